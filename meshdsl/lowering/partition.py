"""Partition a lowered plan into a pipeline: which stage runs each step, and when.

The plan is first lowered as a whole (on the mesh with the micro-batch axis, see
:mod:`.pipeline`); here its steps are cut into four segments of one ``pipeline``
step, and each step gets the set of stages that run it:

* **prologue** (once, before the schedule): steps that depend on no input, e.g.
  param re-layouts.  They run on the stages that read their results.
* **forward** (per micro-batch, in the schedule's ``F`` actions): what feeds the
  pipelined repeat (stage 0), the repeat's local layers (every stage, the carry
  received from the stage before and sent to the next), and what follows it up to
  the loss and its gradient down to the repeat's cotangent (the last stage).
* **backward** (per micro-batch, in ``B`` actions): the repeat's backward layers
  (the carry gradient travelling back) and what reads its input gradient (stage 0).
* **final** (once, after the schedule): collectives over the micro-batch axis
  (gradient accumulation, the loss mean) and all that follows: updates, and steps
  that combine values of several stages (a tied embedding's two gradients).

Stages come from data flow: the repeat's output carry lives on the last stage and
its input gradient on stage 0, and every step reading such values runs where they
are; steps reading neither run where their results are read.  A value a step
needs on another stage travels by one ``send``/``recv`` pair over the stage axis
(the carry and its gradient every micro-batch; others, such as the tied
embedding's gradient, once in the final segment), so nothing is gathered or
reduced over the stage axis and a param is stored only on the stages that read it.

What the pipelined layers read from outside their repeat (:mod:`meshdsl.ir.closure`)
reaches every stage: an input is fed to each stage that reads it, a value made once
(from params and tables) is made on each, and a value made per micro-batch before the
layers (an encoder's output) is made on the first stage that reads it and sent on with
the carry.  Its gradient, each stage's sum over its own layers, travels back down the
stages to stage 0 with the carry's gradient (:mod:`.stage_sum`); a param's is summed
over the stages after the micro-batches, as the global norm's sums are.
"""
from __future__ import annotations

import dataclasses

from ..errors import LayoutError, message
from .bucket import bucket_final
from .pipeline import BATCH, MB_AXIS
from .stage_sum import chained as chained_stage_sums, expand as expand_stage_sum
from .plan import Plan, Step, Value, step_args, register_step_kind
from .schedule_gen import SCHEDULES, make_schedule

# axis: the stage axis; num_stages, microbatches; mb_axis: the virtual micro-batch axis (None for m = 1);
# schedule: a lowering.schedule.Schedule; stages: per segment (prologue, forward, backward, final), per
# step, the stages running it; carry_tags: tags of the carry's (activation, gradient) transfers.
FIELDS = ("axis", "num_stages", "microbatches", "mb_axis", "schedule", "stages", "carry_tags")
register_step_kind("pipeline", FIELDS)

ACT_TAG, GRAD_TAG = 0, 1
SEGMENTS = ("prologue", "forward", "backward", "final")


def _transfer(kind, v, values, mesh, axis, offset, tag, phase, what) -> Step:
    ins, outs = ((v,), ()) if kind == "send" else ((), (v,))
    return Step(kind, -1, kind, f"{kind} {what}", phase, ins, outs, (axis,),
                step_args(kind, {"offset": offset, "tag": tag}), values[v].local_bytes(mesh))


def _error(what, spec, bullets, rule, fix):
    return LayoutError(message(f"compile (pipeline over '{spec.axis}'): {what}", bullets=bullets,
                               inputs=[f"mesh: {spec.given[0]}", f"layout: {spec.given[1]}",
                                       f"micro-batches: {spec.num_microbatches}"], rule=rule, fix=fix))


def _whole_batch_cause(steps, producer, final, i):
    """The collective over the micro-batch axis that put step ``i`` in the final segment, or
    None when the step is there for another reason (it runs on several stages)."""
    while not (steps[i].is_collective and MB_AXIS in steps[i].axes):
        i = next((producer[v] for v in steps[i].ins if producer.get(v) in final), None)
        if i is None:
            return None
    return steps[i]


def varies_per_microbatch(steps, values=None) -> list[bool]:
    """Per step: whether it depends on the batch (an input, or a value made from one), so runs
    once per micro-batch; the others run once.  With ``values``, an input without the batch
    dim (a table, a hyperparameter) is the same for every micro-batch."""
    mb_vals: set[int] = set()
    out = []
    for s in steps:
        batch_input = s.kind == "input" and (values is None or BATCH in values[s.outs[0]].shape.names)
        out.append(batch_input or any(v in mb_vals for v in s.ins))
        if out[-1]:
            mb_vals.update(s.outs)
    return out


