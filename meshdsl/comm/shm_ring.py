"""Split-phase allreduce through shared memory: started now, folded when its result is read.

A slot collective of :mod:`.shm` runs to the end when called: every member waits twice
for the slowest one.  Started in the backward, as gradient buckets are, each such wait
turns the members' drift (one is descheduled, one layer ran slower) into exposed time,
once per bucket.  A :class:`Ring` splits an allreduce in two:

* ``start`` copies the tensor into this member's region of the segment, at an offset
  every member works out alike from the sizes of the group's earlier allreduces (a ring
  buffer: the next one goes after the last, or back at 0 when it does not fit), raises
  this member's *arrived* count and returns; the caller goes on computing;
* ``wait`` waits until every member has arrived at that allreduce, folds every member's
  copy in group order into the tensor (as the simulated mesh folds: bitwise its result,
  the same on every member) and raises this member's *read* count.

A start whose space still holds an allreduce some member has not read yet first reads
every earlier allreduce itself, then waits for the others' reads.  So every member that
has passed a start has read what that start overwrites, and a member waits only for
others to reach points they reach in program order: no deadlock, whatever else runs
between.  A tensor larger than a quarter of a region goes in pieces, each an allreduce
of its own.  With two members each member reads two copies and writes one, against the
slot allreduce's copy in, half fold and copy out: about the same memory traffic, no
second barrier.  (With n members each reads n copies: more traffic than a fold of one
chunk each, which the barriers it needs would buy back only on a quiet host.)

Where the host has a core to spare for each process (:func:`~.shm.helper_for`), a helper
thread per process runs each allreduce from copy to fold in start order, so the copying
and summing overlap the caller's compute as gloo's own threads would; ``wait`` then only
waits for the thread.
"""
from __future__ import annotations

import ctypes
import queue
import threading
from collections import deque

import torch

from ..errors import DistributedError, message

#: Bytes of one member's ring region.  A data-parallel step keeps all its gradient buckets
#: in flight until the update reads them: the default transformer's are 12.6 MB on 2 ranks.
RING_BYTES = 16 << 20
#: The largest piece one allreduce of the ring moves; a larger tensor goes in pieces.
PIECE_BYTES = RING_BYTES // 4
_ALIGN = 64           # bytes: every piece starts on a cache line (and at a multiple of any element size)
_LINE = 8             # int64s per member's counters: one cache line each
_ARRIVED, _READ = 0, 1


def ring_bytes(size: int) -> int:
    """Bytes a ring for ``size`` members takes in a segment: their counters and regions."""
    return _LINE * 8 * size + RING_BYTES * size


