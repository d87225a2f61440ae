"""Coalescing: small independent collectives of one kind made back to back sent as one.

An activation's partial sum is reduced where a reader needs it whole.  A kernel with several
outputs (attention's backward under a sequence split: the keys' and the values' gradients,
partial over the split) leaves several such sums at once, and so do neighbouring kernels of one
input (an FNO layer's real and imaginary spectra, two einsums of its input with a cosine and a
sine table, under a grid split; two parallel projections of one input); each sum pays a
collective's latency for a few hundred bytes.  As SyncBatchNorm sends its two statistics in one
buffer, this pass sends them as one ``bucket_allreduce`` (packed, reduced once, cut apart on
first use: :mod:`meshdsl.comm.bucket`).  Allgathers and reduce-scatters of activations are
packed likewise (a GRU's three gates renamed into a dim split over the mesh, reduce-scattered in
the forward and gathered in the backward, each a few dozen bytes): a ``bucket_reduce_scatter``
packs its members chunk-major as a gradient bucket does, a ``bucket_allgather`` each rank's parts
one after another, so that one allgather of the flat buffers hands every member its parts, joined
again along its own dim (:func:`meshdsl.comm.bucket.unpack_gathered`).  Either moves the same
elements the members would, folded in the same group order: the same bits.

Members of one coalesced step:

* are steps of one kind (``allreduce``, ``allgather`` or ``reduce_scatter``) and phase (the
  forward or the backward) with the same mesh axes, reduce op (a MIN joins MAXes as the MAX of
  its negation: :mod:`.min_as_max`) and dtype, over no micro-batch axis, whose results the rest
  of the forward or backward reads: a gradient only the update reads, or an output (but a
  repeat block's saved activation), is the gradient buckets' business (:mod:`.bucket`), which
  ``bucket_mb=0`` turns off; an allgather or reduce-scatter whose parts differ in length (an
  uneven split: its ``uneven`` arg) is left alone, its buffer laid out unlike its neighbours',
  and so is an allgather of a fed value (a param's slice: the layer loop prefetches those one
  layer ahead, :mod:`meshdsl.runtime.prefetch`);
* are independent (no member's input depends on another member) and their inputs are made back
  to back: between the step that makes the first member's input and the one that makes the
  last's, the plan runs no collective, only kernels that read no member (those that do wait
  for the coalesced step; :func:`meshdsl.runtime.executor.issue_order` runs the ready kernels
  in plan order and starts a collective as soon as it is ready, so these kernels are what
  runs between the two);
* are joined only while the cost model (:class:`.cost.CostModel`) says it pays: the first
  member waits for the kernels between (priced at the model's FLOP rate) and for the others'
  bytes (their bandwidth term), at most the one latency term each member after it saves.  A
  collective that overlaps a long kernel is never held back for a later one.

The coalesced step stands after every member's input is made (where the first member stood,
or after the last member's input when that comes later), and every reader of a member after
it: the plan is put back in a topological order that moves only the readers of a member
that stood before it.  A repeat's block is coalesced in its own sub-plan (one coalesced step
per layer).  A pipelined plan and gradient accumulation are cut into segments before this pass
and are left as they are.
"""
from __future__ import annotations

import heapq
from dataclasses import replace

from .cost import CostModel
from .fuse import IDENTITY
from .min_as_max import as_maxes, unpacked_mins
from .pipeline import MB_AXIS
from .plan import Step, step_args


#: member kind -> the kind of the step that sends several as one
PACKED = {"allreduce": "bucket_allreduce", "allgather": "bucket_allgather", "reduce_scatter": "bucket_reduce_scatter"}


