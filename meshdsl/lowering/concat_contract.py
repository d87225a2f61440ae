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
anyway) keeps the einsum on it where that costs less.

A conv whose input channel dim is the concat's (a U-Net's skip, ``conv(concat([up, skip], c),
w)``) is the same sum: ``sum_k conv(part_k, w[c: start_k:stop_k])``, each part convolved on its
own layout (its spatial halos its own), and its weight gradient the concat of each part's
(:func:`_lower_conv_per_part`; in a repeat's block that gradient reads ``(dy, x)``, the concat as
an output channel dim).  A strided conv reads its input's phases (a pad, a rearrange, a slice and
a squeeze of the spatial dims, :func:`meshdsl.ops.conv.conv`): those ops leave the channel dim
be, so each part goes through them itself (:data:`_CARRIED`).  Where the weight's rows are split
as the concat (``cat:model``) they move to the parts' blocks instead, so the cost model chooses.
"""
from __future__ import annotations

import contextlib
import re
from contextvars import ContextVar
from dataclasses import dataclass

from ..ops.einsum import einsum
from ..ops.elementwise import add
from ..ops.registry import apply
from ..ops.shape_ops import rearrange, rename
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


#: ops between a concat and a conv that act on each part alone where they leave the concat's dim be
#: (a strided conv's phases: a pad and a rearrange of the spatial dim, a phase's slice and squeeze)
_CARRIED = ("rename", "pad", "slice", "squeeze", "rearrange")


def _concat_of(t):
    """``(concat node, dim, dim as ``t`` names it, chain)`` where ``t`` is a concat of several parts
    or made from one by a chain of ops (oldest first) each of which renames that dim alone or
    leaves it be (:data:`_CARRIED`); None otherwise."""
    chain = []
    while t.node is not None and t.node.op.name in _CARRIED:
        chain.append(t.node)
        t = t.node.inputs[0]
    if t.node is None or t.node.op.name != "concat" or len(t.node.inputs) < 2:
        return None
    d = name = t.node.attrs["dim"]
    for n in reversed(chain):
        a = n.attrs
        if n.op.name == "rename":
            if set(a["mapping"]) != {name}:
                return None
            name = a["mapping"][name]
        elif n.op.name == "rearrange":
            left, right = a["pattern"].split("->")
            if name in a["sizes"] or not (_bare(left, name) and _bare(right, name)) or (
                    d != name and re.search(rf"(?<![\w.]){re.escape(d)}(?![\w.])", a["pattern"])):
                return None   # (the part's dim, ``d``, must not name another dim of the pattern)
        elif a["dim"] == name:
            return None
    return t.node, d, name, chain[::-1]


def _bare(side: str, name: str) -> bool:
    """Whether dim ``name`` stands alone (in no group) on ``side`` of a rearrange pattern."""
    depth, alone = 0, set()
    for tok in re.findall(r"\(|\)|[^\s()]+", side):
        depth += (tok == "(") - (tok == ")")
        if tok not in "()" and not depth:
            alone.add(tok)
    return name in alone


def _through(t, chain, d: str):
    """Part ``t`` (its dim ``d``) through ``chain`` (:func:`_concat_of`) but its renames: ``d`` kept."""
    name = d
    for n in chain:
        a = n.attrs
        if n.op.name == "rename":
            name = a["mapping"][name]
        elif n.op.name == "rearrange":
            t = rearrange(t, re.sub(rf"(?<![\w.]){re.escape(name)}(?![\w.])", d, a["pattern"]), **a["sizes"])
        else:
            t = apply(n.op.name, [t], dict(a))
    return t


def _fits(lw, node, i: int, found) -> bool:
    """Whether einsum ``node``'s input ``i``, a concat ``found`` (:func:`_concat_of`), may be
    lowered per part: a part the layout splits along the dim, whose name (where renamed) no
    operand or the output has."""
    cat, d, named, chain = found
    if any(n.op.name != "rename" for n in chain) or not any(lw.target(p).axes_of(d) for p in cat.inputs):
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
        if node.op.name not in _RULES:
            continue
        fits, lower = _RULES[node.op.name]
        for i, t in enumerate(node.inputs):
            found = _concat_of(t)
            if found and id(found[0]) not in absorbed and fits(lw, node, i, found) and all(
                    id(p) in lw.env or id(p.node) in made for p in found[0].inputs):
                rules[id(node)] = lambda lw, node, i=i, found=found, lower=lower: lower(lw, node, i, found)
                readers[id(t)] = readers.get(id(t), 0) + 1
                rec.used = True
                break
    for node in reversed(nodes):   # a concat and its chains read only by these nodes (the chains first)
        if node.op.name == "concat" or node.op.name in _CARRIED:
            t = node.outputs[0]
            if id(node) not in rules and readers.get(id(t), 0) == lw.num_uses(t) > 0:
                rules[id(node)] = None
                src = node.inputs[0]
                if node.op.name != "concat":
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
        return _joined(lw, ys, kept, d, named, terms)

    terms = []
    lower_composite(lw, node, build, inputs=parts + others)
    for y in terms:
        lw.shared_sums.pop(id(y), None)


def _joined(lw, ys: list, kept: bool, d: str, named: str, terms: list) -> list:
    """The parts' results ``ys`` joined: concatenated along ``named`` where the node keeps the dim,
    else summed (each term priced as one share of the sum's one reduction, :mod:`.shared_sums`,
    and listed in ``terms`` to be forgotten after)."""
    if kept:
        return [concat([rename(y, {d: named}) for y in ys], named)]
    total = ys[0]
    for y in ys[1:]:
        total = add(total, y)
    terms.extend(ys)
    lw.shared_sums.update(dict.fromkeys(map(id, ys), len(ys)))
    return [total]



def _rows(x, named: str, d: str, start: int, stop: int):
    """``x``'s rows ``[start, stop)`` along ``named``, renamed ``d`` (``x`` itself without it)."""
    if named not in x.shape.names:
        return x
    x = slice_(x, named, start, stop)
    return rename(x, {named: d})


