"""Lowering of conv and its weight gradient: batch and channels split freely, spatial dims by halos.

The compute sharding follows the input ``x``: its batch, spatial and input channel
splits stay where they are (per-sample weights are cut along their per dims as ``x`` is:
under ``batch:data`` every rank convolves its own samples with their own filters) (a split input channel leaves the result a partial sum, as
an einsum's contraction does); each output channel dim (one, or several: a ConvLSTM's
``[gate, hid]``) takes the axes the layout wants for the output, else the other operand's,
when no dim of ``x`` nor an output dim before it uses them (an uneven cut too: each rank's
filters are its output channels).  A split spatial
dim whose output keeps the split trades a halo of ``span - 1`` rows (``taps - 1``, or
``dilation * (taps - 1)`` dilated) with the neighbours
(:func:`~.halo.extend`, shared with every other reader of ``x`` there: the weight
gradient reuses the forward's); a window longer than a rank's block (evenly split) takes
its rows from the ranks further on too, where those permutes cost less than gathering the
dim (:func:`_far`); otherwise the dim is gathered.  The taps are whole.
"""
from __future__ import annotations

from ..layout.sharding import Sharding
from ..ops.conv import conv_valid, dilations, span, weight_grad_valid
from .halo import Reach, cut_by, extend, gathered, piece_rows, readers, reads, take_window, window_attrs
from .relayout import keep_microbatches, relayout_cost
from .rules import lowering


@reads("conv", "conv_weight_grad")
def conv_reach(node, slot: int, dim: str) -> Reach | None:
    """Where output position i of a spatial dim reads x: ``i - before .. i - before + span - 1``
    (``span = dilation * (taps - 1) + 1``: the dilated taps' reach, every row of it traded)."""
    if slot:
        return None
    for (d, _, k, before, _), dl in zip(node.attrs["spatial"], dilations(node.attrs)):
        if d == dim:
            ref = node.outputs[0] if node.op.name == "conv" else node.inputs[1]
            return Reach(before, ref.shape.get(d).size, span(k, dl) - 1)
    return None


def _windows(ctx, attrs, x):
    for w in attrs["windows"]:
        x = take_window(ctx, w, x)
    return x


def _conv(ctx, attrs, x, w):
    return conv_valid(attrs["conv"], _windows(ctx, attrs, x), w)


def _weight_grad(ctx, attrs, x, dy):
    return weight_grad_valid(attrs["conv"], _windows(ctx, attrs, x), dy)


def _compute_split(lw, node, xv) -> dict:
    """Compute dim -> axes: ``x``'s splits, each output channel dim's where free (see the module docstring)."""
    a, other = node.attrs, node.inputs[1]
    split = dict(lw.sharding(xv).split)
    used = {ax for axes in split.values() for ax in axes}
    for out_dim in a["out_dims"]:
        cands = [lw.target(node.outputs[0]).axes_of(out_dim), lw.sharding(lw.value(other)).axes_of(out_dim)]
        for axes in cands:
            if axes and not used & set(axes):
                split[out_dim] = axes
                used |= set(axes)
                break
    return split


