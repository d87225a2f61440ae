"""Collectives over dims stored at given lengths: each member's part as its values store it.

A collective that joins or cuts parts of unequal length carries them in its ``uneven`` arg
(:func:`.uneven.uneven_arg`), from which a communicator works out each member's length
(:func:`meshdsl.collectives.parts_of`).  A pass that stores a dim at given lengths after the
steps were lowered (unequal pipeline stages and stacks on some of the stages, :mod:`.stage_layers`:
``Sharding.parts``; virtual stages: ``Sharding.blocks``) changes what each member holds, so a
collective over such a value, lowered for the even cut, carries the stored lengths too.

Without them the simulated mesh still joins the right parts (it concatenates whatever each member
holds), but real processes cannot: gloo and NCCL move parts of one length, taken from the
caller's own part (``torch_collectives``), so a stage holding none of a stack gathered nothing and
the stage holding all of it gathered twice its layers.
"""
from __future__ import annotations

import dataclasses

from .plan import Step, step_args

#: collective kind -> its args naming the dims whose parts it joins or cuts
_DIM_ARGS = {"allgather": ("dim",), "reduce_scatter": ("dim",), "alltoall": ("split_dim", "concat_dim")}


def with_given_lengths(lists: dict, values: dict, mesh) -> dict:
    """The segment lists ``lists`` (segment -> ``(step, stages)`` pairs) with every collective that
    joins or cuts a dim one of its values stores at given lengths carrying those lengths."""
    return {seg: [(_with_lengths(s, values, mesh), st) for s, st in pairs] for seg, pairs in lists.items()}


def with_stored_bytes(lists: dict, values: dict, lowered: dict, mesh) -> dict:
    """The segment lists ``lists`` with each collective's bytes following the value it moves
    (its first) where a pass stored that value otherwise after the steps were lowered: a stack on
    one stage held whole there (its gradients' sums move all its layers, not one stage's share),
    stages at given counts (the largest part, as an uneven split is counted).  ``lowered``: each
    value's local bytes as lowered."""
    def stored(s: Step) -> Step:
        v = next((v for v in (*s.ins, *s.outs) if v in values), None) if s.is_collective else None
        now = None if v is None or not lowered.get(v) else values[v].local_bytes(mesh)
        return s if now in (None, lowered.get(v)) else dataclasses.replace(s, bytes=s.bytes * now // lowered[v])
    return {seg: [(stored(s), st) for s, st in pairs] for seg, pairs in lists.items()}


def _with_lengths(s: Step, values: dict, mesh) -> Step:
    names = _DIM_ARGS.get(s.kind)
    if names is None or len(s.axes) != 1:
        return s
    (axis,) = s.axes
    given = {}
    for pos in (s.args[n] for n in names):
        lengths = next((ls for ls in (_stored(values[v], pos, axis, mesh) for v in (*s.ins, *s.outs)) if ls), None)
        if lengths is not None and len(set(lengths)) > 1:   # equal parts: the even step already fits them
            given[pos] = lengths
    if not given:
        return s
    entries = [e for e in s.args.get("uneven") or () if e[0] not in given]
    entries += [(pos, values[s.ins[0]].shape[pos].size, (), lengths) for pos, lengths in sorted(given.items())]
    if s.args.get("uneven") == tuple(entries):
        return s
    return dataclasses.replace(s, args=step_args(s.kind, {**s.args, "uneven": tuple(entries)}))


def _stored(v, pos: int, axis: str, mesh) -> tuple[int, ...] | None:
    """The lengths value ``v`` stores its dim at ``pos`` at, by the index along ``axis``, where
    ``axis`` alone splits it at given lengths (parts or blocks); None otherwise."""
    sh, name = v.sharding, v.shape[pos].name
    if sh.axes_of(name) != (axis,) or not (name in sh.given_parts or name in sh.given_blocks):
        return None
    return tuple(v.local_shape(mesh, r)[pos] for r in mesh.group(0, (axis,)))
