"""Running a ``pipeline`` step: the schedule's actions over stage views of the communicator.

The step is data (:mod:`meshdsl.lowering.partition` builds it): four segments
(prologue, forward, backward, final), each step with the stages that run it, and
a :class:`~meshdsl.lowering.schedule.Schedule`.  Here:

* the prologue runs once, each step on the ranks of its stages;
* each schedule action runs on a *view*: the ranks of one stage and one
  micro-batch (the virtual micro-batch ranks, see :mod:`meshdsl.lowering.pipeline`).
  ``F`` runs the forward segment's steps of that stage, ``B`` the backward
  segment's; ``send_*``/``recv_*`` move the carry (or its gradient) to the next
  stage (or the previous one) by ``send``/``recv``.  A B that sends a gradient
  upstream puts its loop's weight-gradient matmuls off until the send has gone
  (:class:`~.sink.Deferred`): they run as a ``W`` entry right after it, so the
  stage upstream starts its backward while this one finishes the weight gradients;
* the final segment runs once after all micro-batches (gradient accumulation,
  updates), and the sends still in flight are waited for.

A micro-batch's activations are dropped from a stage after its last action there,
and its partial sums over the micro-batches (gradients, the loss) are added in
place into one buffer per value (:class:`~.pipeline_store.Accumulator`); the final segment's
allreduce over the micro-batch axis then reduces only that buffer over its other
axes.  On real processes a stage posts the receive of its next carry (or carry
gradient) as soon as it has taken the previous one, so the message arrives while
it computes; sends are asynchronous and waited for at the end of the step.  The carry's
transfers ask for the communicator's pipeline path (``Communicator.open_pipe``, made at
the first run: shared memory between the processes of one host, :mod:`.shm_pipe`).  All
of this is prepared once per plan: a run walks a list of ready calls.

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

from ..lowering.partition import pipelined_repeats
from ..lowering.schedule import COMPUTE, Action, split_backward
from ..lowering.timeline import simulate
from .executor import donatable_params, donating_steps
from .pipeline_store import Accumulator, ViewEnv, folded
from .sink import Deferred, adding_into_sum, product_sums
from .steps import rule_for, step_rule, twins

_PHASE = {"F": 1, "send_act": 1, "recv_act": 1, "B": 2, "send_grad": 2, "recv_grad": 2}


class _StageExecutor:
    """What the step rules read from an executor, for one view of the communicator; a stage's
    local layers are layers ``layer_offset``.. of the stack."""

    def __init__(self, plan, comm, layer_offset, donated=frozenset()):
        self.plan, self.comm, self.donated, self.layer_offset = plan, comm, donated, layer_offset
        # Segments share values across actions (a forward's result is read by the backward):
        # their adds stay out of place.
        self.add_into = {}


def _view(comm, ranks):
    ranks = tuple(ranks)
    return comm if ranks == tuple(comm.ranks) else comm.view(ranks)


def _order(schedule, held_stages):
    """(stage, action) pairs to run: one rank's list, or every rank's in a dependency-respecting order."""
    if len(held_stages) == 1:
        (s,) = held_stages
        return [(s, a) for a in schedule.actions[s]]
    timeline = simulate(schedule).timeline
    # A transfer happens when it ends, a compute when it starts; at equal times sends before
    # receives before computes, so every receive finds its message and every compute its input.
    rank_of = {"send": 0, "recv": 1}
    items = []
    for stage, row in enumerate(timeline):
        for a, t0, t1 in row:
            kind = "send" if a.is_send else "recv" if a.is_recv else None
            items.append(((t1 if kind else t0), rank_of.get(kind, 2), stage, a))
    items.sort(key=lambda t: t[:3])
    return [(stage, a) for _, _, stage, a in items]


@step_rule("pipeline")
@step_rule("accumulate")
def _prepare_pipeline(ex, i, step):
    a = step.args
    plan, comm, mesh = ex.plan, ex.comm, ex.plan.mesh
    ax, mb_axis, schedule = a["axis"], a["mb_axis"], a["schedule"]
    prologue, forward, backward, final = step.subplans
    segments = [(prologue.steps, a["stages"][0]), (forward.steps, a["stages"][1]),
                (backward.steps, a["stages"][2]), (final.steps, a["stages"][3])]
    carry = set(a["carry_tags"])
    stacks, local_layers = pipelined_repeats(step)  # (segment, position) of its steps; its layers per stage
    coords = {r: mesh.coords(r) for r in comm.ranks}  # an accumulate step: one stage, no axis
    stage_of = {r: c[ax] if ax is not None else 0 for r, c in coords.items()}
    held_stages = sorted(set(stage_of.values()))
    # Each held rank's micro-batch-0 twin: the rank a micro-batch sum accumulates on.
    base = {r: r if mb_axis is None else mesh.rank({**c, mb_axis: 0}) for r, c in coords.items()}
    store: dict = {}   # value id -> {rank: tensor}, for one run
    # A backward loop's stacked gradients, and the products of matmuls, that only the final
    # segment's sums read: later micro-batches add into the first one's (Accumulator.into).
    read = {v for steps, _ in segments[:3] for s in steps for v in s.ins}
    fresh = {v for s in backward.steps if s.kind == "repeat" for v in s.outs[1:]} - read
    sums = product_sums(backward, read)
    acc = Accumulator(store, base, mb_axis, folded(step, mb_axis), fresh | set(sums))
    # Per stage: the loops' gradients (they may wait for a W), and the sums added into.
    made = {stage: [v for s, st in zip(*segments[2]) if stage in st for v in s.outs] for stage in held_stages}
    later = {stage: tuple(v for v in vs if v in fresh) for stage, vs in made.items()}
    summed = {stage: tuple(v for v in vs if v in acc.fresh) for stage, vs in made.items()}
    views: dict = {}
    final_donations = _final_donations(ex, step) if ex.donates else set()

    def view_of(stages, mb=None):
        key = (stages, mb)
        if key not in views:
            ranks = tuple(r for r in comm.ranks if stage_of[r] in stages
                          and (mb is None or mb_axis is None or coords[r][mb_axis] == mb))
            views[key] = _view(comm, ranks) if ranks else None
        return views[key]

    def prepared(seg, j, stages, view):
        """Step ``j`` of segment ``seg`` on ``view``, prepared once: a function of the run."""
        s = segments[seg][0][j]
        if s.kind in ("allreduce", "bucket_allreduce") and all(v in acc.ops for v in s.ins):
            go = acc.reduce_step(s, view, view_of(frozenset(stages), 0))
        elif s.kind == "recv":
            go = _Recv(s, store, view, plan, s.args["tag"] in carry).run
        elif s.kind == "send":
            env, (src,), axes = ViewEnv(store, view.ranks), s.ins, s.axes
            args = {"offset": s.args["offset"], "tag": s.args["tag"], "pipe": s.args["tag"] in carry}
            go = lambda run: view.collective("send", env.get(src), axes, args)  # noqa: E731
        else:
            env = ViewEnv(store, view.ranks)
            offset = local_layers * stages[0] if len(stages) == 1 and (seg, j) in stacks else 0
            sx = _StageExecutor(plan, view, offset)
            if seg == 3 and j in final_donations and (len(view.ranks) == 1 or twins(sx, s) is not None):
                sx.donated = frozenset({j})   # the update overwrites its param (see Executor.donated)
            call, get = rule_for(s.kind)(sx, j, s), env.get
            if seg == 2 and s.outs and sums.get(s.outs[0]) == j:
                call = adding_into_sum(call, s)
            go = lambda run: call(env, get, run)  # noqa: E731
        return go if s.subplans else _timed(s.kind, go)  # a repeat times its own steps

    def once(seg):
        return [prepared(seg, j, st, view_of(frozenset(st))) for j, st in enumerate(segments[seg][1])
                if view_of(frozenset(st)) is not None]

    # Receives of the carry are posted ahead on real processes: the next one of each kind as
    # soon as the previous one is taken, so the message lands while the stage computes.
    early = len(held_stages) == 1 and "recv" in comm.async_kinds
    # A B that sends its input gradient upstream puts its loop's weight-gradient matmuls
    # off until the send has gone: they run as the W action right after it (see .sink).
    if ex.defer_weight_grads:
        schedule = split_backward(schedule)
    # A W right after its own B (ZB-H1's first rank) is that B's tail: nothing to put off.
    has_w = {(a.stage, a.microbatch) for row in schedule.actions for prev, a in zip((None, *row), row)
             if a.kind == "W" and prev != Action("B", a.microbatch, a.stage)}
    deferred: dict = {}   # (stage, micro-batch) -> its B's Deferred
    order = _order(schedule, held_stages)
    posted: dict = {}   # carry kind -> receives of that kind, in run order
    program = []
    kept = {v for s in final.steps for v in s.ins} | set(step.outs) | set(acc.ops)
    drops = {(seg, stage): _action_drops(segments, seg, stage, kept) for seg in (1, 2) for stage in held_stages}
    for stage, act in order:
        key = (stage, act.microbatch)
        if act.kind == "W":
            if key in deferred:
                program.append((stage, act, [_timed("local", _flushing(deferred[key]))]))
            continue
        seg = _PHASE[act.kind]
        steps, stages = segments[seg]
        view = view_of(frozenset({stage}), act.microbatch)
        thunks = []
        if act.kind == "B" and summed[stage]:
            thunks.append(_adding_into(acc, view.ranks, summed[stage]))
        for j, (s, st) in enumerate(zip(steps, stages)):
            if stage not in st:
                continue
            is_carry = s.kind in ("send", "recv") and s.args["tag"] in carry
            if act.kind in COMPUTE:
                if not is_carry:
                    thunks.append(prepared(seg, j, (stage,), view))
                    dropped = drops[(seg, stage)].get(j)
                    if dropped:
                        thunks.append(_dropper(store, view.ranks, dropped))
            elif is_carry and act.is_recv and s.kind == "recv" and early:
                r = _Recv(s, store, view, plan, pipe=True)
                posted.setdefault(act.kind, []).append(r)
                thunks.append(_timed("recv", r.take))
            elif is_carry and (s.kind == "send") == act.is_send:
                thunks.append(prepared(seg, j, (stage,), view))
        if act.kind == "B" and summed[stage]:
            thunks.append(_done)
        if act.kind == "B" and later[stage] and key in has_w:
            deferred[key] = Deferred(later[stage])
            thunks = [_deferring(deferred[key]), *thunks, _done]
        program.append((stage, act, thunks))
    for rs in posted.values():  # taking one posts the next
        for r, nxt in zip(rs, rs[1:]):
            r.then = nxt.post
    first_posts = [rs[0].post for rs in posted.values()]
    # What one micro-batch makes and only its own actions read (activations, the carry and
    # its gradient): dropped from a stage once its B is done, so a stage holds the
    # activations its schedule keeps in flight, not every micro-batch's.  (Its last action
    # there is its B, or the send of the gradient that B made.)  Its partial sums over the
    # micro-batches go into the accumulator then.
    transient = {stage: tuple({v for seg in (1, 2) for s, st in zip(*segments[seg]) if stage in st
                               for v in s.outs} - kept) for stage in held_stages}
    last = {(stage, a.microbatch): a for stage in held_stages for a in schedule.actions[stage]
            if a.kind != "W" or (stage, a.microbatch) in deferred}
    done = [(view_of(frozenset({stage}), act.microbatch).ranks, transient[stage])
            if last[(stage, act.microbatch)] == act else None for stage, act, _ in program]
    head, tail = once(0), once(3)
    # The carry's transfers may take a faster path than the communicator's plain send and
    # receive (shared memory between processes of one host: .shm_pipe); made at the first run,
    # where every rank runs this step.
    offsets = sorted({s.args["offset"] for seg in (1, 2) for s in segments[seg][0]
                      if s.kind in ("send", "recv") and s.args["tag"] in carry})
    opened = []

    def call(env, get, run):
        if offsets and not opened:
            comm.open_pipe((ax,), offsets)
            opened.append(True)
        store.clear()
        acc.clear()
        for v in step.ins:
            store[v] = {r: x for r, x in zip(comm.ranks, get(v)) if x is not None}
        for go in head:
            go(run)
        for post in first_posts:
            post()
        timeline = {s: [] for s in held_stages}
        clock = time.perf_counter
        for (stage, act, thunks), finished in zip(program, done):
            t0 = clock()
            for go in thunks:
                go(run)
            timeline[stage].append((act, t0, clock()))
            if finished is not None:  # the micro-batch is done on this stage
                ranks, dropped = finished
                for v in dropped:
                    slot = store.get(v)
                    if slot:
                        for r in ranks:
                            slot.pop(r, None)
                acc.add(ranks)
        for go in tail:
            go(run)
        comm.drain()
        for v in step.outs:
            slot = store.get(v, {})
            env[v] = [slot.get(r) for r in comm.ranks]
        store.clear()
        acc.clear()
        ex.last_timeline = tuple(tuple(timeline[s]) for s in held_stages)
    return call


def _final_donations(ex, step) -> set[int]:
    """Positions in the final segment of the updates that may overwrite their params: every
    action has run by then, so the rule is the executor's over all the pipeline's steps."""
    top = [s for s in ex.plan.steps if s is not step]   # the pipeline step itself reads every param
    inner = [s for sub in step.subplans for s in sub.steps]
    params = donatable_params(top + inner, {s.outs[0] for s in top if s.kind == "param"},
                              set(ex.plan.outputs.values()))
    final = step.subplans[3].steps
    last_use = {v: j for j, s in enumerate(final) for v in s.ins}
    return donating_steps(final, params, last_use)


def _action_drops(segments, seg, stage, kept) -> dict[int, tuple]:
    """Step position -> the values ``stage`` drops right after that step of segment ``seg``
    (1: F, 2: B): made there and read only by its compute steps on this stage (not by a
    send, another segment or ``kept``), so dead after their last reader, as in the executor."""
    made = {v for s, st in zip(*segments[seg]) if stage in st for v in s.outs}
    last, shared = {}, set(kept)
    for k, (steps, stages) in enumerate(segments):
        for j, (s, st) in enumerate(zip(steps, stages)):
            for v in s.ins:
                if k != seg or s.kind in ("send", "recv") or stage not in st:
                    shared.add(v)
                else:
                    last[v] = j
    out: dict[int, tuple] = {}
    for v, j in last.items():
        if v in made and v not in shared:
            out[j] = out.get(j, ()) + (v,)
    return out


def _adding_into(acc, ranks, values):
    """Sets ``run.into`` for a B action: the running sums its loop adds ``values`` into."""
    def go(run):
        run.into = acc.into(ranks, values)
    return go


def _deferring(deferred):
    """Sets ``run.defer`` for a B action whose weight-gradient matmuls wait for its send."""
    def go(run):
        run.defer = deferred
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
    may take the communicator's pipeline path (see ``Communicator.open_pipe``).
    """

    def __init__(self, s, store, view, plan, pipe: bool):
        v = plan.values[s.outs[0]]
        self.env, self.out, self.view = ViewEnv(store, view.ranks), s.outs[0], view
        self.templates = [torch.empty(v.local_shape(plan.mesh), dtype=v.dtype, device=view.device)] * len(view.ranks)
        self.axes, self.args = s.axes, {"offset": s.args["offset"], "tag": s.args["tag"], "pipe": pipe}
        self.pending, self.then = None, None

    def post(self) -> None:
        self.pending = self.view.start("recv", self.templates, self.axes, self.args)

    def take(self, run) -> None:
        self.env[self.out] = self.pending
        self.pending = None
        if self.then is not None:
            self.then()

    def run(self, run) -> None:
        self.env[self.out] = self.view.collective("recv", self.templates, self.axes, self.args)


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