def coalesce(steps: list[Step], values: dict, outputs: dict[str, int], cost: CostModel, mesh) -> list[Step]:
    """``steps`` (a plan without a pipeline), and its repeats' blocks, with the independent
    allreduces, allgathers and reduce-scatters made back to back merged (see the module docstring).

    Returns ``steps`` itself when nothing was merged."""
    # a repeat block's saved activations are outputs its forward reads on: they may join
    kept = {v for name, v in outputs.items() if not name.startswith("saved/")}
    given, (steps, negated) = steps, as_maxes(steps, values, kept, mesh)   # (a MIN with a MAX: :mod:`.min_as_max`)
    out = [_in_blocks(s, cost) for s in steps]
    made = {v: i for i, s in enumerate(out) for v in s.outs}
    groups = _groups(out, values, kept, cost, mesh, made)
    if not groups:
        out = unpacked_mins(out, negated, values)
        return given if len(out) == len(given) and all(a is b for a, b in zip(out, given)) else out
    merged = {i for g in groups for i in g}
    keyed = [((i, 0), s) for i, s in enumerate(out) if i not in merged]
    # after the first member's place and after every member's input, ahead of what follows
    keyed += [((max(min(g), *(made.get(out[j].ins[0], -1) for j in g)), 1), _coalesced(g, out)) for g in groups]
    return unpacked_mins(_topological(keyed), negated, values)


def _in_blocks(s: Step, cost: CostModel) -> Step:
    """A ``repeat`` step with its block's sub-plan coalesced (per layer)."""
    if s.kind != "repeat" or len(s.subplans) != 1:
        return s
    sub = s.subplans[0]
    given, values = list(sub.steps), dict(sub.values)
    steps = coalesce(given, values, dict(sub.outputs), cost, sub.mesh)
    if steps is given:
        return s
    return replace(s, subplans=(replace(sub, steps=tuple(steps), values=values),))


def _member(s: Step, readers: dict, steps: list[Step], outs: set[int], made: dict[int, int]) -> bool:
    """Whether ``s`` may join a coalesced step: an allreduce, or an allgather or reduce-scatter of
    parts of one length, the forward or backward reads on (one only the update reads, a gradient,
    is the gradient buckets'; an allgather of a fed value, a param's, the layer loop's prefetch's)."""
    if s.kind not in PACKED or s.phase not in ("forward", "backward") or MB_AXIS in s.axes:
        return False
    if len(s.ins) != 1 or len(s.outs) != 1 or s.outs[0] in outs or s.args.get("uneven"):
        return False
    if s.kind == "allgather" and s.ins[0] in made and steps[made[s.ins[0]]].kind in ("input", "param"):
        return False
    # the rest of the backward reads it (it may be a gradient too: a bias's, read by the update)
    return any(steps[j].phase != "update" and not (steps[j].kind == "local" and steps[j].op in IDENTITY)
               for j in readers.get(s.outs[0], ()))


def _groups(steps: list[Step], values: dict, outs: set[int], cost: CostModel, mesh,
            made: dict[int, int]) -> list[list[int]]:
    """The positions of the members of each coalesced step, first made first, two or more each."""
    readers: dict[int, list[int]] = {}
    for i, s in enumerate(steps):
        for v in s.ins:
            readers.setdefault(v, []).append(i)
    ancestors: list[int] = []   # position -> bit set of the steps it depends on
    for s in steps:
        dep = 0
        for v in s.ins:
            j = made.get(v)
            if j is not None and j < len(ancestors):
                dep |= ancestors[j] | (1 << j)
        ancestors.append(dep)
    # by the place their input is made: the order the executor can start them in
    members = sorted((made.get(s.ins[0], -1), i) for i, s in enumerate(steps)
                     if _member(s, readers, steps, outs, made))
    open_: dict[tuple, list[int]] = {}
    groups: list[list[int]] = []
    for _, i in members:
        s = steps[i]
        key = (s.kind, s.phase, s.axes, s.args.get("op", "sum"), values[s.ins[0]].dtype)
        group = open_.get(key)
        if group is not None and _joins(group, i, steps, ancestors, made, cost, mesh):
            group.append(i)
            continue
        open_[key] = [i]
        groups.append(open_[key])
    return [g for g in groups if len(g) > 1]


