"""Runs a :class:`~meshdsl.lowering.plan.Plan` against a communicator.

The same code serves the simulated mesh (every rank in one process) and
torch.distributed (one rank per process): values are lists with one local
tensor per rank the communicator holds.  Per-rank context (slice offsets) is
computed once per plan.

Steps run in an issue order computed once per plan (:func:`issue_order`):
collectives the communicator runs asynchronously start as soon as their input
exists, and steps that need their results run after the other ready work, so
communication overlaps compute without changing any step's result.
"""
from __future__ import annotations

import heapq
import time
import weakref
from types import EllipsisType

import torch

from ..errors import GraphError, clip, message
from ..ir.interpret import check_feed, feeds_dict
from ..layout.sharding import Sharding, cyclic_order
from ..lowering.plan import Plan, Value
from ..lowering.relayout import move_args, plan_moves
from ..lowering.users_terms import about_plan, num_microbatches, user_mesh_layout
from ..ops.registry import run_device, running_on
from ..comm.communicator import Communicator, Pending
from .dense import check_no_extra_feeds
from ..comm.microbatch import real_rank
from .context import PerRank, StepContext
from .compiled import segments_of, settings_of, whole_step
from .program import build, units_of
from .steps import inplace_adds, representatives, rule_for, split_local


def run_collective(comm: Communicator, kind: str, xs, axes, args):
    """Run one collective (or a local ``split``) on the held ranks' tensors."""
    if kind == "split":
        return split_local(comm, xs, axes, args["dim"])
    return comm.collective(kind, xs, axes, args)


def waiting_getter(env: dict, stats: dict | None):
    """``get(v)``: value ``v`` of ``env``, a pending collective's result waited for (and kept) on
    first read, the wait timed into ``stats['wait']`` when ``stats`` is given."""
    def get(v):
        x = env[v]
        if isinstance(x, Pending):
            if stats is None:
                x = env[v] = x.wait()
            else:
                t0 = time.perf_counter()
                x = env[v] = x.wait()
                stats["wait"] = stats.get("wait", 0.0) + time.perf_counter() - t0
        return x
    return get


class _Run:
    """What one run of a plan was given: feeds, params, the kernel salt, and the stats dict;
    ``into``: running sums a pipeline's backward loop adds its gradients into; ``defer``: the
    :class:`~.deferred.Deferred` its weight-gradient matmuls go to (see :mod:`.layers`)."""

    __slots__ = ("feeds", "params", "salt", "stats", "into", "defer")

    def __init__(self, feeds, params, salt, stats):
        self.feeds, self.params, self.salt, self.stats = feeds, params, salt, stats
        self.into = self.defer = None


def _local_index(value: Value, mesh, rank: int):
    """The index of ``rank``'s local slice of ``value`` in its full tensor: ``...`` (the whole),
    slices, or for a block-cyclic dim (``Sharding.cyclic``) the list of its global positions."""
    sh = value.sharding
    if not sh.cyclic:
        return _whole_or(sh.slice_index(value.shape, mesh, rank), value.shape.sizes)
    assert len(sh.cyclic) == 1, f"{sh}: one block-cyclic dim"
    regions = sorted(sh.regions(value.shape, mesh, rank), key=lambda r: [s.start for s in r[1]])
    at = value.shape.index(sh.cyclic[0][0])
    first = regions[0][0]
    return first[:at] + ([i for g, _ in regions for i in range(g[at].start, g[at].stop)],) + first[at + 1:]


def _whole_or(index: tuple[slice, ...], sizes) -> tuple[slice, ...] | EllipsisType:
    """``...`` where slice ``index`` is the whole of a tensor of ``sizes`` (no indexing needed), else ``index``."""
    return ... if all(i.start == 0 and i.stop == n for i, n in zip(index, sizes)) else index


