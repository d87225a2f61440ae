"""What each rank of a multi-process job runs: check a model against dense, or train it.

These functions are module-level so the spawn launcher can pickle them; each
rank rebuilds the model from its file, compiles the same plan, cross-checks
the plan's signature with every other rank (a mismatch is an error, not a
deadlock), and runs it on its :class:`~meshdsl.comm.distributed.TorchComm`.
"""
from __future__ import annotations

import sys
import time


from ..errors import DistributedError, message
from ..comm.communicator import Communicator
from ..runtime.executor import Executor
from ..comm.microbatch import for_plan
from ..runtime.pipeline import outputs_to_first_rank
from ..lowering.bucket import DEFAULT_BUCKET_MB
from ..lowering.compiler import compile as compile_plan
from ..lowering.plan import Plan
from ..lowering.users_terms import about_plan
from .model import DEFAULT_LR
from .step import TrainStep, step_outputs, training_outputs


def agree_plan(comm: Communicator, plan: Plan) -> None:
    """Raise on every rank unless all ranks compiled the same plan (hash of steps and collectives)."""
    sigs = comm.agree(plan.signature())
    if len(set(sigs)) > 1:
        groups: dict[str, list[int]] = {}
        for r, s in enumerate(sigs):
            groups.setdefault(s, []).append(r)
        raise DistributedError(about_plan(message(
            "The ranks compiled different plans; running them would deadlock or give wrong numbers "
            "(the mesh and layout below are this rank's).",
            inputs=[f"mesh: {plan.mesh}", f"layout: {plan.layout}"],
            bullets=[f"ranks {rs}: plan {s}" for s, rs in groups.items()],
            rule="every rank compiles the same model with the same mesh and layout",
            fix="pass identical --mesh/--layout and model files to every rank"), plan))


def _load(model_ref: str, tiny: bool, config: dict | None = None):
    from .model import load_model
    return load_model(model_ref, tiny=tiny, **(config or {}))


def check_job(comm: Communicator, model_ref: str, tiny: bool, mesh: str, layout: str, seed: int = 0,
              microbatches: int = 1, schedule: str = "gpipe", optimizer=None, clip_norm: float | None = None,
              config: dict | None = None, bucket_mb: float = DEFAULT_BUCKET_MB, compile=False,
              remat: str | None = None, stage_layers=None):
    """Loss and gradients of the model on this job's ranks; rank 0 returns them in full.

    With an ``optimizer``: loss, global gradient norm, and the new params and
    optimizer state after one step (``clip_norm`` clips the norm).  ``config`` holds
    overrides of the model's Config fields (``--config``); ``bucket_mb`` sizes the gradient buckets;
    ``compile``: the executor's (``Executor(..., compile=)``); ``remat``: every repeat's
    activation checkpointing (None: its own policy).
    """
    model = _load(model_ref, tiny, config)
    hyper = {}
    if optimizer is None:
        step = training_outputs(model.loss, model.params, DEFAULT_LR, with_grads=True, remat=remat)
        outs = {"loss": model.loss, **{f"grad/{k}": step[f"grad/{k}"] for k in model.params}}
    else:
        outs = step_outputs(model.loss, model.params, DEFAULT_LR, optimizer, clip_norm is not None, remat,
                            updates=model.updates)   # as `check` compares on the simulated mesh
        hyper = TrainStep.hyper_values(optimizer, clip_norm, 0)
    plan = compile_plan(outs, mesh, layout, microbatches=microbatches, schedule=schedule, bucket_mb=bucket_mb,
                        stage_layers=stage_layers)   # layers per stage (None: equal)
    agree_plan(comm, plan)
    ex = Executor(plan, for_plan(comm, plan), compile=compile)
    res = ex.run({**model.feeds(seed), **hyper}, ex.init_params(seed))
    report_compile(comm, ex, "check")
    full = outputs_to_first_rank(comm, plan, ex.full_outputs(res))
    return {k: v.detach().cpu() for k, v in full.items()} if comm.ranks[0] == 0 else None


