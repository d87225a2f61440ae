"""Values each rank can make itself (from nothing, or from whole values), made again at another
sharding rather than moved.

A constant or an iota reads no input: each rank makes its own part of it at any layout.  So does
a value whose whole ancestry is such steps and generic local steps over them (a rotary table's
``cos(arange(seq) * inv_freq)``, a causal mask compared from two iotas): where a reader needs it
at another sharding (the table renamed ``seq`` -> ``key_seq`` under ``seq:model``, read whole by
the keys), each rank recomputes its part there, ancestry and all, instead of receiving it (that
table was allgathered).  The :class:`~.compiler.Lowerer` records each such step as it is emitted
(:func:`made_from_nothing`) and :meth:`~.compiler.Lowerer.relayout` asks :func:`remake` first.

A generic step whose inputs are whole (every rank holds them: an expert-choice dispatch's one-hot
of a top-k gathered over ``seq``) is recorded too: each rank can make any part of its value from
what it holds.  Such a value is made again only where its compute costs less than the move
(:func:`remake_cost`), which the generic rule also prices, so that an einsum reading the one-hot
``[.., seq]`` made split by ``seq:model`` sees it whole for the price of a one-hot, and gathers the
other, smaller, operand rather than reducing its larger result.
"""
from __future__ import annotations

import dataclasses

from ..layout.sharding import Sharding
from .generic import lower_generic, op_flops
from .plan import step_args
from .relayout import relayout_cost
from .rules import rule_for

# ops whose local step reads nothing: each rank makes its own part of the value at any layout
INPUT_FREE = frozenset({"constant", "iota"})


def made_from_nothing(lw, node, step) -> bool:
    """Whether local ``step`` (of ``node``) makes its one value from nothing: an iota or a constant,
    or a generic step (one local kernel per node, :mod:`.generic`) of a deterministic op whose
    inputs are all made so or whole, split only along its output's dims (no partial sum, no max
    over a split dim: the step's result is then the value itself), none of its values a partial sum."""
    if len(step.outs) != 1:
        return False
    if not step.ins:
        return step.op in INPUT_FREE
    if not all(v in lw.made_from_nothing or not lw.values[v].sharding.used_axes for v in step.ins):
        return False
    if node is None or node.op.reads_salt or len(node.outputs) != 1 or rule_for(node.op.name) is not lower_generic:
        return False
    values = [lw.values[v] for v in (*step.ins, *step.outs)]
    if any(v.sharding.partial or v.sharding.parts or v.sharding.cyclic for v in values):
        return False
    spec = node.op.spec(node)
    out_dims = {spec.out_rename.get(n, n) for n in node.outputs[0].shape.names}
    return all(d in out_dims for d, axes in step.args["compute"].items() if axes)


def remakeable(lw, vid: int, to: Sharding) -> bool:
    """Whether :func:`remake` can make value ``vid`` at ``to`` with no collective on the way: every
    step of its ancestry is made from nothing and may run at the sharding asked of it."""
    made = lw.made_from_nothing.get(vid)
    if made is None or to.partial:
        return False
    step, node = made
    if not step.ins:
        return True
    if to.parts or to.cyclic or to.blocks:
        return False
    spec = node.op.spec(node)
    compute = {spec.out_rename.get(n, n): axes for n, axes in to.split.items()}
    if set(compute) & spec.fixed:
        return False
    for u in step.ins:
        r = Sharding.of(lw.values[u].shape, compute)
        if r != lw.values[u].sharding and not lw.relaid(u, r) and not remakeable(lw, u, r):
            return False
    return True


def remake_cost(lw, vid: int, to: Sharding) -> float | None:
    """Seconds :func:`remake` takes to make value ``vid`` at ``to`` (the compute of the steps it
    runs again; cutting a whole input is free), or None where it cannot."""
    if not remakeable(lw, vid, to):
        return None
    step, node = lw.made_from_nothing[vid]
    if not step.ins:
        return lw.cost.compute(step.flops)
    spec = node.op.spec(node)
    compute = {spec.out_rename.get(n, n): axes for n, axes in to.split.items()}
    mesh = lw.mesh
    cost = lw.cost.compute(op_flops(node, {d: -(-size // mesh.axis_size(compute.get(d, ())))
                                           for d, size in spec.dims.items()}))
    for u in step.ins:
        v = lw.values[u]
        r = Sharding.of(v.shape, compute)
        if r != v.sharding and not lw.relaid(u, r) and v.sharding.used_axes:
            cost += remake_cost(lw, u, r)
    return cost


def _pays(lw, vid: int, to: Sharding) -> bool:
    """Whether making value ``vid`` again at ``to`` pays: always for a value made from nothing (its
    tables are small), where it reads a whole value only if it costs less than moving it there
    (a cut of it, free, is no reason to run its steps again)."""
    if next(_leaves(lw, vid), None) is None:
        return True
    v = lw.values[vid]
    return remake_cost(lw, vid, to) < relayout_cost(v.shape, v.sharding, to, lw.mesh, v.dtype.itemsize, lw.cost)


def _leaves(lw, vid: int):
    """The values the steps that made ``vid`` (as :func:`remake` would run them again) read."""
    step, _ = lw.made_from_nothing[vid]
    for u in step.ins:
        if u in lw.made_from_nothing:
            yield from _leaves(lw, u)
        else:
            yield u


def remake(lw, vid: int, to: Sharding, why: str) -> int | None:
    """Value ``vid`` made again at sharding ``to`` by the steps that made it from nothing (its
    inputs first, each at the sharding the step reads it at then), or None where it was made
    otherwise or ``to`` is a partial sum (see the module docstring)."""
    made = lw.made_from_nothing.get(vid)
    v = lw.values[vid]
    if made is None or to.partial or v.sharding.partial:
        return None
    step, node = made
    if not step.ins:   # an iota or a constant: its split is its compute's
        compute, ins, flops = to.split, (), step.flops
    else:
        if not remakeable(lw, vid, to) or not _pays(lw, vid, to):
            return None
        spec = node.op.spec(node)
        compute = {spec.out_rename.get(n, n): axes for n, axes in to.split.items()}
        ins = tuple(lw.relayout(u, Sharding.of(lw.values[u].shape, compute), node, why) for u in step.ins)
        mesh = lw.mesh
        flops = op_flops(node, {d: -(-size // mesh.axis_size(compute.get(d, ()))) for d, size in spec.dims.items()})
    out = lw.new_value(v.shape, v.dtype, to)
    args = {k: a for k, a in step.args.items() if k != "parts"}
    again = dataclasses.replace(step, ins=ins, outs=(out,), flops=flops,
                                args=step_args("local", {**args, "compute": compute}))
    lw.steps.append(again)
    lw.made_from_nothing[out] = (again, node)
    return out
