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
from .plan import Plan
from .timeline import simulate

KEYS = ("params", "grads", "optimizer", "activations_peak")


def _grad_scopes(scopes: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(x for s in scopes for x in (("grads", s) if s == "params" else (s,)))


def _activation_peak(plan: Plan, skip: set[int]) -> int:
    mesh = plan.mesh
    last: dict[int, int] = {}
    for i, s in enumerate(plan.steps):
        for v in s.ins:
            last[v] = i
    live = peak = 0
    for i, s in enumerate(plan.steps):
        if s.kind in ("pipeline", "accumulate"):
            inner = _pipeline_peak(s, mesh)
        else:
            inner = max((_activation_peak(sub, set()) for sub in s.subplans), default=0)
        for v in s.outs:
            if v not in skip and s.kind not in ("param", "input"):
                live += plan.values[v].local_bytes(mesh)
        peak = max(peak, live + inner)
        for v in set(s.ins):
            if last.get(v) == i and v not in skip and v in plan.values and not _is_leaf(plan, v):
                live -= plan.values[v].local_bytes(mesh)
    return peak


def _pipeline_peak(step, mesh) -> int:
    """A pipeline's (or an accumulate step's) activations at their peak, on its busiest stage:
    the larger of its segments' own peaks (one micro-batch's), plus, for each further
    micro-batch its schedule holds at once (GPipe: all m, 1F1B: p - rank), what that
    micro-batch's forward keeps for its backward there."""
    held = [r.peak_activations for r in simulate(step.args["schedule"]).ranks]
    own = max(_activation_peak(sub, set()) for sub in step.subplans)
    return own + max((h - 1) * b for h, b in zip(held, saved_bytes(step, mesh)))


def saved_bytes(step, mesh) -> list[int]:
    """Per stage of a pipeline (or accumulate) step, the bytes one micro-batch's forward keeps
    for its backward there: values the forward segment makes on that stage and the backward reads."""
    _, forward, backward, _ = step.subplans
    read_back = {v for s in backward.steps for v in s.ins}
    out = [0] * step.args["num_stages"]
    for s, stages in zip(forward.steps, step.args["stages"][1]):
        for v in s.outs:
            if v in read_back:
                for k in stages:
                    out[k] += forward.values[v].local_bytes(mesh)
    return out


def _is_leaf(plan: Plan, vid: int) -> bool:
    return vid in plan.params.values() or vid in plan.inputs.values()


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
    act = _activation_peak(plan, skip)
    for r in ranks:
        r["activations_peak"] = act
    out = {k: max(r[k] for r in ranks) for k in KEYS}
    if per_rank:
        out["ranks"] = ranks
    return out


def _leaf_steps(plan: Plan):
    for s in plan.steps:
        if s.kind == "param":
            yield s
        for sub in s.subplans:
            yield from _leaf_steps(sub)
