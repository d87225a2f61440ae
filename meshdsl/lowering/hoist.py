"""A repeat's block work on loop-invariant tensors, made once before the loop.

A block reads tensors of the graph around it (:mod:`meshdsl.ir.closure`): a router weight, a
shared param, a norm's scale, a mask, an encoder's output.  Every layer reads them unchanged, so
a step of the block that reads only such values (or what such steps made of them) makes the same
value in every layer: a move (an allgather or an alltoall), a halo's permute (a conv or a sliding
window over a split dim of the tensor: the neighbours' rows), a reduction of a partial sum made of
them, and a local op (``h * exp(r)``'s ``exp(r)``, a norm's ``1 + g``: :mod:`meshdsl.ir.closure`
keeps the ops of a param in the block, for its gradient's sake, so they reach the plan per layer).
:func:`hoist_moves` takes those steps out of the block's sub-plan and makes them once in the plan
around the loop; the block reads each value it still needs of them as one more closed-over input
(``<name>@moved<k>`` for a copy made by moves only, ``<name>@made<k>`` for one an op computed),
forward and backward alike.  What a loop made is remembered (``lw.memo``, and
:meth:`.Lowerer.hold` for the moves): the backward loop's recompute of the same steps, or any
other re-layout of the tensor to that sharding, takes the forward's copy, so each is made once
per step, in a pipeline too (not per micro-batch or layer).  The gradient steps stay in the
block: they read the layer's cotangent.  A pipeline's backward loop takes only copies its forward
loop reads (an interleaved pipeline's chunks pass nothing else between stages) and makes the
others again itself (the forward read ``exp(r)`` gathered; the backward's ``exp`` stays).

Not hoisted: a random op (its stream is salted per layer), a step holding sub-plans (a nested
repeat), an op reading only the block's own constants (the block's own, as in
:mod:`meshdsl.ir.closure`), a step other than a move whose result is a backward block's output (a
gradient: the loop sums them; a forward block's, a saved activation, is stacked from the copy it
reads), and a local op whose result has
the examples' dim, unless a hoisted collective reads it (the strip a halo sends: the rest of the
halo's glue stays) and there is no pipeline (a stage would make it per micro-batch and send it
up the stages with the carry).

Memory rule: a copy lives from the forward loop to the end of the backward one instead of
through one layer, so the copies of one loop are taken while together they hold no more bytes
than the larger of the largest copy (one copy a layer makes at its peak anyway: FSDP gathers a
shared param in every layer, the backward's first layer while every saved activation is still
held) and what the loop keeps for its backward over the same span, its layers' inputs and saved
activations (``layers x (carry + saved)``, the memory report's ``saved_per_layer`` times the
layers one rank runs): the copies at most double that, and take no memory that grows with the
layers.  YOCO's one key and value, read by every cross layer, are both gathered once; under full
remat (the layer inputs alone kept) a tiny loop takes fewer.  Taken first, smallest first: copies
made by moves alone, then those whose making holds a collective, then a local op's (a collective
saved per layer is worth more than a kernel); a backward loop takes the copies its forward loop
made already before any other (no collective at all).  A copy a recurrence nested in the block
reads (an inner repeat's input gathered whole) is read again by the outer backward, which
recomputes the recurrence under every remat policy: where the loop's policy keeps that input
(``none``; ``selective`` or ``save:`` where it names the op making it), the copy is that saved
activation, made once instead of once per layer, and is held besides the budget (HAN's BiGRU:
both directions' gathered words; under ``full`` it is priced as any other copy).  A copy left
out leaves the step making it in the block (and what reads it); what that step reads is then
asked for instead.  No copy is stacked over the layers; a stacked param's per-layer gather is not
loop-invariant and stays in the block.

Gradients: the backward block may make a closed-over tensor's gradient at the sharding of the
copy the forward loop read (:func:`copy_read`), its partial sums kept, so the loop adds the
layers' up as the whole (gathered) value and the sum is reduced to the tensor's layout once after
the loop (one reduce-scatter, or none where its reader's own reduction takes it), not in every
layer: :mod:`.repeat` lowers the block so too and keeps it where that is cheaper and sends no
more bytes (a weight whose gradient the block makes split keeps it so).  The sum is one more
buffer of the copy's size through the backward loop.  Not in a pipeline.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch

from ..ir.closure import examples_of_graph
from ..layout.sharding import Sharding
from ..ops.registry import OPS
from .pipeline import MB_AXIS
from .plan import Plan, Step

#: Collective kinds that bring a value to another sharding, whole (no reduction, no halo).
_MOVES = frozenset({"allgather", "alltoall"})
#: Collective kinds that sum a partial value (one made of loop-invariant values is loop-invariant too).
_REDUCTIONS = frozenset({"allreduce", "reduce_scatter"})
#: Collective kinds a loop-invariant value's step may be: its moves, a halo's permute, a reduction.
_COLLECTIVES = _MOVES | _REDUCTIONS | {"permute"}


def hoist_moves(lw, node, plan: Plan, ins: list, closed: tuple, carry_bytes: int) -> tuple[Plan, list, tuple]:
    """Sub-plan ``plan`` without its steps of the closed-over inputs ``closed`` (names, whose
    values are the last ``len(closed)`` of the step's inputs ``ins``) alone, the steps made once
    in lowerer ``lw`` instead, for repeat node ``node``.

    Returns the new sub-plan, the step's inputs (the copies appended) and the closed-over
    input names (the copies' appended).
    """
    given = {plan.inputs[k]: ins[len(ins) - len(closed) + i] for i, k in enumerate(closed) if k in plan.inputs}
    # a forward block's outputs (per-layer outputs, saved activations) are stacked per layer: a
    # copy read back as one is stacked alike; a backward block's the loop sums (kept in the block)
    kept_in = set(plan.outputs.values()) if node.op.name == "repeat_grad" else set()
    made_by = _invariant_steps(plan, set(given), kept_in, examples_of_graph(node.graph), lw.pipeline_axis is not None)
    stay: set[int] = set()   # ids of steps made outside whose values the block makes again itself
    if node.op.name == "repeat_grad" and lw.pipeline_axis is not None:
        ends, made_by, stay = _forward_copies(lw, node, plan, given, made_by)
    else:
        held = set(_made_already(lw, node, plan, given, made_by)) if node.op.name == "repeat_grad" else set()
        rescanned = _rescanned(lw, node, plan, made_by, closed)
        ends, made_by = _kept(plan, made_by, carry_bytes, lw.mesh, _layers(lw, node), held, rescanned)
    if not ends:
        return plan, ins, closed
    outer = dict(given)   # block value -> the plan's value
    hoisted = [s for s in plan.steps if any(made_by.get(v) is s for v in s.outs)]
    for s in hoisted:
        _make_outside(lw, node, plan, s, outer)
    sources = [_source(plan, made_by, v, closed) for v in ends]
    if node.op.name == "repeat":
        lw.memo.setdefault(__name__ + ".fed", set()).update(outer[v] for v in ends)
    names = [f"{k}@{'moved' if _moves_only(made_by, v) else 'made'}{j}" for j, (k, v) in enumerate(zip(sources, ends))]
    dropped = [s for s in hoisted if id(s) not in stay]
    return _rewired(plan, ends, names, sources, dropped), [*ins, *(outer[v] for v in ends)], (*closed, *names)


def copy_read(lw, vid: int) -> Sharding | None:
    """The sharding of the copy of closed-over value ``vid`` that a forward loop read, made once
    before it by moves alone (:func:`hoist_moves`), or None (none, or several).

    A backward block may make that tensor's gradient there: its layers' partial sums of the whole
    (gathered) value are added up by the loop and reduced to the tensor's layout once after it, not
    reduce-scattered in every layer (YOCO's one key/value pair, read by every cross layer)."""
    fed = lw.memo.get(__name__ + ".fed", set())
    moved: dict[int, list] = {}   # value -> (sharding, copy) of each move of it made before a loop
    for key, _, hit in lw.memo.get(__name__, ()):
        if key[0] in _MOVES:
            moved.setdefault(key[3][0], []).append((key[4][0][2], hit[0]))
    todo, found = [vid], set()
    while todo:
        for sh, copy in moved.get(todo.pop(), ()):
            if copy in fed:
                found.add(sh)
            todo.append(copy)
    return next(iter(found)) if len(found) == 1 else None


def _may_leave(plan: Plan, s: Step, outputs: set[int]) -> bool:
    """Whether block step ``s``, reading only values the same in every layer, may be made before
    the loop: a move, a permute, a reduction (of a partial sum), a local op not random, and none
    but a move whose value is one of ``outputs`` (a backward block's: the gradients the loop sums)."""
    if s.subplans or (s.kind not in _MOVES and any(v in outputs for v in s.outs)):
        return False
    if s.is_collective:
        partial = plan.values[s.ins[0]].sharding.partial
        return (s.kind in _COLLECTIVES and len(s.ins) == len(s.outs) == 1 and MB_AXIS not in s.axes
                and (not partial or s.kind in _REDUCTIONS))
    return s.kind in ("local", "split") and not _reads_salt(s.op)


def _reads_salt(op: str) -> bool:
    """Whether a local step's kernel may read the run's salt (a random op: its stream differs per
    layer); a fused kernel (``a+b``) does when one of its parts does, an unknown one is taken to."""
    return any(OPS.get(p) is None or OPS[p].reads_salt for p in op.split("+"))


def _invariant_steps(plan: Plan, given: set[int], outputs: set[int], examples: str | None,
                     pipelined: bool) -> dict[int, Step]:
    """Value -> the block's step making it, for each value the same in every layer that a step may
    make once before the loop (the module's rules), in block order."""
    consts = {v for s in plan.steps if s.kind == "local" and not s.ins and not _reads_salt(s.op) for v in s.outs}
    wide: set[int] = set()   # ids of local steps with the examples' dim, hoisted only for a collective
    made_by: dict[int, Step] = {}
    for s in plan.steps:
        if not s.ins or not all(v in given or v in made_by or v in consts for v in s.ins) or \
                not any(v in given or v in made_by for v in s.ins) or not _may_leave(plan, s, outputs):
            continue
        if not s.is_collective and examples is not None and any(
                examples in plan.values[v].shape.names for v in s.outs):
            if pipelined:
                continue
            wide.add(id(s))
        made_by.update((v, s) for v in s.outs)
    return _without_wide(plan, made_by, wide)


def _without_wide(plan: Plan, made_by: dict[int, Step], wide: set[int]) -> dict[int, Step]:
    """``made_by`` without the local steps in ``wide`` that no kept collective reads (through
    other kept steps), nor any step reading what they made."""
    while True:
        needed: set[int] = set()
        for s in reversed(plan.steps):
            if any(made_by.get(v) is s for v in s.outs) and (s.is_collective or id(s) in needed):
                needed.update(id(made_by[v]) for v in s.ins if v in made_by)
        drop = {v for v, s in made_by.items() if id(s) in wide and id(s) not in needed}
        if not drop:
            return made_by
        made_by = _cut(plan, made_by, drop)


def _cut(plan: Plan, made_by: dict[int, Step], drop: set[int]) -> dict[int, Step]:
    """``made_by`` without the steps making the values ``drop``, nor the steps reading what they made."""
    gone = {id(made_by[v]) for v in drop}
    out: dict[int, Step] = {}
    for s in plan.steps:
        if not any(made_by.get(v) is s for v in s.outs):
            continue
        if id(s) not in gone and not any(v in made_by and v not in out for v in s.ins):
            out.update((v, s) for v in s.outs)
    return out


def _ends(plan: Plan, made_by: dict[int, Step], stay: frozenset = frozenset()) -> list[int]:
    """The hoisted values the block still reads (a step left in it, or its outputs), in block order;
    ``stay``: ids of the steps the block runs itself too (their values are no copies)."""
    hoisted = {id(s) for s in made_by.values()} - stay
    read = {v for s in plan.steps if id(s) not in hoisted for v in s.ins} | set(plan.outputs.values())
    return [v for v in made_by if v in read and id(made_by[v]) not in stay]


def _kept(plan: Plan, made_by: dict[int, Step], carry_bytes: int, mesh, layers: int,
          held: set[int] = frozenset(), saved: set[int] = frozenset()) -> tuple[list[int], dict[int, Step]]:
    """The copies the loop holds (the module's memory rule), in block order, and ``made_by``
    without the steps whose copies it does not hold (nor what reads them).  ``saved``: copies
    the remat policy keeps for the backward (:func:`_rescanned`), held besides the budget.  Taken
    first: the copies an earlier loop made already (``held``: a backward loop reads the forward's,
    no collective at all), then those made by moves alone, then those whose making holds a
    collective, then the rest (a local op's), each smallest first: a collective saved per layer is
    worth more than a kernel."""
    ends = _ends(plan, made_by)
    if not ends:
        return [], {}
    size = {v: plan.values[v].local_bytes(mesh) for v in ends if v not in saved}
    # one copy a layer makes at its peak anyway, or no more than what the loop keeps for its backward
    budget = max(max(size.values(), default=0), layers * (carry_bytes + _saved_bytes(plan, mesh)))
    while True:
        size = {v: plan.values[v].local_bytes(mesh) for v in ends}
        total, kept = 0, {v for v in ends if v in saved}
        for v in sorted(set(ends) - kept, key=lambda v: (v not in held, _rank(made_by, v), size[v], ends.index(v))):
            if total + size[v] <= budget:
                total += size[v]
                kept.add(v)
        if len(kept) == len(ends):
            return ends, made_by
        made_by = _cut(plan, made_by, {v for v in ends if v not in kept})
        ends = _ends(plan, made_by)


def _layers(lw, node) -> int:
    """The layers repeat ``node`` runs on one rank (a pipeline's stage runs its share; a stack the
    pipeline leaves whole is counted so too: the rule errs towards fewer copies)."""
    stages = lw.mesh.axis_size((lw.pipeline_axis,)) if lw.pipeline_axis is not None else 1
    return max(1, node.attrs["layer"].size // stages)


def _saved_bytes(plan: Plan, mesh) -> int:
    """Bytes one layer of the loop keeps for its backward: a forward block's saved activations
    (its ``saved/...`` outputs, stacked over the layers), or those a backward block is given."""
    if any(s.kind == "input" and s.op == "saved" for s in plan.steps):
        vids = [v for s in plan.steps if s.kind == "input" and s.op == "saved" for v in s.outs]
    else:
        vids = [v for k, v in plan.outputs.items() if k.startswith("saved/")]
    return sum(plan.values[v].local_bytes(mesh) for v in set(vids))


def _rank(made_by: dict[int, Step], v: int) -> int:
    """0: value ``v`` is made by moves alone; 1: its making holds a collective; 2: local ops only."""
    if _moves_only(made_by, v):
        return 0
    todo, seen = [v], set()
    while todo:
        x = todo.pop()
        if x in made_by and x not in seen:
            seen.add(x)
            if made_by[x].is_collective:
                return 1
            todo.extend(made_by[x].ins)
    return 2


def _make_outside(lw, node, plan: Plan, s: Step, outer: dict) -> None:
    """Make block step ``s``'s values in the plan around the loop (``outer``: block value -> the
    plan's), or take the copies made already (by the forward loop, for the backward)."""
    for v in s.ins:   # a constant of the block: made outside too
        if v not in outer:
            _make_outside(lw, node, plan, _producer(plan, v), outer)
    hit = _taken(lw, node, plan, s, outer)
    if hit is None:
        src, vals = [outer[v] for v in s.ins], [plan.values[v] for v in s.outs]
        hit = tuple(lw.new_value(v.shape, v.dtype, v.sharding) for v in vals)
        what = "moved" if s.is_collective else "made"
        why = f"{what} once before repeat '{node.name}' (every layer reads it)" + (
            f": {s.note or s.kind}" if s.is_collective or s.note else "")
        lw.emit(s.kind, node, src, hit, s.axes, dict(s.args), s.bytes, s.flops, note=why, op=s.op, label=s.label)
        if s.kind in _MOVES:   # held: a later re-layout of the tensor to this sharding takes the copy
            _hold(lw, src[0], vals[0].sharding, hit[0])
        lw.memo.setdefault(__name__, []).append((_key(s, src, vals), s.args, hit))
    outer.update(zip(s.outs, hit))


def _taken(lw, node, plan: Plan, s: Step, outer: dict) -> tuple | None:
    """The plan's values block step ``s`` would make, made already (by an earlier loop), or None."""
    src = [outer.get(v) for v in s.ins]
    if None in src:
        return None
    vals = [plan.values[v] for v in s.outs]
    key = _key(s, src, vals)
    hit = next((outs for k, args, outs in lw.memo.get(__name__, ()) if k == key and _same(args, s.args)), None)
    if hit is None and s.kind in _MOVES and lw.relaid(src[0], vals[0].sharding):
        hit = (lw.relayout(src[0], vals[0].sharding, node),)
    return hit


def _forward_copies(lw, node, plan: Plan, given: dict, made_by: dict) -> tuple[list[int], dict, set[int]]:
    """A pipeline's backward block: the copies it takes, only those a forward loop reads already
    (an interleaved pipeline cuts both loops into the same chunks, which pass nothing else
    between stages), so no memory is added; ``made_by`` cut to the steps a forward loop made;
    and the ids of those the block makes again itself (a value the forward read only moved).
    Returns ``(ends, made_by, stay)``."""
    outer = _made_already(lw, node, plan, given, made_by)
    made_by = _cut(plan, made_by, {v for v in made_by if outer.get(v) is None})
    fed, stay = lw.memo.get(__name__ + ".fed", set()), set()
    while True:
        ends = _ends(plan, made_by, frozenset(stay))
        unfed = {id(made_by[v]) for v in ends if outer.get(v) not in fed}
        if not unfed:
            return ends, made_by, stay
        stay |= unfed


def _made_already(lw, node, plan: Plan, given: dict, made_by: dict) -> dict[int, int]:
    """Block value -> the plan's value, for each value of ``made_by`` an earlier loop made already
    before it (the forward's copies, which a backward loop takes: :func:`_taken`)."""
    outer, taken = dict(given), {}
    for s in plan.steps:
        if not any(made_by.get(v) is s for v in s.outs):
            continue
        for v in s.ins:   # constants: the forward made them too where it hoisted their readers
            if v not in outer and v not in made_by:
                c = _producer(plan, v)
                outer.update(zip(c.outs, _taken(lw, node, plan, c, outer) or (None,) * len(c.outs)))
        hit = _taken(lw, node, plan, s, outer)
        outer.update(zip(s.outs, hit or (None,) * len(s.outs)))
        taken.update((v, outer[v]) for v in s.outs if hit is not None)
    return taken


def _rescanned(lw, node, plan: Plan, made_by: dict, closed: tuple) -> set[int]:
    """The copies of ``made_by`` a recurrence nested in the block reads (an inner repeat's step),
    made by moves alone from a closed-over tensor that the remat policy of the loop's backward
    saves (:func:`_policy_saves`).  The outer backward recomputes a nested repeat under every
    policy, reading its inputs as the forward did; an input made in the block is saved gathered
    (:mod:`.saved_copies`), and one read from outside is the same in every layer: its copy, held
    from the forward loop to the backward's end, is that saved activation made once, so it is kept
    besides the memory rule's budget (HAN's BiGRU: both directions' gathered words)."""
    policies = _backward_policies(lw, node)
    if not policies:
        return set()
    tensors = dict(zip(closed, node.inputs[len(node.inputs) - len(closed):]))
    of_input = {plan.inputs[k]: t for k, t in tensors.items() if k in plan.inputs}
    scans = {v for s in plan.steps if s.kind == "repeat" for v in s.ins}
    out = set()
    for v in made_by:
        if v in scans and _moves_only(made_by, v):
            t = of_input.get(_origins(made_by, v)[0])
            if t is not None and any(_policy_saves(p, t) for p in policies):
                out.add(v)
    return out


def _backward_policies(lw, node) -> list:
    """The remat policies of the backward loops of repeat ``node`` this plan runs: a backward
    block's own; a forward repeat's, those of its gradients that some output reads (none when
    nothing differentiates it)."""
    if node.op.name == "repeat_grad":
        return [node.attrs["block"].extra["remat"]]
    return [g.attrs["block"].extra["remat"] for g in node.graph.nodes
            if g.op.name == "repeat_grad" and g.inputs and g.inputs[0] is node.outputs[1]
            and any(id(t) in lw.used for t in g.outputs)]


#: Ops that lay a tensor out anew (no arithmetic): a policy saving their input saves them (as :func:`chosen`).
_LAYOUT_OPS = frozenset({"transpose", "rename", "reshape", "rearrange"})


def _policy_saves(policy, t) -> bool:
    """Whether ``policy`` keeps tensor ``t`` for the backward, were it an activation of the block:
    ``none`` keeps all; otherwise the outputs of the ops it names, and what ops that only lay one
    out anew make of it (:func:`~meshdsl.ir.remat.chosen` saves a cheap op's output no larger in
    place of the saved op's)."""
    while policy.save is not None and t.node.op.name not in policy.save:
        if t.node.op.name not in _LAYOUT_OPS or not t.node.inputs:
            return False
        t = t.node.inputs[0]
    return True


def _producer(plan: Plan, v: int) -> Step:
    """The step of ``plan`` making value ``v`` (a constant the hoisted steps read)."""
    return next(t for t in plan.steps if v in t.outs)


def _hold(lw, src: int, to, copy: int) -> None:
    """Record ``copy`` as value ``src`` at sharding ``to``, and as what ``src`` was moved from at
    it too (a chain of moves over two axes: a later re-layout of the tensor takes the copy)."""
    seen = set()
    while src is not None and src not in seen:
        seen.add(src)
        lw.hold(src, to, copy)
        src = lw.cut_from(src)


def _key(s: Step, src: list[int], vals: list) -> tuple:
    """What a step made outside must agree on to be taken again (besides its args)."""
    return (s.kind, s.op, s.axes, tuple(src), tuple((v.shape, v.dtype, v.sharding) for v in vals))


def _same(a, b) -> bool:
    """Whether two steps' args (kernels, attrs, tensors among them) are the same."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and a.device == b.device and bool(torch.equal(a, b)))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):
        return False


def _origins(made_by: dict[int, Step], v: int) -> list[int]:
    """The values outside ``made_by`` that value ``v`` is made from (closed-over inputs, constants)."""
    todo, seen, out = [v], set(), []
    while todo:
        x = todo.pop()
        if x in seen:
            continue
        seen.add(x)
        if x in made_by:
            todo.extend(reversed(made_by[x].ins))
        else:
            out.append(x)
    return out


def _moves_only(made_by: dict[int, Step], v: int) -> bool:
    """Whether value ``v`` is a closed-over input brought to another sharding by moves alone."""
    while v in made_by:
        if made_by[v].kind not in _MOVES:
            return False
        v = made_by[v].ins[0]
    return True


def _source(plan: Plan, made_by: dict, v: int, closed: tuple) -> str:
    """The first closed-over input name value ``v`` is made from."""
    given = set(_origins(made_by, v))
    return next(k for k in closed if plan.inputs.get(k) in given)


def _rewired(plan: Plan, ends: list[int], names: list[str], sources: list[str], hoisted: list[Step]) -> Plan:
    """``plan`` without the ``hoisted`` steps (and constants only they read), each kept end an
    input named as ``names`` say, fed like its closed-over input (``sources``)."""
    gone = {id(s) for s in hoisted}
    read = {v for s in plan.steps if id(s) not in gone for v in s.ins} | set(plan.outputs.values())
    gone |= {id(s) for s in plan.steps if s.kind == "local" and not s.ins and not any(v in read for v in s.outs)}
    at = next((i for i, s in enumerate(plan.steps) if s.kind != "input"), len(plan.steps))
    head, tail = list(plan.steps[:at]), [s for s in plan.steps[at:] if id(s) not in gone]
    feeds = {s.args.get("name"): s for s in plan.steps if s.kind == "input"}
    fed = [replace(feeds[k], ins=(), outs=(v,), args={"name": n, "tensor": feeds[k].args["tensor"]},
                   note="made once before the loop") for v, n, k in zip(ends, names, sources)]
    return replace(plan, steps=[*head, *fed, *tail], inputs={**plan.inputs, **dict(zip(names, ends))})
