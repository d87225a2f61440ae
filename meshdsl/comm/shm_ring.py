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
between.  A tensor larger than :data:`PIECE_BYTES` goes in pieces, each an allreduce of
its own.  With two members each member reads two copies and writes one, against the
slot allreduce's copy in, half fold and copy out: about the same memory traffic, no
second barrier.  (With n members each reads n copies: more traffic than a fold of one
chunk each, which the barriers it needs would buy back only on a quiet host.)

A tensor the caller makes in this member's region instead (:meth:`Ring.reserve`: a layer
loop's gradient rows, written there by the backward's matmuls) is reduced from where it
lies into the segment's *result* area, one for the group, which every member then reads
in place (a reduce-scatter whose result is shared): ``start`` copies nothing, and ``wait``
folds this member's chunk (a 1/n cut: every member's copies of that chunk in group order,
as the simulated mesh folds) into the result area, raises its *read* count, and waits
until every member has (every chunk is there).  The caller reads the result there, the
same bits on every member, until it reserves again: a member folds a chunk of the next
reservation only once every member has started it, so after every member's next
reservation.  Per byte of gradient each member reads 1 byte and writes 1/n, against 3 and
2 when copied in (the copy, then the fold): the default transformer's 12.6 MB of layer
gradients move 19 MB per rank and step instead of 63 MB.  (A member that waits for a late
one could fold the late one's chunks of the rows that have come as well: on this
project's 2-core machine that did not show against the late member's compute, which its
memory traffic slows.)  A member's region is the same whatever the order of the group's
members in a collective (:meth:`Ring.slots`).

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
#: in flight until the update reads them: the default transformer's are 12.6 MB on 2 ranks,
#: reserved as its layer loop's gradient rows at the region's start (:meth:`Ring.reserve`).
RING_BYTES = 24 << 20
#: The largest piece one allreduce of the ring moves; a larger tensor goes in pieces.
PIECE_BYTES = 4 << 20
#: The largest reservation (:meth:`Ring.reserve`): the rest of a region takes the allreduces placed after it.
RESERVE_BYTES = RING_BYTES - PIECE_BYTES
_ALIGN = 64           # bytes: every piece starts on a cache line (and at a multiple of any element size)
_LINE = 8             # int64s per member's counters: one cache line each
_ARRIVED, _READ = 0, 1


def ring_bytes(size: int) -> int:
    """Bytes a ring for ``size`` members takes in a segment: their counters and regions, and the
    result area of the reservations."""
    return _LINE * 8 * size + RING_BYTES * size + RESERVE_BYTES