def _same(ctx, attrs, x):
    return x


def _own_carry(steps, values, pipelined) -> list:
    """``steps`` with the pipelined repeat's first carry a value of its own, when the value it
    reads is read by other steps too (or is an input): later stages receive their carry into
    that value, which must not overwrite the input a step after the layers reads (the loss's
    ``x``).  The new value is the old one's tensor, handed on by a step on stage 0."""
    at = next((i for i, s in enumerate(steps) if pipelined(s) and not s.args["backward"]), None)
    if at is None:
        return steps
    v0 = steps[at].ins[0]
    if not any(v0 in s.ins for i, s in enumerate(steps) if i != at) and \
            not any(v0 in s.outs for s in steps if s.kind in ("param", "input")):
        return steps
    own = max(values) + 1
    values[own] = Value(own, values[v0].shape, values[v0].dtype, values[v0].sharding)
    f = steps[at]
    copy = Step("local", f.node, "carry", f"{f.label}: its first carry", f.phase, (v0,), (own,), (),
                step_args("local", {"fn": _same, "attrs": {}, "compute": values[v0].sharding.split,
                                    "sizes": {d.name: d.size for d in values[v0].shape}}))
    return [*steps[:at], copy, dataclasses.replace(f, ins=(own, *f.ins[1:])), *steps[at + 1:]]


def _may_move(seg_from: str, seg_to: str, src: int, dst: int) -> bool:
    """Whether a value made in segment ``seg_from`` on stage ``src`` can reach a reader in
    ``seg_to`` on stage ``dst``: after the micro-batches, or with the carry (forward, to a
    later stage; backward, to an earlier one), or from a forward to a backward."""
    return (seg_to == "final" or (seg_from, seg_to) == ("forward", "backward")
            or (seg_from == seg_to == "forward" and src < dst) or (seg_from == seg_to == "backward" and src > dst))


