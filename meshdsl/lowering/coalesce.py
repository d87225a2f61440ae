"""Coalescing: small independent allreduces that start at the same moment sent as one.

An activation's partial sum is reduced where a reader needs it whole.  A kernel with several
outputs (attention's backward under a sequence split: the keys' and the values' gradients,
partial over the split) leaves several such sums at once, and each pays a collective's
latency for a few hundred bytes.  As SyncBatchNorm sends its two statistics in one buffer,
this pass sends them as one ``bucket_allreduce`` (packed, reduced once, cut apart on first
use: :mod:`meshdsl.comm.bucket`).

Members of one coalesced step:

* are ``allreduce`` steps of the forward or backward with the same mesh axes, reduce op and
  dtype, over no micro-batch axis, whose results the rest of the forward or backward reads:
  a gradient only the update reads, or an output, is the gradient buckets' business
  (:mod:`.bucket`), which ``bucket_mb=0`` turns off;
* depend on exactly the same steps (their inputs' ancestors are one set): whatever order the
  executor issues a plan in (:func:`meshdsl.runtime.executor.issue_order`), they become ready
  after the same step, and it starts them one after the other with nothing between, so the
  coalesced step starts no member later than it would have started alone; an allreduce that
  was started early to overlap with compute is never held back for a later one;
* are joined only while the cost model (:class:`.cost.CostModel`) says it pays: the first
  member waits for the others' bytes (their bandwidth term), at most one latency term, which
  each member after it saves.

The coalesced step stands where its first member stood; every member's input is made before
it (same ancestors) and every member's reader comes after it.  A repeat's block is coalesced
in its own sub-plan (one coalesced step per layer).  A pipelined plan and gradient
accumulation are cut into segments before this pass and are left as they are.
"""
from __future__ import annotations

from dataclasses import replace

from .cost import CostModel
from .fuse import IDENTITY
from .pipeline import MB_AXIS
from .plan import Step, step_args


def coalesce(steps: list[Step], values: dict, outputs: dict[str, int], cost: CostModel, mesh) -> list[Step]:
    """``steps`` (a plan without a pipeline), and its repeats' blocks, with the independent
    allreduces that start at the same moment merged (see the module docstring).

    Returns ``steps`` itself when nothing was merged."""
    out = [_in_blocks(s, cost) for s in steps]
    groups = _groups(out, values, set(outputs.values()), cost, mesh)
    if not groups:
        return steps if all(a is b for a, b in zip(out, steps)) else out
    first = {g[0]: g for g in groups}
    merged = {i for g in groups for i in g}
    return [_coalesced(first[i], out) if i in first else s
            for i, s in enumerate(out) if i in first or i not in merged]


def _in_blocks(s: Step, cost: CostModel) -> Step:
    """A ``repeat`` step with its block's sub-plan coalesced (per layer)."""
    if s.kind != "repeat" or len(s.subplans) != 1:
        return s
    sub = s.subplans[0]
    given = list(sub.steps)
    steps = coalesce(given, dict(sub.values), dict(sub.outputs), cost, sub.mesh)
    if steps is given:
        return s
    return replace(s, subplans=(replace(sub, steps=tuple(steps)),))


def _member(s: Step, readers: dict, steps: list[Step], outs: set[int]) -> bool:
    """Whether ``s`` may join a coalesced step: an allreduce the forward or backward reads on
    (one only the update reads, a gradient, is the gradient buckets')."""
    if s.kind != "allreduce" or s.phase not in ("forward", "backward") or MB_AXIS in s.axes:
        return False
    if len(s.ins) != 1 or len(s.outs) != 1 or s.outs[0] in outs:
        return False
    # the rest of the backward reads it (it may be a gradient too: a bias's, read by the update)
    return any(steps[j].phase != "update" and not (steps[j].kind == "local" and steps[j].op in IDENTITY)
               for j in readers.get(s.outs[0], ()))


def _groups(steps: list[Step], values: dict, outs: set[int], cost: CostModel, mesh) -> list[list[int]]:
    """The positions of the members of each coalesced step, in plan order, two or more each."""
    readers: dict[int, list[int]] = {}
    for i, s in enumerate(steps):
        for v in s.ins:
            readers.setdefault(v, []).append(i)
    producer = {v: i for i, s in enumerate(steps) for v in s.outs}
    ancestors: list[int] = []   # position -> bit set of the steps it depends on
    for s in steps:
        dep = 0
        for v in s.ins:
            j = producer.get(v)
            if j is not None and j < len(ancestors):
                dep |= ancestors[j] | (1 << j)
        ancestors.append(dep)
    open_: dict[tuple, list[int]] = {}
    groups: list[list[int]] = []
    for i, s in enumerate(steps):
        if not _member(s, readers, steps, outs):
            continue
        key = (ancestors[i], s.axes, s.args.get("op", "sum"), values[s.ins[0]].dtype)
        members = open_.get(key)
        if members is not None and _pays(members + [i], steps, cost, mesh):
            members.append(i)
            continue
        open_[key] = [i]
        groups.append(open_[key])
    return [g for g in groups if len(g) > 1]


def _pays(members: list[int], steps: list[Step], cost: CostModel, mesh) -> bool:
    """Whether the first member's wait for the others' bytes (their bandwidth term) stays
    within the one latency term each of the others saves."""
    n = mesh.axis_size(steps[members[0]].axes)
    latency = cost.collective("allreduce", 0, n)
    rest = sum(steps[j].bytes for j in members[1:])
    return cost.collective("allreduce", rest, n) - latency <= latency


def _coalesced(members: list[int], steps: list[Step]) -> Step:
    """One ``bucket_allreduce`` of the allreduces at ``members``."""
    first = steps[members[0]]
    ms = [steps[j] for j in members]
    names = ", ".join(m.label for m in ms)
    return Step("bucket_allreduce", first.node, first.op, first.label, first.phase,
                tuple(m.ins[0] for m in ms), tuple(m.outs[0] for m in ms), first.axes,
                step_args("bucket_allreduce", {"op": first.args.get("op", "sum")}), sum(m.bytes for m in ms),
                note=f"{len(ms)} independent allreduces ready at the same moment sent in one buffer "
                     f"(one latency instead of {len(ms)}): {names}")
