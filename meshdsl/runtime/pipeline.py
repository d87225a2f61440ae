"""Running a ``pipeline`` step: the schedule's actions over stage views of the communicator.

The step carries a :class:`~meshdsl.lowering.pipeline_program.PipelineProgram` (lowering
builds it: :mod:`meshdsl.lowering.partition`): four segments (prologue, forward, backward,
final), each step with the stages that run it, and per stage its ordered actions, with the
values each one frees.  Here that program is run:

* the prologue runs once, each step on the ranks of its stages;
* each schedule action runs on a *view*: the ranks of one stage and one
  micro-batch (the virtual micro-batch ranks, see :mod:`meshdsl.lowering.pipeline`).
  ``F`` runs the forward segment's steps of that stage, ``B`` the backward
  segment's; ``send_*``/``recv_*`` move the carry (or its gradient) to the next
  stage (or the previous one) by ``send``/``recv``.  A B that sends a gradient
  upstream puts its loop's weight-gradient matmuls off until the send has gone
  (:class:`~.deferred.Deferred`): they run as a ``W`` entry right after it, so the
  stage upstream starts its backward while this one finishes the weight gradients;
* the final segment runs once after all micro-batches (gradient accumulation,
  updates), and the sends still in flight are waited for.

A micro-batch's activations are dropped from a stage after its last action there, and
freed (their memory given back) before the stage's next F, B or W, or sooner while a
receive waits for its message: the transfers after that action do not wait for the frees.
Its partial sums over the micro-batches (gradients, the loss) are added in place into one
buffer per value (:class:`~.pipeline_store.Accumulator`); the final segment's
allreduce over the micro-batch axis then reduces only that buffer over its other
axes.  On real processes the carry's transfers take the communicator's pipeline path
(``Communicator.open_pipe``, made at the first run: shared memory between the processes
of one host, :mod:`.shm_pipe`), each bound to it once (``Communicator.pipe_link``): the
layer loop whose result a send takes next writes its last layer's sum straight into the
slot that send then publishes (:mod:`.carry_out`; where nothing else on the rank reads the
value and the ring has a free slot, else the send copies it there), and a receive hands
the next action a view of the slot, held until the micro-batch finishes on its stage, where the schedule lets its sender
go on writing meanwhile (:func:`~.pipeline_store.slot_holds`; else it copies the message
out).  What outlives the micro-batch (a running sum, a step output) is copied out of the
slot before it is released.  Where a transfer has no such path (gloo), a stage posts the receive of
its next carry (or carry gradient) as soon as it has taken the previous one, so the
message arrives while it computes; sends are asynchronous and waited for at the end of
the step.  All of this is prepared once per plan: a run walks a list of ready calls.

Values live in one store, per value and rank, so a view reads and writes only its
own ranks.  The simulated mesh holds every stage: it runs all ranks' actions in one
order that respects their dependencies (the unit-cost simulation's); a
torch.distributed process runs its own stage's list.  Each action's wall-clock
start and end are recorded per stage in :attr:`Executor.last_timeline`, ready for
:func:`meshdsl.lowering.timeline.bubble_from_timeline`.
"""
from __future__ import annotations

import time

import torch

from ..ir.repeat import LayerStack
from ..lowering.pipeline import varies_by_microbatch
from ..lowering.pipeline_program import PER_MICROBATCH, PipelineProgram, Segment, StageAction
from ..lowering.schedule import COMPUTE
from .executor import donatable_params, donating_steps
from .pipeline_store import Accumulator, slot_holds, view_env
from .deferred import Deferred, adding_into_sum, product_sums
from .context import StepContext
from .steps import one_per_real_rank, representatives, rule_for, step_rule


def _view(comm, ranks):
    ranks = tuple(ranks)
    return comm if ranks == tuple(comm.ranks) else comm.view(ranks)


@step_rule("pipeline")
@step_rule("accumulate")
def _prepare_pipeline(ctx, i, step):
    return _Runner(ctx, step).call


