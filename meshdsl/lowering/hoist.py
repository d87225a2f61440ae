"""A repeat's block moves of loop-invariant tensors, made once before the loop.

A block reads tensors of the graph around it (:mod:`meshdsl.ir.closure`): a router weight, a
shared param, a mask.  Every layer reads them unchanged, so a collective that only moves one of
them (an allgather or an alltoall, of the closed-over input or of what such moves made of it)
sends the same bytes in every layer.  :func:`hoist_moves` takes those moves out of the block's
sub-plan and makes them once in the plan around the loop; the block reads the moved copy as one
more closed-over input (``<name>@moved<k>``), forward and backward alike.  The copy is held
(:meth:`.Lowerer.hold`): the backward loop, or any other reader of the tensor at that sharding,
takes the forward's copy, so it is made once per step, in a pipeline too (not per micro-batch or
layer; an interleaved pipeline's chunks need the backward to read only what the forward does).

Not loop-invariant, so never hoisted: a reduction (a partial sum is made per layer: the
closed-over inputs are fed whole), and anything that reads what a layer computed.  Not hoisted
either: a move of a value the block computes from closed-over tensors only (a softmax of a
router param: :mod:`meshdsl.ir.closure` keeps ops of params in the block), since the local step
making it runs per layer; nor a halo's permute (neighbours' rows, no sharding of the value).

Memory rule: a copy lives from the forward loop to the end of the backward one instead of
through one layer, so the copies of one loop are taken smallest first while together they hold
no more bytes than the larger of one layer's carry and the largest copy: one copy a layer makes
at its peak anyway (FSDP gathers a shared param in every layer, the backward's first layer while
every saved activation is still held), or several no larger than one more layer input.  A
stacked param's per-layer gather is not loop-invariant and stays in the block.
"""
from __future__ import annotations

from dataclasses import replace

from .plan import Plan, Step

#: Collective kinds that bring a value to another sharding, whole (no reduction, no halo).
_MOVES = frozenset({"allgather", "alltoall"})


def hoist_moves(lw, node, plan: Plan, ins: list, closed: tuple, carry_bytes: int) -> tuple[Plan, list, tuple]:
    """Sub-plan ``plan`` without its moves of the closed-over inputs ``closed`` (names, whose
    values are the last ``len(closed)`` of the step's inputs ``ins``), the moves made once in
    lowerer ``lw`` instead, for repeat node ``node``.

    Returns the new sub-plan, the step's inputs (the copies appended) and the closed-over
    input names (the copies' appended).
    """
    given = {plan.inputs[k]: ins[len(ins) - len(closed) + i] for i, k in enumerate(closed) if k in plan.inputs}
    chain = _invariant_moves(plan, set(given))
    frontier = _frontier(plan, chain)
    ends = _kept(plan, frontier, carry_bytes, lw.mesh)
    if not ends:
        return plan, ins, closed
    made_by = {s.outs[0]: s for s in chain}
    # the block drops the moves to its kept ends, but those a move it keeps in the block needs
    drop = _path(made_by, ends, set()) - _path(made_by, [v for v in frontier if v not in ends], set())
    outer = dict(given)   # block value -> the plan's value
    for v in ends:   # a copy made already (the forward loop's, for the backward): taken as it is
        src, to = outer[_start(made_by, v)], plan.values[v].sharding
        if lw.relaid(src, to):
            outer[v] = lw.relayout(src, to, node)
    need = _path(made_by, ends, set(outer))   # the moves each end not made yet needs
    for s in chain:
        if id(s) in need:
            v = plan.values[s.outs[0]]
            outer[s.outs[0]] = lw.new_value(v.shape, v.dtype, v.sharding)
            why = f"moved once before repeat '{node.name}' (every layer reads it): {s.note or s.kind}"
            lw.emit(s.kind, node, [outer[s.ins[0]]], [outer[s.outs[0]]], s.axes, dict(s.args), s.bytes,
                    note=why, op=s.op, label=s.label)
    for v in ends:   # held: a later re-layout of the tensor to the same sharding takes the copy
        lw.hold(outer[_start(made_by, v)], plan.values[v].sharding, outer[v])
    sources = [_source(plan, made_by, v, closed) for v in ends]
    names = [f"{k}@moved{j}" for j, k in enumerate(sources)]
    return _rewired(plan, ends, names, sources, drop), [*ins, *(outer[v] for v in ends)], (*closed, *names)


def _invariant_moves(plan: Plan, invariant: set[int]) -> list[Step]:
    """The block's collectives that only move a loop-invariant value (a closed-over input, or
    what such a move made), in block order."""
    out = []
    for s in plan.steps:
        if (s.kind in _MOVES and len(s.ins) == 1 and len(s.outs) == 1 and s.ins[0] in invariant
                and not plan.values[s.ins[0]].sharding.partial):
            invariant.add(s.outs[0])
            out.append(s)
    return out


def _frontier(plan: Plan, chain: list[Step]) -> list[int]:
    """The moved values something else than another hoisted move reads (or the block outputs)."""
    chained = {id(s) for s in chain}
    read = {v for s in plan.steps if id(s) not in chained for v in s.ins} | set(plan.outputs.values())
    return [s.outs[0] for s in chain if s.outs[0] in read]


def _kept(plan: Plan, ends: list[int], carry_bytes: int, mesh) -> list[int]:
    """The ends whose copies the loop holds (the module's memory rule), in block order."""
    if not ends:
        return []
    size = {v: plan.values[v].local_bytes(mesh) for v in ends}
    budget, total, kept = max(carry_bytes, max(size.values())), 0, set()
    for v in sorted(ends, key=lambda v: size[v]):
        if total + size[v] <= budget:
            total += size[v]
            kept.add(v)
    return [v for v in ends if v in kept]


def _path(made_by: dict, ends: list[int], made: set) -> set[int]:
    """``id`` of each move on the way to ``ends`` (back to a value in ``made`` or a closed-over input)."""
    out = set()
    for v in ends:
        while v in made_by and v not in made:
            out.add(id(made_by[v]))
            v = made_by[v].ins[0]
    return out


def _start(made_by: dict, v: int) -> int:
    """The closed-over input value ``v`` was moved from."""
    while v in made_by:
        v = made_by[v].ins[0]
    return v


def _source(plan: Plan, made_by: dict, v: int, closed: tuple) -> str:
    """The closed-over input name value ``v`` was moved from."""
    return next(k for k in closed if plan.inputs.get(k) == _start(made_by, v))


def _rewired(plan: Plan, ends: list[int], names: list[str], sources: list[str], drop: set[int]) -> Plan:
    """``plan`` without the hoisted moves, each kept end an input named as ``names`` say, fed
    like its closed-over input (``sources``)."""
    at = next((i for i, s in enumerate(plan.steps) if s.kind != "input"), len(plan.steps))
    head, tail = list(plan.steps[:at]), [s for s in plan.steps[at:] if id(s) not in drop]
    feeds = {s.args.get("name"): s for s in plan.steps if s.kind == "input"}
    fed = [replace(feeds[k], ins=(), outs=(v,), args={"name": n, "tensor": feeds[k].args["tensor"]},
                   note="moved once before the loop") for v, n, k in zip(ends, names, sources)]
    return replace(plan, steps=[*head, *fed, *tail], inputs={**plan.inputs, **dict(zip(names, ends))})
