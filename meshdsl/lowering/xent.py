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

from ..core.graph import Graph, topo_nodes
from ..ops.leaf import placeholder
from ..ops.xent import composite_backward, composite_forward
from .generic import lower_generic
from .rules import lowering, rule_for


def _class_dim_split(lw, node) -> bool:
    logits, dim = node.inputs[0], node.attrs["dim"]
    return bool(lw.sharding(lw.value(logits)).axes_of(dim) or lw.target(logits).axes_of(dim))


@lowering("cross_entropy", "cross_entropy_backward")
def lower_cross_entropy(lw, node) -> None:
    if not _class_dim_split(lw, node):
        lower_generic(lw, node)
        return
    dim = node.attrs["dim"]
    g = Graph(f"{node.graph.name}/{node.op.name}")
    with g, g.in_phase(node.phase), g.scope(node.op.name):
        ins = [placeholder(f"in{i}", t.shape, t.dtype, t.scopes) for i, t in enumerate(node.inputs)]
        if node.op.name == "cross_entropy":
            outs = list(composite_forward(*ins, dim))
        else:
            outs = [composite_backward(*ins, dim)]
    for p, t in zip(ins, node.inputs):
        lw.bind(p, lw.value(t))
    lw.count_readers(outs)
    for n in topo_nodes(outs, lw.env):
        rule_for(n.op.name)(lw, n)
    for t, o in zip(node.outputs, outs):
        lw.bind(t, lw.value(o))
