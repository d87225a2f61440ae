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

A conv whose output is the narrower of the two (a conv's input gradient where ``c_out > c_in``:
it reads the output's gradient, ``c_out`` wide, and makes ``c_in``) need not trade its input's
halo: each rank convolves its own input rows alone (zeros for the rest, :func:`_own_rows`) into
its output block and the rows around it they feed, and sends those rows to the neighbours that
own them, where they are added (:func:`~.halo_routes.fold_halo`): as many rows, output-wide.
The readers of one value share its halo, so they leave it together or not at all
(:func:`_leaves_halo`): every conv among them folds, and every weight gradient (whose sums are
also the weight gradient of its conv's input gradient, its operands the other way round,
:func:`_swapped`) reads its other operand's halo, which a recurrence's forward saved; where the
cost model finds that cheaper than the halo.  A fold reaches the neighbours only; past them the
halo stays.
"""
from __future__ import annotations

import dataclasses

import torch.nn.functional as F

from ..layout.sharding import Sharding
from ..ops.conv import conv_valid, dilations, span, weight_grad_valid
from .halo import READS, Reach, cut_by, extend, gathered, piece_rows, readers, reads, resized, take_window, window_attrs
from .halo_routes import fold_halo
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
        x = _own_rows(ctx, w, x) if "own" in w else take_window(ctx, w, x)
    return x


def _conv(ctx, attrs, x, w):
    return conv_valid(attrs["conv"], _windows(ctx, attrs, x), w)


def _weight_grad(ctx, attrs, x, dy):
    return weight_grad_valid(attrs["conv"], _windows(ctx, attrs, x), dy)


def _compute_split(lw, node, xsh: Sharding) -> dict:
    """Compute dim -> axes: ``x``'s splits (held at ``xsh``), each output channel dim's where free
    (see the module docstring)."""
    a, other = node.attrs, node.inputs[1]
    split = dict(xsh.split)
    used = {ax for axes in split.values() for ax in axes}
    for out_dim in a["out_dims"]:
        cands = [lw.target(node.outputs[0]).axes_of(out_dim), _held(lw, other).axes_of(out_dim)]
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


def _halos(lw, node, xv, split: dict, folds: dict):
    """``x``'s value with the halos of its split spatial dims glued on, and each spatial dim's
    window; a spatial dim no exchange serves is gathered (dropped from ``split``); a dim in
    ``folds`` trades no halo: its window is the rank's own rows (:func:`_own_rows`)."""
    mesh, x = lw.mesh, node.inputs[0]
    widths = {}
    for d, *_ in node.attrs["spatial"]:
        axes = split.get(d, ())
        if not axes or d in folds:
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
        if d in folds:
            windows.append(_fold_window(reach, d, x.shape.index(d), n, folds[d], cut))
            continue
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


# ----------------------------------------------------------------------------- the output's overlap

def _fold_widths(node, d: str, n: int, p: int, cut) -> tuple[int, int] | None:
    """``(hl, hr)``: the rows of conv ``node``'s output before and after each rank's block that its
    own input rows (``n`` along ``d``, ``p`` blocks) feed: output row i reads input rows i - s ..
    i - s + e, so input row j feeds output rows j + s - e .. j + s, a window of its own (the
    adjoint's); None where some rank's rows feed past its neighbours' blocks."""
    r = conv_reach(node, 0, d)
    return Reach(r.e - r.s, n, r.e).widths(r.m, p, cut)


def _own_rows(ctx, w: dict, x):
    """The input rows this rank's extended output block reads along ``w["dim"]`` (its own output
    block and ``hl`` rows before, ``hr`` after): its own block's rows, zeros for every other row
    (those reach the output through the ranks that hold them, folded in after)."""
    pos, off = w["pos"], ctx.offset(w["dim"])
    o_off, o_len = next((oo, ol) for o, oo, ol in w["blocks"] if o == off)
    lo, hi = o_off - w["hl"] - w["s"], o_off + o_len + w["hr"] - w["s"] + w["e"]
    a, b = max(lo, off), min(hi, off + x.shape[pos])
    if a >= b:
        return x.new_zeros(x.shape[:pos] + (hi - lo,) + x.shape[pos + 1:])
    return F.pad(x.narrow(pos, a - off, b - a), (0, 0) * (x.dim() - 1 - pos) + (a - lo, hi - b))


def _held(lw, t) -> Sharding:
    """Where ``t`` is (or, not made yet, where its layout puts it), without a partial sum."""
    sh = lw.sharding(lw.value(t)) if id(t) in lw.env else lw.target(t)
    return Sharding.of(t.shape, sh.split)


def _rows_cost(lw, t, sh: Sharding, d: str, widths, vid: int | None = None) -> float:
    """Seconds the permutes of ``widths`` rows of ``t`` (at ``sh``) along ``d`` take; none where
    value ``vid`` traded that halo already."""
    hit = lw.memo.get(("halo", vid, d, False)) if vid is not None else None
    if hit and hit[0] >= widths[0] and hit[1] >= widths[1]:
        return 0.0
    mesh, n = lw.mesh, t.shape.get(d).size
    p = mesh.axis_size(sh.axes_of(d))
    row = sh.local_numel(t.shape, mesh) // -(-n // p) * t.dtype.itemsize   # the largest block's rows
    return sum(lw.cost.collective("permute", w * row, p) for w in widths if w)


def _swapped(node):
    """Weight gradient ``node`` computed from its operands the other way round: ``dw`` of a conv is
    also the weight gradient of that conv's input gradient (operands: the output's gradient and
    the input; taps and padding mirrored, channel dims swapped), so it reads the other operand's
    halo.  The node itself, its inputs and attrs swapped (its id, name and output kept)."""
    a = node.attrs
    extra = {k: a[k] for k in ("dilation", "per") if k in a}
    spatial = tuple((d, tap, k, span(k, dl) - 1 - b, span(k, dl) - 1 - af)
                    for (d, tap, k, b, af), dl in zip(a["spatial"], dilations(a)))
    attrs = {"spatial": spatial, "in_dims": a["out_dims"], "out_dims": a["in_dims"], "flip": not a["flip"],
             "w_names": a["w_names"], **extra}
    inputs = node.inputs[::-1]
    ((shape, _),) = node.op.infer(inputs, attrs)
    assert shape == node.outputs[0].shape, (shape, node.outputs[0].shape)
    return dataclasses.replace(node, inputs=inputs, attrs=attrs)


def _leaves_halo(lw, node) -> bool:
    """Whether ``node`` (a conv, or a weight gradient) reads no halo of its input 0: the conv folds
    its output's overlap instead, the weight gradient reads its other operand's halo (:func:`_swapped`)."""
    x = node.inputs[0]
    key = ("leaves halo", id(x))
    if key not in lw.memo:
        lw.memo[key] = _readers_leaving(lw, x)
    return id(node) in lw.memo[key]


def _readers_leaving(lw, x) -> frozenset:
    """The ids of the readers of ``x`` that leave its halo: all of them, where each reads it along
    its split spatial dims as a conv (which then folds its output's overlap, ``c_out`` wide, not
    the input's halo, ``c_in`` wide: a conv's input gradient, whose input is the wider) or a
    weight gradient (which swaps, :func:`_swapped`), and those ways cost less than the halo they all
    share; none otherwise (one reader that keeps the halo pays it for all)."""
    mesh, sh = lw.mesh, _held(lw, x)
    dims = [d for d in sh.split if sh.axes_of(d)]
    group, halo, alt = [], {}, 0.0
    for r, slot in readers(lw, x):
        reach = READS.get(r.op.name)
        reached = [d for d in dims if reach is not None and reach(r, slot, d) is not None]
        if r.op.name == "conv_weight_grad" and slot and id(r) in lw.memo.get(("leaves halo", id(r.inputs[0])), ()):
            return frozenset()   # swapped already: it reads this halo
        if r.op.name == "shift" and not slot and not reached:
            return frozenset()   # a shift along a whole dim: the shifts of its result may read x's halo
        if not reached:
            continue
        if r.op.name not in ("conv", "conv_weight_grad"):
            return frozenset()
        for d in reached:
            n, p, cut = x.shape.get(d).size, mesh.axis_size(sh.axes_of(d)), cut_by(mesh, sh.axes_of(d))
            w = conv_reach(r, 0, d).widths(n, p, cut)
            if w is None:
                return frozenset()
            was = halo.get(d, (0, 0))
            halo[d] = (max(was[0], w[0]), max(was[1], w[1]))
        cost = _way_around(lw, r, sh, reached)
        if cost is None:
            return frozenset()
        group.append(r)
        alt += cost
    vid = lw.value(x) if id(x) in lw.env else None
    paid = sum(_rows_cost(lw, x, sh, d, w, vid) for d, w in halo.items())
    return frozenset(id(r) for r in group) if group and alt < paid - 1e-12 else frozenset()


def _way_around(lw, node, sh: Sharding, dims) -> float | None:
    """Seconds reader ``node`` of a value held at ``sh`` spends not reading its halo along ``dims``:
    a conv's fold of its output's overlap, a weight gradient's halo of its other operand; None
    where that does not serve (a window past the neighbours, the other operand split otherwise)."""
    mesh, cost = lw.mesh, 0.0
    if node.op.name == "conv":
        out = node.outputs[0]
        out_sh = Sharding.of(out.shape, {d: ax for d, ax in _compute_split(lw, node, sh).items()
                                         if d in out.shape and d not in node.attrs["in_dims"]})
        for d in dims:
            axes = sh.axes_of(d)
            w = _fold_widths(node, d, node.inputs[0].shape.get(d).size, mesh.axis_size(axes), cut_by(mesh, axes))
            if w is None:
                return None
            cost += _rows_cost(lw, out, out_sh, d, w)
        return cost
    other = node.inputs[1]
    osh, turned = _held(lw, other), _swapped(node)
    for d in dims:
        axes = sh.axes_of(d)
        if osh.axes_of(d) != axes:
            return None
        w = conv_reach(turned, 0, d).widths(other.shape.get(d).size, mesh.axis_size(axes), cut_by(mesh, axes))
        if w is None:
            return None
        cost += _rows_cost(lw, other, osh, d, w, lw.value(other) if id(other) in lw.env else None)
    return cost


def _folds(lw, node, split: dict) -> dict:
    """Spatial dim -> ``(hl, hr)``: where conv ``node`` computes its output from each rank's own
    input rows and folds the overlap onto the neighbours (:func:`_leaves_halo`); empty otherwise."""
    if node.op.name != "conv" or not _leaves_halo(lw, node):
        return {}
    mesh, x = lw.mesh, node.inputs[0]
    out = {}
    for d, *_ in node.attrs["spatial"]:
        axes = split.get(d, ())
        if axes:
            out[d] = _fold_widths(node, d, x.shape.get(d).size, mesh.axis_size(axes), cut_by(mesh, axes))
    return {} if None in out.values() else out   # split otherwise than the readers' choice saw: the halo


def _fold_window(reach: Reach, d: str, pos: int, n: int, widths, cut) -> dict:
    """What :func:`_own_rows` needs: the reach, each source block's output block and the widths."""
    return {"own": True, "dim": d, "pos": pos, "s": reach.s, "e": reach.e, "hl": widths[0], "hr": widths[1],
            "blocks": tuple((o, oo, ol) for (o, _), (oo, ol) in zip(cut(n), cut(reach.m)))}


@lowering("conv", "conv_weight_grad")
def lower_conv(lw, node) -> None:
    """Lower a conv or its weight gradient; see the module docstring."""
    weight_grad = node.op.name == "conv_weight_grad"
    if weight_grad and _leaves_halo(lw, node):
        node = _swapped(node)
        lw.note(f"{node.name}: computed from its operands the other way round, reading the halo of "
                f"'{node.inputs[0].name}', not of '{node.inputs[1].name}' (whose readers leave its halo)")
    mesh, a, out = lw.mesh, node.attrs, node.outputs[0]
    x, other = node.inputs
    xv = lw.reduced(lw.value(x))
    split = _compute_split(lw, node, lw.sharding(xv))
    _note_gathered_phases(lw, node)
    folds = _folds(lw, node, split)
    xv, windows = _halos(lw, node, xv, split, folds)
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
    made = out.shape
    for d, (hl, hr) in folds.items():   # each rank's output block and the rows its own input feeds around it
        made = resized(made, d, made.get(d).size + (hl + hr) * mesh.axis_size(split[d]))
    res = lw.new_value(made, out.dtype, out_sh)
    local = {}
    for t in (x, other, out):   # the output's spatial sizes last: a valid conv's are smaller
        local.update({d.name: -(-d.size // mesh.axis_size(split.get(d.name, ()))) for d in t.shape})  # the largest part
    lw.emit("local", node, [xv, ov], [res],
            args={"fn": _weight_grad if weight_grad else _conv, "attrs": {"conv": a, "windows": windows},
                  "compute": {d: ax for d, ax in split.items() if d in x.shape},
                  "sizes": {d.name: d.size for d in x.shape}},
            flops=node.op.flops(node, local))
    for d, (hl, hr) in folds.items():
        res = fold_halo(lw, node, res, d, hl, hr, what="output overlap")
        lw.note(f"{node.name}: each rank convolves its own '{d}' rows and sends the {hl + hr} output "
                f"row{'s' if hl + hr > 1 else ''} they feed past its block to the neighbours, where they "
                "are added (narrower than the input's halo)")
    tgt = lw.target(out)
    lazy = keep_microbatches(tgt.with_partial(tuple(ax for ax in partial if ax not in tgt.used_axes)),
                             out_sh, out.shape, mesh)
    lw.bind(out, lw.relayout(res, lazy, node, f"output of {node.op.name} to its layout"))
