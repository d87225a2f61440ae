"""Values computed from params alone, offered their params' layout.

A weight normalised in the graph (nGPT's ``w * rsqrt(reduce_sum(w * w, "d_model"))``), a weight
standardised or quantised by its mean magnitude (BitNet), a LoRA merge ``w + a @ b``: each is
computed from params (and constants) only, yet its own layout target is an activation's (no scope:
under FSDP, ``params.d_model:data``, its ``d_model`` is whole), so every op of such a chain
gathered its result at once: ``w * w`` gathered for the sum, then the normalised weight again.
Here such a value (:func:`param_scopes`), read by one op, is also offered the layout its params'
scoped rules give it, as a further target after its own: the generic rule's cost model chooses, so
the chain may run split and be gathered once, where a reader needs it whole (the small row sums
allreduced on the way), a gathered copy freed after its readers as any other.  A value with a dim
no param of its chain holds (a class token broadcast over the batch) is an activation: not offered.

The choice is greedy, op by op, so it may split a gather into more (a depthwise conv's taps: each
tap's product kept split and gathered again): a plan whose lowering offered such a target is
lowered again without (:func:`offering`), and the one kept is the cheaper by the cost model that
sends no more bytes in no more collectives (:func:`better`).  A layer's backward block offers none
(:func:`offers`): its recompute's params are read whole anyway by their gradients' einsums
(gathered once, foreseen), so there the chain computed whole from them sends least (split, it
would add the row sums' allreduce per layer).  The backward is lowered as before: the partial
sums of the chain's gradient pass on lazily to the param's reduce-scatter (:mod:`.lazy_grads`).

Random ops (their stream depends on where they run) and repeats (their outputs are per layer)
end a chain; a value read into a block from outside keeps the scopes it was given there.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar

#: leaves: a param (or a block's placeholder of one) starts a chain, any other ends it
LEAVES = frozenset({"param", "input", "placeholder"})


def _is_param(t) -> bool:
    """Whether tensor ``t`` is a param, or a repeat block's placeholder of one (its layer's slice)."""
    return t.node.op.name in ("param", "placeholder") and "params" in t.scopes


def param_scopes(nodes, known: dict[int, tuple]) -> dict[int, tuple]:
    """``id(tensor) -> (scopes, dims)`` of each output of ``nodes`` (in topological order) computed
    from params alone, beyond ``known`` (an earlier call's, whose entries it extends): the scopes of
    its params (each param's name, then ``params``), in the order they are first read, and the dims
    its params hold.  A value with no param in its ancestry (a constant, an iota) is not listed but
    does not spoil one made with it; a value with a dim none of its params holds (a param broadcast
    over the batch, a class token) is an activation, not a param's, and ends the chain."""
    out = dict(known)
    free: set[int] = set()   # ids of values made from nothing (constants, iotas and ops of them)
    for n in nodes:
        for t in (*n.inputs, *n.outputs):   # (a block's params are bound before it is lowered: inputs only)
            if id(t) not in out and _is_param(t):
                out[id(t)] = (t.scopes, frozenset(t.shape.names))
        if any(id(t) in out for t in n.outputs):
            continue
        if n.op.name in LEAVES or n.op.reads_salt or n.op.subgraphs(n):
            continue
        if all(id(t) in free for t in n.inputs):
            free.update(id(t) for t in n.outputs)
            continue
        if not all(id(t) in out or id(t) in free for t in n.inputs):
            continue
        scopes: list[str] = []
        dims: frozenset = frozenset()
        for t in n.inputs:
            s_in, d_in = out.get(id(t), ((), frozenset()))
            scopes += [s for s in s_in if s not in scopes]
            dims |= d_in
        scopes.sort(key=lambda s: s == "params")   # the params' own names first (stable)
        for t in n.outputs:
            if not t.scopes and set(t.shape.names) <= dims:   # (a tensor given scopes of its own keeps them)
                out[id(t)] = (tuple(scopes), dims)
    return out


class _Offer:
    """Whether a lowering offers params' layouts (:func:`with_param_targets`), and whether it did."""
    __slots__ = ("on", "offered")

    def __init__(self, on: bool):
        self.on, self.offered = on, False


_OFFER: ContextVar[_Offer | None] = ContextVar("meshdsl_param_targets", default=None)


@contextlib.contextmanager
def offering(on: bool):
    """Lower (a plan and its blocks' sub-plans) offering params' layouts or not; yields the record
    whose ``offered`` says whether some value was offered one."""
    rec = _Offer(on)
    token = _OFFER.set(rec)
    try:
        yield rec
    finally:
        _OFFER.reset(token)


def better(new, old, cheaper) -> bool:
    """Whether lowerer ``new`` is worth keeping over ``old``: ``cheaper(new, old)`` (the cost
    model's time, no more bytes) and no more collectives (those of sub-plans as often as they run)."""
    return cheaper(new, old) and _num_collectives(new.steps) <= _num_collectives(old.steps)


def _num_collectives(steps) -> int:
    return sum(s.is_collective + sum(s.runs(k) * _num_collectives(sub.steps) for k, sub in enumerate(s.subplans))
               for s in steps)


def offers(lw, nodes) -> bool:
    """Whether lowerer ``lw``, lowering ``nodes``, offers params' layouts: not in a layer's backward
    block (see the module docstring)."""
    return not (lw.in_block and any(n.phase != "forward" for n in nodes))


def with_param_targets(layout, t, own: list, scopes: tuple[str, ...], mesh) -> list:
    """``own`` (the targets of tensor ``t``'s own scopes) followed by those its params' ``scopes``
    give it that ``own`` lacks, as alternatives the cost model may choose; ``own`` alone where
    the lowering under way (:func:`offering`) offers none."""
    rec = _OFFER.get()
    if rec is None or not rec.on:
        return own
    seen = {sh for sh, _ in own}
    extra = [(sh, note) for sh, note in layout.targets(t.shape, scopes, mesh, t.name, False) if sh not in seen]
    rec.offered |= bool(extra)
    return own + extra
