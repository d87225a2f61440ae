"""A split tensor that several readers read: moved once for all of them, where that costs less.

The generic rule (:mod:`.generic`) chooses each op's sharding when the op is lowered, knowing
what earlier readers of its inputs moved them to (a held copy is free to read again), but not
what later readers will.  Two lookups into one item table split ``items:model`` (a recommender's
history embedding and its scoring of candidates): the first, whose rows are no bigger than the
table's shard, reads its shard as it is, masked, and leaves a partial sum reduced over ``model``;
the second, bigger, gathers the table.  The first could have read that gathered table: two
collectives where the one gather does.

So the top-level graph is lowered once more where the first lowering shows that pattern: a value
read as it is by a step whose result is a partial sum over an axis the value is split over, and
moved by another reader to a sharding without that split (:func:`foresee`).  The second lowering
prices reading the value at those shardings as free (as :mod:`.foresight` does for a repeat's
backward block), so every reader makes its choice knowing the move is made anyway; it is kept
only where its collectives and kernels cost less and it sends no more bytes (:func:`cheaper`).

A split value read by several slices, each of whose results every reader then moves off the
split (CPC's true future latents ``z[:, s:s+n]`` for each step ahead ``s``, renamed to the
candidates' ``batch2``, which no rule splits), is gathered slice by slice: each slice op, alone,
sees its result's layout target split as its input is.  Where gathering the value once costs less
than gathering its slices (:func:`sliced_whole`), the second lowering also foresees that move, and
each slice's result wanted where its readers take it (:class:`.foresight.Foresight`): a slice
made from the whole copy, then cut to its target, is read whole again with no move.  A slice
kept split by a halo whose result its readers then gather (:func:`halo_slices_read_whole`) is
foreseen wanted whole: the slice rule (:mod:`.window`) then weighs moving its rows once.

A split value that no reader moves, read as it is by several projections (einsums with params)
that each leave a partial sum over its split (q, k and v of a normed input split along
``d_model``), has each result reduced: several times the projection's bytes, where gathering the
input once, and the params' few bytes, would do (:func:`projected_once`).  Each projection,
alone, sees its own gather and its weight's, two latencies against one reduction; and the
reductions, made back to back, go as one packed allreduce (:mod:`.coalesce`) as the gathers
would.  So that lowering again foresees the input gathered, and is kept where, both plans
coalesced, it costs less and sends no more bytes (:func:`cheaper_packed`).
"""
from __future__ import annotations

import dataclasses

from .coalesce import coalesce
from .dead_moves import live_steps
from ..layout.sharding import Sharding
from .foresight import NONE, Foresight
from .halo import gathered, readers
from .plan import Step
from .relayout import relayout_cost


def foresee(lw) -> Foresight:
    """What the second lowering foresees: ``held``, ``id(tensor) -> shardings`` of the tensors
    lowerer ``lw`` moved that another reader read as they were made, reducing around their split
    instead, and those of :func:`sliced_whole`, whose ``wanted`` it passes on (see the module
    docstring); empty when there is none, the usual case: then nothing is lowered again."""
    reduced_around: dict[int, frozenset] = {}   # value -> axes a reader of it left a partial sum over
    for s in lw.steps:
        if s.kind != "local":
            continue
        partial = frozenset(a for v in s.outs for a in lw.values[v].sharding.partial)
        if partial:
            for v in s.ins:
                reduced_around[v] = reduced_around.get(v, frozenset()) | partial
    out = {}
    for tid, vid in lw.env.items():
        split = lw.values[vid].sharding
        axes = reduced_around.get(vid, frozenset()) & {a for _, ax in split.dims for a in ax}
        if not axes or split.partial:
            continue
        moved = frozenset(to for to in lw.held(vid) if not to.partial and axes - to.used_axes)
        if moved:
            out[tid] = moved
    cuts = sliced_whole(lw)
    for tid, to in cuts.held.items():
        out[tid] = out.get(tid, frozenset()) | to
    return Foresight(out, {**halo_slices_read_whole(lw), **cuts.wanted})


