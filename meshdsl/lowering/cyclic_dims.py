"""Dims an implied rule splits block-cyclically: a flat fused weight's ``(qkv heads d_head)``.

GPT-2's ``c_attn`` is one flat dim ``F = (qkv heads d_head)``, ``qkv`` outermost.  Under
``heads:model`` (p ranks) rank r needs, for each of the ``Q = |qkv|`` parts, the run of rows of
its heads: cut F into ``p Q`` equal blocks, those are blocks r, r + p, .., r + (Q - 1) p, which
is ``Sharding.cyclic`` with ``v = Q`` blocks per rank.  Its local part, blocks in that order, is
a row-major ``(qkv, heads / p, d_head)`` array, so the reshape is a local view both ways
(:func:`.reshape.cyclic_carry`) and the projection is column-parallel, as Megatron runs it.
nanoGPT cuts F by slices instead (``q, k, v = qkv.split(n_embd)``: three ``slice_`` of F, each
rearranged ``(heads d_head)``): those rearranges split the sliced F (one group, ``F / Q``)
plainly, so F is block-cyclic at its full size with ``Q`` blocks per rank (:func:`cyclic_entry`),
and a slice or pad of whole groups is the rank's own blocks (:func:`lower_cyclic_window`).

The lowering splits such a dim as it splits any (``F:model``, each rank's part as long); only
the reshapes know that a rank's part is its blocks, and the ops between read F's positions
independently (an einsum that keeps F, elementwise math) or sum over them (a contraction over F,
a partial sum: the blocks' order does not matter), or slice or pad whole groups of it.
:func:`cyclic_ok` says when a graph holds F in no other op, so the implied rule may be
block-cyclic; :func:`store_cyclic` then marks every
value whose F is split over its axis block-cyclic, so init, gathers and checkpoints place
the rows where they are (``Sharding.regions``), and puts the blocks of a collective that joins or
cuts F in order (:mod:`.cyclic_moves`).  A value of the plan that splits F otherwise (over other
axes too) refuses it (:class:`NotCyclic`): the compiler lowers again without the rule.
"""
from __future__ import annotations

import dataclasses

from ..layout.sharding import Sharding
from ..ops.elementwise import Nary, Unary
from ..ops.reduce import Reduce
from .cyclic_moves import steps_in_global_order
from .relayout import relayout_cost
from .reshape import Regroup, cyclic_carry

#: ops other than elementwise math and reductions that read each position of a dim on its own:
#: a block-cyclic dim may pass through them (a dim they need whole, ``spec.fixed``, may not).  No
#: input: a data loader cuts the rows of what it feeds as one run per rank (``train/feeder.py``).
_FREE = frozenset({"einsum", "broadcast_to", "transpose", "sgd_step", "sgd_update", "adamw_update", "param",
                   "placeholder"})


class NotCyclic(Exception):
    """A plan splits a block-cyclic dim otherwise than over its one axis (see the module docstring)."""


def cyclic_entry(nodes, dim: str, size: int, v: int, mesh, axes, layout, sizes):
    """``(dim, blocks per rank, size)`` for ``Layout.cyclic`` where the implied split of ``dim`` over
    ``axes``, ``v`` blocks per rank at ``size`` (what a reshape carries), is block-cyclic at some of
    its ``sizes``: None where it is a plain split at each (no size holds more than one group of
    ``size / v``), False where a block-cyclic one is refused (:func:`cyclic_ok`).

    nanoGPT's ``q, k, v = qkv.split(n_embd)``, written as three ``slice_`` of ``F`` each
    rearranged ``(heads d_head)``: the rearranges carry ``heads:model`` to ``F`` at size
    ``n_embd``, one group, so the full ``F`` (3 groups) is block-cyclic with 3 blocks per rank
    and each slice of one group is the rank's own block (:func:`lower_cyclic_window`)."""
    group, big = size // v, max(sizes)
    if big <= group:
        return None
    if len(axes) != 1 or any(s % group for s in sizes) or not cyclic_ok(nodes, dim, group, mesh, axes, layout):
        return False
    return dim, big // group, big


