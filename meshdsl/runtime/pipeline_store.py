"""A pipeline's value store: what an action's steps write and read, and the micro-batch sums.

Values live in one store, per value and rank (:mod:`.pipeline` runs the actions).
:class:`ViewEnv` is the env a step call writes into, for the ranks of one view (:func:`view_env`
makes one; a view of one rank, each action's on real processes, gets :class:`OneRankEnv`);
:class:`Accumulator` takes the values the final segment only sums over the micro-batch axis
(the program's :attr:`~meshdsl.lowering.pipeline_program.PipelineProgram.folded`): it adds
each micro-batch's into one buffer as it finishes on a stage and reduces the buffer over the
other axes once (a bucket's in one flat buffer).  A backward
loop's stacked gradients are added into that buffer by the loop itself (:meth:`Accumulator.into`):
its matmuls accumulate there, so a micro-batch's gradients are never copied.
:func:`slot_holds` says which received carries a stage may read where their sender wrote them
(a shared-memory slot, :meth:`~meshdsl.comm.shm_pipe.PipeLink.recv`) until their micro-batch
finishes there, without ever leaving a message its sender cannot write.
"""
from __future__ import annotations

from collections import deque

from ..collectives import REDUCE
from ..comm.bucket import pack, unpack
from ..comm.communicator import Pending
from ..lowering.timeline import simulate


class ViewEnv:
    """The env a step call writes into: results land in the store at the view's ranks."""

    __slots__ = ("store", "ranks")

    def __init__(self, store, ranks):
        self.store, self.ranks = store, ranks

    def __setitem__(self, vid, xs):
        if isinstance(xs, Pending):
            xs = xs.wait()
        slot = self.store.setdefault(vid, {})
        for r, x in zip(self.ranks, xs):
            if x is not None:
                slot[r] = x

    def get(self, vid):
        slot = self.store[vid]
        # A rank a collective gave nothing (a halo's permute at the end of a dim) reads None, as
        # outside a pipeline.
        return [slot.get(r) for r in self.ranks]


class OneRankEnv(ViewEnv):
    """A :class:`ViewEnv` of one rank (every action's view on real processes): the same
    reads and writes without the loops over ranks, since each step call makes several."""

    __slots__ = ("rank",)

    def __init__(self, store, ranks):
        super().__init__(store, ranks)
        (self.rank,) = ranks

    def __setitem__(self, vid, xs):
        if isinstance(xs, Pending):
            xs = xs.wait()
        x = xs[0]
        slot = self.store.get(vid)
        if slot is None:   # a None (a halo's permute at the end of a dim) leaves an empty slot, as ViewEnv
            self.store[vid] = {} if x is None else {self.rank: x}
        elif x is not None:
            slot[self.rank] = x

    def get(self, vid):
        return [self.store[vid].get(self.rank)]


def view_env(store, ranks) -> ViewEnv:
    """The env of a view of ``ranks`` on ``store``."""
    return OneRankEnv(store, ranks) if len(ranks) == 1 else ViewEnv(store, ranks)


class Accumulator:
    """Sums over the micro-batch axis (gradient accumulation, the loss), taken as each
    micro-batch finishes on a stage, in place into one buffer per value and base rank.

    The final segment's allreduce over the micro-batch axis then only reduces that buffer
    over its other axes (once).  Micro-batches finish on a stage in micro-batch order, the
    order the allreduce would fold them in, so sums come out the same.
    """

    def __init__(self, store, base, mb_axis, ops, fresh=frozenset()):
        self.store, self.base, self.mb_axis, self.ops = store, base, mb_axis, ops
        #: values made in a buffer of their own each time (a backward loop's stacked gradients)
        self.fresh = frozenset(v for v in fresh if ops.get(v) == "sum")
        self.sums: dict = {}    # (value id, base rank) -> running reduction
        #: whether a tensor lies in memory that is not the step's to keep (a received message
        #: read where it lies): a sum started with one starts with its copy
        self.borrowed = None
        self.owned: set = set()  # keys whose buffer is ours to write into

    def clear(self) -> None:
        self.sums.clear()
        self.owned.clear()

    def keyed(self, ranks, values=None) -> tuple:
        """``values`` (of :attr:`ops`; default all) of ``ranks`` (one stage's ranks for one
        micro-batch) as :meth:`into` and :meth:`add` take them, worked out once per action: per
        value, ``(value id, its op, whether fresh, ((rank, key of its sum), ...))``."""
        return tuple((v, self.ops[v], v in self.fresh, tuple((r, (v, self.base[r])) for r in ranks))
                     for v in (self.ops if values is None else values))

    def into(self, keyed) -> dict:
        """The running sums of the :meth:`keyed` values (of :attr:`fresh`) that their ranks may
        add into in place, as the backward loop's ``run.into``: value id -> one tensor per rank,
        for values whose sum is started and ours on every rank."""
        owned, sums, out = self.owned, self.sums, {}
        for v, _, _, pairs in keyed:
            if all(k in owned for _, k in pairs):
                out[v] = [sums[k] for _, k in pairs]
        return out

    def add(self, keyed) -> None:
        """Fold the :meth:`keyed` values of their ranks into the sums."""
        sums, owned, store = self.sums, self.owned, self.store
        for v, op, fresh, pairs in keyed:
            slot = store.get(v)
            if not slot:
                continue
            for r, key in pairs:
                x = slot.pop(r, None)
                if x is None:
                    continue
                y = sums.get(key)
                if y is None:
                    if self.borrowed is not None and self.borrowed(x):
                        x = x.clone()
                        owned.add(key)
                    sums[key] = x      # may be shared (unless fresh): the next one allocates
                    if fresh:
                        owned.add(key)
                elif x is y:           # added into the sum where it was made (:meth:`into`)
                    continue
                elif key in owned:
                    REDUCE[op](y, x, out=y)
                else:
                    sums[key] = REDUCE[op](y, x)
                    owned.add(key)

    def reduce_step(self, s, view, bases):
        """The final segment's allreduce (or bucket of allreduces) ``s`` on ``view``: the sums
        of ``bases`` (the view's micro-batch-0 ranks) reduced over the remaining axes, on
        every rank; a bucket's in one flat buffer."""
        env = view_env(self.store, view.ranks)
        axes, args = tuple(a for a in s.axes if a != self.mb_axis), {"op": s.args.get("op", "sum")}

        def go(run):
            parts = [[self.sums[(v, r)] for v in s.ins] for r in bases.ranks]
            if axes:
                flats = [pack(xs) if len(xs) > 1 else xs[0] for xs in parts]
                flats = bases.collective(s.kind, flats, axes, args)
                parts = [unpack(flat, [x.numel() for x in xs], [x.shape for x in xs]) if len(xs) > 1 else [flat]
                         for flat, xs in zip(flats, parts)]
            by_base = dict(zip(bases.ranks, parts))
            for k, out in enumerate(s.outs):
                env[out] = [by_base[self.base[r]][k] for r in view.ranks]
        return go


