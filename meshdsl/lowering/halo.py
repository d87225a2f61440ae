"""Halo exchanges: ops that read a bounded window of a split dim trade strips with their neighbours.

An op *reaches* along a dim when its output position ``i`` reads source positions
``i - s .. i - s + e`` (a :class:`Reach`: pad ``s = before``; slice ``s = -start``; shift
and roll ``s = offset``; a conv ``s = before``, ``e = taps - 1``).  With the dim split over
axes A (``p`` ranks, blocks of ``nb = n / p``) and an output that keeps the split (its
size ``m`` a multiple of ``p``), rank r reads ``[r*mb - s, (r+1)*mb - s + e)``: its own
block and at most ``hl`` positions of its left neighbour's, ``hr`` of its right one's
(positions outside ``[0, n)`` are the op's fill, or wrap around for roll).  Each rank
sends its last ``hl`` rows right and its first ``hr`` rows left (two ``permute``\\ s over
A, labelled ``halo`` in the plan), and glues them around its block: the *extended block*,
source positions ``r*nb - hl .. (r+1)*nb + hr``, from which the op's local kernel takes
its window (:func:`take`).

Every reader of one value along one dim shares one exchange, as wide as the widest of
them needs (the taps of a convolution written as shifts: one strip per neighbour, not
one per tap).  A ``pad`` whose every reader is a ``slice``, ``pad`` or ``shift`` along the
same dim is not materialised: its readers reach through it into its input (*virtual*
pads), so the "same" convolution written as ``pad`` then ``slice``\\ s keeps the input's
split and moves only the halo.  An unevenly split dim (blocks as ``torch.tensor_split``
cuts, :func:`halo_parts`) trades halos the same way: each rank's output block, cut from the
output's length likewise, reads its window from its own source block and its neighbours'.
There the ranks need different rows of their neighbours (the first 4 of 7 rows over 3 ranks:
rank 1 reads rank 0's last row, rank 2 rank 1's first), so each rank sends the strip its
neighbour reads, as wide as the widest one, and the neighbour places it where those rows lie
(:func:`strips`), rather than every rank sending its last ``hl`` rows alike.
Where no exchange with the neighbours reaches (a window beyond the next rank, fewer output
rows than ranks), the reader gathers the dim, unless it asks for :meth:`Reach.far_widths` (a
dilated conv, a far shift or window, priced by its lowering): then the rows come from the ranks
further on too, over equal blocks whole blocks and the edge rows past them (:func:`hops`), one
permute each; over unequal blocks the rows each rank reads, from the ranks that hold them
(:mod:`.halo_routes`, one exchange for every reader of the value there, :func:`far_group`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..core.shape import Dim, Shape
from ..layout.sharding import Sharding
from .halo_routes import exchange, hops, routes


@dataclass(frozen=True)
class Reach:
    """Output position ``i`` (of ``m``) reads source positions ``i - s`` .. ``i - s + e``;
    outside the source it reads ``fill``, or wraps around when ``wrap``."""

    s: int
    m: int
    e: int = 0
    fill: float = 0.0
    wrap: bool = False

    def widths(self, n: int, p: int, cut=None) -> tuple[int, int] | None:
        """``(hl, hr)``: the rows each rank needs from its left and right neighbours, the source
        dim (size ``n``) and the output split in ``p`` blocks; None when some rank reads beyond
        its neighbours.  A size ``p`` does not divide is cut into unequal blocks by ``cut``
        (size -> ((offset, length), ...) in the neighbours' order, :func:`halo_parts`); without
        it such a split has no halo (None)."""
        if n % p or self.m % p:
            return self._block_widths(n, cut(n), cut(self.m)) if cut and self.m >= p else None
        nb, mb = n // p, self.m // p
        return self._block_widths(n, [(r * nb, nb) for r in range(p)], [(r * mb, mb) for r in range(p)])

    def far_widths(self, n: int, p: int, cut=None) -> tuple[int, int] | None:
        """:meth:`widths` of a zero-filled window over ``p`` blocks, however far it reaches:
        rows beyond the neighbour come from the ranks further on (:func:`extend`); None for a
        roll, or an unequal split without ``cut`` (with it: :mod:`.halo_routes`)."""
        if self.wrap:
            return None
        if n % p or self.m % p:
            return self._block_widths(n, cut(n), cut(self.m), far=True) if cut and self.m >= p else None
        nb, mb = n // p, self.m // p
        return self._block_widths(n, [(r * nb, nb) for r in range(p)], [(r * mb, mb) for r in range(p)], far=True)

    def _block_widths(self, n: int, parts, out_parts, far: bool = False) -> tuple[int, int] | None:
        """:meth:`widths` over source blocks ``parts`` and output blocks ``out_parts``
        ((offset, length) each, in the neighbours' order); ``far``: no limit of one block."""
        hl = hr = 0
        for (off, ln), (o_off, o_ln) in zip(parts, out_parts):
            lo, hi = o_off - self.s, o_off + o_ln - self.s + self.e
            if not self.wrap:
                lo, hi = max(lo, 0), min(hi, n)
                if lo >= hi:
                    continue
            hl, hr = max(hl, off - lo), max(hr, hi - off - ln)
        shortest = min(ln for _, ln in parts)   # every rank sends its own last hl (first hr) rows
        return (hl, hr) if far or (hl <= shortest and hr <= shortest) else None

    def through_pad(self, before: int, fill: float) -> "Reach":
        """This reach, read through a pad of ``before`` positions of ``fill``: over the pad's input."""
        return Reach(self.s + before, self.m, self.e, fill, self.wrap)


#: op name -> ``reach(node, slot, dim)``: the :class:`Reach` of the node's input ``slot`` along
#: ``dim``, or None when it reads that input whole there.  The conv rules add theirs.
READS: dict[str, Callable] = {}


def reads(*op_names: str):
    """Decorator: register ``reach(node, slot, dim)`` for the ops named."""
    def deco(fn):
        for name in op_names:
            READS[name] = fn
        return fn
    return deco


@reads("pad", "slice", "shift")
def window_reach(node, slot: int, dim: str) -> Reach | None:
    """The reach of pad, slice and shift/roll along their dim."""
    a = node.attrs
    if slot or a["dim"] != dim:
        return None
    n = node.inputs[0].shape.get(dim).size
    if node.op.name == "pad":
        return Reach(a["before"], n + a["before"] + a["after"], fill=a["value"])
    if node.op.name == "slice":
        return Reach(-a["start"], a["stop"] - a["start"])
    return Reach(a["offset"], n, wrap=a["wrap"])


def cut_by(mesh, axes):
    """``size -> halo_parts(size, mesh, axes)``: the ``cut`` of :meth:`Reach.widths`."""
    return lambda size: halo_parts(size, mesh, axes)


def halo_parts(n: int, mesh, axes) -> tuple[tuple[int, int], ...]:
    """``(offset, length)`` of each block of a dim of ``n`` split over ``axes``, in the order
    of the neighbours a halo permute trades with (each axis, major first, cuts as
    :func:`~meshdsl.layout.sharding.chunk` does)."""
    parts = [(0, n)]
    for a in axes:
        k, cut = mesh.sizes[a], []
        for off, ln in parts:
            q, r = divmod(ln, k)
            cut += [(off + i * q + min(i, r), q + (i < r)) for i in range(k)]
        parts = cut
    return tuple(parts)


# ----------------------------------------------------------------------------- readers and virtual pads

def readers(lw, t) -> list:
    """``(node, slot)`` for each input slot of a node this plan lowers that reads ``t``."""
    key = ("readers", t.graph.uid)
    table = lw.memo.get(key)
    if table is None:
        table = lw.memo[key] = {}
        for n in t.graph.nodes:
            for slot, x in enumerate(n.inputs):
                table.setdefault(id(x), []).append((n, slot))
    return [(n, slot) for n, slot in table.get(id(t), ()) if any(id(o) in lw.used for o in n.outputs)]


def _composes(reader, slot: int, pad) -> bool:
    """Whether ``reader`` can read through ``pad`` into its input (see the module docstring)."""
    a, b = reader.attrs, pad.attrs
    if slot or reader.op.name not in ("slice", "pad", "shift") or a["dim"] != b["dim"]:
        return False
    if reader.op.name == "pad":
        return a["value"] == b["value"]
    return reader.op.name == "slice" or (not a["wrap"] and b["value"] == 0.0)


def is_virtual(lw, pad) -> bool:
    """Whether the pad node is not materialised: every use of its output reads through it."""
    if pad.op.name != "pad":
        return False
    out = pad.outputs[0]
    if lw.memo.get(("virtual", id(out))):
        return True
    if id(out) in lw.env:
        return False
    rs = readers(lw, out)
    return bool(rs) and len(rs) == lw.num_uses(out) and all(_composes(r, slot, pad) for r, slot in rs)


def through(lw, t, reach: Reach):
    """``(source, reach)``: ``t`` and ``reach``, moved through the virtual pads that made ``t``."""
    while lw.memo.get(("virtual", id(t))):
        pad = t.node
        reach = reach.through_pad(pad.attrs["before"], pad.attrs["value"])
        t = pad.inputs[0]
    return t, reach


def commuted(lw, node):
    """The inner shift a shift ``node`` along a split dim reads through, or None: where its input
    is a shift of ``x`` along another dim that ``x``'s layout keeps whole, the two commute
    (``shift_w(shift_h(x)) == shift_h(shift_w(x))``, fill or wrap), so ``node`` shifts ``x`` itself
    along its split dim (one exchange of ``x``, shared with every other reader) and then, locally,
    along the whole one.  A depthwise 2-D conv under ``width:model``: each width shift read its
    own height-shifted tensor and traded a halo of its own."""
    inner = node.inputs[0].node if node.op.name == "shift" else None
    if inner is None or inner.op.name != "shift" or inner.attrs["dim"] == node.attrs["dim"] \
            or id(inner.inputs[0]) not in lw.env or lw.memo.get(("virtual", id(inner.inputs[0]))):
        return None
    sh = lw.sharding(lw.value(inner.inputs[0]))
    if not sh.axes_of(node.attrs["dim"]) or sh.axes_of(inner.attrs["dim"]):
        return None
    return inner


def _reaches(lw, t, dim: str):
    """Every reach into ``t`` along ``dim`` of the readers this plan lowers, through virtual pads
    and through the shifts along another dim that its readers commute with (:func:`commuted`)."""
    out = []
    for node, slot in readers(lw, t):
        fn = READS.get(node.op.name)
        r = fn(node, slot, dim) if fn else None
        if r is None:
            if node.op.name == "shift" and not slot:
                out += [window_reach(n, 0, dim) for n, k in readers(lw, node.outputs[0])
                        if not k and n.op.name == "shift" and n.attrs["dim"] == dim and commuted(lw, n) is node]
            continue
        if is_virtual(lw, node):
            a = node.attrs
            out += [x.through_pad(a["before"], a["value"]) for x in _reaches(lw, node.outputs[0], dim)]
        else:
            out.append(r)
    return out


# ----------------------------------------------------------------------------- the exchange

def resized(shape: Shape, name: str, size: int) -> Shape:
    return Shape(Dim(d.name, size) if d.name == name else d for d in shape)


def strip_rows(ctx, attrs, x):
    pos, width = attrs["pos"], attrs["width"]
    if "starts" in attrs:   # per-rank strips: where this rank's rows start in its block, by its offset
        return x.narrow(pos, dict(attrs["starts"])[ctx.offset(attrs["dim"])], width)
    return x.narrow(pos, x.shape[pos] - width, width) if attrs["last"] else x.narrow(pos, 0, width)


def _glue(ctx, attrs, x, *got):
    """``x`` with the rows received glued on: ``attrs["left"]`` / ``["right"]`` list each side's
    pieces nearest rank first, (rows, whether a permute sent them); ``attrs["place"]``, for a side
    whose one piece is a per-rank strip (:func:`strips`), ``(left, rows, ((offset, at), ...))``:
    the strip lies ``at`` rows into that side's ``rows``, by this rank's block offset."""
    pos, got = attrs["pos"], list(got)
    parts = [x]

    def zeros(rows):
        return x.new_zeros(x.shape[:pos] + (rows,) + x.shape[pos + 1:])
    for side, left in ((attrs["left"], True), (attrs["right"], False)):
        for width, sent in side:
            part = got.pop(0) if sent else None
            if part is None:
                # A rank at the end of a dim that does not wrap has no neighbour there: its readers
                # never take those rows as data (they read the fill), so zeros stand in.
                part = zeros(width)
            place = {on_left: (rows, at) for on_left, rows, at in attrs.get("place", ())}.get(left)
            if place is not None:   # a per-rank strip: its place in the side's rows (none read the rest)
                at = dict(place[1]).get(ctx.offset(attrs["dim"]), 0)
                part = torch.cat([zeros(at), part, zeros(place[0] - at - width)], dim=pos)
            parts.insert(0 if left else len(parts), part)
    return torch.cat(parts, dim=pos)


def strips(reaches, n: int, cut, hl: int, hr: int) -> dict:
    """Per-rank strips of a halo over the blocks ``cut`` makes of the source (size ``n``) and of
    each reach's output ((offset, length) each, in the neighbours' order), for each side whose
    widest need is narrower than its rows (``hl`` left, ``hr`` right): ``{left: (width, sends,
    places)}``.  Every rank
    sends ``width`` rows starting ``sends[offset]`` into its block (by its block's offset), and
    its neighbour places them ``places[offset]`` (by the receiver's offset) into that side's
    rows; the rows none of ``reaches`` reads there stay zero.  Over uneven blocks (or a slice
    shorter than the ranks' blocks) the ranks need different rows of their neighbours: sending
    each its last ``hl`` rows alike moved rows nobody reads."""
    need = {True: {}, False: {}}   # side -> receiver index -> the source rows it reads there
    parts = cut(n)
    for r in reaches:
        for i, ((off, ln), (oo, ol)) in enumerate(zip(parts, cut(r.m))):
            lo, hi = max(oo - r.s, 0), min(oo + ol - r.s + r.e, n)
            for left, a, b in ((True, lo, min(hi, off)), (False, max(lo, off + ln), hi)):
                if a < b:
                    was = need[left].get(i, (a, b))
                    need[left][i] = (min(was[0], a), max(was[1], b))
    out = {}
    for left, rows in ((True, hl), (False, hr)):
        width = max((b - a for a, b in need[left].values()), default=0)
        if not 0 < width < rows:
            continue
        sends, places = [], []
        for i, (off, ln) in enumerate(parts):
            j = i + 1 if left else i - 1    # the rank it sends to
            if not 0 <= j < len(parts):
                sends.append((off, ln - width if left else 0))
                continue
            r_off, r_ln = parts[j]
            edge = r_off if left else r_off + r_ln   # where the receiver's side rows end (begin)
            a, b = need[left].get(j, (edge - width, edge) if left else (edge, edge + width))
            start = min(a, edge - width) if left else max(edge, b - width)
            sends.append((off, start - off))
            places.append((r_off, start - (edge - rows) if left else start - edge))
        out[left] = (width, tuple(sends), tuple(places))
    return out


def by_routes(n: int, p: int, m: int, cut, widths) -> bool:
    """Whether a halo of ``widths`` rows over ``n`` source rows in ``p`` blocks (an output of
    ``m``) takes its rows by :mod:`.halo_routes`: an unequal split it reaches past a neighbour of."""
    return bool(n % p or m % p) and max(widths) > min(ln for _, ln in cut(n))


def piece_rows(reaches, n: int, p: int, cut, widths) -> list[int]:
    """The rows of each permute a halo of ``widths`` for ``reaches`` moves (to price it)."""
    if by_routes(n, p, reaches[0].m, cut, widths):
        return [rt.width for rt in routes(reaches, n, cut, *widths)]
    return [rows for w in widths if w for rows, k in hops(w, n // p, p) if k < p]


def far_group(lw, t, dim: str, reach: Reach, n: int, p: int, cut) -> tuple[tuple[Reach, ...], tuple[int, int]]:
    """The zero-filled reaches into ``t`` along ``dim`` that one exchange over uneven blocks
    (:mod:`.halo_routes`) serves with ``reach``, and the widths it needs: every reader's, however
    far (the taps of a dilated conv written as shifts share one exchange)."""
    group = [(r, r.far_widths(n, p, cut)) for r in _reaches(lw, t, dim) if not r.wrap]
    group = [(r, w) for r, w in group if w is not None]
    if reach not in [r for r, _ in group]:
        group.append((reach, reach.far_widths(n, p, cut) or (0, 0)))
    return tuple(r for r, _ in group), (max(w[0] for _, w in group), max(w[1] for _, w in group))


def extend(lw, node, t, vid: int, dim: str, reach: Reach, widths: tuple[int, int]) -> tuple[int, int]:
    """``(hl, ext)``: value ``vid`` (of tensor ``t``, ``dim`` split) with its
    neighbours' rows glued on along ``dim``: at least ``widths``, and as many as any reader of
    ``t`` there needs, exchanged once per value, dim and wrap (see the module docstring)."""
    v, mesh = lw.values[vid], lw.mesh
    sh = v.sharding
    axes = sh.axes_of(dim)
    p = mesh.axis_size(axes)
    key = ("halo", vid, dim, reach.wrap)
    hit = lw.memo.get(key)
    if hit is not None and hit[0] >= widths[0] and hit[1] >= widths[1] and _serves(lw, hit[2], reach):
        return hit[0], hit[2]
    n, cut = t.shape.get(dim).size, cut_by(mesh, axes)
    group = [(r, w) for r, w in ((r, r.widths(n, p, cut)) for r in _reaches(lw, t, dim) if r.wrap == reach.wrap)
             if w is not None]
    hl = max([widths[0]] + [w[0] for _, w in group])
    hr = max([widths[1]] + [w[1] for _, w in group])
    if not hl and not hr:
        return 0, vid
    served = tuple(r for r, _ in group)
    pos = v.shape.index(dim)
    shared = f", shared by {len(group)} readers" if len(group) > 1 else ""
    far = far_group(lw, t, dim, reach, n, p, cut) if not reach.wrap and (n % p or reach.m % p) else None
    if far and by_routes(n, p, reach.m, cut, (max(hl, far[1][0]), max(hr, far[1][1]))):
        # uneven blocks, some reader past a neighbour's: one exchange by routes serves them all
        served, hl, hr = far[0], max(hl, far[1][0]), max(hr, far[1][1])
        shared = f", shared by {len(served)} readers" if len(served) > 1 else ""
        ext = exchange(lw, node, vid, dim, routes(served, n, cut, hl, hr), hl, hr, served, shared)
        lw.memo[key] = (hl, hr, ext)
        return hl, ext
    per = strips(served, n, cut, hl, hr) if not reach.wrap and reach in served and max(hl, hr) <= n // p else {}
    sizes = {d.name: d.size for d in v.shape}
    got, glue = [], {"pos": pos, "left": [], "right": [], "dim": dim, "place": (), "served": served if per else None}
    for width, offset, side in ((hl, 1, "left"), (hr, -1, "right")):
        strip = per.get(offset > 0)
        if strip is not None:   # each rank sends the rows its neighbour reads, placed there
            glue["place"] += ((offset > 0, width, strip[2]),)
        for rows, k in ((strip[0], 1),) if strip else (hops(width, n // p, p) if width else ()):
            glue[side].append((rows, k < p))
            if k >= p:     # beyond the dim's end for every rank: fill, zeros stand in
                continue
            piece = vid
            if rows < n // p or n % p or strip:
                piece = lw.new_value(resized(v.shape, dim, rows * p), v.dtype, sh)
                attrs = {"pos": pos, "width": rows, "last": offset > 0}
                if strip:
                    attrs = {**attrs, "dim": dim, "starts": strip[1]}
                lw.emit("local", node, [vid], [piece], args={"fn": strip_rows, "attrs": attrs,
                                                            "compute": sh.split, "sizes": sizes})
            got.append(lw.new_value(lw.values[piece].shape, v.dtype, sh))
            where = f"the {side} neighbour" if k == 1 else f"the rank {k} to the {side}"
            lw.emit("permute", node, [piece], [got[-1]], axes, args={"offset": offset * k, "wrap": reach.wrap},
                    nbytes=lw.values[piece].local_bytes(mesh),
                    note=f"halo: {rows} '{dim}' row{'s' if rows > 1 else ''} from {where}{shared}")
    glue = {**glue, "left": tuple(glue["left"]), "right": tuple(glue["right"])}
    # each block grows by hl + hr rows: cut as chunk cuts, n + p (hl + hr) has exactly those parts
    ext = lw.new_value(resized(v.shape, dim, v.shape.get(dim).size + (hl + hr) * p), v.dtype, sh)
    lw.emit("local", node, [vid] + got, [ext], args={"fn": _glue, "attrs": glue, "compute": sh.split,
                                                     "sizes": sizes})
    lw.memo[key] = (hl, hr, ext)
    return hl, ext


def _serves(lw, ext: int, reach: Reach) -> bool:
    """Whether the exchange that glued ``ext`` gives ``reach`` its rows: any does, but one of
    per-rank strips (:func:`strips`) only the reaches it was cut for (its glue's ``served``)."""
    glue = next((s for s in reversed(lw.steps) if s.outs == (ext,)), None)
    served = glue.args["attrs"].get("served") if glue is not None and "attrs" in glue.args else None
    return served is None or reach in served


# ----------------------------------------------------------------------------- the local window

def window_attrs(reach: Reach, dim: str, pos: int, n: int, p: int, hl: int, cut=None) -> dict:
    """What :func:`take_window` needs: the reach, the source dim (size ``n``, ``p`` blocks, at
    ``pos``) and the rows ``hl`` glued before the block (0 when the dim is whole); for an
    unequal split of a window that changes the length, each source block's output block
    (``blocks``: (source offset, output offset, output length), from ``cut``)."""
    w = {"dim": dim, "pos": pos, "n": n, "p": p, "s": reach.s, "m": reach.m, "e": reach.e,
         "fill": reach.fill, "wrap": reach.wrap, "hl": hl}
    if p > 1 and reach.m != n and (n % p or reach.m % p):
        w["blocks"] = tuple((o, oo, ol) for (o, _), (oo, ol) in zip(cut(n), cut(reach.m)))
    return w


def take_window(ctx, w: dict, ext):
    """This rank's window of the source along ``w["dim"]``, from its (extended) block ``ext``."""
    off = ctx.offset(w["dim"])
    if "blocks" in w:      # unequal blocks: this rank's output block, by its source block's offset
        o_off, o_len = next((oo, ol) for o, oo, ol in w["blocks"] if o == off)
    elif w["m"] == w["n"]:   # the output block is the source block, even or not
        o_off, o_len = off, ctx.size(w["dim"], w["n"])
    else:
        nb, mb = w["n"] // w["p"], w["m"] // w["p"]
        o_off, o_len = off // nb * mb, mb
    lo = o_off - w["s"]
    return take(ext, w["pos"], off - w["hl"], lo, lo + o_len + w["e"], w["n"], w["fill"], w["wrap"])


def take(ext, pos: int, start: int, lo: int, hi: int, n: int, fill: float, wrap: bool):
    """Source positions ``lo .. hi`` along ``pos`` from ``ext``, which holds positions ``start ..``
    (modulo ``n`` when ``wrap``); positions outside ``[0, n)`` are ``fill`` unless ``wrap``."""
    if wrap:
        off = lo - start
        if off < 0 or off + hi - lo > ext.shape[pos]:   # the whole dim, read across its end
            return torch.roll(ext, -off, pos).narrow(pos, 0, hi - lo)
        return ext.narrow(pos, off, hi - lo)
    a, b = max(lo, 0), min(hi, n)
    if a >= b:
        return ext.new_full(ext.shape[:pos] + (hi - lo,) + ext.shape[pos + 1:], fill)
    mid = ext.narrow(pos, a - start, b - a)
    if (a, b) == (lo, hi):
        return mid
    return F.pad(mid, (0, 0) * (ext.dim() - 1 - pos) + (a - lo, hi - b), value=fill)


def gathered(sh: Sharding, shape: Shape, dim: str) -> Sharding:
    """``sh`` with ``dim`` whole."""
    return Sharding.of(shape, {d: a for d, a in sh.split.items() if d != dim}, sh.partial)
