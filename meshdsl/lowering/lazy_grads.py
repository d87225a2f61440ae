"""Partial sums of the main graph's backward that pass on lazily to several readers.

A partial sum with several readers is reduced at its first one (:func:`.generic._partial_modes`):
passed on lazily, each reader's result would need a reduction of its own.  Not so where every
reader is linear in it and every path of linear ops from it ends in gradients (plan outputs,
or values only the optimizer's update reads): those are reduced anyway, in the gradient bucket,
so the value's own reduction is one collective more.  A param normalised before use (SwAV's
prototypes ``w / ||w||``, a weight norm) is the case: the gradient wrt the normalised tensor,
partial over the split batch, is read twice by the normalisation's backward, and both paths
end in the param's gradient.  :func:`lazy_to_gradients` marks such values for
``Lowerer.lazy_through`` (as :func:`.repeat._lazy_through` does inside a repeat's backward
block, which prices both lowerings); here only where the gradients reached hold no more
elements than the value, so reducing them instead sends no more bytes.

A partial sum read only by ops that shrink it (RNN-T's gradient of ``enc + pred``, ``[batch,
t, u, d_joint]``, summed over ``u`` for the encoder and over ``t`` for the prediction network)
passes on to them as well, where the cost model says so: each result is reduced where it is
needed, ``|b,t,j| + |b,u,j|`` sent in two collectives instead of ``|b,t,u,j|`` in one
(:func:`lazy_to_smaller_sums`).
"""
from __future__ import annotations

from ..collectives import COLLECTIVES
from ..core.graph import readers_of

#: ends more gradients than this: the bucket's bytes would outgrow the value's (and the
#: backward's upstream gradient, linear in every param's, is not walked gradient by gradient)
MAX_ENDS = 8


def _linear_reader(n, t) -> bool:
    """Whether node ``n`` is linear in ``t`` (read at one position, or jointly linear)."""
    pos = [i for i, x in enumerate(n.inputs) if x is t]
    if n.op.is_linear(n):
        return True
    return len(pos) == 1 and (n.op.linear_in(n, pos[0]) or n.op.multilinear)


def lazy_to_gradients(nodes, outputs) -> frozenset[int]:
    """Ids of backward values with several readers, all linear in them, whose linear paths end
    only in gradients holding no more elements than they do (see the module docstring).

    ``nodes``: the graph's nodes in topological order; ``outputs``: the plan's output tensors."""
    readers = readers_of(nodes)
    outs = {id(t) for t in outputs}
    ends: dict[int, frozenset | None] = {}   # id(tensor) -> the gradients its linear paths end in
    marked = set()
    for n in reversed(nodes):
        for t in n.outputs:
            ends[id(t)] = e = _ends(n, t, readers.get(id(t), ()), outs, ends)
            if e is not None and len(readers.get(id(t), ())) > 1 and t.dtype.is_floating_point \
                    and sum(g.shape.numel for g in e) <= t.shape.numel:
                marked.add(id(t))
    return frozenset(_downstream(marked, nodes, readers, ends))


def _downstream(marked: set, nodes, readers: dict, ends: dict) -> set:
    """``marked`` and the values on their linear paths that end in no other gradient: their
    readers pass them on too (a row sum's gradient broadcast back over the rows, on its way to
    the same param's gradient, priced alone would be reduced first: a collective more)."""
    out, todo = set(marked), [t for n in nodes for t in n.outputs if id(t) in marked]
    while todo:
        t = todo.pop()
        for r in readers.get(id(t), ()):
            if r.op.multilinear and not r.op.is_linear(r):   # (an einsum prices its own: a contraction
                continue                                        # may shrink what it would reduce)
            for o in r.outputs:
                e = ends.get(id(o))
                if id(o) not in out and e is not None and e <= ends[id(t)]:
                    out.add(id(o))
                    todo.append(o)
    return out


def _ends(n, t, reads, outs: set, ends: dict) -> frozenset | None:
    """The gradients ``t`` (made by ``n``) reaches by linear ops only, or None: a path leaves."""
    if n.phase != "backward" or not t.dtype.is_floating_point:
        return None
    if (id(t) in outs or reads) and all(r.phase == "update" for r in reads):   # (as the bucket's test)
        return frozenset([t])
    if not reads:   # an output of a node nothing reads (a layer norm backward's unused dgamma)
        return frozenset()
    if not all(r.phase == "backward" and _linear_reader(r, t) for r in reads):
        return None
    found: set = set()
    for r in reads:
        for o in r.outputs:
            e = ends.get(id(o))
            if e is None:
                return None
            found |= e
    return frozenset(found) if len(found) <= MAX_ENDS else None


def lazy_to_smaller_sums(nodes, cost, mesh) -> frozenset[int]:
    """Ids of values with several readers, each a one-input linear op whose result is smaller
    (a sum over some dims), that are cheaper to reduce after those readers, one collective per
    reader, than once before them, by ``cost`` (a :class:`.cost.CostModel`).

    Which axes a value will be partial over is not known before it is lowered; it is priced at
    the least that reducing late can gain: split over every axis but the smallest, which it is
    partial over (local sizes at their smallest), in a group of two (the fewest bytes on the
    wire per byte sent).  Where it is not partial, marking it changes nothing.

    ``nodes``: the graph's nodes in topological order."""
    readers = readers_of(nodes)
    wire = COLLECTIVES["allreduce"].fraction(2)
    split = mesh.size // min((n for _, n in mesh.axes), default=1)
    out = set()
    for n in nodes:
        for t in n.outputs:
            rs = readers.get(id(t), ())
            if len(rs) < 2 or not t.dtype.is_floating_point or not all(
                    len(r.inputs) == 1 and len(r.outputs) == 1 and r.op.is_linear(r)
                    and r.outputs[0].shape.numel < t.shape.numel for r in rs):
                continue
            size = t.dtype.itemsize / split
            once = cost.collective("allreduce", 0, 2) + wire * t.shape.numel * size / cost.bandwidth_Bps
            late = sum(cost.collective("allreduce", 0, 2) + wire * r.outputs[0].shape.numel * size
                       / cost.bandwidth_Bps for r in rs)
            if late < once:
                out.add(id(t))
    return frozenset(out)
