"""Balanced stages: the pipeline's layers per stage that even out the stages' predicted cost.

The first stage also runs what feeds the layers (the embedding) and the last what follows
them (the head and the loss), so equal layer counts make unequal stages and the schedule
waits on the slowest.  :func:`balance_stages` prices the even split with the cost model
(:func:`~.predict.predict`: each stage's F, B and W seconds per micro-batch, and the part
its layers take), then cuts the layers where the predicted maximum stage cost is smallest
(:func:`split_by_cost`; a layer costs its repeat's measured average).
``compile(..., stage_layers=counts)`` runs it.

An encoder-decoder with both stacks on the stage axis is cut as the stacks' layers joined in
graph order (lowering/pipeline.py ``stack_counts``): a layer costs its own stack's average
(:func:`layer_seconds`; a decoder layer's cross-attention makes it dearer), and any cut of the
joined list may be proposed (:func:`cut_regions`: a stack may run on one stage, on some or on
all of them).

With virtual stages (``interleaved:v``, ``interleaved-zb:v``) the stages balanced are the
``p * v`` virtual ones, in layer order (stage s is chunk ``s // p`` of rank ``s % p``): the
first holds the embedding and the last the head.  There the slowest stage is not the whole
story: a rank runs v stages, and which rank's stage waits on which depends on the schedule.
So :func:`split_by_schedule` starts from the split above and moves one layer at a time from a
stage to another while that shortens the schedule simulated at the stages' predicted costs
(:func:`~meshdsl.lowering.timeline.simulate`); of that split, :func:`split_by_cost`'s and the
equal one, the cost model's fastest step is the answer (never slower than equal stages, as
far as the cost model sees).  Without virtual stages the answer is chosen so too (the slowest
stage does not alone decide a gpipe step either).

What a stage holds besides its layers is measured on the plan priced, and it moves with the cut
(an encoder's output sent to the decoder's stages, say), so the two splits are derived again
from the fastest plan's own stage costs until that plan stays the fastest (:data:`REFINE`
rounds at most); and where the cuts are few (:data:`EVERY_CUT`: a few layers on a few stages)
each is priced, so the answer is the cost model's fastest of all.

Example::

    counts = md.balance_stages(outs, "stage:2", "layer:stage", microbatches=8, schedule="1f1b")
    plan = md.compile(outs, "stage:2", "layer:stage", microbatches=8, schedule="1f1b", stage_layers=counts)
"""
from __future__ import annotations

import itertools
import math

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
    """The layers per stage (of the stacks' layers joined, with several pipelined stacks) that
    the cost model predicts make the fastest step.

    Args:
      outputs, mesh, layout, microbatches, schedule, compile_kw: as for
        :func:`~meshdsl.lowering.compiler.compile` (without ``stage_layers``).
      cal: the calibration pricing the steps (default: this host's, :func:`~.calibrate.load`).

    Returns:
      One layer count per stage, summing to the pipelined repeat's layers, e.g. ``(3, 5)``;
      with ``v`` virtual stages per rank one per virtual stage (``p * v``), in layer order;
      with several pipelined stacks, summing to their layers (encoder first).

    Raises:
      LayoutError: the layout pipelines no repeat (no ``layer:<axis>`` rule on a mesh axis
        of size > 1).
      What :func:`~meshdsl.lowering.compiler.compile` raises.
    """
    cal = cal or load()
    first = _equal_split(outputs, mesh, layout, parse_schedule(schedule)[1])
    kw = dict(microbatches=microbatches, schedule=schedule, **compile_kw)
    refused: list = []
    try:
        plan = first and compile_plan(outputs, mesh, layout, stage_layers=first, **kw)
    except LayoutError as e:   # the even cut refused (a stack with per-layer outputs on one stage)
        first, plan, refused = _first_accepted(outputs, mesh, layout, first, kw, e)
    pred = predict(plan, cal) if plan else None
    stages = pred.stages if plan else ()
    if not stages or len(stages) != plan_stage_count(plan):
        raise LayoutError(message(
            "balance_stages: the layout pipelines no repeat.",
            inputs=[f"mesh: {mesh}", f"layout: {layout}", f"schedule: {schedule}"],
            rule="stages are balanced on a pipeline ('layer:<axis>' over an axis of size > 1)",
            fix="split the layer dim over a stage axis, e.g. --layout 'layer:stage'"))
    sched = next(s.args["program"].schedule for s in plan.steps if s.kind == "pipeline")

    preds = {first: pred, **{c: None for c in refused}}

    def price(counts) -> None:
        """Predict ``counts``'s plan into ``preds`` (None where the compiler refuses it)."""
        if counts not in preds:
            try:
                preds[counts] = predict(compile_plan(outputs, mesh, layout, stage_layers=counts, **kw), cal)
            except LayoutError:
                preds[counts] = None
    total = sum(first)
    if math.comb(total - 1, len(first) - 1) <= EVERY_CUT:   # few cuts: price each
        for counts in _cuts(total, len(first)):
            price(counts)
    for _ in range(REFINE):
        # candidates from the fastest plan's own stage costs: what a stage holds besides its
        # layers (a transfer of an encoder's output, say) moves with the cut
        best = _fastest(preds, first)
        for counts in (split_by_cost(preds[best].stages), split_by_schedule(preds[best].stages, sched)):
            price(counts)
        if _fastest(preds, first) == best:
            break
    return _fastest(preds, first)