def issue_order(plan: Plan, async_kinds=frozenset()) -> list[int]:
    """The order in which to run ``plan.steps``: a topological order that starts
    asynchronous collectives early and consumes their results late.

    List scheduling over the value dependencies: a ready step whose kind is in
    ``async_kinds`` is issued at once (starting it costs little and hides its
    latency behind what follows); otherwise the ready step that waits on the
    most recently issued collective still in flight goes last, ties broken by
    plan order.  The order depends on the plan alone, so every rank issues the
    same collectives in the same order.

    Args:
      plan: a compiled plan.
      async_kinds: collective kinds the communicator overlaps (``Communicator.async_kinds``).

    Returns:
      Step indices, each once.
    """
    steps = plan.steps
    producer = {v: i for i, s in enumerate(steps) for v in s.outs}
    users: list[list[int]] = [[] for _ in steps]
    waiting = [0] * len(steps)
    for i, s in enumerate(steps):
        deps = {producer[v] for v in s.ins if v in producer}
        waiting[i] = len(deps)
        for j in deps:
            users[j].append(i)
    # Two heaps of ready steps: asynchronous ones by plan order, the others by (position of the
    # latest in-flight collective they wait on, plan order).  A ready step's key changes when a
    # collective's result is consumed (or issued): it is pushed again, its stale entry skipped when met.
    in_flight: dict[int, int] = {}   # value id -> position its collective was issued at
    readers: dict[int, list[int]] = {}   # value id -> the steps reading it
    for j, s in enumerate(steps):
        for v in s.ins:
            readers.setdefault(v, []).append(j)
    key: dict[int, int] = {}   # ready non-async step -> its current first key
    starts: list[int] = []
    others: list[tuple[int, int]] = []

    def make_ready(j):
        if steps[j].kind in async_kinds:
            heapq.heappush(starts, j)
        else:
            k = key[j] = max((in_flight[v] for v in steps[j].ins if v in in_flight), default=-1)
            heapq.heappush(others, (k, j))

    for j, n in enumerate(waiting):
        if n == 0:
            make_ready(j)
    order: list[int] = []
    while starts or others:
        if starts:
            i = heapq.heappop(starts)
        else:
            k, i = heapq.heappop(others)
            if key.get(i) != k:
                continue   # stale: issued, or its key fell since
            del key[i]
        s = steps[i]
        if s.kind in async_kinds:
            changed = s.outs
            for v in changed:
                in_flight[v] = len(order)
        else:
            changed = [v for v in s.ins if in_flight.pop(v, None) is not None]
        for v in changed:
            for j in readers.get(v, ()):
                if j in key:
                    k = max((in_flight[u] for u in steps[j].ins if u in in_flight), default=-1)
                    if k != key[j]:
                        key[j] = k
                        heapq.heappush(others, (k, j))
        order.append(i)
        for j in users[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                make_ready(j)
    assert len(order) == len(steps), "plan steps form a cycle"
    return order


def donatable_params(steps, params: set[int], keep: set[int]) -> set[int]:
    """The ``params`` an update may overwrite: none that a collective (or a send) may still be
    reading, nor a plan output.  A repeat loop (stacked params) has read its layers' slices
    when it returns, so it does not stand in the way."""
    return set(params) - {v for s in steps if s.kind not in ("local", "repeat") for v in s.ins} - keep


def donating_steps(steps, params: set[int], last_use: dict[int, int]) -> set[int]:
    """Indices of the local steps with an in-place kernel that are the last readers (``last_use``:
    value -> step index) of the donatable ``params`` they write into."""
    return {i for i, s in enumerate(steps)
            if s.kind == "local" and s.args.get("inplace") is not None
            and all(s.ins[k] in params and last_use.get(s.ins[k]) == i for k in s.args.get("donates", (0,)))}


def _check_arguments(plan, comm) -> None:
    """Executor(plan, comm) is given a compiled Plan and a Communicator."""
    if not isinstance(plan, Plan):
        raise GraphError(message(
            f"Executor: plan is {clip(repr(plan), 80)} ({type(plan).__name__}), not a Plan.",
            rule="an executor runs a compiled plan on a communicator: Executor(plan, comm)",
            fix="compile first: plan = md.compile(outputs, mesh, layout) (md.run_dense runs the graph itself)"))
    if not isinstance(comm, Communicator):
        raise GraphError(message(
            f"Executor: comm is {clip(repr(comm), 80)} ({type(comm).__name__}), not a Communicator.",
            rule="an executor runs a compiled plan on a communicator: Executor(plan, comm)",
            fix="pass md.SimulatedComm(plan.mesh) (every rank in this process) or md.TorchComm(plan.mesh) "
                "(one rank per process)"))


def _mesh_mismatch(plan: Plan, comm: Communicator) -> str:
    """Why ``comm`` cannot run ``plan``, in the mesh the user compiled for (a plan with micro-batches
    runs on that mesh plus a virtual micro-batch axis, which the user never wrote)."""
    mesh, m = user_mesh_layout(plan)[0], num_microbatches(plan)
    if m > 1 and mesh.axes == comm.mesh.axes:
        return message(f"executor: the plan runs {m} micro-batches per step, and communicator mesh '{comm.mesh}' "
                       "holds one per rank.", inputs=[f"mesh: {mesh}", f"micro-batches: {m}"],
                       rule="a plan with micro-batches runs on its mesh with a virtual micro-batch axis, plan.mesh",
                       fix="pass md.SimulatedComm(plan.mesh) (every rank and micro-batch in this process), or on "
                           "real processes meshdsl.comm.microbatch.for_plan(comm, plan); md.TrainStep does this for you")
    return about_plan(message(f"executor: plan mesh '{plan.mesh}' differs from communicator mesh '{comm.mesh}'.",
                              rule="a plan runs on the mesh it was compiled for",
                              fix="compile with the same mesh string"), plan)



class _FeedOf:
    """``executor.feed`` for its step context without a reference back to the executor: the
    executor holds the context (and its prepared steps do), so a bound method there would make
    a cycle, and every dropped executor would wait for the cyclic garbage collector."""

    __slots__ = ("_executor",)

    def __init__(self, executor):
        self._executor = weakref.ref(executor)

    def __call__(self, name, vid, value):
        return self._executor().feed(name, vid, value)

class Executor:
    """Executes ``plan`` for the ranks ``comm`` holds.

    Args:
      plan: a compiled plan.
      comm: SimulatedComm (all ranks) or TorchComm (this process's rank).
      donate_params: updates may overwrite the params they read (a training loop's).
      compile: run each rank's local steps as segments compiled by ``torch.compile``
        (:mod:`.compiled`): True (inductor), a backend name (``"aot_eager"``), or False.
    """

    #: A pipeline stage's B that sends a gradient upstream runs its weight-gradient matmuls
    #: after the send (:mod:`.pipeline`); False runs them inside the B (read when a plan is prepared).
    defer_weight_grads = True
    # Whether per-rank feeds are checked against the plan's local shapes; a layer loop turns
    # it off for its body, which it feeds from the outer plan's own tensors every layer.
    check_feeds = True

    def __init__(self, plan: Plan, comm: Communicator, donate_params: bool = False, compile=False):
        _check_arguments(plan, comm)
        if comm.mesh.size != plan.mesh.size or comm.mesh.axes != plan.mesh.axes:
            raise GraphError(_mesh_mismatch(plan, comm))
        self.plan, self.comm = plan, comm
        #: how runs of local steps are compiled (:mod:`.compiled`); None: eager
        self.compiling = settings_of(compile)
        #: where params are made and feeds are moved (the communicator's device)
        self.device = comm.device
        steps = plan.steps
        self.order = issue_order(plan, comm.async_kinds)
        last_use: dict[int, int] = {}
        for i in self.order:
            for v in steps[i].ins:
                last_use[v] = i
        keep = set(plan.outputs.values())
        self.free_after: list[tuple[int, ...]] = [()] * len(steps)
        for v, i in last_use.items():
            if v not in keep:
                self.free_after[i] += (v,)
        # With donate_params (a training loop that replaces its params by the updated
        # ones), a kernel with an in-place variant that is the last reader of the params
        # it writes into (the param, an optimizer's state) overwrites them.  Only where the
        # step runs once per process (one held rank, or one micro-batch rank for all: see
        # steps.representatives): simulated ranks may share a replicated tensor.
        #: whether this executor may overwrite its params (a pipeline's final segment asks too)
        self.donates = bool(donate_params) and len({real_rank(comm.mesh, r) for r in comm.ranks}) == 1
        donated: set[int] = set()
        if self.donates:
            params = donatable_params(steps, {s.outs[0] for s in steps if s.kind == "param"}, keep)
            donated = {i for i in donating_steps(steps, params, last_use)
                       if len(comm.ranks) == 1 or representatives(plan, comm, steps[i]) is not None}
        #: What the step rules see (:class:`.context.StepContext`).
        self.ctx = StepContext(plan, comm, feed=_FeedOf(self), donated=frozenset(donated),
                               add_into=inplace_adds(plan), defer_weight_grads=self.defer_weight_grads,
                               donates=self.donates, compile=self.compiling)
        self._leaves = {s.outs[0]: s.args["tensor"] for s in steps if s.kind in ("input", "param")}
        self._slice_idx: dict[int, list[tuple]] = {}
        self._local_shape: dict[int, list[tuple[int, ...]]] = {}  # value id -> each held rank's
        self._feed_want: dict[int, tuple] = {}   # input value id -> its full sizes and dtype
        # One prepared callable per step: the run loop dispatches by index, not by kind.
        self.calls = [rule_for(s.kind)(self.ctx, i, s) for i, s in enumerate(steps)]
        #: each step's call as its rule made it (a loop may replace some of ``calls``: .deferred)
        self.rules = tuple(self.calls)
        self._programs = [None, None]   # the straight-line program (.program), untimed and timed
        self.whole = None   # --compile: the run as one compiled graph (.whole), False where it cannot be
        self._needs = (frozenset(s.args["name"] for s in steps if s.kind == "input"),
                       frozenset(s.args["name"] for s in steps if s.kind == "param"))
        # Steps with sub-plans are timed by their sub-plans' own steps.
        self._timed = [None if s.subplans else s.kind for s in steps]

    @property
    def donated(self) -> frozenset:
        """Step indices whose in-place kernel overwrites the params it reads."""
        return self.ctx.donated

    @property
    def add_into(self) -> dict:
        """Add steps that write into an operand no one else reads (:func:`.steps.inplace_adds`)."""
        return self.ctx.add_into

    @property
    def last_timeline(self):
        """Per stage, the ``(action, start, end)`` of the last pipelined run (see :mod:`.pipeline`)."""
        return self.ctx.timeline

    # -- params and feeds
    def local_slices(self, value: Value, full: torch.Tensor) -> list:
        """Each held rank's slice of ``full`` (indices worked out once per value); ``None`` on a
        rank that does not hold the value (a pipeline stage that never reads it)."""
        idx = self._slice_idx.get(value.id)
        if idx is None:
            holders = self.plan.holders.get(value.id)
            idx = self._slice_idx[value.id] = [
                _local_index(value, self.plan.mesh, r) if holders is None or r in holders else None
                for r in self.comm.ranks]
        return [None if i is None else full.contiguous() if i is ... else full[i].contiguous() for i in idx]

    def init_params(self, seed: int = 0) -> dict[str, list[torch.Tensor]]:
        """Every param's local slices, from the layout-independent init."""
        from ..ops.leaf import init_value
        out = {}
        for s in self.plan.steps:
            if s.kind == "param":
                node = s.args["tensor"]
                out[s.args["name"]] = self.local_slices(self.plan.values[s.outs[0]], init_value(node, seed).to(self.device))
        return out

    def feed(self, name, vid, value) -> list[torch.Tensor]:
        """The held ranks' slices of feed ``value`` for input ``name`` (value ``vid``), checked."""
        if isinstance(value, PerRank) and not self.check_feeds:
            return list(value) if self.device.type == "cpu" else [x.to(self.device) for x in value]
        v = self.plan.values[vid]
        if isinstance(value, PerRank):
            if len(value) != len(self.comm.ranks):
                raise GraphError(message(f"feed '{name}': {len(value)} slices for {len(self.comm.ranks)} rank(s).",
                                         rule="per-rank feeds give one local slice per rank held",
                                         fix="pass one tensor per rank, or the full tensor"))
            wants = self._local_shape.get(vid)
            if wants is None:  # a loop feeds its body every layer: worked out once
                wants = self._local_shape[vid] = [v.local_shape(self.plan.mesh, r) for r in self.comm.ranks]
            for x, want in zip(value, wants):
                if tuple(x.shape) != want:
                    raise GraphError(message(f"feed '{name}': local slice shape {tuple(x.shape)} != {want}.",
                                             inputs=[f"layout of '{name}': {v.sharding}"],
                                             rule="a per-rank slice has the local shape the layout gives",
                                             fix=f"slice it to {want} or feed the full tensor"))
            return [x.to(self.device) for x in value]
        want = self._feed_want.get(vid)   # (the input's sizes and dtype, worked out once)
        if want is None:
            t = self.plan_tensor(name, vid)
            want = self._feed_want[vid] = (t.shape.sizes, t.dtype)
        if type(value) is not torch.Tensor or value.shape != want[0] or value.dtype is not want[1]:
            check_feed(self.plan_tensor(name, vid), value)   # (raises the error, if any)
        return self.local_slices(v, value if value.device == self.device else value.to(self.device))

    def plan_tensor(self, name, vid):
        try:
            return self._leaves[vid]
        except KeyError:
            raise KeyError(name) from None

    # -- running
    def run(self, feeds: dict | None = None, params: dict | None = None, salt: int = 0,
            stats: dict | None = None, prefetched: dict | None = None) -> dict[str, list[torch.Tensor]]:
        """Run the plan; returns output name -> local tensors (one per held rank).

        With ``stats`` (a dict), seconds spent per step kind are added to it, and
        time blocked on collectives in flight under 'wait' (a ``--compile`` whole step, one
        graph, adds its time under 'local').  ``prefetched`` maps value
        ids to collectives started before the run (:mod:`.prefetch`); their steps are skipped.

        Raises:
          GraphError: a missing feed or param, a bad feed, or a feed no input of the plan reads.
        """
        feeds = feeds_dict("Executor.run", feeds)
        if not feeds.keys() <= self.plan.inputs.keys():
            check_no_extra_feeds("Executor.run", feeds, self.plan.inputs)
        if params is None:
            params = self.init_params()
        env: dict[int, list] = dict(prefetched) if prefetched else {}
        run = _Run(feeds, params, salt, stats)
        if self._needs[0] <= feeds.keys() and self._needs[1] <= params.keys():
            whole = whole_step(self) if self.compiling is not None and not prefetched else None
            t0 = time.perf_counter()
            out = whole(feeds, params) if whole is not None else None   # --compile: one graph (.whole)
            if out is not None and stats is not None:   # one graph, every rank here: all of it is compute
                stats["local"] = stats.get("local", 0.0) + time.perf_counter() - t0
            return out if out is not None else self._run_program(env, run)
        # A feed or param is missing: the step-by-step loop raises its step's error.
        clock = time.perf_counter if stats is not None else None

        def get(v):
            x = env[v]
            if isinstance(x, Pending):
                if clock:
                    t0 = clock()
                    x = env[v] = x.wait()
                    stats["wait"] = stats.get("wait", 0.0) + clock() - t0
                else:
                    x = env[v] = x.wait()
            return x

        calls, free_after, timed = self.calls, self.free_after, self._timed
        order = self.order if not prefetched else \
            [i for i in self.order if self.plan.steps[i].outs[0] not in prefetched]
        with running_on(self.device):  # where kernels with no tensor inputs allocate
            for i in order:
                if clock:
                    t0, waited = clock(), stats.get("wait", 0.0)
                calls[i](env, get, run)
                for v in free_after[i]:
                    x = env.pop(v, None)
                    if isinstance(x, Pending):
                        x.wait()
                if clock and timed[i]:
                    k = timed[i]
                    stats[k] = stats.get(k, 0.0) + clock() - t0 - (stats.get("wait", 0.0) - waited)
        return {name: get(vid) for name, vid in self.plan.outputs.items()}

    def _run_program(self, env: dict, run: _Run) -> dict[str, list]:
        """Run the straight-line program (:mod:`.program`): what ``run`` does without ``stats``."""
        stats = run.stats
        program = self._programs[stats is not None]
        if program is None:
            units = units_of(self)
            if self.compiling is not None:
                units = segments_of(self, units, self.compiling)
            program = self._programs[stats is not None] = build(self, units, timed=stats is not None)

        get = waiting_getter(env, stats)
        if run_device() is self.device:   # a loop's body, run inside its plan's run
            return program(env, get, run)
        with running_on(self.device):  # where kernels with no tensor inputs allocate
            return program(env, get, run)

    # -- assembling full tensors
    def to_full(self, vid: int, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Gather (and reduce) value ``vid``'s local tensors into full tensors on every held rank."""
        v = self.plan.values[vid]
        rep = Sharding.replicated(v.shape)
        for m in plan_moves(v.shape, v.sharding, rep, self.plan.mesh):
            xs = run_collective(self.comm, m.kind, xs, m.axes, _gather_args(m, v, self.plan.mesh))
        return [_in_order(v, self.plan.mesh, x) for x in xs] if v.sharding.cyclic else xs

    def full_outputs(self, outs: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Full output tensors (as seen by the first held rank that holds them)."""
        return {k: self.to_full_held(self.plan.outputs[k], xs) for k, xs in outs.items()}

    def to_full_held(self, vid: int, xs: list):
        """The full tensor of value ``vid`` from the held ranks that hold it (a pipeline keeps
        some values on some stages only); None if this process holds none of them."""
        holders = self.plan.holders.get(vid)
        if holders is None:
            return self.to_full(vid, xs)[0]
        pos = [j for j, r in enumerate(self.comm.ranks) if r in holders]
        if not pos:
            return None
        ranks = tuple(self.comm.ranks[j] for j in pos)
        if ranks == tuple(self.comm.ranks):
            return self.to_full(vid, xs)[0]
        v = self.plan.values[vid]
        comm = self.comm.view(ranks)
        part = [xs[j] for j in pos]
        for m in plan_moves(v.shape, v.sharding, Sharding.replicated(v.shape), self.plan.mesh):
            part = run_collective(comm, m.kind, part, m.axes, _gather_args(m, v, self.plan.mesh))
        return _in_order(v, self.plan.mesh, part[0]) if v.sharding.cyclic else part[0]


def _gather_args(m, v: Value, mesh) -> dict:
    """The args of move ``m`` gathering value ``v``: a dim with given part lengths (a pipeline's
    layers stored where its unequal stages run them, ``Sharding.parts``) carries them."""
    args = move_args(m, v.shape, mesh)
    given = v.sharding.given_parts.get(m.dim) if m.kind == "allgather" and v.sharding.parts else None
    if given:
        args = {**args, "uneven": ((v.shape.index(m.dim), v.shape.get(m.dim).size, (), given),)}
    return args


def _in_order(v: Value, mesh, x: torch.Tensor) -> torch.Tensor:
    """A gathered ``x`` of value ``v`` with each block-cyclic dim's blocks (joined rank by rank)
    put back in the global order (``Sharding.cyclic``, of its given lengths: ``Sharding.blocks``)."""
    for name, blocks in v.sharding.cyclic:
        p = mesh.axis_size(v.sharding.axes_of(name))
        order = cyclic_order(v.shape.get(name).size, p, blocks, v.sharding.given_blocks.get(name))
        x = x.index_select(v.shape.index(name), torch.tensor(order, device=x.device))
    return x
