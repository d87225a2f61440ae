"""Layout rules that reshapes imply: a dim a reshape makes inherits the split of its source.

A merge ``[height, width] -> [(height width)]`` whose outermost part (of size > 1) is
split keeps that split on the merged dim without moving data, and a split
``height -> [hp, ph]`` keeps it on the outer factor (:mod:`.reshape`).  Mesh-TF asks
the layout to say so (``height:data; height_width:data``); here a dim that no written
rule names gets the split its reshape carries over, as an *implied* rule:

* ``height:data`` alone implies ``height_width:data`` (``from height``), and
  ``hp:data`` for ``height = (hp ph)``; ``height:(x,y)`` implies ``hp:x; ph:y``
  where ``x`` fills ``hp``;
* a rename of a dim whose rule is implied passes it on (a patchify's
  ``hp_wp`` renamed ``patches``); a rename of a dim the user split does not: a
  rename is how a layout moves a split (Mesh-TF's expert parallelism);
* chains of reshapes are followed to a fixpoint.

Only the forward graph is read (repeat blocks included): the backward's reshapes
map the new dims back and then find both sides split, so they move nothing.  An
implied rule is global: none is made for a dim with a written global rule, and a
written scoped rule (``params.hw:fsdp``) still wins for its tensors.  It ranks after
every written rule where two dims of a tensor contend for an axis, and none is made
where its axes would not divide the dim or would split two dims of a param or input
(those layouts are errors).  The plan lists each implied rule in its notes.
"""
from __future__ import annotations

from functools import cached_property

from ..core.names import Name
from ..errors import LayoutError
from ..layout.layout import Layout
from ..layout.specs import Rule
from .reshape import Regroup

RESHAPES = ("reshape", "rearrange")
LEAVES = ("param", "input", "placeholder")


class _Graph:
    """What the derivation reads of a graph: its forward reshapes and renames in build
    order, its leaves (params, inputs, a block's placeholders), every size of each dim."""

    def __init__(self, nodes):
        self.movers, self.leaves, self.nodes = [], [], []
        self._walk(nodes, forward=True)

    def _walk(self, nodes, forward: bool) -> None:
        for n in nodes:
            fwd = forward and n.phase == "forward"
            if fwd and n.op.name in RESHAPES + ("rename",):
                self.movers.append(n)
            if n.op.name in LEAVES:
                self.leaves.append(n.outputs[0])
            self.nodes.append(n)
            for graph, _ in n.op.subgraphs(n):
                self._walk(graph.nodes, fwd)

    @cached_property
    def sizes(self) -> dict[str, set[int]]:
        out: dict[str, set[int]] = {}
        for n in self.nodes:
            for t in n.outputs:
                for d in t.shape:
                    out.setdefault(d.name, set()).add(d.size)
        return out


def implied_layout(nodes, mesh, layout: Layout) -> Layout:
    """``layout`` with the rules the forward graph's reshapes imply (see the module docstring).

    Args:
      nodes: the graph's nodes (those the plan computes), in build order.
      mesh: the mesh (a ``Mesh``).
      layout: the written layout.

    Returns:
      ``layout.with_implied(...)``; ``layout`` itself where nothing is implied.
    """
    g = _Graph(nodes)
    if not any(n.op.name in RESHAPES for n in g.movers):
        return layout
    named = {r.key[1] for r in layout.rules if r.key[0] is None}
    implied: dict[str, tuple[Rule, str]] = {}
    grew = True
    while grew:   # each pass adds a rule or ends; a dim gets at most one
        grew = False
        for node in g.movers:
            cur = layout.with_implied(tuple(implied.values()))
            for dim, axes, src in _carried(node, mesh, cur, implied):
                if dim in named or dim in implied or not _fits(dim, axes, g, mesh, cur):
                    continue
                rule = Rule(None, Name(dim, None), tuple(Name(a, None) for a in axes))
                implied[dim] = (rule, f"implied by {node.op.name}: {rule} (from {src})")
                cur = layout.with_implied(tuple(implied.values()))
                grew = True
    return layout.with_implied(tuple(implied.values()))


def _carried(node, mesh, layout: Layout, implied: dict):
    """``(dim, axes, source dims)`` for each new output dim of ``node`` that its input's split reaches."""
    t, out = node.inputs[0], node.outputs[0]
    if node.op.name == "rename":   # only an implied split: a written one is moved by the rename
        for old, new in node.attrs["mapping"].items():
            if old in implied:
                yield new, implied[old][0].axis_names, old
        return
    try:
        split = layout.targets(t.shape, t.scopes, mesh, t.name, False)[0][0].split
    except LayoutError:
        return   # a written rule that does not fit: the lowering reports it
    if not split:
        return
    got = Regroup.of(node).map(mesh, dict(split), "drop")[-1]
    for d in out.shape:
        axes = got.get(d.name)
        if axes and d.name not in t.shape.names:   # a dim the reshape made, not one it passes through
            yield d.name, axes, ", ".join(n for n, ax in split.items() if set(ax) & set(axes))


def _fits(dim: str, axes, g: _Graph, mesh, layout: Layout) -> bool:
    """Whether ``dim:axes`` divides every size ``dim`` has and leaves each param and input
    with every axis on one dim at most."""
    n = mesh.axis_size(axes)
    if any(size % n for size in g.sizes.get(dim, ())):
        return False
    for t in g.leaves:
        if dim not in t.shape.names or layout.rule_for(dim, t.scopes) is not None:
            continue   # (a written scoped rule places that tensor's dim)
        for other, r in layout.wanted(t.shape, t.scopes).items():
            if other != dim and set(r.axis_names) & set(axes):
                return False
    return True
