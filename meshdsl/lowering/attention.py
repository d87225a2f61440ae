"""Lowering of the fused attention: fused, or composite where its key dim arrives split.

The fused kernels (``attention``, ``attention_backward``) need the key and feature dims whole
on a rank, so lowered generically a split key dim gathers k and v, forward and backward. When
k arrives split along its key dim and q is whole along its query dim (cross-attention from a
few queries over a long memory split by position: a Perceiver's latents, a decoder over an
encoder output under ``seq:model``), the node is lowered instead as the composite of the same
math, built in a sub-graph bound to the node's inputs as :mod:`.xent` does: the scores are
computed on each rank's keys, the softmax's max and sum are allreduced (a value per query),
and the weighted values come out as a partial sum over the key dim's axes. The backward
recomputes the probabilities from the forward's logsumexp (as the fused kernel does); its
``dk`` and ``dv`` stay split and ``dq`` is a partial sum. Nothing of the key dim moves.

The composite is chosen only where it moves fewer bytes: its collectives carry about q's
size (the output, or ``dq``) where the gathers carry k's and v's.

A sliding-window attention (``window`` w) whose query and key dims are split alike (self-attention
under ``seq:model``: k and v renamed from the split ``seq``) needs on each rank only the w - 1 key
and value rows before its block (and after it, not causal): they come from the neighbours as a halo
(:func:`~.halo.extend`, one ``permute`` per side and piece; from the ranks further on where w - 1
exceeds a block; over an uneven split, from the ranks that hold the rows each rank reads,
:mod:`.halo_routes`), and the fused kernel runs on the extended block, its mask
offset by the rank's position (:func:`meshdsl.ops.attention._mask`).  The backward reads the same
halo and sends the gradient rows of the halo keys and values back to the ranks that own them, where
they are added (:func:`~.halo_routes.fold_halo`).  With attention ``sinks`` the window's rows and the first S
rows come together, one allgather of each rank's edges and one reduce-scatter of their gradients
(:mod:`.attention_sinks`).  The cost model weighs it against gathering k and v.
"""
from __future__ import annotations

import torch

from ..layout.sharding import Sharding
from ..ops.einsum import einsum
from ..ops.elementwise import abs as abs_, exp, less, log, logical_or, maximum, stop_gradient, where
from ..ops.embed import causal_mask, iota
from ..ops.reduce import reduce_max, reduce_sum
from .attention_sinks import edges_cost, edges_grad_sharding, fold_edges, gathered_edges, kernel, kernel_attrs
from .composite import lower_composite
from .generic import lower_generic
from .halo import Reach, cut_by, extend, gathered, piece_rows
from .halo_routes import fold_halo, routes_of
from .relayout import relayout_cost
from .rules import lowering


def _scores(q, k, attrs, keep=None):
    """``q . k * scale`` ``[batch..., query, key]``, the causal mask applied (-inf after the query),
    and the window's and the user's ``keep`` mask."""
    qd, kd = attrs["query_dim"], attrs["key_dim"]
    out = [*attrs["batch"], qd, kd]
    s = einsum(f"{' '.join(q.shape.names)}, {' '.join(k.shape.names)} -> {' '.join(out)}", q, k) * attrs["scale"]
    if attrs["causal"]:
        s = where(causal_mask(q.shape.get(qd), k.shape.get(kd)), s, float("-inf"))
    if attrs.get("window") is not None:
        dist = iota(q.shape.get(qd)) - iota(k.shape.get(kd))
        near = less(dist if attrs["causal"] else abs_(dist), attrs["window"])
        if attrs.get("sinks"):   # the first keys stay visible besides the window
            near = logical_or(near, less(iota(k.shape.get(kd)), attrs["sinks"]))
        s = where(near, s, float("-inf"))
    if keep is not None:
        s = where(keep, s, float("-inf"))
    return s


def _contract(a, b, out):
    return einsum(f"{' '.join(a.shape.names)}, {' '.join(b.shape.names)} -> {' '.join(out.shape.names)}", a, b)


def composite_forward(q, k, v, attrs, keep=None):
    """(out, logsumexp) of the fused attention, from einsums, a max, an exp and a sum."""
    kd = attrs["key_dim"]
    s = _scores(q, k, attrs, keep)
    # A query that keeps no key (all its scores -inf) gets zeros and no gradient, as the fused
    # kernel and torch's SDPA give it: its max is raised to the dtype's lowest finite value (so
    # s - m is -inf, not NaN) and its sum of 0 to 1; any other row's max is finite, its sum >= 1.
    m = maximum(stop_gradient(reduce_max(s, kd)), _lowest(s))
    e = exp(s - m)
    z = reduce_sum(e, kd)
    z = where(less(z, 0.5), 1.0, z)
    out = _contract(e / z, v, q)
    return out, m + log(z)


def _lowest(t) -> float:
    """The lowest finite value of ``t``'s dtype."""
    return float(torch.finfo(t.dtype).min)


