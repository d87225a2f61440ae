"""Lowering of pad, slice and shift/roll: a window of their dim, by a halo exchange when it is split.

Each op reads a window of its input along its dim (:class:`~.halo.Reach`).  Computed in
its input's sharding: where the dim is split and the output keeps the split, the ranks
trade halos with their neighbours (:func:`~.halo.extend`: one exchange per value and dim,
shared by every reader) and each takes its window locally; where no such exchange
reaches, or the cost model finds gathering the dim cheaper (the layout wants the output
whole anyway), the dim is gathered first, as any op that needs it whole; a shift by more
than a rank's slice of an evenly split dim permutes the block and edge rows it reads from
the ranks that hold them instead (:func:`_far_extend`), where that costs less than its share
of the gather (every such shift of the value reads one gather).  A pad read
only through slices, pads or shifts is not materialised (:func:`~.halo.is_virtual`).  A
slice that no halo serves, to an output that stays whole along its dim (a class token's row of
a split sequence), is each rank's overlap with it, a partial sum (:func:`_slice_as_sum`), where
that moves fewer bytes than gathering the dim; so is a slice a halo would keep split where the
first lowering saw its readers gather it (MIMO-UNet's DFT patch, rows all on one rank: summed
once, not moved over the ranks and gathered back; :func:`.shared_moves.halo_slices_read_whole`),
where that costs no more than the gather and less than the halo.  A shift along a split dim of
a shift along a dim the layout keeps whole (a depthwise 2-D conv's taps under ``width:model``)
commutes with it: it shifts the inner shift's input, sharing that one's exchange, then shifts
along the whole dim locally (:func:`~.halo.commuted`).  A zero-fill window passes a partial sum
on lazily, except where it makes the sum larger and its result is reduced at once: such an edge
row padded to a split length is reduced first where that costs less (:func:`_reduced_first`).
A partial sum read only by slices of it along one dim (a concat's gradient: XLNet's keys with a
memory slot) passes on to each where the cost model finds each part's reduction to where it goes
cheaper than one of the whole: the key rows reduce-scattered to the split sequence, the slot's row
reduced with its param's gradient (:func:`_parts_passed_on`).
"""
from __future__ import annotations

import torch

from ..layout.sharding import Sharding
from .cyclic_dims import lower_cyclic_window
from .halo import (resized, strip_rows, commuted, cut_by, extend, far_group, gathered, is_virtual, piece_rows, readers,
                   take_window, through, window_attrs, window_reach)
from .relayout import keep_microbatches, relayout_cost
from .rules import lowering


def _halo_cost(lw, src, comp, dim, widths) -> float:
    """Seconds the two permutes of a halo exchange of ``widths`` rows take (0 once exchanged)."""
    mesh = lw.mesh
    axes = comp.axes_of(dim)
    n = src.shape.get(dim).size
    row = comp.local_numel(src.shape, mesh) // (n // mesh.axis_size(axes)) * src.dtype.itemsize
    return sum(lw.cost.collective("permute", w * row, mesh.axis_size(axes)) for w in widths if w)


def _overlap(ctx, attrs, x):
    """This rank's elements of the slice ``[start, stop)`` of ``attrs["dim"]``, at their places
    in the slice, zeros elsewhere: the ranks' results sum to the slice."""
    pos, start, stop = attrs["pos"], attrs["start"], attrs["stop"]
    off, ln = ctx.offset(attrs["dim"]), ctx.size(attrs["dim"], attrs["n"])
    out = x.new_zeros(x.shape[:pos] + (stop - start,) + x.shape[pos + 1:])
    a, b = max(start, off), min(stop, off + ln)
    if a < b:
        out.narrow(pos, a - start, b - a).copy_(x.narrow(pos, a - off, b - a))
    return out


