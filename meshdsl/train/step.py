"""A training step as one compiled plan: loss, gradients and SGD updates.

:class:`TrainStep` compiles ``{loss, new params}`` for a mesh and layout, keeps
each rank's param slices between steps, and reports where the time went
(local compute vs communication) per step.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..collectives import COLLECTIVES
from ..core.graph import Tensor
from ..exec.comm import Communicator
from ..exec.executor import Executor
from ..exec.fold import for_plan
from ..exec.simulated import SimulatedComm
from ..ir.autodiff import grad
from ..lowering.compiler import compile
from .optim import sgd

#: Stats keys that count as communication: every collective kind, and time blocked on one in flight.
COMM_KINDS = (*COLLECTIVES, "wait")

# (graph uid, id(loss), lr, with_grads) -> (loss, outputs), the most recent 64.
_TRAIN_OUTPUTS: OrderedDict = OrderedDict()
_TRAIN_OUTPUTS_SIZE = 64


def training_outputs(loss: Tensor, params: dict[str, Tensor], lr: float, with_grads: bool = False):
    """Graph outputs of one SGD step: ``loss`` and ``new/<param>`` (cached per loss and lr).

    Built once per (loss, lr): a second call returns the same tensors, so the compile
    cache sees the same outputs and the graph does not grow a second update.
    """
    key = (loss.graph.uid, id(loss), lr, with_grads)
    hit = _TRAIN_OUTPUTS.get(key)
    if hit is not None and hit[0] is loss:
        _TRAIN_OUTPUTS.move_to_end(key)
        return hit[1]
    grads = grad(loss, params)
    new = sgd(params, grads, lr)
    outs = {"loss": loss, **{f"new/{k}": v for k, v in new.items()}}
    if with_grads:
        outs.update({f"grad/{k}": g for k, g in grads.items()})
    _TRAIN_OUTPUTS[key] = (loss, outs)
    if len(_TRAIN_OUTPUTS) > _TRAIN_OUTPUTS_SIZE:
        _TRAIN_OUTPUTS.popitem(last=False)
    return outs


@dataclass
class StepStats:
    """Seconds of one step: total, local compute, communication, and per collective kind."""

    total: float
    compute: float
    comm: float
    by_kind: dict[str, float] = field(default_factory=dict)

    @property
    def overhead(self) -> float:
        """Time outside kernels and collectives: the framework's own cost."""
        return max(0.0, self.total - self.compute - self.comm)


class TrainStep:
    """Compile and run SGD steps of ``loss`` over ``params`` on ``comm``'s ranks.

    Args:
      loss: scalar loss Tensor.
      params: name -> param Tensor.
      mesh, layout: strings (or objects) as for :func:`meshdsl.compile`.
      comm: SimulatedComm or TorchComm for the same mesh.
      lr: SGD learning rate.
      seed: param init seed (same values for every layout).
      microbatches: cut the batch into this many micro-batches and accumulate their
        gradients (one step still equals one full-batch step).
      schedule: the pipeline schedule when the layout pipelines a repeat (``"layer:stage"``).
    """

    def __init__(self, loss: Tensor, params: dict[str, Tensor], mesh, layout, comm: Communicator,
                 lr: float = 0.01, seed: int = 0, microbatches: int = 1, schedule: str = "gpipe"):
        self.outputs = training_outputs(loss, params, lr)
        self.plan = compile(self.outputs, mesh, layout, microbatches=microbatches, schedule=schedule)
        if self.plan.mesh.axes != comm.mesh.axes:  # the plan has the virtual micro-batch axis
            comm = SimulatedComm(self.plan.mesh) if isinstance(comm, SimulatedComm) else for_plan(comm, self.plan)
        self.executor = Executor(self.plan, comm, donate_params=True)
        self.params = self.executor.init_params(seed)
        self.names = list(params)

    def __call__(self, feeds: dict, timed: bool = False) -> tuple[float, StepStats | None]:
        stats = {} if timed else None
        t0 = time.perf_counter()
        outs = self.executor.run(feeds, self.params, stats=stats)
        for k in self.names:
            self.params[k] = outs[f"new/{k}"]
        # A pipeline keeps the loss on its last stage: read it where it is.
        held = [x for x in outs["loss"] if x is not None]
        loss = float(held[0].item()) if held else float("nan")
        total = time.perf_counter() - t0
        if not timed:
            return loss, None
        comm = sum(v for k, v in stats.items() if k in COMM_KINDS)
        return loss, StepStats(total, stats.get("local", 0.0) + stats.get("split", 0.0), comm, stats)

    def full_params(self) -> dict[str, torch.Tensor]:
        """Every param as a full tensor (gathered over the mesh)."""
        return {k: self.executor.to_full_held(self.plan.params[k], v) for k, v in self.params.items()}
