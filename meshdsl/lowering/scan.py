"""Lowering of cumsum along a possibly split dim: a local scan plus a prefix of rank totals.

When the scanned dim is split over axes A (n slices), each rank scans its own
slice and keeps the slice's total (the last element of its inclusive scan, a
tensor whose scanned dim has one element per slice).  One allgather over A
gives every rank all n totals, in the order of the dim's slices; a rank adds
the sum of the totals before its own (after it, for a reverse scan) to its
local scan.  Every other dim keeps its sharding: other split dims are just
batch dims of the scan.  An uneven split (slices of unequal lengths, none empty)
scans the same way: a rank finds its slice among the totals by its offset, in the
slices' starts the lowering lists in the totals' order.  The scan is linear, so a
lazy partial sum stays partial through all three steps.

The rule picks where to scan by price, among the input's sharding and the
output's target, each with the scanned dim as it is or whole: scanning a split
dim costs the totals' allgather, gathering it first costs the whole tensor.
"""
from __future__ import annotations

from ..core.shape import Dim, Shape
from ..layout.sharding import Sharding
from ..ops.scan import exclusive_of, scan_local
from .pipeline import MB_AXIS
from .relayout import relayout_cost
from .rules import lowering


def _scan_with_total(ctx, attrs, x):
    """This rank's scan of its slice, and the slice's total (size 1 along the dim)."""
    pos, reverse = attrs["pos"], attrs["reverse"]
    inclusive = scan_local(x, pos, False, reverse)
    # The total is where the inclusive scan ends: the last element, or the first when reversed.
    total = inclusive.narrow(pos, 0 if reverse else x.shape[pos] - 1, 1)
    return (exclusive_of(inclusive, pos, reverse) if attrs["exclusive"] else inclusive), total


def _add_prefix(ctx, attrs, scan, totals):
    """``scan`` plus the totals of the slices that come before this rank's (in scan order)."""
    name, pos = attrs["dim"], attrs["pos"]
    num_slices = totals.shape[pos]
    j = attrs["starts"].index(ctx.offset(name))  # this rank's slice, counted along the dim
    lo, hi = (j + 1, num_slices) if attrs["reverse"] else (0, j)
    # dtype=: torch.sum would promote int32 to int64; an empty range sums to zero
    prefix = totals.narrow(pos, lo, hi - lo).sum(pos, keepdim=True, dtype=scan.dtype)
    return scan + prefix


def _candidates(shape: Shape, name: str, cur: Sharding, targets) -> list[Sharding]:
    """Compute shardings worth pricing: the input's and each target's, with ``name`` as is or whole.

    Partial axes of the input that a candidate does not split stay partial.
    """
    out: list[Sharding] = []
    for base in [cur] + [t for t, _ in targets]:
        for whole in (False, True):
            split = {n: a for n, a in base.split.items() if not (whole and n == name)}
            used = {a for axes in split.values() for a in axes}
            sh = Sharding.of(shape, split, tuple(a for a in cur.partial if a not in used))
            if sh not in out:
                out.append(sh)
    return out


def _slice_starts(shape: Shape, name: str, sh: Sharding, mesh, axes) -> tuple[int, ...] | None:
    """Where each slice of ``name`` starts, in the order an allgather over ``axes`` joins the
    totals; None where a rank could not tell its slice by its offset (an empty slice, or slices
    not in the dim's order)."""
    if sh.cyclic:
        return None
    pos = shape.names.index(name)
    starts = [0] * mesh.axis_size(axes)
    for r in range(mesh.size):
        starts[mesh.index_along(r, axes)] = sh.offsets(shape, mesh, r)[pos]
    ends = starts[1:] + [shape.get(name).size]
    return tuple(starts) if all(a < b for a, b in zip(starts, ends)) else None


def _totals_shape(shape: Shape, name: str, num_slices: int) -> Shape:
    return Shape(Dim(d.name, num_slices) if d.name == name else d for d in shape)


@lowering("cumsum")
def lower_cumsum(lw, node) -> None:
    """Lower a cumsum; see the module docstring."""
    mesh, model = lw.mesh, lw.cost
    (t,) = node.inputs
    out = node.outputs[0]
    name, pos = node.attrs["dim"], node.attrs["pos"]
    vid = lw.reduced(lw.value(t))
    cur = lw.sharding(vid)
    item = t.dtype.itemsize
    best = None
    targets = lw.targets(out)
    for comp in _candidates(t.shape, name, cur, targets):
        axes = comp.axes_of(name)
        split = MB_AXIS not in axes and mesh.axis_size(axes) > 1
        if split and _slice_starts(t.shape, name, comp, mesh, axes) is None:
            continue   # a rank finds its slice's place among the totals from its offset
        cost = relayout_cost(t.shape, cur, comp, mesh, item, model)
        if MB_AXIS in axes:  # its totals would be gathered over micro-batches: a blocked move
            cost = float("inf")
        if mesh.axis_size(axes) > 1:
            tot = _totals_shape(t.shape, name, mesh.axis_size(axes))
            cost += model.collective("allgather", comp.local_numel(tot, mesh) * item, mesh.axis_size(axes))
        for tgt, note in targets:
            lazy = tgt.with_partial(tuple(a for a in comp.partial if a not in tgt.used_axes))
            c = cost + relayout_cost(t.shape, comp, lazy, mesh, item, model)
            if lazy.partial:  # it will be reduced eventually
                c += model.collective("allreduce", lazy.local_numel(t.shape, mesh) * item,
                                      mesh.axis_size(lazy.partial))
            if best is None or c < best[0] - 1e-12:
                best = (c, comp, lazy, note)
    _, comp, lazy, note = best
    vid = lw.relayout(vid, comp, node, "input of cumsum")
    axes = comp.axes_of(name)
    sizes = {d.name: d.size for d in t.shape}
    flops = comp.local_numel(t.shape, mesh)
    res = lw.new_value(out.shape, out.dtype, comp)
    if mesh.axis_size(axes) == 1:  # whole on every rank (axes of size 1 split nothing)
        lw.emit("local", node, [vid], [res], args={"fn": node.op.compute, "attrs": node.attrs,
                                                   "compute": comp.split, "sizes": sizes}, flops=flops)
    else:
        tot_shape = _totals_shape(t.shape, name, mesh.axis_size(axes))
        scan = lw.new_value(out.shape, out.dtype, comp)
        tot = lw.new_value(tot_shape, t.dtype, comp)  # one element per slice: split like the dim
        lw.emit("local", node, [vid], [scan, tot], args={"fn": _scan_with_total, "attrs": node.attrs,
                                                         "compute": comp.split, "sizes": sizes},
                flops=flops, note="scan of the local slice, and its total")
        whole = Sharding.of(tot_shape, {n: a for n, a in comp.split.items() if n != name}, comp.partial)
        got = lw.new_value(tot_shape, t.dtype, whole)
        lw.emit("allgather", node, [tot], [got], axes, args={"dim": pos},
                nbytes=comp.local_numel(tot_shape, mesh) * t.dtype.itemsize,
                note=f"per-rank totals of '{name}'")
        attrs = {**node.attrs, "starts": _slice_starts(t.shape, name, comp, mesh, axes)}
        lw.emit("local", node, [scan, got], [res], args={"fn": _add_prefix, "attrs": attrs,
                                                         "compute": comp.split, "sizes": sizes},
                flops=flops, note="plus the totals of the slices before this one")
    if note:
        lw.note(f"{node.name}: {note}")
    lw.bind(out, lw.relayout(res, lazy, node, "output of cumsum"))
