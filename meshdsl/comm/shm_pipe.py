"""Pipeline transfers through shared memory, between the ranks of one host.

A pipeline's critical path crosses from stage to stage once per micro-batch: each
transfer's latency adds to the step.  Through gloo a transfer goes through a TCP socket
on the loopback and a gloo thread on each side (about 120 us one way for 128 KiB on
this project's 2-core machine, more when that thread waits for a core).  Ranks on one
host can instead hand the tensor over in a shared segment: the sender copies it into
a ring of slots (or makes it there: :meth:`PipeLink.reserve`) and raises a counter; the
receiver, spinning on that counter, copies it out (or reads it in place) and raises its own.

A :class:`ShmPipe` holds one ring (a *channel*) per ordered pair of members that
transfers run between (member j to member j + offset, for the offsets a pipeline
uses).  A message is cut into slot-sized pieces, each with a header (tag, bytes, offset).
A channel is FIFO; a receive that meets another tag's message first (two transfers
received in another order than sent) keeps that message aside for its own receive.
Sends never block: what finds the ring full waits in a queue that a helper thread
writes as the receiver frees slots, so two stages sending to each other cannot wait
on each other, as with gloo's ``isend``.  ``drain`` waits until every queued piece is in
its ring.

A transfer a pipeline runs every step (one channel, one tag, one shape) binds a
:class:`PipeLink` once: its sends and receives skip the per-message lookups and copy
straight between the tensor and its slot.  A receive may also *hold* its slot: the message
stays where its sender wrote it and the receiver computes from it, until it releases the
slot.  The counter a receiver raises for its sender is then the position of its oldest
held piece, not of its last taken one, so a slot is written again only once every piece
before it in its ring is released too; which receives may hold without stalling their
sender for good is the receiver's to know (a pipeline works it out from its schedule:
:func:`meshdsl.runtime.pipeline_store.slot_holds`).

Segments are made as :class:`~.shm.ShmGroup`'s are (:func:`~.shm.open_segment`,
collective over the group): where that fails, the group keeps gloo, for every member
alike.  Only the pipeline's own carry transfers use a pipe (their steps ask for it), so
both ends of a transfer always agree on how it travels.
"""
from __future__ import annotations

import threading
import time
from collections import deque

import torch

from ..errors import DistributedError, message
from .shm import open_segment, spins_for, wait_until

#: Bytes of one slot's data, and slots per channel: 2 MiB of ring per channel (a pipeline of p
#: stages maps 2(p-1) channels; a larger message streams through the ring in pieces).
SLOT_DATA = 256 << 10
NUM_SLOTS = 8
_HEAD = 64                          # a slot's header: tag, message bytes, offset, piece bytes
_SLOT = _HEAD + SLOT_DATA
_COUNTERS = 128                     # a channel's two counters, one cache line each
_CHANNEL = _COUNTERS + NUM_SLOTS * _SLOT


def pairs_for(size: int, offsets) -> list[tuple[int, int]]:
    """Ordered (from, to) member positions of a group of ``size`` for transfers at ``offsets``."""
    return [(j, j + off) for off in sorted(set(offsets)) for j in range(size) if 0 <= j + off < size and off]


