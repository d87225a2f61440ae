"""Several partial sums added into one value: reduced once for all of them, where that costs less.

The generic rule (:mod:`.generic`) prices each op's output on its own: a result left as a partial
sum pays, there, for its reduction to the layout's target.  Four lookups into one entity table
split ``entities:model`` over a batch split ``batch:(data,model)`` (TransE: the head, the tail and
the corrupted heads and tails) have four ``scatter_add`` gradients, added into the table's one
gradient.  Each alone would rather gather its own ids and rows (a few hundred bytes) than leave a
partial table to reduce: eight allgathers.  Left partial, the four tables add up lazily (add is
linear) and the sum is reduced once.

So :func:`summed_terms` finds the terms of such sums: the inputs of a tree of adds (each add read
only by the next) made by ops that sum over a dim (a split one leaves a partial sum), at least two
per tree; a term may reach its add through zero-fill pads and renames of such an op's result (the
gradients of several slices of one value, each padded back to its size: CPC's future latents), the
chain marked with it (:func:`_passed_on`).  Where the first lowering gave two or more of them a
collective of their own, moving their inputs rather than leave their results partial, or reducing
their results (:func:`moved_around`), the graph is lowered again with each term's and each
inner add's eventual reduction priced as its share of the one reduction of the whole sum
(``Lowerer.shared_sums``: ``id(tensor) -> number of terms``); the compiler keeps the lowering the
cost model prices lower (:func:`.shared_moves.cheaper`), by time alone: nothing is priced free
here, and fewer collectives may send more bytes (TransE at its tiny size: 2 reductions of the
384 B table gradient instead of 8 allgathers of ids and rows, 640 B).

A partial sum read by several ops is reduced at its first reader (:func:`.generic._partial_modes`),
though its readers may all be linear and meet again: two slices of it concatenated (FNO's low
and high kept modes), padded and added, or each scaled and concatenated.  The sum over the ranks
commutes with them, so one reduction where the paths meet gives the same numbers, and a later
add of another partial sum joins it for free.  :func:`meeting_sums` finds such values and the
values on their paths; the compiler lowers the graph again passing them on partial to every
reader (``Lowerer.lazy_through``) where the first lowering left one of them partial, and keeps
that lowering where the cost model prices it lower and it sends no more bytes.
"""
from __future__ import annotations

import heapq

from ..collectives import COLLECTIVES
from ..core.graph import readers_of

#: ops whose results, summed, make the gradient of a tensor read several times: a lookup's
#: (``gather``'s gradient), a contraction's (a ``one_hot`` lookup's, a tied weight's), attention's
#: keys' and values' (summed over the queries), a sum's or mean's (its result's gradient, itself
#: summed over a dim where that is split, broadcast back: Informer's mean of the values ``v``)
_SUMMING = frozenset({"scatter_add", "einsum", "attention_backward", "broadcast_to"})
_MOVES = frozenset(k for k, c in COLLECTIVES.items() if not c.point_to_point)


def summed_terms(nodes, outputs) -> dict[int, int]:
    """``id(tensor) -> k``: the terms (and inner partial results) of each tree of adds whose ``k >=
    2`` terms are made by ops summing over a dim (see the module docstring); empty when there is none.

    ``nodes``: the graph's nodes in topological order; ``outputs``: the plan's output tensors."""
    readers = readers_of(nodes)
    outs = {id(t) for t in outputs}

    def only_reader(t):
        rs = readers.get(id(t), ())
        return rs[0] if len(rs) == 1 and id(t) not in outs else None

    adds = {n.id for n in nodes if n.op.name == "add" and _adds_own_shape(n)}
    inner = {n.id for n in nodes if n.id in adds and getattr(only_reader(n.outputs[0]), "id", None) in adds}
    marked: dict[int, int] = {}
    for n in nodes:
        if n.id not in adds or n.id in inner:
            continue
        tree, terms = _tree(n, inner, only_reader)
        chains = [c for c in (_passed_on(t, only_reader) for t in terms) if _sums(c[-1].node)]
        if len(chains) >= 2:
            for t in [x for c in chains for x in c] + tree:
                marked[id(t)] = len(chains)
    return marked


#: one-input linear ops that pass a partial sum on as one (a slice's gradient: a zero-fill pad of
#: the gradient of a renamed slice, CPC's future latents)
_PASSING = frozenset({"pad", "rename"})


def _passed_on(t, only_reader) -> list:
    """``t`` and the tensors it was made from through :data:`_PASSING` ops, each read only by the
    next: the last is the one whose maker may sum."""
    chain = [t]
    while (t.node is not None and t.node.op.name in _PASSING and len(t.node.inputs) == 1
           and not t.node.attrs.get("value") and only_reader(t.node.inputs[0]) is t.node):
        t = t.node.inputs[0]
        chain.append(t)
    return chain


def _adds_own_shape(n) -> bool:
    """Whether add ``n`` adds floats of its own shape (no broadcast: each term is the whole sum's size)."""
    out = n.outputs[0]
    return out.dtype.is_floating_point and all(x.shape == out.shape for x in n.inputs)


def _sums(node) -> bool:
    """Whether ``node`` sums over a dim (its result is a partial sum where that dim is split):
    a lookup's gradient (``scatter_add``), a contraction; not a leaf, a loop or a composite."""
    return node is not None and node.op.name in _SUMMING


def _tree(root, inner: set, only_reader) -> tuple[list, list]:
    """The inner adds' outputs below add ``root`` and the terms they add (inputs read once)."""
    tree, terms, todo = [], [], [root]
    while todo:
        n = todo.pop()
        for x in n.inputs:
            if x.node is not None and x.node.id in inner and only_reader(x) is n:
                tree.append(x)
                todo.append(x.node)
            elif only_reader(x) is n:
                terms.append(x)
    return tree, terms