class _Runner:
    """A pipeline step prepared once for the ranks ``ctx.comm`` holds: its program's actions
    as ready calls, run by :meth:`call`."""

    def __init__(self, ctx, step):
        prog: PipelineProgram = step.args["program"]
        self.ctx, self.step, self.prog = ctx, step, prog
        self.plan, self.comm, mesh = ctx.plan, ctx.comm, ctx.plan.mesh
        self.coords = {r: mesh.coords(r) for r in self.comm.ranks}  # an accumulate step: one stage, no axis
        self.rank_of = {r: c[prog.axis] if prog.axis is not None else 0 for r, c in self.coords.items()}
        held = set(self.rank_of.values())
        self.held_ranks = sorted(held)
        self.held_stages = [s for s in range(prog.num_stages) if prog.rank_of(s) in held]
        mb_axis = prog.mb_axis
        # Each held rank's micro-batch-0 twin: the rank a micro-batch sum accumulates on.
        base = {r: r if mb_axis is None else mesh.rank({**c, mb_axis: 0}) for r, c in self.coords.items()}
        self.store: dict = {}   # value id -> {rank: tensor}, for one run
        # The products of matmuls that only the final segment's sums read, and the backward loops'
        # stacked gradients: later micro-batches add into the first one's (Accumulator.into).
        self.sums = product_sums(prog.segments[Segment.BACKWARD], prog.read_in_schedule)
        self.acc = Accumulator(self.store, base, mb_axis, prog.folded, prog.loop_grads | set(self.sums))
        made = {stage: prog.made(Segment.BACKWARD, stage) for stage in self.held_stages}
        # Per stage: the loops' gradients (they may wait for a W), and the sums added into.
        self.later = {stage: tuple(v for v in vs if v in prog.loop_grads) for stage, vs in made.items()}
        self.summed = {stage: tuple(v for v in vs if v in self.acc.fresh) for stage, vs in made.items()}
        self.views: dict = {}
        self.donations = _final_donations(self.plan, step) if ctx.donates else set()
        # Receives of the carry are posted ahead on real processes: the next one of each kind as
        # soon as the previous one is taken, so the message lands while the stage computes.
        self.early = len(self.held_ranks) == 1 and "recv" in self.comm.async_kinds
        self.deferred: dict = {}   # (stage, micro-batch) -> its B's Deferred
        self.posted: dict = {}     # carry kind -> receives of that kind, in run order
        self.sends: list = []      # the carry's sends (real processes)
        self.garbage: list = []    # finished micro-batches' activations, freed before the next compute
        self.receives: dict = {}   # position in the actions -> its carry receive (real processes)
        self.loops: dict = {}      # position in the actions -> {value a loop step makes: its prepared call}
        self.send_at: dict = {}    # position in the actions -> its carry send (real processes)
        self.actions = [self._action(k, a) for k, a in enumerate(self._order())]
        self.releases: list = [()] * len(self.actions)   # per action: the receives whose slots it releases
        # The values that outlive a micro-batch on this rank's stages besides its sums (a held
        # receive's slot must not be one's memory once released).
        self.outliving = tuple(dict.fromkeys(v for stage in self.held_stages for seg in PER_MICROBATCH
                                             for v in prog.made(seg, stage) if v in prog.kept and v not in prog.folded))
        self.first_posts: list = []
        self.head, self.tail = self._once(Segment.PROLOGUE), self._once(Segment.FINAL)
        self.opened = False

    def _order(self) -> tuple[StageAction, ...]:
        """The actions to run: one rank's list, or every rank's in the program's order."""
        defer = self.ctx.defer_weight_grads
        if len(self.held_ranks) == 1:
            return self.prog.actions(defer)[self.held_ranks[0]]
        return self.prog.order(defer)

    def view_of(self, stages: frozenset, mb=None):
        """The communicator's view of the ranks running ``stages`` (for micro-batch ``mb``)."""
        key = (stages, mb)
        if key not in self.views:
            mb_axis, ranks_of = self.prog.mb_axis, {self.prog.rank_of(s) for s in stages}
            ranks = tuple(r for r in self.comm.ranks if self.rank_of[r] in ranks_of
                          and (mb is None or mb_axis is None or self.coords[r][mb_axis] == mb))
            self.views[key] = _view(self.comm, ranks) if ranks else None
        return self.views[key]

    def _transfer(self, s, view):
        """A send or receive of ``view``.  One whose value does not vary by micro-batch (in the
        prologue or the final segment) moves once per real rank: its representatives send,
        receive, and share."""
        same = not (self.prog.is_carry(s) or varies_by_microbatch(s, self.plan.values))
        tw = one_per_real_rank(self.plan.mesh, view.ranks) if same else None
        reps = view if tw is None else _view(view, [view.ranks[k] for k in tw[0]])
        # The carry's path (shared memory between the processes of a host) takes any transfer
        # between stages its channels connect, not the carry's only.
        pipe = s.args["offset"] in self.prog.carry_offsets
        if s.kind == "recv":
            recv = _Recv(s, self.store, reps, self.plan, pipe)
            if tw is None:
                return recv.run
            env, out = view_env(self.store, view.ranks), s.outs[0]

            def shared(run):
                got = recv.view.collective("recv", recv.templates, recv.axes, recv.args)
                env[out] = [got[k] for k in tw[1]]
            return shared
        env, (src,), axes = view_env(self.store, reps.ranks), s.ins, s.axes
        args = {"offset": s.args["offset"], "tag": s.args["tag"], "pipe": pipe}
        return lambda run: reps.collective("send", _sendable(env.get(src)), axes, args)  # noqa: E731

    def prepared(self, seg: Segment, j: int, stages: tuple, view):
        """Step ``j`` of segment ``seg`` on ``view``, prepared once: a function of the run."""
        s, prog, store = self.prog.segments[seg].steps[j], self.prog, self.store
        if s.kind in ("allreduce", "bucket_allreduce") and all(v in self.acc.ops for v in s.ins):
            go = self.acc.reduce_step(s, view, self.view_of(frozenset(stages), 0))
        elif s.kind in ("send", "recv"):
            go = self._transfer(s, view)
        else:
            env = view_env(store, view.ranks)
            offset = prog.layer_offset(seg, j, stages[0]) if len(stages) == 1 else 0
            # Segments share values across actions (a forward's result is read by the backward):
            # their adds stay out of place (no add_into).
            sx = StepContext(self.plan, view, layer_offset=offset, defer_weight_grads=self.ctx.defer_weight_grads,
                             compile=self.ctx.compile)   # a loop's body compiles (--compile); other steps stay eager
            if seg == Segment.FINAL and j in self.donations and (
                    len(view.ranks) == 1 or representatives(self.plan, view, s) is not None):
                sx.donated = frozenset({j})   # the update overwrites its param (see Executor.donated)
            call = rule_for(s.kind)(sx, j, s)
            if seg == Segment.BACKWARD and s.outs and self.sums.get(s.outs[0]) == j:
                call = adding_into_sum(call, s)
            bound = _bound(call, env, None if s.subplans else s.kind)   # a repeat times its own steps
            bound.carry_out = getattr(call, "carry_out", None)   # (a loop: its result made in a send's slot)
            return bound
        return go if s.subplans else _timed(s.kind, go)

    def _once(self, seg: Segment) -> list:
        """The calls of a segment run once per step (the prologue, the final segment); a value
        only a send of it reads is dropped once sent."""
        sent_only = self._sent_only(seg)
        out = []
        for j, st in enumerate(self.prog.stages[seg]):
            view = self.view_of(frozenset(st))
            if view is not None:
                out.append(self.prepared(seg, j, st, view))
                if j in sent_only:
                    out.append(_dropper(self.store, view.ranks, sent_only[j]))
        return out

    def _sent_only(self, seg: Segment) -> dict[int, tuple[int, ...]]:
        """Position of a send in ``seg`` -> the value it sends, where that send is its one reader
        (in every segment) and it is no output of the step."""
        readers: dict = {}
        for g in Segment:
            for j, s in enumerate(self.prog.segments[g].steps):
                for v in s.ins:
                    readers.setdefault(v, []).append((g, j))
        keep = set(self.prog.outputs) | set(self.step.outs)
        return {j: (s.ins[0],) for j, s in enumerate(self.prog.segments[seg].steps)
                if s.kind == "send" and readers[s.ins[0]] == [(seg, j)] and s.ins[0] not in keep}

    def _action(self, k: int, sa: StageAction) -> tuple:
        """``(rank, action, calls, finished, compute)`` of entry ``k`` of a rank's list; ``finished``:
        the ranks and the values to drop when the entry ends its micro-batch on its stage, else
        None; ``compute``: whether it is an F, B or W (what was dropped is freed before it runs).
        An entry that finishes its micro-batch adds, as its last call, the gradients it made into
        the step's sums: that addition is its backward's work (a loop's gradients are added in
        place by the loop itself)."""
        act, seg, stage = sa.action, sa.segment, sa.action.stage
        key, rank = (stage, act.microbatch), self.prog.rank_of(stage)
        view = self.view_of(frozenset({stage}), act.microbatch)
        finished = None if sa.finishes is None else (view.ranks, sa.finishes)
        summing = [] if sa.finishes is None else [_summing(self.acc, self.acc.keyed(view.ranks, sa.accumulates))]
        if act.kind == "W":   # the put-off weight-gradient matmuls of its B (see .deferred)
            return rank, act, [_timed("local", _flushing(self.deferred[key])), *summing], finished, True
        summed, frees, calls = self.summed[stage] if act.kind == "B" else (), dict(sa.frees), []
        if summed:
            calls.append(_adding_into(self.acc, self.acc.keyed(view.ranks, summed)))
        steps = self.prog.segments[seg].steps
        # a transfer inside a compute action (a tensor read from outside the layers, sent on with
        # the carry) may take the ring's next slot: then no loop of it writes into a reserved one
        transfers = any(steps[j].kind in ("send", "recv") for j in sa.steps) if act.kind in COMPUTE else True
        for j in sa.steps:
            if act.kind in COMPUTE:
                calls.append(self.prepared(seg, j, (stage,), view))
                if getattr(calls[-1], "carry_out", None) is not None and not transfers:
                    self.loops.setdefault(k, {})[steps[j].outs[0]] = calls[-1]
                if j in frees:
                    calls.append(_dropper(self.store, view.ranks, frees[j]))
            elif act.is_recv and self.early:
                r = _Recv(steps[j], self.store, view, self.plan, pipe=True, garbage=self.garbage)
                self.posted.setdefault(act.kind, []).append(r)
                self.receives[k] = r
                calls.append(_timed("recv", r.take))
            elif act.is_send and self.early and self.prog.is_carry(steps[j]):
                send = _Send(steps[j], self.store, view, self.plan, steps[j].args["offset"] in self.prog.carry_offsets)
                self.sends.append(send)
                if len(sa.steps) == 1:   # (several sends share the ring: the reserved slot could go to another)
                    self.send_at[k] = send
                calls.append(_timed("send", send.run))
            else:
                calls.append(self.prepared(seg, j, (stage,), view))
        if summed:
            calls.append(_done)
        if sa.defers:   # the B's weight-gradient matmuls wait for its W, after the send
            self.deferred[key] = Deferred(self.later[stage])
            calls = [_deferring(self.deferred[key]), *calls, _done]
        return rank, act, [*calls, *summing], finished, act.kind in COMPUTE

    def _bind(self) -> None:
        """Bind the carry's transfers to the communicator's pipeline path (at the first run, once
        it is open), and chain the receives that still go through ``start``: taking one posts
        the next (a bound receive needs no posting: its sender writes the message into shared
        memory, whenever it comes)."""
        for t in (*self.sends, *(r for rs in self.posted.values() for r in rs)):
            t.bind()
        self._hold_slots()
        self._sends_in_place()
        for rs in self.posted.values():
            for r, nxt in zip(rs, rs[1:]):
                r.then = nxt.post if nxt.link is None else None
        self.first_posts = [rs[0].post for rs in self.posted.values() if rs[0].link is None]

    def _sends_in_place(self) -> None:
        """Let each bound carry send whose value the loop of the action just before it makes (that
        stage's and micro-batch's), and that nothing but sends reads, have the loop write that value
        into the slot the send then publishes (:meth:`PipeLink.reserve`, :mod:`.carry_out`): asked
        for right before the loop runs; nothing else sends between (the next entry is the send)."""
        rows = [a for _, a, *_ in self.actions]
        for k, send in self.send_at.items():
            maker = self.loops.get(k - 1, {}).get(send.src)
            if (maker is None or send.link is None or not hasattr(send.link, "reserve")
                    or (rows[k - 1].stage, rows[k - 1].microbatch) != (rows[k].stage, rows[k].microbatch)
                    or not self._only_sent(send.src, rows[k].stage)):
                continue
            carry = maker.carry_out()
            if carry is not None:
                calls = self.actions[k - 1][2]
                calls.insert(calls.index(maker), _reserving(send.link, carry))

    def _only_sent(self, v: int, stage: int) -> bool:
        """Whether value ``v`` is read on ``stage``'s rank by sends only, one of them on ``stage``,
        and outlives no micro-batch (no step output, no final-segment input, no sum): then it may
        live in the slot its send hands to its receiver."""
        prog = self.prog
        rank = prog.rank_of(stage)
        readers = [(s, stages) for seg in Segment for s, stages in zip(prog.segments[seg].steps, prog.stages[seg])
                   if v in s.ins and any(prog.rank_of(t) == rank for t in stages)]
        return (all(s.kind == "send" for s, _ in readers) and sum(stage in st for _, st in readers) == 1
                and v not in prog.kept and v not in self.step.outs)

    def _hold_slots(self) -> None:
        """Let the bound receives that the schedule allows read their messages in place (see
        :func:`~.pipeline_store.slot_holds`), each released after the last action that drops what
        its stage made for its micro-batch."""
        links = [r.link for r in self.receives.values() if r.link is not None and hasattr(r.link, "release")]
        if not links or len(self.held_ranks) != 1:
            return
        holds = slot_holds(self.prog, self.ctx.defer_weight_grads, self.held_ranks[0], links[0].slots)
        releases: dict = {}
        for k, end in holds.items():
            r = self.receives[k]
            if r.link is not None and hasattr(r.link, "release"):
                r.hold = True
                releases.setdefault(end, []).append(r)
        for end, rs in releases.items():
            self.releases[end] = (self.outliving, tuple(rs))
        self.acc.borrowed = links[0].borrows

    def _release(self, ranks, releasing) -> None:
        """Give the slots of ``releasing``'s receives back (their micro-batch is done on the
        stage), after copying out of them what outlives it there."""
        outliving, receives = releasing
        store, borrows = self.store, receives[0].link.borrows
        for v in outliving:
            slot = store.get(v)
            for r in ranks:
                x = None if slot is None else slot.get(r)
                if isinstance(x, LayerStack):   # saved layer inputs: the first may be a received carry
                    if any(borrows(t) for t in x):
                        slot[r] = LayerStack(t.clone() if borrows(t) else t for t in x)
                elif x is not None and borrows(x):
                    slot[r] = x.clone()
        for r in receives:
            r.link.release()

    def call(self, env, get, run):
        comm, store, acc, step = self.comm, self.store, self.acc, self.step
        # The carry's transfers may take a faster path than the communicator's plain send and
        # receive (shared memory between processes of one host: .shm_pipe); made at the first run,
        # where every rank runs this step.
        if not self.opened:
            if self.prog.carry_offsets:
                comm.open_pipe((self.prog.axis,), list(self.prog.carry_offsets))
            self._bind()
            self.opened = True
        store.clear()
        acc.clear()
        self.garbage.clear()
        for v in step.ins:
            store[v] = {r: x for r, x in zip(comm.ranks, get(v)) if x is not None}
        for go in self.head:
            go(run)
        for post in self.first_posts:
            post()
        timeline = {r: [] for r in self.held_ranks}
        clock, garbage, releases = time.perf_counter, self.garbage, self.releases
        for k, (rank, act, calls, finished, compute) in enumerate(self.actions):
            if compute and garbage:   # what no receive's wait freed yet, before this one allocates
                garbage.clear()
            t0 = clock()
            for go in calls:
                go(run)
            timeline[rank].append((act, t0, clock()))
            if finished is not None:  # the micro-batch is done on this stage: out of the store
                ranks, dropped = finished
                for v in dropped:
                    slot = store.get(v)
                    if slot:
                        for r in ranks:
                            x = slot.pop(r, None)
                            if x is not None:
                                garbage.append(x)
                if releases[k]:
                    self._release(ranks, releases[k])
        garbage.clear()
        for go in self.tail:
            go(run)
        comm.drain()
        for v in step.outs:
            slot = store.get(v, {})
            env[v] = [slot.get(r) for r in comm.ranks]
        store.clear()
        acc.clear()
        self.ctx.timeline = tuple(tuple(timeline[r]) for r in self.held_ranks)