def halo_slices_read_whole(lw) -> dict:
    """``id(slice result) -> its sharding whole along the sliced dim`` for each slice lowerer ``lw``
    kept split along a split dim by a halo exchange, whose result every reader, through renames
    and slices of other dims, then moved off that split (MIMO-UNet's DFT patch: its rows moved
    over the ranks, then gathered for the DFT): the slice rule then weighs making it whole
    (:mod:`.window`) instead of moving its rows twice."""
    read_as_is = {v for s in lw.steps if s.kind != "input" and not s.is_collective for v in s.ins}
    halos = {s.node for s in lw.steps if s.kind == "permute"}
    wanted = {}
    for t in {id(t): t for t in lw.keep}.values():
        if t.node is None or t.node.op.name != "slice" or t.node.id not in halos or id(t) not in lw.env:
            continue
        dim, sh = t.node.attrs["dim"], lw.values[lw.env[id(t)]].sharding
        axes = set(sh.axes_of(dim))
        if axes and not sh.partial and _moved_off(lw, t, dim, axes, read_as_is):
            wanted.update(_chain(lw, t, dim))
    return wanted


def _chain(lw, t, dim: str) -> dict:
    """``id -> its sharding whole along dim`` for ``t`` and what renames and slices of other dims
    make of it (``dim`` renamed as they rename it)."""
    vid = lw.env.get(id(t))
    if vid is None:
        return {}
    out = {id(t): gathered(lw.values[vid].sharding, t.shape, dim)}
    for n, slot in readers(lw, t):
        if _passes(n, slot, dim):
            out.update(_chain(lw, n.outputs[0], _renamed(n, dim)))
    return out


def _moved_off(lw, t, dim: str, axes: set, read_as_is: set) -> bool:
    """Whether tensor ``t`` (or what renames and slices of dims other than ``dim`` make of it) is
    read only after a move to shardings that keep ``dim`` off ``axes``."""
    vid = lw.env.get(id(t))
    if vid is None:
        return False
    if vid not in read_as_is:
        moved = lw.held(vid)
        return bool(moved) and all(not to.partial and not axes & set(to.axes_of(dim)) for to in moved)
    rs = readers(lw, t)
    return bool(rs) and all(_passes(n, slot, dim) and _moved_off(lw, n.outputs[0], _renamed(n, dim), axes, read_as_is)
                            for n, slot in rs)


def _passes(node, slot: int, dim: str) -> bool:
    """Whether ``node`` passes its input ``slot``'s ``dim`` on as it is: a rename, a slice of another dim."""
    return not slot and (node.op.name == "rename" or node.op.name == "slice" and node.attrs["dim"] != dim)


def _renamed(node, dim: str) -> str:
    """What ``node`` (a rename or a slice) calls ``dim`` in its output."""
    return node.attrs["mapping"].get(dim, dim) if node.op.name == "rename" else dim


def sliced_whole(lw) -> Foresight:
    """What the second lowering foresees for the split values lowerer ``lw`` sliced several times,
    each slice moved by every reader to one sharding without some axes of the split (see the
    module docstring): ``held``, the value at that sharding; ``wanted``, each slice there.  Only
    where one move of the value is priced below the moves of its slices; :data:`.foresight.NONE`
    when there is none, the usual case."""
    read_as_is = {v for s in lw.steps if s.kind != "input" and not s.is_collective for v in s.ins}
    made = {s.node: s for s in lw.steps if s.kind == "local" and s.op == "slice" and len(s.outs) == 1}
    cuts: dict[tuple[int, object], list] = {}   # (the sliced value, where its slices went) -> the slices
    for t in {id(t): t for t in lw.keep}.values():
        s = made.get(t.node.id) if t.node is not None and t.node.op.name == "slice" else None
        if s is None:
            continue
        src, out = s.ins[0], s.outs[0]
        sh, moved = lw.values[src].sharding, lw.held(out)
        if sh.partial or lw.values[out].sharding != sh or out in read_as_is or len(moved) != 1:
            continue
        (to,) = moved
        # (a move that splits the sliced dim would cut the value's rows otherwise than its slice's)
        if not to.partial and sh.used_axes - to.used_axes and t.node.attrs["dim"] not in dict(to.split):
            cuts.setdefault((src, to), []).append((t, out))
    held, wanted = {}, {}
    for (src, to), outs in cuts.items():
        if len(outs) < 2 or _move_cost(lw, src, to) >= sum(_move_cost(lw, o, to) for _, o in outs):
            continue
        x = id(outs[0][0].node.inputs[0])
        held[x] = held.get(x, frozenset()) | {to}
        wanted.update((id(t), to) for t, _ in outs)
    return Foresight(held, wanted) if held else NONE