class ShmPipe:
    """Channels between members of one group (positions in ``members``), in one shared segment.

    Use :meth:`open` (collective over the group), then :meth:`send` and :meth:`recv`.
    """

    def __init__(self, buf, pairs, members, timeout: float, describe: str, spins: int):
        self.buf, self.members, self.timeout, self.describe, self.spins = buf, tuple(members), timeout, describe, spins
        self.channel = {pair: k for k, pair in enumerate(pairs)}
        self.ints = memoryview(buf).cast("q")
        self.bytes = torch.frombuffer(buf, dtype=torch.uint8)
        self.written = [0] * len(pairs)   # this side's count of pieces put in a channel (its sender's)
        self.taken = [0] * len(pairs)     # pieces taken out (its receiver's)
        self.held: list[list[int]] = [[] for _ in pairs]   # positions taken but still read from, in order
        self.aside: dict = {}             # (channel, tag) -> messages received ahead of their receive
        self.queue: dict[int, deque] = {k: deque() for k in range(len(pairs))}
        self.lock = threading.Condition()
        self.pumping: threading.Thread | None = None
        self.failure: BaseException | None = None

    @classmethod
    def open(cls, pg, members, offsets, timeout: float, describe: str, local_procs: int = 1) -> "ShmPipe | None":
        """Map the segment of the channels for ``offsets`` among ``members`` (group ``pg``; every
        member calls this at the same point); None (use gloo) where that fails for any member."""
        pairs = pairs_for(len(members), offsets)
        if not pairs:
            return None
        buf = open_segment(pg, len(members), len(pairs) * _CHANNEL, timeout)
        return None if buf is None else cls(buf, pairs, members, timeout, describe, spins_for(local_procs))

    # ------------------------------------------------------------- layout
    @staticmethod
    def _counter(k: int, which: int) -> int:
        """Index (in int64s) of channel ``k``'s pieces-written (0) or pieces-taken (1) counter."""
        return (k * _CHANNEL + which * 64) // 8

    @staticmethod
    def _slot(k: int, n: int) -> int:
        """Byte offset of the slot that piece ``n`` of channel ``k`` goes in."""
        return k * _CHANNEL + _COUNTERS + (n % NUM_SLOTS) * _SLOT

    def link(self, src: int, dst: int, tag: int, like: torch.Tensor, book=None) -> "PipeLink":
        """The transfers from member position ``src`` to ``dst`` with ``tag`` of tensors shaped as
        ``like`` (CPU), bound once; ``book(nbytes, seconds)`` is called after each one."""
        return PipeLink(self, src, dst, tag, like, book)

    # ------------------------------------------------------------- sending
    def send(self, x: torch.Tensor, src: int, dst: int, tag: int) -> None:
        """Send contiguous CPU ``x`` from member position ``src`` (this one) to ``dst`` with ``tag``;
        returns at once (what does not fit in the ring now is written by the helper thread)."""
        self._raise_failure()
        k = self.channel[(src, dst)]
        flat = x.reshape(-1).view(torch.uint8)
        item = [tag, flat, 0, max(1, -(-flat.numel() // SLOT_DATA))]  # tag, bytes, next piece, pieces
        with self.lock:
            q = self.queue[k]
            if not q:
                self._write(k, item)
            if item[2] < item[3]:
                q.append(item)
                if self.pumping is None:
                    self.pumping = threading.Thread(target=self._pump, name="meshdsl-shm-pipe", daemon=True)
                    self.pumping.start()

    def _free(self, k: int) -> int:
        return NUM_SLOTS - (self.written[k] - self.ints[self._counter(k, 1)])

    def _write(self, k: int, item) -> None:
        """Put as many of ``item``'s remaining pieces as there are free slots (the lock held)."""
        tag, flat, i, n = item
        total = flat.numel()
        while i < n and self._free(k) > 0:
            off = i * SLOT_DATA
            self._piece(k, tag, total, off, flat[off:off + SLOT_DATA])
            i += 1
        item[2] = i

    def _piece(self, k: int, tag: int, total: int, off: int, data: torch.Tensor) -> None:
        at = self._slot(k, self.written[k])
        n = data.numel()
        if n:
            self.bytes[at + _HEAD:at + _HEAD + n].copy_(data)
        h = at // 8
        self.ints[h], self.ints[h + 1], self.ints[h + 2], self.ints[h + 3] = tag, total, off, n
        self.written[k] += 1
        self.ints[self._counter(k, 0)] = self.written[k]   # after the data: x86-64 keeps store order

    def _pump(self) -> None:
        """The helper thread: writes queued pieces as their rings free slots; ends when the
        queues are empty (the next send that finds a ring full starts another)."""
        try:
            while True:
                with self.lock:
                    busy = [k for k, q in self.queue.items() if q]
                    if not busy:
                        self.pumping = None
                        return
                for k in busy:
                    wait_until(lambda: self._free(k) > 0, 0, self.timeout, lambda: self._silent(k, True), yields=0)
                    with self.lock:
                        q = self.queue[k]
                        while q:
                            self._write(k, q[0])
                            if q[0][2] < q[0][3]:
                                break
                            q.popleft()
                        self.lock.notify_all()
        except BaseException as e:  # the main thread raises it at its next send or drain
            with self.lock:
                self.failure, self.pumping = e, None
                self.lock.notify_all()

    def drain(self) -> None:
        """Return once every queued piece is in its ring."""
        with self.lock:
            while any(self.queue.values()) and self.failure is None:
                self.lock.wait(timeout=1.0)
        self._raise_failure()

    def _raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def _silent(self, k: int, sending: bool):
        """Raise: channel ``k``'s receiver took nothing for the timeout (``sending``: seen by its
        sender, whose ring stayed full), or its sender sent nothing (seen by its receiver)."""
        src, dst = (self.members[j] for j in next(p for p, j in self.channel.items() if j == k))
        what, silent = ((f"rank {dst} took nothing that rank {src} sent it for", dst) if sending else
                        (f"rank {dst} received nothing from rank {src} within", src))
        raise DistributedError(message(
            f"pipeline transfer through shared memory: {what} {self.timeout:.0f} s",
            inputs=[self.describe],
            rule="every send of a pipeline is matched by a receive on its peer, in the same order",
            fix=f"look at rank {silent}'s output for its error; run with MESHDSL_SHM=0 to compare with gloo"))

    # ------------------------------------------------------------- receiving
    def recv(self, out: torch.Tensor, src: int, dst: int, tag: int) -> "_Receive":
        """A receive into contiguous CPU ``out`` of what member ``src`` sends this one (``dst``)
        with ``tag``; its ``wait()`` copies the message in."""
        return _Receive(self, out, self.channel[(src, dst)], tag)

    def _next_message(self, k: int, tag: int, out: torch.Tensor):
        """Channel ``k``'s next whole message, read piece by piece: ``(its tag, its bytes)``, the
        bytes written into ``out`` (uint8) when the message is ``tag``'s and has its size."""
        buf, got, total = None, 0, 0
        while True:
            self._wait_piece(k)
            at = self._slot(k, self.taken[k])
            h = at // 8
            t, total, off, n = self.ints[h], self.ints[h + 1], self.ints[h + 2], self.ints[h + 3]
            if buf is None:
                buf = out if t == tag and total == out.numel() else torch.empty(total, dtype=torch.uint8)
                first = t
            if n:
                buf[off:off + n].copy_(self.bytes[at + _HEAD:at + _HEAD + n])
            got += n
            self.taken[k] += 1
            if not self.held[k]:   # (else the counter stays at the oldest held piece)
                self.ints[self._counter(k, 1)] = self.taken[k]
            if got >= total:
                return first, buf

    def release(self, k: int, n: int) -> None:
        """Give piece ``n`` of channel ``k``, taken and held (:meth:`PipeLink.recv`), back to its
        sender: its slot, and those after it, may be written again once older holds go too."""
        held = self.held[k]
        held.remove(n)
        self.ints[self._counter(k, 1)] = held[0] if held else self.taken[k]

    def _wait_piece(self, k: int) -> None:
        i, target = self._counter(k, 0), self.taken[k]
        ints = self.ints
        if ints[i] > target:
            return
        wait_until(lambda: ints[i] > target, self.spins, self.timeout, lambda: self._silent(k, False))


class _Receive:
    """A receive posted on a :class:`ShmPipe`: ``wait()`` takes the message (the work of a recv)."""

    __slots__ = ("pipe", "out", "k", "tag", "done")

    def __init__(self, pipe: ShmPipe, out: torch.Tensor, k: int, tag: int):
        self.pipe, self.out, self.k, self.tag, self.done = pipe, out, k, tag, False

    def wait(self) -> bool:
        if self.done:
            return True
        pipe, key = self.pipe, (self.k, self.tag)
        flat = self.out.reshape(-1).view(torch.uint8)
        kept = pipe.aside.get(key)
        if kept:
            data = kept.popleft()
            if not kept:
                del pipe.aside[key]
        else:
            while True:
                tag, data = pipe._next_message(self.k, self.tag, flat)
                if tag == self.tag:
                    break
                pipe.aside.setdefault((self.k, tag), deque()).append(data)
        if data.numel() != flat.numel():
            raise DistributedError(message(
                f"pipeline transfer through shared memory (tag {self.tag}): {data.numel()} bytes arrived "
                f"for a receive of {flat.numel()} bytes",
                inputs=[pipe.describe],
                rule="a send and its receive move a tensor of one shape and dtype",
                fix="check that every rank runs the same plan (meshdsl check compares them)"))
        if data is not flat:
            flat.copy_(data)
        self.done = True
        return True


class PipeLink:
    """One channel and tag of a :class:`ShmPipe`, for tensors of one shape and dtype: a
    pipeline's carry transfer, bound once and run every step.

    A message that fits a slot is copied straight from the sent tensor into its slot, and on
    the other side read where it lies (``recv(hold=True)``: a view of the slot, until
    :meth:`release`) or copied out of it into a fresh tensor (no reshaping, no lookups per
    message: each slot's view is made here once).  Anything else (a larger message, a ring
    full or with messages queued, a message of another tag first) takes the pipe's general
    :meth:`ShmPipe.send` and :class:`_Receive`, which copy; the two paths write and read the
    same pieces, so either end may take either.  A link carries one message at a time: a
    held one is released before the link receives again.

    The sender may also skip its copy: :meth:`reserve` hands out the slot its next send goes
    in, for the kernel that makes the message to write into; sent from there, only the
    slot's header is written.  Between the two, nothing else may send on the channel.
    """

    __slots__ = ("pipe", "src", "dst", "tag", "k", "shape", "dtype", "nbytes", "views", "heads",
                 "head_counter", "tail_counter", "book", "holding", "memory")

    #: slots in the link's ring: a receiver holding piece n makes its sender wait before piece n + slots
    slots = NUM_SLOTS

    def __init__(self, pipe: ShmPipe, src: int, dst: int, tag: int, like: torch.Tensor, book=None):
        self.pipe, self.src, self.dst, self.tag, self.book = pipe, src, dst, tag, book
        self.k = k = pipe.channel[(src, dst)]
        self.shape, self.dtype = like.shape, like.dtype
        self.nbytes = like.numel() * like.element_size()
        slots = [pipe._slot(k, n) for n in range(NUM_SLOTS)]
        self.heads = [at // 8 for at in slots]
        # each slot's data as a tensor of the message's shape (None: the message takes pieces)
        self.views = [pipe.bytes[at + _HEAD:at + _HEAD + self.nbytes].view(self.dtype).view(self.shape)
                      if self.nbytes <= SLOT_DATA else None for at in slots]
        self.head_counter, self.tail_counter = pipe._counter(k, 0), pipe._counter(k, 1)
        self.holding: int | None = None    # the position of the piece a held receive reads from
        start = pipe.bytes.data_ptr()
        self.memory = range(start, start + pipe.bytes.numel())   # the shared segment's addresses

    def reserve(self) -> torch.Tensor | None:
        """The slot the next :meth:`send` writes, as a tensor of the link's shape and dtype for the
        kernel that makes the message to write into (then sent from there, it is not copied); None
        where that send would not take the slot (the ring full, pieces queued, a message in
        pieces).  Asks nothing of the receiver and changes nothing: a reservation not sent from is
        simply not used.  Until the send, nothing else may send on this link's channel."""
        pipe, k = self.pipe, self.k
        n = pipe.written[k]
        if (pipe.queue[k] or pipe.failure is not None or n - pipe.ints[self.tail_counter] >= NUM_SLOTS
                or self.views[0] is None):
            return None
        return self.views[n % NUM_SLOTS]

    def send(self, x: torch.Tensor) -> None:
        """Send ``x`` (CPU, the link's shape and dtype, any strides); returns at once.  Where ``x``
        is the slot :meth:`reserve` gave (written in place), only the header is written."""
        t0, pipe, k = time.perf_counter(), self.pipe, self.k
        n = pipe.written[k]
        ints = pipe.ints
        # The helper thread writes a channel only while its queue holds something, and only the
        # main thread adds to a queue: with this queue empty, no one else writes this channel.
        if (pipe.queue[k] or pipe.failure is not None or n - ints[self.tail_counter] >= NUM_SLOTS
                or self.views[0] is None or x.shape != self.shape or x.dtype != self.dtype):
            # a tensor in the segment (a slot of this ring) could be overwritten before it is written
            flat = x.clone(memory_format=torch.contiguous_format) if self.borrows(x) else x.contiguous()
            pipe.send(flat, self.src, self.dst, self.tag)
        else:
            slot = n % NUM_SLOTS
            view = self.views[slot]
            at = x.data_ptr() - view.data_ptr()
            if at or x.stride() != view.stride():   # (else written in place: nothing to copy)
                view.copy_(x.clone() if 0 <= at < self.nbytes else x)   # (a view into the slot itself)
            h = self.heads[slot]
            ints[h], ints[h + 1], ints[h + 2], ints[h + 3] = self.tag, self.nbytes, 0, self.nbytes
            pipe.written[k] = n + 1
            ints[self.head_counter] = n + 1   # after the data: x86-64 keeps store order
        if self.book is not None:
            self.book(self.nbytes, time.perf_counter() - t0)

    def ready(self) -> bool:
        """Whether a piece waits in this link's channel (a receive would not wait for it)."""
        return self.pipe.ints[self.head_counter] > self.pipe.taken[self.k]

    def recv(self, hold: bool = False) -> torch.Tensor:
        """The next message of this link's tag (waits for it): with ``hold``, where it came by
        the direct path, a view of its slot, valid until :meth:`release` (the slot is not
        written again before); else in a fresh tensor."""
        t0, pipe, k = time.perf_counter(), self.pipe, self.k
        n, ints = pipe.taken[k], pipe.ints
        direct = not pipe.aside and self.views[0] is not None   # (else it may be aside already)
        if direct:
            if ints[self.head_counter] <= n:
                pipe._wait_piece(k)
            h = self.heads[n % NUM_SLOTS]
            direct = ints[h] == self.tag and ints[h + 1] == self.nbytes and ints[h + 3] == self.nbytes
        if direct:
            held = pipe.held[k]
            if hold:
                assert self.holding is None, "a link holds one message at a time"
                out = self.views[n % NUM_SLOTS].detach()   # a tensor object of its own over the slot
                self.holding = n
                held.append(n)
            else:
                out = self.views[n % NUM_SLOTS].clone()
            pipe.taken[k] = n + 1
            if not held:    # (else the counter stays at the oldest held piece)
                ints[self.tail_counter] = n + 1
        else:   # another tag's message first, or in pieces: the general receive sorts it out
            out = torch.empty(self.shape, dtype=self.dtype)
            _Receive(pipe, out, k, self.tag).wait()
        if self.book is not None:
            self.book(self.nbytes, time.perf_counter() - t0)
        return out

    def release(self) -> None:
        """Give the slot a held :meth:`recv` reads from back to the sender (nothing if none)."""
        if self.holding is not None:
            self.pipe.release(self.k, self.holding)
            self.holding = None

    def borrows(self, x: torch.Tensor) -> bool:
        """Whether ``x`` lies in this link's shared segment (a held message, or a view of one)."""
        return x.data_ptr() in self.memory
