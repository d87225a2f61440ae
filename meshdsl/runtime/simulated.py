"""Run a whole plan with every rank simulated in this process (:class:`~meshdsl.comm.simulated.SimulatedComm`)."""
from __future__ import annotations

import torch

from ..comm.simulated import SimulatedComm
from ..errors import GraphError, clip, did_you_mean, message
from ..ir.interpret import feeds_dict
from ..lowering.plan import Plan
from .executor import Executor


def run_simulated(plan: Plan, feeds: dict | None = None, params: dict | None = None,
                  seed: int = 0, device=None, compile=False) -> dict[str, torch.Tensor]:
    """Run ``plan`` with every rank simulated in this process; returns full outputs.

    Args:
      plan: a compiled plan.
      feeds: input name -> full tensor (or :class:`~meshdsl.runtime.executor.PerRank` slices).
      params: param name -> full tensor; defaults to the deterministic init.
      seed: init seed when params are not given.
      device: where every rank's values live (default the CPU; e.g. ``"cuda"``).
      compile: as for :class:`~meshdsl.runtime.executor.Executor` (compiled segments; False: eager).

    Raises:
      GraphError: a param or feed the plan does not have, or one of the wrong shape or dtype.
    """
    if not isinstance(plan, Plan):
        raise GraphError(message(
            f"run_simulated: plan is {clip(repr(plan), 80)} ({type(plan).__name__}), not a Plan.",
            rule="run_simulated runs a compiled plan: every rank of its mesh in this process",
            fix="compile first, plan = md.compile(outputs, mesh, layout), then md.run_simulated(plan, feeds); "
                "md.run_dense(outputs, feeds) runs the graph itself on one device"))
    ex = Executor(plan, SimulatedComm(plan.mesh, device=device), compile=compile)
    local = ex.init_params(seed)
    for k, v in feeds_dict("run_simulated", params, "params").items():
        vid = plan.params.get(k)
        if vid is None:
            raise GraphError(message(f"run_simulated: the plan has no param '{k}'.{did_you_mean(k, plan.params)}",
                                     inputs=[f"params of the plan: {sorted(plan.params)}"],
                                     rule="params given by name must be params the outputs depend on",
                                     fix="drop it or correct the name"))
        value = plan.values[vid]
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != value.shape.sizes or v.dtype != value.dtype:
            got = f"{tuple(v.shape)} {v.dtype}" if isinstance(v, torch.Tensor) else type(v).__name__
            raise GraphError(message(f"run_simulated: param '{k}' is {got}, not {value.shape.sizes} {value.dtype}.",
                                     rule="a full param has its declared shape (dims in order) and dtype",
                                     fix=f"pass a tensor of shape {value.shape.sizes}"))
        local[k] = ex.local_slices(value, v.to(ex.device))
    return ex.full_outputs(ex.run(feeds, local))