def _move_cost(lw, vid: int, to, model=None) -> float:
    """Seconds of bringing lowerer ``lw``'s value ``vid`` to sharding ``to`` (by ``model``, else
    its cost model)."""
    v = lw.values[vid]
    return relayout_cost(v.shape, v.sharding, to, lw.mesh, v.dtype.itemsize, model or lw.cost)


def cheaper(new, old, sent: bool = True) -> bool:
    """Whether lowerer ``new``'s steps cost less than ``old``'s (collectives and kernels, by its
    cost model) and, where ``sent``, send no more bytes: the second lowering prices free what it
    merely forecasts.  (:mod:`.shared_sums` forecasts nothing: its time alone decides.)"""
    return (_price(new.steps, new) < _price(old.steps, old) - 1e-12
            and (not sent or _price(new.steps, new, sent=True) <= _price(old.steps, old, sent=True)))


def _price(steps: list[Step] | tuple[Step, ...], lw, sent: bool = False) -> float:
    """Seconds of ``steps``' collectives and kernels (their sub-plans' as often as they run), or the
    bytes their collectives send when ``sent``."""
    mesh, model = lw.mesh, lw.cost
    total = 0.0
    for s in steps:
        if s.is_collective:
            total += s.bytes if sent else model.collective(s.kind, s.bytes, mesh.axis_size(s.axes))
        elif s.kind == "local" and not sent:
            total += model.compute(s.flops)
        for k, sub in enumerate(s.subplans):
            total += s.runs(k) * _price(sub.steps, lw, sent)
    return total


def projected_once(lw, params=None) -> dict[int, frozenset]:
    """``id(tensor) -> {its sharding without some axes of its split}`` for each value lowerer
    ``lw`` neither moved nor made partial, read as it is by two or more einsums with params (read
    as stored) whose results are partial sums over those axes (see the module docstring); only
    where gathering it and their params sends fewer bytes than reducing their results.
    ``params``: the values that count as params (a repeat's block: one layer's slice of each
    stacked param, :mod:`.repeat`); else ``lw``'s params."""
    params = set(lw.params.values()) if params is None else set(params)
    by_reader: dict[int, list[Step]] = {}
    for s in lw.steps:
        if s.kind == "local" and s.op == "einsum" and len(s.outs) == 1:
            for v in set(s.ins):
                by_reader.setdefault(v, []).append(s)
    wire = dataclasses.replace(lw.cost, latency_s=0.0)   # (bytes' seconds: the relowering weighs latencies)
    out = {}
    for tid, vid in lw.env.items():
        sh = lw.values[vid].sharding
        if sh.partial or lw.held(vid) or len(by_reader.get(vid, ())) < 2:
            continue
        sums = [s for s in by_reader[vid] if set(s.ins) - {vid} <= params
                and lw.values[s.outs[0]].sharding.partial]
        axes = sh.used_axes.intersection(*(lw.values[s.outs[0]].sharding.partial for s in sums))
        if len(sums) < 2 or not axes:
            continue
        to = _without(lw.values[vid], axes)
        gather = _move_cost(lw, vid, to, wire) + sum(
            _move_cost(lw, w, _without(lw.values[w], axes), wire) for s in sums for w in set(s.ins) - {vid})
        reduce = sum(_move_cost(lw, s.outs[0], lw.values[s.outs[0]].sharding.with_partial(()), wire) for s in sums)
        if gather < reduce:
            out[tid] = frozenset({to})
    return out


def _without(v, axes):
    """Value ``v``'s sharding with no dim split over ``axes``."""
    return Sharding.of(v.shape, {d: kept for d, a in v.sharding.split.items()
                                   if (kept := tuple(x for x in a if x not in axes))}, v.sharding.partial)


def cheaper_packed(new, new_outs: dict, old, old_outs: dict) -> bool:
    """:func:`cheaper`, each lowerer's steps priced as the plan will send them: collectives
    nothing reads dropped (:mod:`.dead_moves`), small ones made back to back packed (:mod:`.coalesce`)."""
    def sent(lw, outs):
        return coalesce(live_steps(lw.steps, outs.values()), lw.values, outs, lw.cost, lw.mesh)
    a, b = sent(new, new_outs), sent(old, old_outs)
    return _price(a, new) < _price(b, old) - 1e-12 and _price(a, new, sent=True) <= _price(b, old, sent=True)