def _final_donations(plan, step) -> set[int]:
    """Positions in the final segment of the updates that may overwrite their params: every
    action has run by then, so the rule is the executor's over all the pipeline's steps."""
    top = [s for s in plan.steps if s is not step]   # the pipeline step itself reads every param
    inner = [s for sub in step.subplans for s in sub.steps]
    params = donatable_params(top + inner, {s.outs[0] for s in top if s.kind == "param"},
                              set(plan.outputs.values()))
    final = step.subplans[3].steps
    last_use = {v: j for j, s in enumerate(final) for v in s.ins}
    return donating_steps(final, params, last_use)


def _adding_into(acc, keyed):
    """Sets ``run.into`` for a B action: the running sums its loop adds the ``keyed`` values
    into (:meth:`Accumulator.keyed`)."""
    def go(run):
        run.into = acc.into(keyed)
    return go


def _summing(acc, keyed):
    """The last call of the entry that ends a micro-batch on its stage: the gradients (and the
    loss) it made added into the step's running sums (:meth:`Accumulator.add`)."""
    def go(run):
        acc.add(keyed)
    return go


def _deferring(deferred):
    """Sets ``run.defer`` for a B action whose weight-gradient matmuls wait for its send."""
    def go(run):
        run.defer = deferred
    return go