def slot_holds(prog, defer: bool, rank: int, slots: int, margin: int = 2) -> dict[int, int]:
    """The carry receives of ``rank``'s list (``prog.actions(defer)[rank]``) that may read their
    message where it lies in their channel's ring of ``slots`` until the last action that drops
    what their stage made for their micro-batch: position of the receive -> position of that
    action (its micro-batch's last on the stage, or later where another stage of the rank
    reads what it made).

    A ring's sender writes piece n only once its receiver released every piece before
    n - slots + 1.  So a receive may hold its piece h only if every piece its rank reads from
    that channel until the release lies before h + slots; else the rank could wait for a
    piece its sender cannot write.  Pieces are numbered by the sender's list (a channel is
    FIFO); the receiver's list says when it reads each (a receive reads up to its own piece,
    keeping others' aside: those are copied, as is a piece that was read ahead).  Nor should
    a hold make the sender find its ring full (its piece would wait for a helper thread): in
    the schedule's unit-cost run, the sender's piece h + slots - ``margin`` (at least h + 1)
    must not start before the release.
    """
    rows = prog.actions(defer)
    row = rows[rank]
    last = _last_drops(prog, row)
    timeline = {a: (t0, t1) for r in simulate(prog.run_schedule(defer)).timeline for a, t0, t1 in r}
    out: dict[int, int] = {}
    for offset in prog.carry_offsets:
        if not 0 <= rank - offset < prog.num_ranks:
            continue
        sender = rows[rank - offset]
        sent = [(i, key) for i, key, _ in _transfers(prog, sender, "send", offset)]
        for i, n in _direct_reads(prog, row, offset, sent, slots, last):
            end = last.get((row[i].action.stage, row[i].action.microbatch))
            late = max(n + 1, n + slots - margin)
            if end is not None and (late >= len(sent) or
                                    timeline[sender[sent[late][0]].action][0] >= timeline[row[end].action][1]):
                out[i] = end
    return out


def _direct_reads(prog, row, offset: int, sent: list, slots: int, last: dict) -> list[tuple[int, int]]:
    """``(position in row, piece)`` of the carry receives at ``offset`` that read their piece
    straight from the ring (none read it ahead) and may hold it until their micro-batch's last
    drop (``last``: :func:`_last_drops`): every piece ``row`` reads from that channel until
    then lies before piece + ``slots``.  ``sent``: the sender's ``(position, (tag,
    micro-batch))`` per piece, in order."""
    where: dict = {}   # (tag, micro-batch) -> its pieces, in order
    for n, (_, key) in enumerate(sent):
        where.setdefault(key, deque()).append(n)
    read, reach, direct = 0, [0] * len(row), []
    for i, key, carry in _transfers(prog, row, "recv", offset):
        if not where.get(key):
            return []     # the lists do not pair up (never for a validated program): hold nothing
        n = where[key].popleft()
        if n >= read:
            if carry and n == read and row[i].action.is_recv:
                direct.append((i, n))
            read = n + 1
        reach[i] = read
    for i in range(1, len(row)):
        reach[i] = max(reach[i], reach[i - 1])
    return [(i, n) for i, n in direct
            if (row[i].action.stage, row[i].action.microbatch) in last
            and reach[last[(row[i].action.stage, row[i].action.microbatch)]] <= n + slots]


def _last_drops(prog, row) -> dict:
    """``(stage, micro-batch)`` -> the position in ``row`` of the last action that drops a value
    that stage makes for that micro-batch (its last action there, or later where another stage
    of the rank reads the value): nothing made from a received message is read after it."""
    made = {stage: set(prog.transient(stage)) for stage in {sa.action.stage for sa in row}}
    out: dict = {}
    for i, sa in enumerate(row):
        if sa.finishes is not None:
            dropped = set(sa.finishes)
            for stage, values in made.items():
                if stage == sa.action.stage or dropped & values:
                    out[(stage, sa.action.microbatch)] = i
    return out


def _transfers(prog, row, kind: str, offset: int):
    """``(position in row, (tag, micro-batch), carry)`` of each ``kind`` step at ``offset`` that
    ``row``'s actions run, in order."""
    for i, sa in enumerate(row):
        if sa.segment is None:
            continue
        steps = prog.segments[sa.segment].steps
        for j in sa.steps:
            s = steps[j]
            if s.kind == kind and s.args["offset"] == offset:
                yield i, (s.args["tag"], sa.action.microbatch), prog.is_carry(s)
