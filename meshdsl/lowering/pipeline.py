"""Pipeline detection: which mesh axis (if any) a layout makes a pipeline, and micro-batches.

A layout rule ``layer:<axis>`` on the layer dim of a ``repeat`` makes ``<axis>`` a
pipeline axis: each rank of it holds ``layers / p`` consecutive layers.  Nothing
else may be split over that axis.  Several stacks (an encoder-decoder's, each scanning a
layer dim of its own name) may share it: the stages then cut the stacks' layers one after
another (:func:`stack_counts`, :attr:`PipeSpec.stacks`), into ``p * v`` virtual stages with
``interleaved:v``.

Micro-batches are a virtual mesh axis: the plan is lowered on the user's mesh plus
an axis :data:`MB_AXIS` of size ``m`` (minor), with the ``batch`` dim split over it
first.  Local shapes are then those of one micro-batch, and everything summed over
the batch (the loss, weight gradients) stays a partial sum over :data:`MB_AXIS`
until a collective reduces it: gradient accumulation, exactly.  A process holds all
``m`` virtual ranks of its coordinate (the simulated mesh holds every rank anyway).
:mod:`.partition` then cuts the plan into what runs per micro-batch on each stage
and what runs once.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core.examples import BATCH, examples_dim_of
from ..core.names import Name
from ..errors import LayoutError, MeshError, message
from ..layout.layout import Layout, free_axes
from ..layout.mesh import Mesh
from ..layout.specs import Rule
from .schedule_gen import named_schedule, parse_schedule
from .schedule import Schedule, ScheduleError
from .plan import MB_AXIS, varies_by_microbatch  # noqa: F401  (both read from here too)
from .stage_layers import check_counts


@dataclass(frozen=True)
class PipeSpec:
    """A pipelined compilation: the stage axis, the micro-batches and the schedule.

    Attributes:
      axis: the pipeline mesh axis, or None when only micro-batches are asked for.
      num_stages: its size p (1 without a pipeline).
      num_microbatches: m.
      node: id of the pipelined repeat node (-1 without a pipeline).
      layer: the repeat's layer dim name.
      schedule: the validated schedule (None without a pipeline).
      mesh, layout: what the plan is lowered on (with :data:`MB_AXIS` when m > 1).
      given: the user's (mesh, layout), for messages.
      stage_layers: layers per stage when not equal (:mod:`.stage_layers`), else (); with virtual
        stages, per virtual stage (``p * v`` counts in layer order: stage s is chunk ``s // p``
        of rank ``s % p``).
      stacks: with more than one pipelined repeat (an encoder-decoder), each as ``(node id, layer dim
        name, counts)`` in graph order, ``counts`` its layers on each stage (0 outside its run of
        stages; with virtual stages, on each of the ``p * v``): the stages cut the stacks' layers
        one after another (:func:`stack_counts`); else ().
        ``node`` and ``layer`` are then the first stack's, and ``stage_layers`` is ().
      examples: the dim the micro-batches cut: ``batch``, or the user's name for the examples'
        dim read off the graph (:func:`~meshdsl.core.examples.examples_dim`: ``B``, ``N``, ...).
      scan_hint: where the pipelined repeat scans a dim of the inputs (a recurrence over ``seq``),
        a refusal's ``(bullet, fix)`` for a user who meant sequence parallelism (:func:`scan_hint`).
    """

    axis: str | None
    num_stages: int
    num_microbatches: int
    node: int
    layer: str
    schedule: Schedule | None
    mesh: Mesh
    layout: Layout
    given: tuple = ()
    stage_layers: tuple = ()
    stacks: tuple = ()
    examples: str = BATCH
    scan_hint: tuple = ()


def per_microbatch(step, values) -> bool:
    """Whether plan step ``step`` computes something else for each micro-batch: one of its
    values is split or partial along :data:`MB_AXIS`, or it moves one micro-batch's carry
    (``send``/``recv``).  Otherwise a process runs it once for all its micro-batches
    (``runtime/steps.py`` ``representatives``; the cost model prices it so)."""
    return step.kind in ("send", "recv") or varies_by_microbatch(step, values)


def _err(what, *, mesh, layout, rule, fix, bullets=None, cls=LayoutError):
    return cls(message(f"compile: {what}", inputs=[f"mesh: {mesh}", f"layout: {layout}"], bullets=bullets,
                       rule=rule, fix=fix))


def _check_count(what: str, n) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise MeshError(message(f"compile: {what} = {n!r}.", rule=f"{what} is a positive integer",
                                fix=f"pass e.g. {what}=4"))


def detect(nodes, mesh: Mesh, layout: Layout, dims: dict[str, int], microbatches: int = 1,
           schedule: str = "gpipe", stage_layers=None) -> PipeSpec | None:
    """The pipeline a layout asks for, or None for a plain program.

    ``schedule`` names a generator of :mod:`.schedule_gen`; ``"interleaved:v"`` runs v virtual
    stages per rank (:mod:`.interleave`).  ``stage_layers`` gives each stage's layer count
    (:mod:`.stage_layers`; with ``interleaved:v``, each of the ``p * v`` virtual stages', in layer
    order); None splits the layers evenly.  With several pipelined stacks (distinct layer dims on
    one axis) ``stage_layers`` counts each stage's layers of the stacks joined in graph order.

    Raises:
      LayoutError: ``layer`` split over two axes, stacked params of one repeat split
        differently, two pipelined repeats over one layer dim or over two axes, a pipeline axis
        that also splits another
        dim, a ``layer`` rule with no repeat scanning that dim, a batch that the
        micro-batches (times the batch's axes) do not divide, virtual stages that do not
        divide the layers of a rank (without ``stage_layers``), bad ``stage_layers`` (a wrong
        count of entries, one below 1, a sum other than the layers).
      ScheduleError: an unknown schedule, or sizes its generator refuses.
    """
    _check_count("microbatches", microbatches)
    if MB_AXIS in mesh.sizes:
        raise MeshError(message(f"compile: mesh axis '{MB_AXIS}' is reserved.", inputs=[f"mesh: {mesh}"],
                                rule=f"'{MB_AXIS}' is the virtual micro-batch axis", fix="rename that axis"))
    layout = layout.with_empty_parts(_stack_dims(nodes, mesh, layout))
    found, scanned = _pipelined_repeats(nodes, mesh, layout)
    # several top-level repeats over one dim of the inputs (a bi-GRU's two directions over 'src') are
    # recurrences too, not stacks wanting layer dims of their own
    one_dim = len({n.attrs["layer"].name for n, _ in found}) == 1
    hint = scan_hint(nodes, *found[0], layout) if found and one_dim else ()
    _check_layer_rules(mesh, layout, found, scanned, hint)
    node, axis = found[0] if found else (None, None)
    # A layer dim split over axes of size 1 is whole: a pipeline of one stage is no pipeline.
    trivial = [r for r in layout.rules if r.key[1] in scanned and r.axis_names and mesh.axis_size(r.axis_names) == 1]
    if trivial:
        layout = Layout(tuple(r for r in layout.rules if r not in trivial), source=layout.source,
                        empty_ok=layout.empty_ok)
    # read off the graph with one micro-batch too: what varies per micro-batch (and so runs in the
    # stages' F and B actions, not once before them) is what the examples' dim reaches
    examples = examples_dim_of(nodes)
    if len(found) > 1:
        return _several_stacks(found, mesh, layout, dims, microbatches, schedule, stage_layers, examples)
    if axis is None and stage_layers is not None:
        _stage_layers(stage_layers, None, 1, 1, mesh, layout)   # refused: no pipeline
    if axis is None and microbatches == 1:
        return PipeSpec(None, 1, 1, -1, "", None, mesh, layout, (mesh, layout)) if trivial else None
    chunks = parse_schedule(schedule)[1]
    p = mesh.sizes[axis] if axis else 1
    mesh2, layout2 = _with_microbatches(mesh, layout, dims, microbatches, examples)
    sched = None
    if axis:
        if stage_layers is None:   # given counts need not divide evenly
            _check_chunks(node, p, chunks, mesh, layout)
        sched = named_schedule(schedule, p, microbatches)
    counts = _stage_layers(stage_layers, node, p, chunks, mesh, layout)
    return PipeSpec(axis, p, microbatches, node.id if node else -1, node.attrs["layer"].name if node else "",
                    sched, mesh2, layout2, (mesh, layout), counts, examples=examples or BATCH, scan_hint=hint)


def scan_hint(nodes, node, axis: str, layout: Layout) -> tuple[str, str] | tuple[()]:
    """``(bullet, fix)`` for a refusal of a layout that pipelines repeat ``node`` over ``axis``
    where the dim it scans is also a dim of the graph's inputs: the repeat steps along the data (a
    CRF's forward algorithm or an RNN over ``seq``), and ``seq:model`` asked for sequence
    parallelism, not for stages each running a run of the steps; else ``()``.  The fixes keep the
    rest of the model split: an inner repeat gathers the dim it scans (:mod:`.repeat`), and a renamed
    dim is one the layout does not split."""
    dim = node.attrs["layer"].name
    if not any(n.op.name == "input" and dim in n.outputs[0].shape.names for n in nodes):
        return ()
    rule = layout.rule_for(dim, ())
    return (f"'{rule or dim}' splits '{dim}', the dim the outermost repeat '{node.name}' scans "
            f"({node.attrs['layer'].size} steps): that makes '{axis}' its pipeline axis, each rank running "
            "its own run of the steps, not sequence parallelism",
            f"for sequence parallelism make the recurrence an inner repeat, which gathers '{dim}' and runs every "
            f"step on each rank while the rest stays split: md.repeat(lambda c, _: md.repeat(step, c, stacked, "
            f"'{dim}'), x, {{}}, md.Dim('once', 1)); or scan a dim the layout leaves whole "
            f"(md.rename(t, {dim}='step') for the stacked tensors, md.repeat(..., 'step'))")


def _stage_layers(stage_layers, node, p: int, chunks: int, mesh: Mesh, layout: Layout) -> tuple:
    """The checked per-stage layer counts, or () for equal stages."""
    if stage_layers is None:
        return ()
    if isinstance(stage_layers, str):
        raise _err(f"stage_layers={stage_layers!r} is a string.", mesh=mesh, layout=layout,
                   rule="compile takes one layer count per stage; the cost model's balanced split is "
                        "md.balance_stages (--stage-layers auto)",
                   fix="pass e.g. stage_layers=(3, 5), or stage_layers=md.balance_stages(outputs, mesh, layout, "
                       "microbatches=..., schedule=...)")
    if node is None or p == 1:
        raise _err(f"stage_layers={stage_layers!r} given, but no repeat is pipelined.", mesh=mesh, layout=layout,
                   rule="stage_layers cuts a pipelined repeat's layers into stages",
                   fix="split the layer dim over a stage axis ('layer:stage'), or leave out stage_layers")
    counts = check_counts(stage_layers, node.attrs["layer"].size, p, mesh, layout, chunks)
    return () if len(set(counts)) == 1 else counts


def _stack_dims(nodes, mesh: Mesh, layout: Layout) -> frozenset:
    """The layer dims of repeats whose rules put them on one mesh axis (of size > 1) with another
    repeat's: several stacks on one stage axis, where a stage cut may leave a stack none of its
    layers on some stages (a stack of fewer layers than stages), so their splits may have empty
    parts there (:meth:`~meshdsl.layout.layout.Layout.with_empty_parts`)."""
    on: dict[str, set] = {}
    for n in nodes:
        if n.op.name == "repeat":
            r = layout.rule_for(n.attrs["layer"].name, ())
            axes = tuple(a for a in r.axis_names if mesh.sizes.get(a, 1) > 1) if r is not None else ()
            if len(axes) == 1:
                on.setdefault(axes[0], set()).add(n.attrs["layer"].name)
    return frozenset(d for dims in on.values() if len(dims) > 1 for d in dims)


def _pipelined_repeats(nodes, mesh: Mesh, layout: Layout) -> tuple[list, set]:
    """The repeats whose stacked params split their layer dim over one mesh axis of size > 1,
    as ``(node, axis)``, and the layer dims of every repeat."""
    found, scanned = [], set()
    for n in nodes:
        if n.op.name != "repeat":
            continue
        layer = n.attrs["layer"].name
        scanned.add(layer)
        per = {}
        for k, p in n.attrs["stacked"].items():
            sh = layout.targets(p.shape, p.scopes, mesh, p.name, True)[0][0]
            per[k] = sh.axes_of(layer)
        kinds = set(per.values())
        if len(kinds) > 1:
            raise _err(f"repeat '{n.name}': its stacked params split '{layer}' differently.", mesh=mesh,
                       layout=layout, bullets=[f"'{k}': {a or 'whole'}" for k, a in per.items()],
                       rule="every stacked param of a pipelined repeat splits its layer dim over the same axis",
                       fix=f"write one unscoped rule '{layer}:<axis>'")
        axes = next(iter(kinds), ())
        if len(axes) > 1:
            raise _err(f"repeat '{n.name}': dim '{layer}' is split over {len(axes)} mesh axes {axes}.",
                       mesh=mesh, layout=layout, rule="a pipeline runs over one mesh axis",
                       fix=f"map '{layer}' to one axis, e.g. '{layer}:{axes[0]}'")
        if axes and mesh.axis_size(axes) > 1:
            found.append((n, axes[0]))
    return found, scanned


def _shared_fix(found: list) -> str | None:
    """The fix when two pipelined repeats read the same stacked tensors (one encoder applied to
    two inputs, as a siamese or ColBERT encoder): their own layer dims would need two copies of
    the weights. None when they share none."""
    seen: dict[int, str] = {}
    for n, _ in found:
        layer = n.attrs["layer"].name
        for t in n.inputs:
            if layer in t.shape.names and id(t) in seen and seen[id(t)] != n.name:
                return (f"the repeats read the same stacked tensor '{t.name}' (one stack of weights applied "
                        "twice): run it as one md.repeat over both inputs joined on the batch dim (padded to one "
                        "length), or pipeline neither (drop the layer rule) and split other dims")
            seen.setdefault(id(t), n.name)
    return None


def _check_layer_rules(mesh: Mesh, layout: Layout, found: list, scanned: set, hint: tuple = ()) -> None:
    """Refuse a ``layer`` rule no repeat scans, a second pipelined repeat over the same layer dim
    or over another axis, and a pipeline axis that splits a dim other than the stacks' layer dims
    (with ``hint``, :func:`scan_hint`'s bullet and fix for a repeat over a dim of the inputs)."""
    for r in layout.rules:
        dim = r.key[1]
        if dim == "layer" and dim not in scanned and r.axis_names:
            raise _err(f"layout rule '{r}' splits dim 'layer', which no repeat scans over.", mesh=mesh,
                       layout=layout, rule="a 'layer:<axis>' rule makes a pipeline of a repeat over 'layer'",
                       fix="stack the blocks with md.repeat(..., 'layer'), or drop the rule")
    if len(found) > 1:
        dims = sorted({n.attrs["layer"].name for n, _ in found})
        axes = sorted({a for _, a in found})
        if len(dims) < len(found) or len(axes) > 1:
            raise _err("more than one repeat is pipelined" + (" over one layer dim." if len(axes) == 1 else
                                                              f" over {len(axes)} mesh axes."),
                       mesh=mesh, layout=layout,
                       bullets=[f"repeat '{n.name}' over '{a}': its {n.attrs['layer'].size} layers scan dim "
                                f"'{n.attrs['layer'].name}'" for n, a in found] + list(hint[:1]),
                       rule="the stacks of a model (an encoder-decoder's) are pipelined on one stage axis, each "
                            "scanning a layer dim of its own name",
                       fix=(hint[1] if hint else _shared_fix(found) or
                            "give each stack a layer dim of its own name (md.Dim('enc_layer', n) for the encoder's "
                            "params and its md.repeat) and split both over the stage axis ('enc_layer:"
                            f"{found[0][1]}; {dims[0]}:{found[0][1]}')") if len(dims) < len(found) else
                           f"map every stack's layer dim to one axis, e.g. "
                           f"'{'; '.join(f'{d}:{axes[0]}' for d in dims)}'")
    if found:
        axis = found[0][1]
        layers = {n.attrs["layer"].name for n, _ in found}
        for r in layout.rules:
            if axis in r.axis_names and r.key[1] in scanned and r.key[1] not in layers:
                raise _unsplit_stack(r, axis, layers, mesh, layout)
            if axis in r.axis_names and r.key[1] not in layers:
                # The rule that made the axis a pipeline axis: a scoped one ('params.layer:data') reads as
                # FSDP by layer, which is not what it does.
                via = next((q for q in layout.rules if q.key[1] in layers and axis in q.axis_names), None)
                scoped = via is not None and via.key[0] is not None
                raise _err(f"layout rule '{r}' uses the pipeline axis '{axis}'.", mesh=mesh, layout=layout,
                           bullets=[f"'{via}' makes '{axis}' a pipeline axis: a rule that splits a repeat's layer dim "
                                    "pipelines its layers over the stages" +
                                    (", whatever its scope (a stack's params are not sharded by layer)" if scoped
                                     else "")] if via is not None and not hint else list(hint[:1]),
                           rule=f"a pipeline axis splits only the layer dim ({', '.join(map(repr, sorted(layers)))})",
                           fix=(f"{hint[1]}; or, to pipeline the steps, " if hint else "") +
                               _off_stage_axis(r, axis, mesh) +
                               (f", or for FSDP drop '{via}' and shard the params along another dim "
                                f"('params.d_model:{axis}')" if scoped else ""))


def _off_stage_axis(r: Rule, axis: str, mesh: Mesh) -> str:
    """The fix that takes rule ``r``'s dim off the pipeline axis: another axis where the mesh has
    one, else the dim kept whole (``stage:2`` alone has no other axis)."""
    head = f"{r.key[0]}.{r.key[1]}" if r.key[0] else r.key[1]
    free = free_axes(mesh, (axis,))
    if free:
        return f"map '{r.key[1]}' to another axis, e.g. '{head}:{free[0]}'"
    return f"keep '{r.key[1]}' whole: " + (f"write '{head}:()' in place of '{r}'" if r.key[0] else f"drop '{r}'")


def _unsplit_stack(r: Rule, axis: str, layers: set, mesh: Mesh, layout: Layout) -> LayoutError:
    """A rule on the layer dim of a repeat that is not pipelined with the others: its stacked params
    keep that dim whole (a stack of one layer: a dim of size 1 is never split)."""
    dim = r.key[1]
    return _err(f"layout rule '{r}': the repeat over '{dim}' is not pipelined over '{axis}' with "
                f"{', '.join(map(repr, sorted(layers)))}.", mesh=mesh, layout=layout,
                bullets=[f"'{dim}' stays whole in its stacked params (as a one-layer stack's does: a dim of size 1 "
                         "is never split)"],
                rule="every stack pipelined on a stage axis has its layer dim split over it",
                fix=f"give the stack over '{dim}' at least 2 layers, or drop '{r}' (it then runs whole on "
                    "the stage that reads it)")


def _several_stacks(found: list, mesh: Mesh, layout: Layout, dims: dict[str, int], microbatches: int,
                    schedule: str, stage_layers, examples: str | None) -> PipeSpec:
    """The pipeline of several stacks on one stage axis (:func:`stack_counts` cuts their layers)."""
    axis = found[0][1]
    p, chunks = mesh.sizes[axis], parse_schedule(schedule)[1]
    if isinstance(stage_layers, str):
        _stage_layers(stage_layers, found[0][0], p, 1, mesh, layout)   # refused: a string
    sizes = [n.attrs["layer"].size for n, _ in found]
    counts = stack_counts(sizes, stage_layers, p, mesh, layout, chunks)
    mesh2, layout2 = _with_microbatches(mesh, layout, dims, microbatches, examples)
    node = found[0][0]
    stacks = tuple((n.id, n.attrs["layer"].name, c) for (n, _), c in zip(found, counts))
    return PipeSpec(axis, p, microbatches, node.id, node.attrs["layer"].name,
                    named_schedule(schedule, p, microbatches), mesh2, layout2, (mesh, layout), (), stacks,
                    examples or BATCH)


def stack_counts(sizes, stage_layers, p: int, mesh: Mesh, layout: Layout, v: int = 1) -> list[tuple[int, ...]]:
    """Per stack (``sizes``: each one's layers, in graph order), its layers on each of the ``p``
    stages (``p * v`` virtual stages with ``v`` per rank, in layer order: virtual stage s on rank
    s % p): the stages cut the stacks' layers one after another, stage s taking
    ``stage_layers[s]`` of them (even counts when None), so a stage may hold the end of one stack
    and the start of the next, and a stack none on the stages outside its run."""
    total = sum(sizes)
    if stage_layers is None and v > 1 and total < p * v:
        raise _err(f"the {len(sizes)} pipelined stacks have {total} layers in all, fewer than the {p * v} "
                   f"virtual stages ({p} ranks x {v} per rank).", mesh=mesh,
                   layout=layout, rule="each stage runs one layer at least", cls=ScheduleError,
                   fix="use fewer virtual stages per rank (--schedule interleaved:V) or fewer stages")
    given = _even_counts(total, p * v) if stage_layers is None else stage_layers
    cut = check_counts(given, total, p, mesh, layout, v)
    out, start = [], 0
    for n in sizes:
        per, off = [], 0
        for c in cut:
            per.append(max(0, min(off + c, start + n) - max(off, start)))
            off += c
        out.append(tuple(per))
        start += n
    return out


def _even_counts(total: int, p: int) -> list[int]:
    return [total // p + (i < total % p) for i in range(p)]


def _check_chunks(node, p: int, chunks: int, mesh: Mesh, layout: Layout) -> None:
    """Refuse virtual stages that do not divide the layers each rank holds."""
    layers = node.attrs["layer"].size
    if chunks > 1 and (layers // p) % chunks:
        raise _err(f"{chunks} virtual stages per rank do not divide the {layers // p} layers of each of the "
                   f"{p} ranks of the pipeline ({layers} layers).", mesh=mesh, layout=layout, cls=ScheduleError,
                   rule="each rank runs its layers in equal chunks, one per virtual stage",
                   fix=_chunks_fix(layers, p, chunks))


def _chunks_fix(layers: int, p: int, chunks: int) -> str:
    """What to change where ``chunks`` virtual stages per rank do not divide each rank's layers."""
    first = (f"a number of virtual stages that divides {layers // p}" if layers // p > 1
             else "one stage per rank (--schedule 1f1b or zbh1)")
    own = (f", or give each of the {p * chunks} virtual stages its layers (--stage-layers N,N,.., stage_layers=)"
           if layers >= p * chunks else "")
    return f"use {first}, or a multiple of {p * chunks} layers{own}"


def _with_microbatches(mesh: Mesh, layout: Layout, dims: dict[str, int], microbatches: int,
                       examples: str | None):
    """The mesh and layout a plan with ``microbatches`` is lowered on: the mesh with
    :data:`MB_AXIS` (minor), the examples' dim (``batch``, or the user's name for it) split
    over it first."""
    if microbatches == 1:
        return mesh, layout
    if examples is None:
        raise _err(f"{microbatches} micro-batches, but the graph has no examples' dim to cut.", mesh=mesh,
                   layout=layout,
                   rule=f"micro-batches cut the dim named '{BATCH}', or else the dim the inputs hold and no "
                        "param does (the examples' dim, whatever its name)",
                   fix=f"name the dim that indexes the examples '{BATCH}' (md.Dim('{BATCH}', n)), "
                       "or use microbatches=1")
    rule = layout.rule_for(examples, ())
    axes = rule.axis_names if rule else ()
    n = microbatches * mesh.axis_size(axes)
    if dims[examples] % n:
        what, whose = ("batch", "the batch's") if examples == BATCH else (f"the examples' dim {examples!r}", "its")
        raise _err(f"{what} {dims[examples]} is not divisible by {microbatches} micro-batches "
                   f"x {mesh.axis_size(axes)} ({whose} mesh axes {axes or '(none)'}).", mesh=mesh,
                   layout=layout, rule="each micro-batch takes an equal share of the batch on every rank",
                   fix=f"use a {examples} that is a multiple of {n}, or fewer micro-batches")
    mesh2 = Mesh(mesh.axes + ((MB_AXIS, microbatches),))
    rules = [Rule(r.scope, r.dim, (Name(MB_AXIS, None),) + r.axes, r.span) if r.key[1] == examples else r
             for r in layout.rules]
    if rule is None:
        rules.append(Rule(None, Name(examples, None), (Name(MB_AXIS, None),)))
    return mesh2, Layout(tuple(rules), source=layout.source, empty_ok=layout.empty_ok)
