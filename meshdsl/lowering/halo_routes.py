"""Halo routes: the rows a window over an uneven split needs from ranks past its neighbour.

Over blocks cut as ``torch.tensor_split`` cuts (4, 4, 3 for 11 rows on 3 ranks), a halo wider
than the shortest block reaches past the next rank, and the blocks do not line up with whole
hops, so each rank works out from the static block sizes which ranks hold the rows it reads.
A *route* is one permute ``hop`` ranks away along one side: every rank sends ``width`` rows of
its block, starting where the rank ``hop`` away needs them (``sends``, by the sender's block
offset; rows past the sender's block are zeros), and the receiver places the rows it needs
into its side's rows (``places``, by its own offset); rows no reader needs stay zero, as the
fill a window never reads as data.  ``width`` is the widest need of that hop over the ranks:
every rank sends the same count, so each permute is one even piece.

The backward of a reader that differentiates through the extended block (a sliding-window
attention's keys and values) sends each route's rows back the way they came and adds them onto
the sender's rows (:func:`fold_back`); over blocks a halo reaches by whole hops (:func:`hops`),
each piece goes back one permute the way it came (:func:`fold_halo`, which also folds a conv's
output computed from each rank's own input rows onto the ranks that own its rows).
"""
from __future__ import annotations

from dataclasses import astuple, dataclass

import torch

from ..core.shape import Dim, Shape


@dataclass(frozen=True)
class Route:
    """One permute of a halo over uneven blocks (see the module docstring)."""

    left: bool      # the rows lie before the receiver's block: they come from lower ranks
    hop: int        # how many ranks away the sender is
    width: int      # rows every rank sends
    sends: tuple    # (sender's block offset, the first row it sends, within its block)
    places: tuple   # (receiver's block offset, where the rows go in its side's rows, how many it needs)


def _needs(reaches, parts, cut, n: int) -> list[tuple[int, int] | None]:
    """Per block, the source rows ``[lo, hi)`` its output block reads over all ``reaches``."""
    need: list = [None] * len(parts)
    for r in reaches:
        for i, (oo, ol) in enumerate(cut(r.m)):
            lo, hi = max(oo - r.s, 0), min(oo + ol - r.s + r.e, n)
            if lo < hi:
                was = need[i] or (lo, hi)
                need[i] = (min(was[0], lo), max(was[1], hi))
    return need


def routes(reaches, n: int, cut, hl: int, hr: int) -> tuple[Route, ...]:
    """The routes that bring each block the rows ``reaches`` read outside it (``hl`` rows
    before a block at most, ``hr`` after), over the blocks ``cut`` makes of ``n`` source rows
    and of each reach's output; nearest hop first, left side first."""
    parts = cut(n)
    need, out = _needs(reaches, parts, cut, n), []
    for left in (True, False):
        for hop in range(1, len(parts)):
            got = {}   # receiver -> the rows [a, b) it reads from the block hop away
            for i, (off, ln) in enumerate(parts):
                j = i - hop if left else i + hop
                if need[i] is None or not 0 <= j < len(parts):
                    continue
                lo, hi = (need[i][0], min(need[i][1], off)) if left else (max(need[i][0], off + ln), need[i][1])
                a, b = max(lo, parts[j][0]), min(hi, parts[j][0] + parts[j][1])
                if a < b:
                    got[i] = (j, a, b)
            if not got:
                continue
            sends, places = [], []
            for i, (j, a, b) in got.items():
                off, ln = parts[i]
                area = off - hl if left else off + ln   # the source row the side's rows start at
                assert area <= a and b <= area + (hl if left else hr), (area, a, b, hl, hr)
                sends.append((parts[j][0], a - parts[j][0]))
                places.append((off, a - area, b - a))
            out.append(Route(left, hop, max(b - a for _, a, b in got.values()), tuple(sends), tuple(places)))
    return tuple(out)


def hops(width: int, nb: int, p: int) -> list[tuple[int, int]]:
    """The pieces of a halo of ``width`` rows over blocks of ``nb``, nearest rank first: (rows,
    ranks away). Within one block, one piece from the neighbour; beyond it, whole blocks from
    the ranks on and the edge rows of the one past them (none from beyond the dim's ``p`` ranks)."""
    if width <= nb:
        return [(width, 1)]
    q, r = divmod(width, nb)
    return [(nb, k) for k in range(1, q + 1)] + ([(r, q + 1)] if r else [])


# ----------------------------------------------------------------------------- local kernels

def _rows(x, pos: int, start: int, width: int):
    """Rows ``[start, start + width)`` of ``x`` along ``pos``, zeros past its end."""
    have = max(0, min(width, x.shape[pos] - start))
    part = x.narrow(pos, start, have)
    if have == width:
        return part
    return torch.cat([part, x.new_zeros(x.shape[:pos] + (width - have,) + x.shape[pos + 1:])], dim=pos)


def send_rows(ctx, attrs, x):
    """The rows this rank sends along one route (none needs them where it has no receiver)."""
    return _rows(x, attrs["pos"], dict(attrs["sends"]).get(ctx.offset(attrs["dim"]), 0), attrs["width"])


