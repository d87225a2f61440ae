"""A MIN allreduce sent as a MAX: ``min(x) = -max(-x)``, so it packs with the MAX allreduces.

Min-max normalisation over a split dim (MuZero's hidden state, ``(x - min) / (max - min)``)
reduces the same rows twice over the same axes, a MIN and a MAX allreduce of a few bytes each,
each paying a collective's latency.  :mod:`.coalesce` packs allreduces of one reduce op only; a
MIN whose input and result are negated is a MAX (negation is exact in floating point: no
rounding, ties and NaNs kept), so the two may go as one ``bucket_allreduce``.

:func:`as_maxes` rewrites each floating-point MIN allreduce that has a MAX allreduce of the same
phase, mesh axes and dtype in the same step list into ``neg``, a MAX allreduce, ``neg``;
:func:`unpacked_mins` puts back, once coalescing has chosen, every rewritten MIN that joined no
bucket (its two negations would be kernels for nothing).  Whether a pair is packed, the MAX
ready at the same point with no collective between and the latency saved worth the wait, is
coalescing's call.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .pipeline import MB_AXIS
from .plan import Step, Value, step_args


@dataclass(frozen=True)
class Negated:
    """A MIN allreduce rewritten as a MAX: the step as it was, the id of its negated input (the
    MAX's input) and of the MAX's result (negated back into the MIN's result)."""

    step: Step
    neg_in: int
    max_out: int


def as_maxes(steps: list[Step], values: dict, outputs: set[int], mesh) -> tuple[list[Step], list[Negated]]:
    """``steps`` with each MIN allreduce that has a MAX partner (see the module docstring) sent as
    the MAX of its negated input, negated back; new values are added to ``values``.  Returns the
    steps and what was rewritten (``steps`` itself, and nothing, when no MIN has a partner)."""
    maxes = {_key(s, values) for s in steps if _extreme(s, "max", outputs)}
    mins = {i for i, s in enumerate(steps) if _extreme(s, "min", outputs) and _key(s, values) in maxes
            and values[s.ins[0]].dtype.is_floating_point}
    if not mins:
        return steps, []
    out, negated, next_id = [], [], max(values) + 1
    for i, s in enumerate(steps):
        if i not in mins:
            out.append(s)
            continue
        a, b = values[s.ins[0]], values[s.outs[0]]
        values[next_id] = Value(next_id, a.shape, a.dtype, a.sharding)
        values[next_id + 1] = Value(next_id + 1, b.shape, b.dtype, b.sharding)
        as_max = replace(s, ins=(next_id,), outs=(next_id + 1,), args=step_args(s.kind, {**s.args, "op": "max"}),
                         note=f"{s.label}'s min sent as the max of its negation (exact), to pack with a max")
        out += [_negation(s, a.id, next_id, values, mesh), as_max, _negation(s, next_id + 1, b.id, values, mesh)]
        negated.append(Negated(s, next_id, next_id + 1))
        next_id += 2
    return out, negated


def unpacked_mins(steps: list[Step], negated: list[Negated], values: dict) -> list[Step]:
    """``steps`` with each rewritten MIN (``negated``, from :func:`as_maxes`) whose MAX joined no
    bucket put back as it was, its negations and their values dropped."""
    alone = {n.max_out: n for n in negated
             if any(s.kind == "allreduce" and s.outs == (n.max_out,) for s in steps)}
    if not alone:
        return steps
    negations = {n.neg_in for n in alone.values()}
    out = []
    for s in steps:
        if s.kind == "allreduce" and s.outs[0] in alone:
            out.append(alone[s.outs[0]].step)
        elif not (s.kind == "local" and s.op == "neg" and (s.outs[0] in negations or s.ins[0] in alone)):
            out.append(s)
    for n in alone.values():
        del values[n.neg_in], values[n.max_out]
    return out


def _extreme(s: Step, op: str, outputs: set[int]) -> bool:
    """Whether ``s`` is an allreduce with reduce op ``op`` that coalescing may pack: of the forward
    or the backward, over no micro-batch axis, one value in, one out that is no plan output."""
    return (s.kind == "allreduce" and s.args.get("op") == op and s.phase in ("forward", "backward")
            and MB_AXIS not in s.axes and len(s.ins) == 1 and len(s.outs) == 1 and s.outs[0] not in outputs)


def _key(s: Step, values: dict) -> tuple:
    """What a MIN and a MAX must share to be packed (as :mod:`.coalesce` groups them)."""
    return s.phase, s.axes, values[s.ins[0]].dtype


def _negate(ctx, attrs, x):
    return torch.neg(x)


def _negation(s: Step, src: int, dst: int, values: dict, mesh) -> Step:
    """A local step of ``s``'s node that writes ``-src`` into ``dst``."""
    v = values[dst]
    return Step("local", s.node, "neg", s.label, s.phase, (src,), (dst,), (),
                step_args("local", {"fn": _negate, "attrs": {}, "compute": dict(v.sharding.split),
                                    "sizes": {d.name: d.size for d in v.shape}}),
                flops=v.local_bytes(mesh) // v.dtype.itemsize,
                note=f"{s.label}'s min as the max of its negation: negated "
                     + ("before the max" if dst not in s.outs else "back after it"))
