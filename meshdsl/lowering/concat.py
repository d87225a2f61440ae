"""Lowering of concat: generic where its dim is whole, a sum of pads where it arrives split,
rebuilt from its source where its parts are windows of slices of one tensor along the dim.

``concat`` runs ``torch.cat``, which needs its dim whole on a rank (the dim is fixed in its
spec), so lowered generically a split dim is gathered first: the whole ``[batch, seq,
d_model]`` patches under ``seq:model`` when a ViT joins a class token before them. Where an
operand arrives split along the dim and the output's layout splits it too, the node is lowered
instead as the composite of the same values: each operand padded with zeros to the output's
length at its place, summed (exact: every element is one operand's value plus zeros). The
pads lower by halo exchanges (:mod:`.window`): a whole operand (the class token) is cut
locally, a split one trades the rows its shift by the operands before it moves across rank
boundaries.

Per-part concat (MusicGen's delay pattern: codebook ``k`` of ``codes [batch, codebooks, seq]``
sliced off, shifted ``k`` frames by a ``slice_`` and a ``pad`` along ``seq``, the parts joined
over ``codebooks`` again): where every operand is a chain of slices, pads and shifts of one
tensor ``x``, read by nothing else, whose only cut along the concat's dim is a slice and whose
slices tile that dim in order, the concat is ``x`` with each part's window applied to the
positions of the dim it came from.  Windows along other dims treat the concat's dim as a batch
dim, so part ``k`` is ``window_k(x)`` at positions ``[start_k, stop_k)``: the node is lowered as
``where(position >= start_k, window_k(x), ...)`` of windows of the whole ``x``
(:func:`absorbed_parts` finds such chains before lowering; the chains are not lowered).  A
window is one shift and a mask of the fill, so under a split concat dim nothing moves (each
rank's positions are its own parts), and over a split window dim the shifts of ``x`` share one
halo exchange of the largest shift (:func:`.halo.extend`), where each slice and pad traded its
own; where the dim is whole and the parts' own exchanges cost less (shifts past a neighbour's
block, or in opposite directions), each part is its slice through one shift and mask instead
(:func:`_shares_halos`).  The gradient, a sum of the parts' gradients each padded back to its
place along the dim, is the same form and lowered the same way (:func:`_summed_parts`).  The
local work grows with the number of distinct windows (each is applied to the whole local
block), so this is done only where the layout splits the concat's dim or a window's dim.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.graph import topo_nodes
from ..ops.elementwise import add, greater_equal, less, logical_and, where
from ..ops.embed import arange
from ..ops.slicing import concat, pad, shift, slice_
from .composite import lower_composite
from .concat_contract import contracted_parts
from .generic import lower_generic
from .rules import lowering

WINDOWS = ("slice", "pad", "shift")


def composite_concat(xs, dim: str, sizes) -> list:
    """``concat(xs, dim)`` as the sum of each operand padded to its place along ``dim``."""
    total, start, out = sum(sizes), 0, None
    for x, size in zip(xs, sizes):
        placed = pad(x, dim, start, total - start - size)
        out = placed if out is None else add(out, placed)
        start += size
    return [out]


# -- per-part concat -------------------------------------------------------------------------

@dataclass(frozen=True)
class Window:
    """Slices, pads and shifts along one dim of length ``n``, composed: position ``i`` of the
    result is the source's ``i - s`` for ``lo <= i < hi``, ``fill`` elsewhere; ``length`` long."""

    s: int
    lo: int
    hi: int
    length: int
    fill: float | None = None   # the one value the windows fill with (None: none filled yet)

    def then(self, node) -> "Window | None":
        """This window followed by the slice, pad or shift ``node``; None where it is no such
        window (a roll, or two fill values)."""
        a, name = node.attrs, node.op.name
        if name == "slice":
            start, stop = a["start"], a["stop"]
            return Window(self.s - start, max(self.lo - start, 0), min(self.hi - start, stop - start),
                          stop - start, self.fill)
        if name == "pad":
            b, e = a["before"], a["after"]
            return _filled(Window(self.s + b, self.lo + b, self.hi + b, self.length + b + e, self.fill),
                           a["value"] if b or e else None)
        if a["wrap"]:
            return None
        o = a["offset"]
        return _filled(Window(self.s + o, max(self.lo + o, 0), min(self.hi + o, self.length), self.length,
                              self.fill), 0.0 if o else None)

    def apply(self, x, dim):
        """``x`` (of length ``length`` along ``dim``) through this window."""
        if (self.lo <= 0 and self.hi >= self.length) or (self.fill == 0.0 and (self.lo, self.hi) == (
                max(self.s, 0), min(self.length + self.s, self.length))):
            return x if not self.s else shift(x, dim, self.s)   # no fill, or just the shift's zeros
        pos = arange(x.shape.get(dim))
        keep = logical_and(greater_equal(pos, max(self.lo, 0)), less(pos, self.hi))
        fill = self.fill if x.dtype.is_floating_point else int(self.fill)
        return where(keep, shift(x, dim, self.s) if self.s else x, fill)


