"""A communicator on torch.distributed: one process holds one rank of the mesh.

:class:`TorchComm` maps a tuple of mesh axes to the process group of the ranks
that differ only along those axes.  Groups are created once, at construction,
for every subset of axes in a fixed order, because every rank must call
``dist.new_group`` for every group in the same order.  A tuple like
``("model", "data")`` reuses the group of ``("data", "model")``; the collectives
put members in the order the tuple asks for (first axis major).

Results match :class:`~meshdsl.comm.simulated.SimulatedComm`: bitwise for
gather, all-to-all, permute, max/min and reduce-scatter (which reduces locally
in group order); ``all_reduce(op="sum")`` uses the backend's own summation
order, so it agrees to within fp rounding.  What each collective kind sends is
its ``distributed`` (and optional ``start``) entry in :mod:`meshdsl.collectives`;
this module owns the groups, the device, the stats and the string exchange.

Set ``MESHDSL_VERBOSE=1`` (or pass ``verbose=True``) to log every collective to
stderr; per-kind totals are always kept in :attr:`TorchComm.stats`.

On gloo, the allreduces, allgathers, reduce-scatters and all-to-alls of a group whose
ranks share this host go through shared memory (:mod:`.shm`), several times faster
than gloo's sockets; ``shm=False`` or ``MESHDSL_SHM=0`` keeps them on gloo.
"""
from __future__ import annotations

import itertools
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..collectives import COLLECTIVES, REDUCE, parts_of
from ..errors import DistributedError, MeshError, message
from ..layout.mesh import Mesh
from .communicator import Communicator, Pending
from .torch_collectives import TORCH
from .shm import ShmGroup, supported as shm_supported
from .shm_pipe import ShmPipe

DEFAULT_TIMEOUT_S = 60.0



class _InFlight(Pending):
    """An async collective; ``wait()`` blocks on it, books its stats and returns the result."""

    __slots__ = ("comm", "work", "kind", "finish", "axes", "slice", "x", "t0", "out")

    def __init__(self, comm, work, kind, finish, axes, s, x, t0):
        self.comm, self.work, self.kind, self.finish = comm, work, kind, finish
        self.axes, self.slice, self.x, self.t0 = axes, s, x, t0

    def wait(self):
        if self.work is not None:
            self.work.wait()
            self.work = None
            self.out = [self.finish()]
            self.finish = None
            self.comm._done(self.kind, self.axes, self.slice, self.x, self.t0)
        return self.out


def resolve_backend(backend: str = "auto", local_procs: int | None = None) -> str:
    """Turn ``"auto"`` into ``"nccl"`` when CUDA is available (and, with ``local_procs``,
    there is a GPU for each of them), else ``"gloo"``.

    Args:
      backend: ``"auto"``, ``"gloo"`` or ``"nccl"``.
      local_procs: processes this machine will run, when known: nccl gives each its own GPU.

    Returns:
      The backend name to pass to ``init_process_group``.

    Raises:
      DistributedError: ``"nccl"`` without CUDA or with fewer GPUs than ``local_procs``,
        or an unknown backend name.
    """
    if backend == "auto":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return "nccl" if gpus and (local_procs is None or local_procs <= gpus) else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise DistributedError(message(
            "backend 'nccl' needs CUDA, and CUDA is not available on this machine",
            inputs=[f"torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}"],
            rule="nccl runs collectives on GPUs; gloo runs them on CPUs",
            fix="use --backend gloo (or --backend auto, which picks gloo without CUDA)"))
    if backend not in ("gloo", "nccl"):
        raise DistributedError(message(
            f"unknown backend '{backend}'", rule="the backend is 'auto', 'gloo' or 'nccl'",
            fix="use --backend gloo"))
    if backend == "nccl" and local_procs is not None and local_procs > torch.cuda.device_count():
        raise DistributedError(message(
            f"backend 'nccl' with {local_procs} processes on a machine with {torch.cuda.device_count()} GPU(s)",
            rule="nccl gives every process of a machine a GPU of its own",
            fix=f"run at most {torch.cuda.device_count()} process(es) here, or use --backend gloo"))
    return backend


