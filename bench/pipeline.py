"""Pipeline step on 2 gloo processes: meshdsl GPipe, 1F1B, ZB-H1, interleaved vs torch.distributed.pipelining.

Workload: models/transformer.py at its default Config (4 layers, batch 16, seq 64,
d_model 256, fp32), one step = forward + backward + SGD, 1 torch thread per process.
Variants:

  1 proc    plain torch (bench/dense_vs_torch.py's TorchGPT, autograd, fused SGD): the baseline
  1 proc    meshdsl, mesh "data:1", layout ""
  2 procs   meshdsl, mesh "stage:2", layout "layer:stage", --microbatches m, schedule gpipe / 1f1b / zbh1
            / interleaved:2 (v = 2 virtual stages: rank r runs layer chunks r and r + 2) / interleaved-zb:2
            (the same with its Ws placed for the zero-bubble split: the last rank runs its last Ws
            after its last B; beside torch's ScheduleInterleaved1F1B too)
  2 procs   torch.distributed.pipelining ScheduleGPipe / Schedule1F1B, the same split
            (embedding + blocks 0-1 | blocks 2-3 + final norm + head) and the same m
            (torch's zero-bubble schedules need several stages per rank: no ZB-H1 counterpart),
            and ScheduleInterleaved1F1B with 2 chunks per rank, the same split as meshdsl's
            interleaved:2 (rank 0: embedding + block 0, block 2 | rank 1: block 1, block 3 + head);
            both interleaved schedules need m to be a multiple of 2
  2 procs   with --gloo-sends, meshdsl 1F1B with its stage-to-stage transfers on gloo's sockets
            (TorchComm(shm=False)) beside the default shared-memory ones: the transport's share
  floor     plain torch with the batch in max(m) micro-batches (gradients accumulated), on one
            process and on both at once with no communication: what cutting the batch and sharing
            the machine cost any pipeline; the bench prints the speedup two equal stages with the
            theory bubble could reach from them
  2 procs   balanced stages (unless --no-balanced): the transformer with a large vocabulary
            (vocab 8192, 8 layers: the head's matmul alone costs about two layers), meshdsl 1F1B at
            m = max(m) with the layer-count split (4,4) beside the split --stage-layers auto picks
            (md.balance_stages on this host's calibration), in the same job: the bubble the stages'
            imbalance leaves before and after, side by side; and the split auto picks for the bench
            model's interleaved:2 (one count per virtual stage), printed beside its rows

for m in {1, 2, 4, 8}.  The harness is bench/distributed_mlp.py's: spawned processes,
turns that rotate the variants (one untimed step, a barrier, then ``block - 1`` steps
back to back; a sample is their mean step time, the slower rank's), rounds that
alternate the 1-process and the 2-process job, and step-0 losses checked against
plain torch's.  For meshdsl, every timed step's pipeline actions are recorded on both
ranks (``Executor.last_timeline``) and put on one clock, giving the measured bubble
per stage next to (p-1)/(m+p-1), and the peak number of micro-batch activations held.
Each stage's time in F and B per step is printed for both sides: meshdsl's recorded
actions, and torch's ``PipelineStage.forward_one_chunk`` / ``backward_one_chunk``, timed
by wrapping them (compute against compute, waiting left out).

The bubble is, per stage and step, 1 - (its F + B + W time) / makespan, the makespan running
from the first F on any stage to the last action's end: its own sends and receives and the
runtime's work between actions count as idle.  The formulas assume equal stage costs and free
transfers (F = 1, B = 2).  So at the largest m each meshdsl schedule's idle time is also cut
into parts (``idle_breakdown``: sends, receives after the message was sent, waits for a late
sender, time between actions, fill and drain), beside the bubble the schedule leaves at the
measured F, B and W alone ("at costs": the stages' imbalance) and with the ranks' own transfer
and bookkeeping time too ("at own costs", ``bubble_at_own_costs``).

    python bench/pipeline.py                    # 3 rounds
    python bench/pipeline.py --quick            # 1 round, 2 turns, m in {4, 8}: the goals' cases
    python bench/pipeline.py --ms 8             # 3 rounds at m = 8 alone (interleaved's goals)
    python bench/pipeline.py --rounds 1 --reps 2 --ms 1 4
    python bench/pipeline.py --profile          # cProfile of meshdsl 1f1b at the largest m, per rank
    python bench/pipeline.py --profile --profile-schedule interleaved:2 --ms 8
    python bench/pipeline.py --gloo-sends       # also 1F1B with its transfers on gloo (not shared memory)
    python bench/pipeline.py --tiny             # the tiny transformer: the runtime and transfers alone
    python bench/pipeline.py --ms 8 --no-balanced   # without the balanced-stages rows

Results go to bench/results/pipeline.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from _common import (machine_end, machine_start, paired_ratio, setup,  # noqa: E402  (the torch sides, shared)
                     torch_interleaved_step, torch_pipe_step, torch_step)
from distributed_mlp import _cpu_ticks, _interleave, _ms  # noqa: E402  (the shared harness)

MODEL = str(ROOT / "models" / "transformer.py")
RESULTS = ROOT / "bench" / "results" / "pipeline.json"
INTERLEAVED = "interleaved:2"   # v = 2 virtual stages per rank
INTERLEAVED_ZB = "interleaved-zb:2"   # the same with the zero-bubble split: some ranks' last Ws put off
SCHEDULES = ("gpipe", "1f1b", "zbh1", INTERLEAVED, INTERLEAVED_ZB)
TORCH_SCHEDULES = ("gpipe", "1f1b", INTERLEAVED)   # torch's zero-bubble schedules need several stages per rank
GLOO = "1f1b(gloo)"   # --gloo-sends: meshdsl 1F1B with its stage-to-stage transfers on gloo's sockets
# Step-0 losses agree up to fp32 summation order (micro-batch sums, other kernels): a wrong
# split or a missing micro-batch moves the loss by O(1) of itself, far above 1e-4.
LOSS_RTOL = 1e-4
# Goals from the issues: one-stage-per-rank schedules within 10% of (p-1)/(m+p-1); interleaved at
# m = 8 at most 1.2x (p-1)/(vm+p-1) and not slower than torch's ScheduleInterleaved1F1B.
BUBBLE_RTOL, SPEEDUP_GOAL, INTERLEAVED_BUBBLE_GOAL = 0.10, 1.5, 1.2
#: The balanced-stages rows' model: a vocabulary large enough that the last stage's head and loss
#: (a d_model x vocab matmul per token, forward and backward) weigh about two layers.
BALANCED = {"vocab": 8192, "layers": 8}
BALANCED_SCHEDULE = "1f1b"


#: --tiny: the tiny transformer with 4 layers and batch 16 (every m divides it), whose kernels cost
#: almost nothing: the runtime and the transfers alone.
TINY = {"tiny": True, "layers": 4, "batch": 16}


def _setup(seed: int, tiny: bool = False):
    return setup(seed, MODEL, **(TINY if tiny else {}))


# ----------------------------------------------------------------------------- meshdsl variants

def meshdsl_step(model, feeds, comm, mesh, layout, lr, seed, m=1, schedule="gpipe", rows=None, outside=None,
                 stage_layers=None):
    """A meshdsl TrainStep; with ``rows``, appends each timed step's pipeline timeline to it, and
    to ``outside`` the seconds this rank's step spent before its first schedule action and after
    its last (the steps around the pipeline, its prologue and its final segment)."""
    from meshdsl.train.jobs import agree_plan
    from meshdsl.train.step import TrainStep
    ts = TrainStep(model.loss, model.params, mesh, layout, comm, lr=lr, seed=seed, microbatches=m,
                   schedule=schedule, stage_layers=stage_layers)
    agree_plan(comm, ts.plan)

    def step(timed=False):
        # Per-kind stats (TrainStep's timed=True) time every kernel: overhead nothing here reads.
        # The pipeline's action timeline is recorded on every step anyway.
        t0 = time.perf_counter()
        loss, _ = ts(feeds)
        t1 = time.perf_counter()
        if timed and rows is not None:
            timeline = ts.executor.last_timeline
            rows.append(timeline)
            if outside is not None:
                first = min(a[1] for row in timeline for a in row)
                last = max(a[2] for row in timeline for a in row)
                outside.append((first - t0, t1 - last))
        return loss
    step.plan = ts.plan
    return step


def _activation_bytes(plan) -> list[int]:
    """Per logical stage, bytes of one micro-batch's activations: what its forward makes and its
    backward reads (values made by the forward segment's steps of that stage, read by the backward's)."""
    from meshdsl.lowering.memory import saved_bytes
    return saved_bytes(next(s for s in plan.steps if s.kind == "pipeline"), plan.mesh)


def _once_transfer_bytes(plan, num_processes: int) -> dict:
    """Per rank of the stage axis (= process), bytes it sends per step in the pipeline's prologue
    and final segment (run once per step, outside the schedule).  Stages store the layers they run
    (virtual stages too: ``layer:stage[cyclic v]``), so no param or gradient is handed out there;
    the figure shows that it stays so.  A process
    holds ``mesh.size / num_processes`` ranks of the plan's mesh (its m micro-batch ranks): a
    transfer whose value varies by micro-batch is sent once per held rank, any other once
    (``runtime/pipeline.py``: its representatives send it)."""
    from meshdsl.lowering.pipeline import varies_by_microbatch
    from meshdsl.lowering.pipeline_program import Segment
    from meshdsl.tools.pipe_report import pipeline_program
    prog, held = pipeline_program(plan), plan.mesh.size // num_processes
    out = {seg.name.lower(): [0] * prog.num_ranks for seg in (Segment.PROLOGUE, Segment.FINAL)}
    for seg in (Segment.PROLOGUE, Segment.FINAL):
        for s, stages in prog.steps(seg):
            if s.kind == "send":
                for r in {prog.rank_of(st) for st in stages}:
                    out[seg.name.lower()][r] += s.bytes * (held if varies_by_microbatch(s, plan.values) or prog.is_carry(s) else 1)
    return out


def _floor_names(ms) -> tuple[str, str]:
    """The torch-alone variants that price what a pipeline of the largest m cannot avoid: the
    batch cut into m micro-batches on one process, and that run on both processes at once."""
    return f"torch 1p m={max(ms)}", f"torch 1p m={max(ms)} x2"


def single_job(comm, ms, warmup, reps, block, lr, seed, tiny=False):
    """1 process: plain torch (whole batch, and in max(ms) micro-batches) and meshdsl on data:1, interleaved."""
    model, feeds, w = _setup(seed, tiny)
    steps = {"torch 1p": torch_step(model.config, w, feeds, lr),
             _floor_names(ms)[0]: torch_step(model.config, w, feeds, lr, max(ms)),
             "meshdsl 1p": meshdsl_step(model, feeds, comm, "data:1", "", lr, seed)}
    loss0, last, times, cpu = _interleave(steps, warmup, reps, block, timed_arg=("meshdsl 1p",))
    return {"loss0": loss0, "last": last, "times": times, "cpu": cpu}


def _runs(who: str, schedule: str, m: int) -> bool:
    """Whether ``who`` runs ``schedule`` with m micro-batches on 2 stages: torch's Schedule1F1B
    refuses fewer micro-batches than stages (m=1), and the interleaved schedules want whole
    groups of p = 2 micro-batches."""
    if schedule in (INTERLEAVED, INTERLEAVED_ZB):
        return m % 2 == 0 and (who == "meshdsl" or schedule in TORCH_SCHEDULES)
    return who == "meshdsl" or (schedule in TORCH_SCHEDULES and not (schedule == "1f1b" and m < 2))


def _names(ms, gloo=False):
    return [f"{who} {s} m={m}" for m in ms for s in SCHEDULES + (GLOO,) * gloo for who in ("meshdsl", "torch")
            if _runs(who, s, m)]


def _balanced_name(m: int, counts) -> str:
    """The balanced-stages variant of layers per stage ``counts`` (the large-vocabulary model)."""
    return f"meshdsl {BALANCED_SCHEDULE} m={m} vocab {BALANCED['vocab']} split {','.join(map(str, counts))}"


def balanced_splits(m: int, lr: float, seed: int) -> list[tuple[int, ...]]:
    """The balanced-stages rows' splits: the layer-count one, and the one ``--stage-layers auto``
    picks (:func:`meshdsl.search.stage_balance.balance_stages`, on this host's calibration; priced
    once here, so both ranks run the same split)."""
    from meshdsl.search.stage_balance import balance_stages
    from meshdsl.train.step import training_outputs
    model, _, _ = setup(seed, MODEL, **BALANCED)
    layers = BALANCED["layers"]
    even = (layers // 2, layers - layers // 2)
    auto = tuple(balance_stages(training_outputs(model.loss, model.params, lr), "stage:2", "layer:stage",
                                microbatches=m, schedule=BALANCED_SCHEDULE))
    return [even] if auto == even else [even, auto]


def interleaved_auto_split(m: int, lr: float, seed: int) -> tuple[int, ...]:
    """What ``--stage-layers auto`` picks for the bench model's interleaved:2 (one count per virtual
    stage, on this host's calibration): the split an auto-balanced interleaved row would run."""
    from meshdsl.search.stage_balance import balance_stages
    from meshdsl.train.step import training_outputs
    model, _, _ = _setup(seed)
    return tuple(balance_stages(training_outputs(model.loss, model.params, lr), "stage:2", "layer:stage",
                                microbatches=m, schedule=INTERLEAVED))


