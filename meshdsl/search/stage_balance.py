"""Balanced stages: the pipeline's layers per stage that even out the stages' predicted cost.

The first stage also runs what feeds the layers (the embedding) and the last what follows
them (the head and the loss), so equal layer counts make unequal stages and the schedule
waits on the slowest.  :func:`balance_stages` prices the even split with the cost model
(:func:`~.predict.predict`: each stage's F, B and W seconds per micro-batch, and the part
its layers take), then gives the layers one at a time to the stage that stays cheapest
with one more: the split with the smallest predicted maximum stage cost, as every layer of
a repeat costs the same.  ``compile(..., stage_layers=counts)`` runs it.

With virtual stages (``interleaved:v``, ``interleaved-zb:v``) the stages balanced are the
``p * v`` virtual ones, in layer order (stage s is chunk ``s // p`` of rank ``s % p``): the
first holds the embedding and the last the head.  There the slowest stage is not the whole
story: a rank runs v stages, and which rank's stage waits on which depends on the schedule.
So :func:`split_by_schedule` starts from the split above and moves one layer at a time from a
stage to another while that shortens the schedule simulated at the stages' predicted costs
(:func:`~meshdsl.lowering.timeline.simulate`); of that split, :func:`split_by_cost`'s and the
equal one, the cost model's fastest step is the answer (never slower than equal stages, as
far as the cost model sees).

Example::

    counts = md.balance_stages(outs, "stage:2", "layer:stage", microbatches=8, schedule="1f1b")
    plan = md.compile(outs, "stage:2", "layer:stage", microbatches=8, schedule="1f1b", stage_layers=counts)
"""
from __future__ import annotations

from ..core.graph import topo_nodes
from ..errors import LayoutError, message
from ..layout.layout import Layout
from ..layout.mesh import Mesh
from ..lowering.compiler import compile as compile_plan
from ..lowering.schedule import Schedule
from ..lowering.schedule_gen import parse_schedule
from ..lowering.timeline import simulate
from .calibrate import Calibration, load
from .predict import StageCost, predict


def balance_stages(outputs, mesh, layout, microbatches: int = 1, schedule: str = "gpipe",
                   cal: Calibration | None = None, **compile_kw) -> tuple[int, ...]:
    """The layers per stage that minimise the predicted cost of the slowest stage.

    Args:
      outputs, mesh, layout, microbatches, schedule, compile_kw: as for
        :func:`~meshdsl.lowering.compiler.compile` (without ``stage_layers``).
      cal: the calibration pricing the steps (default: this host's, :func:`~.calibrate.load`).

    Returns:
      One layer count per stage, summing to the pipelined repeat's layers, e.g. ``(3, 5)``;
      with ``v`` virtual stages per rank one per virtual stage (``p * v``), in layer order.

    Raises:
      LayoutError: the layout pipelines no repeat (no ``layer:<axis>`` rule on a mesh axis
        of size > 1).
      What :func:`~meshdsl.lowering.compiler.compile` raises.
    """
    cal = cal or load()
    first = _equal_split(outputs, mesh, layout, parse_schedule(schedule)[1])
    kw = dict(microbatches=microbatches, schedule=schedule, **compile_kw)
    plan = first and compile_plan(outputs, mesh, layout, stage_layers=first, **kw)
    pred = predict(plan, cal) if plan else None
    stages = pred.stages if plan else ()
    if not stages or len(stages) != plan_stage_count(plan):
        raise LayoutError(message(
            "balance_stages: the layout pipelines no repeat.",
            inputs=[f"mesh: {mesh}", f"layout: {layout}", f"schedule: {schedule}"],
            rule="stages are balanced on a pipeline ('layer:<axis>' over an axis of size > 1)",
            fix="split the layer dim over a stage axis, e.g. --layout 'layer:stage'"))
    sched = next(s.args["program"].schedule for s in plan.steps if s.kind == "pipeline")

    def compiled(counts):
        """The plan of ``counts``, or None where the compiler refuses them (per-layer outputs
        need as many layers on every rank): the equal split then stays."""
        try:
            return compile_plan(outputs, mesh, layout, stage_layers=counts, **kw)
        except LayoutError:
            return None
    if sched.num_chunks == 1:
        counts = split_by_cost(stages)
        return counts if counts == first or compiled(counts) is not None else first
    step_s = {first: pred.step_s}
    for counts in (split_by_cost(stages), split_by_schedule(stages, sched)):
        if counts not in step_s and (cand := compiled(counts)) is not None:
            step_s[counts] = predict(cand, cal).step_s
    return min(step_s, key=lambda c: (step_s[c], c != first))   # ties: the equal split