def _slice_as_sum(lw, node, vid: int, comp: Sharding, tgt: Sharding, halo: float = float("inf")) -> bool:
    """Lower a slice of a split dim that no halo serves (a class token's row under ``seq:model``),
    or whose halo and then gather cost ``halo`` seconds (its readers want it whole), as each rank's
    overlap with the slice, a partial sum over the dim's axes, where that moves fewer bytes than
    gathering the dim (the output's rows, not the input's) or the halo; False otherwise."""
    mesh, src, out, a = lw.mesh, node.inputs[0], node.outputs[0], node.attrs
    dim, size = a["dim"], src.dtype.itemsize
    axes = comp.axes_of(dim)
    rest = {d: ax for d, ax in comp.split.items() if d != dim}
    summed = Sharding.of(out.shape, rest, comp.partial + axes)
    whole = gathered(comp, src.shape, dim)
    gather = relayout_cost(src.shape, comp, whole, mesh, size, lw.cost) + relayout_cost(
        out.shape, Sharding.of(out.shape, whole.split, whole.partial), tgt, mesh, size, lw.cost)
    # where its readers want it whole (``halo`` given), a tie with the gather goes to the sum: its
    # reduction waits for the readers, and a later slice of another dim makes it smaller
    beaten = gather if halo == float("inf") else gather + 1e-12
    if relayout_cost(out.shape, summed, tgt.with_partial(()), mesh, size, lw.cost) >= min(beaten, halo):
        return False
    lw.note(f"{node.name}: its rows [{a['start']}:{a['stop']}] of split '{dim}' summed from the ranks "
            "that hold them (a partial sum), not gathered")
    vid = lw.relayout(vid, comp, node, f"input of {node.op.name}")
    res = lw.new_value(out.shape, out.dtype, summed)
    attrs = {"dim": dim, "pos": src.shape.index(dim), "start": a["start"], "stop": a["stop"],
             "n": src.shape.get(dim).size}
    lw.emit("local", node, [vid], [res], args={"fn": _overlap, "attrs": attrs, "compute": comp.split,
                                               "sizes": {d.name: d.size for d in src.shape}},
            flops=summed.local_numel(out.shape, mesh))
    lazy = keep_microbatches(tgt.with_partial(tuple(x for x in summed.partial if x not in tgt.used_axes)),
                             summed, out.shape, mesh)
    lw.bind(out, lw.relayout(res, lazy, node, f"output of {node.op.name}"))
    return True


def _far_shift(lw, node, src, comp, dim, reach) -> tuple[int, int, int] | None:
    """``(q, r, nb)`` of a shift (not a roll) of a dim split evenly over ``p`` ranks of ``nb``
    rows by ``|s| = q*nb + r`` rows, more than a rank's slice: each rank's window is the block
    of the rank ``q`` away and ``r`` edge rows of the one ``q + 1`` away (:func:`_far_extend`);
    None for any other window."""
    if node.op.name != "shift" or reach.wrap or reach.e or src is not node.inputs[0]:
        return None
    n, p = src.shape.get(dim).size, lw.mesh.axis_size(comp.axes_of(dim))
    if n % p or reach.m != n:
        return None
    nb = n // p
    q, r = divmod(abs(reach.s), nb)
    return (q, r, nb) if q else None


def _read_whole(lw, out, dim: str, axes) -> bool:
    """Whether every reader of ``out`` renames ``dim`` to a dim its layout keeps off ``axes``, so
    gathers it (CTC's emissions from frame 1 on, renamed to the steps a repeat scans): a slice
    then weighs gathering its input against its halo and that gather."""
    rs = readers(lw, out)
    return bool(rs) and all(n.op.name == "rename" and dim in n.attrs["mapping"] and not set(axes) & set(
        lw.target(n.outputs[0]).axes_of(n.attrs["mapping"][dim])) for n, _ in rs)


def _wanted_whole(lw, out, dim: str, axes) -> bool:
    """Whether the first lowering saw every reader of ``out`` (through renames and slices of other
    dims) move it off ``axes`` along ``dim`` (:func:`.shared_moves.halo_slices_read_whole`)."""
    want = lw.wanted.get(id(out))
    return want is not None and not set(axes) & set(want.axes_of(dim))


