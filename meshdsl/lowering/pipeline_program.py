"""A pipeline as one program: what each stage runs, in which order, and what it keeps.

Lowering makes one :class:`PipelineProgram` per pipeline (:mod:`.partition`; gradient
accumulation's one-stage pipeline in :mod:`.accumulate`) and the ``pipeline`` (or
``accumulate``) step of the plan carries it.  It is plain data:

* the four :class:`Segment` sub-plans and, per step, the stages that run it;
* the :class:`~.schedule.Schedule` as generated, and as the runtime runs it: each B that
  sends its input gradient upstream split into B and W (:func:`~.schedule.split_backward`);
* per rank of the stage axis, the ordered :class:`StageAction` list: the segment steps
  each action runs, the values it reads, the values it frees right after their last
  reader, whether its weight gradients wait for a W, and, at the last action of a
  micro-batch on a stage, the activations dropped and the micro-batch sums taken;
* the transfers (:class:`Transfer`) with their tags, offsets and receive buffers;
* the simulated timelines (unit cost, and the picture's costs), computed once.

``runtime/pipeline.py`` runs it; the memory report, the cost model, the CLI's schedule
table and the timeline picture read the same object.  Stages are logical: with virtual
stages (``num_chunks`` v > 1) stage ``s`` runs on rank ``s % num_ranks`` of the stage axis.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property
from typing import Callable

from .plan import Step, step_args
from .schedule import COMPUTE, Action, Number, Schedule, split_backward, unit_cost
from .schedule_gen import peak_theory
from .timeline import PipelineStats, picture_cost, simulate, theory_bubble


class Segment(enum.IntEnum):
    """The four parts of a pipeline step, in the order of its sub-plans."""

    PROLOGUE = 0   # once, before the schedule: what reads no input (param re-layouts)
    FORWARD = 1    # per micro-batch, in the F actions
    BACKWARD = 2   # per micro-batch, in the B actions
    FINAL = 3      # once, after the schedule: sums over the micro-batches, updates


#: The segment whose steps a schedule action runs (a W runs put-off work of its B's).
SEGMENT_OF = {"F": Segment.FORWARD, "send_act": Segment.FORWARD, "recv_act": Segment.FORWARD,
              "B": Segment.BACKWARD, "send_grad": Segment.BACKWARD, "recv_grad": Segment.BACKWARD}
#: The segments run once per micro-batch.
PER_MICROBATCH = (Segment.FORWARD, Segment.BACKWARD)


#: The tags of the carry's transfers (activation, gradient); a tuple carry's other tensors take the
#: next pairs (:func:`carry_tags`), and the other transfers the tags after those.
ACT_TAG, GRAD_TAG = 0, 1


def num_carries(s: Step) -> int:
    """The tensors a repeat step carries (its first inputs and outputs): k for a tuple carry."""
    return s.args.get("carries", 1)


def carry_tags(c: int) -> tuple[int, int]:
    """The (activation, gradient) tags of carried tensor ``c``'s transfers between stages: the first
    one's are :data:`ACT_TAG` and :data:`GRAD_TAG`, a tuple carry's others the pairs after them, so
    each carried tensor has a receive slot of its own."""
    return (ACT_TAG + 2 * c, GRAD_TAG + 2 * c)


@dataclass(frozen=True)
class Transfer:
    """A send or a receive between stages: step ``position`` of ``segment``.

    ``value`` is the value sent, or the buffer a receive writes; ``carry`` marks the carry
    (or its gradient), which the schedule's send and receive actions move."""

    segment: Segment
    position: int
    kind: str
    value: int
    offset: int
    tag: int
    carry: bool
    stages: tuple[int, ...]


def transfer_step(kind: str, v: int, values: dict, mesh, axis: str, offset: int, tag: int, phase: str,
                  what: str) -> Step:
    """A ``send`` of value ``v`` (or a ``recv`` into it) over the stage axis to the rank ``offset``
    away (from it, for a receive), paired with its other half by ``tag``."""
    ins, outs = ((v,), ()) if kind == "send" else ((), (v,))
    return Step(kind, -1, kind, f"{kind} {what}", phase, ins, outs, (axis,),
                step_args(kind, {"offset": offset, "tag": tag}), values[v].local_bytes(mesh))