def check_world_size(mesh: Mesh, world_size: int) -> None:
    """Raise :class:`MeshError` unless the mesh has one device per process.

    Args:
      mesh: the logical mesh, e.g. ``Mesh.parse("data:2; model:2")``.
      world_size: the number of processes in the job.

    Raises:
      MeshError: ``mesh.size != world_size``.
    """
    if mesh.size == world_size:
        return
    raise MeshError(message(
        f"mesh '{mesh}' has {mesh.size} devices but the job has {world_size} processes",
        inputs=[f"mesh: {mesh} ({mesh.size} devices)", f"processes: {world_size}"],
        rule="a distributed run needs exactly one process per mesh device",
        fix=f"launch {mesh.size} processes (--nproc {mesh.size}), or change the mesh "
            f"axis sizes so that their product is {world_size}"))


@dataclass(frozen=True)
class _Slice:
    """This rank's group over a tuple of axes, with members in the tuple's order."""

    pg: object                    # a ProcessGroup, or None when the group is this rank alone
    members: tuple[int, ...]      # global ranks, first axis of the tuple major
    group_rank: tuple[int, ...]   # group_rank[j]: rank of members[j] inside pg
    me: int                       # this rank's position in members

    @property
    def size(self) -> int:
        return len(self.members)


class TorchComm(Communicator):
    """Collectives over mesh axes for the one rank this process holds.

    ``torch.distributed`` must already be initialised (see
    :mod:`meshdsl.processes.launcher`), with one process per mesh device.

    Args:
      mesh: a :class:`Mesh` or mesh string, e.g. ``"data:2; model:2"``.
      timeout: seconds before a collective on a new group gives up.
      verbose: log every collective to stderr; defaults to ``MESHDSL_VERBOSE=1``.
      shm: collectives through shared memory among ranks on this host (gloo, x86-64
        Linux); defaults to on unless ``MESHDSL_SHM=0``.

    Raises:
      DistributedError: torch.distributed is not initialised.
      MeshError: the mesh size differs from the world size.
    """

    def __init__(self, mesh: "Mesh | str", *, timeout: float = DEFAULT_TIMEOUT_S,
                 verbose: bool | None = None, shm: bool | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise DistributedError(message(
                "TorchComm: torch.distributed is not initialised",
                rule="a TorchComm lives inside a process group",
                fix="start the job with meshdsl.processes.launcher.spawn(...) or under torchrun "
                    "with launch.init_from_env()"))
        self.mesh = Mesh.parse(mesh)
        check_world_size(self.mesh, dist.get_world_size())
        self.rank = dist.get_rank()
        self.ranks = (self.rank,)
        self.backend = dist.get_backend()
        self.device = torch.device("cpu")
        if self.backend == "nccl":
            local = int(os.environ.get("LOCAL_RANK", self.rank % torch.cuda.device_count()))
            self.device = torch.device("cuda", local)
            torch.cuda.set_device(self.device)
        if verbose is None:
            verbose = os.environ.get("MESHDSL_VERBOSE", "") == "1"
        self.verbose = verbose
        self.stats: dict[str, dict[str, float]] = {}
        # Progress, read by the launcher's heartbeat to name a rank that stops making progress.
        self.num_done = 0
        self.last_done = ""
        self._pgs: dict[tuple[str, ...], object] = {}
        self._slices: dict[tuple[str, ...], _Slice] = {}
        self._sends: list = []   # (work, buffer) of isends not yet waited for
        self._parts: dict = {}   # (axes, uneven arg) -> this group's part lengths (see _lengths)
        self._create_groups(timedelta(seconds=timeout))
        if shm is None:
            shm = os.environ.get("MESHDSL_SHM", "1") != "0"
        self.shm = bool(shm) and self.backend == "gloo" and shm_supported()
        self._timeout = timeout
        self._shm: dict[tuple[int, ...], object] = {}
        self._pipes: dict[tuple[int, ...], ShmPipe | None] = {}

    # ---------------------------------------------------------------- groups

    def _canonical(self, axes) -> tuple[str, ...]:
        """Axes of size > 1, in mesh order: one process group per such tuple."""
        for a in axes:
            self.mesh.check_axis(a, "TorchComm")
        return tuple(a for a in self.mesh.names if a in axes and self.mesh.sizes[a] > 1)

    def _create_groups(self, timeout: timedelta) -> None:
        # Every rank walks the same subsets in the same order and calls new_group for
        # every group (members or not): c10d numbers groups by call order.
        names = [a for a in self.mesh.names if self.mesh.sizes[a] > 1]
        for k in range(1, len(names) + 1):
            for subset in itertools.combinations(names, k):
                if self.mesh.axis_size(subset) == self.mesh.size:
                    self._pgs[subset] = dist.group.WORLD
                    continue
                for members in self.mesh.groups(subset):
                    pg = dist.new_group(list(members), timeout=timeout)
                    if self.rank in members:
                        self._pgs[subset] = pg

    def _slice(self, axes) -> _Slice:
        axes = tuple(axes)
        s = self._slices.get(axes)
        if s is None:
            canon = self._canonical(axes)
            members = self.mesh.group(self.rank, axes)
            pg = self._pgs.get(canon) if canon else None
            in_pg = sorted(members)  # new_group sorts its ranks: group rank = sorted position
            s = _Slice(pg, members, tuple(in_pg.index(m) for m in members), members.index(self.rank))
            self._slices[axes] = s
        return s

    # ---------------------------------------------------------- bookkeeping

    def prep(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` contiguous and on this rank's device, as torch.distributed wants it."""
        if self.device.type == "cuda" and x.device != self.device:
            x = x.to(self.device)
        return x.contiguous()

    def _done(self, kind: str, axes, s: _Slice, x: torch.Tensor, t0: float) -> None:
        nbytes = x.numel() * x.element_size()
        if self.verbose and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        self._book(kind, f"{kind} over {tuple(axes)}", nbytes, dt)
        if self.verbose:
            self._log(f"{kind} axes={tuple(axes)} group={s.members} bytes={nbytes} {dt * 1e3:.3f} ms")

    def _book(self, kind: str, what: str, nbytes: int, seconds: float) -> None:
        """Count one finished ``kind`` (``what``: it and its axes, for a dead-rank report) in :attr:`stats`."""
        st = self.stats.get(kind) or self.stats.setdefault(kind, {"count": 0, "bytes": 0, "seconds": 0.0})
        st["count"] += 1
        st["bytes"] += nbytes
        st["seconds"] += seconds
        self.num_done += 1
        self.last_done = what

    def shm_group(self, s: _Slice):
        """The shared-memory segment of ``s``'s group, made on first use (every member asks at
        the same collective); None where shared memory is off or the group cannot have one."""
        if not self.shm or s.pg is None or s.size < 2:
            return None
        key = tuple(sorted(s.members))
        if key not in self._shm:
            self._shm[key] = ShmGroup.open(s.pg, s.size, self._timeout, f"mesh: {self.mesh}", self._local_procs())
            if self.verbose:
                grp = self._shm[key]
                how = (("shared memory" + (", allreduces run by a helper thread" if grp.ring.helper else ""))
                       if grp is not None else
                       "gloo (no shared segment: ranks on other hosts, or it could not be made or handed over)")
                self._log(f"group {key}: collectives through {how}")
        return self._shm[key]

    def _log(self, text: str) -> None:
        """One ``--verbose`` line on stderr, in one write (ranks share the stream)."""
        sys.stderr.write(f"[meshdsl rank {self.rank}] {text}\n")
        sys.stderr.flush()

    def _local_procs(self) -> int:
        return int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))

    def open_pipe(self, axes, offsets) -> None:
        """Make the shared-memory channels of a pipeline's transfers over ``axes`` (member j to
        j + offset, for each of ``offsets``); collective over that group, once.  Where shared
        memory is off or the group cannot have a segment, its transfers stay on gloo."""
        s = self._slice(axes)
        if not self.shm or s.pg is None or s.size < 2 or s.members in self._pipes:
            return
        pipe = ShmPipe.open(s.pg, s.members, offsets, self._timeout, f"mesh: {self.mesh}", self._local_procs())
        self._pipes[s.members] = pipe
        if self.verbose:
            how = "shared memory" if pipe is not None else "gloo (no shared segment)"
            self._log(f"pipeline transfers over {tuple(axes)} {s.members}: {how}")

    def pipe_for(self, s: _Slice) -> ShmPipe | None:
        """The shared-memory channels :meth:`open_pipe` made for ``s``'s group, or None."""
        return self._pipes.get(s.members)

    def pipe_link(self, kind, axes, offset, tag, like):
        """See :meth:`Communicator.pipe_link`: a :class:`~.shm_pipe.PipeLink` on the channels
        :meth:`open_pipe` made, booked in :attr:`stats` like any transfer; None where the
        transfer stays on gloo (no channels, a CUDA tensor, no peer) or is logged (verbose)."""
        s = self._slice(axes)
        pipe = self._pipes.get(s.members)
        peer = s.me + offset if kind == "send" else s.me - offset
        if pipe is None or self.verbose or like.device.type != "cpu" or not 0 <= peer < s.size:
            return None
        src, dst = (s.me, peer) if kind == "send" else (peer, s.me)
        what = f"{kind} over {tuple(axes)}"
        return pipe.link(src, dst, tag, like, lambda nbytes, seconds: self._book(kind, what, nbytes, seconds))

    @staticmethod
    def check_op(op: str) -> str:
        """``op`` if it is a reduction torch.distributed knows, else a :class:`DistributedError`."""
        if op not in REDUCE:
            raise DistributedError(message(
                f"unknown reduction '{op}'", rule=f"a reduction is one of {sorted(REDUCE)}",
                fix="use 'sum', 'max' or 'min'"))
        return op

    # ----------------------------------------------------------- collectives

    def _lengths(self, args, axes, s: _Slice):
        """``args``, with ``lengths`` (this group's parts, by dim position) where the step's
        ``uneven`` arg says its parts differ in length (see :mod:`.torch_collectives`)."""
        uneven = args.get("uneven")
        if not uneven:
            return args
        key = (tuple(axes), uneven)
        lengths = self._parts.get(key)
        if lengths is None:
            lengths = self._parts[key] = parts_of(args, self.mesh, s.members, axes)
        return {**args, "lengths": lengths}

    def collective(self, kind, xs, axes, args):
        """See :meth:`Communicator.collective`: the kind's torch.distributed implementation."""
        (x,), s, t0 = xs, self._slice(axes), time.perf_counter()
        out = TORCH[kind][0](self, x, s, self._lengths(args, axes, s))
        self._done(kind, axes, s, x, t0)
        return [out]

    #: Collectives :meth:`start` runs asynchronously; the executor issues them early.
    async_kinds = frozenset(k for k, c in COLLECTIVES.items() if c.asynchronous)

    def start(self, kind, xs, axes, args):
        """Begin a collective; kinds with an asynchronous form (allreduce, allgather) run with
        ``async_op`` so the executor can overlap them with the compute that follows."""
        s = self._slice(axes)
        begin = TORCH[kind][1]
        if begin is None or s.size == 1:
            return super().start(kind, xs, axes, args)
        (x,), t0 = xs, time.perf_counter()
        work, finish = begin(self, x, s, self._lengths(args, axes, s))
        return _InFlight(self, work, kind, finish, axes, s, x, t0)

    def reduce_buffer(self, axes, numel: int, dtype: torch.dtype, starts: int):
        """See :meth:`Communicator.reduce_buffer`: a span of this rank's region of the group's
        shared segment and of its result area (:meth:`~.shm.ShmGroup.reserve`) where it has one."""
        s = self._slice(axes)
        if s.size < 2 or self.device.type != "cpu":
            return None
        grp = self.shm_group(s)
        return None if grp is None else grp.reserve(numel, dtype, starts, s.me, s.members)

    def hold(self, work, buffer) -> None:
        """Keep an isend and its buffer (which must live until it completes) until :meth:`drain`."""
        self._sends.append((work, buffer))

    def drain(self) -> None:
        """Wait for every isend this rank started."""
        sends, self._sends = self._sends, []
        for work, _ in sends:
            work.wait()
        for pipe in self._pipes.values():
            if pipe is not None:
                pipe.drain()

    def exchange(self, x: torch.Tensor, s: _Slice, split_dim: int) -> list[torch.Tensor]:
        """Send chunk j of ``x`` (along ``split_dim``) to member j; return what each member sent."""
        work, parts = self.start_exchange(x, s, split_dim, async_op=False)
        return parts()

    def start_exchange(self, x: torch.Tensor, s: _Slice, split_dim: int, async_op: bool = True):
        """:meth:`exchange` started: returns ``(work, parts)``; ``parts()`` gives what each
        member sent once ``work`` is done (``work`` is None when ``async_op`` is False)."""
        chunks = x.chunk(s.size, dim=split_dim)
        if len(chunks) != s.size:
            self._exchange_error(x, s, split_dim)
        by_group_rank = [None] * s.size
        for j, g in enumerate(s.group_rank):
            by_group_rank[g] = chunks[j]
        send = torch.cat([self.prep(c).reshape(-1) for c in by_group_rank])
        mine = chunks[s.me]
        recv = torch.empty(mine.numel() * s.size, dtype=x.dtype, device=send.device)
        splits = [c.numel() for c in by_group_rank]
        work = dist.all_to_all_single(recv, send, output_split_sizes=[mine.numel()] * s.size,
                                      input_split_sizes=splits, group=s.pg, async_op=async_op)
        pieces = recv.view(s.size, -1)
        return work, lambda: [pieces[g].view(mine.shape) for g in s.group_rank]

    @staticmethod
    def _exchange_error(x: torch.Tensor, s: _Slice, split_dim: int):
        """Raise: ``x`` cannot be cut into one chunk per member of ``s``."""
        raise DistributedError(message(
            f"cannot split dim {split_dim} of size {x.shape[split_dim]} into "
            f"{s.size} chunks for group {s.members}",
            rule="a split dim needs at least one element per group member",
            fix="make the dim divisible by the product of the mesh axes it is split over"))

    def barrier(self) -> None:
        """Wait for every rank of the job."""
        if self.backend == "nccl":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def agree(self, token: str) -> list[str]:
        """Exchange ``token`` with every rank, without pickling.

        The string travels as utf-8 bytes in a uint8 tensor padded to the longest
        token (lengths are gathered first).

        Args:
          token: e.g. a hash of the compiled plan.

        Returns:
          Every rank's token, in rank order.
        """
        world = dist.get_world_size()
        data = token.encode("utf-8")
        n = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        lengths = [torch.empty_like(n) for _ in range(world)]
        dist.all_gather(lengths, n)
        width = max(int(v.item()) for v in lengths)
        buf = torch.zeros(width, dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        buf = buf.to(self.device)
        bufs = [torch.empty_like(buf) for _ in range(world)]
        dist.all_gather(bufs, buf)
        return [bytes(b[: int(m.item())].cpu().tolist()).decode("utf-8")
                for b, m in zip(bufs, lengths)]