def _uneven_far(lw, node, src, vid: int, comp, dim: str, reach, tgt) -> tuple[int, int] | None:
    """The widths of a window over an uneven split that reaches past a neighbour's block, taken
    from the ranks that hold its rows (:mod:`.halo_routes`, one exchange for every such reader
    of the value), where those permutes cost less than the gather they all share (free where
    the dim is gathered already, or the exchange made); None otherwise."""
    mesh, n, size, out = lw.mesh, src.shape.get(dim).size, src.dtype.itemsize, node.outputs[0]
    axes = comp.axes_of(dim)
    p, cut = mesh.axis_size(axes), cut_by(mesh, axes)
    if reach.wrap or not (n % p or reach.m % p) or reach.far_widths(n, p, cut) is None:
        return None
    served, widths = far_group(lw, src, dim, reach, n, p, cut)
    whole = gathered(comp, src.shape, dim)
    out_sh = Sharding.of(out.shape, comp.split, comp.partial)
    gather = (0.0 if lw.relaid(vid, whole) else relayout_cost(src.shape, comp, whole, mesh, size, lw.cost)) \
        + relayout_cost(out.shape, Sharding.of(out.shape, whole.split, whole.partial), tgt, mesh, size, lw.cost)
    hit = lw.memo.get(("halo", vid, dim, False))
    halo = relayout_cost(out.shape, out_sh, tgt, mesh, size, lw.cost)
    if not (hit and hit[0] >= widths[0] and hit[1] >= widths[1]):
        row = comp.local_numel(src.shape, mesh) // -(-n // p) * size   # the largest block's rows
        halo += sum(lw.cost.collective("permute", rows * row, p) for rows in piece_rows(served, n, p, cut, widths))
    return widths if halo < gather - 1e-12 else None


def _why_gathered(lw, node, reach, n: int, axes) -> str:
    """Why no exchange serves a window of a dim of ``n`` split over ``axes`` (for the plan's note)."""
    dim, p = node.attrs["dim"], lw.mesh.axis_size(axes)
    if not reach.wrap and (n % p or reach.m % p) and reach.far_widths(n, p, cut_by(lw.mesh, axes)):
        return (f"the rows its window reads past the neighbours' blocks of uneven '{dim}', from the ranks "
                "that hold them, cost more than gathering it")
    what = f"shift by {reach.s} exceeds the local slice" if node.op.name == "shift" else \
        "no exchange with the neighbours gives its window"
    return f"{what} of '{dim}'"


def _far_readers(lw, src, dim: str, nb: int) -> int:
    """How many shifts of ``src`` along ``dim`` reach beyond the neighbours: one gather of the dim
    serves them all, so each weighs its permutes against its share of that gather."""
    return sum(1 for n, slot in readers(lw, src) if n.op.name == "shift" and not slot
               and n.attrs["dim"] == dim and not n.attrs["wrap"] and abs(n.attrs["offset"]) >= nb)


def _far_cost(lw, src, comp, dim, far) -> float:
    """Seconds the permutes of :func:`_far_extend` take (none where the shift leaves only fill)."""
    q, r, nb = far
    mesh = lw.mesh
    p = mesh.axis_size(comp.axes_of(dim))
    if q >= p:
        return 0.0
    row = comp.local_numel(src.shape, mesh) // nb * src.dtype.itemsize
    return sum(lw.cost.collective("permute", w * row, p) for w, k in ((nb, q), (r, q + 1)) if w and k < p)


def _far_glue(ctx, attrs, x, *got):
    """The permuted block and edge rows in source order; a rank with no sender there (the ends of
    the dim) gets zeros, which its window never reads as data (it reads the fill)."""
    pos, got = attrs["pos"], list(got)
    parts = [got.pop(0) if sent else None for sent in attrs["sent"]]   # a part no rank sends: zeros
    parts = [g if g is not None else x.new_zeros(x.shape[:pos] + (w,) + x.shape[pos + 1:])
             for g, w in zip(parts, attrs["widths"])]
    return torch.cat(parts, dim=pos) if len(parts) > 1 else parts[0]


