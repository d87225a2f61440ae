"""Lowering of argmax/argmin: torch's kernel where the dim is whole, reductions where it is split.

The kernel needs the searched dim whole on a rank (``fixed`` in the op's spec), so lowered
generically a split dim would be gathered: the whole ``[batch, seq, vocab]`` logits of a greedy
decode over a vocab-split head.  Where the input arrives split along that dim, the node is
lowered as the composite of the same answer, as :mod:`.softmax` does: the extreme (an allreduce
max or min of the other dims), each position's index where it holds the extreme, else the dim's
size, and their minimum (an allreduce min of int64): the first extreme, as torch's kernel picks
on a tie.  A NaN counts as the extreme, as in torch's kernel (the allreduce propagates it).
"""
from __future__ import annotations

from ..ops.elementwise import equal, logical_or, not_equal, where
from ..ops.embed import iota
from ..ops.reduce import reduce_max, reduce_min
from .composite import lower_composite
from .generic import lower_generic
from .rules import lowering


def composite_arg_extreme(x, dim: str, largest: bool):
    """``argmax`` (``largest``) or ``argmin`` of ``x`` along ``dim`` from reductions (``x``'s
    other dims, in their order)."""
    extreme = (reduce_max if largest else reduce_min)(x, dim)
    hit = equal(x, extreme)
    if x.dtype.is_floating_point:
        hit = logical_or(hit, not_equal(x, x))   # a NaN is the extreme, and the extreme is then NaN
    d = x.shape.get(dim)
    return reduce_min(where(hit, iota(d), d.size), dim)


@lowering("argmax", "argmin")
def lower_argmax(lw, node) -> None:
    dim = node.attrs["dim"]
    if not lw.sharding(lw.value(node.inputs[0])).axes_of(dim):
        lower_generic(lw, node)
        return
    largest = node.op.name == "argmax"
    lower_composite(lw, node, lambda x: [composite_arg_extreme(x, dim, largest)])
