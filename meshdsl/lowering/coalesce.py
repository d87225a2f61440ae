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
again along its own dim (:func:`meshdsl.comm.bucket.unpack_gathered`).  FSDP's gathers of the
params (``params.d_model:data``) are all ready at the start of the step, or of a layer (its
slices, fed together, and prefetched together one layer ahead: :mod:`meshdsl.runtime.prefetch`),
and go as one ``bucket_allgather`` too.  A sliding window over a split sequence sends its keys'
and its values' halo rows to the same neighbour (and their gradients back): one
``bucket_permute``, each rank's members packed in one buffer moved as a permute moves it.  Each
moves the same elements the members would, folded in the same group order: the same bits.

Members of one coalesced step:

* are steps of one kind (``allreduce``, ``allgather``, ``reduce_scatter`` or ``permute``) and
  phase (the forward, its recompute or the backward) with the same mesh axes, reduce op (a MIN
  joins MAXes as the MAX of its negation: :mod:`.min_as_max`), permute offset and dtype, over no
  micro-batch axis, whose results the rest of the forward or backward reads: a gradient only the
  update reads, or an output (but a repeat block's saved activation), is the gradient buckets'
  business (:mod:`.bucket`), which ``bucket_mb=0`` turns off; an allgather or reduce-scatter
  whose parts differ in length (an uneven split: its ``uneven`` arg) is left alone, its buffer
  laid out unlike its neighbours', and so is a permute whose pieces differ in shape between
  ranks; in a layer's block, the gathers of the params the loop prefetches join only each other
  (so that their one step is prefetched whole);
* are independent (no member's input depends on another member) and their inputs are made back
  to back: between the step that makes the first member's input and the one that makes the
  last's, the plan runs no collective, only kernels that read no member (those that do wait
  for the coalesced step; :func:`meshdsl.runtime.executor.issue_order` runs the ready kernels
  in plan order and starts a collective as soon as it is ready, so these kernels are what
  runs between the two);
* are joined only while the cost model (:class:`.cost.CostModel`) says it pays: the first
  member waits for the kernels between (priced at the model's FLOP rate) and for the others'
  bytes (their bandwidth term), at most the one latency term each member after it saves.  A
  collective that overlaps a long kernel is never held back for a later one;
* where a member gathers a param or an input, moves a halo or is a recompute's, are joined only
  while the plan's activations' peak (:func:`.memory.live_bytes`, as the memory report counts it)
  stays what the separate collectives hold at once: a param's gather packed with the first is
  held from the start, not from where its reader needs it (FSDP gathers each layer's weights
  just in time so as not to hold them all), so a layer's block may rise by what the plan's
  peak leaves above it, and no more.

The coalesced step stands after every member's input is made (where the first member stood,
or after the last member's input when that comes later), and every reader of a member after
it: the plan is put back in a topological order that moves only the readers of a member
that stood before it.  A pass runs again while it merges: collectives that stood between
members of one kind may be packed ahead of them (a layer's row-sum allreduces before its
normalised weights' gathers).  A repeat's block is coalesced in its own sub-plan (one coalesced
step per layer).  A pipelined plan and gradient accumulation are cut into segments before this
pass and are left as they are.
"""
from __future__ import annotations

import heapq
from dataclasses import replace

from .cost import CostModel
from .fuse import IDENTITY
from .memory import live_bytes
from .min_as_max import as_maxes, unpacked_mins
from .pipeline import MB_AXIS
from .plan import Step, step_args


#: member kind -> the kind of the step that sends several as one
PACKED = {"allreduce": "bucket_allreduce", "allgather": "bucket_allgather", "reduce_scatter": "bucket_reduce_scatter",
          "permute": "bucket_permute"}
#: a permute's args: its members share them (one neighbour)
MOVE_ARGS = ("offset", "wrap", "reverse")


def coalesce(steps: list[Step], values: dict, outputs: dict[str, int], cost: CostModel, mesh,
             ahead: frozenset = frozenset(), slack: int = 0) -> list[Step]:
    """``steps`` (a plan without a pipeline), and its repeats' blocks, with the independent
    allreduces, allgathers and reduce-scatters made back to back merged (see the module docstring).
    ``ahead``: the inputs a loop whose body ``steps`` are prefetches (its layer's params);
    ``slack``: the bytes ``steps``' activations' peak may rise by (a block's: up to the plan's peak).

    Returns ``steps`` itself when nothing was merged."""
    cap = _Room(steps, values, mesh, _skipped(outputs)).peak + slack
    out = _once(steps, values, outputs, cost, mesh, ahead, cap, False)
    while out is not steps:   # (members a collective stood between, since packed ahead of them: again)
        steps, out = out, _once(out, values, outputs, cost, mesh, ahead, cap, True)
    return out


def _skipped(outputs: dict[str, int]) -> set[int]:
    """The values the memory report does not count: the params' new values."""
    return {v for name, v in outputs.items() if name.startswith("new/")}


def _once(steps: list[Step], values: dict, outputs: dict[str, int], cost: CostModel, mesh,
          ahead: frozenset, cap: int, again: bool) -> list[Step]:
    """One pass of :func:`coalesce`, keeping the activations' peak within ``cap`` bytes (``again``:
    a later pass, whose every group keeps it): ``steps`` itself when nothing was merged."""
    # a repeat block's saved activations are outputs its forward reads on: they may join
    kept = {v for name, v in outputs.items() if not name.startswith("saved/")}
    given, (steps, negated) = steps, as_maxes(steps, values, kept, mesh)   # (a MIN with a MAX: :mod:`.min_as_max`)
    around = _Room(steps, values, mesh, _skipped(outputs)).live   # a block may hold what the plan's peak leaves
    out = [_in_blocks(s, cost, cap - live) for s, live in zip(steps, around)]
    made = {v: i for i, s in enumerate(out) for v in s.outs}
    room = _Room(out, values, mesh, _skipped(outputs), cap, again)
    groups = _groups(out, values, kept, cost, mesh, made, ahead, room)
    merged = _merged(groups, out, made)
    early = [g for g in groups if room.minds(g, out, made)]
    if early:   # (the estimate left readers in place: measured again, the last dropped while over)
        limit = room.peak_of(_merged([g for g in groups if g not in early], out, made))
        while early and room.peak_of(merged) > max(limit, room.cap):
            groups.remove(early.pop())
            merged = _merged(groups, out, made)
    if not groups:
        out = unpacked_mins(out, negated, values)
        return given if len(out) == len(given) and all(a is b for a, b in zip(out, given)) else out
    return unpacked_mins(merged, negated, values)


def _merged(groups: list[list[int]], steps: list[Step], made: dict[int, int]) -> list[Step]:
    """``steps`` with each group's members sent as one step (:func:`_coalesced`), put in place."""
    merged = {i for g in groups for i in g}
    keyed = [((i, 0), s) for i, s in enumerate(steps) if i not in merged]
    keyed += [((_place(g, steps, made), 1), _coalesced(g, steps)) for g in groups]
    return _topological(keyed)


def _place(members: list[int], steps: list[Step], made: dict[int, int]) -> int:
    """Where the step packing ``members`` stands: after the first member's place and after every
    member's input, ahead of what follows."""
    return max(min(members), *(made.get(steps[j].ins[0], -1) for j in members))


def _in_blocks(s: Step, cost: CostModel, slack: int) -> Step:
    """A ``repeat`` step with its block's sub-plan coalesced (per layer), its peak raised by at
    most ``slack`` bytes."""
    if s.kind != "repeat" or len(s.subplans) != 1:
        return s
    sub = s.subplans[0]
    given, values = list(sub.steps), dict(sub.values)
    steps = coalesce(given, values, dict(sub.outputs), cost, sub.mesh, frozenset(s.args.get("names", ())),
                     max(slack, 0))
    if steps is given:
        return s
    return replace(s, subplans=(replace(sub, steps=tuple(steps), values=values),))


def _member(s: Step, readers: dict, steps: list[Step], outs: set[int], values: dict, mesh) -> bool:
    """Whether ``s`` may join a coalesced step: an allreduce, or an allgather or reduce-scatter of
    parts of one length, the forward (or its recompute) or backward reads on (one only the update
    reads, a gradient, is the gradient buckets')."""
    if s.kind not in PACKED or s.phase not in ("forward", "recompute", "backward") or MB_AXIS in s.axes:
        return False
    if len(s.ins) != 1 or len(s.outs) != 1 or s.outs[0] in outs or s.args.get("uneven"):
        return False
    if s.kind == "permute" and not _alike(s, values, mesh):
        return False
    # the rest of the backward reads it (it may be a gradient too: a bias's, read by the update)
    return any(steps[j].phase != "update" and not (steps[j].kind == "local" and steps[j].op in IDENTITY)
               for j in readers.get(s.outs[0], ()))


def _alike(s: Step, values: dict, mesh) -> bool:
    """Whether permute ``s`` sends and receives one local shape on every rank (a flat buffer of
    one length each: a receiver cuts what it gets as its own)."""
    shapes = {values[v].local_shape(mesh, r) for v in (*s.ins, *s.outs) for r in range(mesh.size)}
    return len(shapes) == 1


def _groups(steps: list[Step], values: dict, outs: set[int], cost: CostModel, mesh,
            made: dict[int, int], ahead: frozenset, room: "_Room") -> list[list[int]]:
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
                     if _member(s, readers, steps, outs, values, mesh))
    open_: dict[tuple, list[int]] = {}
    groups: list[list[int]] = []
    for _, i in members:
        s = steps[i]
        # a loop's prefetched gathers (of its layer's params) packed apart: all started ahead, as one
        fed = steps[made[s.ins[0]]] if s.ins[0] in made else s
        key = (s.kind, s.phase, s.axes, s.args.get("op", "sum"), values[s.ins[0]].dtype,
               fed.kind == "input" and fed.args.get("name") in ahead, *(s.args.get(k) for k in MOVE_ARGS))
        group = open_.get(key)
        if group is not None and _joins(group, i, steps, ancestors, made, cost, mesh) and \
                (not room.minds(group + [i], steps, made) or room.fits(group + [i], steps, made)):
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


def _held(members: list[int], steps: list[Step], made: dict[int, int]) -> bool:
    """Whether packing ``members`` must keep the activations' peak (:class:`_Room`): a member gathers
    a param or an input (ready from the start: packed with the first, not where a reader needs
    it), moves a halo or is a recompute's (in a backward block, among its largest values)."""
    return any(steps[j].kind == "permute" or steps[j].phase == "recompute" or
               (steps[j].kind == "allgather" and steps[made.get(steps[j].ins[0], j)].kind in ("param", "input"))
               for j in members)


class _Room:
    """The activations the unpacked ``steps`` hold at each step (:func:`.memory.live_bytes`), and
    their peak, which no packing may raise: a member packed ahead of its place (a param's gather,
    ready from the start, packed with the first) holds its result from the packed step on, and
    one packed after its place holds its input until then."""

    def __init__(self, steps: list[Step], values: dict, mesh, skip: set[int], cap: int | None = None,
                 every: bool = False):
        self.values, self.mesh, self.skip = values, mesh, skip
        self.kept = skip | {v for s in steps if s.kind in ("param", "input") for v in s.outs}
        self.live = live_bytes(steps, values, mesh, self.kept, skip)
        self.peak = max(self.live, default=0)
        self.cap = self.peak if cap is None else cap   # (the most a packing may hold at once)
        self.every = every
        self.last = {v: i for i, s in enumerate(steps) for v in s.ins}

    def minds(self, members: list[int], steps: list[Step], made: dict[int, int]) -> bool:
        """Whether packing ``members`` must keep the peak: every group of a later pass does."""
        return self.every or _held(members, steps, made)

    def fits(self, members: list[int], steps: list[Step], made: dict[int, int]) -> bool:
        """Whether packing ``members`` keeps the peak (estimated: their readers stay in place)."""
        at, extra = _place(members, steps, made), {}
        for j in members:
            v, lo, hi = steps[j].outs[0], at, j   # (held early: from the packed step to its place)
            if j < at:
                v, lo, hi = steps[j].ins[0], j + 1, at + 1   # (held late: its input, read last here)
                if self.last.get(v) != j or v in self.kept:
                    continue
            b = self.values[v].local_bytes(self.mesh)
            for t in range(max(lo, 0), hi):
                extra[t] = extra.get(t, 0) + b
        return all(self.live[t] + b <= self.cap for t, b in extra.items())

    def peak_of(self, steps: list[Step]) -> int:
        """The most ``steps`` (these, packed) hold at once."""
        return max(live_bytes(steps, self.values, self.mesh, self.kept, self.skip), default=0)


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
    if first.kind == "permute":
        args = {k: first.args[k] for k in MOVE_ARGS if k in first.args}
    else:
        args = {} if first.kind == "allgather" else {"op": first.args.get("op", "sum")}
    if first.kind in ("allgather", "reduce_scatter"):
        args["dims"] = tuple(m.args["dim"] for m in ms)
    names = ", ".join(m.label for m in ms)
    whys = " | ".join(f"{m.label}: {m.note}" for m in ms if m.note)   # each member's own note, kept
    return Step(kind, first.node, first.op, first.label, first.phase,
                tuple(m.ins[0] for m in ms), tuple(m.outs[0] for m in ms), first.axes,
                step_args(kind, args), sum(m.bytes for m in ms),
                note=f"{len(ms)} independent {first.kind}s made back to back sent in one buffer "
                     f"(one latency instead of {len(ms)}): {names}" + (f" [{whys}]" if whys else ""))
