"""Several pipelined stacks with virtual stages: a logical-stage cut put on the ranks.

With ``schedule="interleaved:v"`` and several stacks on the stage axis (an encoder-decoder's
``layer:stage; enc_layer:stage``), :mod:`.partition` cuts the plan on ``p * v`` logical stages
as it cuts one stage per rank (:func:`.pipeline.stack_counts` over ``p * v`` counts; every pass
works per stage), and :func:`.stage_layers.split_stacks` stores each stack's layer-split values
block-cyclically at its counts (``Sharding.blocks``, a block of length 0 for a virtual stage
holding none of the stack).  Logical stage ``s`` runs on rank ``s % p``;
:func:`on_ranks` then makes of the segment lists what the ranks run, as a pass on data:

* a transfer between logical stages takes its ranks' offset (the carry's wrap from rank p - 1
  to rank 0 between chunks: ``-(p - 1)``), and one between two logical stages of one rank is no
  message: a local copy (per micro-batch) or nothing (once: the rank holds the value already),
  and a once-run transfer bringing a rank a value it received already is dropped;
* a value that steps of several chunks of one rank make per micro-batch (the carry, what a
  layer keeps for its backward, a stacked gradient, a stage sum's running total) gets one value
  per chunk, since a rank holds one tensor per value and micro-batch; where the final segment
  (or the step's outputs) reads it, each rank joins its chunks' parts at the end of its last
  chunk's action of that micro-batch: a layer-split value's chunks one after another (the
  block-cyclic local order), a part of a sum over the stages added up; a stacked gradient that the
  final segment only sums over the micro-batches is summed per chunk there and joined after
  (each chunk's backward loop adds into its running sum in place, as with one stack);
* a layer-split value made outside the micro-batches (a stacked param) is narrowed in the
  prologue to each chunk's layers of each rank (a view: nothing moves);
* a value made as zeros on a stage holding none of the stack that makes it is made so only on
  ranks that hold no other stage making it;
* a step each stage runs on its own layers (what a loss makes of a stack's per-layer outputs,
  ``(carry, {name: tensor})``, and their cotangent) runs in each chunk on the chunk's layers, and in
  a chunk where no rank runs any layer of that stack makes only a zero part of its sum over the layers.
"""
from __future__ import annotations

import dataclasses

import torch

from ..core.shape import Dim, Shape
from ..errors import LayoutError, message
from .pipeline_program import PER_MICROBATCH, Segment
from .plan import Step, Value, step_args
from .stage_layers import zeros_step


def _narrow(ctx, attrs, x):
    """One chunk's layers of a rank's stacked tensor."""
    return x.narrow(attrs["dim"], attrs["start"], attrs["length"])


def _join(ctx, attrs, *parts):
    """A rank's chunks of a layer-split tensor, one after another (its local order)."""
    return torch.cat(parts, attrs["dim"])


def _add(ctx, attrs, *parts):
    """A rank's chunks' parts of a sum over the stages."""
    out = parts[0]
    for x in parts[1:]:
        out = out + x
    return out


def _same(ctx, attrs, x):
    """A value handed from one chunk of a rank to another."""
    return x


class _Ranks:
    """The logical stages of one cut and the values made per chunk."""

    def __init__(self, cut, p: int):
        self.cut, self.spec, self.values, self.p = cut, cut.spec, cut.values, p
        self.v = cut.spec.num_stages // p
        self.counts = {layer: counts for _, layer, counts in cut.spec.stacks}
        self.chunked: dict = {}   # (value, chunk) -> its value of that chunk

    def rank(self, t: int) -> int:
        return t % self.p

    def chunk(self, t: int) -> int:
        return t // self.p

    def layer_of(self, vid: int) -> str | None:
        """The stack layer dim the stage axis splits in ``vid``, or None."""
        sh = self.values[vid].sharding
        return next((d for d in self.counts if sh.axes_of(d) == (self.spec.axis,)), None)

    def of(self, vid: int, c: int) -> int | None:
        """Chunk ``c``'s value of ``vid`` (its layer dim, if split, at the chunk's layers per rank),
        or None for a layer-split value of a stack that no rank runs in chunk ``c``."""
        key = (vid, c)
        if key not in self.chunked:
            old, layer = self.values[vid], self.layer_of(vid)
            shape, sharding = old.shape, old.sharding
            if layer is not None:
                lengths = self.lengths(layer, c)
                if not sum(lengths):
                    return None
                shape = Shape(Dim(d.name, sum(lengths)) if d.name == layer else d for d in shape)
                sharding = sharding.with_cyclic(layer, 1, lengths)
            new = max(self.values) + 1
            self.values[new] = Value(new, shape, old.dtype, sharding)
            self.chunked[key] = new
        return self.chunked[key]

    def lengths(self, layer: str, c: int) -> tuple[int, ...]:
        """Each rank's layers of ``layer``'s stack in chunk ``c``."""
        return tuple(self.counts[layer][c * self.p: (c + 1) * self.p])

    def local(self, op: str, fn, ins, out: int, attrs: dict, label: str, phase: str) -> Step:
        val = self.values[out]
        args = step_args("local", {"fn": fn, "attrs": attrs, "compute": val.sharding.split,
                                   "sizes": {d.name: d.size for d in val.shape}})
        return Step("local", -1, op, label, phase, tuple(ins), (out,), (), args)


