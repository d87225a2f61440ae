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
"""
from __future__ import annotations

from .plan import Step


def foresee(lw) -> dict[int, frozenset]:
    """``id(tensor) -> shardings`` of the tensors lowerer ``lw`` moved that another reader read as
    they were made, reducing around their split instead (see the module docstring); empty when
    none was, the usual case: then nothing is lowered again."""
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
    return out


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
