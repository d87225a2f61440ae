"""Lowering of pad, slice and shift/roll: a window of their dim, by a halo exchange when it is split.

Each op reads a window of its input along its dim (:class:`~.halo.Reach`).  Computed in
its input's sharding: where the dim is split and the output keeps the split, the ranks
trade halos with their neighbours (:func:`~.halo.extend`: one exchange per value and dim,
shared by every reader) and each takes its window locally; where no such exchange
reaches, or the cost model finds gathering the dim cheaper (the layout wants the output
whole anyway), the dim is gathered first, as any op that needs it whole.  A pad read
only through slices, pads or shifts is not materialised (:func:`~.halo.is_virtual`).  A
slice that no halo serves, to an output that stays whole along its dim (a class token's row of
a split sequence), is each rank's overlap with it, a partial sum (:func:`_slice_as_sum`), where
that moves fewer bytes than gathering the dim.
"""
from __future__ import annotations

from ..layout.sharding import Sharding
from .halo import cut_by, extend, gathered, is_virtual, take_window, through, window_attrs, window_reach
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


def _slice_as_sum(lw, node, vid: int, comp: Sharding, tgt: Sharding) -> bool:
    """Lower a slice of a split dim that no halo serves (a class token's row under ``seq:model``)
    as each rank's overlap with the slice, a partial sum over the dim's axes, where that moves
    fewer bytes than gathering the dim (the output's rows, not the input's); False otherwise."""
    mesh, src, out, a = lw.mesh, node.inputs[0], node.outputs[0], node.attrs
    dim, size = a["dim"], src.dtype.itemsize
    axes = comp.axes_of(dim)
    rest = {d: ax for d, ax in comp.split.items() if d != dim}
    summed = Sharding.of(out.shape, rest, comp.partial + axes)
    whole = gathered(comp, src.shape, dim)
    gather = relayout_cost(src.shape, comp, whole, mesh, size, lw.cost) + relayout_cost(
        out.shape, Sharding.of(out.shape, whole.split, whole.partial), tgt, mesh, size, lw.cost)
    if relayout_cost(out.shape, summed, tgt.with_partial(()), mesh, size, lw.cost) >= gather:
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


@lowering("pad", "slice", "shift")
def lower_window(lw, node) -> None:
    """Lower a pad, slice, shift or roll; see the module docstring."""
    mesh, out, dim = lw.mesh, node.outputs[0], node.attrs["dim"]
    if is_virtual(lw, node):
        lw.memo[("virtual", id(out))] = True   # its readers read through it: nothing to compute
        return
    src, reach = through(lw, node.inputs[0], window_reach(node, 0, dim))
    vid = lw.reduced(lw.value(src))
    cur = lw.sharding(vid)
    # A partial sum passes through lazily where the window is linear (zero fill) and it is the
    # input's only reader, as the generic rule does for linear ops, or a backward block passes it
    # on to each reader (a concat's gradient read by its slices: :func:`.repeat._lazy_through`,
    # kept where the loop costs less); otherwise it is reduced.
    passed_on = id(src) in lw.lazy_through
    lw.through_used |= passed_on and bool(cur.partial) and lw.num_uses(src) > 1
    lazy = src is node.inputs[0] and reach.fill == 0.0 and (lw.num_uses(src) == 1 or passed_on)
    comp = cur if lazy else Sharding(cur.dims)
    axes = comp.axes_of(dim)
    n, size = src.shape.get(dim).size, src.dtype.itemsize
    tgt = lw.target(out)
    tgt = keep_microbatches(tgt.with_partial(tuple(a for a in comp.partial if a not in tgt.used_axes)),
                            comp, out.shape, mesh)
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
            widths = None if gather < halo - 1e-12 else widths
        elif widths is None and node.op.name == "slice" and src is node.inputs[0] \
                and not tgt.axes_of(dim) and _slice_as_sum(lw, node, vid, comp, tgt):
            return
        elif widths is None:
            what = f"shift by {reach.s} exceeds the local slice" if node.op.name == "shift" else \
                "no exchange with the neighbours gives its window"
            lw.note(f"{node.name}: {what} of '{dim}'; the dim is gathered")
        if widths is None:
            comp, axes = whole, ()
    vid = lw.relayout(vid, comp, node, f"input of {node.op.name}")
    hl = 0
    if axes:
        hl, vid = extend(lw, node, src, vid, dim, reach, widths)
    out_sh = Sharding.of(out.shape, comp.split, comp.partial)
    res = lw.new_value(out.shape, out.dtype, out_sh)
    attrs = window_attrs(reach, dim, src.shape.index(dim), n, mesh.axis_size(axes), hl, cut_by(mesh, axes))
    lw.emit("local", node, [vid], [res], args={"fn": take_window, "attrs": attrs, "compute": comp.split,
                                               "sizes": {d.name: d.size for d in src.shape}},
            flops=out_sh.local_numel(out.shape, mesh))
    lw.bind(out, lw.relayout(res, tgt, node, f"output of {node.op.name}"))