def glue(ctx, attrs, x, *got):
    """``x`` with each route's rows placed into its side's rows (``hl`` before, ``hr`` after)."""
    pos, off = attrs["pos"], ctx.offset(attrs["dim"])
    sides = {True: x.new_zeros(x.shape[:pos] + (attrs["hl"],) + x.shape[pos + 1:]),
             False: x.new_zeros(x.shape[:pos] + (attrs["hr"],) + x.shape[pos + 1:])}
    for (left, places), part in zip(attrs["routes"], got):
        place = dict((o, (at, rows)) for o, at, rows in places).get(off)
        if part is not None and place is not None:   # a rank with no sender there reads only fill
            sides[left].narrow(pos, place[0], place[1]).copy_(part.narrow(pos, 0, place[1]))
    return torch.cat([sides[True], x, sides[False]], dim=pos)


def cut_back(ctx, attrs, x):
    """The gradient of the rows one route brought this rank, from its extended block's gradient
    ``x``, as the route sent them (zeros where it needed none)."""
    pos, width = attrs["pos"], attrs["width"]
    out = x.new_zeros(x.shape[:pos] + (width,) + x.shape[pos + 1:])
    place = dict((o, (at, rows)) for o, at, rows in attrs["places"]).get(ctx.offset(attrs["dim"]))
    if place is not None:
        start = place[0] if attrs["left"] else x.shape[pos] - attrs["hr"] + place[0]
        out.narrow(pos, 0, place[1]).copy_(x.narrow(pos, start, place[1]))
    return out


def fold(ctx, attrs, x, *got):
    """This rank's own rows of the extended gradient ``x`` plus the rows each route sends back."""
    pos, hl, hr, off = attrs["pos"], attrs["hl"], attrs["hr"], ctx.offset(attrs["dim"])
    length = x.shape[pos] - hl - hr
    out = x.narrow(pos, hl, length).clone()
    for sends, part in zip(attrs["sends"], got):
        start = dict(sends).get(off)
        if part is not None and start is not None:
            rows = min(part.shape[pos], length - start)
            out.narrow(pos, start, rows).add_(part.narrow(pos, 0, rows))
    return out


def cut_rows(ctx, attrs, x):
    """Rows ``[start, start + rows)`` of ``x``'s extended block along ``pos``, ``start`` counted from
    its end when negative."""
    pos, start, rows = attrs["pos"], attrs["start"], attrs["rows"]
    return x.narrow(pos, start if start >= 0 else x.shape[pos] + start, rows)


def fold_rows(ctx, attrs, x, *got):
    """This rank's own rows of the extended block ``x`` plus the rows its neighbours send back:
    ``attrs["adds"]`` lists (rows, whether they add onto the block's last rows) per piece."""
    pos, hl, hr = attrs["pos"], attrs["hl"], attrs["hr"]
    length = x.shape[pos] - hl - hr
    out = x.narrow(pos, hl, length).clone()
    for (rows, last), part in zip(attrs["adds"], got):
        if part is not None:   # a rank at the dim's end has no neighbour there
            out.narrow(pos, length - rows if last else 0, rows).add_(part)
    return out


# ----------------------------------------------------------------------------- lowering

def _resized(shape: Shape, name: str, size: int) -> Shape:
    return Shape(Dim(d.name, size) if d.name == name else d for d in shape)


def exchange(lw, node, vid: int, dim: str, rts: tuple[Route, ...], hl: int, hr: int, served, shared: str) -> int:
    """Value ``vid`` (``dim`` split) extended by the routes ``rts``: one permute each, then a glue."""
    v, mesh = lw.values[vid], lw.mesh
    sh = v.sharding
    axes, p = sh.axes_of(dim), mesh.axis_size(sh.axes_of(dim))
    pos, sizes = v.shape.index(dim), {d.name: d.size for d in v.shape}
    got = []
    for rt in rts:
        piece = lw.new_value(_resized(v.shape, dim, rt.width * p), v.dtype, sh)
        lw.emit("local", node, [vid], [piece], args={"fn": send_rows, "compute": sh.split, "sizes": sizes, "attrs": {
            "pos": pos, "dim": dim, "width": rt.width, "sends": rt.sends}})
        got.append(lw.new_value(lw.values[piece].shape, v.dtype, sh))
        side = "left" if rt.left else "right"
        where = f"the {side} neighbour" if rt.hop == 1 else f"the rank {rt.hop} to the {side}"
        lw.emit("permute", node, [piece], [got[-1]], axes, args={"offset": rt.hop if rt.left else -rt.hop,
                                                                  "wrap": False},
                nbytes=lw.values[piece].local_bytes(mesh),
                note=f"halo: {rt.width} '{dim}' row{'s' if rt.width > 1 else ''} from {where}{shared} "
                     "(uneven blocks: the rows each rank reads there)")
    ext = lw.new_value(_resized(v.shape, dim, v.shape.get(dim).size + (hl + hr) * p), v.dtype, sh)
    attrs = {"pos": pos, "dim": dim, "hl": hl, "hr": hr, "routes": tuple((rt.left, rt.places) for rt in rts),
             "served": served, "route_list": tuple(astuple(rt) for rt in rts)}
    lw.emit("local", node, [vid] + got, [ext], args={"fn": glue, "attrs": attrs, "compute": sh.split,
                                                     "sizes": sizes})
    return ext