@dataclass(frozen=True)
class StageAction:
    """One entry of a stage's run list.

    Attributes:
      action: the schedule action (``F``, ``B``, ``W`` or a carry transfer).
      segment: the segment whose steps it runs (None for a W).
      steps: positions in ``segment`` it runs, in order: an F's or B's compute steps
        (the segment's other transfers included), or a transfer action's carry step.
      frees: ``(position, values)``: values dropped right after that step, their last
        reader on this stage.
      reads: values its steps read.
      defers: a B whose loop's weight-gradient matmuls wait for a later W, or that W.
      finishes: the last action of its micro-batch on this stage: what the stage drops
        then (None otherwise).
      accumulates: the last action's too: the micro-batch's partial sums the stage adds into
        its running sums then (:attr:`PipelineProgram.folded`).
    """

    action: Action
    segment: Segment | None
    steps: tuple[int, ...] = ()
    frees: tuple[tuple[int, tuple[int, ...]], ...] = ()
    reads: tuple[int, ...] = ()
    defers: bool = False
    finishes: tuple[int, ...] | None = None
    accumulates: tuple[int, ...] = ()


@dataclass(frozen=True)
class PipelineProgram:
    """A pipeline (or gradient accumulation) step as data; see the module docstring.

    Attributes:
      axis: the stage mesh axis (None for gradient accumulation).
      num_ranks: ranks on the stage axis (p).
      microbatches: m.
      mb_axis: the virtual micro-batch axis (None for m = 1).
      schedule: the validated schedule, as its generator made it.
      segments: the sub-plans, indexed by :class:`Segment`.
      stages: per segment, per step, the stages that run it.
      carry_tags: the tags of the carry's (activation, gradient) transfers.
      outputs: the pipeline step's outputs (kept past the schedule).
      stack_loops: with several stacks on the stage axis (an encoder-decoder's), ``(segment,
        position)`` of each stack's loop on each of its stages (:func:`.stage_layers.split_stacks`);
        empty with one.
    """

    axis: str | None
    num_ranks: int
    microbatches: int
    mb_axis: str | None
    schedule: Schedule
    segments: tuple
    stages: tuple[tuple[tuple[int, ...], ...], ...]
    carry_tags: tuple[int, ...]
    outputs: tuple[int, ...]
    stack_loops: frozenset = frozenset()

    @classmethod
    def of_schedule(cls, schedule: Schedule, axis: str = "stage") -> "PipelineProgram":
        """The program of ``schedule`` alone, with no steps: what the figures and pictures of a
        schedule read (a schedule drawn without a model, a run's figures in another process)."""
        empty = ((), (), (), ())
        return cls(axis, schedule.num_ranks, schedule.num_microbatches, None, schedule, empty, empty, (), ())

    # --------------------------------------------------------------------------- structure

    @property
    def num_stages(self) -> int:
        """Logical stages: ``num_ranks`` times the schedule's stages per rank."""
        return self.schedule.num_stages

    def rank_of(self, stage: int) -> int:
        """The rank of the stage axis that runs logical stage ``stage``."""
        return stage % self.num_ranks

    def steps(self, segment: Segment) -> tuple:
        """``(step, stages)`` of ``segment``, in order."""
        return tuple(zip(self.segments[segment].steps, self.stages[segment]))

    def is_carry(self, step) -> bool:
        return step.kind in ("send", "recv") and step.args["tag"] in self.carry_tags

    @cached_property
    def transfers(self) -> tuple[Transfer, ...]:
        """Every send and receive of the segments, in segment order."""
        out = []
        for seg in Segment:
            for j, (s, st) in enumerate(self.steps(seg)):
                if s.kind in ("send", "recv"):
                    value = s.ins[0] if s.kind == "send" else s.outs[0]
                    out.append(Transfer(seg, j, s.kind, value, s.args["offset"], s.args["tag"], self.is_carry(s), st))
        return tuple(out)

    @cached_property
    def carry_offsets(self) -> tuple[int, ...]:
        """The stage-axis offsets the carry's transfers take (the communicator's pipeline path)."""
        return tuple(sorted({t.offset for t in self.transfers if t.carry}))

    @cached_property
    def pipelined(self) -> frozenset:
        """``(segment, position)`` of the pipelined repeat's steps: the repeats that run on several
        stages, one chunk of layers each (another stack, such as an encoder's before the layers,
        runs on one), and with several stacks on the stage axis, every stack's loops."""
        return self.stack_loops | frozenset(
            (seg, j) for seg in PER_MICROBATCH for j, (s, st) in enumerate(self.steps(seg))
            if s.kind == "repeat" and (len(st) > 1 or self._split_over_stages(seg, s)))

    def _split_over_stages(self, seg: Segment, s) -> bool:
        """Whether repeat ``s`` reads a stacked param split over the stage axis (unequal stages
        run one such repeat each, :mod:`.stage_layers`)."""
        values, at = self.segments[seg].values, num_carries(s)   # (the first stacked param follows the carries)
        return len(s.ins) > at and s.ins[at] in values and self.axis in values[s.ins[at]].sharding.used_axes

    @cached_property
    def layers_per_stage(self) -> int:
        """Layers of the pipelined repeat each stage runs (0 without one)."""
        fwd = self.segments[Segment.FORWARD].steps
        return next((fwd[j].times for seg, j in sorted(self.pipelined) if seg == Segment.FORWARD), 0)

    def layer_offset(self, segment: Segment, position: int, stage: int) -> int:
        """The global index of the first layer step ``position`` of ``segment`` runs on
        ``stage``: the layers the pipelined forward steps run on the stages before it (stage s
        runs layers ``s k ..`` with k layers per stage); a stage's kernels salt by it (0 for a
        step outside the pipelined layers)."""
        if (segment, position) not in self.pipelined:
            return 0
        fwd = self.segments[Segment.FORWARD].steps
        # with several stacks, only the layers of this one
        stack = self._stack_of(segment, position) if self.stack_loops else None
        return sum(fwd[j].times * sum(1 for t in self.stages[Segment.FORWARD][j] if t < stage)
                   for seg, j in self.pipelined
                   if seg == Segment.FORWARD and (stack is None or stack == self._stack_of(seg, j)))

    def _stack_of(self, segment: Segment, position: int):
        """The stack a loop runs layers of: the layer dim that the stage axis splits in the stacked
        param it reads (each stack has its own; a chunk's narrowed param keeps it), or that param
        itself where it is whole (a stack on one stage)."""
        step = self.segments[segment].steps[position]
        param = step.ins[num_carries(step)]
        sharding = self.segments[segment].values[param].sharding
        return next((name for name, axes in sharding.dims if self.axis in axes), param)

    # --------------------------------------------------------------------------- values

    @cached_property
    def folded(self) -> dict[int, str]:
        """Values the final segment only sums over the micro-batch axis (and reads nowhere
        else there): value id -> the reduction.  A stage takes each micro-batch's into one
        running sum as the micro-batch finishes there."""
        if self.mb_axis is None:
            return {}
        per_mb = {v for seg in PER_MICROBATCH for s in self.segments[seg].steps for v in s.outs}
        readers: dict = {}
        for s in self.segments[Segment.FINAL].steps:
            for v in s.ins:
                readers.setdefault(v, []).append(s)
        out, reduce = {}, ("allreduce", "bucket_allreduce")
        for v, steps in readers.items():
            ops = {s.args.get("op", "sum") for s in steps if s.kind in reduce and self.mb_axis in s.axes}
            if v in per_mb and v not in self.outputs and len(ops) == 1 and all(s.kind in reduce for s in steps):
                out[v] = ops.pop()
        return out

    @cached_property
    def read_in_schedule(self) -> frozenset:
        """Values a step of the prologue, the forward or the backward segment reads."""
        return frozenset(v for seg in (Segment.PROLOGUE, *PER_MICROBATCH) for s in self.segments[seg].steps
                         for v in s.ins)

    @cached_property
    def loop_grads(self) -> frozenset:
        """The backward loops' stacked gradients that only the final segment reads: each is made
        in a buffer of its own (later micro-batches may add into the first one's)."""
        return frozenset(v for s in self.segments[Segment.BACKWARD].steps if s.kind == "repeat"
                         for v in s.outs[1:]) - self.read_in_schedule

    def made(self, segment: Segment, stage: int) -> tuple[int, ...]:
        """Values the steps of ``segment`` make on ``stage``, in order."""
        return tuple(v for s, st in self.steps(segment) if stage in st for v in s.outs)

    @cached_property
    def kept(self) -> frozenset:
        """Values that outlive a micro-batch's actions: the final segment's inputs, the step's
        outputs and the micro-batch sums."""
        return frozenset({v for s in self.segments[Segment.FINAL].steps for v in s.ins}
                         | set(self.outputs) | set(self.folded))

    def drops(self, segment: Segment, stage: int) -> dict[int, tuple[int, ...]]:
        """Step position -> the values ``stage`` drops right after that step of ``segment`` (F
        or B): made there and read only by its compute steps on this stage (not by a transfer,
        another segment or :attr:`kept`), so dead after their last reader, as in the executor."""
        made = set(self.made(segment, stage))
        last, shared = {}, set(self.kept)
        for seg in Segment:
            for j, (s, st) in enumerate(self.steps(seg)):
                for v in s.ins:
                    if seg != segment or s.kind in ("send", "recv") or stage not in st:
                        shared.add(v)
                    else:
                        last[v] = j
        out: dict[int, tuple[int, ...]] = {}
        for v, j in last.items():
            if v in made and v not in shared:
                out[j] = out.get(j, ()) + (v,)
        return out

    def accumulated(self, stage: int) -> tuple[int, ...]:
        """The micro-batch sums ``stage`` makes (added into its running sums as each micro-batch
        finishes there)."""
        return tuple(v for seg in PER_MICROBATCH for v in self.made(seg, stage) if v in self.folded)

    def transient(self, stage: int) -> tuple[int, ...]:
        """What one micro-batch makes on ``stage`` and only its own actions read (activations,
        the carry and its gradient): dropped once its last action there is done."""
        return tuple({v for seg in PER_MICROBATCH for v in self.made(seg, stage)} - self.kept)

    # --------------------------------------------------------------------------- schedule

    @cached_property
    def split(self) -> Schedule:
        """The schedule as the runtime runs it when weight gradients are put off: a B that
        sends its input gradient upstream leaves its weight gradients to a W after the send."""
        return split_backward(self.schedule)

    def run_schedule(self, defer: bool = True) -> Schedule:
        return self.split if defer else self.schedule

    @cached_property
    def _actions_split(self) -> tuple[tuple[StageAction, ...], ...]:
        return _rank_actions(self, self.split)

    @cached_property
    def _actions_whole(self) -> tuple[tuple[StageAction, ...], ...]:
        return _rank_actions(self, self.schedule)

    def actions(self, defer: bool = True) -> tuple[tuple[StageAction, ...], ...]:
        """Per rank of the stage axis, the actions it runs in order (with ``defer``: a B's
        weight gradients put off into a W where :attr:`split` says so)."""
        return self._actions_split if defer else self._actions_whole

    def order(self, defer: bool = True) -> tuple[StageAction, ...]:
        """Every stage's actions in one order that respects their dependencies: the unit-cost
        simulation's, a transfer when it ends, a compute when it starts, and at equal times
        sends before receives before computes, then by rank, each rank's in its own order (one
        process holding every stage runs this)."""
        runs = {a.action: a for row in self.actions(defer) for a in row}
        timeline = simulate(self.run_schedule(defer)).timeline
        kind_order = {"send": 0, "recv": 1}
        items = []
        for rank, row in enumerate(timeline):
            for a, t0, t1 in row:
                kind = "send" if a.is_send else "recv" if a.is_recv else None
                items.append(((t1 if kind else t0), kind_order.get(kind, 2), rank, a))
        items.sort(key=lambda t: t[:3])   # stable: a rank's ties stay in its list's order
        return tuple(runs[a] for *_, a in items if a in runs)

    @cached_property
    def timeline(self) -> PipelineStats:
        """The schedule simulated with F = B = 1 and transfers free (peaks of held activations)."""
        return simulate(self.schedule)

    @cached_property
    def picture(self) -> PipelineStats:
        """The schedule at the costs it is shown with (:func:`~.timeline.picture_cost`)."""
        return simulate(self.schedule, picture_cost(self.schedule))

    @cached_property
    def theory_bubble(self) -> Fraction:
        """The idle fraction at the theory's costs (:func:`~.timeline.theory_bubble`)."""
        return theory_bubble(self.schedule)

    @cached_property
    def peak_theory(self) -> tuple[int, ...]:
        """Per rank, the stage activations held at once in theory (:func:`~.schedule_gen.peak_theory`)."""
        s = self.schedule
        return tuple(peak_theory(s.name, s.num_ranks, s.num_microbatches, r, s.num_chunks) for r in range(s.num_ranks))

    def simulate(self, cost: Callable[[Action], Number] = unit_cost, defer: bool = False) -> PipelineStats:
        """The schedule (with ``defer``: as split for the runtime) run at ``cost``."""
        return simulate(self.run_schedule(defer), cost)

    def with_schedule(self, schedule: Schedule) -> "PipelineProgram":
        """This program run by ``schedule`` (same stages and sizes)."""
        return dataclasses.replace(self, schedule=schedule)


