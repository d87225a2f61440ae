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
"""
from __future__ import annotations

from ..ops.einsum import einsum
from ..ops.elementwise import exp, log, stop_gradient, where
from ..ops.embed import causal_mask
from ..ops.reduce import reduce_max, reduce_sum
from .composite import lower_composite
from .generic import lower_generic
from .rules import lowering


def _scores(q, k, attrs):
    """``q . k * scale`` ``[batch..., query, key]``, the causal mask applied (-inf after the query)."""
    qd, kd = attrs["query_dim"], attrs["key_dim"]
    out = [*attrs["batch"], qd, kd]
    s = einsum(f"{' '.join(q.shape.names)}, {' '.join(k.shape.names)} -> {' '.join(out)}", q, k) * attrs["scale"]
    if attrs["causal"]:
        s = where(causal_mask(q.shape.get(qd), k.shape.get(kd)), s, float("-inf"))
    return s


def _contract(a, b, out):
    return einsum(f"{' '.join(a.shape.names)}, {' '.join(b.shape.names)} -> {' '.join(out.shape.names)}", a, b)


def composite_forward(q, k, v, attrs):
    """(out, logsumexp) of the fused attention, from einsums, a max, an exp and a sum."""
    kd = attrs["key_dim"]
    s = _scores(q, k, attrs)
    m = stop_gradient(reduce_max(s, kd))
    e = exp(s - m)
    z = reduce_sum(e, kd)
    out = _contract(e / z, v, q)
    return out, m + log(z)


def composite_backward(g, q, k, v, out, lse, attrs):
    """(dq, dk, dv) of the fused attention, the probabilities recomputed from ``lse``."""
    p = exp(_scores(q, k, attrs) - lse)
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
    if not _keys_stay_split(lw, node):
        lower_generic(lw, node)
        return
    build = composite_forward if node.op.name == "attention" else composite_backward
    lower_composite(lw, node, lambda *ins: build(*ins, node.attrs))
