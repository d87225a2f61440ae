"""RMS norm with its scale: one op forward that saves each row's rstd, one backward that reads it.

``rms_norm(x, dim, scale)`` is ``x * rsqrt(mean(x^2) + eps) * scale`` along ``dim``.  As a
normalisation op times an elementwise scale its backward recomputed ``rsqrt(mean(x^2) + eps)``
and the normalised input from ``x`` (one more pass over the activation), and the scale's
gradient was a product and a sum of their own.  As one op, as :mod:`.layernorm` is for layer
norm, its forward also returns each row's rstd (an extra output, read only by the gradient
rule; ``_fused_rms_norm`` off the CPU, the row norms and two products on it), and the
backward reads ``(g, x, rstd, [scale])`` and returns the input gradient and the scale's at
once: ``_fused_rms_norm_backward`` where torch has it (not on the CPU), else the formula
below in a few passes.  The rstd is one
value per row (``x``'s shape without ``dim``), so inside a repeat block saving it costs
``1/size(dim)`` of saving ``x``; a remat policy that recomputes the norm recomputes it too.

With ``x̂ = x * rstd`` and ``gw = g * scale``:
``dx = rstd * (gw - x̂ * mean(gw * x̂))`` and ``d_scale = sum over rows of g * x̂``.

Lowering is the generic rule's: ``dim`` is ``fixed`` (gathered where a layout splits it, the
scale whole along it, so the saved rstd is the whole row's under every layout), and the
backward's scale gradient reduces over every other dim, a partial sum over any axis that
splits a batch or sequence dim, reduced once where it is read.  The statistics are fp32 for a
low-precision ``x`` (fp64 for fp64), and so is the backward's arithmetic.
"""
from __future__ import annotations

import math

import torch

from ..core.graph import Tensor
from ..errors import ShapeError
from .layernorm import _last, _spec, _stats_dtype
from .registry import Op, apply, register

_FWD = torch.ops.aten._fused_rms_norm.default
_BWD = torch.ops.aten._fused_rms_norm_backward.default


def _forward(pos: int, eps: float, x: torch.Tensor, scale: torch.Tensor | None = None):
    """(y, rstd): rstd has ``x``'s dims but ``pos``, in the statistics' dtype."""
    dtype = _stats_dtype(x.dtype)
    if x.device.type == "cpu" and not (x.requires_grad or (scale is not None and scale.requires_grad)):
        # one reduction pass (the row norms, accumulated in the statistics' dtype) and the
        # products: ~1.5x faster than the CPU ``_fused_rms_norm`` on llama's [16, 64, 256]
        # (in place, so not where autograd watches: a caller differentiating the kernel; ``pow_(2)``,
        # not ``square_``, which functionalization cannot rewrite: ``--compile``'s whole-step trace)
        n = x.shape[pos]
        rstd = torch.linalg.vector_norm(x, dim=pos, keepdim=True, dtype=dtype).pow_(2).div_(n).add_(eps).rsqrt_()
        y = torch.mul(x, rstd)
        if scale is not None:
            y.mul_(scale.view(n, *[1] * (x.dim() - 1 - pos)))
        return (y if y.dtype == x.dtype else y.to(x.dtype)), rstd.squeeze(pos)
    if pos == x.dim() - 1:   # the normalised dim last (the usual case): no moves
        y, rstd = _FWD(x, x.shape[-1:], scale, eps)
    else:
        y, rstd = _FWD(x.movedim(pos, -1), [x.shape[pos]], scale, eps)
        y = y.movedim(-1, pos)
    rstd = rstd.squeeze(-1)
    return y, (rstd if rstd.dtype == dtype else rstd.to(dtype))


def _backward_rows(g: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, scale: torch.Tensor | None):
    """(dx, d_scale or None) for ``g`` and ``x`` with the normalised dim last, in the rstd's dtype
    (fp32 for a bf16 ``x``).  With ``dot = sum(g * scale * x)`` per row,
    ``dx = rstd * g * scale - rstd^3 * x * dot / n``: the rows' sums as matrix-vector products
    of the one product ``g * x``."""
    n, acc = x.shape[-1], rstd.dtype
    g2, x2, r = g.reshape(-1, n).to(acc), x.reshape(-1, n).to(acc), rstd.reshape(-1, 1)
    gx = g2 * x2
    if scale is None:
        gw, dot, dscale = g2, gx.sum(-1, keepdim=True), None
    else:
        w = scale.to(acc)
        gw, dot, dscale = g2 * w, gx @ w.unsqueeze(-1), (r.t() @ gx).view(n)
    k = (r * r).mul_(dot).div_(-n)
    dx = torch.addcmul(gw, x2, k).mul_(r)
    return dx.view(x.shape), dscale