def partition(steps, values, outputs: dict[str, int], spec, bucket_mb: float = 0.0):
    """Cut ``steps`` into a ``pipeline`` step; returns (top-level steps, holders).

    The final segment's gradient allreduces are packed into buckets of about ``bucket_mb``
    MB (:func:`~.bucket.bucket_final`; 0: one per gradient).

    ``holders`` maps each param, input and output value id to the mesh ranks that
    hold it (the ranks of the stages reading or producing it).
    """
    mesh, ax, p, layer = spec.mesh, spec.axis, spec.num_stages, spec.layer
    ALL = frozenset(range(p))

    def pipelined(s):
        return (s.kind == "repeat" and len(s.ins) > 1
                and values[s.ins[1]].sharding.axes_of(layer) == (ax,))
    steps = _own_carry(steps, values, pipelined)
    producer = {v: i for i, s in enumerate(steps) for v in s.outs}
    fwd = [i for i, s in enumerate(steps) if pipelined(s) and not s.args["backward"]]
    bwd = [i for i, s in enumerate(steps) if pipelined(s) and s.args["backward"]]
    assert len(fwd) == 1, "a pipelined repeat lowers to one forward step"
    if len(bwd) > 1:
        raise _error("the pipelined repeat is differentiated more than once.", spec, [],
                     "a pipeline runs one forward and one backward per micro-batch", "take one gradient")
    F, B = fwd[0], (bwd[0] if bwd else None)
    dy_pos = 1 + len(steps[F].args["names"])
    leaf = [s.kind in ("param", "input") for s in steps]

    per_mb = varies_per_microbatch(steps, values)
    # the gradients of activations the pipelined layers read from outside: summed down the stages
    sums = chained_stage_sums(steps, ax, B, per_mb, producer)

    # Stages: values anchored by the repeat's ends flow forward; the rest is placed by demand.
    held: dict[int, frozenset] = {}
    stages: list = [None] * len(steps)
    for i, s in enumerate(steps):
        if i in (F, B):
            stages[i] = ALL
            held[s.outs[0]] = frozenset({p - 1}) if i == F else frozenset({0})
            held.update((v, ALL) for v in s.outs[1:])
        elif i in sums:
            stages[i] = frozenset({0})
            held.update((v, stages[i]) for v in s.outs)
        elif not leaf[i]:
            anchored = [held[v] for v in s.ins if v in held]
            if anchored:
                stages[i] = frozenset().union(*anchored)
                held.update((v, stages[i]) for v in s.outs)
    demand: dict[int, frozenset] = {v: ALL for v in outputs.values()}
    spread: set[int] = set()  # per micro-batch steps each stage runs on its own part (split over the stages)
    for i in reversed(range(len(steps))):
        s = steps[i]
        if stages[i] is None:
            want = frozenset().union(*(demand.get(v, frozenset()) for v in s.outs))
            if per_mb[i] and not leaf[i] and s.phase == "forward" and len(want) > 1:
                if any(ax in values[v].sharding.used_axes for v in s.outs):
                    spread.add(i)
                else:
                    # made once per micro-batch, on the first stage that reads it (an encoder's output read
                    # by every pipelined layer: stage 0), and sent on to the later ones with the carry
                    want = frozenset({min(want)})
            stages[i] = want or frozenset({0})
            held.update((v, stages[i]) for v in s.outs)
        for j, v in enumerate(s.ins):
            want = {0} if (i == F and j == 0) else {p - 1} if (i == B and j == dy_pos) else stages[i]
            demand[v] = demand.get(v, frozenset()) | want

    # Segments.
    final: set[int] = set()
    for i, s in enumerate(steps):
        if leaf[i] or i in (F, B) or not per_mb[i]:
            continue
        if ((s.is_collective and MB_AXIS in s.axes) or (len(stages[i]) > 1 and i not in spread)
                or any(producer.get(v) in final for v in s.ins)):
            final.add(i)
    for blk in (F, B):
        if blk is not None:
            for v in steps[blk].ins:
                if producer.get(v) in final:
                    c = _whole_batch_cause(steps, producer, final, producer[v])
                    if c is None:
                        u = steps[producer[v]]
                        raise _error(f"'{u.op}' ({u.label}) is read by the pipelined repeat, but runs after the "
                                     "micro-batches.", spec, [f"'{u.op}' runs on stages {sorted(stages[producer[v]])}"],
                                     "what feeds the pipelined layers runs one micro-batch at a time, on one stage",
                                     "compute it from the batch before the stack, or from params and tables only")
                    src = steps[producer[c.ins[0]]] if c.ins[0] in producer else c
                    raise _error(f"'{src.op}' ({src.label}) reduces over the whole batch, and '{c.op}' reads "
                                 "the result before the pipelined repeat.", spec,
                                 [f"{c.kind} over {c.axes} for '{c.op}' joins the micro-batches"],
                                 "what feeds or follows the pipelined layers runs one micro-batch at a time",
                                 "keep ops that reduce over the batch after the loss, or use microbatches=1")
    after_b: set[int] = set(steps[B].outs) if B is not None else set()
    phase = {}
    for i, s in enumerate(steps):
        if any(v in after_b for v in s.ins):
            after_b.update(s.outs)
            phase[i] = "B"
    segment = []
    for i, s in enumerate(steps):
        if leaf[i]:
            segment.append(None)
        elif i in final:
            segment.append("final")
        elif i == F:
            segment.append("forward")
        elif i == B:
            segment.append("backward")
        elif not per_mb[i]:
            segment.append("prologue")
        else:
            segment.append("backward" if phase.get(i) == "B" else "forward")

    # Transfers for values read on a stage that does not hold them.
    lists: dict[str, list] = {k: [] for k in SEGMENTS}
    tag = GRAD_TAG
    moved: set = set()
    for i, s in enumerate(steps):
        if leaf[i]:
            continue
        before = []
        for j, v in enumerate(s.ins):
            if (i == F and j == 0) or (i == B and j == dy_pos):
                continue
            for t in sorted(stages[i] - held.get(v, ALL)):
                if (v, t) in moved:
                    continue
                moved.add((v, t))
                src = min(held[v], key=lambda h: abs(h - t))
                pj = producer[v]
                if not _may_move(segment[pj], segment[i], src, t):
                    raise _error(f"'{s.op}' on stage {t} reads '{steps[pj].op}' of stage {src} in the same pass.",
                                 spec, [f"{steps[pj].label} -> {s.label}"],
                                 "within a micro-batch, values move forward with the carry and back with its "
                                 "gradient", "restructure the model so each stage reads its own values")
                tag += 1
                what = f"{steps[pj].label} to stage {t}"
                snd = (_transfer("send", v, values, mesh, ax, t - src, tag, s.phase, what), frozenset({src}))
                rcv = (_transfer("recv", v, values, mesh, ax, t - src, tag, s.phase, what), frozenset({t}))
                if segment[i] == "final":
                    before += [snd, rcv]
                else:
                    lists[segment[pj]].append(snd)  # after its producer (already placed), in its segment
                    before.append(rcv)
        seg = lists[segment[i]]
        seg.extend(before)
        if i in sums:
            moves, tag = expand_stage_sum(s, values, mesh, ax, p, tag)
            seg.extend(moves)
        elif i in (F, B):
            carry, off, tg = (s.ins[0], 1, ACT_TAG) if i == F else (s.ins[dy_pos], -1, GRAD_TAG)
            first, last = frozenset(range(p - 1)), frozenset(range(1, p))  # stages with a next / a previous
            seg.append((_transfer("recv", carry, values, mesh, ax, off, tg, s.phase, "carry"),
                        last if i == F else first))
            seg.append((s, ALL))
            seg.append((_transfer("send", s.outs[0], values, mesh, ax, off, tg, s.phase, "carry"),
                        first if i == F else last))
        else:
            seg.append((s, stages[i]))
        for v in s.outs:
            held[v] = held.get(v, stages[i])
        for v, t in moved:
            held[v] = held[v] | {t}

    in_actions = {v for k in ("forward", "backward") for s, _ in lists[k] for v in s.outs}
    lists["final"] = bucket_final(lists["final"], values, outputs, bucket_mb, in_actions)
    sub = {k: Plan(mesh, spec.layout, [s for s, _ in lists[k]], values, {}) for k in SEGMENTS}
    m = spec.num_microbatches
    leaves = [s for i, s in enumerate(steps) if leaf[i]]
    made = {v for i, s in enumerate(steps) if not leaf[i] for v in s.outs}
    pipe = Step("pipeline", -1, "pipeline", _label(ax, spec.schedule), "forward",
                tuple(v for s in leaves for v in s.outs), tuple(sorted(set(outputs.values()) & made)), (ax,),
                step_args("pipeline", {
                    "axis": ax, "num_stages": p, "microbatches": m,
                    "mb_axis": MB_AXIS if m > 1 else None, "schedule": spec.schedule,
                    "stages": tuple(tuple(tuple(sorted(st)) for _, st in lists[k]) for k in SEGMENTS),
                    "carry_tags": (ACT_TAG, GRAD_TAG)}),
                subplans=tuple(sub[k] for k in SEGMENTS), sub_times=(1, m, m, 1))
    holders = {}
    for v in [v for s in leaves for v in s.outs] + list(outputs.values()):
        st = held.get(v, demand.get(v, ALL))
        holders[v] = tuple(r for r in range(mesh.size) if mesh.coords(r)[ax] in st)
    return leaves + [pipe], holders


