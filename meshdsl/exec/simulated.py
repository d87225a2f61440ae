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
from .comm import Communicator, as_device
from .executor import Executor


class SimulatedComm(Communicator):
    """Ranks of ``mesh`` in this process; ``xs[i]`` belongs to ``ranks[i]`` (default: every rank).

    Point-to-point sends leave their tensors in :attr:`mailbox` (keyed by destination
    rank and tag) and receives take them out, so the two ends of a transfer may run
    at different times, on different views (:meth:`view`).
    """

    def __init__(self, mesh: Mesh, ranks=None, *, mailbox: dict | None = None, log: list | None = None,
                 device=None):
        self.mesh = mesh
        self.device = as_device(device)
        self.ranks = tuple(range(mesh.size)) if ranks is None else tuple(ranks)
        self.log: list[tuple[str, tuple[str, ...], int]] = [] if log is None else log
        self.mailbox: dict = {} if mailbox is None else mailbox
        self._held = frozenset(self.ranks)

    def view(self, ranks) -> "SimulatedComm":
        """A communicator holding only ``ranks`` (e.g. one pipeline stage), sharing mailbox and log."""
        return SimulatedComm(self.mesh, ranks, mailbox=self.mailbox, log=self.log, device=self.device)

    def collective(self, kind, xs, axes, args):
        """See :meth:`Communicator.collective`; every call is appended to :attr:`log`."""
        c = COLLECTIVES[kind]
        if c.mailbox == "take":
            n, off = self.mesh.axis_size(axes), args["offset"]
            try:  # a member with no sender (the first stage, for offset 1) gets None
                xs = [self.mailbox.pop((r, args["tag"])) if 0 <= self.mesh.index_along(r, axes) - off < n
                      else None for r in self.ranks]
            except KeyError as e:
                raise GraphError(message(f"recv (tag {args['tag']}): nothing was sent to rank {e.args[0][0]}.",
                                         rule="a receive runs after its send",
                                         fix="run the sending step first")) from None
        x0 = next((x for x in xs if x is not None), None)
        self.log.append((kind, tuple(axes), 0 if x0 is None else x0.numel() * x0.element_size()))
        groups = self.mesh.groups(tuple(axes))
        if len(self.ranks) == self.mesh.size:
            full = list(xs)
        else:
            full = [None] * self.mesh.size
            for r, x in zip(self.ranks, xs):
                full[r] = x
            groups = tuple(g for g in groups if self._held.intersection(g))
            assert c.point_to_point or all(self._held.issuperset(g) for g in groups), \
                f"{kind} over {axes} needs ranks this view does not hold"
        out = c.simulated(full, groups, args)
        if c.mailbox == "put":
            for r, y in enumerate(out):
                if y is not None:
                    self.mailbox[(r, args["tag"])] = y
            return [None] * len(self.ranks)
        return [out[r] for r in self.ranks]


def run_simulated(plan: Plan, feeds: dict | None = None, params: dict | None = None,
                  seed: int = 0, device=None) -> dict[str, torch.Tensor]:
    """Run ``plan`` with every rank simulated in this process; returns full outputs.

    Args:
      plan: a compiled plan.
      feeds: input name -> full tensor (or :class:`~meshdsl.exec.executor.PerRank` slices).
      params: param name -> full tensor; defaults to the deterministic init.
      seed: init seed when params are not given.
      device: where every rank's values live (default the CPU; e.g. ``"cuda"``).

    Raises:
      GraphError: a param or feed the plan does not have, or one of the wrong shape or dtype.
    """
    ex = Executor(plan, SimulatedComm(plan.mesh, device=device))
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
        local[k] = ex.local_slices(value, v.to(ex.device))
    return ex.full_outputs(ex.run(feeds, local))