def _filled(w: Window, value) -> Window | None:
    if value is None or w.fill is None or w.fill == value:
        return Window(w.s, w.lo, w.hi, w.length, w.fill if value is None else float(value))
    return None


def _chain(lw, t, dim: str):
    """``(source, start, stop, windows)`` of a concat operand ``t`` made from ``source`` by slices,
    pads and shifts read by nothing else, one of them a slice ``[start, stop)`` along ``dim`` and
    none other along it (``windows``: dim -> :class:`Window`, in the order met); None otherwise."""
    chain, cur = [], t
    while cur.node is not None and cur.node.op.name in WINDOWS and (cur is t or lw.num_uses(cur) == 1):
        chain.append(cur.node)
        cur = cur.node.inputs[0]
    cuts = [n for n in chain if n.attrs["dim"] == dim]
    if len(cuts) != 1 or cuts[0].op.name != "slice" or lw.num_uses(t) != 1:
        return None
    windows = {}
    for n in reversed(chain):
        d = n.attrs["dim"]
        if d == dim:
            continue
        size = cur.shape.get(d).size
        w = windows.get(d, Window(0, 0, size, size)).then(n)
        if w is None:
            return None
        windows[d] = w
    if any(w.length != cur.shape.get(d).size or (w.fill is None and (w.lo > 0 or w.hi < w.length))
           for d, w in windows.items()):
        return None
    if not cur.dtype.is_floating_point and (cur.dtype == torch.bool or any(
            w.fill is not None and not float(w.fill).is_integer() for w in windows.values())):
        return None   # (a where of that fill would not be the pad's value)
    return cur, cuts[0].attrs["start"], cuts[0].attrs["stop"], windows, chain


def _per_part(lw, chains, out, dim: str):
    """``(source, [(start, windows)], chain nodes)`` where ``chains`` (of :func:`_chain`) are the
    parts of a per-part concat (see the module docstring) making ``out``, whose concat dim or
    window dims the layout splits; None otherwise."""
    if len(chains) < 2 or any(c is None for c in chains) or len({id(c[0]) for c in chains}) != 1:
        return None
    src = chains[0][0]
    if [(d.name, d.size) for d in src.shape] != [(d.name, d.size) for d in out.shape]:
        return None
    at = 0
    for _, start, stop, _, _ in chains:
        if start != at:
            return None
        at = stop
    if at != src.shape.get(dim).size:
        return None
    dims = {dim} | {d for c in chains for d in c[3]}
    if not any(lw.target(t).axes_of(d) for t in (src, out) for d in dims):
        return None
    return src, [(c[1], c[3]) for c in chains], [n for c in chains for n in c[4]]


def _summed_parts(lw, node):
    """The :func:`_per_part` of a sum of parts each padded back to its place along one dim (the
    gradient of a per-part concat: ``add``s, read by nothing else, of ``pad(part_k, dim, start,
    n - stop)``), rooted at ``node``; None otherwise."""
    leaves, todo, adds = [], list(node.inputs), [node]
    while todo:
        t = todo.pop()
        if t.node is not None and t.node.op.name == "add" and lw.num_uses(t) == 1 and len(t.node.inputs) == 2:
            adds.append(t.node)
            todo += t.node.inputs
        else:
            leaves.append(t)
    if any(t.node is None or t.node.op.name != "pad" or lw.num_uses(t) != 1 for t in leaves):
        return None
    dims = {t.node.attrs["dim"] for t in leaves}
    if len(dims) != 1:
        return None
    dim = dims.pop()
    leaves.sort(key=lambda t: t.node.attrs["before"])
    chains = [_chain(lw, t.node.inputs[0], dim) for t in leaves]
    n = node.outputs[0].shape.get(dim).size
    if any(c is None for c in chains) or any(
            (t.node.attrs["before"], t.node.attrs["after"], t.node.attrs["value"]) != (c[1], n - c[2], 0.0)
            for t, c in zip(leaves, chains)):
        return None
    found = _per_part(lw, chains, node.outputs[0], dim)
    return found and (*found[:2], found[2] + [t.node for t in leaves] + adds[1:], dim)