def pipelined_repeats(step: Step) -> tuple[frozenset, int]:
    """The pipelined repeat's steps in a ``pipeline`` (or ``accumulate``) step: their (segment,
    position) pairs, the segments counted as in ``step.subplans``, and its layers per stage.

    They are the repeats every stage runs; another stack (an encoder's, before the pipelined
    layers) runs on one stage.  A stage's kernels salt by the global layer index, so the runtime
    offsets the pipelined layers of stage ``s`` by ``s`` times the layers per stage.
    """
    stacks = frozenset((g, j) for g in (1, 2) for j, (s, st) in enumerate(zip(step.subplans[g].steps,
                                                                             step.args["stages"][g]))
                       if s.kind == "repeat" and len(st) == step.args["num_stages"])
    return stacks, next((step.subplans[1].steps[j].times for g, j in sorted(stacks) if g == 1), 0)


def with_schedule(plan: Plan, schedule: str) -> Plan:
    """``plan`` with its pipeline run by ``schedule`` (one stage per rank) instead of the one it
    was compiled with.

    The schedule is the only part of a compiled pipeline that depends on it (the segments, the
    stages and the transfers do not), so this equals compiling again with ``schedule``; the
    layout search uses it to compile a pipelined layout once for all the schedules it prices.
    A plan without a pipeline comes back as it is.

    Raises:
      ScheduleError: what :func:`.schedule_gen.make_schedule` raises for ``schedule``.
      ValueError: ``schedule`` runs several stages per rank (it needs its own compilation).
    """
    if SCHEDULES.get(schedule) is not None and SCHEDULES[schedule].chunked:
        raise ValueError(f"with_schedule: '{schedule}' runs several stages per rank; compile for it")
    steps = []
    for s in plan.steps:
        if s.kind == "pipeline":
            sched = make_schedule(schedule, s.args["num_stages"], s.args["microbatches"])
            s = dataclasses.replace(s, label=_label(s.args["axis"], sched),
                                    args=step_args("pipeline", {**s.args, "schedule": sched}))
        steps.append(s)
    return dataclasses.replace(plan, steps=tuple(steps))


def _label(axis: str, schedule) -> str:
    """The pipeline step's label: its axis and schedule."""
    return f"pipeline over '{axis}' ({schedule.name})"
