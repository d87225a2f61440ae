"""An einsum of a concat along a split dim, lowered as one einsum per part.

``h = concat([a, b, c], "hidden")`` under ``hidden:model`` splits each part over ``model`` on its
own, but ``h`` split as one dim wants other rows on each rank: the concat moves rows (halo
permutes, :mod:`.concat`) and, where its reader wants the dim whole, gathers them.  An einsum
reading ``h`` (or ``h`` renamed, GraphSAGE's ``hidden -> cat``) needs no ``h`` at all:

* where it contracts the concat's dim, ``einsum(concat(parts, d), w) == sum_k einsum(part_k,
  w[d: start_k:stop_k])``: each part contracts, split as it arrives, with its own rows of the
  other operands (cut locally from a whole ``w``), the partial sums add locally and are reduced
  once where a reader needs them;
* where it keeps the dim, ``einsum(concat(parts, d), y) == concat_k(einsum(part_k, y))`` (a
  weight's gradient ``einsum(dy, h)``): each part's product is moved, not the parts.

The other operands' rows of part ``k`` are renamed to the part's dim, so that they take its
layout.  A concat (and the renames between it and the einsums) whose every reader is such an
einsum is not lowered.  The choice is the plan's: a graph with such an einsum is lowered with
and without these rules (:func:`summing_parts`), and the rewrite is kept where the cost model
finds it better (:func:`.param_values.better`), so a concat read elsewhere too (and so made
anyway) keeps the einsum on it where that costs less.  Only einsums; a conv over a concat of
channels is lowered as before.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass

from ..ops.einsum import einsum
from ..ops.elementwise import add
from ..ops.shape_ops import rename
from ..ops.slicing import concat, slice_
from .composite import lower_composite


@dataclass
class _Use:
    """Whether this lowering may rewrite (``on``), and whether it did (``used``)."""
    on: bool
    used: bool = False


_USE: ContextVar[_Use] = ContextVar("meshdsl_summed_parts", default=_Use(False))


@contextlib.contextmanager
def summing_parts(on: bool):
    """Lower with (``on``) or without the rules of this module; yields the record whose ``used``
    says whether some einsum was lowered by them."""
    rec = _Use(on)
    token = _USE.set(rec)
    try:
        yield rec
    finally:
        _USE.reset(token)


def _concat_of(t):
    """``(concat node, dim, renamed dim, renames)`` where ``t`` is a concat of several parts or a
    chain of renames of its dim alone; None otherwise."""
    renames = []
    while t.node is not None and t.node.op.name == "rename":
        renames.append(t.node)
        t = t.node.inputs[0]
    if t.node is None or t.node.op.name != "concat" or len(t.node.inputs) < 2:
        return None
    d = name = t.node.attrs["dim"]
    for r in reversed(renames):
        m = r.attrs["mapping"]
        if set(m) != {name}:
            return None
        name = m[name]
    return t.node, d, name, renames


def _fits(lw, node, i: int, found) -> bool:
    """Whether einsum ``node``'s input ``i``, a concat ``found`` (:func:`_concat_of`), may be
    lowered per part: a part the layout splits along the dim, whose name (where renamed) no
    operand or the output has."""
    cat, d, named, _ = found
    if not any(lw.target(p).axes_of(d) for p in cat.inputs):
        return False
    if any(len(x.shape.names) != len(set(x.shape.names)) for x in node.inputs):
        return False
    if d != named and (d in node.attrs["out"] or any(d in x.shape.names for x in node.inputs)):
        return False
    if any(x.node is not None and x.node.op.name in ("rename", "concat") and _concat_of(x)
           for j, x in enumerate(node.inputs) if j != i):
        return False   # (one concat per einsum)
    return True


def contracted_parts(lw, nodes, absorbed: dict) -> dict:
    """Einsums among ``nodes`` reading a concat along a split dim (see the module docstring):
    node id -> the rule that lowers it per part, or None for a concat or rename every reader of
    which is such an einsum (not lowered); empty unless :func:`summing_parts` is on.  A concat
    ``absorbed`` (built from its parts' source, :func:`.concat.absorbed_parts`) is left to that."""
    rec = _USE.get()
    if not rec.on:
        return {}
    rules, readers = {}, {}
    made = {id(n) for n in nodes}   # (a block's backward may have the concat saved, not its parts)
    for node in nodes:
        if node.op.name != "einsum":
            continue
        for i, t in enumerate(node.inputs):
            found = _concat_of(t)
            if found and id(found[0]) not in absorbed and _fits(lw, node, i, found) and all(
                    id(p) in lw.env or id(p.node) in made for p in found[0].inputs):
                rules[id(node)] = lambda lw, node, i=i, found=found: _lower_per_part(lw, node, i, found)
                readers[id(t)] = readers.get(id(t), 0) + 1
                rec.used = True
                break
    for node in reversed(nodes):   # a concat and its renames read only by these einsums (renames first)
        if node.op.name in ("concat", "rename"):
            t = node.outputs[0]
            if id(node) not in rules and readers.get(id(t), 0) == lw.num_uses(t) > 0:
                rules[id(node)] = None
                src = node.inputs[0]
                if node.op.name == "rename":
                    readers[id(src)] = readers.get(id(src), 0) + 1
    return rules


def _lower_per_part(lw, node, i: int, found) -> None:
    cat, d, named, _ = found
    kept = named in node.attrs["out"]
    lw.note(f"{node.name}: reads the concat of {len(cat.inputs)} parts along '{d}' (split), "
            + ("as the concat of each part's einsum" if kept else "as the sum of each part's einsum "
               "with its rows of the other operands"))
    parts, others = list(cat.inputs), [x for j, x in enumerate(node.inputs) if j != i]

    def build(*ins):
        ys, start = [], 0
        for part in ins[:len(parts)]:
            n = part.shape.get(d).size
            xs = list(ins[len(parts):])
            xs = [_rows(x, named, d, start, start + n) for x in xs]
            xs.insert(i, part)
            out = [d if name == named else name for name in node.attrs["out"]]
            eq = ", ".join(" ".join(x.shape.names) for x in xs) + " -> " + " ".join(out)
            ys.append(einsum(eq, *xs))
            start += n
        if kept:
            return [concat([rename(y, {d: named}) for y in ys], named)]
        total = ys[0]
        for y in ys[1:]:
            total = add(total, y)
        terms.extend(ys)   # (each priced as one share of the sum's one reduction, :mod:`.shared_sums`)
        lw.shared_sums.update(dict.fromkeys(map(id, ys), len(ys)))
        return [total]

    terms = []
    lower_composite(lw, node, build, inputs=parts + others)
    for y in terms:
        lw.shared_sums.pop(id(y), None)



def _rows(x, named: str, d: str, start: int, stop: int):
    """``x``'s rows ``[start, stop)`` along ``named``, renamed ``d`` (``x`` itself without it)."""
    if named not in x.shape.names:
        return x
    x = slice_(x, named, start, stop)
    return rename(x, {named: d})