def _has_w(schedule: Schedule) -> set:
    """(stage, micro-batch) of the Ws that do not directly follow their own B (a W right after
    its B is that B's tail: nothing to put off)."""
    return {(a.stage, a.microbatch) for row in schedule.actions for prev, a in zip((None, *row), row)
            if a.kind == "W" and prev != Action("B", a.microbatch, a.stage)}


def _rank_actions(prog: PipelineProgram, schedule: Schedule) -> tuple[tuple[StageAction, ...], ...]:
    """Per rank, the :class:`StageAction` list of ``schedule`` (see :meth:`PipelineProgram.actions`)."""
    has_w = _has_w(schedule)
    deferring = {stage: bool(set(prog.made(Segment.BACKWARD, stage)) & prog.loop_grads)
                 for stage in range(prog.num_stages)}
    out = []
    for rank_row in schedule.actions:
        row = []
        for a in rank_row:
            defers = deferring[a.stage] and (a.stage, a.microbatch) in has_w
            if a.kind == "W":
                if defers:
                    row.append(StageAction(a, None, defers=True))
                continue
            row.append(_stage_action(prog, a, defers and a.kind == "B"))
        out.append(_finishing(prog, row))
    return tuple(out)


def _stage_action(prog: PipelineProgram, a: Action, defers: bool) -> StageAction:
    seg = SEGMENT_OF[a.kind]
    drops = prog.drops(seg, a.stage) if a.kind in COMPUTE else {}
    steps = []
    for j, (s, st) in enumerate(prog.steps(seg)):
        if a.stage not in st:
            continue
        carry = prog.is_carry(s)
        if (a.kind in COMPUTE and not carry) or (carry and a.kind not in COMPUTE
                                                 and (s.kind == "send") == a.is_send):
            steps.append(j)
    segment_steps = prog.segments[seg].steps
    reads = tuple(dict.fromkeys(v for j in steps for v in segment_steps[j].ins))
    return StageAction(a, seg, tuple(steps), tuple((j, drops[j]) for j in steps if j in drops), reads, defers)