def _far(lw, node, xv, split: dict, d: str) -> tuple[int, int] | None:
    """The widths of a halo on ``d`` that reaches past the neighbours (a dilated conv's span
    longer than a rank's block: rows from the ranks further on, :func:`~.halo.hops`, or over
    uneven blocks :mod:`.halo_routes`), where its permutes cost less than gathering ``x``'s dim
    (a weight gradient: and ``dy``'s, against the allreduce its partial sum needs); None otherwise."""
    mesh, x = lw.mesh, node.inputs[0]
    axes, n = split[d], x.shape.get(d).size
    p = mesh.axis_size(axes)
    reach, cut = conv_reach(node, 0, d), cut_by(mesh, axes)
    widths = reach.far_widths(n, p, cut)
    if widths is None:
        return None
    comp = Sharding.of(x.shape, split)
    row = comp.local_numel(x.shape, mesh) // -(-n // p) * x.dtype.itemsize   # the largest block's rows
    hit = lw.memo.get(("halo", xv, d, False))   # the forward's exchange, read again by the weight gradient
    far = 0.0 if hit and hit[0] >= widths[0] and hit[1] >= widths[1] else sum(
        lw.cost.collective("permute", rows * row, p) for rows in piece_rows([reach], n, p, cut, widths))
    gather = relayout_cost(x.shape, comp, gathered(comp, x.shape, d), mesh, x.dtype.itemsize, lw.cost)
    # The weight gradients that read x's exchange (or the gathered x) decide with it: the forward's
    # choice is theirs too
    grads = [node] if node.op.name == "conv_weight_grad" else [
        r for r, slot in readers(lw, x) if r.op.name == "conv_weight_grad" and not slot
        and conv_reach(r, 0, d) == reach]
    for wg in grads:
        more_far, more_gather = _weight_grad_terms(lw, wg, split, d, p)
        far, gather = far + more_far, gather + more_gather
    return widths if far < gather - 1e-12 else None


def _weight_grad_terms(lw, node, split: dict, d: str, p: int) -> tuple[float, float]:
    """What a weight gradient adds to each side of :func:`_far`: kept split along ``d``, its result
    is a partial sum over the axes (an allreduce more); gathered, ``dy`` is gathered there too."""
    mesh, out, dy = lw.mesh, node.outputs[0], node.inputs[1]
    wsh = Sharding.of(out.shape, {k: ax for k, ax in split.items() if k in out.shape})
    dsh = lw.sharding(lw.value(dy)) if id(dy) in lw.env else lw.target(dy)   # dy not made yet: as its layout has it
    return (lw.cost.collective("allreduce", wsh.local_numel(out.shape, mesh) * out.dtype.itemsize, p),
            relayout_cost(dy.shape, dsh, gathered(dsh, dy.shape, d), mesh, dy.dtype.itemsize, lw.cost))


def _halos(lw, node, xv, split: dict):
    """``x``'s value with the halos of its split spatial dims glued on, and each spatial dim's
    window; a spatial dim no exchange serves is gathered (dropped from ``split``)."""
    mesh, x = lw.mesh, node.inputs[0]
    widths = {}
    for d, *_ in node.attrs["spatial"]:
        axes = split.get(d, ())
        if not axes:
            continue
        n, p = x.shape.get(d).size, mesh.axis_size(axes)
        widths[d] = conv_reach(node, 0, d).widths(n, p, cut_by(mesh, axes)) or _far(lw, node, xv, split, d)
        if widths[d] is None:
            lw.note(f"{node.name}: no exchange with the ranks around gives the taps' window on '{d}' "
                    "for less than gathering it; the dim is gathered")
            del split[d]
    xv = lw.relayout(xv, Sharding.of(x.shape, split), node, f"input 0 of {node.op.name}")
    windows = []
    for d, *_ in node.attrs["spatial"]:
        reach, n, p = conv_reach(node, 0, d), x.shape.get(d).size, mesh.axis_size(split.get(d, ()))
        hl = 0
        cut = cut_by(mesh, split.get(d, ()))
        if p > 1:
            hl, xv = extend(lw, node, x, xv, d, reach, widths[d])
        windows.append(window_attrs(reach, d, x.shape.index(d), n, p, hl, cut))
    return xv, tuple(windows)


