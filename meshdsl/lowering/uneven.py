"""Uneven splits: the dims a layout splits over axes that do not divide them.

By default such a dim is split as ``torch.tensor_split`` cuts it (see
:mod:`meshdsl.layout.sharding`): the first ``size % n`` parts one longer.  Local
sums, maxima and the softmax family over a split dim stay exact without masking
(every element is in exactly one part), and the collectives that join or cut
parts of unequal length carry their lengths (:func:`uneven_arg`).  With strict
splits (``compile(..., strict_splits=True)``, ``--strict-splits``) such a layout
is refused as before.

:func:`find` lists a graph's uneven splits before lowering; the compiler notes
them in the plan (``meshdsl plan`` prints notes) and refuses them when strict.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core.graph import Node
from ..errors import LayoutError, message
from ..layout.layout import Layout, free_axes
from ..layout.mesh import Mesh
from ..layout.sharding import Sharding, is_even, part_sizes
from .pipeline import scan_hint


#: The ops whose tensors a note names (the user's params and inputs); the others it counts.
LEAVES = ("param", "input")


@dataclass(frozen=True)
class UnevenSplit:
    """A dim of ``size`` that a layout rule splits over ``axes``, which do not divide it."""

    dim: str
    size: int
    axes: tuple[str, ...]
    leaves: tuple[str, ...]   # the params and inputs split so
    others: int               # how many other tensors are

    def note(self, mesh: Mesh) -> str:
        """The plan note: the dim, its size, the axes and each rank's part, e.g. for
        vocab 257 on ``model:4``: ``... parts 65, 64, 64, 64 ...``."""
        axes = " x ".join(f"{a}:{mesh.sizes[a]}" for a in self.axes)
        parts = part_sizes(self.size, mesh, mesh.group(0, self.axes), self.axes)
        which = [", ".join(self.leaves)] if self.leaves else []
        which += [f"{self.others} other tensor{'s' * (self.others != 1)}"] if self.others else []
        return (f"uneven split: '{self.dim}' ({self.size}) over {axes}: parts {', '.join(map(str, parts))} "
                f"({' and '.join(which)})")


def _nodes(nodes, nested: bool = False):
    """``(node, nested)`` for ``nodes`` and the nodes of their sub-graphs (a repeat's block),
    ``nested`` where the node is in a sub-graph."""
    for n in nodes:
        yield n, nested
        for graph, _ in n.op.subgraphs(n):
            yield from _nodes(graph.nodes, True)


def find(nodes: list[Node], mesh: Mesh, layout: Layout, strict: bool, stage_layers=None) -> list[UnevenSplit]:
    """The uneven splits the layout's rules make on the tensors of ``nodes``.

    Raises:
      LayoutError: several params or inputs with two dims on one mesh axis, all named
        (:meth:`Layout.check_leaves`); with ``strict``, at the first uneven split (see :meth:`Layout.check_even`);
        for the outermost repeat's layer dim split unevenly (its layers run in equal runs per rank),
        unless ``stage_layers`` gives each pipeline stage its layers (:mod:`.stage_layers`).  A repeat
        inside a block (a recurrence over ``seq``) gathers its scanned dim, even or uneven
        (:mod:`.repeat`): its split is noted like any other.
    """
    layout.check_leaves([(t.name, t.shape, t.scopes) for n in nodes if n.op.name in LEAVES for t in n.outputs], mesh)
    found: dict[tuple, list] = {}   # (dim, size, axes) -> the tensors split so
    layers = {}   # the layer dim of a repeat outside any block -> the repeat node
    for t, nested in ((t, nested) for n, nested in _nodes(nodes) for t in n.outputs):
        if t.node.op.name == "repeat" and not nested:
            layers[t.node.attrs["layer"].name] = t.node
        if strict:
            layout.check_even(t.shape, t.scopes, mesh, t.name, intermediate=t.node.op.name not in LEAVES)
            continue
        for name, rule in layout.wanted(t.shape, t.scopes).items():
            axes = tuple(a for a in rule.axis_names if mesh.sizes[a] > 1)
            size = t.shape.get(name).size
            # (a part with nothing in it is Layout.targets' refusal, with the tensor that has it)
            if not is_even(size, mesh, axes) and size >= mesh.axis_size(axes):
                found.setdefault((name, size, axes), []).append(t)
    out = []
    for (d, size, axes), ts in found.items():
        if d in layers and stage_layers is None:
            _refuse_layers(layout, mesh, (d, size, axes), layers[d], ts, scan_hint(nodes, layers[d], axes[0], layout))
        if d in layers:   # cut at the stages' layer counts instead (lowering/stage_layers.py)
            continue
        leaves = tuple(dict.fromkeys(t.name for t in ts if t.node.op.name in LEAVES))
        out.append(UnevenSplit(d, size, axes, leaves, sum(t.node.op.name not in LEAVES for t in ts)))
    return out


def _refuse_layers(layout: Layout, mesh: Mesh, split: tuple, repeat: Node, tensors: list, hint: tuple = ()):
    """Raise: the layer dim of a repeat split unevenly (a stage or loop runs whole layers, as many
    on each rank), ``split`` its ``(name, size, axes)``, or a dim of that name and another size in
    ``tensors`` (a recurrence's 8 steps over ``seq`` sliced from 9); ``hint``:
    :func:`~.pipeline.scan_hint`'s bullet and fix where the repeat scans a dim of the inputs (a
    recurrence over ``seq`` split for sequence parallelism)."""
    dim, size, axes = split
    rule = next((r for r in layout.rules if r.key[1] == dim), None)
    where = {"source": layout.source if rule else None, "span": rule.span if rule else None}
    over = f"mesh axes {' x '.join(f'{a}:{mesh.sizes[a]}' for a in axes)} (= {mesh.axis_size(axes)})"
    num_layers = repeat.attrs["layer"].size
    named = [t for t in tensors if t.node.op.name in LEAVES] or tensors   # the user's params and inputs first
    raise LayoutError(message(
        f"compile: repeat '{repeat.name}' has {size} layers (dim '{dim}'), which {over} do not divide."
        if size == num_layers else
        f"compile: dim '{dim}' ({size}) of {', '.join(list(dict.fromkeys(repr(t.name) for t in named))[:3])}, the dim "
        f"repeat '{repeat.name}' scans ({num_layers} layers), is split over {over}, which do not divide it.",
        **where, inputs=[f"mesh: {mesh}"], bullets=list(hint[:1]),
        rule="a repeat's layers are split into equal runs of whole layers (pipeline stages): uneven "
             "splits are for other dims",
        fix=(f"{hint[1]}; or, to pipeline the steps, " if hint else "") +
            f"use a {'layer count' if size == num_layers else 'size'} that is a multiple of "
            f"{mesh.axis_size(axes)}{', or other axes' if free_axes(mesh, axes) else ''}; a pipeline "
            f"can take each stage's layers instead (stage_layers=, --stage-layers N,N,.. or auto)"))


def uneven_arg(shape, before: Sharding, after: Sharding, mesh: Mesh, axes) -> tuple | None:
    """The ``uneven`` arg of a collective over ``axes`` from ``before`` to ``after``, or None.

    For each dim whose parts differ in length across a group over ``axes`` (a dim
    split over ``axes`` at its minor end, before or after), ``(position, size,
    above)``: its global size and the axes that split it above ``axes``.  A
    communicator works out each member's length from them
    (:func:`meshdsl.collectives.parts_of`).
    """
    if not axes:
        return None
    out = []
    for pos, d in enumerate(shape):
        for sh in (before, after):
            split = sh.axes_of(d.name)
            k = len(split) - len(axes)
            if k >= 0 and split[k:] == tuple(axes) and not is_even(d.size, mesh, split):
                out.append((pos, d.size, split[:k]))
                break
    return tuple(out) or None