class Ring:
    """Per-member counters and ring regions in a segment, from byte ``offset`` on
    (:func:`ring_bytes` long).  Every member calls :meth:`start` in the same order with
    tensors of the same sizes; a handle's ``wait()`` gives the folded tensor."""

    def __init__(self, buf, offset: int, size: int, timeout: float, describe: str, wait_until,
                 helper: bool = False):
        self.buf, self.n, self.timeout, self.describe = buf, size, timeout, describe
        self.wait_until = wait_until   # wait_until(ready, late): shm.py's spin, yield, nap
        self.flags = memoryview(buf).cast("q")
        self.base = offset // 8        # int64 index of member 0's counters
        self.data = offset + _LINE * 8 * size
        self.started = 0               # allreduces this member started: sequence numbers 1, 2, ...
        self.head = 0                  # byte offset in a region after the last one started
        self.live: deque = deque()     # (seq, lo, hi): spans some member may not have read yet
        self.pending: deque = deque()  # (seq, byte offset, piece, fold): started here, not yet folded
        self._views: dict = {}
        self.helper = _Helper(self) if helper else None

    def _count(self, member: int, which: int) -> int:
        return self.flags[self.base + member * _LINE + which]

    def _regions(self, dtype: torch.dtype) -> torch.Tensor:
        """Every member's region as a ``[members, elements]`` tensor of ``dtype``."""
        v = self._views.get(dtype)
        if v is None:
            esz = torch.empty(0, dtype=dtype).element_size()
            per = RING_BYTES // esz
            v = self._views[dtype] = torch.frombuffer(self.buf, dtype=dtype, count=per * self.n,
                                                      offset=self.data).view(self.n, per)
        return v

    # ------------------------------------------------------------- the two phases
    def start(self, x: torch.Tensor, fold, me: int, members):
        """Begin reducing contiguous CPU ``x`` in place with ``fold`` (``torch.add``,
        ``torch.maximum``, ``torch.minimum``), members in ``members`` order (this one at ``me``);
        a handle whose ``wait()`` finishes it.  With a helper thread, the thread copies and folds."""
        if self.helper is not None:
            return self.helper.submit(x, fold, me, members)
        return self._start(x, fold, me, members)

    def _start(self, x: torch.Tensor, fold, me: int, members) -> "Folding":
        flat, esz = x.view(-1), x.element_size()
        per = PIECE_BYTES // esz
        regions = self._regions(x.dtype)
        last = 0                       # an empty x moves nothing: its handle has nothing to fold
        for lo in range(0, flat.numel(), per):
            piece = flat[lo:lo + per]
            off = self._place(piece.numel() * esz, me, members)
            # raw bytes: glibc's memmove streams large copies, a third faster than copy_ here
            ctypes.memmove(regions[me, off // esz:].data_ptr(), piece.data_ptr(), piece.numel() * esz)
            self.started += 1
            self.flags[self.base + me * _LINE + _ARRIVED] = self.started  # after the copy: x86 keeps store order
            self.pending.append((self.started, off, piece, fold))
            last = self.started
        return Folding(self, last, me, members)

    def complete_through(self, seq: int, me: int, members) -> None:
        """Fold every allreduce this member started up to ``seq`` that it has not folded yet, in order."""
        while self.pending and self.pending[0][0] <= seq:
            s, off, piece, fold = self.pending.popleft()
            self._wait_for(_ARRIVED, s, members)
            regions = self._regions(piece.dtype)
            a = off // piece.element_size()
            parts = [regions[j, a:a + piece.numel()] for j in range(self.n)]
            # piece holds this member's own part: members 0 and 1 fold the other of the two into
            # it in place (the sum, max and min of two are the same either way round, bit for
            # bit, a NaN's payload aside), which reads and writes it once, with no read for
            # ownership of a fresh output
            if me < 2:
                fold(piece, parts[1 - me], out=piece)
            else:
                fold(parts[0], parts[1], out=piece)
            for j in range(2, self.n):
                fold(piece, parts[j], out=piece)
            self.flags[self.base + me * _LINE + _READ] = s  # after the reads: x86 keeps loads before it

    # ------------------------------------------------------------- space
    def _place(self, nbytes: int, me: int, members) -> int:
        """The byte offset of the next allreduce's ``nbytes`` in every region, once every member
        has read what was there."""
        n = -(-nbytes // _ALIGN) * _ALIGN
        lo = self.head if self.head + n <= RING_BYTES else 0
        hi = self.head = lo + n
        read = min(self._count(j, _READ) for j in range(self.n))
        while self.live and self.live[0][0] <= read:
            self.live.popleft()
        need = max((s for s, a, b in self.live if a < hi and lo < b), default=0)
        if need:
            self.complete_through(need, me, members)
            self._wait_for(_READ, need, members)
        self.live.append((self.started + 1, lo, hi))
        return lo

    def _wait_for(self, which: int, seq: int, members) -> None:
        """Return once every member's count ``which`` has reached ``seq``."""
        flags, at = self.flags, [self.base + j * _LINE + which for j in range(self.n)]

        def late():
            raise not_arrived([members[j] for j in range(self.n) if flags[at[j]] < seq], members,
                              self.timeout, self.describe)
        self.wait_until(lambda: all(flags[i] >= seq for i in at), late)


def not_arrived(behind, members, timeout: float, describe: str) -> DistributedError:
    """The error of a shared-memory collective whose members ``behind`` did not come in time."""
    return DistributedError(message(
        f"shared-memory collective: rank(s) {behind} of group {tuple(members)} did not arrive within "
        f"{timeout:.0f} s",
        inputs=[describe],
        rule="every member of a group runs the same collectives in the same order",
        fix="look at the named ranks' output for their error; run with MESHDSL_SHM=0 to compare with gloo"))


class Folding:
    """The work handle of a ring allreduce: ``wait()`` folds it (and every earlier one of the ring)."""

    __slots__ = ("ring", "seq", "me", "members")

    def __init__(self, ring: Ring, seq: int, me: int, members):
        self.ring, self.seq, self.me, self.members = ring, seq, me, members

    def wait(self) -> bool:
        if self.ring is not None:
            self.ring.complete_through(self.seq, self.me, self.members)
            self.ring = None
        return True


class _Helper:
    """A thread that runs a ring's allreduces from copy to fold, in the order they were started,
    while the caller computes: for a process with a core to spare (:func:`~.shm.helper_for`).
    It waits with GIL-free naps, so the caller's Python is never held up by it for long."""

    def __init__(self, ring: Ring):
        self.ring, self.submitted, self.done, self.error = ring, 0, 0, None
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.cond = threading.Condition()
        threading.Thread(target=self._run, name="meshdsl-shm-ring", daemon=True).start()

    def submit(self, x: torch.Tensor, fold, me: int, members) -> "_Submitted":
        self.submitted += 1
        self.queue.put((self.submitted, x, fold, me, members))
        return _Submitted(self, self.submitted)

    def _run(self) -> None:
        while True:
            n, x, fold, me, members = self.queue.get()
            try:
                if self.error is None:
                    self.ring._start(x, fold, me, members).wait()
            except BaseException as e:  # handed to the caller's wait(); later ones are skipped
                self.error = e
            with self.cond:
                self.done = n
                self.cond.notify_all()

    def wait_for(self, n: int) -> None:
        with self.cond:
            while self.done < n:
                self.cond.wait()
        if self.error is not None:
            raise self.error


class _Submitted:
    """The work handle of an allreduce handed to a :class:`_Helper`."""

    __slots__ = ("helper", "n")

    def __init__(self, helper: _Helper, n: int):
        self.helper, self.n = helper, n

    def wait(self) -> bool:
        self.helper.wait_for(self.n)
        return True
