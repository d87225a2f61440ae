"""Attention sinks over a split sequence: the halo and the sink rows in one allgather.

A sliding-window attention with ``sinks`` S (StreamingLLM: query ``i`` keeps key ``j <= i`` when
``i - j < w`` or ``j < S``) whose query and key dims are split alike (``seq:model``) needs on each
rank, besides its own key and value block, the ``hl = w - 1`` rows before it (and ``hr`` after it,
not causal) and the first S rows, which only the first rank(s) hold.  Each rank packs the rows any
other rank may read from it into one buffer, its *edges*: the last ``hl`` rows of its k block, the
first ``hr``, its own rows among the first S (placed where they lie in ``[0, S)``, zeros
elsewhere), then the same of v, in k's dim order: ``2 (hl + hr + S)`` rows.  One allgather of
that buffer over the seq axes gives every rank every rank's edges; from them it assembles its
extended block (the rows before and after its own, from the ranks that hold them, as near or
far as the window reaches, over even or uneven blocks) and the sink rows (the sum of the ranks'
sink parts: they do not overlap), and the fused kernel runs on ``[sinks, extended block]``
(:func:`meshdsl.ops.attention._mask` keeps a sink copy only where the window does not reach
it, so that no key counts twice).

The backward runs the kernel on the same keys, keeps the gradient of its own rows, and puts the
gradient of every row it read from another rank into that rank's slot of a buffer shaped as the
gathered edges; one reduce-scatter over the seq axes (the allgather's adjoint) hands each rank
the sum for its own edges, added onto its rows.  One collective each way, for k and v together,
where the halo's permutes and a separate move of the sink rows took several: the choice
against gathering k and v whole is priced (:mod:`.attention`).
"""
from __future__ import annotations

import torch

from ..layout.sharding import Sharding
from ..ops.registry import OPS
from .halo import halo_parts, resized


def _perm(a, b) -> tuple[int, ...]:
    """The permutation that takes a tensor in ``a``'s dim order to ``b``'s (the two share dims)."""
    return tuple(a.shape.index(n) for n in b.shape.names)


def edge_rows(hl: int, hr: int, num_sinks: int) -> int:
    """The rows of one rank's edges buffer (see the module docstring)."""
    return 2 * (hl + hr + num_sinks)


def edges_cost(lw, k, sh: Sharding, kd: str, widths, num_sinks: int, axes) -> float:
    """Seconds the allgather of every rank's edges (``k`` at ``sh``, ``widths`` = (hl, hr)) takes."""
    p = lw.mesh.axis_size(axes)
    shape = resized(k.shape, kd, edge_rows(*widths, num_sinks))
    row = Sharding.of(shape, {d: x for d, x in sh.split.items() if d != kd}).local_numel(shape, lw.mesh)
    return lw.cost.collective("allgather", row * p * k.dtype.itemsize, p)


# ----------------------------------------------------------------------------- local kernels

def _rows_at(x, pos: int, start: int, width: int):
    """Rows ``[start, start + width)`` of ``x`` along ``pos``; zeros where they fall outside it."""
    lo, hi = max(start, 0), min(start + width, x.shape[pos])
    if lo >= hi:
        return _zeros(x, pos, width)
    if (lo, hi) == (start, start + width):
        return x.narrow(pos, lo, width)
    return torch.cat([_zeros(x, pos, lo - start), x.narrow(pos, lo, hi - lo), _zeros(x, pos, start + width - hi)], pos)


def _zeros(x, pos: int, rows: int):
    return x.new_zeros(x.shape[:pos] + (rows,) + x.shape[pos + 1:])


def _pack(ctx, attrs, k, v):
    """This rank's edges: per tensor (k, then v in k's dim order) its last ``hl`` rows, its first
    ``hr`` and its rows among the first ``sinks`` in place in zeros."""
    pos, hl, hr, num_sinks = attrs["pos"], attrs["hl"], attrs["hr"], attrs["sinks"]
    off = ctx.offset(attrs["dim"])
    pieces = []
    for x in (k, v.permute(attrs["v_to_k"])):
        n = x.shape[pos]
        pieces += [_rows_at(x, pos, n - hl, hl), _rows_at(x, pos, 0, hr), _rows_at(x, pos, -off, num_sinks)]
    return torch.cat(pieces, pos)