def _note_gathered_phases(lw, node) -> None:
    """Note a strided conv's phase that arrives whole along a spatial dim its source split unevenly:
    the phase rearrange (``(d d_phase) -> d d_phase``, :func:`meshdsl.ops.conv.conv`) keeps a split
    only where every part starts at a multiple of the stride, which ``torch.tensor_split``'s cut
    of such a length does not (10 rows, stride 2, 3 ranks: 4, 3, 3), so it gathered the dim."""
    if node.phase != "forward":
        return
    for d, *_ in node.attrs["spatial"]:
        t = node.inputs[0]   # up to the rearrange that made d's phases (another dim's may follow it)
        while t.node is not None and t.node.op.name in ("squeeze", "slice", "pad", "rearrange") and not (
                t.node.op.name == "rearrange" and f"{d}_phase" not in t.node.inputs[0].shape.names):
            t = t.node.inputs[0]
        if t.node is None or t.node.op.name != "rearrange" or f"{d}_phase" not in t.shape.names:
            continue
        src = t.node.inputs[0]
        while src.node is not None and src.node.op.name == "pad" and id(src) not in lw.env:
            src = src.node.inputs[0]
        vid = lw.value(src) if id(src) in lw.env else None
        sh = lw.sharding(vid) if vid is not None else None
        axes = sh.axes_of(d) if sh is not None else ()
        n, stride = src.shape.get(d).size, t.shape.get(f"{d}_phase").size
        if axes and n % lw.mesh.axis_size(axes) and lw.relaid(vid, gathered(sh, src.shape, d)) \
                and not lw.memo.get(("phases noted", id(t))):
            lw.memo[("phases noted", id(t))] = True   # once per rearrange, not per phase
            lw.note(f"{node.name}: a strided conv's phases of '{d}' ({n} rows split unevenly over "
                    f"{','.join(axes)}) do not cut at multiples of the stride {stride}: the input is gathered "
                    "(docs/design/communication.md, 'Halos over uneven splits')")


@lowering("conv", "conv_weight_grad")
def lower_conv(lw, node) -> None:
    """Lower a conv or its weight gradient; see the module docstring."""
    mesh, a, out = lw.mesh, node.attrs, node.outputs[0]
    x, other = node.inputs
    weight_grad = node.op.name == "conv_weight_grad"
    xv = lw.reduced(lw.value(x))
    split = _compute_split(lw, node, xv)
    _note_gathered_phases(lw, node)
    xv, windows = _halos(lw, node, xv, split)
    # The other operand (w, or the weight gradient's dy) is split as the compute is.  The dims
    # the kernel sums over leave a partial sum: conv's input channel, the weight gradient's
    # batch and spatial dims (not its per dims: per-sample weights keep them, cut as x is).
    per = a.get("per", ())
    summed = [d for d in x.shape.names if d not in a["in_dims"] and d not in per] if weight_grad \
        else list(a["in_dims"])
    want = Sharding.of(other.shape, {d: ax for d, ax in split.items() if d in other.shape})
    ov = lw.relayout(lw.reduced(lw.value(other)), want, node, f"input 1 of {node.op.name}")
    partial = tuple(ax for ax in mesh.names if any(ax in split.get(d, ()) for d in summed))
    out_sh = Sharding.of(out.shape, {d: ax for d, ax in split.items() if d in out.shape and d not in summed},
                         partial)
    res = lw.new_value(out.shape, out.dtype, out_sh)
    local = {}
    for t in (x, other, out):   # the output's spatial sizes last: a valid conv's are smaller
        local.update({d.name: -(-d.size // mesh.axis_size(split.get(d.name, ()))) for d in t.shape})  # the largest part
    lw.emit("local", node, [xv, ov], [res],
            args={"fn": _weight_grad if weight_grad else _conv, "attrs": {"conv": a, "windows": windows},
                  "compute": {d: ax for d, ax in split.items() if d in x.shape},
                  "sizes": {d.name: d.size for d in x.shape}},
            flops=node.op.flops(node, local))
    tgt = lw.target(out)
    lazy = keep_microbatches(tgt.with_partial(tuple(ax for ax in partial if ax not in tgt.used_axes)),
                             out_sh, out.shape, mesh)
    lw.bind(out, lw.relayout(res, lazy, node, f"output of {node.op.name} to its layout"))
