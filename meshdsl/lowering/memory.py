"""Memory per rank from a plan: params, gradients, optimizer state, peak activations.

Everything is read from the plan: a param's or state tensor's local bytes come
from its value's sharding (and :attr:`Plan.holders`, which keeps a pipeline
stage's params on its own ranks); a gradient's from the sharding its layout
rules give it (``grads.`` over ``params.``), so ZeRO arithmetic shows: on
``N`` data ranks, a sharded part costs ``1/N`` of its bytes.  Optimizer state is
every param named ``opt/...``.  Peak activations follow the plan's own order:
values are live from the step that makes them to their last reader (sub-plans
count their own peak on top of what is live around them); params, state,
inputs and the outputs that replace params are not activations.  A pipeline (or gradient
accumulation) holds as many micro-batches' saved activations as its schedule keeps in
flight: m under GPipe, p - rank under 1F1B, one when accumulating.
"""
from __future__ import annotations

from ..layout.sharding import Sharding
from .pipeline_program import Segment
from .plan import Plan

KEYS = ("params", "grads", "optimizer", "activations_peak")


def _grad_scopes(scopes: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(x for s in scopes for x in (("grads", s) if s == "params" else (s,)))


def activation_peak(plan: Plan, skip: frozenset[int] | set[int] = frozenset()) -> int:
    """The most bytes of activations ``plan`` holds at once on one rank, running its steps in
    order: a value is live from its step to its last reader (``skip``: values not counted,
    such as the params); a step's sub-plans add their own peak to what is live around them."""
    kept = {*skip, *plan.params.values(), *plan.inputs.values()}   # never freed: not counted, or leaves
    return max(live_bytes(plan.steps, plan.values, plan.mesh, kept, skip), default=0)


def live_bytes(steps, values: dict, mesh, kept, skip=frozenset()) -> list[int]:
    """Per step of ``steps``, the bytes of activations live on one rank while it runs (its
    sub-plans' own peak on top): :func:`activation_peak` is their largest.  ``kept``: values
    never freed (params, inputs: not counted, or leaves); ``skip``: values not counted."""
    last: dict[int, int] = {}
    for i, s in enumerate(steps):
        for v in s.ins:
            last[v] = i
    live, out = 0, []
    for i, s in enumerate(steps):
        if s.kind in ("pipeline", "accumulate"):
            inner = _pipeline_peak(s, mesh)
        else:
            inner = max((activation_peak(sub, set()) for sub in s.subplans), default=0)
        for v in s.outs:
            if v not in skip and s.kind not in ("param", "input"):
                live += values[v].local_bytes(mesh)
        out.append(live + inner)
        for v in set(s.ins):
            if last[v] == i and v not in kept and v in values:
                live -= values[v].local_bytes(mesh)
    return out


def _pipeline_peak(step, mesh) -> int:
    """A pipeline's (or an accumulate step's) activations at their peak, on its busiest rank:
    the larger of its segments' own peaks (one micro-batch's), plus, for each further
    micro-batch its schedule holds at once (GPipe: all m, 1F1B: p - rank), what that
    micro-batch's forward keeps for its backward there (with virtual stages, on the rank's
    stage that keeps the most)."""
    prog = step.args["program"]
    held = [r.peak_activations for r in prog.timeline.ranks]
    own = max(activation_peak(sub, set()) for sub in step.subplans)
    per_stage = saved_bytes(step, mesh)
    per_rank = [max(b for s, b in enumerate(per_stage) if prog.rank_of(s) == r) for r in range(prog.num_ranks)]
    return own + max((h - 1) * b for h, b in zip(held, per_rank))


def saved_bytes(step, mesh) -> list[int]:
    """Per stage of a pipeline (or accumulate) step, the bytes one micro-batch's forward keeps
    for its backward there: values the forward segment makes on that stage and the backward reads."""
    prog = step.args["program"]
    read_back = {v for s in prog.segments[Segment.BACKWARD].steps for v in s.ins}
    out = [0] * prog.num_stages
    for s, stages in prog.steps(Segment.FORWARD):
        for v in s.outs:
            if v in read_back:
                for k in stages:
                    out[k] += prog.segments[Segment.FORWARD].values[v].local_bytes(mesh)
    return out


def memory_report(plan: Plan, per_rank: bool = False) -> dict:
    """Bytes per rank for params, gradients, optimizer state and peak activations.

    Args:
      plan: a compiled training plan (e.g. ``TrainStep(...).plan``).
      per_rank: also return ``"ranks"``, the four figures for every rank.

    Returns:
      ``{"params": bytes, "grads": ..., "optimizer": ..., "activations_peak": ...}``,
      each the most any rank needs (pipeline stages hold different params).

    Example: AdamW with ``"batch:data; opt.d_model:data"`` (ZeRO-1) on ``data:4``
    reports a quarter of the state of each param with a ``d_model`` dim.
    """
    mesh = plan.mesh
    ranks = [dict.fromkeys(KEYS, 0) for _ in range(mesh.size)]
    skip = set(plan.params.values()) | {plan.outputs[k] for k in plan.outputs if k.startswith("new/")}
    leaves = {s.args["name"]: s.args["tensor"] for s in _leaf_steps(plan)}
    for name, vid in plan.params.items():
        v = plan.values[vid]
        holders = plan.holders.get(vid, range(mesh.size))
        kind = "optimizer" if name.startswith("opt/") else "params"
        local = v.local_bytes(mesh)
        grad = 0
        if kind == "params" and f"new/{name}" in plan.outputs and name in leaves:
            t = leaves[name]
            sh: Sharding = plan.layout.targets(v.shape, _grad_scopes(t.scopes), mesh, name, False)[0][0]
            grad = sh.local_numel(v.shape, mesh) * v.dtype.itemsize
        for r in holders:
            ranks[r][kind] += local
            ranks[r]["grads"] += grad
    act = activation_peak(plan, skip)
    for r in ranks:
        r["activations_peak"] = act
    out = {k: max(r[k] for r in ranks) for k in KEYS}
    out["saved_per_layer"] = max((r["input"] + r["activations"] for r in saved_per_layer(plan)), default=0)
    if per_rank:
        out["ranks"] = ranks
    return out


def saved_per_layer(plan: Plan) -> list[dict]:
    """What one layer of each repeat keeps for its backward on one rank (activation
    checkpointing shows here: ``full`` keeps its input only).

    Returns:
      Per forward repeat step (in a pipeline's or an accumulation's segments too), in plan
      order: ``{"label", "layers" (run per stage), "input" (bytes of the layer's input),
      "activations" (bytes of the saved activations), "saved" (how many)}``.
    """
    rows = []
    for s in plan.steps:
        for sub in s.subplans:
            if s.kind != "repeat":
                rows.extend(saved_per_layer(sub))
        if s.kind != "repeat" or s.args["backward"]:
            continue
        n_ys, n_saved, nc = len(s.args.get("ys", ())), len(s.args["saved"]), s.args.get("carries", 1)
        per = [plan.values[v].local_bytes(plan.mesh) // s.times for v in s.outs]
        # the layer's input: every carried tensor's (outputs nc..2nc-1, after the last carries)
        rows.append({"label": s.label, "layers": s.times, "input": sum(per[nc:2 * nc]),
                     "activations": sum(per[2 * nc + n_ys:2 * nc + n_ys + n_saved]), "saved": n_saved})
    return rows


def _leaf_steps(plan: Plan):
    for s in plan.steps:
        if s.kind == "param":
            yield s
        for sub in s.subplans:
            yield from _leaf_steps(sub)
