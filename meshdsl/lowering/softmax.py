"""Lowering of the fused softmax: fused where its dim is whole, composite where it is split.

``softmax`` and ``softmax_backward`` are one torch kernel each, which needs the softmax's
dim whole on a rank (the dim is ``fixed`` in their spec), so lowered generically a split dim
is gathered first: the whole ``[batch, heads, query, key]`` scores when attention is written
with einsums over a split key dim (a Perceiver's latents over a long input split by ``seq``).
Where the input already arrives split along that dim, the node is lowered as the composite
of the same math instead: ``exp(x - max) / sum(exp(x - max))`` forward (the max and the sum
reduce over the split dim by small allreduces of the other dims) and ``y * (g - sum(g * y))``
backward, built in a sub-graph bound to the node's inputs, as :mod:`.xent` does for the
cross-entropy. The output stays split as its input was; nothing of the split dim moves.
"""
from __future__ import annotations

from ..ops.elementwise import exp, stop_gradient
from ..ops.reduce import reduce_max, reduce_sum
from .composite import lower_composite
from .generic import lower_generic
from .rules import lowering


def composite_softmax(x, dim: str):
    """``softmax(x)`` along ``dim`` from a max, an exp and a sum (``x``'s dims and order)."""
    e = exp(x - stop_gradient(reduce_max(x, dim)))
    return e / reduce_sum(e, dim)


def composite_softmax_backward(g, y, dim: str):
    """The softmax's input gradient ``y * (g - sum(g * y))`` along ``dim`` (``y``'s dims and order)."""
    return y * (g - reduce_sum(g * y, dim))


def _dim_arrives_split(lw, node) -> bool:
    x = node.inputs[-1]   # softmax: its input; softmax_backward: the saved output y
    return bool(lw.sharding(lw.value(x)).axes_of(node.attrs["dim"]))


@lowering("softmax", "softmax_backward")
def lower_softmax(lw, node) -> None:
    if not _dim_arrives_split(lw, node):
        lower_generic(lw, node)
        return
    dim = node.attrs["dim"]
    build = composite_softmax if node.op.name == "softmax" else composite_softmax_backward
    lower_composite(lw, node, lambda *ins: [build(*ins, dim)])