def _joins(group: list[int], i: int, steps: list[Step], ancestors: list[int], made: dict[int, int],
           cost: CostModel, mesh) -> bool:
    """Whether the collective at ``i`` may join ``group``: independent of its members, no
    collective between their inputs and its own, and the cost model says it pays."""
    bits = sum(1 << j for j in group) | (1 << i)
    if ancestors[i] & bits:
        return False   # its input reads a member
    first, last = made.get(steps[group[0]].ins[0], -1), made.get(steps[i].ins[0], -1)
    flops = 0
    for j in range(first + 1, last + 1):   # what runs between the two inputs: a member's readers wait
        if (1 << j) & bits or ancestors[j] & bits:
            continue
        if _sends(steps[j]):
            return False
        flops += _work(steps[j])
    return _pays(group + [i], flops, steps, cost, mesh)


def _sends(s: Step) -> bool:
    """Whether ``s`` is, or runs, a collective."""
    return s.is_collective or any(_sends(t) for sub in s.subplans for t in sub.steps)


def _work(s: Step) -> int:
    """FLOPs of one run of ``s`` on one rank, its sub-plans' as often as they run."""
    return s.flops + sum(s.runs(k) * sum(_work(t) for t in sub.steps) for k, sub in enumerate(s.subplans))


def _pays(members: list[int], flops: int, steps: list[Step], cost: CostModel, mesh) -> bool:
    """Whether the first member's wait for the kernels between (``flops``) and for the others'
    bytes (their bandwidth term) stays within the one latency term each of the others saves."""
    kind, n = steps[members[0]].kind, mesh.axis_size(steps[members[0]].axes)
    latency = cost.collective(kind, 0, n)
    rest = sum(steps[j].bytes for j in members[1:])
    return cost.compute(flops) + cost.collective(kind, rest, n) - latency <= latency


def _topological(keyed: list[tuple[tuple[int, int], Step]]) -> list[Step]:
    """The steps in a topological order of their values, each as early as its key allows:
    a step stays in key order unless it reads a value made by a step of a later key."""
    made = {v: k for k, (_, s) in enumerate(keyed) for v in s.outs}
    users: list[list[int]] = [[] for _ in keyed]
    waiting = [0] * len(keyed)
    for k, (_, s) in enumerate(keyed):
        deps = {made[v] for v in s.ins if v in made}
        waiting[k] = len(deps)
        for j in deps:
            users[j].append(k)
    ready = [(key, k) for k, (key, _) in enumerate(keyed) if not waiting[k]]
    heapq.heapify(ready)
    order: list[Step] = []
    while ready:
        _, k = heapq.heappop(ready)
        order.append(keyed[k][1])
        for j in users[k]:
            waiting[j] -= 1
            if not waiting[j]:
                heapq.heappush(ready, (keyed[j][0], j))
    assert len(order) == len(keyed), "coalescing made a cycle"
    return order


def _coalesced(members: list[int], steps: list[Step]) -> Step:
    """One bucket step (:data:`PACKED`) of the collectives at ``members``: an allreduce's reduce
    op, a reduce-scatter's op and each member's dim, an allgather's dims."""
    first = steps[members[0]]
    ms = [steps[j] for j in members]
    kind = PACKED[first.kind]
    args = {} if first.kind == "allgather" else {"op": first.args.get("op", "sum")}
    if first.kind != "allreduce":
        args["dims"] = tuple(m.args["dim"] for m in ms)
    names = ", ".join(m.label for m in ms)
    whys = " | ".join(f"{m.label}: {m.note}" for m in ms if m.note)   # each member's own note, kept
    return Step(kind, first.node, first.op, first.label, first.phase,
                tuple(m.ins[0] for m in ms), tuple(m.outs[0] for m in ms), first.axes,
                step_args(kind, args), sum(m.bytes for m in ms),
                note=f"{len(ms)} independent {first.kind}s made back to back sent in one buffer "
                     f"(one latency instead of {len(ms)}): {names}" + (f" [{whys}]" if whys else ""))
