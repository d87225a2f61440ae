"""A repeat's saved activations, also saved as the forward block re-laid them out.

The forward block of a repeat often moves an activation it saves for the backward: Soft MoE's
slots go batch->experts (an alltoall) for the experts' MLP, and back for the combine.  The
backward reads the saved activation in those moved layouts too.  Given only the activation as
the forward made it, the backward repeated each exchange, every layer (6 alltoalls a layer where
4 do).  So the forward step also outputs, stacked over the layers, each copy it already made of a
saved activation that costs no more memory than the activation (:func:`worth_saving`), named
``saved/<i>@<k>``; the backward step takes them as inputs, and its sub-plan holds them as the
saved activation re-laid out (:meth:`.Lowerer.hold`): a reader that needs one reads it, no
collective.  The copies the backward does not read leave both steps (:func:`drop_unread`).

Under remat the backward recomputes what the policy does not save, and no copy is saved of that.
The memory report counts each copy with the saved activations (``args["saved"]``).
"""
from __future__ import annotations

from dataclasses import replace

from ..layout.sharding import Sharding
from .compiler import Lowerer
from .plan import Plan, step_args

#: ``lw.memo`` key (with a saved activation's id): the stacked re-laid copies the forward step saved of it.
COPIES = "saved copies"


def record(lw: Lowerer, t, vid: int) -> None:
    """Note that the forward step outputs stacked value ``vid``, a re-laid copy of saved activation ``t``."""
    lw.memo.setdefault((COPIES, id(t)), []).append(vid)


def copies_of(lw: Lowerer, t) -> list[int]:
    """The stacked re-laid copies of saved activation ``t`` the forward step outputs (:func:`record`)."""
    return list(lw.memo.get((COPIES, id(t)), ()))


def worth_saving(sub: Lowerer, vid: int) -> list[Sharding]:
    """The shardings the forward block already brought saved value ``vid`` to (an einsum's
    operand moved by an alltoall) that the forward saves too, so a backward reading it there
    takes the copy instead of repeating the exchange: those whose local part is no larger
    than the value's own (an alltoall's, a further split's).  Memory against bytes: such a
    copy costs at most the activation's own size per layer and saves at least that many bytes
    each way per layer; a gathered copy (an allgather's, ``n`` times the memory) is not kept,
    the backward gathers again.  Copies the backward does not read are dropped from the
    forward step after it is lowered (:func:`drop_unread`)."""
    v, mesh = sub.values[vid], sub.mesh
    own = v.sharding.local_numel(v.shape, mesh)
    return sorted((to for to in sub.held(vid) if not to.partial and to.local_numel(v.shape, mesh) <= own),
                  key=str)


def drop_unread(lw: Lowerer, loop, plan: Plan, ins: list, names: list[str]) -> tuple:
    """``(plan, ins, names)`` without the saved copies the backward sub-plan ``plan`` does not
    read, each dropped from the forward step that saves it too (it keeps those read)."""
    read = {v for s in plan.steps for v in s.ins}
    at = len(ins) - len(loop.closed) - len(loop.copies)
    unread = {n for n in names[len(names) - len(loop.copies):] if plan.inputs[n] not in read}
    if not unread:
        return plan, ins, names
    gone = [v for n, v in zip(names[len(names) - len(loop.copies):], ins[at:]) if n in unread]
    for i, s in enumerate(lw.steps):   # the forward step: its outputs end with its saved values, in order
        if s.kind == "repeat" and not s.args["backward"] and set(gone) & set(s.outs):
            first = len(s.outs) - len(s.args["saved"])
            keep = [k for k, v in enumerate(s.outs[first:]) if v not in gone]
            sub = s.subplans[0]
            kept = [s.args["saved"][k] for k in keep]
            outputs = {n: v for n, v in sub.outputs.items() if not n.startswith("saved/") or n in kept}
            lw.steps[i] = replace(s, outs=s.outs[:first] + tuple(s.outs[first + k] for k in keep),
                                  args=step_args("repeat", {**s.args, "saved": tuple(kept)}),
                                  subplans=(replace(sub, outputs=outputs),))
    for key, vids in lw.memo.items():
        if isinstance(key, tuple) and key[0] == COPIES:
            vids[:] = [v for v in vids if v not in gone]
    steps = [s for s in plan.steps if not (s.kind == "input" and s.args.get("name") in unread)]
    plan = replace(plan, steps=steps, inputs={n: v for n, v in plan.inputs.items() if n not in unread})
    return (plan, [v for k, v in enumerate(ins) if not (k >= at and v in gone)],
            [n for n in names if n not in unread])