def on_ranks(cut, lists: dict, p: int) -> dict:
    """The segment lists of a cut on ``p * v`` logical stages (``lists``) as the ``p`` ranks run
    them (see the module docstring); values of ``cut.values`` are added for the chunks."""
    rk = _Ranks(cut, p)
    writers = _writers(lists, PER_MICROBATCH)
    split = frozenset(x for x, st in writers.items() if _several_chunks(rk, st))
    made_ranks = {x: {rk.rank(t) for t in st} for x, st in _writers(lists, Segment, zeros=False).items()}
    out = {}
    for seg, pairs in lists.items():
        if seg in PER_MICROBATCH:
            out[seg] = [pair for s, st in pairs for pair in _per_chunk(rk, s, st, split, writers)]
        else:
            again = _received_again(rk, pairs)
            out[seg] = [pair for s, st in pairs if s.kind not in ("send", "recv") or s.args["tag"] not in again
                        for pair in _once(rk, s, st, made_ranks)]
    out[Segment.PROLOGUE] += _narrowed(rk, out)
    read_after = {x for s, _ in out[Segment.FINAL] for x in s.ins} | set(cut.outputs.values())
    joined = [x for x in sorted(split) if x in read_after]
    out[Segment.FINAL], summed = _sums_per_chunk(rk, out[Segment.FINAL], joined, writers, set(cut.outputs.values()))
    for seg in PER_MICROBATCH:
        made = _writers(lists, (seg,))
        out[seg] += _joins(rk, seg, [x for x in joined if x in made and x not in summed], writers)
    return out


def _sums_per_chunk(rk: _Ranks, final: list, values: list, writers: dict, outputs: set) -> tuple[list, set]:
    """The final segment with the sum over the micro-batches of each layer-split value of
    ``values`` (a stacked gradient) taken per chunk, then joined on each rank (its chunks one
    after another), where that sum is the final segment's one reader of it and every rank makes
    every chunk of it: each micro-batch's chunks then add into running sums where they are made,
    with no join per micro-batch.  Returns it and the values so summed."""
    readers: dict = {}
    for k, (s, _) in enumerate(final):
        for x in s.ins:
            readers.setdefault(x, []).append(k)
    at = {}
    for x in values:
        chunks = [c for c in range(rk.v) if rk.of(x, c) is not None] if rk.layer_of(x) is not None else []
        if not chunks or x in outputs or len(readers.get(x, ())) != 1:
            continue
        k = readers[x][0]
        s, st = final[k]
        per_rank = {tuple(sorted({rk.chunk(t) for t in ts} & set(chunks))) for ts in _by(writers[x], rk.rank).values()}
        if (s.kind == "allreduce" and s.ins == (x,) and s.axes and rk.spec.axis not in s.axes
                and per_rank == {tuple(chunks)} and len(_by(writers[x], rk.rank)) == rk.p):
            at[k] = (x, chunks)
    out = []
    for k, (s, st) in enumerate(final):
        if k not in at:
            out.append((s, st))
            continue
        x, chunks = at[k]
        sums = []
        for c in chunks:
            total = rk.of(s.outs[0], c)
            sums.append(total)
            out.append((dataclasses.replace(s, ins=(rk.of(x, c),), outs=(total,), label=f"{s.label} (chunk {c})",
                                            bytes=rk.values[total].local_bytes(rk.spec.mesh)), st))
        layer = rk.layer_of(x)
        out.append((rk.local("join", _join, sums, s.outs[0], {"dim": rk.values[x].shape.names.index(layer)},
                             "the rank's chunks, one after another", s.phase), st))
    return out, {x for x, _ in at.values()}


