"""Convenience entry points: run a plan on the simulated mesh, or the dense oracle."""
from __future__ import annotations

import torch

from ..errors import GraphError, did_you_mean, message
from ..lowering.plan import Plan
from .executor import Executor
from .simulated import SimulatedComm


def run_simulated(plan: Plan, feeds: dict | None = None, params: dict | None = None,
                  seed: int = 0) -> dict[str, torch.Tensor]:
    """Run ``plan`` with every rank simulated in this process; returns full outputs.

    Args:
      plan: a compiled plan.
      feeds: input name -> full tensor (or :class:`PerRank` slices).
      params: param name -> full tensor; defaults to the deterministic init.
      seed: init seed when params are not given.
    """
    ex = Executor(plan, SimulatedComm(plan.mesh))
    local = ex.init_params(seed)
    for k, v in (params or {}).items():
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
        local[k] = ex.local_slices(value, v)
    return ex.full_outputs(ex.run(feeds, local))
