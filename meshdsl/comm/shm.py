"""Collectives through shared memory, for the ranks of a group that share one host's CPU.

gloo moves a CPU allreduce through TCP sockets on the loopback: every byte is copied
into the kernel and out again, by a gloo thread that competes with the compute for
the cores.  Ranks on one host can instead share a memory segment.  An allreduce is
split in two (:mod:`.shm_ring`): started, each rank copies its tensor into its region
of the segment's ring and goes on; waited for, it folds every rank's copy in group
order, as the simulated mesh folds, so every rank gets the same bits and the result is
bitwise the simulated mesh's.  On this project's 2-core machine a 16 MiB allreduce
took about 5 ms through shared memory and 15 ms through gloo (``bench/collectives.py``).

The allgather, the reduce-scatter and the all-to-all run to the end when called: each
rank writes its tensor, or its chunks, into its slot and each reads what it needs from
every slot, in pieces of a slot for larger tensors; two barriers (on flags in the
segment) keep the steps apart.

A :class:`ShmGroup` is made collectively over a group's process group (when its
first collective runs): the members check that they share a host (host name and
boot id), the first member makes an anonymous file (``memfd_create``, space
reserved up front) and passes its descriptor to the others over a Unix socket
in the abstract namespace, to the group's own processes only (checked by their
pid and uid), and each maps it (:func:`open_segment`).  Nothing of it has a
name in ``/dev/shm`` or on disk, so nothing is left behind however a member
dies, even the first one the moment it made the segment: the memory goes with
the last mapping.  Where any of that fails (no memory, another host or network
namespace) the group keeps using gloo.  Only x86-64 is used: its stores become
visible in program order, which the flags rely on.

``TorchComm(..., shm=False)`` or ``MESHDSL_SHM=0`` turns it off.
"""
from __future__ import annotations

import mmap
import os
import platform
import secrets
import socket
import struct
import sys
import time

import torch

from .shm_ring import Ring, not_arrived, ring_bytes

#: Bytes of one rank's slot; larger tensors go in pieces.
SLOT_BYTES = 4 << 20
_FLAG_STRIDE = 8      # int64s between two ranks' flags: one 64-byte cache line each
_NAME_BYTES = 64
_SPINS = 200          # busy checks of the flags before yielding the core
# The most a segment's hand-over waits for a member (a connect, a descriptor): they all arrive
# together, right after a collective, so this only ends an attempt that cannot succeed.
_HANDOVER_S = 10.0


def supported() -> bool:
    """Whether this machine can run shared-memory collectives: x86-64 Linux, whose anonymous
    files (``memfd_create``) a process can pass to another (``socket.send_fds``)."""
    return (platform.machine().lower() in ("x86_64", "amd64") and sys.platform.startswith("linux")
            and hasattr(os, "memfd_create") and hasattr(socket, "send_fds"))


def _flag_bytes(size: int) -> int:
    """Bytes of the flags at the head of a segment for ``size`` members."""
    return _FLAG_STRIDE * 8 * size