def _writers(lists: dict, segments, zeros: bool = True) -> dict:
    """Value -> the logical stages whose steps of ``segments`` make it (receives included;
    without ``zeros``, leaving out the zeros made where a stage holds none of a stack)."""
    out: dict = {}
    for seg in segments:
        for s, st in lists[seg]:
            if zeros or s.op != "zeros":
                for x in s.outs:
                    out[x] = out.get(x, frozenset()) | st
    return out


def _several_chunks(rk: _Ranks, stages) -> bool:
    """Whether some rank runs ``stages`` of more than one chunk."""
    seen: dict = {}
    for t in stages:
        seen.setdefault(rk.rank(t), set()).add(rk.chunk(t))
    return any(len(c) > 1 for c in seen.values())


def _by(stages, key) -> dict:
    out: dict = {}
    for t in sorted(stages):
        out.setdefault(key(t), set()).add(t)
    return {k: frozenset(v) for k, v in out.items()}


def _per_chunk(rk: _Ranks, s: Step, stages, split: frozenset, writers: dict) -> list:
    """Step ``s`` of a per-micro-batch segment on logical ``stages``, as ``(step, stages)``
    pairs per chunk: its values those of the chunk, its transfers at the ranks' offsets."""
    def mine(x, c):
        if x in split:
            return rk.of(x, c)
        if x not in writers and rk.layer_of(x) is not None:   # a stacked param: the chunk's layers
            return rk.of(x, c)
        return x
    if s.kind in ("send", "recv"):
        return _transfers(rk, s, stages, mine)
    out = []
    for c, st in _by(stages, rk.chunk).items():
        outs = tuple(mine(x, c) for x in s.outs)
        ins = tuple(mine(x, c) for x in s.ins)
        if None in outs or None in ins:
            out += _no_layers(rk, s, ins, outs, st)
            continue
        out.append((dataclasses.replace(s, ins=ins, outs=outs), st))
    return out


def _no_layers(rk: _Ranks, s: Step, ins: tuple, outs: tuple, stages) -> list:
    """Step ``s`` in a chunk where no rank runs any layer of a stack it makes or reads (``None`` among
    its chunk's values ``ins``, ``outs``): nothing for the layers themselves (a stack's zeros there, a
    stage's own-part step on its per-layer outputs or stacked gradients, each stage on its own layers),
    and a zero part of what such a step sums over the layers (a part of a sum over the stages)."""
    assert s.op == "zeros" or None in ins, s   # (only a stack's loops and own-part steps read its layers)
    out = []
    for x in outs:
        if x is not None:
            assert rk.spec.axis in rk.values[x].sharding.partial, s
            out.append((zeros_step(x, rk.values, s.phase), stages))
    return out


def _offsets(rk: _Ranks, s: Step, stages) -> dict:
    """Rank offset -> the logical stages of ``stages`` whose transfer ``s`` takes it."""
    o = s.args["offset"]
    other = (lambda t: t + o) if s.kind == "send" else (lambda t: t - o)
    return _by(stages, lambda t: (rk.rank(other(t)) - rk.rank(t)) * (1 if s.kind == "send" else -1))


def _transfers(rk: _Ranks, s: Step, stages, mine) -> list:
    """A per-micro-batch send or receive at its ranks' offsets; between two stages of one rank,
    no message: the receiving chunk's copy of the sending chunk's value."""
    out, o = [], s.args["offset"]
    for off, st in _offsets(rk, s, stages).items():
        for c, at in _by(st, rk.chunk).items():
            if off == 0:
                if s.kind == "recv":
                    src, dst = mine(s.outs[0], rk.chunk(min(at) - o)), mine(s.outs[0], c)
                    if src != dst:
                        out.append((rk.local("copy", _same, (src,), dst, {}, f"{s.label} (same rank)", s.phase),
                                    at))
                continue
            args = step_args(s.kind, {"offset": off, "tag": s.args["tag"]})
            out.append((dataclasses.replace(s, ins=tuple(mine(x, c) for x in s.ins),
                                            outs=tuple(mine(x, c) for x in s.outs), args=args), at))
    return out