def _reserving(link, carry):
    """Before a loop whose result ``link`` sends next: the slot that send will publish, for the
    loop's last add to write into (:class:`~.carry_out.CarryOut`; none where the ring has no
    free slot now: the send copies)."""
    def go(run):
        slot = link.reserve()
        carry.want = None if slot is None else [slot]
    return go


def _done(run):
    """Clears ``run.into`` and ``run.defer`` after a B action."""
    run.into = run.defer = None


def _flushing(deferred):
    """The W entry after a B's send: its put-off weight-gradient matmuls."""
    def go(run):
        deferred.run()
    return go


def _dropper(store, ranks, values):
    def drop(run):
        for v in values:
            for r in ranks:
                store.get(v, {}).pop(r, None)
    return drop


def _bound(call, env, kind):
    """A step's prepared ``call`` on ``env``, as a function of the run; timed as :func:`_timed`
    (one frame less per call: a step runs several per action) unless ``kind`` is None."""
    get = env.get
    if kind is None:
        return lambda run: call(env, get, run)  # noqa: E731

    def timed(run):
        if run.stats is None:
            return call(env, get, run)
        t0 = time.perf_counter()
        call(env, get, run)
        run.stats[kind] = run.stats.get(kind, 0.0) + time.perf_counter() - t0
    return timed