def _equal_split(outputs, mesh, layout, v: int = 1) -> tuple[int, ...] | None:
    """Layers per stage (per virtual stage, with ``v`` per rank) as equal as they come (the
    first ones one more), or None when the layout pipelines no repeat."""
    ts = outputs.values() if isinstance(outputs, dict) else outputs if isinstance(outputs, (list, tuple)) \
        else [outputs]
    mesh, layout = Mesh.parse(mesh), Layout.parse(layout)
    found = []
    for n in topo_nodes(list(ts)):
        rule = layout.rule_for(n.attrs["layer"].name, ()) if n.op.name == "repeat" else None
        if rule is not None and rule.axis_names and mesh.axis_size(rule.axis_names) > 1:
            found.append((n.attrs["layer"], mesh.axis_size(rule.axis_names) * v))
    if len(found) > 1:
        raise LayoutError(message(
            f"balance_stages: {len(found)} stacks are pipelined "
            f"({', '.join(f'{d.name!r}: {d.size} layers' for d, _ in found)}).",
            inputs=[f"mesh: {mesh}", f"layout: {layout}"],
            rule="the automatic split balances the layers of one pipelined stack",
            fix=f"give each stage its layers of the stacks joined in order (--stage-layers N,N,.., "
                f"{found[0][1]} counts summing to {sum(d.size for d, _ in found)}), or leave it out for an even cut"))
    if found:
        (dim, p), = found
        return tuple(dim.size // p + (i < dim.size % p) for i in range(p))
    return None


def plan_stage_count(plan) -> int:
    """The stage count of ``plan``'s pipeline, virtual stages counted (0 without one)."""
    return next((s.args["program"].num_stages for s in plan.steps if s.kind == "pipeline"), 0)


def split_by_cost(stages: list[StageCost]) -> tuple[int, ...]:
    """Layers per stage minimising the largest ``other_s + layers * per_layer``: each stage
    keeps what it holds besides its layers, and a layer costs the measured average."""
    total = sum(c.layers for c in stages)
    per_layer = sum(c.layers_s for c in stages) / total
    counts = [1] * len(stages)
    for _ in range(total - len(stages)):
        # the stage that stays cheapest with one more layer (the first of equals)
        s = min(range(len(stages)), key=lambda i: (stages[i].other_s + (counts[i] + 1) * per_layer, i))
        counts[s] += 1
    return tuple(counts)


def split_by_schedule(stages: list[StageCost], schedule: Schedule) -> tuple[int, ...]:
    """Layers per stage for ``schedule`` (one with virtual stages): from :func:`split_by_cost`'s
    split, the best move of one layer from a stage to another while it shortens the schedule's
    makespan simulated at the stages' costs (ties: the smaller largest stage).

    A stage of n layers costs ``other_s + n * per_layer`` per micro-batch (as in
    :func:`split_by_cost`), its F a third of that and its B the rest (a matmul's backward is two
    of its forward's size), or with the weight gradients split off (``W`` actions) F, B and W a
    third each.
    """
    total = sum(c.layers for c in stages)
    per_layer = sum(c.layers_s for c in stages) / total
    has_w = any(a.kind == "W" for row in schedule.actions for a in row)
    share = {"F": 1 / 3, "B": 1 / 3, "W": 1 / 3} if has_w else {"F": 1 / 3, "B": 2 / 3}

    def key(counts) -> tuple[float, float]:
        sec = [c.other_s + n * per_layer for c, n in zip(stages, counts)]
        return float(simulate(schedule, lambda a: sec[a.stage] * share.get(a.kind, 0.0)).makespan), max(sec)

    counts = split_by_cost(stages)
    best = key(counts)
    while True:
        moves = [tuple(n + (k == j) - (k == i) for k, n in enumerate(counts))
                 for i in range(len(counts)) if counts[i] > 1 for j in range(len(counts)) if j != i]
        scored = min(((key(c), c) for c in moves), default=None)
        if scored is None or scored[0] >= best:
            return counts
        best, counts = scored


def parse_stage_layers(text: str):
    """``--stage-layers``: ``auto``, or counts such as ``3,5``; returns ``"auto"`` or a tuple.

    Raises:
      ValueError: neither (the CLI's argument type turns it into a usage error, exit 2).
    """
    if text.strip() == "auto":
        return "auto"
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"'{text}' is neither 'auto' nor layer counts such as 3,5") from None
    if any(c < 1 for c in counts):
        raise ValueError(f"'{text}': each stage runs at least one layer")
    return counts