def _once(rk: _Ranks, s: Step, stages, made_ranks: dict) -> list:
    """A step of the prologue or the final segment: its transfers at the ranks' offsets (none
    between stages of one rank), its zeros only on ranks that make the value otherwise nowhere."""
    if s.kind in ("send", "recv"):
        return [(dataclasses.replace(s, args=step_args(s.kind, {"offset": off, "tag": s.args["tag"]})), st)
                for off, st in _offsets(rk, s, stages).items() if off != 0]
    if s.op == "zeros":
        stages = frozenset(t for t in stages if rk.rank(t) not in made_ranks.get(s.outs[0], ()))
        return [(s, stages)] if stages else []
    return [(s, stages)]


def _received_again(rk: _Ranks, pairs: list) -> set:
    """The tags of the transfers of a once-run segment that bring a rank a value it received
    already (sent to two stages of one rank)."""
    seen, again = set(), set()
    for s, st in pairs:
        if s.kind == "recv":
            for t in st:
                if (s.outs[0], rk.rank(t)) in seen:
                    again.add(s.args["tag"])
                seen.add((s.outs[0], rk.rank(t)))
    return again


def _narrowed(rk: _Ranks, lists: dict) -> list:
    """Prologue steps giving each chunk of each rank its layers of each stacked value made outside
    the micro-batches that its steps read (:meth:`_Ranks.of`): a narrow of the rank's blocks."""
    made = {x for seg in PER_MICROBATCH for s, _ in lists[seg] for x in s.outs}
    whole = {new: vid for (vid, _), new in rk.chunked.items()}
    need = {}
    for seg in PER_MICROBATCH:
        for s, st in lists[seg]:
            for x in s.ins:
                if x in whole and x not in made:
                    for t in st:
                        need[(x, rk.rank(t))] = rk.chunk(t)
    out = []
    for (x, r), c in sorted(need.items()):
        src, layer = whole[x], rk.layer_of(whole[x])
        start = sum(rk.counts[layer][j * rk.p + r] for j in range(c))
        attrs = {"dim": rk.values[src].shape.names.index(layer), "start": start,
                 "length": rk.counts[layer][c * rk.p + r]}
        out.append((rk.local("narrow", _narrow, (src,), x, attrs, f"layers of chunk {c} (rank {r})", "forward"),
                    frozenset({c * rk.p + r})))
    return out


def _joins(rk: _Ranks, seg: Segment, values: list, writers: dict) -> list:
    """Per value of ``values`` (made per chunk in ``seg``, read after the micro-batches), each
    rank's join of its chunks' parts, on its last chunk of ``seg`` (the forward's highest, the
    backward's lowest)."""
    out, spec = [], rk.spec
    for x in values:
        layer, val = rk.layer_of(x), rk.values[x]
        if layer is None and spec.axis not in val.sharding.partial:
            raise LayoutError(message(
                f"compile (pipeline over '{spec.axis}', {rk.v} virtual stages per rank): value {x} is made per "
                "micro-batch by several chunks of a rank and read after the micro-batches.",
                inputs=[f"mesh: {spec.given[0]}", f"layout: {spec.given[1]}"],
                rule="what a rank's chunks make and the final segment reads is a layer-split tensor (joined) or "
                     "a part of a sum over the stages (added)",
                fix="use one stage per rank (--schedule 1f1b or zbh1)"))
        groups: dict = {}
        for r, st in _by(writers[x], rk.rank).items():
            chunks = tuple(sorted({rk.chunk(t) for t in st}))
            last = chunks[-1] if seg == Segment.FORWARD else chunks[0]
            groups.setdefault(chunks, set()).add(last * rk.p + r)
        for chunks, at in groups.items():
            parts = [y for y in (rk.of(x, c) for c in chunks) if y is not None]
            if layer is not None:
                step = rk.local("join", _join, parts, x, {"dim": val.shape.names.index(layer)},
                                "the rank's chunks, one after another", "backward" if seg == Segment.BACKWARD
                                else "forward")
            else:
                step = rk.local("add", _add, parts, x, {}, "the sum of the rank's chunks' parts",
                                "backward" if seg == Segment.BACKWARD else "forward")
            out.append((step, frozenset(at)))
    return out