def _timed(kind, go):
    """``go``, adding its seconds to the run's stats under ``kind`` when the run is timed."""
    def timed(run):
        if run.stats is None:
            return go(run)
        t0 = time.perf_counter()
        go(run)
        run.stats[kind] = run.stats.get(kind, 0.0) + time.perf_counter() - t0
    return timed


class _Recv:
    """A carry receive on one view: posted (``post``), then taken (``take``, the schedule's action).

    Posted ahead, the transfer runs while the stage computes; ``then`` posts the next
    receive of the same kind once this one is taken.  ``run`` receives at once (the
    simulated mesh, where the message is already in the mailbox).  ``pipe``: the transfer
    may take the communicator's pipeline path (see ``Communicator.open_pipe``).  ``garbage``:
    finished activations that ``take`` frees when it would otherwise wait for the message.
    """

    def __init__(self, s, store, view, plan, pipe: bool, garbage=None):
        v = plan.values[s.outs[0]]
        self.env, self.out, self.view, self.store = view_env(store, view.ranks), s.outs[0], view, store
        self.templates = [torch.empty(v.local_shape(plan.mesh, r), dtype=v.dtype, device=view.device)
                          for r in view.ranks]   # each rank's own shape: an uneven split differs by rank
        self.axes, self.args = s.axes, {"offset": s.args["offset"], "tag": s.args["tag"], "pipe": pipe}
        self.pending, self.then, self.link, self.garbage = None, None, None, garbage
        self.hold = False   # read the message where it lies (its link's slot) until released

    def bind(self) -> None:
        """Take the communicator's bound path (``Communicator.pipe_link``) where it has one."""
        if self.args["pipe"] and len(self.view.ranks) == 1:
            self.link = self.view.pipe_link("recv", self.axes, self.args["offset"], self.args["tag"],
                                            self.templates[0])

    def post(self) -> None:
        self.pending = self.view.start("recv", self.templates, self.axes, self.args)

    def take(self, run) -> None:
        if self.garbage and (self.link is None or not self.link.ready()):
            self.garbage.clear()    # the message is not there yet: free while it comes
        if self.link is not None:   # the slot itself (held), or a copy of it: what the next action reads
            got = self.link.recv(True) if self.hold else self.link.recv()
            self.store.setdefault(self.out, {})[self.view.ranks[0]] = got
        else:
            self.env[self.out] = self.pending
            self.pending = None
        if self.then is not None:
            self.then()

    def run(self, run) -> None:
        self.env[self.out] = self.view.collective("recv", self.templates, self.axes, self.args)