def composite_backward(g, q, k, v, out, lse, attrs, keep=None):
    """(dq, dk, dv) of the fused attention, the probabilities recomputed from ``lse``."""
    s = _scores(q, k, attrs, keep)
    p = exp(s - maximum(lse, _lowest(s)))   # a query that keeps no key: -inf - lowest, p = 0
    dv = _contract(p, g, v)
    ds = p * (_contract(g, v, p) - reduce_sum(g * out, attrs["feature_dim"])) * attrs["scale"]
    return _contract(ds, k, q), _contract(ds, q, k), dv


def _keys_stay_split(lw, node) -> bool:
    """Whether k arrives split along the key dim, q whole along the query dim, and the composite's
    collectives (about q's size) carry less than gathering k and v would."""
    q, k, v = node.inputs[:3] if node.op.name == "attention" else node.inputs[1:4]
    qd, kd = node.attrs["query_dim"], node.attrs["key_dim"]
    if not lw.sharding(lw.value(k)).axes_of(kd) or lw.sharding(lw.value(q)).axes_of(qd):
        return False
    return q.shape.numel < k.shape.numel + v.shape.numel


@lowering("attention", "attention_backward")
def lower_attention(lw, node) -> None:
    if _lower_halo(lw, node):
        return
    if not _keys_stay_split(lw, node):
        lower_generic(lw, node)
        return
    forward = node.op.name == "attention"
    build, n = (composite_forward, 3) if forward else (composite_backward, 6)
    lower_composite(lw, node, lambda *ins: build(*ins[:n], node.attrs, *ins[n:]))   # (the mask last)


# ----------------------------------------------------------------------------- sliding window: halo


def _halo_widths(lw, node):
    """``(axes, hl, hr)``: the key rows each rank needs from before and after its block when the
    node's window is served by a halo (query and key dims split alike, as wide as each other),
    else None."""
    a = node.attrs
    w = a.get("window")
    if w is None or a.get("masked"):   # a user's mask would need its halo columns too: gathered instead
        return None
    q, k = node.inputs[:2] if node.op.name == "attention" else node.inputs[1:3]
    qd, kd = a["query_dim"], a["key_dim"]
    n = q.shape.get(qd).size
    qs, ks = lw.sharding(lw.value(q)), lw.sharding(lw.value(k))
    axes = qs.axes_of(qd)
    if not axes or ks.axes_of(kd) != axes or k.shape.get(kd).size != n or qs.parts or qs.cyclic \
            or ks.parts or ks.cyclic or any(x in axes for d, xs in qs.split.items() if d != qd for x in xs):
        return None
    hl = min(w - 1, n - 1)
    hr = 0 if a["causal"] else hl
    return axes, hl, hr


def _shardings(node, q, k, lse, qs: Sharding, axes):
    """(q's, k's and v's, the logsumexp's) compute shardings: q's split but its feature dim, k's
    the same on the dims it shares and its key dim over ``axes``; no partial sums."""
    a = node.attrs
    split = {d: x for d, x in qs.split.items() if d != a["feature_dim"]}
    ksplit = {d: split[d] for d in k.shape.names if d in split}
    ksplit[a["key_dim"]] = axes
    return Sharding.of(q.shape, split), Sharding.of(k.shape, ksplit), Sharding.of(lse.shape, split)


def _halo_cost(lw, t, sh: Sharding, dim: str, widths) -> float:
    """Seconds the permutes of a halo of ``widths`` rows of ``t`` (at ``sh``) take."""
    mesh = lw.mesh
    axes = sh.axes_of(dim)
    p, n = mesh.axis_size(axes), t.shape.get(dim).size
    row = sh.local_numel(t.shape, mesh) // -(-n // p) * t.dtype.itemsize   # the largest block's rows
    reach = Reach(widths[0], n, sum(widths))
    return sum(lw.cost.collective("permute", rows * row, p) for rows in piece_rows([reach], n, p, cut_by(mesh, axes),
                                                                                    widths))


def _halo_pays(lw, node, kv, kv_vids, kvsh, hl: int, hr: int, axes) -> bool:
    """Whether the halo (and the sink rows) of k and v cost less than gathering them; notes why."""
    a, kd = node.attrs, node.attrs["key_dim"]
    gather = sum(0.0 if lw.relaid(vid, gathered(sh, t.shape, kd)) else relayout_cost(
        t.shape, sh, gathered(sh, t.shape, kd), lw.mesh, t.dtype.itemsize, lw.cost)
        for t, vid, sh in zip(kv, kv_vids, kvsh))
    halo = edges_cost(lw, kv[0], kvsh[0], kd, (hl, hr), a["sinks"], axes) if a.get("sinks") else \
        sum(_halo_cost(lw, t, sh, kd, (hl, hr)) for t, sh in zip(kv, kvsh))
    sinks = f" and the first {a['sinks']} (sinks)" if a.get("sinks") else ""
    if gather < halo - 1e-12:
        lw.note(f"{node.name}: window {a['window']} over split '{a['query_dim']}': gathering k and v costs less "
                f"than a halo of {hl + hr} key/value rows{sinks}; gathered")
        return False
    how = "one allgather of each rank's window and sink rows" if sinks else "the ranks that hold them (a halo)"
    lw.note(f"{node.name}: window {a['window']} over split '{a['query_dim']}': {hl + hr} key/value rows{sinks} "
            f"from {how}, not gathered")
    return True


