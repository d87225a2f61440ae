"""Lowering of the fused cross-entropy: fused where the class dim is whole, composite where split.

With the class dim (``vocab``) whole on a rank, as its layout and the logits'
sharding leave it, ``cross_entropy`` and its backward lower as any op
(:func:`~.generic.lower_generic`): one fused kernel each.  A layout that splits
it (Megatron's vocab-parallel loss) would make the fused kernel gather the
logits; instead the node is lowered as the composite of the same math
(:func:`meshdsl.ops.xent.composite_forward` / ``composite_backward``), built in a
sub-graph whose inputs (``placeholder`` ops, as a repeat's block has) are bound to
the node's inputs, in the node's phase: its max, sums and
picked logits reduce over the split dim by small allreduces, and the backward is
elementwise, so the logits are never gathered.
"""
from __future__ import annotations

from ..ops.xent import composite_backward, composite_forward
from .composite import lower_composite
from .generic import lower_generic
from .rules import lowering


def _class_dim_split(lw, node) -> bool:
    logits, dim = node.inputs[0], node.attrs["dim"]
    return bool(lw.sharding(lw.value(logits)).axes_of(dim) or lw.target(logits).axes_of(dim))


@lowering("cross_entropy", "cross_entropy_backward")
def lower_cross_entropy(lw, node) -> None:
    if not _class_dim_split(lw, node):
        lower_generic(lw, node)
        return
    dim = node.attrs["dim"]
    if node.op.name == "cross_entropy":
        lower_composite(lw, node, lambda *ins: composite_forward(*ins, dim))
    else:
        lower_composite(lw, node, lambda *ins: [composite_backward(*ins, dim)])