def _far_extend(lw, node, vid: int, dim: str, reach, far) -> int:
    """The rows a far shift's window reads (see :func:`_far_shift`), one permute of the block of
    the rank ``q`` away and one of the ``r`` edge rows of the rank ``q + 1`` away, in source
    order: positions ``off - s ..`` (s > 0) or ``off + q*nb ..`` (s < 0) of a rank at offset ``off``."""
    q, r, nb = far
    v, mesh = lw.values[vid], lw.mesh
    sh = v.sharding
    axes = sh.axes_of(dim)
    p = mesh.axis_size(axes)
    if q >= p:   # every row of the window is the fill: nothing to read
        return vid
    sign = 1 if reach.s > 0 else -1   # s > 0 reads from the left (lower ranks), the permute's +offset
    pos, sizes = v.shape.index(dim), {d.name: d.size for d in v.shape}
    got, widths, sent = [], [], []
    for width, k in ((nb, q), (r, q + 1)):
        if not width:
            continue
        widths.append(width)
        sent.append(k < p)
        if k >= p:   # beyond the dim's end for every rank: rows of fill, zeros stand in
            continue
        piece = vid
        if width < nb:   # the edge rows nearest the block: the sender's last (s > 0) or first rows
            piece = lw.new_value(resized(v.shape, dim, width * p), v.dtype, sh)
            lw.emit("local", node, [vid], [piece], args={"fn": strip_rows, "attrs": {
                "pos": pos, "width": width, "last": sign > 0}, "compute": sh.split, "sizes": sizes})
        got.append(lw.new_value(lw.values[piece].shape, v.dtype, sh))
        lw.emit("permute", node, [piece], [got[-1]], axes, args={"offset": sign * k, "wrap": False},
                nbytes=lw.values[piece].local_bytes(mesh),
                note=f"shift: {width} '{dim}' row{'s' if width > 1 else ''} from the rank {k} to the "
                     f"{'left' if sign > 0 else 'right'}")
    if sign > 0:   # source order: the edge rows (further left) before the block
        got, widths, sent = got[::-1], widths[::-1], sent[::-1]
    ext = lw.new_value(resized(v.shape, dim, sum(widths) * p), v.dtype, sh)
    lw.emit("local", node, [vid] + got, [ext], args={"fn": _far_glue, "attrs": {
        "pos": pos, "widths": tuple(widths), "sent": tuple(sent)}, "compute": sh.split, "sizes": sizes})
    return ext


@lowering("pad", "slice", "shift")
def lower_window(lw, node) -> None:
    """Lower a pad, slice, shift or roll; see the module docstring.  A slice or pad of whole groups
    of a block-cyclic dim is a local step instead (:func:`.cyclic_dims.lower_cyclic_window`)."""
    if not lower_cyclic_window(lw, node):
        _lower_by_halos(lw, node)