#: price every cut when there are at most this many (a model of a few layers on a few stages)
EVERY_CUT = 16
#: rounds of candidates derived from the fastest plan so far
REFINE = 3


#: at most this many cuts are tried for one the compiler accepts where it refuses the even one
TRIED_CUTS = 64


def _first_accepted(outputs, mesh, layout, even, kw, error: LayoutError):
    """(the first cut the compiler accepts, in :func:`_cuts`'s order, its plan, the cuts refused
    before it, the even one included); ``error`` (the even cut's) where none of the first
    :data:`TRIED_CUTS` is accepted."""
    refused = [even]
    for counts in itertools.islice(_cuts(sum(even), len(even)), TRIED_CUTS):
        if counts == even:
            continue
        try:
            return counts, compile_plan(outputs, mesh, layout, stage_layers=counts, **kw), refused
        except LayoutError:
            refused.append(counts)
    raise error


def _fastest(preds: dict, first) -> tuple[int, ...]:
    """The cut of ``preds`` (cut -> prediction, None where refused) with the fastest predicted
    step; ties: the equal split ``first``, then the first priced."""
    ok = [c for c, p in preds.items() if p is not None]
    return min(ok, key=lambda c: (preds[c].step_s, c != first))


def _cuts(total: int, parts: int):
    """Every way to give ``parts`` stages at least one of ``total`` layers, in order."""
    if parts == 1:
        yield (total,)
        return
    for n in range(1, total - parts + 2):
        for rest in _cuts(total - n, parts - 1):
            yield (n, *rest)


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
    if found:
        # several stacks on one stage axis (an encoder-decoder's) are cut as their layers joined
        # in graph order (lowering/pipeline.py stack_counts), one stage per rank: the most even
        # cut (the first stages one layer more)
        sizes, p = [d.size for d, _ in found], found[0][1]
        total = sum(sizes)   # fewer layers than stages: no cut, and the compiler refuses the even one
        return _best_cut([0.0] * p, [1.0] * total, sizes) or tuple(total // p + (i < total % p) for i in range(p))
    return None


def plan_stage_count(plan) -> int:
    """The stage count of ``plan``'s pipeline, virtual stages counted (0 without one)."""
    return next((s.args["program"].num_stages for s in plan.steps if s.kind == "pipeline"), 0)


def layer_seconds(stages: list[StageCost]) -> list[float]:
    """Each layer's seconds per micro-batch, the pipelined stacks' layers joined in graph order
    (the encoder's first): a layer costs its stack's measured average (an encoder's and a
    decoder's layer differ, the decoder's cross-attention)."""
    out: list[float] = []
    for parts in zip(*(c.per_stack for c in stages)):
        n = sum(k for k, _ in parts)
        out += [sum(sec for _, sec in parts) / n] * n
    return out


def stack_sizes(stages: list[StageCost]) -> list[int]:
    """Layers of each pipelined stack, in graph order."""
    return [sum(k for k, _ in parts) for parts in zip(*(c.per_stack for c in stages))]


def cut_regions(sizes, p: int) -> list[tuple[int, ...]]:
    """The sets of positions of the joined layer list (``sizes``: each stack's layers) where the
    compiler lets the ``p`` stages' boundaries fall: anywhere, as a stack may run on one stage, on
    some (with an empty part of its layers on the others) or on all of them
    (lowering/stage_layers.py ``split_stacks``), so one set of every position."""
    return [tuple(range(1, sum(sizes)))]


def split_by_cost(stages: list[StageCost]) -> tuple[int, ...]:
    """Layers per stage (a cut of the stacks' joined layers) minimising the largest
    ``other_s + its layers' seconds`` (:func:`layer_seconds`): each stage keeps what it holds
    besides its layers. Of the cuts as good, the most even (the smallest sum of the stages'
    squared costs), then the one giving earlier stages more. Only cuts the compiler runs
    (:func:`cut_regions`)."""
    return _best_cut([c.other_s for c in stages], layer_seconds(stages), stack_sizes(stages))


def _best_cut(other: list, costs: list, sizes) -> tuple[int, ...] | None:
    """:func:`_min_max_cut`'s best over the :func:`cut_regions` of stacks of ``sizes`` (None:
    no cut the compiler runs)."""
    found = [c for region in cut_regions(sizes, len(other))
             if (c := _min_max_cut(other, costs, region)) is not None]
    return min(found, key=lambda f: (f[0], f[1], tuple(-n for n in f[2])))[2] if found else None


def _min_max_cut(other: list, costs: list, allowed) -> tuple[float, float, tuple[int, ...]] | None:
    """The cut of layers ``costs`` into ``len(other)`` stages of at least one layer, boundaries
    at ``allowed`` positions, with the smallest largest stage cost (stage s costs ``other[s]``
    plus its layers'), then the smallest sum of squares, then the most layers on earlier stages:
    ``(largest, sum of squares, counts)``, or None when no such cut exists."""
    p, n = len(other), len(costs)
    pre = [0.0]
    for c in costs:
        pre.append(pre[-1] + c)
    ends = [sorted(b for b in allowed if 0 < b < n)] * (p - 1) + [[n]]
    inf = float("inf")
    # worst[s][e]: the smallest largest cost of stages 0..s with stage s ending at e
    worst = [{0: -inf}]
    for s in range(p):
        worst.append({e: min((max(w, other[s] + pre[e] - pre[b]) for b, w in worst[s].items() if b < e),
                             default=inf) for e in ends[s]})
    top = worst[p].get(n, inf)
    if top == inf:
        return None
    cap = top + 1e-9 * abs(top)   # the stages may cost up to the least largest (rounding aside)
    # squares[s][b]: the smallest sum of squares of stages s.. starting at b, each within cap
    squares: list[dict] = [{} for _ in range(p)] + [{n: (0.0, ())}]
    for s in reversed(range(p)):
        for b in [0] if s == 0 else ends[s - 1]:
            best = None
            for e in reversed(ends[s]):   # more layers first: kept unless a cut is strictly better
                cost = other[s] + pre[e] - pre[b]
                if e <= b or cost > cap or e not in squares[s + 1]:
                    continue
                sq, rest = squares[s + 1][e]
                cand = (cost * cost + sq, (e - b, *rest))
                if best is None or cand[0] < best[0] - 1e-12 * abs(best[0]):
                    best = cand
            if best is not None:
                squares[s][b] = best
    if 0 not in squares[0]:
        return None
    sq, counts = squares[0][0]
    return top, sq, counts


def split_by_schedule(stages: list[StageCost], schedule: Schedule) -> tuple[int, ...]:
    """Layers per stage for ``schedule`` (one with virtual stages): from :func:`split_by_cost`'s
    split, the best move of one layer from a stage to another while it shortens the schedule's
    makespan simulated at the stages' costs (ties: the smaller largest stage).

    A stage costs ``other_s`` plus its layers' :func:`layer_seconds` per micro-batch (as in
    :func:`split_by_cost`), its F a third of that and its B the rest (a matmul's backward is two
    of its forward's size), or with the weight gradients split off (``W`` actions) F, B and W a
    third each.
    """
    costs = layer_seconds(stages)
    has_w = any(a.kind == "W" for row in schedule.actions for a in row)
    share = {"F": 1 / 3, "B": 1 / 3, "W": 1 / 3} if has_w else {"F": 1 / 3, "B": 2 / 3}

    def key(counts) -> tuple[float, float]:
        ends = [sum(counts[:i + 1]) for i in range(len(counts))]
        sec = [c.other_s + sum(costs[e - n:e]) for c, n, e in zip(stages, counts, ends)]
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
