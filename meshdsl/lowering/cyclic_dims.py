"""Dims an implied rule splits block-cyclically: a flat fused weight's ``(qkv heads d_head)``.

GPT-2's ``c_attn`` is one flat dim ``F = (qkv heads d_head)``, ``qkv`` outermost.  Under
``heads:model`` (p ranks) rank r needs, for each of the ``Q = |qkv|`` parts, the run of rows of
its heads: cut F into ``p Q`` equal blocks, those are blocks r, r + p, .., r + (Q - 1) p, which
is ``Sharding.cyclic`` with ``v = Q`` blocks per rank.  Its local part, blocks in that order, is
a row-major ``(qkv, heads / p, d_head)`` array, so the reshape is a local view both ways
(:func:`.reshape.cyclic_carry`) and the projection is column-parallel, as Megatron runs it.

The lowering splits such a dim as it splits any (``F:model``, each rank's part as long); only
the reshapes know that a rank's part is its blocks, and the ops between read F's positions
independently (an einsum that keeps F, elementwise math) or sum over them (a contraction over F,
a partial sum: the blocks' order does not matter).  :func:`cyclic_ok` says when a graph holds F
in no other op, so the implied rule may be block-cyclic; :func:`store_cyclic` then marks every
value whose F is split over its axis block-cyclic, so init, gathers and checkpoints place
the rows where they are (``Sharding.regions``), and puts the blocks of a collective that joins or
cuts F in order (:mod:`.cyclic_moves`).  A value of the plan that splits F otherwise (over other
axes too) refuses it (:class:`NotCyclic`): the compiler lowers again without the rule.
"""
from __future__ import annotations

import dataclasses

from ..ops.elementwise import Nary, Unary
from ..ops.reduce import Reduce
from .cyclic_moves import steps_in_global_order
from .reshape import Regroup, cyclic_carry

#: ops other than elementwise math and reductions that read each position of a dim on its own:
#: a block-cyclic dim may pass through them (a dim they need whole, ``spec.fixed``, may not).  No
#: input: a data loader cuts the rows of what it feeds as one run per rank (``train/feeder.py``).
_FREE = frozenset({"einsum", "broadcast_to", "transpose", "sgd_step", "sgd_update", "adamw_update", "param",
                   "placeholder"})


class NotCyclic(Exception):
    """A plan splits a block-cyclic dim otherwise than over its one axis (see the module docstring)."""


def cyclic_ok(nodes, dim: str, v: int, mesh, axes, layout) -> bool:
    """Whether ``dim`` may be split block-cyclically over ``axes``, ``v`` blocks per rank: no written
    rule names it (a scoped one would split it otherwise), and every op of ``nodes`` (the backward's
    included) holding it reads its positions independently or sums over them, or is a reshape that
    cuts it into, or makes it from, parts the block-cyclic split carries."""
    if any(r.key[1] == dim for r in layout.rules):
        return False
    for n in nodes:
        if n.op.subgraphs(n) or not any(dim in t.shape.names for t in (*n.inputs, *n.outputs)):
            continue   # (a repeat: its block's ops are among the nodes)
        if n.op.name in ("reshape", "rearrange"):
            if not _regroups(n, dim, v, mesh, tuple(axes)):
                return False
        elif not (isinstance(n.op, (Unary, Nary, Reduce)) or n.op.name in _FREE) or dim in n.op.spec(n).fixed:
            return False
    return True


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


def store_cyclic(steps, values: dict, mesh, layout) -> list:
    """Every value of ``values`` (and of the sub-plans ``steps`` run) whose block-cyclic dim its
    axis splits, stored block-cyclically; ``steps`` with every collective that joins or cuts such a
    dim keeping the global order.  ``values`` is changed in place; the steps are returned.

    Raises:
      NotCyclic: a value splits such a dim over other axes.
    """
    cyclic = layout.cyclic_blocks
    if not cyclic:
        return list(steps)
    axis = {r.key[1]: r.axis_names for r, _ in layout.implied if r.key[1] in cyclic}
    _mark(values, cyclic, axis)
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


def _mark(values: dict, cyclic: dict, axis: dict) -> None:
    for vid, val in list(values.items()):
        sh = val.sharding
        for dim, v in cyclic.items():
            if dim not in val.shape.names or dim in sh.cyclic_blocks or not sh.axes_of(dim):
                continue
            if sh.axes_of(dim) != axis[dim]:
                raise NotCyclic(f"'{dim}' whole, not block-cyclic: a value splits it over "
                                f"{','.join(sh.axes_of(dim))}, not over {','.join(axis[dim])} alone")
            sh = sh.with_cyclic(dim, v)
        if sh is not val.sharding:
            values[vid] = dataclasses.replace(val, sharding=sh)