def _lower_by_halos(lw, node) -> None:
    """A pad, slice, shift or roll that keeps its dim's split by trading halos, or gathers it."""
    mesh, out, dim = lw.mesh, node.outputs[0], node.attrs["dim"]
    if is_virtual(lw, node):
        lw.memo[("virtual", id(out))] = True   # its readers read through it: nothing to compute
        return
    inner = commuted(lw, node)   # a shift of a shift along a whole dim: shifts that one's input
    src, reach = through(lw, inner.inputs[0] if inner else node.inputs[0], window_reach(node, 0, dim))
    vid = lw.reduced(lw.value(src))
    cur = lw.sharding(vid)
    # A partial sum passes through lazily where the window is linear (zero fill) and it is the
    # input's only reader, as the generic rule does for linear ops, or a backward block passes it
    # on to each reader (a concat's gradient read by its slices: :func:`.repeat._lazy_through`,
    # kept where the loop costs less); otherwise it is reduced.
    passed_on = id(src) in lw.lazy_through or (src is node.inputs[0] and _parts_passed_on(lw, src, dim, cur))
    lw.through_used |= passed_on and bool(cur.partial) and lw.num_uses(src) > 1
    lazy = src is node.inputs[0] and reach.fill == 0.0 and (lw.num_uses(src) == 1 or passed_on)
    comp = cur if lazy else Sharding(cur.dims)
    axes = comp.axes_of(dim)
    whole = lw.cut_from(vid) if axes and src is node.inputs[0] and not cur.partial else None
    if whole is not None and lw.sharding(whole) == gathered(comp, src.shape, dim):
        # a local cut of a value this rank holds whole along the dim (a renamed gradient's): the
        # window of that needs no halo, and its result is cut the same way
        vid, comp, axes = whole, lw.sharding(whole), ()
    n, size = src.shape.get(dim).size, src.dtype.itemsize
    tgt = _read_target(lw, node, out, _target(lw, out, comp, lazy), comp, dim, axes)
    comp, tgt = _reduced_first(lw, node, src, comp, tgt, axes) if lazy and comp.partial else (comp, tgt)
    comp = comp if axes else _held_as_wanted(lw, src, vid, comp, tgt, dim, out)
    far = None   # a shift beyond the neighbours served by permutes (:func:`_far_shift`)
    if axes:
        widths = reach.widths(n, mesh.axis_size(axes), cut_by(mesh, axes))
        whole = gathered(comp, src.shape, dim)
        out_sh = Sharding.of(out.shape, comp.split, comp.partial)
        # Where the layout keeps the output split as the input is, the halo is all that moves;
        # else the cost model weighs it against gathering the input.
        if widths is not None and tgt.axes_of(dim) != axes:
            gather = relayout_cost(src.shape, comp, whole, mesh, size, lw.cost) + relayout_cost(
                out.shape, Sharding.of(out.shape, whole.split, whole.partial), tgt, mesh, size, lw.cost)
            halo = _halo_cost(lw, src, comp, dim, widths) + relayout_cost(out.shape, out_sh, tgt, mesh,
                                                                            size, lw.cost)
            if node.op.name == "slice" and src is node.inputs[0] and _wanted_whole(lw, out, dim, axes) \
                    and _slice_as_sum(lw, node, vid, comp, tgt, halo):
                return   # foreseen read whole: the rows summed from the ranks that hold them
            widths = None if gather < halo - 1e-12 else widths
        elif widths is None and node.op.name == "slice" and src is node.inputs[0] \
                and not tgt.axes_of(dim) and _slice_as_sum(lw, node, vid, comp, tgt):
            return
        elif widths is None:
            widths = _uneven_far(lw, node, src, vid, comp, dim, reach, tgt)
            far = None if widths else _far_shift(lw, node, src, comp, dim, reach)
            if far is not None:
                # the permutes against this shift's share of the gather, which every far shift of
                # the value reads (free where it is gathered already)
                gather = 0.0 if lw.relaid(vid, whole) else relayout_cost(
                    src.shape, comp, whole, mesh, size, lw.cost) / max(1, _far_readers(lw, src, dim, far[2]))
                gather += relayout_cost(out.shape, Sharding.of(out.shape, whole.split, whole.partial), tgt, mesh,
                                        size, lw.cost)
                shifted = _far_cost(lw, src, comp, dim, far) + relayout_cost(out.shape, out_sh, tgt, mesh, size,
                                                                              lw.cost)
                far = far if shifted < gather - 1e-12 else None
            if far is None and widths is None:
                lw.note(f"{node.name}: {_why_gathered(lw, node, reach, n, axes)}; the dim is gathered")
        if widths is None and far is None:
            comp, axes = whole, ()
    vid = lw.relayout(vid, comp, node, f"input of {node.op.name}")
    hl = 0
    if axes and far is not None:
        # the rows before this rank's offset where its extended block starts: s > 0, the edge
        # rows and the block to their right; s < 0, the block q ranks on, then the edge rows
        hl, vid = reach.s if reach.s > 0 else -far[0] * far[2], _far_extend(lw, node, vid, dim, reach, far)
    elif axes:
        hl, vid = extend(lw, node, src, vid, dim, reach, widths)
    out_sh = Sharding.of(out.shape, comp.split, comp.partial)
    res = lw.new_value(out.shape, out.dtype, out_sh)
    attrs = window_attrs(reach, dim, src.shape.index(dim), n, mesh.axis_size(axes), hl, cut_by(mesh, axes))
    lw.emit("local", node, [vid], [res], args={"fn": take_window, "attrs": attrs, "compute": comp.split,
                                               "sizes": {d.name: d.size for d in src.shape}},
            flops=out_sh.local_numel(out.shape, mesh))
    res = _shift_whole(lw, node, inner, res)   # then a commuted inner shift, locally
    lw.bind(out, lw.relayout(res, tgt, node, f"output of {node.op.name}"))