def train_job(comm: Communicator, model_ref: str, tiny: bool, mesh: str, layout: str, steps: int,
              lr: float, seed: int = 0, warmup: int = 1, microbatches: int = 1, schedule: str = "gpipe",
              optimizer=None, clip_norm: float | None = None, config: dict | None = None,
              with_timeline: bool = False, precision: str = "fp32", bucket_mb: float = DEFAULT_BUCKET_MB,
              remat: str | None = None, compile=False, stage_layers=None):
    """Run ``warmup + steps`` training steps (plain SGD of ``lr``, or ``optimizer``) in
    ``precision``, every repeat checkpointed by ``remat`` (None: its own policy); returns
    per-step (loss, StepStats, seconds) of the timed steps.

    With a pipeline, the loss is that of the ranks that hold it (the last stage; NaN elsewhere).
    ``config`` holds overrides of the model's Config fields (``--config``); ``bucket_mb`` sizes
    the gradient buckets (0: none).  With ``with_timeline``, returns ``(steps, timelines)``
    instead: ``timelines`` has, per timed step, every rank's pipeline actions (see :func:`gather_timelines`; None without a pipeline).
    """
    model = _load(model_ref, tiny, config)
    step = TrainStep(model.loss, model.params, mesh, layout, comm, lr=lr, seed=seed,
                     microbatches=microbatches, schedule=schedule, optimizer=optimizer, clip_norm=clip_norm,
                     precision=precision, bucket_mb=bucket_mb, remat=remat, compile=compile,
                     stage_layers=stage_layers,   # layers per stage (None: equal)
                     updates=model.updates)       # the frozen params it sets, as `meshdsl train` does
    agree_plan(comm, step.plan)
    feeds = model.feeds(seed)
    for n in range(warmup):
        step(feeds)
        if n == 0:
            report_compile(comm, step.executor, "run")
    comm.barrier()
    origin = time.perf_counter()  # every rank leaves the barrier at about the same moment
    out, rows = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss, stats = step(feeds, timed=True)
        out.append((loss, stats, time.perf_counter() - t0))
        rows.append(step.executor.last_timeline)
    # A pipeline's loss is on its last stage only: every rank reports the losses of the first that has them.
    reported = [r for r in comm.agree(" ".join(repr(loss) for loss, _, _ in out)) if "nan" not in r]
    if reported:
        out = [(float(x), stats, dt) for x, (_, stats, dt) in zip(reported[0].split(), out)]
    if not with_timeline:
        return out
    return out, (gather_timelines(comm, rows, origin) if rows[0] is not None else None)


def report_compile(comm: Communicator, ex: Executor, command: str) -> None:
    """Rank 0 prints what compiling cost (``--compile``), after the first run."""
    if ex.compiling is not None and comm.ranks[0] == 0:
        print(f"{command}: --compile: rank 0: {ex.compiling.stats.summary()}", file=sys.stderr, flush=True)


def gather_timelines(comm: Communicator, rows: list, origin: float) -> list:
    """Every rank's recorded pipeline actions, per step, on one clock.

    Each rank's ``perf_counter`` times are taken relative to ``origin``, the moment it left
    a barrier, so rows of different processes (even on different hosts) line up to within
    the barrier's skew (tens of microseconds on loopback gloo).  Gathered after the timed
    steps, so the exchange does not land inside a timed step.

    Args:
      rows: per step, this rank's ``Executor.last_timeline`` (one row per stage it runs).

    Returns:
      Per step, a list of rows (every rank's, rank order), each a list of
      ``(kind, microbatch, stage, peer, start, end)`` with times in seconds since ``origin``.
    """
    text = "|".join(";".join(" ".join(f"{a.kind},{a.microbatch},{a.stage},{-1 if a.peer is None else a.peer},"
                                      f"{t0 - origin:.7f},{t1 - origin:.7f}" for a, t0, t1 in row)
                             for row in step_rows) for step_rows in rows)
    per_step: list[list] = [[] for _ in rows]
    for token in comm.agree(text):
        for k, step_text in enumerate(token.split("|")):
            for row_text in step_text.split(";"):
                row = []
                for item in row_text.split():
                    kind, mb, stage, peer, t0, t1 = item.split(",")
                    row.append((kind, int(mb), int(stage), None if peer == "-1" else int(peer),
                                float(t0), float(t1)))
                if row:
                    per_step[k].append(row)
    return per_step


__all__ = ["agree_plan", "check_job", "train_job", "gather_timelines"]