def _host_key() -> int:
    """A number that two processes share exactly when they run on one host (and boot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    h = 1469598103934665603
    for b in f"{socket.gethostname()}|{boot}".encode():
        h = ((h ^ b) * 1099511628211) % (1 << 63)
    return h


class ShmGroup:
    """A shared segment for one process group: a flag per member, a slot per member, and the
    allreduces' ring (:class:`~.shm_ring.Ring`).

    Use :meth:`open` (collective over the group); then every member calls
    :meth:`start_allreduce` (or :meth:`allreduce_`), :meth:`gather` and :meth:`exchange`
    in the same order, with tensors of the same shapes.
    """

    def __init__(self, buf: mmap.mmap, size: int, timeout: float, describe: str, spins: int = _SPINS,
                 helper: bool = False):
        self.buf, self.n, self.timeout, self.describe = buf, size, timeout, describe
        self.spins = spins
        self.flags = memoryview(buf).cast("q")
        self.data = _flag_bytes(size)  # byte offset of the slots
        self.seq = 0
        self._views: dict = {}
        # the allreduces' ring, after the slots (see shm_ring.py); its helper thread naps
        # between checks (a spinning thread would hold the GIL the caller's Python needs)
        waiter = ((lambda ready, late: nap_until(ready, timeout, late)) if helper else
                  (lambda ready, late: wait_until(ready, spins, timeout, late)))
        self.ring = Ring(buf, self.data + size * SLOT_BYTES, size, timeout, describe, waiter, helper)

    # ------------------------------------------------------------- making one
    @classmethod
    def open(cls, pg, size: int, timeout: float, describe: str, local_procs: int = 1) -> "ShmGroup | None":
        """Map one segment for the ``size`` members of process group ``pg`` (every member calls
        this at the same point); None (use gloo) where they do not share a host or one fails.
        With more ``local_procs`` (this host's processes of the job) than cores, a member that
        waits yields its core at once instead of spinning first; with a core to spare per
        process, a helper thread runs the allreduces (:func:`helper_for`)."""
        buf = open_segment(pg, size, _flag_bytes(size) + size * SLOT_BYTES + ring_bytes(size), timeout)
        if buf is None:
            return None
        return cls(buf, size, timeout, describe, spins_for(local_procs), helper_for(local_procs))

    # ------------------------------------------------------------- running
    def _arrive_and_wait(self, me: int, members) -> None:
        """Raise this member's flag to the next sequence number; return once every member has."""
        self.seq += 1
        seq, flags, n = self.seq, self.flags, self.n
        flags[me * _FLAG_STRIDE] = seq

        def late():
            raise not_arrived([members[j] for j in range(n) if flags[j * _FLAG_STRIDE] < seq], members,
                              self.timeout, self.describe)
        wait_until(lambda: all(flags[j * _FLAG_STRIDE] >= seq for j in range(n)), self.spins, self.timeout, late)

    def _slots(self, dtype: torch.dtype):
        v = self._views.get(dtype)
        if v is None:
            esz = torch.empty(0, dtype=dtype).element_size()
            per = SLOT_BYTES // esz
            whole = torch.frombuffer(self.buf, dtype=dtype, count=per * self.n, offset=self.data)
            v = self._views[dtype] = (whole.view(self.n, per), per)
        return v

    def start_allreduce(self, x: torch.Tensor, fold, me: int, members):
        """Begin reducing contiguous CPU ``x`` over the group in place with ``fold`` (``torch.add``,
        ``torch.maximum``, ``torch.minimum``), members in ``members`` order (this one at ``me``);
        the handle's ``wait()`` finishes it (:class:`~.shm_ring.Ring`: no member waits for
        another before then)."""
        return self.ring.start(x, fold, me, members)

    def reserve(self, numel: int, dtype: torch.dtype, starts: int, me: int, members):
        """``(buffer, result)``: a tensor in this member's part of the segment that ``starts`` later
        :meth:`start_allreduce` calls on spans of it reduce with nothing copied in, and where
        their results appear (:meth:`~.shm_ring.Ring.reserve`); or None."""
        return self.ring.reserve(numel, dtype, starts, me, members)

    def allreduce_(self, x: torch.Tensor, fold, me: int, members) -> torch.Tensor:
        """:meth:`start_allreduce`, finished: ``x`` reduced in place."""
        self.ring.start(x, fold, me, members).wait()
        return x

    def gather(self, x: torch.Tensor, me: int, members, combine):
        """``combine(parts)``, ``parts`` being every member's ``x`` in ``members`` order.

        A tensor that fits in a slot is handed over as views of the segment (valid only
        inside ``combine``); a larger one goes in pieces into a local ``[members, numel]``
        buffer first."""
        slots, per = self._slots(x.dtype)
        flat, n = x.reshape(-1), x.numel()
        if n <= per:
            slots[me, :n].copy_(flat)
            self._arrive_and_wait(me, members)
            out = combine([slots[j, :n].view(x.shape) for j in range(self.n)])
            self._arrive_and_wait(me, members)  # nobody writes a slot again until every member has read
            return out
        recv = torch.empty(self.n, n, dtype=x.dtype)
        for lo in range(0, n, per):
            k = min(per, n - lo)
            slots[me, :k].copy_(flat[lo:lo + k])
            self._arrive_and_wait(me, members)
            recv[:, lo:lo + k].copy_(slots[:, :k])
            self._arrive_and_wait(me, members)
        return combine([recv[j].view(x.shape) for j in range(self.n)])

    def exchange(self, x: torch.Tensor, dim: int, me: int, members, combine):
        """``combine(parts)``, ``parts[j]`` being member j's chunk ``me`` of its ``x`` along ``dim``
        (an all-to-all), handed over as :meth:`gather` hands its parts; None (the caller uses
        gloo, as every member does) when ``x`` does not cut into equal chunks."""
        slots, per = self._slots(x.dtype)
        chunks = x.chunk(self.n, dim)
        if len(chunks) != self.n or any(c.shape != chunks[0].shape for c in chunks):
            return None
        k, shape = chunks[0].numel(), chunks[0].shape
        if k * self.n <= per:
            mine = slots[me, :k * self.n].view(self.n, k)
            for j, c in enumerate(chunks):
                mine[j].view(shape).copy_(c)
            self._arrive_and_wait(me, members)
            out = combine([slots[j, me * k:(me + 1) * k].view(shape) for j in range(self.n)])
            self._arrive_and_wait(me, members)
            return out
        flats = [c.reshape(-1) for c in chunks]
        step = per // self.n
        recv = torch.empty(self.n, k, dtype=x.dtype)
        for lo in range(0, k, step):
            m = min(step, k - lo)
            mine = slots[me, :m * self.n].view(self.n, m)
            for j, c in enumerate(flats):
                mine[j].copy_(c[lo:lo + m])
            self._arrive_and_wait(me, members)
            recv[:, lo:lo + m].copy_(slots[:, me * m:(me + 1) * m])
            self._arrive_and_wait(me, members)
        return combine([recv[j].view(shape) for j in range(self.n)])


def wait_until(ready, spins: int, timeout: float, late, yields: int = 4000) -> None:
    """Return once ``ready()``: check it ``spins`` times, then ``yields`` times yielding the core
    between checks, then napping; past ``timeout`` seconds after the spins, call ``late()``
    (which raises)."""
    n, deadline = 0, None
    while not ready():
        n += 1
        if n < spins:
            continue
        now = time.monotonic()
        if deadline is None:
            deadline = now + timeout
        elif now > deadline:
            late()
        os.sched_yield() if n < spins + yields else time.sleep(5e-5)


def nap_until(ready, timeout: float, late, shortest: float = 5e-5, longest: float = 2e-4) -> None:
    """Return once ``ready()``, sleeping between checks (the GIL free), the naps doubling from
    ``shortest`` to ``longest`` seconds; past ``timeout`` seconds, call ``late()`` (which raises).
    For a helper thread: at most ``longest`` late, and a few thousand checks a second at most."""
    nap, deadline = shortest, None
    while not ready():
        now = time.monotonic()
        if deadline is None:
            deadline = now + timeout
        elif now > deadline:
            late()
        time.sleep(nap)
        nap = min(2 * nap, longest)


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def helper_for(local_procs: int) -> bool:
    """Whether a helper thread should copy and fold this process's allreduces while it computes:
    where this host has a core to spare for each of the job's ``local_procs`` processes beyond
    their torch threads.  Otherwise the thread would take its own process's core, and the
    process copies and folds them itself when it waits for them.  ``MESHDSL_SHM_HELPER=1``
    (or ``0``) turns the thread on (or off) whatever the cores."""
    forced = os.environ.get("MESHDSL_SHM_HELPER", "")
    if forced in ("0", "1"):
        return forced == "1"
    return _usable_cores() >= local_procs * (torch.get_num_threads() + 1)


def spins_for(local_procs: int) -> int:
    """Busy checks before a waiting member yields: none when this host runs more of the
    job's processes than this process may use cores (a spinning waiter would take the core
    of the member it waits for)."""
    return _SPINS if local_procs <= _usable_cores() else 0


def open_segment(pg, size: int, nbytes: int, timeout: float = _HANDOVER_S) -> mmap.mmap | None:
    """A fresh ``nbytes`` shared mapping for the ``size`` members of process group ``pg``
    (collective: every member calls it at the same point); None for every member alike
    where they do not share a host, or any of them cannot make, receive or map it.

    The segment has no name anywhere: the first member makes it with ``memfd_create`` and
    hands its descriptor to the others (:func:`_hand_over`), so however a member dies, nothing
    is left behind: the memory goes with the last mapping of it."""
    import torch.distributed as dist
    ids = [torch.zeros(2, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(ids, torch.tensor([_host_key(), os.getpid()], dtype=torch.int64), group=pg)
    if len({int(i[0]) for i in ids}) != 1:
        return None
    first = dist.get_rank(pg) == 0
    fd, listener, name = -1, None, ""
    if first:
        fd, listener, name = _make_segment(nbytes, size)
    try:
        name = _broadcast_name(pg, name)
        if not name:
            return None
        peers = {int(i[1]) for i in ids[1:]}
        buf = _hand_over(pg, first, fd, listener, name, nbytes, peers, min(timeout, _HANDOVER_S))
    finally:
        if listener is not None:  # its abstract name goes with it
            listener.close()
        if fd >= 0:
            os.close(fd)
    ok = torch.tensor([1 if buf is not None else 0], dtype=torch.int64)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=pg)  # every member has it mapped (or gave up)
    if not int(ok):
        if buf is not None:
            buf.close()
        return None
    return buf


def _make_segment(nbytes: int, size: int):
    """The first member's side: an anonymous ``nbytes`` file (space reserved up front: no
    SIGBUS later when memory runs short) and a Unix socket listening in the abstract
    namespace (no file; its name dies with this process) to hand it over on.

    Returns:
      ``(fd, listener, name)``; ``(-1, None, "")`` where either cannot be made.
    """
    fd, listener = -1, None
    name = f"meshdsl-{os.getpid()}-{secrets.token_hex(8)}"
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.posix_fallocate(fd, 0, nbytes)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind("\0" + name)
        listener.listen(size + 8)
        return fd, listener, name
    except OSError:
        if listener is not None:
            listener.close()
        if fd >= 0:
            os.close(fd)
        return -1, None, ""


def _broadcast_name(pg, name: str) -> str:
    """The first member's socket name, on every member ("" where it made none)."""
    import torch.distributed as dist
    t = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
    t[:len(name)] = torch.tensor(list(name.encode()), dtype=torch.uint8)
    dist.broadcast(t, src=dist.get_global_rank(pg, 0), group=pg)
    return bytes(t[t > 0].tolist()).decode()


def _hand_over(pg, first: bool, fd: int, listener, name: str, nbytes: int, peers: set[int], timeout: float):
    """Pass the segment's descriptor from the first member to the others over its socket
    (``SCM_RIGHTS``), to this group's processes only (``SO_PEERCRED``: their pids, our uid),
    and map it; this member's mapping, or None where it failed (every member learns whether
    all connected before the first member gives anything away)."""
    import torch.distributed as dist
    conn = None
    if not first:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(timeout)
        try:
            conn.connect("\0" + name)
        except OSError:  # another network namespace, a full backlog
            conn.close()
            conn = None
    ready = torch.tensor([1 if first or conn is not None else 0], dtype=torch.int64)
    dist.all_reduce(ready, op=dist.ReduceOp.MIN, group=pg)
    try:
        if not int(ready):
            return None
        if first:
            _serve(listener, fd, peers, timeout)
        else:
            fd = _receive_fd(conn)
        return mmap.mmap(fd, nbytes) if fd >= 0 else None
    except OSError:
        return None
    finally:
        if conn is not None:
            conn.close()
            if fd >= 0:
                os.close(fd)


def _serve(listener, fd: int, peers: set[int], timeout: float) -> None:
    """Send ``fd`` to each process in ``peers`` that connects (of our uid), within ``timeout``;
    any other caller is turned away."""
    waiting, deadline = set(peers), time.monotonic() + timeout
    while waiting and time.monotonic() < deadline:
        listener.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            return
        with conn:
            pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              struct.calcsize("3i")))
            if pid in waiting and uid == os.getuid():
                socket.send_fds(conn, [b"m"], [fd])
                waiting.discard(pid)


def _receive_fd(conn) -> int:
    """The descriptor the first member sends on ``conn``; -1 when none came."""
    _, fds, _, _ = socket.recv_fds(conn, 1, 1, getattr(socket, "MSG_CMSG_CLOEXEC", 0))
    for extra in fds[1:]:
        os.close(extra)
    return fds[0] if fds else -1
