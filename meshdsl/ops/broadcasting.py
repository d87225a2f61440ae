"""How an operand's dims meet a result's: broadcasting by name, and its undoing in gradients.

An elementwise op or ``broadcast_to`` aligns each operand to the result's dims
(``align_plan`` once when the node is built, ``align`` on every run); the gradient
of a broadcast operand sums the result's gradient back to the operand's dims
(``sum_to``).  ``sum_to`` builds its ``reduce_sum`` and ``transpose`` nodes through
the op table, so the op modules that broadcast need not import the ones that reduce.
"""
from __future__ import annotations

from ..core.graph import Tensor
from ..core.shape import Shape
from .registry import apply


def align_plan(src: Shape, dst: Shape):
    """Index recipe turning a tensor with dims ``src`` into one broadcastable to ``dst``."""
    names = [n for n in dst.names if n in src]
    perm = tuple(src.index(n) for n in names)
    perm = None if perm == tuple(range(len(perm))) else perm
    idx = tuple(slice(None) if n in src else None for n in dst.names)
    idx = None if all(i is not None for i in idx) else idx
    return perm, idx


def align(x, plan):
    """Apply an ``align_plan`` recipe to the torch tensor ``x`` (views only, no copy)."""
    perm, idx = plan
    if perm is not None:
        x = x.permute(perm)
    if idx is not None:
        x = x[idx]
    return x


def sum_to(g: Tensor, like: Tensor) -> Tensor:
    """Sum ``g`` over dims ``like`` lacks, and order its dims like ``like``.

    The same nodes as ``reduce_sum(g, extra)`` then ``transpose(g, like's dims)``,
    whose checks always pass here: ``extra`` are dims of ``g``, and what is left is
    a permutation of ``like``'s dims.
    """
    extra = tuple(n for n in g.shape.names if n not in like.shape)
    if extra:
        g = apply("reduce_sum", [g], {"dims": extra})
    if g.shape.names != like.shape.names:
        g = apply("transpose", [g], {"names": like.shape.names})
    return g
