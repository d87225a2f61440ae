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
"""
from __future__ import annotations

from ..collectives import REDUCE
from ..comm.bucket import pack, unpack
from ..comm.communicator import Pending


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
        if x is not None:
            slot = self.store.get(vid)
            if slot is None:
                self.store[vid] = {self.rank: x}
            else:
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
