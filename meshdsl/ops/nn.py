"""Neural-network ops: softmax, log_softmax, layer_norm, rms_norm, cross_entropy
(composites of primitives, so they lower and differentiate on any layout, e.g.
a vocab-split cross-entropy), and dropout (a primitive whose mask depends only
on the global element index and the seed, never on the layout).
"""
from __future__ import annotations

import torch

from ..core.graph import Tensor
from ..core.shape import Dim
from ..errors import ShapeError, message
from .elementwise import exp, rsqrt, stop_gradient
from .embed import one_hot
from .reduce import logsumexp, reduce_max, reduce_mean, reduce_sum
from .registry import Op, apply, register


def _name(dim) -> str:
    return dim.name if isinstance(dim, Dim) else dim


def softmax(x: Tensor, dim) -> Tensor:
    """Softmax along ``dim``."""
    g = x.graph
    with g.scope("softmax"):
        d = _name(dim)
        e = exp(x - stop_gradient(reduce_max(x, d)))
        return e / reduce_sum(e, d)


def log_softmax(x: Tensor, dim) -> Tensor:
    """Log-softmax along ``dim``."""
    with x.graph.scope("log_softmax"):
        return x - logsumexp(x, _name(dim))


def _check_affine(what: str, x: Tensor, **params) -> None:
    """A norm's scale/bias may only use dims of ``x`` (else it would silently broadcast ``x``)."""
    for role, p in params.items():
        if p is not None and any(n not in x.shape for n in p.shape.names):
            extra = [n for n in p.shape.names if n not in x.shape]
            raise ShapeError(message(f"{what}: {role} {p!r} has dim(s) {extra} that {x!r} lacks.",
                                     rule=f"the {role} is shaped by dims of the normalised tensor",
                                     fix=f"give the {role} dims from {list(x.shape.names)}"))


def layer_norm(x: Tensor, dim, scale: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5) -> Tensor:
    """Layer norm over ``dim`` with optional ``scale`` and ``bias`` (shaped by ``dim``)."""
    _check_affine("layer_norm", x, scale=scale, bias=bias)
    with x.graph.scope("layer_norm"):
        d = _name(dim)
        xc = x - reduce_mean(x, d)
        y = xc * rsqrt(reduce_mean(xc * xc, d) + eps)
        if scale is not None:
            y = y * scale
        if bias is not None:
            y = y + bias
        return y


def rms_norm(x: Tensor, dim, scale: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """RMS norm over ``dim`` with an optional ``scale``."""
    _check_affine("rms_norm", x, scale=scale)
    with x.graph.scope("rms_norm"):
        y = x * rsqrt(reduce_mean(x * x, _name(dim)) + eps)
        return y * scale if scale is not None else y


def cross_entropy(logits: Tensor, labels: Tensor, dim) -> Tensor:
    """Per-example cross-entropy of integer ``labels`` under ``logits`` along ``dim``.

    Returns a tensor with ``labels``' dims; take ``reduce_mean`` for the loss.
    """
    d = _name(dim)
    if labels.shape != logits.shape.without([d]):
        raise ShapeError(message(
            f"cross_entropy: labels {labels.shape} must have the logits' dims minus '{d}' "
            f"({logits.shape.without([d])}).", rule="one label per example, indexing dim '" + d + "'",
            fix="rename or transpose the labels"))
    with logits.graph.scope("cross_entropy"):
        picked = reduce_sum(logits * one_hot(labels, logits.shape.get(d), logits.dtype), d)
        return logsumexp(logits, d) - picked


def _hash_uniform(shape_full, ctx, local_shape, names, seed: int) -> torch.Tensor:
    """Uniform [0,1) numbers from a 32-bit integer hash of each element's global index."""
    idx = torch.zeros((), dtype=torch.int64)
    stride = 1
    for i in reversed(range(len(names))):
        n = local_shape[i]
        ar = torch.arange(ctx.offset(names[i]), ctx.offset(names[i]) + n, dtype=torch.int64) * stride
        view = [1] * len(names)
        view[i] = n
        idx = idx + ar.view(view)
        stride *= shape_full[i]
    m = 0xFFFFFFFF
    h = (idx ^ ((seed * 0x9E3779B1 + 0x7F4A7C15) & m)) & m
    for _ in range(2):
        h = (((h >> 16) ^ h) * 0x45D9F3B) & m
    h = ((h >> 16) ^ h) & m
    return h.to(torch.float64).div_(4294967296.0).to(torch.float32)


@register
class Dropout(Op):
    name = "dropout"
    linear = True

    def infer(self, inputs, attrs):
        (x,) = inputs
        attrs["names"] = x.shape.names
        attrs["full"] = x.shape.sizes
        return [(x.shape, x.dtype)]

    def compute(self, ctx, attrs, x):
        seed = attrs["seed"] + 1000003 * ctx.salt
        u = _hash_uniform(attrs["full"], ctx, x.shape, attrs["names"], seed)
        keep = (u >= attrs["rate"]).to(x.dtype)
        return x * keep * (1.0 / (1.0 - attrs["rate"]))

    def grad(self, node, douts):
        g = douts[0]
        if g.shape.names != node.inputs[0].shape.names:
            from .shape_ops import transpose
            g = transpose(g, node.inputs[0].shape.names)
        return [apply("dropout", [g], dict(node.attrs))]


def dropout(x: Tensor, rate: float, seed: int = 0) -> Tensor:
    """Zero each element with probability ``rate`` and scale the rest by 1/(1-rate).

    The mask is a function of the element's global index and ``seed`` only, so
    every layout and process count drops the same elements.
    """
    if not x.dtype.is_floating_point:
        raise ShapeError(message(f"dropout: {x!r} is {x.dtype}, not floating point.",
                                 rule="dropout scales the kept elements by 1/(1-rate)", fix="cast it to a float dtype"))
    if not 0.0 <= rate < 1.0:
        raise ShapeError(message(f"dropout: rate {rate} is not in [0, 1).", rule="0 <= rate < 1",
                                 fix="pass a rate such as 0.1"))
    if rate == 0.0:
        return x
    return apply("dropout", [x], {"rate": float(rate), "seed": int(seed)})


__all__ = ["softmax", "log_softmax", "layer_norm", "rms_norm", "cross_entropy", "dropout"]
