"""Collectives over a block-cyclic dim keep its blocks in the global order.

An interleaved pipeline (:mod:`.interleave`) stores the stacked values' layers block-cyclically
once the plan is lowered (``Sharding.cyclic``): rank r holds chunks r, r + p, ... A collective
lowered before that joins or cuts the layer dim as even blocks in rank order. Where a stacked
value's gradient leaves the stack for an activation the repeat reads stacked (CTC's emissions
renamed to the time steps, an LSTM's per-step inputs), its allgather would join rank 0's chunks
0 and 2 first, and every gradient behind it would be wrong. So each such allgather is followed by
a local step putting the joined blocks in the global order, and each reduce-scatter into a
block-cyclic value is preceded by one putting the whole tensor in the ranks' joined order.  A
flat fused weight's dim split block-cyclically (:mod:`.cyclic_dims`) is kept in order alike, and
an alltoall joining or cutting it too.  (A local split into such a dim cuts the value's regions at
run time: ``runtime/steps.py``.)
"""
from __future__ import annotations

import dataclasses

import torch

from ..layout.sharding import cyclic_order
from .plan import Step, Value, step_args


def _reorder(ctx, attrs, x):
    """``x`` with dim ``attrs['dim']`` taken at positions ``attrs['index']``."""
    return x.index_select(attrs["dim"], torch.tensor(attrs["index"], device=x.device))


def _order(value: Value, name: str, mesh, inverse: bool) -> tuple[int, ...]:
    """For block-cyclic dim ``name`` of ``value``: the joined position of each global index, or
    (``inverse``) the global index at each joined position."""
    sh = value.sharding
    order = cyclic_order(value.shape.get(name).size, mesh.axis_size(sh.axes_of(name)), sh.cyclic_blocks[name],
                         sh.given_blocks.get(name))
    if not inverse:
        return tuple(order)
    out = [0] * len(order)
    for g, j in enumerate(order):
        out[j] = g
    return tuple(out)


def _local(s: Step, vin: int, vout: int, values: dict, dim: int, index: tuple, what: str) -> Step:
    v = values[vout]
    args = step_args("local", {"fn": _reorder, "attrs": {"dim": dim, "index": index},
                               "compute": v.sharding.split, "sizes": {d.name: d.size for d in v.shape}})
    return Step("local", s.node, "reorder", f"{s.label}: {what}", s.phase, (vin,), (vout,), (), args)


def _like(values: dict, vid: int) -> int:
    new = max(values) + 1
    old = values[vid]
    values[new] = Value(new, old.shape, old.dtype, old.sharding)
    return new


def _in_order(s: Step, stages, values: dict, mesh) -> list:
    """``[(step, stages), ...]`` for ``s``: itself, or with the local step that orders its blocks."""
    if s.kind == "alltoall":
        return _alltoall_in_order(s, stages, values, mesh)
    if s.kind == "allgather":
        vin = values[s.ins[0]]
        name = vin.shape.names[s.args["dim"]]
        if name in vin.sharding.cyclic_blocks:
            joined = _like(values, s.outs[0])
            fix = _local(s, joined, s.outs[0], values, s.args["dim"], _order(vin, name, mesh, False),
                         "blocks in the global order")
            return [(dataclasses.replace(s, outs=(joined,)), stages), (fix, stages)]
    if s.kind == "reduce_scatter":
        vout = values[s.outs[0]]
        name = vout.shape.names[s.args["dim"]]
        if name in vout.sharding.cyclic_blocks:
            joined = _like(values, s.ins[0])
            fix = _local(s, s.ins[0], joined, values, s.args["dim"], _order(vout, name, mesh, True),
                         "blocks in the ranks' joined order")
            return [(fix, stages), (dataclasses.replace(s, ins=(joined,)), stages)]
    return [(s, stages)]


def _alltoall_in_order(s: Step, stages, values: dict, mesh) -> list:
    """An alltoall that joins a block-cyclic dim (its ``concat_dim``): the joined blocks put in the
    global order after it; one that cuts such a dim (its ``split_dim``): the whole put in the ranks'
    joined order before it (a flat fused weight's ``F``, :mod:`.cyclic_dims`)."""
    vin, vout = values[s.ins[0]], values[s.outs[0]]
    before, after = [], []
    name = vout.shape.names[s.args["split_dim"]]
    if name in vout.sharding.cyclic_blocks:
        joined = _like(values, s.ins[0])
        before.append((_local(s, s.ins[0], joined, values, s.args["split_dim"], _order(vout, name, mesh, True),
                              "blocks in the ranks' joined order"), stages))
        s = dataclasses.replace(s, ins=(joined,))
    name = vin.shape.names[s.args["concat_dim"]]
    if name in vin.sharding.cyclic_blocks:
        joined = _like(values, s.outs[0])
        after.append((_local(s, joined, s.outs[0], values, s.args["concat_dim"], _order(vin, name, mesh, False),
                             "blocks in the global order"), stages))
        s = dataclasses.replace(s, outs=(joined,))
    return [*before, (s, stages), *after]


def steps_in_global_order(steps, values: dict, mesh) -> list:
    """``steps`` with every collective that joins or cuts a block-cyclic dim keeping the global
    order (as :func:`in_global_order` for a pipeline's segments)."""
    return [x for s in steps for x, _ in _in_order(s, None, values, mesh)]


def in_global_order(values: dict, segments: dict, mesh) -> dict:
    """``segments`` (segment -> ``[(step, stages), ...]``) with every allgather out of, and
    reduce-scatter into, a block-cyclic dim keeping the global order (see the module docstring)."""
    return {seg: [pair for s, st in pairs for pair in _in_order(s, st, values, mesh)]
            for seg, pairs in segments.items()}
