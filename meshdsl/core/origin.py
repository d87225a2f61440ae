"""Where a dim joined a tensor: its producer chain walked back, for error messages.

Elementwise ops broadcast by dim name, so adding a ``[src_seq, d_model]`` table to a
``[batch, tgt_seq, d_model]`` stream silently gives ``[batch, tgt_seq, d_model,
src_seq]``; the mistake only shows at a later op that lists the stream's dims.  That
op's error should point at the op where the dim came in, not suggest keeping it.
"""
from __future__ import annotations

from dataclasses import dataclass

from .graph import Node, Tensor


@dataclass(frozen=True)
class Join:
    """Node ``node`` gave ``stream`` (holding more of the wanted dims) the dim of ``carrier``."""

    node: Node
    stream: Tensor
    carrier: Tensor


def _overlap(t: Tensor, wanted: frozenset[str]) -> int:
    return len(wanted.intersection(t.shape.names))


def dim_joined(t: Tensor, dim: str, wanted) -> Join | None:
    """The node where ``dim`` joined the lineage of ``t`` that holds the ``wanted`` dims.

    Walks from ``t`` to the producer's input that carries ``dim`` and most of
    ``wanted``, until a node reads an input holding more of ``wanted`` than any
    input that carries ``dim``: that node merged the two (an elementwise op's
    broadcast, or an outer product).

    Args:
      t: the tensor that carries ``dim``.
      dim: the unexpected dim's name.
      wanted: the dim names ``t`` was expected to have.

    Returns:
      The :class:`Join`, or None when ``dim`` was there from a leaf or from an op
      that made it (a reshape, ``broadcast_to``): then no broadcast brought it in.
    """
    wanted = frozenset(wanted)
    while True:
        ins = t.node.inputs
        carriers = [x for x in ins if dim in x.shape]
        if not carriers:
            return None
        best = max(carriers, key=lambda x: _overlap(x, wanted))
        others = [x for x in ins if dim not in x.shape]
        stream = max(others, key=lambda x: _overlap(x, wanted), default=None)
        if stream is not None and _overlap(stream, wanted) > _overlap(best, wanted):
            return Join(t.node, stream, best)
        t = best