def _sources(attrs, off: int):
    """Where this rank's (block offset ``off``) extended rows come from: ``(side, at, slot, row,
    count)``: ``count`` rows of the gathered edges, from slot ``slot`` at ``row`` in its part
    ``side`` (0: last rows, 1: first rows), land ``at`` rows into the ``hl`` before (side 0) or the
    ``hr`` after (side 1) this rank's block."""
    hl, hr, parts = attrs["hl"], attrs["hr"], attrs["parts"]
    me = next(i for i, (o, _) in enumerate(parts) if o == off)
    o_r, l_r = parts[me]
    out = []
    for j, (o, ln) in enumerate(parts):
        if j == me:
            continue
        a, b = max(o, o_r - hl), min(o + ln, o_r)   # rows before the block, held by j: its last rows
        if a < b:
            out.append((0, a - (o_r - hl), j, a - (o + ln - hl), b - a))
        a, b = max(o, o_r + l_r), min(o + ln, o_r + l_r + hr)   # rows after the block: j's first rows
        if a < b:
            out.append((1, a - (o_r + l_r), j, a - o, b - a))
    return out


def _unpack(ctx, attrs, x, edges, which: int):
    """(sink rows, extended block) of k (``which`` 0) or v (1, in v's dim order) from its block
    ``x`` and the gathered edges."""
    pos, hl, hr, num_sinks = attrs["pos"], attrs["hl"], attrs["hr"], attrs["sinks"]
    width = edge_rows(hl, hr, num_sinks)
    base = which * (hl + hr + num_sinks)
    slot = [edges.narrow(pos, j * width + base, width // 2) for j in range(len(attrs["parts"]))]
    sides = [_zeros(slot[0], pos, w) for w in (hl, hr)]
    for side, at, j, row, count in _sources(attrs, ctx.offset(attrs["dim"])):
        sides[side].narrow(pos, at, count).copy_(slot[j].narrow(pos, side * hl + row, count))
    sinks = sum(s.narrow(pos, hl + hr, num_sinks) for s in slot)
    back = attrs["k_to_v"] if which else tuple(range(x.dim()))
    return sinks.permute(back), torch.cat([sides[0].permute(back), x, sides[1].permute(back)], attrs["kv_pos"][which])


def kernel(ctx, attrs, *xs):
    """The fused kernel (``attrs["op"]``) on ``[sinks, extended block]`` keys and values; ``xs``:
    the kernel's inputs (k and v this rank's blocks), then the gathered edges.  The backward
    returns dq, the gradient of this rank's own k and v rows, and the edges' gradient."""
    *ins, edges = xs
    slot, (kp, vp) = attrs["k_slot"], attrs["kv_pos"]
    kv = [_unpack(ctx, attrs, ins[slot + i], edges, i) for i in (0, 1)]
    ins[slot], ins[slot + 1] = torch.cat(kv[0], kp), torch.cat(kv[1], vp)
    outs = OPS[attrs["op"]].compute(ctx, attrs, *ins)
    if attrs["op"] == "attention":
        return outs
    dq, dk, dv = outs
    num_sinks, hl = attrs["sinks"], attrs["hl"]
    n = [t.shape[p] for t, p in zip(xs[slot:slot + 2], (kp, vp))]
    own = [d.narrow(p, num_sinks + hl, m) for d, p, m in zip((dk, dv), (kp, vp), n)]
    return dq, own[0], own[1], _scatter(ctx, attrs, dk, dv.permute(attrs["v_to_k"]), edges)


def _scatter(ctx, attrs, dk, dv, edges):
    """The gradient of the rows this rank read from others (``dk``, ``dv``: of its ``[sinks,
    extended block]`` keys, both in k's dim order), each in the slot of the rank that sent it."""
    pos, hl, hr, num_sinks = attrs["pos"], attrs["hl"], attrs["hr"], attrs["sinks"]
    width, half = edge_rows(hl, hr, num_sinks), hl + hr + num_sinks
    out = torch.zeros_like(edges)
    for which, d in enumerate((dk, dv)):
        n = d.shape[pos] - num_sinks - hl - hr   # this rank's own rows
        ext = (d.narrow(pos, num_sinks, hl), d.narrow(pos, num_sinks + hl + n, hr))
        for side, at, j, row, count in _sources(attrs, ctx.offset(attrs["dim"])):
            out.narrow(pos, j * width + which * half + side * hl + row, count).add_(ext[side].narrow(pos, at, count))
        for j, (o, ln) in enumerate(attrs["parts"]):   # a sink row's gradient to the rank that owns it
            rows = max(0, min(o + ln, num_sinks) - o)
            if rows:
                out.narrow(pos, j * width + which * half + hl + hr + o, rows).add_(d.narrow(pos, o, rows))
    return out


def _fold(ctx, attrs, dk, dv, got):
    """This rank's own dk and dv rows plus the gradient of its edges (``got``, summed over the ranks)."""
    pos, hl, hr, num_sinks = attrs["pos"], attrs["hl"], attrs["hr"], attrs["sinks"]
    off, half = ctx.offset(attrs["dim"]), hl + hr + num_sinks
    out = []
    for which, (d, p) in enumerate(zip((dk, dv), attrs["kv_pos"])):
        g = got.narrow(pos, which * half, half)
        g = g if not which else g.permute(attrs["k_to_v"])
        n = d.shape[p]
        d = d.clone()
        lo = max(0, n - hl)   # the last hl rows (fewer in a shorter block: the rest was zeros)
        d.narrow(p, lo, n - lo).add_(g.narrow(p, hl - (n - lo), n - lo))
        first = min(hr, n)
        d.narrow(p, 0, first).add_(g.narrow(p, hl, first))
        rows = max(0, min(n, num_sinks - off))
        if rows:
            d.narrow(p, 0, rows).add_(g.narrow(p, hl + hr + off, rows))
        out.append(d)
    return tuple(out)


# ----------------------------------------------------------------------------- lowering

def kernel_attrs(lw, node, k, v, axes, widths) -> dict:
    """What :func:`kernel` and the pack and fold steps read, besides the node's own attrs."""
    kd = node.attrs["key_dim"]
    return {"dim": kd, "pos": k.shape.index(kd), "kv_pos": (k.shape.index(kd), v.shape.index(kd)),
            "hl": widths[0], "hr": widths[1], "sinks": node.attrs["sinks"], "parts": halo_parts(
                k.shape.get(kd).size, lw.mesh, axes), "v_to_k": _perm(v, k), "k_to_v": _perm(k, v),
            "op": node.op.name, "sink_rows": node.attrs["sinks"], "halo": widths[0],
            "keys": k.shape.get(kd).size, "k_slot": 1 if node.op.name == "attention" else 2}


def gathered_edges(lw, node, k, blocks, attrs) -> int:
    """Every rank's edges (see the module docstring) on every rank: one local pack, one allgather;
    shared by the readers of the same k and v blocks in this plan (the backward reads the forward's)."""
    key = ("attention edges", *blocks, attrs["hl"], attrs["hr"], attrs["sinks"])
    if key in lw.memo:
        return lw.memo[key]
    sh, kd = lw.values[blocks[0]].sharding, attrs["dim"]
    axes = sh.axes_of(kd)
    shape = resized(k.shape, kd, edge_rows(attrs["hl"], attrs["hr"], attrs["sinks"]) * lw.mesh.axis_size(axes))
    part = lw.new_value(shape, k.dtype, Sharding.of(shape, {d: x for d, x in sh.split.items()}))
    lw.emit("local", node, list(blocks), [part], args={"fn": _pack, "attrs": attrs, "compute": sh.split,
                                                        "sizes": {d.name: d.size for d in k.shape}})
    whole = Sharding.of(shape, {d: x for d, x in sh.split.items() if d != kd})
    out = lw.relayout(part, whole, node, f"attention edges: {attrs['hl'] + attrs['hr']} window rows and the "
                                         f"first {attrs['sinks']} '{kd}' rows of k and v to every rank")
    lw.memo[key] = out
    return out


def edges_grad_sharding(lw, edges: int, groups, axes) -> Sharding:
    """The edges' gradient as the backward kernel makes it: whole, a partial sum over the ranks."""
    sh = lw.values[edges].sharding
    return Sharding.of(lw.values[edges].shape, sh.split, tuple(groups) + tuple(axes))


def fold_edges(lw, node, own, grad: int, kv, attrs, groups) -> tuple[int, int]:
    """dk and dv of this rank's blocks: its own rows' gradient ``own`` plus its edges' gradient,
    the buffer ``grad`` reduce-scattered back to the ranks that sent the rows."""
    g, kd = lw.values[grad], attrs["dim"]
    axes = [x for x in g.sharding.partial if x not in groups]
    back = Sharding.of(g.shape, {**g.sharding.split, kd: tuple(axes)}, tuple(groups))
    got = lw.relayout(grad, back, node, f"attention edges: the gradient of the window and sink rows of '{kd}'")
    outs = [lw.new_value(t.shape, t.dtype, lw.values[vid].sharding) for t, vid in zip(kv, own)]
    sh = lw.values[own[0]].sharding
    lw.emit("local", node, [*own, got], outs, args={"fn": _fold, "attrs": attrs, "compute": sh.split,
                                                    "sizes": {d.name: d.size for d in kv[0].shape}})
    return outs[0], outs[1]