def _finishing(prog: PipelineProgram, row: list) -> tuple[StageAction, ...]:
    """``row`` (one rank's) with each micro-batch's last action on each stage marked with what it drops.

    A value one stage makes that another stage of the same rank reads in the same micro-batch
    (a rank's chunks of virtual stages: what the last chunk makes for the backward of the
    earlier ones) is dropped when the last of those stages finishes the micro-batch."""
    last = {(a.action.stage, a.action.microbatch): k for k, a in enumerate(row)}
    mine = {stage for stage, _ in last}
    users: dict[int, set] = {}   # value -> the stages of this rank whose per-micro-batch steps make or read it
    for seg in PER_MICROBATCH:
        for s, st in prog.steps(seg):
            for v in (*s.ins, *s.outs):
                users.setdefault(v, set()).update(mine.intersection(st))
    transient = {stage: prog.transient(stage) for stage in mine}
    drop_at: dict[int, list] = {}
    for (stage, mb), k in last.items():
        for v in transient[stage]:
            drop_at.setdefault(max(last[(u, mb)] for u in users[v] | {stage}), []).append(v)
    return tuple(dataclasses.replace(a, finishes=tuple(dict.fromkeys(drop_at.get(k, ()))),
                                     accumulates=prog.accumulated(a.action.stage))
                 if last[(a.action.stage, a.action.microbatch)] == k else a for k, a in enumerate(row))
