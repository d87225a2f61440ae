"""The runtime's own cost per step, for the cost model: what a step costs beyond its kernel.

:func:`dispatch_seconds` runs the tiny transformer's training step whole in this process
(the simulated mesh, one thread) and spreads the time its kernels' calibrated lines do
not explain over the steps it ran: the executor's bookkeeping and each op's own Python.
:func:`pipeline_dispatch_seconds` does the same for a 2-stage 1F1B pipeline, whose
runtime adds per-action bookkeeping; the cost model prices a pipeline's forward and
backward steps with it.
"""
from __future__ import annotations

import torch

from .calibrate import Calibration
from .sweep import median_time


def dispatch_seconds(cal: Calibration, reps: int) -> float:
    """The executor's seconds per step beyond the kernel lines, from the tiny transformer's
    training step on one rank (median of ``reps`` runs, one thread)."""
    return _runtime_seconds(cal, reps, "data:1", "")


def pipeline_dispatch_seconds(cal: Calibration, reps: int) -> float:
    """The pipeline runtime's seconds per step: the tiny transformer in 2 stages, 4 micro-batches,
    1F1B, run whole on the simulated mesh (every stage's actions in one process, one after
    another), less its kernels, over the steps it ran (median of ``reps`` runs, one thread);
    at least the executor's own :attr:`Calibration.dispatch_s`."""
    return max(cal.dispatch_s, _runtime_seconds(cal, reps, "pipe:2", "layer:pipe", microbatches=4, schedule="1f1b"))


def _runtime_seconds(cal: Calibration, reps: int, mesh: str, layout: str, **compile_args) -> float:
    """Seconds per local step that the tiny transformer's training step, run whole in this
    process on the simulated mesh, takes beyond its kernels' calibrated time."""
    from dataclasses import replace

    from ..runtime.executor import Executor
    from ..comm.simulated import SimulatedComm
    from ..lowering.compiler import compile as compile_plan
    from ..train.model import load_model
    from .predict import predict

    model = load_model("transformer", tiny=True)
    plan = compile_plan(model.train_step(0.01), mesh, layout, **compile_args)
    ex = Executor(plan, SimulatedComm(plan.mesh))
    params, feeds = ex.init_params(0), model.feeds(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seconds = median_time(lambda: ex.run(feeds, params), reps)
    finally:
        torch.set_num_threads(threads)
    # every rank's kernels, one after another (one process holds them all); no runtime cost
    bare = predict(plan, replace(cal, dispatch_s=0.0, pipeline_dispatch_s=0.0, cores=max(cal.cores, plan.mesh.size)))
    return max(0.0, (seconds - bare.compute_s) / max(bare.kernel_calls, 1))