def _lower_halo(lw, node) -> bool:
    """Lower a windowed attention over a split query/key dim by a halo of keys and values (see the
    module docstring); False where no halo serves or gathering k and v costs less."""
    plan = _halo_widths(lw, node)
    if plan is None:
        return False
    axes, hl, hr = plan
    fwd = node.op.name == "attention"
    ins = list(node.inputs)
    q, k, v = ins[:3] if fwd else ins[1:4]
    lse = node.outputs[1] if fwd else ins[5]
    a = node.attrs
    kd, num_sinks = a["key_dim"], a.get("sinks", 0)
    qsh, ksh, lsh = _shardings(node, q, k, lse, lw.sharding(lw.value(q)), axes)
    kv_vids = [lw.reduced(lw.value(t)) for t in (k, v)]
    kvsh = [Sharding.of(t.shape, ksh.split) for t in (k, v)]
    if not _halo_pays(lw, node, (k, v), kv_vids, kvsh, hl, hr, axes):
        return False
    blocks = [lw.relayout(vid, sh, node, f"input of {node.op.name}") for vid, sh in zip(kv_vids, kvsh)]
    step = {"compute": {**qsh.split, **ksh.split}, "sizes": {d.name: d.size for t in (q, k) for d in t.shape}}
    if num_sinks:   # the window's rows and the sink rows by one allgather (.attention_sinks)
        attrs = {**a, **kernel_attrs(lw, node, k, v, axes, (hl, hr))}
        kvx, lead = [*blocks, gathered_edges(lw, node, k, blocks, attrs)], hl
        step.update(fn=kernel, attrs=attrs)
    else:
        reach = Reach(hl, k.shape.get(kd).size, hl + hr)
        ext = [extend(lw, node, t, vid, kd, reach, (hl, hr)) if hl or hr else (0, vid)
               for t, vid in zip((k, v), blocks)]
        (lead, kx), (lead_v, vx) = ext
        assert lead == lead_v, (lead, lead_v)   # both exchanged as wide as this node asks, or wider alike
        kvx = [kx, vx]
        step.update(fn=node.op.compute, attrs={**a, "halo": lead, "keys": k.shape.get(kd).size})
    rel = [lw.relayout(lw.reduced(lw.value(t)), sh, node, f"input of {node.op.name}")
           for t, sh in zip(ins, (qsh,) if fwd else (qsh, qsh, None, None, qsh, lsh)) if sh is not None]
    if fwd:
        outs = [lw.new_value(q.shape, q.dtype, qsh), lw.new_value(lse.shape, lse.dtype, lsh)]
        lw.emit("local", node, [rel[0], *kvx], outs, args=step)
        lw.bind(node.outputs[0], lw.relayout(outs[0], lw.target(node.outputs[0]), node, "output of attention"))
        lw.bind(lse, outs[1])
        return True
    _lower_halo_backward(lw, node, rel, kvx, step, lead, (qsh, ksh, axes))
    return True


def _lower_halo_backward(lw, node, rel, kvx, step, lead: int, shardings) -> None:
    """The backward's kernel on the extended blocks ``kvx`` (with sinks: k's and v's blocks and the
    gathered edges), then dk and dv folded back onto the blocks that own their rows."""
    a, mesh = node.attrs, lw.mesh
    qsh, ksh, axes = shardings
    q, k, v = node.inputs[1:4]
    kd = a["key_dim"]
    g_, q_, o_, l_ = rel
    groups = tuple(x for d in a["batch"][a["shared"]:] for x in qsh.axes_of(d))
    ext_sh = [Sharding.of(lw.values[x].shape, ksh.split, groups) for x in kvx[:2]]   # dk, dv: sums over groups
    outs = [lw.new_value(q.shape, q.dtype, qsh)] + [lw.new_value(lw.values[x].shape, t.dtype, sh)
                                                     for x, t, sh in zip(kvx, (k, v), ext_sh)]
    if a.get("sinks"):
        outs.append(lw.new_value(lw.values[kvx[2]].shape, k.dtype, edges_grad_sharding(lw, kvx[2], groups, axes)))
    lw.emit("local", node, [g_, q_, *kvx[:2], o_, l_, *kvx[2:]], outs, args=step)
    lw.bind(node.outputs[0], lw.relayout(outs[0], lw.target(node.outputs[0]), node, "output of attention_backward"))
    if a.get("sinks"):
        grads = fold_edges(lw, node, outs[1:3], outs[3], (k, v), step["attrs"], groups)
    else:
        grads = []
        for t, vid, x in zip(node.outputs[1:], outs[1:], kvx):
            grown = (lw.values[vid].shape.get(kd).size - t.shape.get(kd).size) // mesh.axis_size(axes)
            grads.append(fold_halo(lw, node, vid, kd, lead, grown - lead, routes_of(lw, x)) if grown else vid)
    for t, vid in zip(node.outputs[1:], grads):
        lw.bind(t, lw.relayout(vid, lw.target(t), node, "output of attention_backward"))