def _parts_passed_on(lw, src, dim: str, cur: Sharding) -> bool:
    """Whether partial sum ``src`` (at ``cur``), read only by slices of it along ``dim`` that do not
    overlap (a concat's gradient), passes on partial to each: every part reduced to where it goes
    (XLNet's key rows reduce-scattered to the split sequence, its memory slot's row into its
    param's gradient) rather than the whole allreduced and each part cut from it, where the cost
    model finds that cheaper.  Decided once per value, so every slice reads it alike."""
    key = ("parts_passed_on", id(src))
    if key not in lw.memo:
        lw.memo[key] = _parts_cheaper(lw, src, dim, cur)
    return lw.memo[key]


def _parts_cheaper(lw, src, dim: str, cur: Sharding) -> bool:
    """:func:`_parts_passed_on`'s test: each part priced at its reduction to the layout target of
    the tensor it becomes through the linear ops that alone read it (:func:`_goes_to`: a slice's
    own dim is often one no rule splits), a gradient's reduction as its bytes only (it joins the
    gradient bucket's collective)."""
    rs = readers(lw, src)
    if not cur.partial or len(rs) < 2 or len(rs) != lw.num_uses(src) or any(
            slot or n.op.name != "slice" or n.attrs["dim"] != dim for n, slot in rs):
        return False
    spans = sorted((n.attrs["start"], n.attrs["stop"]) for n, _ in rs)
    if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        return False
    mesh, size, whole = lw.mesh, src.dtype.itemsize, Sharding(cur.dims)
    once, late = relayout_cost(src.shape, cur, whole, mesh, size, lw.cost), 0.0
    for n, _ in rs:
        goes, kept = _goes_to(lw, n.outputs[0], cur)
        tgt = lw.target(goes)
        cost = relayout_cost(goes.shape, kept.with_partial(cur.partial), tgt, mesh, size, lw.cost)
        late += cost - lw.cost.latency_s if cost and not readers(lw, goes) else cost
        once += relayout_cost(goes.shape, kept, tgt, mesh, size, lw.cost)
    return late < once - 1e-12


def _goes_to(lw, t, cur: Sharding):
    """``(tensor, sharding)``: the tensor ``t`` becomes through one-input linear ops, each its only
    reader and no larger (renames, a broadcast's sum, the gradient's own name), and ``cur``'s split
    of it there.  (Not by phase: a repeat's backward block is traced as a forward graph.)"""
    split = dict(cur.split)
    while lw.num_uses(t) == 1:
        rs = readers(lw, t)
        n = rs[0][0] if len(rs) == 1 else None
        if n is None or len(n.inputs) != 1 or not n.op.is_linear(n) or n.outputs[0].shape.numel > t.shape.numel:
            break
        names = n.attrs["mapping"] if n.op.name == "rename" else {}
        split = {names.get(k, k): v for k, v in split.items()}
        t = n.outputs[0]
    return t, Sharding.of(t.shape, split)


def _reduced_first(lw, node, src, comp: Sharding, tgt: Sharding, axes) -> tuple[Sharding, Sharding]:
    """``(comp, tgt)`` of a zero-fill window of a partial sum ``comp``: with the sum reduced first
    where the window makes it larger (an edge row padded to the whole padded length under a split
    time dim), its result would be reduced at once (``tgt`` keeps no partial), and the cost model
    finds the input's reduction cheaper than the result's, which moves the padded length."""
    out, mesh, size, whole = node.outputs[0], lw.mesh, src.dtype.itemsize, Sharding(comp.dims)
    if tgt.partial or out.shape.numel <= src.shape.numel:
        return comp, tgt
    lazy = relayout_cost(out.shape, Sharding.of(out.shape, comp.split, comp.partial), tgt, mesh, size, lw.cost)
    first = relayout_cost(src.shape, comp, whole, mesh, size, lw.cost) + relayout_cost(
        out.shape, Sharding.of(out.shape, whole.split, ()), tgt, mesh, size, lw.cost)
    if first >= lazy - 1e-12:
        return comp, tgt
    return whole, _read_target(lw, node, out, _target(lw, out, whole, False), whole, node.attrs["dim"], axes)


