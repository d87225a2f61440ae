"""A communicator for the virtual micro-batch axis on real processes.

A plan compiled with ``microbatches=m`` runs on the user's mesh plus a virtual axis
(:data:`meshdsl.lowering.pipeline.MB_AXIS`, minor).  :class:`MicrobatchComm` lets one
process hold all ``m`` virtual ranks of its real rank, on top of a real communicator
(a :class:`~meshdsl.comm.distributed.TorchComm`):

* a collective over axes without the micro-batch axis runs once per held virtual
  rank, over the real group (every member holds the same micro-batches, so all
  issue them in the same order);
* an allreduce over axes with it first folds the held micro-batches locally, in
  group order, then reduces the rest over the real axes;
* an allgather over axes with it (a value holding the examples' dim put back into one
  tensor: an output, a per-example param) joins the held micro-batches locally: each
  gathered over the real axes, then joined, when the micro-batch axis comes first in the
  group order; joined, then gathered, when it comes last;
* a send or receive carries the micro-batch in its tag, so transfers of different
  micro-batches never pair up; a receive can be started early and waited for later.
"""
from __future__ import annotations

import torch

from ..collectives import REDUCE
from ..errors import DistributedError, message
from ..layout.mesh import Mesh
from ..lowering.pipeline import MB_AXIS
from .communicator import Communicator, Pending
from .real_parts import mb_gather_ok


def real_rank(mesh: Mesh, virtual: int) -> int:
    """The real rank of a virtual rank of ``mesh`` (the real mesh is ``mesh`` without the
    micro-batch axis, which is minor); ``virtual`` itself on a mesh without it."""
    return virtual // mesh.sizes.get(MB_AXIS, 1)