def _backward(pos: int, g: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, scale: torch.Tensor | None = None):
    """dx, or (dx, d_scale) with a scale, in ``x``'s and the scale's dtypes."""
    if x.device.type != "cpu":   # torch's kernel (CUDA and the other non-CPU backends)
        def bwd(g, x):
            return _BWD(g, x, [x.shape[-1]], rstd.unsqueeze(-1), scale, [True, scale is not None])
    else:
        def bwd(g, x):
            return _backward_rows(g, x, rstd, scale)
    dx, dscale = _last(bwd, pos, g, x)
    dx = dx if dx.dtype == x.dtype else dx.to(x.dtype)
    if scale is None:
        return dx
    return dx, (dscale if dscale.dtype == scale.dtype else dscale.to(scale.dtype))


@register
class RmsNorm(Op):
    """(x, [scale]) -> (y, rstd); attrs ``dim``, ``pos``, ``eps``, ``scale`` (whether a scale
    follows x).  ``rstd`` (``x``'s dims but ``dim``) is for the backward only."""

    name = "rms_norm"

    def infer(self, inputs, attrs):
        x = inputs[0]
        attrs["pos"] = x.shape.index(attrs["dim"])
        return [(x.shape, x.dtype), (x.shape.without([attrs["dim"]]), _stats_dtype(x.dtype))]

    def compute(self, ctx, attrs, x, *params):
        return _forward(attrs["pos"], attrs["eps"], x, *params)

    def direct(self, attrs):
        pos, eps = attrs["pos"], attrs["eps"]
        return lambda x, *params: _forward(pos, eps, x, *params)

    def spec(self, node):
        return _spec(node, node.inputs[0], reduce=False)

    def flops(self, node, local):
        return 4 * math.prod(local.get(n, s) for n, s in self.spec(node).dims.items())

    def grad(self, node, douts):
        g, g_rstd = douts
        if g_rstd is not None:
            raise ShapeError("rms_norm: the rstd output is for the backward kernel only; it has no gradient")
        if g is None:
            return [None] * len(node.inputs)
        x = node.inputs[0]
        if g.shape.names != x.shape.names:
            from .shape_ops import transpose
            g = transpose(g, x.shape.names)
        outs = apply("rms_norm_backward", [g, x, node.outputs[1], *node.inputs[1:]], dict(node.attrs))
        return list(outs) if isinstance(outs, (list, tuple)) else [outs]


@register
class RmsNormBackward(Op):
    """(g, x, rstd, [scale]) -> (dx, [d_scale]): linear in ``g``; no second-order gradient.
    ``rstd`` is the forward's saved statistic."""

    name = "rms_norm_backward"
    linear_args = (0,)
    differentiable = False

    def infer(self, inputs, attrs):
        x = inputs[1]
        outs = [(x.shape, x.dtype)]
        if attrs["scale"]:
            outs.append((inputs[3].shape, inputs[3].dtype))
        return outs

    def compute(self, ctx, attrs, g, x, rstd, *params):
        return _backward(attrs["pos"], g, x, rstd, *params)

    def direct(self, attrs):
        pos = attrs["pos"]
        return lambda g, x, rstd, *params: _backward(pos, g, x, rstd, *params)

    def spec(self, node):
        return _spec(node, node.inputs[1], reduce=node.attrs["scale"])

    def flops(self, node, local):
        return 8 * math.prod(local.get(n, s) for n, s in self.spec(node).dims.items())


def fused_rms_norm(x: Tensor, dim: str, scale: Tensor | None, eps: float) -> Tensor:
    """The fused op; ``scale`` (if given) has the single dim ``dim`` and ``x``'s dtype."""
    y, _ = apply("rms_norm", [x] + ([scale] if scale is not None else []),
                 {"dim": dim, "eps": float(eps), "scale": scale is not None})
    return y
