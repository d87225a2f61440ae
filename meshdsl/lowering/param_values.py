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
would add the row sums' allreduce per layer).

The backward's gradients of such a chain are offered their params' layout too
(:func:`gradient_scopes`): a value of the backward whose readers lead to params' gradients alone
(the gradient wrt a LoRA merge ``w + a @ b``, or wrt a normalised weight), from one that several
ops read on.  Partial over the split batch, offered only its own (whole) layout, it was reduced
whole at its first reader (an allreduce where ``w``'s gradient is split anyway), or passed on
lazily to every reader (:mod:`.lazy_grads`), the normalisation's backward then gathering ``w`` to
multiply it; offered ``w``'s split, it is reduce-scattered where it is made, its readers run on
the split, and only their small row sums are reduced whole.  Such an early reduce-scatter is no
gradient the buckets pack (the rest of the backward waits for it), so the lowerings offering the
backward, the forward alone and nothing are priced as the buckets will send them, and the richest
that is :func:`better` is kept (:func:`least_offered`).

A param (or value of params alone) read in pieces, each piece then gathered (a depthwise conv's
taps, slices of an FSDP weight ``[k, d_model]``, one gather a tap), is foreseen gathered whole
for the lowering again that :mod:`.shared_moves` makes (:func:`gathered_in_pieces`): the pieces
read the one gather, kept where the cost model finds it cheaper.

Random ops (their stream depends on where they run) and repeats (their outputs are per layer)
end a chain; a value read into a block from outside keeps the scopes it was given there.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from types import SimpleNamespace

from ..core.graph import readers_of
from ..layout.sharding import Sharding
from .bucket import DEFAULT_BUCKET_MB, bucket
from .coalesce import coalesce

#: leaves: a param (or a block's placeholder of one) starts a chain, any other ends it
LEAVES = frozenset({"param", "input", "placeholder"})


def _is_param(t) -> bool:
    """Whether tensor ``t`` is a param, or a repeat block's placeholder of one (its layer's slice)."""
    return t.node.op.name in ("param", "placeholder") and "params" in t.scopes


def param_scopes(nodes, known: dict[int, tuple], outputs=()) -> dict[int, tuple]:
    """``id(tensor) -> (scopes, dims, backward)`` of each output of ``nodes`` (in topological order)
    computed from params alone, beyond ``known`` (an earlier call's, whose entries it extends): the
    scopes of its params (each param's name, then ``params``), in the order they are first read, and
    the dims its params hold; ``backward`` False.  A value with no param in its ancestry (a constant,
    an iota) is not listed but does not spoil one made with it; a value with a dim none of its params
    holds (a param broadcast over the batch, a class token) is an activation, not a param's, and ends
    the chain.  Then the backward's values on their way to params' gradients alone, ``backward``
    True (:func:`gradient_scopes`; ``outputs``: the plan's output tensors)."""
    out = dict(known)
    free: set[int] = set()   # ids of values made from nothing (constants, iotas and ops of them)
    for n in nodes:
        for t in (*n.inputs, *n.outputs):   # (a block's params are bound before it is lowered: inputs only)
            if id(t) not in out and _is_param(t):
                out[id(t)] = (t.scopes, frozenset(t.shape.names), False)
        if any(id(t) in out for t in n.outputs):
            continue
        if n.op.name in LEAVES or n.op.reads_salt or n.op.subgraphs(n):
            continue
        if all(id(t) in free for t in n.inputs):
            free.update(id(t) for t in n.outputs)
            continue
        if not all(id(t) in out or id(t) in free for t in n.inputs):
            continue
        scopes, dims = _merged(out.get(id(t), ((), frozenset(), False)) for t in n.inputs)
        for t in n.outputs:
            if not t.scopes and set(t.shape.names) <= dims:   # (a tensor given scopes of its own keeps them)
                out[id(t)] = (scopes, dims, False)
    for k, v in gradient_scopes(nodes, outputs).items():
        out.setdefault(k, v)   # (a value of the backward computed from params alone is laid as they are)
    return out


def _merged(entries) -> tuple[tuple[str, ...], frozenset]:
    """The scopes (the params' own names first, then ``grads``, then ``params``, each in the order
    met) and the union of the dims of ``entries``, each ``(scopes, dims, ...)``."""
    scopes: list[str] = []
    dims: frozenset = frozenset()
    for s_in, d_in, *_ in entries:
        scopes += [s for s in s_in if s not in scopes]
        dims |= d_in
    scopes.sort(key=lambda s: {"grads": 1, "params": 2}.get(s, 0))   # (stable)
    return tuple(scopes), dims


def gradient_scopes(nodes, outputs=()) -> dict[int, tuple]:
    """``id(tensor) -> (scopes, dims, True)`` of each value of the backward among ``nodes`` (in
    topological order) whose readers all lead to params' gradients alone (tensors scoped ``grads``,
    :func:`~meshdsl.ir.autodiff.grad`'s) and whose dims those gradients hold: their scopes and dims,
    merged.  Listed only where it is, or is computed on the way from, such a value that several ops
    read (the gradient wrt a LoRA merge, read by ``w``'s, ``a``'s and ``b``'s gradients): a value
    read once, a plain weight's gradient, is reduced where its one reader needs it already.
    ``outputs``: the plan's output tensors (one not scoped ``grads`` spoils a chain into it)."""
    readers = readers_of(nodes)
    outs = {id(t) for t in outputs}
    ends: dict[int, tuple] = {}   # id(tensor) -> (scopes, dims) of the gradients it leads to alone
    for n in reversed(nodes):
        chain = (n.phase == "backward" and n.op.name not in LEAVES and not n.op.reads_salt
                 and not n.op.subgraphs(n))
        for t in n.outputs:
            if "grads" in t.scopes:
                ends[id(t)] = (t.scopes, frozenset(t.shape.names))
            elif chain and not t.scopes and id(t) not in outs and t.dtype.is_floating_point:
                rs = [o for r in readers.get(id(t), ()) for o in r.outputs]
                if rs and all(id(o) in ends for o in rs):
                    scopes, dims = _merged(ends[id(o)] for o in rs)
                    if set(t.shape.names) <= dims:
                        ends[id(t)] = (scopes, dims)
    out: dict[int, tuple] = {}
    for n in nodes:
        for t in n.outputs:
            if id(t) in ends and "grads" not in t.scopes and (
                    len(readers[id(t)]) > 1 or any(id(x) in out for x in n.inputs)):
                out[id(t)] = (*ends[id(t)], True)
    return out


#: What a lowering offers its params' layouts to: nothing, the values computed from params alone,
#: those and the backward's values on their way to params' gradients (:func:`least_offered`).
NOTHING, FORWARD, BOTH = 0, 1, 2


class _Offer:
    """What a lowering offers params' layouts to (:func:`with_param_targets`), and what it did
    offer them to (``offered``: a set of ``"forward"``, ``"backward"``)."""
    __slots__ = ("on", "offered")

    def __init__(self, on: int):
        self.on, self.offered = on, set()


_OFFER: ContextVar[_Offer | None] = ContextVar("meshdsl_param_targets", default=None)


@contextlib.contextmanager
def offering(on: int):
    """Lower (a plan and its blocks' sub-plans) offering params' layouts to what ``on`` (:data:`BOTH`,
    :data:`FORWARD` or :data:`NOTHING`) says; yields the record whose ``offered`` says to what some
    value was offered one."""
    rec = _Offer(on)
    token = _OFFER.set(rec)
    try:
        yield rec
    finally:
        _OFFER.reset(token)


def least_offered(lower, cheaper, buckets: bool) -> tuple:
    """``(lowerer, outputs, on)``: the cheapest of ``lower()``'s lowerings (each returns a lowerer
    and its output value ids) offering params' layouts to :data:`BOTH`, to :data:`FORWARD` values
    only (where the first offered the backward some) or to :data:`NOTHING` (where it offered any),
    and what it offered them to.  The greedy choice may gather in pieces what was gathered whole,
    and a gradient chain reduce-scattered early is a reduction the gradient buckets do not pack: a
    richer offer is kept only where :func:`better` (priced as the buckets will send them, where the
    plan is bucketed: ``buckets``)."""
    with offering(BOTH) as rec:
        best = lower()
    if not rec.offered:
        return (*best, NOTHING)
    with offering(NOTHING):
        kept = (*lower(), NOTHING)
    richer = [(FORWARD, None)] if rec.offered == {"forward", "backward"} else []
    for on, made in richer + [(BOTH, best)]:
        if made is None:
            with offering(on):
                made = lower()
        if better(made, kept[:2], cheaper, buckets):
            kept = (*made, on)
    return kept


def better(new, old, cheaper, buckets: bool = False) -> bool:
    """Whether lowering ``new`` (a lowerer and its output value ids) is worth keeping over ``old``:
    ``cheaper`` (the cost model's time, no more bytes) and no more collectives (those of sub-plans
    as often as they run), their steps taken as the gradient buckets will send them (``buckets``)."""
    a, b = (_as_sent(lw, outs) if buckets else lw for lw, outs in (new, old))
    return cheaper(a, b) and _num_collectives(a.steps) <= _num_collectives(b.steps)


def _as_sent(lw, outs):
    """Lowerer ``lw``'s steps as the plan sends them: its gradient reductions in buckets, small
    allreduces made back to back as one (what :func:`.shared_moves.cheaper` prices reads)."""
    steps = bucket(lw.steps, lw.values, outs, DEFAULT_BUCKET_MB, lw.mesh)
    steps = coalesce(steps, dict(lw.values), outs, lw.cost, lw.mesh)   # (pricing: no values added to lw)
    return SimpleNamespace(steps=steps, mesh=lw.mesh, cost=lw.cost)


def _num_collectives(steps) -> int:
    return sum(s.is_collective + sum(s.runs(k) * _num_collectives(sub.steps) for k, sub in enumerate(s.subplans))
               for s in steps)


def offers(lw, nodes) -> bool:
    """Whether lowerer ``lw``, lowering ``nodes``, offers params' layouts: not in a layer's backward
    block (see the module docstring)."""
    return not (lw.in_block and any(n.phase != "forward" for n in nodes))


def gathered_in_pieces(lw, ahead: dict[int, frozenset]) -> dict[int, frozenset]:
    """``ahead`` (``id(tensor) -> shardings`` a lowering again foresees, :mod:`.shared_moves`) with
    each param, or value of params alone, that lowerer ``lw`` read as it was, split, by several
    ops whose results it then gathered over that split (a depthwise conv's taps, each a slice of
    an FSDP weight ``[k, d_model]``, gathered tap by tap): foreseen gathered itself, once, where
    its readers read it whole.  Its even splits only (a given part's or a block-cyclic dim's
    whole form is left to the rules)."""
    pieces: dict[int, list] = {}   # value -> the axes of its split each reader's result was gathered over
    for s in lw.steps:
        if s.kind != "local":
            continue
        for v in set(s.ins):
            sh = lw.values[v].sharding
            if sh.partial or sh.parts or sh.cyclic or not sh.split:
                continue
            dropped = frozenset(a for o in s.outs for to in lw.held(o) if not to.partial
                                for a in (lw.values[o].sharding.used_axes & sh.used_axes) - to.used_axes)
            if dropped:
                pieces.setdefault(v, []).append(dropped)
    out = dict(ahead)
    for tid, vid in lw.env.items():
        made = lw.param_scopes.get(tid)
        if vid not in pieces or len(pieces[vid]) < 2 or made is None or made[2]:
            continue
        sh, gone = lw.values[vid].sharding, frozenset().union(*pieces[vid])
        whole = Sharding(tuple((d, tuple(a for a in ax if a not in gone)) for d, ax in sh.dims))
        out[tid] = out.get(tid, frozenset()) | {whole}
    return out


def with_param_targets(lw, t, own: list) -> list:
    """``own`` (the targets of tensor ``t``'s own scopes, in lowerer ``lw``) followed by those its
    params' scopes give it that ``own`` lacks, as alternatives the cost model may choose: for a value
    computed from params alone and read by one op, or one on its way to their gradients
    (:func:`param_scopes`); ``own`` alone otherwise, or where the lowering under way
    (:func:`offering`) offers none."""
    made = lw.param_scopes.get(id(t))
    rec = _OFFER.get()
    if made is None or rec is None or rec.on < (BOTH if made[2] else FORWARD):
        return own
    scopes, _, backward = made
    if not backward and lw.num_uses(t) != 1:
        return own
    seen = {sh for sh, _ in own}
    extra = [(sh, note) for sh, note in lw.layout.targets(t.shape, scopes, lw.mesh, t.name, False)
             if sh not in seen]
    if extra:
        rec.offered.add("backward" if backward else "forward")
    return own + extra