def routes_of(lw, ext: int) -> tuple[Route, ...] | None:
    """The routes the glue that made ``ext`` placed (:func:`exchange`), or None (not one of these)."""
    step = next((s for s in reversed(lw.steps) if s.outs == (ext,)), None)
    attrs = step.args.get("attrs") if step is not None else None
    got = attrs.get("route_list") if isinstance(attrs, dict) else None
    return None if got is None else tuple(Route(*rt) for rt in got)


def fold_back(lw, node, vid: int, shape: Shape, dim: str, rts: tuple[Route, ...], hl: int, hr: int) -> int:
    """The gradient ``vid`` of an extended block of a tensor of ``shape`` (made by the routes ``rts``)
    summed onto the blocks that own its rows: each route's rows permuted back and added."""
    mesh, v = lw.mesh, lw.values[vid]
    sh = v.sharding
    axes, p = sh.axes_of(dim), mesh.axis_size(sh.axes_of(dim))
    pos, sizes = shape.index(dim), {d.name: d.size for d in shape}
    got = []
    for rt in rts:
        piece = lw.new_value(_resized(shape, dim, rt.width * p), v.dtype, sh)
        lw.emit("local", node, [vid], [piece], args={"fn": cut_back, "compute": sh.split, "sizes": sizes, "attrs": {
            "pos": pos, "dim": dim, "width": rt.width, "left": rt.left, "hr": hr, "places": rt.places}})
        got.append(lw.new_value(lw.values[piece].shape, v.dtype, sh))
        where = "left" if rt.left else "right"
        lw.emit("permute", node, [piece], [got[-1]], axes, args={"offset": -rt.hop if rt.left else rt.hop,
                                                                  "wrap": False},
                nbytes=lw.values[piece].local_bytes(mesh),
                note=f"halo gradient: {rt.width} '{dim}' row{'s' if rt.width > 1 else ''} back to the {where}"
                     + (" neighbour" if rt.hop == 1 else f" rank {rt.hop} away"))
    res = lw.new_value(shape, v.dtype, sh)
    lw.emit("local", node, [vid] + got, [res], args={"fn": fold, "compute": sh.split, "sizes": sizes, "attrs": {
        "pos": pos, "dim": dim, "hl": hl, "hr": hr, "sends": tuple(rt.sends for rt in rts)}})
    return res


def fold_halo(lw, node, vid: int, dim: str, hl: int, hr: int, rts: tuple[Route, ...] | None = None,
              what: str = "halo gradient") -> int:
    """Value ``vid``, an extended block along ``dim`` (``hl`` rows before each rank's own, ``hr``
    after: a halo's gradient, or a conv's output computed from the rank's own input rows), summed
    onto the blocks that own its rows: each piece permuted back to the rank it belongs to and added
    there (over uneven blocks reached past a neighbour, back along the routes ``rts``: :func:`fold_back`);
    ``what`` names the rows in the permutes' notes."""
    mesh, v = lw.mesh, lw.values[vid]
    sh = v.sharding
    axes, p = sh.axes_of(dim), mesh.axis_size(sh.axes_of(dim))
    n = v.shape.get(dim).size - (hl + hr) * p
    if rts is not None:
        return fold_back(lw, node, vid, _resized(v.shape, dim, n), dim, rts, hl, hr)
    pos, sizes = v.shape.index(dim), {d.name: d.size for d in _resized(v.shape, dim, n)}
    got, adds = [], []
    for width, side in ((hl, -1), (hr, 1)):
        edge = hl if side < 0 else -hr     # the piece nearest the block starts (ends) here
        for rows, k in (hops(width, n // p, p) if width else ()):
            start = edge - rows if side < 0 else edge
            edge = start if side < 0 else edge + rows
            if k >= p:
                continue
            piece = lw.new_value(_resized(v.shape, dim, rows * p), v.dtype, sh)
            lw.emit("local", node, [vid], [piece], args={"fn": cut_rows, "attrs": {"pos": pos, "start": start,
                                                                                     "rows": rows},
                                                         "compute": sh.split, "sizes": sizes})
            got.append(lw.new_value(lw.values[piece].shape, v.dtype, sh))
            where = "left" if side < 0 else "right"
            lw.emit("permute", node, [piece], [got[-1]], axes, args={"offset": side * k, "wrap": False},
                    nbytes=lw.values[piece].local_bytes(mesh),
                    note=f"{what}: {rows} '{dim}' row{'s' if rows > 1 else ''} back to the {where}"
                         + (" neighbour" if k == 1 else f" rank {k} away"))
            adds.append((rows, side < 0))
    res = lw.new_value(_resized(v.shape, dim, n), v.dtype, sh)
    lw.emit("local", node, [vid] + got, [res], args={"fn": fold_rows, "attrs": {"pos": pos, "hl": hl, "hr": hr,
                                                                                  "adds": tuple(adds)},
                                                     "compute": sh.split, "sizes": sizes})
    return res
