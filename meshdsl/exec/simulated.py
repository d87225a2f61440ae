"""The simulated mesh: every rank in one process.

:class:`SimulatedComm` computes each collective exactly from the group
members' tensors (the simulated implementations of
:mod:`meshdsl.collectives`, reducing in group order), so results are
deterministic and match what real processes get.  :func:`run_simulated` runs a
whole plan on it and returns full outputs.
"""
from __future__ import annotations

import torch

from ..collectives import COLLECTIVES
from ..errors import GraphError, did_you_mean, message
from ..layout.mesh import Mesh
from ..lowering.plan import Plan
from .comm import Communicator
from .executor import Executor


class SimulatedComm(Communicator):
    """All ranks of ``mesh`` in this process; ``xs[i]`` belongs to rank ``i``."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.ranks = tuple(range(mesh.size))
        self.log: list[tuple[str, tuple[str, ...], int]] = []

    def collective(self, kind, xs, axes, args):
        """See :meth:`Communicator.collective`; every call is appended to :attr:`log`."""
        self.log.append((kind, tuple(axes), xs[0].numel() * xs[0].element_size()))
        return COLLECTIVES[kind].simulated(xs, self.mesh.groups(tuple(axes)), args)


def run_simulated(plan: Plan, feeds: dict | None = None, params: dict | None = None,
                  seed: int = 0) -> dict[str, torch.Tensor]:
    """Run ``plan`` with every rank simulated in this process; returns full outputs.

    Args:
      plan: a compiled plan.
      feeds: input name -> full tensor (or :class:`~meshdsl.exec.executor.PerRank` slices).
      params: param name -> full tensor; defaults to the deterministic init.
      seed: init seed when params are not given.

    Raises:
      GraphError: a param or feed the plan does not have, or one of the wrong shape or dtype.
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
