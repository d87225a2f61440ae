"""Local steps over dims cut at given lengths: each rank's slice as its values store it.

A local step's kernel learns its rank's slice of each dim it splits (``LocalCtx`` offsets and
sizes: a broadcast's local shape, an iota's first index) from the step's ``compute`` split and
the dims' global ``sizes``, cut as :func:`~meshdsl.layout.sharding.chunk` cuts.  A pass that
stores a dim at given part lengths after the steps were lowered (unequal pipeline stages,
:mod:`.stage_layers`, :mod:`.interleave`: ``Sharding.parts``) changes what each rank holds, so
the steps reading or making such values carry the lengths too (the local step's ``parts`` arg,
``{dim: lengths by the index along its one axis}``).  With it, what a loss makes of a pipelined
repeat's per-layer outputs (a broadcast of a sum's gradient over the layers, say) runs on each
stage's own, unequal number of layers.  A block-cyclic dim (virtual stages) has one length per
rank, the sum of its blocks, but no single first index: a kernel that makes such a dim from
positions alone (a stacked ``md.constant`` or ``md.arange(layer)``: no input holds the dim) runs
once per block, at that block's offset, and its blocks are joined in the rank's local order
(:func:`_by_blocks`); the other kernels read only the length.
"""
from __future__ import annotations

import dataclasses

import torch

from ..layout.sharding import block_lengths
from ..ops.registry import LocalCtx
from .plan import Step, step_args


def with_given_parts(lists: dict, values: dict) -> dict:
    """The segment lists ``lists`` (segment -> ``(step, stages)`` pairs) with every local step
    over a dim that one of its values stores at given lengths carrying those lengths."""
    return {seg: [(_with_parts(s, values), st) for s, st in pairs] for seg, pairs in lists.items()}


def _with_parts(s: Step, values: dict) -> Step:
    if s.kind != "local":
        return s
    s = _by_blocks(_whole_again(s, values), values)
    compute, parts = s.args["compute"], {}
    for v in (*s.ins, *s.outs):
        sh = values[v].sharding
        for dim, lengths in sh.parts:
            if compute.get(dim) == sh.axes_of(dim):
                parts[dim] = lengths
    if not parts or s.args.get("parts") == parts:
        return s
    return dataclasses.replace(s, args=step_args("local", {**s.args, "parts": parts}))


def _whole_again(s: Step, values: dict) -> Step:
    """``s`` computing whole each dim its compute split splits but every value of it holding the dim
    stores whole (a stack on one stage of several: :func:`.stage_layers._store_whole` stores its
    layers whole there after lowering; a broadcast of a stacked mask made before the stack)."""
    compute = s.args["compute"]
    whole = set()
    for dim, axes in compute.items():
        held = [values[v].sharding for v in (*s.ins, *s.outs) if dim in values[v].shape.names]
        if axes and held and not any(sh.axes_of(dim) for sh in held):
            whole.add(dim)
    if not whole:
        return s
    return dataclasses.replace(s, args=step_args("local", {**s.args, "compute": {
        d: a for d, a in compute.items() if d not in whole}}))


def _by_blocks(s: Step, values: dict) -> Step:
    """``s`` run once per block where its one output's block-cyclic dim is made from no input
    holding it (the kernel reads its slice's offset: a constant's rows, an iota's first index)."""
    if len(s.outs) != 1:
        return s
    out = values[s.outs[0]]
    for dim, v in out.sharding.cyclic:
        if s.args["compute"].get(dim) and not any(dim in values[i].shape.names for i in s.ins):
            at, size = out.shape.names.index(dim), out.shape.get(dim).size
            fn = _per_block(s.args["fn"], dim, at, size, v, out.sharding.given_blocks.get(dim))
            return dataclasses.replace(s, args=step_args("local", {**s.args, "fn": fn, "inplace": None}))
    return s


def _per_block(fn, dim: str, at: int, size: int, v: int, given):
    """``fn`` run at each of the rank's ``v`` blocks of block-cyclic ``dim`` (axis ``at`` of its
    output), joined in the local order.  The rank is found from its contiguous part's offset
    (each rank holds at least one layer, so the offsets differ)."""
    def kernel(ctx, attrs, *xs):
        offset, n = ctx.offset(dim), ctx.size(dim, size)
        if given:
            p = len(given) // v
            per_rank = [sum(given[c * p + r] for c in range(v)) for r in range(p)]
            i = next(r for r in range(p) if sum(per_rank[:r]) == offset)
        else:
            p, i = size // n, offset // n
        lengths = block_lengths(size, p, v, given)
        parts = []
        for c in range(v):
            b = c * p + i
            offs, sizes = {**ctx.offsets, dim: sum(lengths[:b])}, {**ctx.sizes, dim: lengths[b]}
            parts.append(fn(LocalCtx(offs, sizes, ctx.salt), attrs, *xs))
        return torch.cat(parts, at)
    return kernel
