"""Lowering of the fused norms: fused where the normalised dim is whole, composite where it arrives split.

``rms_norm``, ``layer_norm``, ``normalize`` (a layer norm without affine) and their backwards
are one kernel each that needs the normalised dim whole on a rank (``fixed`` in their spec), so
lowered generically a split dim is gathered first: the whole activation, as a DeepSeek-V2
latent's norm under ``kv_latent:model`` or every norm under a ``d_model`` split would move it.
Where the input already arrives split along that dim, the node is lowered as the composite of
the same math instead (as :mod:`.softmax` does):

* RMS norm: ``rstd = rsqrt(mean(x^2) + eps)``, ``y = x * rstd * scale``; backward, with
  ``x̂ = x * rstd`` and ``gw = g * scale``: ``dx = (gw - x̂ * mean(gw * x̂)) * rstd``;
* layer norm: ``mean``, ``rstd = rsqrt(mean((x - mean)^2) + eps)``, ``y = (x - mean) * rstd *
  scale + bias``; backward ``dx = (gw - mean(gw) - x̂ * mean(gw * x̂)) * rstd``;
* the scale's gradient is ``g * x̂`` and the bias's ``g``, summed over the other dims.

The means over the split dim are small allreduces of one value per row (the layer norm
backward's two row sums packed into one allreduce); the outputs stay split
as the input was, and the statistics are those the fused kernel saves (fp32 for a 16-bit ``x``),
so a fused forward and a composite backward (or the reverse) agree.
"""
from __future__ import annotations

import torch

from ..core.shape import Dim
from ..ops.elementwise import cast, rsqrt
from ..ops.reduce import reduce_mean, reduce_sum
from ..ops.scan import squeeze, unsqueeze
from ..ops.slicing import concat, slice_
from .composite import lower_composite
from .generic import lower_generic
from .rules import lowering


def _acc(x):
    """``x`` in the statistics' dtype: fp32 for a 16-bit ``x``, else its own."""
    return cast(x, torch.float32) if x.dtype in (torch.bfloat16, torch.float16) else x


def _as(t, dtype):
    return t if t.dtype == dtype else cast(t, dtype)


def _sum_but(t, dim: str):
    """``t`` summed over every dim but ``dim`` (an affine param's gradient)."""
    others = [n for n in t.shape.names if n != dim]
    return reduce_sum(t, others) if others else t


def composite_rms_norm(x, *scale, dim: str, eps: float):
    """``(y, rstd)`` of ``rms_norm(x, dim, scale)``."""
    xf = _acc(x)
    rstd = rsqrt(reduce_mean(xf * xf, dim) + eps)
    y = xf * rstd
    if scale:
        y = y * _acc(scale[0])
    return [_as(y, x.dtype), rstd]


def composite_rms_norm_backward(g, x, rstd, *scale, dim: str):
    """``dx`` (and ``d_scale`` with a scale) of the RMS norm, from the saved ``rstd``."""
    xhat, gf = _acc(x) * rstd, _acc(g)
    gw = gf * _acc(scale[0]) if scale else gf
    dx = (gw - xhat * reduce_mean(gw * xhat, dim)) * rstd
    return [_as(dx, x.dtype)] + ([_as(_sum_but(gf * xhat, dim), scale[0].dtype)] if scale else [])


def composite_layer_norm(x, *affine, dim: str, eps: float, has_scale: bool, has_bias: bool):
    """``(y, mean, rstd)`` of ``layer_norm(x, dim, scale, bias)``."""
    xf = _acc(x)
    mean = reduce_mean(xf, dim)
    xc = xf - mean
    rstd = rsqrt(reduce_mean(xc * xc, dim) + eps)
    y = xc * rstd
    params = list(affine)
    if has_scale:
        y = y * _acc(params.pop(0))
    if has_bias:
        y = y + _acc(params.pop(0))
    return [_as(y, x.dtype), mean, rstd]


def composite_layer_norm_backward(g, x, mean, rstd, *scale, dim: str, has_bias: bool):
    """``dx`` (then ``d_scale``, ``d_bias`` as the node has them) of the layer norm."""
    xhat, gf = (_acc(x) - mean) * rstd, _acc(g)
    gw = gf * _acc(scale[0]) if scale else gf
    sum_g, sum_gx = _row_sums([gw, gw * xhat], dim)
    n = x.shape[dim].size
    dx = (gw - sum_g / n - xhat * (sum_gx / n)) * rstd
    outs = [_as(dx, x.dtype)]
    if scale:
        outs.append(_as(_sum_but(gf * xhat, dim), x.dtype))
    if has_bias:
        outs.append(_as(_sum_but(gf, dim), x.dtype))
    return outs


def composite_normalize_backward(g, x, dim: str, eps: float):
    """``[dx]`` of the affine-free layer norm (``normalize``), which saves no statistics: they are
    made again from ``x``, as its fused backward kernel makes them."""
    _, mean, rstd = composite_layer_norm(x, dim=dim, eps=eps, has_scale=False, has_bias=False)
    return composite_layer_norm_backward(g, x, mean, rstd, dim=dim, has_bias=False)


def _row_sums(ts, dim: str) -> list:
    """``reduce_sum(t, dim)`` of each of ``ts``, packed along a new dim after the sums: over a split
    ``dim`` the partial sums (one value per row each) go in one allreduce instead of one each, as
    batch_norm's backward sends its two."""
    k = Dim("norm_row_sums", 1)
    both = concat([unsqueeze(reduce_sum(t, dim), k) for t in ts], k.name)
    return [squeeze(slice_(both, k.name, i, i + 1), k.name) for i in range(len(ts))]


def _build(node):
    """The composite of ``node``'s op, as a function of its inputs."""
    a, name = node.attrs, node.op.name
    if name == "rms_norm":
        return lambda *ins: composite_rms_norm(*ins, dim=a["dim"], eps=a["eps"])
    if name == "rms_norm_backward":
        return lambda *ins: composite_rms_norm_backward(*ins, dim=a["dim"])
    if name == "layer_norm":
        return lambda *ins: composite_layer_norm(*ins, dim=a["dim"], eps=a["eps"], has_scale=a["scale"],
                                                 has_bias=a["bias"])
    if name == "normalize":
        return lambda x: composite_layer_norm(x, dim=a["dim"], eps=a["eps"], has_scale=False, has_bias=False)[:1]
    if name == "normalize_backward":
        return lambda g, x: composite_normalize_backward(g, x, dim=a["dim"], eps=a["eps"])
    return lambda *ins: composite_layer_norm_backward(*ins, dim=a["dim"], has_bias=a["bias"])


@lowering("rms_norm", "rms_norm_backward", "layer_norm", "layer_norm_backward", "normalize", "normalize_backward")
def lower_norm(lw, node) -> None:
    x = node.inputs[0 if node.op.name in ("rms_norm", "layer_norm", "normalize") else 1]
    if not lw.sharding(lw.value(x)).axes_of(node.attrs["dim"]):
        lower_generic(lw, node)
        return
    lower_composite(lw, node, _build(node))