class _TorchActions:
    """Seconds torch pipelining spends in each stage's forward and backward of a micro-batch
    (``PipelineStage.forward_one_chunk`` / ``backward_one_chunk``, timed by wrapping them), per
    variant, over its timed steps: the counterpart of meshdsl's recorded F and B actions."""

    def __init__(self):
        from torch.distributed.pipelining import PipelineStage
        self.current, self.spent, self.steps = None, {}, {}
        for kind, attr in (("F", "forward_one_chunk"), ("B", "backward_one_chunk")):
            setattr(PipelineStage, attr, self._timing(kind, getattr(PipelineStage, attr)))

    def _timing(self, kind, fn):
        def timed(stage, *a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(stage, *a, **kw)
            finally:
                if self.current is not None:
                    key = (self.current, kind)
                    self.spent[key] = self.spent.get(key, 0.0) + time.perf_counter() - t0
        return timed

    def wrap(self, name, step):
        """``step`` as a variant that records its actions when the harness times it."""
        def run(timed=False):
            self.current = name if timed else None
            self.steps[name] = self.steps.get(name, 0) + bool(timed)
            try:
                return step()
            finally:
                self.current = None
        return run

    def per_step_ms(self) -> dict:
        return {name: {kind: self.spent.get((name, kind), 0.0) * 1e3 / n for kind in ("F", "B")}
                for name, n in self.steps.items() if n}


def _meshdsl_actions_ms(rows: list) -> dict:
    """This rank's mean F and B milliseconds per timed step, from its recorded timelines (a
    B's weight gradients run after its send, the W action, count in B, as in torch's backward)."""
    spent = {"F": 0.0, "B": 0.0}
    for timeline in rows:
        for row in timeline:
            for a, t0, t1 in row:
                kind = "B" if a.kind == "W" else a.kind
                if kind in spent:
                    spent[kind] += t1 - t0
    return {k: v * 1e3 / max(1, len(rows)) for k, v in spent.items()}


def pair_job(comm, ms, warmup, reps, block, lr, seed, profile=False, gloo=False, tiny=False, splits=()):
    """2 processes: meshdsl and torch pipelining, every schedule and m, interleaved; plain torch
    in max(ms) micro-batches on both processes at once (no communication: what sharing the
    machine costs); and the large-vocabulary model's 1F1B at max(ms) with each of ``splits``."""
    from meshdsl.comm.distributed import TorchComm
    from meshdsl.train.jobs import gather_timelines
    from meshdsl.tools.pipe_report import schedule_summary
    model, feeds, w = _setup(seed, tiny)
    rows, outside = {}, {}
    steps = {}
    actions = _TorchActions()
    plain = TorchComm("stage:2", shm=False) if gloo else None   # every rank makes its groups, in order
    both = _floor_names(ms)[1]
    steps[both] = torch_step(model.config, w, feeds, lr, max(ms))
    for m in ms:
        for s in SCHEDULES + (GLOO,) * gloo:
            if not _runs("meshdsl", s, m):
                continue
            k = f"meshdsl {s} m={m}"
            rows[k], outside[k] = [], []
            steps[k] = meshdsl_step(model, feeds, plain if s == GLOO else comm, "stage:2", "layer:stage", lr,
                                    seed, m, "1f1b" if s == GLOO else s, rows[k], outside[k])
            if f"torch {s} m={m}" in _names(ms):
                name = f"torch {s} m={m}"
                steps[name] = actions.wrap(name, torch_interleaved_step(model.config, w, feeds, lr, m)
                                           if s == INTERLEAVED else torch_pipe_step(model.config, w, feeds, lr, s, m))
    if splits:
        big, big_feeds, _ = setup(seed, MODEL, **BALANCED)
        for i, counts in enumerate(splits):   # the first: the default split (no stage_layers)
            k = _balanced_name(max(ms), counts)
            rows[k], outside[k] = [], []
            steps[k] = meshdsl_step(big, big_feeds, comm, "stage:2", "layer:stage", lr, seed, max(ms),
                                    BALANCED_SCHEDULE, rows[k], outside[k], stage_layers=counts if i else None)
    if profile:   # the schedule to profile
        return _profile(steps[f"meshdsl {profile} m={max(ms)}"], warmup)
    dist.barrier()
    origin = time.perf_counter()
    loss0, last, times, cpu = _interleave(steps, warmup, reps, block, sync=dist.barrier,
                                          timed_arg=tuple(k for k in steps if k != both))
    # The loss lives on the last stage: rank 1's figures are the ones to report.
    sent = torch.tensor([loss0[k] for k in steps] + [last[k] for k in steps], dtype=torch.float64)
    dist.broadcast(sent, src=1)
    n = len(steps)
    loss0 = dict(zip(steps, sent[:n].tolist()))
    last = dict(zip(steps, sent[n:].tolist()))
    timelines = {k: gather_timelines(comm, r, origin) for k, r in rows.items()}
    summaries = {k: schedule_summary(steps[k].plan) for k in rows}
    act_bytes = {k: _activation_bytes(steps[k].plan) for k in rows}
    compute = {**actions.per_step_ms(), **{k: _meshdsl_actions_ms(r) for k, r in rows.items()}}
    once_bytes = {k: _once_transfer_bytes(steps[k].plan, dist.get_world_size()) for k in rows}
    return {"loss0": loss0, "last": last, "times": times, "cpu": cpu, "timelines": timelines,
            "summaries": summaries, "act_bytes": act_bytes, "actions_ms": compute, "outside": outside,
            "once_bytes": once_bytes}


def _profile(step, warmup, num_steps=10):
    import cProfile
    import io
    import pstats
    for _ in range(warmup):
        step()
    pr = cProfile.Profile()
    dist.barrier()
    pr.enable()
    for _ in range(num_steps):
        step()
    pr.disable()
    out = io.StringIO()
    stats = pstats.Stats(pr, stream=out)
    print(f"rank {dist.get_rank()}: {num_steps} steps", file=out)
    stats.sort_stats("tottime").print_stats(20)
    stats.sort_stats("cumulative").print_stats(30)
    return out.getvalue()


# ----------------------------------------------------------------------------- report

#: The parts of a stage's idle time (:func:`idle_breakdown`), in the order printed: its own send
#: actions; its receives after the message was sent (taking it in: copy and latency); its receives
#: before that (the sender was late); the time between its actions (the runtime's bookkeeping:
#: a finished micro-batch's activations dropped; the gradients its last action made are added into
#: the step's sums inside that action, as torch's backward accumulates them); before its first action and
#: after its last (the pipeline's fill and drain on this stage).
IDLE_PARTS = ("send", "recv copy", "recv wait", "between", "fill+drain")


def _aligned(rows) -> list:
    """One step's rows (one per process) with each process's clock shifted onto the first's.

    The barrier lines the clocks up to its skew only, and a receive's wait is taken against
    its sender's clock.  Between two processes that transfer both ways, the shortest
    receive-end-minus-send-start each way is taken to be the same: the offset is half their
    difference (as NTP takes it), carried along the chain of neighbouring processes."""
    def shortest(a: int, b: int):
        starts = {(kind[5:], mb, stage, peer): t0 for kind, mb, stage, peer, t0, _ in rows[a]
                  if kind.startswith("send")}
        spans = [t1 - starts[(kind[5:], mb, peer, stage)] for kind, mb, stage, peer, _, t1 in rows[b]
                 if kind.startswith("recv") and (kind[5:], mb, peer, stage) in starts]
        return min(spans, default=None)
    shift = [0.0] * len(rows)
    for j in range(1, len(rows)):
        there, back = shortest(j - 1, j), shortest(j, j - 1)
        shift[j] = shift[j - 1] + ((there - back) / 2 if there is not None and back is not None else 0.0)
    return [[(*a[:4], a[4] - d, a[5] - d) for a in row] for row, d in zip(rows, shift)]


def _window(rows) -> tuple[float, float]:
    """A step's makespan window, as :func:`meshdsl.lowering.timeline.bubble_from_timeline` takes
    it: from the first F or B start over all ranks to the last action's end."""
    first = min(t0 for row in rows for kind, *_, t0, _ in row if kind in ("F", "B"))
    return first, max(t1 for row in rows for *_, t1 in row)


def _row_parts(row, sends: dict, first: float, last: float) -> dict:
    """One rank's row of one step cut into busy time and :data:`IDLE_PARTS` (seconds; they sum to
    the makespan).  ``sends``: each send's end, by ``(kind, micro-batch, from stage, to stage)``."""
    out = dict.fromkeys(("busy", *IDLE_PARTS), 0.0)
    prev = first
    for kind, mb, stage, peer, t0, t1 in sorted(row, key=lambda a: a[4]):
        t0, t1 = max(t0, first), min(t1, last)
        if t1 <= t0:
            continue
        out["between" if prev > first else "fill+drain"] += max(0.0, t0 - prev)
        if kind in ("F", "B", "W"):
            out["busy"] += t1 - t0
        elif kind.startswith("send"):
            out["send"] += t1 - t0
        else:   # a receive: waiting until its sender's send ended, then taking the message in
            sent = sends.get((kind[5:], mb, peer, stage), t0)
            wait = min(max(0.0, sent - t0), t1 - t0)
            out["recv wait"] += wait
            out["recv copy"] += t1 - t0 - wait
        prev = max(prev, t1)
    out["fill+drain"] += last - prev
    return out


def idle_breakdown(timelines: list, num_ranks: int) -> list[dict]:
    """Per rank of the stage axis, milliseconds per step (means over the steps, so the parts add up
    to the makespan) of its busy time (F, B, W) and of each part of its idle time
    (:data:`IDLE_PARTS`), with the makespan.

    A receive's wait is taken against its sender's clock: the processes' clocks, lined up by a
    barrier (:func:`meshdsl.train.jobs.gather_timelines`), are first lined up by the transfers
    themselves (:func:`_aligned`).  A send's end is recorded once its call has returned, a little
    after the receiver may already have the message, so "recv copy" leans low and "recv wait" high.

    Args:
      timelines: per step, every rank's rows of ``(kind, microbatch, stage, peer, start, end)``.
      num_ranks: ranks of the stage axis (a row's rank is its stage modulo this).
    """
    per_step: list[list[dict]] = []
    for rows in map(_aligned, timelines):
        first, last = _window(rows)
        sends = {(kind[5:], mb, stage, peer): t1 for row in rows for kind, mb, stage, peer, _, t1 in row
                 if kind.startswith("send")}
        by_rank: list[list[dict]] = [[] for _ in range(num_ranks)]
        for row in rows:
            parts = _row_parts(row, sends, first, last)
            by_rank[row[0][2] % num_ranks].append({**parts, "makespan": last - first})
        per_step.append([{k: statistics.fmean(p[k] for p in ps) for k in ps[0]} for ps in by_rank])
    keys = ("makespan", "busy", *IDLE_PARTS)
    return [{k: statistics.fmean(s[r][k] for s in per_step) * 1e3 for k in keys} for r in range(num_ranks)]


def bubble_at_own_costs(program, timelines: list) -> list[float]:
    """Per rank, the bubble the schedule leaves at the measured costs of what each rank does
    itself: :func:`meshdsl.tools.pipe_report.bubble_at_costs`'s mean F, B and W per stage, plus each
    send action's mean time, each receive's mean time after its message was sent (also the
    latency a receive that waits pays), and the mean time between an action and the next one on its
    rank (the runtime's bookkeeping after it), charged to that action.  Against the measured bubble:
    what is left is waiting that the mean costs do not explain (variation, descheduling)."""
    from meshdsl.lowering.timeline import simulate
    spent: dict = {}
    copies: list[float] = []
    for rows in map(_aligned, timelines):
        sends = {(kind[5:], mb, stage, peer): t1 for row in rows for kind, mb, stage, peer, _, t1 in row
                 if kind.startswith("send")}
        for row in rows:
            ordered = sorted(row, key=lambda a: a[4])
            for (kind, mb, stage, peer, t0, t1), nxt in zip(ordered, [*ordered[1:], None]):
                own = t1 - t0
                if kind.startswith("recv"):
                    own = t1 - max(t0, min(t1, sends.get((kind[5:], mb, peer, stage), t0)))
                    copies.append(own)
                after = 0.0 if nxt is None else max(0.0, nxt[4] - t1)
                spent.setdefault((kind, stage), []).append(own + after)
    mean = {k: statistics.fmean(v) for k, v in spent.items()}
    split = any(kind == "W" for kind, _ in mean)
    latency = statistics.fmean(copies) if copies else 0.0
    stats = simulate(program.run_schedule(split), lambda a: mean.get((a.kind, a.stage), 0.0), latency)
    return [float(r.idle_fraction) for r in stats.ranks]


def placed_at_measured_costs(program, timelines: list) -> dict:
    """interleaved-zb's Ws placed at a run's measured costs instead of F = B = W = 1
    (:func:`meshdsl.lowering.schedule_gen.interleaved_zero_bubble_at`): each stage's mean F, B and
    W (as :func:`meshdsl.tools.pipe_report.bubble_at_costs` takes them; stage 0's B holds its
    weight gradients, it sends nothing), transfers free.  Returns, per rank, the Ws after
    its last B (its own W among them: 1 puts nothing off) and the bubble at those costs, beside
    the run's own (unplaced) schedule's."""
    from meshdsl.lowering.schedule_gen import interleaved_zero_bubble_at
    from meshdsl.lowering.timeline import simulate
    spent: dict = {}
    for rows in timelines:
        for row in rows:
            for kind, _, stage, _, t0, t1 in row:
                if kind in ("F", "B", "W"):
                    spent.setdefault((kind, stage), []).append(t1 - t0)
    mean = {k: statistics.fmean(v) for k, v in spent.items()}
    cost = lambda a: mean.get((a.kind, a.stage), 0.0)  # noqa: E731
    s = program.schedule
    placed = interleaved_zero_bubble_at(s.num_ranks, s.num_microbatches, s.num_chunks, cost)
    after = [sum(a.kind == "W" for a in row[max(i for i, a in enumerate(row) if a.kind == "B"):])
             for row in placed.actions]
    return {"ws_after_last_b": after,
            "bubble_run": [float(r.idle_fraction) for r in program.simulate(cost, defer=True).ranks],
            "bubble_placed": [float(r.idle_fraction) for r in simulate(placed, cost).ranks]}


def _idle_report(console, ms, figures, breakdown) -> None:
    """Prints where each stage's idle time goes at the largest m (:func:`idle_breakdown`)."""
    t = Table(title=f"where the idle time goes at m={max(ms)}: ms per step and stage (means over the timed steps)",
              title_justify="left")
    for col in ("variant", "stage", "makespan", "busy", *IDLE_PARTS, "bubble measured", "at costs",
                "at own costs", "theory"):
        t.add_column(col, justify="left" if col == "variant" else "right")
    for k, per_rank in breakdown.items():
        fig = figures[k]
        for r, parts in enumerate(per_rank):
            t.add_row(k if r == 0 else "", str(r), *(f"{parts[c]:.2f}" for c in ("makespan", "busy", *IDLE_PARTS)),
                      f"{fig['bubble_measured'][r]:.1%}", f"{fig['bubble_at_costs'][r]:.1%}",
                      f"{fig['bubble_at_own_costs'][r]:.1%}", f"{fig['bubble_theory']:.1%}")
    console.print(t)
    console.print("theory: (p-1)/(m+p-1), interleaved (p-1)/(vm+p-1): equal stage costs and free transfers; "
                  "zbh1 and interleaved-zb: their schedule at F = B = W = 1.  "
                  "At costs: the schedule replayed with each stage's mean F, B and W, transfers free "
                  "(the stages' imbalance alone).  At own costs: also each send's and each receive's own time "
                  "(after its message was sent) and the runtime's time between actions, at their means: "
                  "what the ranks' own work explains.  recv copy: a receive's time after its sender's send "
                  "ended; recv wait: before (the sender was late).", markup=False, highlight=False)


def _peak_bytes(peak: list[int], per_stage: list[int]) -> list[float]:
    """Per rank, peak activations held x the bytes of one: with v virtual stages a rank holds
    chunk activations of its v logical stages (rank r: r, r + p, ...), priced at their mean."""
    p = len(peak)
    return [n * statistics.fmean(per_stage[r::p]) for r, n in enumerate(peak)]


def _interleaved_report(console, ms, figures, med, per_round, outside, once_bytes) -> dict:
    """Prints interleaved's bubble against (p-1)/(vm+p-1) and its step against torch's, and the
    time each rank's step spends outside the schedule beside 1F1B's (the prologue and the final
    segment: the optimizer update, the loss's reductions), with the bytes sent there (from the
    plan).  Returns those figures by variant."""
    out = {}
    for m, schedule in ((m, s) for m in ms for s in (INTERLEAVED, INTERLEAVED_ZB) if f"meshdsl {s} m={m}" in figures):
        k, ref = f"meshdsl {schedule} m={m}", f"meshdsl 1f1b m={m}"
        fig, p = figures[k], figures[k]["stages"]
        v = 2
        th = (p - 1) / (v * m + p - 1)
        console.print(f"{schedule} m={m}: bubble formula (p-1)/(v*m+p-1) = {p - 1}/{v * m + p - 1} = {th:.1%}; "
                      f"measured (stage 0, 1) " + " ".join(f"{b:.1%} ({b / th:.2f}x)" for b in fig["bubble_measured"])
                      + "; step meshdsl " + _ms_range(med, per_round, k) + ", torch "
                      + _ms_range(med, per_round, f"torch {INTERLEAVED} m={m}"), markup=False, highlight=False)
        parts = zip(fig["bubble_measured"], fig["bubble_at_costs"], fig["bubble_at_own_costs"])
        console.print("  measured - formula, points per stage: " + " | ".join(
            f"{b - th:+.1%} = imbalance {c - th:+.1%} + own transfers and bookkeeping {o - c:+.1%}"
            f" + the rest {b - o:+.1%}" for b, c, o in parts)
            + " (at costs - formula; at own costs - at costs; measured - at own costs)", markup=False, highlight=False)
        if schedule == INTERLEAVED_ZB:   # its Ws placed: what that buys beside plain interleaved, same run
            plain = figures.get(f"meshdsl {INTERLEAVED} m={m}")
            if plain:
                console.print("  beside interleaved:2, stage 0, 1: measured " + " ".join(
                    f"{a:.1%} (was {b:.1%})" for a, b in zip(fig["bubble_measured"], plain["bubble_measured"]))
                    + "; at costs " + " ".join(f"{a:.1%} (was {b:.1%})" for a, b in
                                               zip(fig["bubble_at_costs"], plain["bubble_at_costs"]))
                    + "; peak chunk activations " + " ".join(f"{a} (was {b})" for a, b in
                                                             zip(fig["peak_activations"], plain["peak_activations"])),
                    markup=False, highlight=False)
                at = plain["zb_placed_at_costs"]
                console.print(f"  its Ws placed at interleaved:2's measured costs instead of F = B = W = 1 (simulated): "
                              f"Ws after the last B per rank {at['ws_after_last_b']}, bubble at those costs "
                              + " ".join(f"{a:.1%} (interleaved:2 {b:.1%})" for a, b in
                                         zip(at["bubble_placed"], at["bubble_run"])), markup=False, highlight=False)
            continue
        out[k] = {}
        for name in (k, ref):
            spans = [[statistics.median(x[i] for x in outside[name][r]) * 1e3 for i in (0, 1)] for r in range(2)]
            sent = once_bytes[name]
            out[k][name] = {"before_after_ms": spans, "prologue_bytes": sent["prologue"], "final_bytes": sent["final"]}
            console.print(f"  {name}: outside the schedule per step, ms before / after (rank 0 | rank 1): "
                          + " | ".join(f"{a:.1f} / {b:.1f}" for a, b in spans) + f" of {med[name]:.1f}; sent once "
                          "per step, prologue / final (rank 0 | rank 1): "
                          + " | ".join(f"{_size(a)} / {_size(b)}" for a, b in zip(sent["prologue"], sent["final"])),
                          markup=False, highlight=False)
    return out


def _balanced_report(console, names, figures, med, per_round, act_ms, times) -> dict:
    """Prints the balanced-stages rows (the layer-count split, then --stage-layers auto's): the
    measured bubble, the bubble the stages' measured costs leave, F+B per stage and the step,
    with the paired ratio of their step times.  Returns those figures by variant."""
    if not names:
        return {}
    t = Table(title=f"balanced stages: transformer vocab {BALANCED['vocab']}, {BALANCED['layers']} layers, "
                    f"{BALANCED_SCHEDULE}; layer-count split vs --stage-layers auto", title_justify="left")
    for col in ("variant", "median ms", "round medians", "bubble measured (stage 0, 1)", "at measured costs",
                "bubble theory", "F+B stage 0 ms", "F+B stage 1 ms"):
        t.add_column(col, justify="left" if col == "variant" else "right")
    out = {}
    for k in names:
        fig, busy = figures[k], [x["F"] + x["B"] if x else float("nan") for x in act_ms.get(k, [None, None])]
        t.add_row(k, f"{med[k]:.1f}", f"{min(per_round[k]):.1f}-{max(per_round[k]):.1f}",
                  " ".join(f"{b:.1%}" for b in fig["bubble_measured"]),
                  " ".join(f"{b:.1%}" for b in fig["bubble_at_costs"]), f"{fig['bubble_theory']:.1%}",
                  *(f"{x:.1f}" for x in busy))
        out[k] = {"median_ms": med[k], "bubble_measured": fig["bubble_measured"],
                  "bubble_at_costs": fig["bubble_at_costs"], "f_plus_b_ms": busy}
    console.print(t)
    if len(names) > 1:
        ratio = paired_ratio(times[names[1]], times[names[0]])
        out["step_ratio_auto_vs_even"] = ratio
        console.print(f"step time, auto split / layer-count split, paired by turn: {ratio['median']:.3f} "
                      f"(p10-p90 {ratio['p10']:.3f}-{ratio['p90']:.3f}, {ratio['turns']} turns)",
                      markup=False, highlight=False)
    else:
        console.print("--stage-layers auto picked the layer-count split itself on this host's calibration",
                      markup=False, highlight=False)
    return out


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB" if num_bytes >= 2**20 else f"{num_bytes / 2**10:.1f} KiB"


def _ms_range(med, per_round, k) -> str:
    return f"{med[k]:.1f} ms ({min(per_round[k]):.1f}-{max(per_round[k]):.1f})" if k in med else "-"


def bench(args) -> int:
    from meshdsl.processes.launcher import spawn
    from meshdsl.lowering.pipeline_program import PipelineProgram
    from meshdsl.lowering.schedule_gen import named_schedule
    from meshdsl.tools.pipe_report import run_figures
    console = Console(width=max(Console().width, 200))
    if args.profile:
        texts = spawn(pair_job, 2, args=(tuple(args.ms), args.warmup, 0, 2, args.lr, args.seed, args.profile_schedule),
                      mesh="stage:2", timeout=1800)
        for text in texts:
            console.print(text, markup=False, highlight=False)
        return 0
    machine = machine_start(threads=1)
    t_start, ticks0 = time.perf_counter(), _cpu_ticks()
    floor1, floor2 = _floor_names(args.ms)
    splits = [] if args.no_balanced else balanced_splits(max(args.ms), args.lr, args.seed)
    il_auto = None if args.no_balanced or args.tiny else interleaved_auto_split(max(args.ms), args.lr, args.seed)
    balanced = [_balanced_name(max(args.ms), c) for c in splits]
    single, pair = ("torch 1p", floor1, "meshdsl 1p"), [floor2, *_names(args.ms, args.gloo_sends), *balanced]
    times = {k: [] for k in (*single, *pair)}
    cpu = {k: [] for k in times}
    per_round = {k: [] for k in times}
    timelines = {k: [] for k in pair if k.startswith("meshdsl")}
    actions = {k: [[] for _ in range(2)] for k in pair}   # per stage (= rank): per round {"F", "B"} ms per step
    outside = {k: [[] for _ in range(2)] for k in timelines}   # per rank: (before, after) the schedule, s
    loss0, last, summaries, act_bytes, once_bytes = {}, {}, {}, {}, {}
    for rnd in range(args.rounds):
        one = spawn(single_job, 1, args=(tuple(args.ms), args.warmup, args.reps, args.block, args.lr, args.seed, args.tiny),
                    mesh="data:1", timeout=1800)[0]
        two = spawn(pair_job, 2, args=(tuple(args.ms), args.warmup, args.reps, args.block, args.lr, args.seed,
                                       False, args.gloo_sends, args.tiny, tuple(splits)), mesh="stage:2",
                    timeout=3600)
        for k in single:
            times[k] += one["times"][k]
            cpu[k] += one["cpu"][k]
            per_round[k].append(_ms(one["times"][k]))
        for k in pair:  # a step is done when its slower rank is
            wall = [max(ts) for ts in zip(*(r["times"][k] for r in two))]
            times[k] += wall
            cpu[k] += [max(cs) for cs in zip(*(r["cpu"][k] for r in two))]
            per_round[k].append(_ms(wall))
        for k in timelines:
            timelines[k] += two[0]["timelines"][k]
        for stage, r in enumerate(two):
            for k, spent in r["actions_ms"].items():
                actions[k][stage].append(spent)
            for k, spans in r["outside"].items():
                outside[k][stage] += spans
        summaries, act_bytes, once_bytes = two[0]["summaries"], two[0]["act_bytes"], two[0]["once_bytes"]
        if rnd == 0:
            loss0 = {**one["loss0"], **two[0]["loss0"]}
            last = {**one["last"], **two[0]["last"]}
    wall_s, ticks1 = time.perf_counter() - t_start, _cpu_ticks()
    load0, load1 = machine["load_start"], machine_end(machine)["load_end"]
    steal = (ticks1[0] - ticks0[0]) / max(1, ticks1[1] - ticks0[1]) if ticks0 and ticks1 else None
    # the summaries came from the ranks' processes: each figure replays its schedule, rebuilt by name
    programs = {k: PipelineProgram.of_schedule(named_schedule(
        summaries[k]["schedule"], summaries[k]["stages"], summaries[k]["microbatches"])) for k in timelines}
    figures = {k: {**run_figures(programs[k], tl), "bubble_at_own_costs": bubble_at_own_costs(programs[k], tl)}
               for k, tl in timelines.items()}
    for k in (k for k in figures if k.split()[1] == INTERLEAVED):   # interleaved-zb's Ws placed at these costs
        figures[k]["zb_placed_at_costs"] = placed_at_measured_costs(programs[k], timelines[k])
    breakdown = {k: idle_breakdown(timelines[k], programs[k].num_ranks) for k in timelines
                 if k not in balanced and k.endswith(f"m={max(args.ms)}")}
    med = {k: _ms(v) for k, v in times.items()}
    cpu_med = {k: _ms(v) for k, v in cpu.items()}
    speedup = {k: med["torch 1p"] / v for k, v in med.items()}
    base = loss0["torch 1p"]
    loss_ok = {k: abs(v - base) <= LOSS_RTOL * abs(base) for k, v in loss0.items() if k not in balanced}
    # the large-vocabulary model's splits: each against the layer-count split's loss
    loss_ok.update({k: abs(loss0[k] - loss0[balanced[0]]) <= LOSS_RTOL * abs(loss0[balanced[0]]) for k in balanced})

    workload = ("tiny transformer (4 layers, batch 16, seq 8, d_model 8)" if args.tiny else
                "transformer training step (4 layers, batch 16, seq 64, d_model 256, fp32)")
    t = Table(title=f"{workload}, 2 stages, "
                    f"1 thread/process, {args.rounds} round(s) x {args.reps} turns x {args.block} steps",
              title_justify="left")
    for col in ("variant", "median ms", "round medians", "CPU ms", "speedup vs 1p",
                "bubble measured (stage 0, 1)", "at measured costs", "bubble theory", "peak act. (theory)",
                "loss step 0"):
        t.add_column(col, justify="left" if col == "variant" else "right")
    for k in (*single, *pair):
        fig = figures.get(k)
        bub = " ".join(f"{b:.1%}" for b in fig["bubble_measured"]) if fig else ""
        costed = " ".join(f"{b:.1%}" for b in fig["bubble_at_costs"]) if fig else ""
        theory = f"{fig['bubble_theory']:.1%}" if fig else ""
        peak = (" ".join(map(str, fig["peak_activations"])) + f" ({' '.join(map(str, fig['peak_theory']))})"
                if fig else "")
        t.add_row(k, f"{med[k]:.1f}", f"{min(per_round[k]):.1f}-{max(per_round[k]):.1f}", f"{cpu_med[k]:.1f}",
                  f"{speedup[k]:.2f}x", bub, costed, theory, peak, f"{loss0[k]:.6f}" + ("" if loss_ok[k] else " [red]MISMATCH[/]"))
    console.print(t)
    console.print("ms: median step over every sample (the slower rank's); round medians: range of the "
                  "per-round medians; CPU ms: CPU time per step of the busier process (every thread; time "
                  "descheduled left out).  Bubble: idle fraction of the pipeline's makespan (first F to last "
                  "action) per stage (outside F, B and W: waits in a receive count as idle), median over the "
                  "timed steps; at "
                  "measured costs: the schedule replayed with each stage's mean F, B and W times and free "
                  "transfers, the bubble the stages' imbalance alone leaves.")

    act = Table(title="F and B per step and stage, ms (means over the timed steps; median of the rounds)",
                title_justify="left")
    for col in ("variant", "stage 0 F", "stage 0 B", "stage 1 F", "stage 1 B", "F+B stage 0", "F+B stage 1"):
        act.add_column(col, justify="left" if col == "variant" else "right")
    act_ms = {k: [{kind: statistics.median(r[kind] for r in per) for kind in ("F", "B")} if per else None
                  for per in stages] for k, stages in actions.items()}
    for k, (s0, s1) in act_ms.items():
        if s0 and s1:
            act.add_row(k, *(f"{x[kind]:.1f}" for x in (s0, s1) for kind in ("F", "B")),
                        f"{s0['F'] + s0['B']:.1f}", f"{s1['F'] + s1['B']:.1f}")
    console.print(act)
    console.print("torch: PipelineStage.forward_one_chunk / backward_one_chunk (the loss outside them); meshdsl: "
                  "its F and B actions, B with its W (the weight gradients, run after the send); the last stage's F includes the loss and the head's backward.")

    mem = Table(title=f"peak activation memory per stage, m={max(args.ms)}", title_justify="left")
    for col in ("schedule", "stage 0", "stage 1"):
        mem.add_column(col, justify="left" if col == "schedule" else "right")
    peak_mem = {}
    for s in SCHEDULES:
        k = f"meshdsl {s} m={max(args.ms)}"
        if k in figures:
            peak_mem[s] = _peak_bytes(figures[k]["peak_activations"], act_bytes[k])
            mem.add_row(s, *(f"{x / 2**20:.1f} MiB" for x in peak_mem[s]))
    console.print(mem)
    console.print("peak micro-batches held (measured) x the bytes of one micro-batch's forward outputs that "
                  "its backward reads, per stage; interleaved: peak chunk activations held x the mean over "
                  "the rank's chunks")

    _idle_report(console, args.ms, figures, breakdown)
    handout = _interleaved_report(console, args.ms, figures, med, per_round, outside, once_bytes)
    if il_auto is not None:   # whether balancing could move anything for interleaved:2 here
        even = il_auto == (sum(il_auto) // len(il_auto),) * len(il_auto)
        note = ("the layer-count split these rows run" + ("; one layer per virtual stage leaves none to move"
                                                          if set(il_auto) == {1} else "")
                if even else "not the layer-count split these rows run")
        console.print(f"{INTERLEAVED}: --stage-layers auto picks {','.join(map(str, il_auto))} per virtual stage "
                      f"on this host's calibration ({note})", markup=False, highlight=False)

    goals = {}
    balance = _balanced_report(console, balanced, figures, med, per_round, act_ms, times)
    for k, fig in figures.items():
        if k not in balanced and int(k.rsplit("=", 1)[1]) >= 4 and k.split()[1] in ("gpipe", "1f1b"):
            th = fig["bubble_theory"]
            goals[f"bubble within {BUBBLE_RTOL:.0%} of theory: {k}"] = all(
                abs(b - th) <= BUBBLE_RTOL * th for b in fig["bubble_measured"])
    for m in (m for m in args.ms if f"torch 1f1b m={m}" in med):
        goals[f"meshdsl 1f1b m={m} not slower than torch 1f1b"] = med[f"meshdsl 1f1b m={m}"] <= med[f"torch 1f1b m={m}"]
    if 8 in args.ms:
        for s in ("gpipe", "1f1b", "zbh1"):
            goals[f"meshdsl {s} m=8 >= {SPEEDUP_GOAL}x one process"] = speedup[f"meshdsl {s} m=8"] >= SPEEDUP_GOAL
        fig = figures[f"meshdsl {INTERLEAVED} m=8"]
        formula = fig["bubble_theory"]   # plain interleaved's theory: (p-1)/(vm+p-1)
        for s in (INTERLEAVED, INTERLEAVED_ZB):
            goals[f"meshdsl {s} m=8 bubble <= {INTERLEAVED_BUBBLE_GOAL}x (p-1)/(vm+p-1)"] = all(
                b <= INTERLEAVED_BUBBLE_GOAL * formula for b in figures[f"meshdsl {s} m=8"]["bubble_measured"])
        goals[f"meshdsl {INTERLEAVED} m=8 not slower than torch {INTERLEAVED}"] = (
            med[f"meshdsl {INTERLEAVED} m=8"] <= med[f"torch {INTERLEAVED} m=8"])
    for name, ok in goals.items():
        console.print(f"goal {name}: [bold {'green' if ok else 'red'}]{'met' if ok else 'missed'}[/]")
    m = max(args.ms)
    # Two equal stages, each half the micro-batched step's work at the speed it runs with the other
    # process busy beside it, and the theory bubble: makespan (m + 1) / m x that half.
    ceiling = med["torch 1p"] / (med[floor2] / 2 * (m + 1) / m)
    console.print(f"what this machine allows at m={m}: plain torch in {m} micro-batches takes {med[floor1]:.1f} ms on "
                  f"one process ({med[floor1] / med['torch 1p']:.2f}x its whole-batch step),\n"
                  f"  {med[floor2]:.1f} ms with both processes running it at once ({med[floor2] / med[floor1]:.2f}x); "
                  f"two equal stages of half that work with the theory bubble {1 / (m + 1):.1%}: "
                  f"{ceiling:.2f}x one process", markup=False, highlight=False)
    bad = [k for k, ok in loss_ok.items() if not ok]
    console.print(f"step-0 losses vs torch 1p (rtol {LOSS_RTOL:g}): "
                  + ("all equal" if not bad else f"[red]MISMATCH in {', '.join(bad)}[/]")
                  + f"; max |diff| = {max(abs(v - base) for k, v in loss0.items() if k not in balanced):.2e}"
                  + ("; the large-vocabulary splits against the layer-count split's" if balanced else ""))
    console.print(f"wall time {wall_s:.0f} s; load average at start {load0[0]:.2f}, at end {load1[0]:.2f} "
                  f"(1 min) on {os.cpu_count()} cores"
                  + (f"; CPU time stolen by the hypervisor during the run: {steal:.1%}" if steal is not None else ""))

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "workload": {"model": "transformer (tiny, 4 layers, batch 16)" if args.tiny else
                     "transformer (default Config)", "stages": 2, "microbatches": list(args.ms),
                     "lr": args.lr, "threads_per_process": 1},
        "run": {"rounds": args.rounds, "reps": args.reps, "block": args.block, "warmup": args.warmup,
                "wall_s": wall_s, "torch": torch.__version__, "python": platform.python_version(),
                "cpus": os.cpu_count(), "loadavg_start": load0, "loadavg_end": load1, "steal_fraction": steal,
                "machine": machine},
        "median_ms": med, "round_median_ms": per_round, "cpu_median_ms": cpu_med, "speedup_vs_torch_1p": speedup,
        "pipeline": figures, "idle_ms_per_step": breakdown, "actions_ms_per_step": act_ms, "outside_schedule": handout,
        "balanced_stages": balance, "interleaved_auto_split": il_auto,
        "ceiling_speedup": {"microbatches": m, "speedup": ceiling, "one_process_ms": med[floor1],
                            "both_processes_ms": med[floor2]}, "peak_activation_bytes": peak_mem, "goals": goals,
        "loss_step0": loss0, "loss_step0_ok": loss_ok, "loss_last": last,
        "step_ms": {k: [x * 1e3 for x in v] for k, v in times.items()},
    }, indent=1))
    console.print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0 if not bad else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="1-process + 2-process job pairs (default 3)")
    p.add_argument("--reps", type=int, default=3, help="turns per variant per round (default 3)")
    p.add_argument("--block", type=int, default=4,
                   help="consecutive steps per turn (at least 2); the first of each is untimed")
    p.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4, 8], help="micro-batch counts (default 1 2 4 8)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="1 round, 2 turns, m in {4, 8} (the goals' cases); overrides --rounds, --reps, --ms")
    p.add_argument("--profile", action="store_true", help="cProfile meshdsl 1f1b at the largest m, per rank")
    p.add_argument("--profile-schedule", default="1f1b", choices=SCHEDULES,
                   help="the schedule --profile profiles (default 1f1b)")
    p.add_argument("--tiny", action="store_true",
                   help="the tiny transformer (4 layers, batch 16), whose kernels cost almost nothing: "
                        "what the runtime and the transfers cost")
    p.add_argument("--no-balanced", action="store_true",
                   help="leave out the balanced-stages rows (the large-vocabulary model, layer-count split "
                        "vs --stage-layers auto)")
    p.add_argument("--gloo-sends", action="store_true",
                   help=f"also run meshdsl 1F1B with its stage-to-stage transfers on gloo's sockets "
                        f"(variant '{GLOO}'; by default they go through shared memory)")
    args = p.parse_args(argv)
    if args.block < 2:
        p.error("--block must be at least 2 (a turn's first step is untimed)")
    if args.quick:
        args.rounds, args.reps, args.ms = 1, 2, [4, 8]
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
