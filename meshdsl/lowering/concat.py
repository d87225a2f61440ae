"""Lowering of concat: generic where its dim is whole, a sum of pads where it arrives split.

``concat`` runs ``torch.cat``, which needs its dim whole on a rank (the dim is fixed in its
spec), so lowered generically a split dim is gathered first: the whole ``[batch, seq,
d_model]`` patches under ``seq:model`` when a ViT joins a class token before them. Where an
operand arrives split along the dim and the output's layout splits it too, the node is lowered
instead as the composite of the same values: each operand padded with zeros to the output's
length at its place, summed (exact: every element is one operand's value plus zeros). The
pads lower by halo exchanges (:mod:`.window`): a whole operand (the class token) is cut
locally, a split one trades the rows its shift by the operands before it moves across rank
boundaries.
"""
from __future__ import annotations

from ..ops.elementwise import add
from ..ops.slicing import pad
from .composite import lower_composite
from .generic import lower_generic
from .rules import lowering


def composite_concat(xs, dim: str, sizes) -> list:
    """``concat(xs, dim)`` as the sum of each operand padded to its place along ``dim``."""
    total, start, out = sum(sizes), 0, None
    for x, size in zip(xs, sizes):
        placed = pad(x, dim, start, total - start - size)
        out = placed if out is None else add(out, placed)
        start += size
    return [out]


@lowering("concat")
def lower_concat(lw, node) -> None:
    dim = node.attrs["dim"]
    arrives_split = any(lw.sharding(lw.value(t)).axes_of(dim) for t in node.inputs)
    if not arrives_split or not lw.target(node.outputs[0]).axes_of(dim):
        lower_generic(lw, node)
        return
    lower_composite(lw, node, lambda *ins: composite_concat(ins, dim, node.attrs["sizes"]))