def _target(lw, out, comp: Sharding, lazy: bool) -> Sharding:
    """Where a window's result ``out``, computed at ``comp``, goes: its layout target, partial over
    the axes of ``comp``'s partial sum that the target leaves whole; a ``lazy`` (zero-fill) window's
    partial result that is a term of a sum reduced once (:mod:`.shared_sums`: a slice's gradient,
    padded, added to the other slices') left as it is."""
    tgt = lw.target(out)
    tgt = keep_microbatches(tgt.with_partial(tuple(a for a in comp.partial if a not in tgt.used_axes)),
                            comp, out.shape, lw.mesh)
    if lazy and comp.partial and not tgt.partial and lw.shared_sums.get(id(out), 1) > 1:
        return Sharding.of(out.shape, comp.split, comp.partial)
    return tgt


def _read_target(lw, node, out, tgt: Sharding, comp: Sharding, dim: str, axes) -> Sharding:
    """Target ``tgt`` of window result ``out``, made whole where its readers gather it anyway: a
    slice of a split ``dim`` (the halo would be moved for nothing), or a partial sum ``comp``
    passed on along a whole dim (reduced whole, not reduce-scattered to the layout's split and
    gathered again; :func:`.shared_moves.halo_slices_read_whole`)."""
    want = lw.wanted.get(id(out))
    if want is not None and not axes and comp.partial and not want.partial and want.used_axes < tgt.used_axes:
        return want
    if axes and node.op.name == "slice" and (_read_whole(lw, out, dim, axes) or _wanted_whole(lw, out, dim, axes)):
        return gathered(tgt, out.shape, dim)
    return tgt


def _held_as_wanted(lw, src, vid: int, comp: Sharding, tgt: Sharding, dim: str, out) -> Sharding:
    """Where a window along ``dim``, whole, of ``src`` (value ``vid``) runs: on a copy already made,
    or foreseen (:mod:`.param_values`, :mod:`.shared_moves`), at the sharding its output's target
    ``tgt`` asks where that keeps ``dim`` whole, rather than on ``comp`` with the window moved after
    (a depthwise conv's taps of an FSDP weight gathered once, not tap by tap); or at the one
    sharding every reader of its output ``out`` moves it to (``lw.wanted``), where cutting the
    result to ``tgt`` costs less than that move (CPC's slices of a batch-split value, each read
    renamed to a dim no rule splits: the value gathered once, each slice's cut read whole again)."""
    want = lw.wanted.get(id(out))
    for to in (tgt,) if want is None else (tgt, want):
        held = Sharding.of(src.shape, to.split)
        if to.partial or held == comp or held.axes_of(dim) or not (
                lw.relaid(vid, held) or held in lw.foreseen.get(id(src), ())):
            continue
        if to is want:
            size = out.dtype.itemsize
            made = Sharding.of(out.shape, to.split)
            if relayout_cost(out.shape, made, tgt, lw.mesh, size, lw.cost) >= \
                    relayout_cost(out.shape, tgt, made, lw.mesh, size, lw.cost):
                continue
        return held
    return comp


def _shift_whole(lw, node, inner, vid: int) -> int:
    """Value ``vid`` shifted locally as ``inner`` (a shift along a dim ``vid`` holds whole) says;
    ``vid`` itself where there is no such shift."""
    if inner is None:
        return vid
    v, d = lw.values[vid], inner.attrs["dim"]
    res = lw.new_value(v.shape, v.dtype, v.sharding)
    attrs = window_attrs(window_reach(inner, 0, d), d, v.shape.index(d), v.shape.get(d).size, 1, 0)
    lw.emit("local", node, [vid], [res], args={"fn": take_window, "attrs": attrs, "compute": v.sharding.split,
                                               "sizes": {x.name: x.size for x in v.shape}},
            flops=v.sharding.local_numel(v.shape, lw.mesh))
    return res
