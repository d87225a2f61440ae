"""Lowering a fused node as the composite of the same math, where a split dim would gather.

A fused op (cross-entropy, softmax, attention) runs one torch kernel that needs some dim whole
on a rank.  Where a layout splits that dim, :mod:`.xent`, :mod:`.softmax` and :mod:`.attention`
lower the node instead as a sub-graph of primitives whose reductions over the split dim are
small allreduces: :func:`lower_composite` builds that sub-graph in the node's phase and scope
(its inputs are ``placeholder`` ops, as a repeat's block has, bound to the node's inputs),
lowers each of its nodes by its own rule, and binds the node's outputs to the sub-graph's.
A sub-graph node identical to one of the enclosing graph already lowered (the same deterministic
op on the same tensors: the composite cross-entropy's logsumexp beside the user's own
``logits - logsumexp(logits)``) takes that node's values instead, so the max and sum over the
split dim are reduced once, as the dense program would compute them once if written so.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from ..core.graph import Graph, Tensor, topo_nodes
from ..ops.leaf import placeholder
from .rules import rule_for


def lower_composite(lw, node, build: Callable[..., Sequence[Tensor]], inputs=None) -> None:
    """Lower ``node`` as ``build(*inputs)``: the sub-graph's outputs, one per output of ``node``;
    ``inputs``: the tensors it is built from, ``node.inputs`` unless given (a per-part concat's
    source, :mod:`.concat`)."""
    inputs = list(node.inputs if inputs is None else inputs)
    g = Graph(f"{node.graph.name}/{node.op.name}")
    with g, g.in_phase(node.phase), g.scope(node.op.name):
        ins = [placeholder(f"in{i}", t.shape, t.dtype, t.scopes) for i, t in enumerate(inputs)]
        outs = list(build(*ins))
    for p, t in zip(ins, inputs):
        lw.bind(p, lw.value(t))
    _share_lowered(lw, node, g, ins, inputs)
    lw.count_readers(outs)
    for n in topo_nodes(outs, lw.env):
        rule_for(n.op.name)(lw, n)
    for t, o in zip(node.outputs, outs):
        lw.bind(t, lw.value(o))


def _share_lowered(lw, node, sub: Graph, ins, inputs) -> None:
    """Bind each node of ``sub`` that ``node``'s graph has already built and lowered (a ``cse``
    op of the same tensors, attrs and phase: :meth:`Graph.built`) to that node's values."""
    outer = {id(p): t for p, t in zip(ins, inputs)}   # sub-graph tensor -> enclosing one
    for n in sub.nodes:
        if not n.op.cse or any(id(x) not in outer for x in n.inputs):
            continue
        twin = node.graph.built(n.op, [outer[id(x)] for x in n.inputs], n.attrs, n.phase)
        if twin is None or any(id(o) not in lw.env for o in twin.outputs):
            continue
        for o, t in zip(n.outputs, twin.outputs):
            outer[id(o)] = t
            lw.bind(o, lw.value(t))