def absorbed_parts(lw, nodes) -> dict:
    """Per-part concats among ``nodes`` (see the module docstring) and their gradients, sums of
    parts padded back to their places: node id -> the rule that lowers it from its parts' source,
    or None for a node of a part, which is not lowered; and einsums of a concat lowered per part
    (:func:`.concat_contract.contracted_parts`)."""
    absorbed = {}
    for node in nodes:   # (in order: a sum's inner adds are tried, and fail to cover the dim, first)
        found = None
        if node.op.name == "concat" and len(node.inputs) > 1:
            dim = node.attrs["dim"]
            found = _per_part(lw, [_chain(lw, t, dim) for t in node.inputs], node.outputs[0], dim)
            found = found and (*found, dim)
        elif node.op.name == "add" and id(node) not in absorbed and any(
                t.node is not None and t.node.op.name == "pad" for t in node.inputs):
            found = _summed_parts(lw, node)
        if found:
            src, parts, chain, dim = found
            absorbed.update(dict.fromkeys(map(id, chain)))
            absorbed[id(node)] = lambda lw, node, src=src, parts=parts, dim=dim: _lower_per_part(
                lw, node, src, parts, dim)
    return {**absorbed, **contracted_parts(lw, nodes, absorbed)}


def from_source(x, dim: str, parts, shared: bool = True) -> list:
    """The per-part concat of ``x``.  ``shared``: each part's windows applied to the whole ``x``
    (parts with the same windows share them), kept at the part's positions of ``dim``; else each
    part's slice of ``x`` through its windows, concatenated (``dim`` whole: local)."""
    if not shared:
        stops = [start for start, _ in parts[1:]] + [x.shape.get(dim).size]
        return [concat([_windowed(slice_(x, dim, start, stop), windows)
                        for (start, windows), stop in zip(parts, stops)], dim)]
    out, done = None, {}
    for start, windows in parts:
        key = tuple(sorted(windows.items()))
        if key not in done:
            done[key] = _windowed(x, windows)
        y = done[key]
        out = y if out is None else where(greater_equal(arange(x.shape.get(dim)), start), y, out)
    return [out]


def _windowed(x, windows: dict):
    for d, w in windows.items():
        x = w.apply(x, d)
    return x


def _shares_halos(lw, src, dim: str, parts) -> bool:
    """Whether to build the parts from the whole source (:func:`from_source`): always where the
    layout splits the concat's dim (a part's slice would be a partial sum), else where one halo
    exchange of the source per window dim, as wide as the widest part's and within the
    neighbours' blocks, costs less than each part's own exchange of its slice's rows."""
    sh, mesh = lw.target(src), lw.mesh
    if sh.axes_of(dim):
        return True
    n, size = src.shape.get(dim).size, sh.local_numel(src.shape, mesh) * src.dtype.itemsize
    stops = [start for start, _ in parts[1:]] + [n]
    shared = own = 0.0
    for d in {d for _, windows in parts for d in windows}:
        p = mesh.axis_size(sh.axes_of(d))
        if p <= 1:
            continue
        if max(abs(ws[d].s) for _, ws in parts if d in ws) > src.shape.get(d).size // p:
            return False   # past a neighbour's block: not one halo (each part's own slice moves less)
        row = size // -(-src.shape.get(d).size // p)   # bytes of one row of the largest block along d
        for side in (1, -1):
            widths = [max(side * w.s, 0) if w.lo < w.hi else 0 for _, ws in parts for w in (ws.get(d),) if w]
            shared += lw.cost.collective("permute", max(widths, default=0) * row, p) if any(widths) else 0.0
            own += sum(lw.cost.collective("permute", max(side * ws[d].s, 0) * row * (stop - start) // n, p)
                       for (start, ws), stop in zip(parts, stops) if d in ws and side * ws[d].s > 0)
    return shared <= own


def _read(lw, outs: list) -> list:
    """``outs``, their sub-graph's tensors marked read by this plan, so that the shifts of the
    source find each other (:func:`.halo.readers`) and share one halo exchange."""
    lw.used.update(id(t) for n in topo_nodes(outs, {}) for t in n.inputs)
    return outs


def _lower_per_part(lw, node, src, parts, dim: str) -> None:
    """Lower a per-part concat (or its gradient's sum) ``node`` from the parts' source ``src``."""
    lw.note(f"{node.name}: its {len(parts)} parts are windows of slices of one tensor along '{dim}': "
            "built from that tensor, each rank's positions from its own block")
    shared = _shares_halos(lw, src, dim, parts)
    lower_composite(lw, node, lambda x: _read(lw, from_source(x, dim, parts, shared)), inputs=[src])


@lowering("concat")
def lower_concat(lw, node) -> None:
    dim = node.attrs["dim"]
    arrives_split = any(lw.sharding(lw.value(t)).axes_of(dim) for t in node.inputs)
    if not arrives_split or not lw.target(node.outputs[0]).axes_of(dim):
        lower_generic(lw, node)
        return
    lower_composite(lw, node, lambda *ins: composite_concat(ins, dim, node.attrs["sizes"]))
