"""The communicator interface: the one seam between a plan and how ranks talk.

A communicator holds the values of some ranks of a mesh: all of them for the
simulated mesh, one for a torch.distributed process.  Values travel as lists
aligned with :attr:`Communicator.ranks`.  Collectives name mesh axes, never
process groups; the communicator maps axes to groups.  Tensor dims are given
by position (the executor has already resolved names).

What each collective kind computes is in :mod:`meshdsl.collectives`; a
communicator implements :meth:`Communicator.collective` once, for every kind.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..errors import GraphError, message
from ..layout.mesh import Mesh


def as_device(device) -> torch.device:
    """``device`` (a name such as ``"cuda"``, a torch.device, or None for the CPU) as a
    torch.device, a GPU's index filled in (the current one), checked to exist here.

    Raises:
      GraphError: a name torch does not know, or a GPU this machine lacks.
    """
    if device is None:
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise GraphError(message(f"unknown device {device!r}.", rule="a device is 'cpu', 'cuda' or 'cuda:<index>'",
                                 fix="use 'cpu' or 'cuda'")) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise GraphError(message(f"device {device!r} needs CUDA, and CUDA is not available on this machine.",
                                     inputs=[f"torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}"],
                                     rule="values live on a device this machine has",
                                     fix="use 'cpu', or run on a machine with a GPU"))
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index >= torch.cuda.device_count():
            raise GraphError(message(f"device {device!r}: this machine has {torch.cuda.device_count()} GPU(s).",
                                     rule="a GPU index is below torch.cuda.device_count()",
                                     fix="use 'cuda' (the current GPU) or a smaller index"))
    return dev


class Communicator(ABC):
    """Collectives over named mesh axes for the ranks this process holds.

    Every method takes ``xs``, one local tensor per held rank, and returns the
    results in the same order.  ``axes`` is a tuple of mesh axis names; a group
    over several axes is ordered with the first axis major.
    """

    mesh: Mesh
    ranks: tuple[int, ...]
    #: Collective kinds :meth:`start` runs asynchronously; the executor issues them early.
    async_kinds: frozenset = frozenset()
    #: Where the held ranks' values live: params are made and feeds moved there by the
    #: executor (a torch.distributed process on nccl: its GPU).
    device: torch.device = torch.device("cpu")

    @abstractmethod
    def collective(self, kind: str, xs: list[torch.Tensor], axes: tuple[str, ...],
                   args) -> list[torch.Tensor | None]:
        """Run collective ``kind`` (a key of :data:`meshdsl.collectives.COLLECTIVES`) with step ``args``."""

    def start(self, kind: str, xs: list[torch.Tensor], axes: tuple[str, ...], args) -> "Pending":
        """Begin collective ``kind`` and return a handle whose ``wait()`` gives the result.

        The default runs it at once; communicators that can overlap communication
        with compute (torch.distributed's ``async_op``) override this.
        """
        return Done(self.collective(kind, xs, axes, args))

    def reduce_buffer(self, axes: tuple[str, ...], numel: int, dtype: torch.dtype, starts: int):
        """``(buffer, result)``, 1-D tensors of ``numel`` elements (one held rank's; contents
        undefined): ``starts`` later ``bucket_allreduce`` starts over ``axes``, each of a
        contiguous span of ``buffer``, reduce it copying nothing in, and each one's result
        (what its handle gives) is the same span of ``result``, valid until this rank asks
        for the next such buffer over ``axes``.  None where the communicator has no such memory:
        the caller allocates its own.  Every member of the group asks at the same point (a
        shared segment may be made then)."""
        return None

    # Named forms of the collectives the compiler emits today (tests and tools call them).
    def all_reduce(self, xs, axes, op: str):
        """Reduce with ``op`` in {"sum", "max", "min"} over each group; everyone gets the result."""
        return self.collective("allreduce", xs, axes, {"op": op})

    def all_gather(self, xs, axes, dim: int):
        """Concatenate the group's tensors along ``dim`` in group order."""
        return self.collective("allgather", xs, axes, {"dim": dim})

    def all_to_all(self, xs, axes, split_dim: int, concat_dim: int):
        """Split along ``split_dim`` into group-size chunks, send chunk j to member j, and
        concatenate what arrives along ``concat_dim`` in group order."""
        return self.collective("alltoall", xs, axes, {"split_dim": split_dim, "concat_dim": concat_dim})

    def reduce_scatter(self, xs, axes, dim: int, op: str):
        """Reduce over the group, then keep chunk ``i`` (along ``dim``) on member ``i``."""
        return self.collective("reduce_scatter", xs, axes, {"dim": dim, "op": op})

    def permute(self, xs, axes, offset: int, wrap: bool, reverse: bool = False):
        """Send to the member ``offset`` further along the group; receive from ``-offset``.

        Without ``wrap`` a member with no sender gets ``None``.  With ``reverse`` member ``j``
        trades with member ``n - 1 - j`` instead (``offset`` unused).
        """
        args = {"offset": offset, "wrap": wrap, **({"reverse": True} if reverse else {})}
        return self.collective("permute", xs, axes, args)

    def send(self, xs, axes, offset: int, tag: int):
        """Send to the member ``offset`` further along the group (no result); ``tag`` pairs it with its recv."""
        return self.collective("send", xs, axes, {"offset": offset, "tag": tag})

    def recv(self, xs, axes, offset: int, tag: int):
        """Receive what the member ``offset`` back along the group sent with ``tag``.

        ``xs`` are templates (local shape and dtype of what arrives); a member with no
        sender gets ``None``.
        """
        return self.collective("recv", xs, axes, {"offset": offset, "tag": tag})

    def open_pipe(self, axes: tuple[str, ...], offsets) -> None:
        """Prepare a pipeline's transfers over ``axes`` at ``offsets`` (a faster path, where a
        communicator has one); every rank calls it at the same point.  Transfers use it when
        their ``args`` ask for ``"pipe"``."""

    def pipe_link(self, kind: str, axes: tuple[str, ...], offset: int, tag: int, like: torch.Tensor):
        """A ``send`` or ``recv`` (``kind``) of this communicator's one rank that a pipeline runs
        every step, bound to :meth:`open_pipe`'s path once: an object whose ``send(x)`` /
        ``recv()`` (a fresh tensor shaped as ``like``) run it; None where there is no such path
        (the transfer goes through :meth:`collective` and :meth:`start`)."""
        return None

    def hold(self, work, buffer) -> None:
        """Keep an asynchronous send (and its buffer) until :meth:`drain` (communicators that have them)."""

    def drain(self) -> None:
        """Wait for every send still in flight."""

    def barrier(self) -> None:
        """Wait for every rank (a no-op where all ranks live in one process)."""

    def agree(self, token: str) -> list[str]:
        """Exchange a string with every rank; returns all ranks' strings (rank order)."""
        return [token] * self.mesh.size


class Pending:
    """A collective in flight; ``wait()`` returns one tensor per held rank."""

    def wait(self) -> list[torch.Tensor]:
        raise AssertionError("subclasses implement wait()")


class Done(Pending):
    """A result that is already there."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def wait(self):
        return self.value