# -- conv ---------------------------------------------------------------------------------------

#: the attrs a conv (or its weight gradient) is built from; the rest its ``infer`` derives
_CONV_ATTRS = ("spatial", "in_dims", "out_dims", "flip", "dilation", "w_names")


def _conv_fits(lw, node, i: int, found) -> bool:
    """Whether conv (or weight gradient) ``node``'s input ``i``, a concat ``found``, may be lowered per
    part: a part split along the dim, which is the conv's one input channel dim (or, for a weight
    gradient built the other way round, :func:`meshdsl.ops.conv.Conv.grad`, one of its output
    channel dims), no per-sample weights, and the part's dim (where renamed) on no other operand."""
    cat, d, named, _ = found
    a = node.attrs
    if not any(lw.target(p).axes_of(d) for p in cat.inputs) or a.get("per"):
        return False
    if not (tuple(a["in_dims"]) == (named,) if i == 0 else
            node.op.name == "conv_weight_grad" and named in a["out_dims"]):
        return False
    other = node.inputs[1 - i]
    if d != named and (d in other.shape.names or d in node.outputs[0].shape.names):
        return False
    return not (other.node is not None and other.node.op.name in ("rename", "concat") and _concat_of(other))


def _lower_conv_per_part(lw, node, i: int, found) -> None:
    """``conv(concat(parts, c_in), w) == sum_k conv(part_k, w[c_in: start_k:stop_k])``; a weight
    gradient reading the concat keeps its dim: the concat of each part's weight gradient."""
    cat, d, named, chain = found
    kept = named in node.outputs[0].shape.names
    lw.note(f"{node.name}: reads the concat of {len(cat.inputs)} parts along '{d}' (split) as its channels, "
            + ("as the concat of each part's weight gradient" if kept else
               "as the sum of each part's conv with its rows of the weight"))
    parts, other = list(cat.inputs), node.inputs[1 - i]
    attrs = {k: _renamed(node.attrs[k], named, d) for k in _CONV_ATTRS if k in node.attrs}

    def build(*ins):
        ys, start = [], 0
        for part in ins[:-1]:
            n = part.shape.get(d).size
            xs = [_through(part, chain, d), _rows(ins[-1], named, d, start, start + n)]
            ys.append(apply(node.op.name, xs if i == 0 else xs[::-1], dict(attrs)))
            start += n
        return _joined(lw, ys, kept, d, named, terms)

    terms = []
    lower_composite(lw, node, build, inputs=parts + [other])
    for y in terms:
        lw.shared_sums.pop(id(y), None)


def _renamed(value, named: str, d: str):
    """A conv attr (a tuple of dim names, or another value) with ``named`` renamed ``d``."""
    if isinstance(value, tuple) and all(isinstance(v, str) for v in value):
        return tuple(d if v == named else v for v in value)
    return value


#: op -> (whether its input may be lowered per part, the rule that does it)
_RULES = {"einsum": (_fits, _lower_per_part), "conv": (_conv_fits, _lower_conv_per_part),
          "conv_weight_grad": (_conv_fits, _lower_conv_per_part)}