class MicrobatchComm(Communicator):
    """The virtual ranks ``ranks`` of ``mesh`` (with :data:`MB_AXIS`) on the real communicator ``real``.

    Args:
      real: a communicator for ``mesh`` without the micro-batch axis, holding one rank.
      mesh: the plan's mesh.
      ranks: the virtual ranks held; default: every micro-batch of ``real``'s rank.
    """

    def __init__(self, real: Communicator, mesh: Mesh, ranks=None):
        self.real, self.mesh = real, mesh
        m = mesh.sizes[MB_AXIS]
        (r,) = real.ranks
        self.ranks = tuple(range(r * m, (r + 1) * m)) if ranks is None else tuple(ranks)
        self.num_microbatches = m
        self.async_kinds = real.async_kinds
        self.device = real.device

    def view(self, ranks) -> "MicrobatchComm":
        """The same process holding only ``ranks`` (some of its micro-batches)."""
        return MicrobatchComm(self.real, self.mesh, ranks)

    def _mb(self, v: int) -> int:
        return v % self.num_microbatches

    def _tag(self, v: int, tag: int) -> int:
        """A transfer's ``tag`` with micro-batch ``v``'s in it: transfers of different micro-batches never match."""
        return tag * self.num_microbatches + self._mb(v)

    def _tagged(self, v: int, args) -> dict:
        return {**args, "tag": self._tag(v, args["tag"])}

    def start(self, kind, xs, axes, args):
        """See :meth:`Communicator.start`: what the real communicator runs asynchronously runs
        so here too.  A receive is posted and waited for later (a pipeline posts its next
        one before computing); a sum over the micro-batches is folded locally at once and
        its reduction over the real axes left in flight."""
        axes = tuple(axes)
        if kind not in self.async_kinds or (kind == "allgather" and MB_AXIS in axes):
            return super().start(kind, xs, axes, args)
        real_axes = _real(axes)
        if kind in ("send", "recv"):
            return _PerRankResults([self.real.start(kind, [x], real_axes, self._tagged(v, args))
                         for v, x in zip(self.ranks, xs)])
        if MB_AXIS not in axes:
            return _PerRankResults([self.real.start(kind, [x], real_axes, args) for x in xs])
        if not real_axes:
            return super().start(kind, xs, axes, args)
        acc = self._fold(kind, xs, axes, args)
        return _SharedResult(self.real.start(kind, [acc], real_axes, args), len(xs))

    def collective(self, kind, xs, axes, args):
        """See :meth:`Communicator.collective`."""
        axes = tuple(axes)
        real_axes = _real(axes)
        if kind in ("send", "recv"):
            return [self.real.collective(kind, [x], real_axes, self._tagged(v, args))[0]
                    for v, x in zip(self.ranks, xs)]
        if MB_AXIS not in axes:
            return [self.real.collective(kind, [x], real_axes, args)[0] for x in xs]
        if kind == "allgather" and mb_gather_ok(kind, axes, args) and len(self.ranks) == self.num_microbatches:
            return [self._join(xs, axes, args)] * len(xs)
        acc = self._fold(kind, xs, axes, args)
        if real_axes:
            acc = self.real.collective(kind, [acc], real_axes, args)[0]
        return [acc] * len(xs)

    def _join(self, xs, axes, args):
        """An allgather over ``axes`` (the micro-batch axis first or last) of all the held
        micro-batches: in the simulated mesh's group order (the first axis is the major one)."""
        dim, real_axes = args["dim"], _real(axes)
        xs = [x for _, x in sorted(zip(map(self._mb, self.ranks), xs), key=lambda p: p[0])]
        if not real_axes:
            return torch.cat(xs, dim=dim)
        if axes[0] == MB_AXIS:    # micro-batch k's block holds every real rank's part of it
            return torch.cat([self.real.collective("allgather", [x], real_axes, args)[0] for x in xs], dim=dim)
        return self.real.collective("allgather", [torch.cat(xs, dim=dim)], real_axes, args)[0]

    def _fold(self, kind, xs, axes, args):
        """The held micro-batches' sum (or max/min), folded in group order; checks that the
        collective is one real processes can fold."""
        if kind != "allreduce" or len(self.ranks) != self.num_microbatches:
            raise DistributedError(message(
                f"{kind} over {axes} on torch.distributed with micro-batches.",
                inputs=[f"mesh: {self.mesh}"],
                rule="on real processes, a rank holding all its micro-batches folds sums over the "
                     "micro-batch axis (gradient accumulation, the loss mean) and joins them in an even "
                     "allgather with the micro-batch axis first or last",
                fix="use microbatches=1 for this layout, or the simulated mesh"))
        acc = xs[0]
        for x in xs[1:]:  # the micro-batch axis is minor: a rank's micro-batches are consecutive in a group
            acc = REDUCE[args.get("op", "sum")](acc, x)
        return acc

    def open_pipe(self, axes, offsets) -> None:
        self.real.open_pipe(_real(axes), offsets)

    def pipe_link(self, kind, axes, offset, tag, like):
        """See :meth:`Communicator.pipe_link`: for a view holding one micro-batch, the real
        communicator's link, with the micro-batch in the tag as :meth:`start` puts it."""
        if len(self.ranks) != 1:
            return None
        return self.real.pipe_link(kind, _real(axes), offset, self._tag(self.ranks[0], tag), like)

    def hold(self, work, buffer) -> None:
        self.real.hold(work, buffer)

    def drain(self) -> None:
        self.real.drain()

    def barrier(self) -> None:
        self.real.barrier()

    def agree(self, token: str) -> list[str]:
        return self.real.agree(token)


class _SharedResult(Pending):
    """One collective in flight whose result every held micro-batch rank reads."""

    __slots__ = ("part", "n")

    def __init__(self, part, n):
        self.part, self.n = part, n

    def wait(self):
        return self.part.wait() * self.n


class _PerRankResults(Pending):
    """Several held ranks' collectives in flight; ``wait()`` gives one result per rank."""

    __slots__ = ("parts",)

    def __init__(self, parts):
        self.parts = parts

    def wait(self):
        return [p.wait()[0] for p in self.parts]


def for_plan(comm: Communicator, plan) -> Communicator:
    """``comm``, or the communicator ``plan`` runs on when it has the micro-batch axis: the
    simulated mesh of the plan's mesh (on ``comm``'s device) when ``comm`` simulates one, a
    :class:`MicrobatchComm` on ``comm`` when it holds one real rank (torch.distributed)."""
    if MB_AXIS in plan.mesh.sizes and MB_AXIS not in comm.mesh.sizes:
        from .simulated import SimulatedComm
        if isinstance(comm, SimulatedComm):
            return SimulatedComm(plan.mesh, device=comm.device)
        if len(comm.ranks) == 1:
            return MicrobatchComm(comm, plan.mesh)
    return comm


def _real(axes) -> tuple[str, ...]:
    """``axes`` without the micro-batch axis: the real communicator's."""
    return tuple(a for a in axes if a != MB_AXIS)
