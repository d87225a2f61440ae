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
Where no exchange with the neighbours reaches (a window beyond the next rank, fewer output
rows than ranks), the reader gathers the dim, unless it asks for :meth:`Reach.far_widths` (a
dilated conv over equal blocks, priced by its lowering): then the rows come from the ranks
further on too, whole blocks and the edge rows past them (:func:`hops`), one permute each.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..core.shape import Dim, Shape
from ..layout.sharding import Sharding


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

    def far_widths(self, n: int, p: int) -> tuple[int, int] | None:
        """:meth:`widths` of a zero-filled window over ``p`` equal blocks, however far it reaches:
        rows beyond the neighbour come from the ranks further on (:func:`extend`); None for a
        roll or an unequal split."""
        if self.wrap or n % p or self.m % p:
            return None
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


def _reaches(lw, t, dim: str):
    """Every reach into ``t`` along ``dim`` of the readers this plan lowers, through virtual pads."""
    out = []
    for node, slot in readers(lw, t):
        fn = READS.get(node.op.name)
        r = fn(node, slot, dim) if fn else None
        if r is None:
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
    return x.narrow(pos, x.shape[pos] - width, width) if attrs["last"] else x.narrow(pos, 0, width)


def _glue(ctx, attrs, x, *got):
    """``x`` with the rows received glued on: ``attrs["left"]`` / ``["right"]`` list each side's
    pieces nearest rank first, (rows, whether a permute sent them)."""
    pos, got = attrs["pos"], list(got)
    parts = [x]
    for side, left in ((attrs["left"], True), (attrs["right"], False)):
        for width, sent in side:
            part = got.pop(0) if sent else None
            if part is None:
                # A rank at the end of a dim that does not wrap has no neighbour there: its readers
                # never take those rows as data (they read the fill), so zeros stand in.
                part = x.new_zeros(x.shape[:pos] + (width,) + x.shape[pos + 1:])
            parts.insert(0 if left else len(parts), part)
    return torch.cat(parts, dim=pos)


def hops(width: int, nb: int, p: int) -> list[tuple[int, int]]:
    """The pieces of a halo of ``width`` rows over blocks of ``nb``, nearest rank first: (rows,
    ranks away). Within one block, one piece from the neighbour; beyond it, whole blocks from
    the ranks on and the edge rows of the one past them (none from beyond the dim's ``p`` ranks)."""
    if width <= nb:
        return [(width, 1)]
    q, r = divmod(width, nb)
    return [(nb, k) for k in range(1, q + 1)] + ([(r, q + 1)] if r else [])


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
    if hit is not None and hit[0] >= widths[0] and hit[1] >= widths[1]:
        return hit[0], hit[2]
    n = t.shape.get(dim).size
    group = [w for w in (r.widths(n, p, cut_by(mesh, axes)) for r in _reaches(lw, t, dim)
                         if r.wrap == reach.wrap) if w is not None]
    hl = max([widths[0]] + [w[0] for w in group])
    hr = max([widths[1]] + [w[1] for w in group])
    if not hl and not hr:
        return 0, vid
    pos = v.shape.index(dim)
    sizes = {d.name: d.size for d in v.shape}
    shared = f", shared by {len(group)} readers" if len(group) > 1 else ""
    got, glue = [], {"pos": pos, "left": [], "right": []}
    for width, offset, side in ((hl, 1, "left"), (hr, -1, "right")):
        for rows, k in (hops(width, n // p, p) if width else ()):
            glue[side].append((rows, k < p))
            if k >= p:     # beyond the dim's end for every rank: fill, zeros stand in
                continue
            piece = vid
            if rows < n // p or n % p:
                piece = lw.new_value(resized(v.shape, dim, rows * p), v.dtype, sh)
                lw.emit("local", node, [vid], [piece], args={"fn": strip_rows, "attrs": {
                    "pos": pos, "width": rows, "last": offset > 0}, "compute": sh.split, "sizes": sizes})
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
