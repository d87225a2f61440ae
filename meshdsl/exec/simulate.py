"""Convenience entry points: run a plan on the simulated mesh, or the dense oracle."""
from __future__ import annotations

import torch

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
    if params:
        for k, v in params.items():
            vid = plan.params.get(k)
            if vid is not None:
                local[k] = ex.local_slices(plan.values[vid], v)
    return ex.full_outputs(ex.run(feeds, local))