def cyclic_ok(nodes, dim: str, group: int, mesh, axes, layout) -> bool:
    """Whether ``dim`` may be split block-cyclically over ``axes`` in groups of ``group`` (one
    block per rank each; a size n of the dim has ``n / group`` blocks per rank): no written rule
    names it (a scoped one would split it otherwise), and every op of ``nodes`` (the backward's
    included) holding it at more than one group reads its positions independently or sums over
    them, is a reshape that cuts it into, or makes it from, parts the block-cyclic split carries,
    or a slice or pad of whole groups.  (An op holding it at one group only sees a plain split.)"""
    if any(r.key[1] == dim for r in layout.rules):
        return False
    for n in nodes:
        held = [t.shape.get(dim).size for t in (*n.inputs, *n.outputs) if dim in t.shape.names]
        if n.op.subgraphs(n) or max(held, default=0) <= group:
            continue   # (a repeat: its block's ops are among the nodes)
        if n.op.name in ("reshape", "rearrange"):
            if not _regroups(n, dim, max(held) // group, mesh, tuple(axes)):
                return False
        elif n.op.name in ("slice", "pad") and n.attrs["dim"] == dim:
            if _bounds(n)[0] % group or _bounds(n)[1] % group:
                return False
        elif n.op.name in ("slice", "pad"):
            continue   # (a window of another dim reads each position of this one on its own)
        elif not (isinstance(n.op, (Unary, Nary, Reduce)) or n.op.name in _FREE) or dim in n.op.spec(n).fixed:
            return False
    return True


def _bounds(node) -> tuple[int, int]:
    """Where a slice's output, or a pad's input, starts and ends in the larger dim."""
    a = node.attrs
    if node.op.name == "slice":
        return a["start"], a["stop"]
    return a["before"], a["before"] + node.inputs[0].shape.get(a["dim"]).size


def _regroups(node, dim: str, v: int, mesh, axes: tuple) -> bool:
    """Whether reshape ``node`` passes ``dim`` alone or cuts or makes it so that its block-cyclic
    split over ``axes`` carries over (to or from its part after parts of product ``v``)."""
    for st in Regroup.of(node).stages:
        for ins, outs in st:
            if dim not in {n for n, _ in (*ins, *outs)} or (len(ins) == 1 and len(outs) == 1):
                continue
            if len(ins) == 1:   # dim cut into parts: the split carries onto one of them
                ok = cyclic_carry(mesh, ins, outs, {dim: axes}, {dim: v})
            elif len(outs) == 1:   # dim made of parts: some split part carries over to it
                ok = any(cyclic_carry(mesh, ins, outs, {n: axes}, {dim: v}) for n, _ in ins)
            else:
                ok = False
            if not ok:
                return False
    return True


def lower_cyclic_window(lw, node) -> bool:
    """Lower a slice or pad of whole groups of a block-cyclic dim as a local step, where the
    input holds it split over its axis; False (the window rule decides) elsewhere.

    Rank r's part of a dim with v blocks per rank is its block of each group in order, so a slice
    of groups g0 .. g1 is its local blocks g0 .. g1 (nanoGPT's q, k, v: block g of the rank's three),
    split block-cyclically as the layout has it at the slice's size (or plainly, one group), and
    the pad back (the slice's gradient) puts the rank's blocks among zero blocks alike: no halo,
    where the window rule would trade one (its contiguous split is the wrong rows)."""
    dim, (t,), out = node.attrs["dim"], node.inputs, node.outputs[0]
    v_in = lw.layout.cyclic_blocks_of(t.shape).get(dim, 1)
    v_out = lw.layout.cyclic_blocks_of(out.shape).get(dim, 1)
    if node.op.name == "shift" or max(v_in, v_out) == 1 or lw.memo.get(("virtual", id(t))):
        return False   # (a pad its readers read through: the window rule reads it so)
    vid = lw.reduced(lw.value(t))
    cur = lw.sharding(vid)
    axes = cur.axes_of(dim)
    want = {r.key[1]: r.axis_names for r, _ in lw.layout.implied}.get(dim)
    if axes != want or dim in dict(cur.parts) or dim in cur.cyclic_blocks:
        return False
    if cur.partial and not (lw.num_uses(t) == 1 and node.op.is_linear(node)):
        cur = cur.with_partial(())
        vid = lw.relayout(vid, cur, node, f"input of {node.op.name}")
    tgt = lw.target(out)
    tgt = tgt.with_partial(tuple(a for a in cur.partial if a not in tgt.used_axes))
    sh, attrs = Sharding.of(out.shape, cur.split, cur.partial), dict(node.attrs)
    whole = Sharding.of(t.shape, {d: a for d, a in cur.split.items() if d != dim}, cur.partial)
    size, mesh = t.dtype.itemsize, lw.mesh
    gather = relayout_cost(t.shape, cur, whole, mesh, size, lw.cost) \
        + relayout_cost(out.shape, Sharding.of(out.shape, whole.split, whole.partial), tgt, mesh, size, lw.cost)
    if relayout_cost(out.shape, sh, tgt, mesh, size, lw.cost) > gather:
        # (its output moves anyway, and a pad's is larger than its input: the dim gathered, then cut)
        vid, sh, note = lw.relayout(vid, whole, node, f"input of {node.op.name}"), \
            Sharding.of(out.shape, whole.split, whole.partial), ""
    else:
        group = t.shape.get(dim).size // v_in
        b, (lo, _) = group // mesh.axis_size(axes), _bounds(node)
        note = f"whole groups of block-cyclic '{dim}': local"
        if node.op.name == "slice":
            attrs.update(start=lo // group * b, stop=(lo // group + v_out) * b)
        else:
            before, after = lo // group * b, (v_out - v_in - lo // group) * b
            attrs["torch_pad"] = attrs["torch_pad"][:-2] + (before, after)   # (the dim's pair is the last)
    res = lw.new_value(out.shape, out.dtype, sh)
    lw.emit("local", node, [vid], [res], args={"fn": node.op.compute, "inplace": None, "attrs": attrs,
                                               "compute": {}, "sizes": {}},
            flops=sh.local_numel(out.shape, mesh), note=note)
    lw.bind(out, lw.relayout(res, tgt, node, f"output of {node.op.name}"))
    return True


def store_cyclic(steps, values: dict, mesh, layout) -> list:
    """Every value of ``values`` (and of the sub-plans ``steps`` run) whose block-cyclic dim its
    axis splits, stored block-cyclically; ``steps`` with every collective that joins or cuts such a
    dim keeping the global order.  ``values`` is changed in place; the steps are returned.

    Raises:
      NotCyclic: a value splits such a dim over other axes.
    """
    if not layout.cyclic:
        return list(steps)
    axis = {r.key[1]: r.axis_names for r, _ in layout.implied if r.key[1] in layout.cyclic_blocks}
    _mark(values, layout, axis)
    out = []
    for s in steps:
        if s.subplans:
            subs = []
            for sub in s.subplans:
                vals = dict(sub.values)
                subs.append(dataclasses.replace(sub, values=vals, steps=store_cyclic(sub.steps, vals, mesh, layout)))
            s = dataclasses.replace(s, subplans=tuple(subs))
        out.append(s)
    return steps_in_global_order(out, values, mesh)


def _mark(values: dict, layout, axis: dict) -> None:
    for vid, val in list(values.items()):
        sh = val.sharding
        for dim, v in layout.cyclic_blocks_of(val.shape).items():
            if dim in sh.cyclic_blocks or not sh.axes_of(dim):
                continue
            if sh.axes_of(dim) != axis[dim]:
                raise NotCyclic(f"'{dim}' whole, not block-cyclic: a value splits it over "
                                f"{','.join(sh.axes_of(dim))}, not over {','.join(axis[dim])} alone")
            sh = sh.with_cyclic(dim, v)
        if sh is not val.sharding:
            values[vid] = dataclasses.replace(val, sharding=sh)