class Ring:
    """Per-member counters and ring regions in a segment, from byte ``offset`` on
    (:func:`ring_bytes` long).  Every member calls :meth:`start` in the same order with
    tensors of the same sizes; a handle's ``wait()`` finishes it, and its ``out`` holds the result."""

    def __init__(self, buf, offset: int, size: int, timeout: float, describe: str, wait_until,
                 helper: bool = False):
        self.buf, self.n, self.timeout, self.describe = buf, size, timeout, describe
        self.wait_until = wait_until   # wait_until(ready, late): shm.py's spin, yield, nap
        self.flags = memoryview(buf).cast("q")
        self.base = offset // 8        # int64 index of member 0's counters
        self.data = offset + _LINE * 8 * size
        self.results = self.data + RING_BYTES * size   # byte offset of the reservations' result area
        self.started = 0               # allreduces this member started: sequence numbers 1, 2, ...
        self.head = 0                  # byte offset in a region after the last one started
        self.live: deque = deque()     # (seq, lo, hi): spans some member may not have read yet
        self.pending: deque = deque()  # (seq, byte offset, piece, fold, in place, me, members): started, not folded
        self.unread: deque = deque()   # in-place seqs folded here whose other chunks may not all be folded yet
        self.reserved = None           # (end, starts left): a reservation at 0 not all started yet
        self.floor = 0                 # placements go at or after it: the last reservation is the caller's
        self._views: dict = {}
        self._at: dict = {}            # members (in a group order) -> each one's region and counters
        self.helper = _Helper(self) if helper else None

    def slots(self, members) -> tuple[int, ...]:
        """Where each of ``members`` (in the order of one collective's group) has its region and
        counters: by global rank, whatever the order (a group over axes ``("b", "a")`` is the one of
        ``("a", "b")`` in another order), so a reserved tensor stays in its member's own region."""
        at = self._at.get(members)
        if at is None:   # (members: a tuple, as the communicator's groups hand it)
            order = sorted(members)
            at = self._at[members] = tuple(order.index(m) for m in members)
        return at

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

    def _result_area(self, dtype: torch.dtype) -> torch.Tensor:
        """The reservations' result area as a 1-D tensor of ``dtype``."""
        key = ("results", dtype)
        v = self._views.get(key)
        if v is None:
            v = self._views[key] = torch.frombuffer(self.buf, dtype=dtype, count=RESERVE_BYTES // dtype.itemsize,
                                                    offset=self.results)
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
        regions, mine = self._regions(x.dtype), self.slots(members)[me]
        if self.reserved is not None and flat.numel():
            off = flat.data_ptr() - regions[mine].data_ptr()
            if 0 <= off < self.reserved[0]:   # in this member's reservation: reduced where it lies
                return self._start_in_place(flat, off, fold, me, members)
        per = PIECE_BYTES // esz
        last = 0                       # an empty x moves nothing: its handle has nothing to fold
        for lo in range(0, flat.numel(), per):
            piece = flat[lo:lo + per]
            off = self._place(piece.numel() * esz, me, members)
            # raw bytes: glibc's memmove streams large copies, a third faster than copy_ here
            ctypes.memmove(regions[mine, off // esz:].data_ptr(), piece.data_ptr(), piece.numel() * esz)
            self.started += 1
            self.flags[self.base + mine * _LINE + _ARRIVED] = self.started  # after the copy: x86 keeps store order
            self.pending.append((self.started, off, piece, fold, False, me, members))
            last = self.started
        self.progress()
        return Folding(self, last, me, members, x)

    def _start_in_place(self, flat: torch.Tensor, off: int, fold, me: int, members) -> "Folding":
        """Start ``flat``, which lies in this member's reservation at byte ``off``: nothing to copy;
        the handle's ``out`` is where the result will be (the same span of the result area)."""
        hi, left = self.reserved
        assert off + flat.numel() * flat.element_size() <= hi and left > 0, "a start past its reservation"
        self.started += 1
        if left == 1:   # all started: the span is freed by the last one's reads, as a placed one is
            self.live.append((self.started, 0, hi))
            self.reserved = None
        else:
            self.reserved = (hi, left - 1)
        self.flags[self.base + self.slots(members)[me] * _LINE + _ARRIVED] = self.started
        self.pending.append((self.started, off, flat, fold, True, me, members))
        self.progress()
        a = off // flat.element_size()
        return Folding(self, self.started, me, members, self._result_area(flat.dtype)[a:a + flat.numel()])

    def complete_through(self, seq: int, me: int, members) -> None:
        """Fold every allreduce this member started up to ``seq`` that it has not folded yet, in
        order; then, if any was reduced into the result area, wait until every member has folded
        its chunks of them."""
        while self.pending and self.pending[0][0] <= seq:
            self._wait_for(_ARRIVED, self.pending[0][0], members)
            self._fold_next()
        last = 0
        while self.unread and self.unread[0] <= seq:
            last = self.unread.popleft()
        if last:
            self._wait_for(_READ, last, members)

    def progress(self) -> None:
        """Fold, oldest first, the started allreduces every member has already arrived at, and
        stop at the first one some member has not: no waiting.  Called at each start, so that
        with no core to spare the folds run between the backward's kernels as the members'
        buckets come, not all at the end, where the members would fold at once and then wait for
        the slowest one's chunks."""
        flags = self.flags
        while self.pending:
            seq, at = self.pending[0][0], self.slots(self.pending[0][6])
            if any(flags[self.base + j * _LINE + _ARRIVED] < seq for j in at):
                return
            self._fold_next()

    def _fold_next(self) -> None:
        """Fold the oldest started allreduce (every member has arrived at it) and raise this
        member's *read* count."""
        s, off, piece, fold, in_place, me, members = self.pending.popleft()
        at = self.slots(members)
        if in_place:   # this member's chunk, into the result area
            cut = chunk_bounds(piece.numel(), self.n)
            self._fold_span(off, piece, fold, cut[me], cut[me + 1], at)
            self.unread.append(s)
        else:
            self._fold_all(off, piece, fold, me, at)
        self.flags[self.base + at[me] * _LINE + _READ] = s  # after the reads: x86 keeps loads before it

    def _fold_all(self, off: int, piece: torch.Tensor, fold, me: int, at) -> None:
        """Fold every member's copy of a copied-in allreduce (at byte ``off`` of every region) into ``piece``."""
        regions = self._regions(piece.dtype)
        a = off // piece.element_size()
        parts = [regions[at[j], a:a + piece.numel()] for j in range(self.n)]
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

    def _fold_span(self, off: int, flat: torch.Tensor, fold, lo: int, hi: int, at) -> None:
        """Elements ``lo:hi`` of in-place ``flat`` (at byte ``off`` of every region): every member's
        copy of them in group order, into the same span of the result area."""
        regions, esz = self._regions(flat.dtype), flat.element_size()
        lo, hi = off // esz + lo, off // esz + hi
        out = self._result_area(flat.dtype)[lo:hi]
        parts = [regions[at[j], lo:hi] for j in range(self.n)]
        fold(parts[0], parts[1], out=out)
        for j in range(2, self.n):
            fold(out, parts[j], out=out)

    # ------------------------------------------------------------- space
    def reserve(self, numel: int, dtype: torch.dtype, starts: int, me: int,
                members) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(buffer, result)``, each ``numel`` elements: ``buffer`` at the start of this member's
        region, for the caller to fill and then reduce in ``starts`` allreduces of contiguous
        spans of it (a layer loop's gradient rows, one start per layer), which copy nothing in;
        each span's result appears in the same span of ``result`` (the result area, the group's
        one) once its handle is waited for, and stays there until this member reserves again
        (see the module docstring).  None where it would not leave a piece's room (the caller
        allocates its own), where a reservation is not all started yet, or with a helper thread
        (which places concurrently).  Every member calls it at the same point with the same sizes."""
        nbytes = numel * dtype.itemsize
        if self.helper is not None or self.reserved is not None or not 0 < nbytes <= RESERVE_BYTES or starts < 1:
            return None
        hi = -(-nbytes // _ALIGN) * _ALIGN
        self._clear(0, hi, me, members)
        self.floor = self.head = hi   # what is placed from now on goes after it
        self.reserved = (hi, starts)
        return self._regions(dtype)[self.slots(members)[me], :numel], self._result_area(dtype)[:numel]

    def _place(self, nbytes: int, me: int, members) -> int:
        """The byte offset of the next allreduce's ``nbytes`` in every region, once every member
        has read what was there (after the last reservation, which is the caller's until the next)."""
        n = -(-nbytes // _ALIGN) * _ALIGN
        floor = self.floor
        lo = self.head if floor <= self.head and self.head + n <= RING_BYTES else floor
        hi = self.head = lo + n
        self._clear(lo, hi, me, members)
        self.live.append((self.started + 1, lo, hi))
        return lo

    def _clear(self, lo: int, hi: int, me: int, members) -> None:
        """Return once every member has read what bytes ``lo:hi`` of the regions held."""
        read = min(self._count(j, _READ) for j in range(self.n))
        while self.live and self.live[0][0] <= read:
            self.live.popleft()
        need = max((s for s, a, b in self.live if a < hi and lo < b), default=0)
        if need:
            self.complete_through(need, me, members)
            self._wait_for(_READ, need, members)

    def _wait_for(self, which: int, seq: int, members) -> None:
        """Return once every member's count ``which`` has reached ``seq``."""
        flags, at = self.flags, [self.base + j * _LINE + which for j in range(self.n)]

        def late():
            raise not_arrived([m for m, i in zip(sorted(members), at) if flags[i] < seq], members,
                              self.timeout, self.describe)
        self.wait_until(lambda: all(flags[i] >= seq for i in at), late)


def chunk_bounds(numel: int, n: int) -> list[int]:
    """Where ``numel`` elements cut into ``n`` chunks, one per member: ``[0, ..., numel]``, every
    inner bound on a multiple of 16 elements (a cache line of float32), so no two members write
    one line."""
    return [0, *(min(numel, (numel * c // n) // 16 * 16) for c in range(1, n)), numel]


def not_arrived(behind, members, timeout: float, describe: str) -> DistributedError:
    """The error of a shared-memory collective whose members ``behind`` did not come in time."""
    return DistributedError(message(
        f"shared-memory collective: rank(s) {behind} of group {tuple(members)} did not arrive within "
        f"{timeout:.0f} s",
        inputs=[describe],
        rule="every member of a group runs the same collectives in the same order",
        fix="look at the named ranks' output for their error; run with MESHDSL_SHM=0 to compare with gloo"))


class Folding:
    """The work handle of a ring allreduce: ``wait()`` folds it (and every earlier one of the ring);
    ``out``: where its result is then (the tensor itself, or its span of the result area)."""

    __slots__ = ("ring", "seq", "me", "members", "out")

    def __init__(self, ring: Ring, seq: int, me: int, members, out: torch.Tensor | None = None):
        self.ring, self.seq, self.me, self.members, self.out = ring, seq, me, members, out

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