class _Send:
    """A carry send of one view on real processes (the schedule's action): through the
    communicator's bound path once :meth:`bind` found one, else its ``send`` collective."""

    def __init__(self, s, store, view, plan, pipe: bool):
        v = plan.values[s.ins[0]]
        self.store, self.src, self.view = store, s.ins[0], view
        self.like = torch.empty(v.local_shape(plan.mesh, view.ranks[0]), dtype=v.dtype, device=view.device)
        self.axes, self.args = s.axes, {"offset": s.args["offset"], "tag": s.args["tag"], "pipe": pipe}
        self.link = None

    def bind(self) -> None:
        if self.args["pipe"] and len(self.view.ranks) == 1:
            self.link = self.view.pipe_link("send", self.axes, self.args["offset"], self.args["tag"], self.like)

    def run(self, run) -> None:
        if self.link is not None:
            self.link.send(self.store[self.src][self.view.ranks[0]])
        else:
            xs = view_env(self.store, self.view.ranks).get(self.src)
            self.view.collective("send", xs, self.axes, self.args)


def outputs_to_first_rank(comm, plan, full: dict) -> dict:
    """``full`` (name -> full tensor or None) completed on rank 0 of a torch.distributed job.

    A pipeline keeps outputs on the stages that make them (the loss on the last);
    each one rank 0 lacks is sent to it, over the stage axis, by the rank of its first
    holding stage with all other coordinates 0.  Every rank calls this, in the same
    order; a communicator holding every rank (the simulated mesh) has them all already.

    Returns:
      ``full`` with rank 0's missing outputs filled in (other ranks: unchanged).
    """
    pipe = next((s for s in plan.steps if s.kind == "pipeline"), None)
    real = getattr(comm, "real", comm)  # the process's own rank (micro-batches folded)
    if pipe is None or len(real.ranks) != 1:
        return full
    ax, mesh, me = pipe.args["axis"], real.mesh, real.ranks[0]
    out = dict(full)
    for tag, (name, vid) in enumerate(plan.outputs.items()):
        holders = plan.holders.get(vid)
        if holders is None or 0 in holders:  # virtual rank 0 is real rank 0's first micro-batch
            continue
        stage = min(plan.mesh.coords(r)[ax] for r in holders)
        src = mesh.rank({a: (stage if a == ax else 0) for a in mesh.names})
        v = plan.values[vid]
        if me == src:
            real.send([out[name]], (ax,), -stage, tag)
            real.drain()
        elif me == 0:
            out[name] = real.recv([torch.empty(v.shape.sizes, dtype=v.dtype, device=real.device)], (ax,), -stage, tag)[0]
    return out


def _sendable(xs: list) -> list:
    """A send's per-rank tensors. A repeat's saved activations are kept as a list of per-layer
    tensors (a LayerStack) and read back layer by layer; one whose backward runs on another stage
    (a stack before the pipelined one, whose gradient the later stages make) goes as one tensor,
    stacked layer first as the plan's value is shaped, which its backward indexes the same way."""
    return [x.tensor() if isinstance(x, LayerStack) else x for x in xs]
