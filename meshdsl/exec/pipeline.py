"""Running a ``pipeline`` step: the schedule's actions over stage views of the communicator.

The step is data (:mod:`meshdsl.lowering.partition` builds it): four segments
(prologue, forward, backward, final), each step with the stages that run it, and
a :class:`~meshdsl.lowering.schedule.Schedule`.  Here:

* the prologue runs once, each step on the ranks of its stages;
* each schedule action runs on a *view*: the ranks of one stage and one
  micro-batch (the virtual micro-batch ranks, see :mod:`meshdsl.lowering.pipeline`).
  ``F`` runs the forward segment's steps of that stage, ``B`` the backward
  segment's; ``send_*``/``recv_*`` move the carry (or its gradient) to the next
  stage (or the previous one) by ``send``/``recv``;
* the final segment runs once after all micro-batches (gradient accumulation,
  updates), and the sends still in flight are waited for.

A micro-batch's activations are dropped from a stage after its last action there.

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

from ..lowering.schedule import COMPUTE
from ..lowering.timeline import simulate
from .comm import Pending
from .steps import rule_for, step_rule

_PHASE = {"F": 1, "send_act": 1, "recv_act": 1, "B": 2, "send_grad": 2, "recv_grad": 2}


class _StageExecutor:
    """What the step rules read from an executor, for one view of the communicator; a stage's
    local layers are layers ``layer_offset``.. of the stack."""

    def __init__(self, plan, comm, layer_offset):
        self.plan, self.comm, self.donated, self.layer_offset = plan, comm, frozenset(), layer_offset


class _ViewEnv:
    """The env a step call writes into: results land in the store at the view's ranks."""

    __slots__ = ("store", "ranks")

    def __init__(self, store, ranks):
        self.store, self.ranks = store, ranks

    def __setitem__(self, vid, xs):
        if isinstance(xs, Pending):
            xs = xs.wait()
        slot = self.store.setdefault(vid, {})
        for r, x in zip(self.ranks, xs):
            if x is not None:
                slot[r] = x

    def get(self, vid):
        slot = self.store[vid]
        return [slot[r] for r in self.ranks]


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
def _prepare_pipeline(ex, i, step):
    a = step.args
    plan, comm, mesh = ex.plan, ex.comm, ex.plan.mesh
    ax, mb_axis, schedule = a["axis"], a["mb_axis"], a["schedule"]
    prologue, forward, backward, final = step.subplans
    segments = [(prologue.steps, a["stages"][0]), (forward.steps, a["stages"][1]),
                (backward.steps, a["stages"][2]), (final.steps, a["stages"][3])]
    carry = set(a["carry_tags"])
    local_layers = next(s.times for s in forward.steps if s.kind == "repeat")
    coords = {r: mesh.coords(r) for r in comm.ranks}
    held_stages = sorted({c[ax] for c in coords.values()})
    views: dict = {}
    calls: dict = {}

    def view_of(stages, mb=None):
        key = (stages, mb)
        if key not in views:
            ranks = tuple(r for r in comm.ranks if coords[r][ax] in stages
                          and (mb is None or mb_axis is None or coords[r][mb_axis] == mb))
            views[key] = _view(comm, ranks) if ranks else None
        return views[key]

    def run_step(seg, j, stages, view, store, run):
        if run.stats is None or segments[seg][0][j].subplans:  # a repeat times its own steps
            return _run_step(seg, j, stages, view, store, run)
        t0 = time.perf_counter()
        _run_step(seg, j, stages, view, store, run)
        kind = segments[seg][0][j].kind
        run.stats[kind] = run.stats.get(kind, 0.0) + time.perf_counter() - t0

    def _run_step(seg, j, stages, view, store, run):
        s = segments[seg][0][j]
        env = _ViewEnv(store, view.ranks)
        if s.kind == "send":
            view.send(env.get(s.ins[0]), s.axes, s.args["offset"], s.args["tag"])
            return
        if s.kind == "recv":
            v = plan.values[s.outs[0]]
            tmpl = torch.empty(v.local_shape(mesh), dtype=v.dtype)
            env[s.outs[0]] = view.recv([tmpl] * len(view.ranks), s.axes, s.args["offset"], s.args["tag"])
            return
        key = (seg, j, id(view))
        call = calls.get(key)
        if call is None:
            offset = local_layers * stages[0] if len(stages) == 1 else 0
            call = calls[key] = rule_for(s.kind)(_StageExecutor(plan, view, offset), j, s)
        call(env, env.get, run)

    def run_once(seg, store, run):
        for j, st in enumerate(segments[seg][1]):
            view = view_of(frozenset(st))
            if view is not None:
                run_step(seg, j, st, view, store, run)

    def run_action(stage, act, store, run):
        seg = _PHASE[act.kind]
        steps, stages = segments[seg]
        view = view_of(frozenset({stage}), act.microbatch)
        for j, (s, st) in enumerate(zip(steps, stages)):
            if stage not in st:
                continue
            is_carry = s.kind in ("send", "recv") and s.args["tag"] in carry
            if act.kind in COMPUTE:
                if not is_carry:
                    run_step(seg, j, (stage,), view, store, run)
            elif is_carry and (s.kind == "send") == act.is_send:
                run_step(seg, j, (stage,), view, store, run)

    order = _order(schedule, held_stages)
    # What one micro-batch makes and only its own actions read (activations, the carry and
    # its gradient): dropped from a stage once its B is done, so a stage holds the
    # activations its schedule keeps in flight, not every micro-batch's.  (Its last action
    # there is its B, or the send of the gradient that B made.)
    kept = {v for s in final.steps for v in s.ins} | set(step.outs)
    transient = {v for seg in (forward, backward) for s in seg.steps for v in s.outs} - kept
    last = {(stage, a.microbatch): a for stage in held_stages for a in schedule.actions[stage]}

    def call(env, get, run):
        store: dict = {}
        for v in step.ins:
            store[v] = {r: x for r, x in zip(comm.ranks, get(v)) if x is not None}
        run_once(0, store, run)
        timeline = {s: [] for s in held_stages}
        clock = time.perf_counter
        for stage, act in order:
            t0 = clock()
            run_action(stage, act, store, run)
            timeline[stage].append((act, t0, clock()))
            if last[(stage, act.microbatch)] == act:  # the micro-batch is done on this stage
                for r in view_of(frozenset({stage}), act.microbatch).ranks:
                    for v in transient:
                        store.get(v, {}).pop(r, None)
        run_once(3, store, run)
        comm.drain()
        for v in step.outs:
            slot = store.get(v, {})
            env[v] = [slot.get(r) for r in comm.ranks]
        ex.last_timeline = tuple(tuple(timeline[s]) for s in held_stages)
    return call


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
            out[name] = real.recv([torch.empty(v.shape.sizes, dtype=v.dtype)], (ax,), -stage, tag)[0]
    return out
