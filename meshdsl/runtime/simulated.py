"""Run a whole plan with every rank simulated in this process (:class:`~meshdsl.comm.simulated.SimulatedComm`)."""
from __future__ import annotations

import torch

from ..comm.simulated import SimulatedComm
from ..errors import GraphError, clip, message
from ..ir.interpret import feeds_dict
from ..lowering.plan import Plan
from .dense import check_given_params
from .executor import Executor


def run_simulated(plan: Plan, feeds: dict | None = None, params: dict | None = None,
                  seed: int = 0, device=None, compile=False) -> dict[str, torch.Tensor]:
    """Run ``plan`` with every rank simulated in this process; returns full outputs.

    Args:
      plan: a compiled plan.
      feeds: input name -> full tensor (or :class:`~meshdsl.runtime.executor.PerRank` slices).
      params: param name -> full tensor; defaults to the deterministic init.  Any param of the
        outputs' graph may be given: one the plan does not read (a batch norm's running
        statistics next to a training loss) is checked, then ignored, as by
        :func:`~meshdsl.run_dense`.
      seed: init seed when params are not given.
      device: where every rank's values live (default the CPU; e.g. ``"cuda"``).
      compile: as for :class:`~meshdsl.runtime.executor.Executor` (compiled segments; False: eager).

    Raises:
      GraphError: a feed the plan does not have, a param named that is no param of the outputs'
        graph, or either of the wrong shape or dtype.
    """
    if not isinstance(plan, Plan):
        raise GraphError(message(
            f"run_simulated: plan is {clip(repr(plan), 80)} ({type(plan).__name__}), not a Plan.",
            rule="run_simulated runs a compiled plan: every rank of its mesh in this process",
            fix="compile first, plan = md.compile(outputs, mesh, layout), then md.run_simulated(plan, feeds); "
                "md.run_dense(outputs, feeds) runs the graph itself on one device"))
    given = feeds_dict("run_simulated", params, "params")
    check_given_params("run_simulated", given, declared_params(plan))
    ex = Executor(plan, SimulatedComm(plan.mesh, device=device), compile=compile)
    local = ex.init_params(seed)
    for k, v in given.items():
        if k in plan.params:   # (a param of the graph the plan does not read is left alone)
            local[k] = ex.local_slices(plan.values[plan.params[k]], v.to(ex.device))
    return ex.full_outputs(ex.run(feeds, local))


def declared_params(plan: Plan) -> dict:
    """Every param of the graph ``plan`` was compiled from: name -> (shape, dtype), those it
    reads included (:attr:`Plan.graph_params`, the plan's own ``params`` for a hand-made plan)."""
    return {**plan.graph_params, **{k: (plan.values[v].shape, plan.values[v].dtype) for k, v in plan.params.items()}}