def moved_around(lw, shared: dict[int, int], nodes) -> bool:
    """Whether lowerer ``lw`` gave two or more ops making terms of shared sums (``shared``:
    :func:`summed_terms`) a collective of their own, moving their inputs (rather than leave a
    partial result) or reducing their result, or one while another term was left partial (its sum
    is reduced anyway: Informer's mean of ``v``, whose gradient was reduced before it joined the
    attention's partial gradient of ``v``): left partial and reduced once, they might cost less."""
    makers = {n.id: n for n in nodes if n.op.name != "add" and any(id(t) in shared for t in n.outputs)}
    paid = {s.node for s in lw.steps if s.kind in _MOVES and s.node in makers
            and s.note.startswith(("re-layout input", "re-layout output of"))}
    if len(paid) != 1:
        return len(paid) >= 2
    return any(lw.values[lw.env[id(t)]].sharding.partial for i, n in makers.items() if i not in paid
               for t in n.outputs if id(t) in shared and id(t) in lw.env)


#: the most nodes a walk from a branching value takes before giving up on its paths meeting
MAX_MEET_NODES = 32


def meeting_sums(nodes, outputs) -> frozenset[int]:
    """Ids of the values that may be partial sums read several times (by several ops, or one op
    twice) whose paths of linear ops (each linear in what it reads of them) all meet again in one
    value, and of the values on those paths (and on from there, :func:`_on_to_a_sum`): passed on
    partial, they are reduced once, after the meeting (see the module docstring).  Empty when
    there is none.

    ``nodes``: the graph's nodes in topological order; ``outputs``: the plan's output tensors."""
    readers = readers_of(nodes)
    outs = {id(t) for t in outputs}
    order = {n.id: i for i, n in enumerate(nodes)}
    sums = _maybe_partial(nodes)
    marked: set[int] = set()
    for n in nodes:
        for t in n.outputs:
            if len(readers.get(id(t), ())) > 1 and id(t) in sums and id(t) not in outs and id(t) not in marked:
                marked |= _paths_to_meeting(t, readers, outs, order, sums)
    return frozenset(marked)


def _maybe_partial(nodes) -> set[int]:
    """Ids of the float values that may be partial sums: made by an op summing over a dim
    (:data:`_SUMMING`, a ``reduce_sum``), or by an op linear in an input that may be."""
    out: set[int] = set()
    for n in nodes:
        summing = n.op.name in _SUMMING or n.op.name == "reduce_sum"
        if summing or any(id(x) in out and _linear_in(n, [i]) for i, x in enumerate(n.inputs)):
            out.update(id(t) for t in n.outputs if t.dtype.is_floating_point)
    return out


def _paths_to_meeting(t, readers: dict, outs: set, order: dict, sums: set) -> set[int]:
    """Ids of ``t`` and the values between it and the one value all its linear paths meet in, or
    none: a path leaves through an op not linear in it, or ends (an output, a value no op reads).
    With them, the values from there on to another sum it is added to (:func:`_on_to_a_sum`)."""
    pending = {id(t): len(readers[id(t)])}   # a path's value -> its readers not yet walked
    found, todo, seen = [id(t)], [], set()

    def follow(x):
        for r in readers[id(x)]:
            if r.id not in seen:
                seen.add(r.id)
                heapq.heappush(todo, (order[r.id], r.id, r))

    follow(t)
    while todo:
        if len(seen) > MAX_MEET_NODES:
            return set()
        _, _, r = heapq.heappop(todo)
        pos = [i for i, x in enumerate(r.inputs) if id(x) in pending]
        if not _linear_in(r, pos) or len(r.outputs) != 1:
            return set()
        for i in pos:
            pending[id(r.inputs[i])] -= 1
            if not pending[id(r.inputs[i])]:
                del pending[id(r.inputs[i])]
        out = r.outputs[0]
        if id(out) in outs or not readers.get(id(out)) or not out.dtype.is_floating_point:
            return set()
        if not pending and not todo:   # every path met here
            return set(found) | _on_to_a_sum(out, readers, outs, sums)
        pending[id(out)] = len(readers[id(out)])
        found.append(id(out))
        follow(out)
    return set()


def _on_to_a_sum(t, readers: dict, outs: set, sums: set) -> set[int]:
    """Ids of ``t`` and the values each the only reader's result, linear in it, up to an add of
    another value that may be a partial sum (FNO's spectral path, through its inverse transforms,
    joining the local path's): reduced after that add, one reduction serves both.  Empty where the
    chain ends otherwise (a growing transform alone is better reduced before it)."""
    chain = []
    while id(t) not in outs and len(readers.get(id(t), ())) == 1 and len(chain) < MAX_MEET_NODES:
        r = readers[id(t)][0]
        pos = [i for i, x in enumerate(r.inputs) if x is t]
        if len(pos) != 1 or not _linear_in(r, pos) or len(r.outputs) != 1:
            return set()
        chain.append(id(t))
        if r.op.name in ("add", "sub") and any(id(x) in sums for x in r.inputs if x is not t):
            return set(chain)
        t = r.outputs[0]
    return set()


def _linear_in(n, pos: list[int]) -> bool:
    """Whether node ``n`` is linear in its inputs at ``pos`` jointly (the others fixed): a zero-fill
    pad, a slice, a concat, an add; a product with one of them."""
    if n.op.name == "pad" and n.attrs.get("value"):
        return False
    if len(pos) == 1:
        return n.op.is_linear(n) or n.op.linear_in(n, pos[0]) or n.op.multilinear
    return n.op.linear_in_all(n, pos) if len(pos) == len(n.inputs) else (
        n.op.is_linear(n) and n.op.name in ("add", "sub", "concat"))
