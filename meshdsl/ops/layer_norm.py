"""Layer norm with its scale and bias as one fused kernel forward (``F.layer_norm``).

``layer_norm(x, dim, scale, bias)`` with a scale and a bias shaped ``[dim]`` is one
``layer_norm_affine`` node instead of normalize, mul and add: one pass over x
forward, and a backward of two kernels, each one call of torch's own layer-norm
backward: ``layer_norm_affine_backward`` (dx, elementwise like x) and
``layer_norm_param_grads`` (dscale, dbias: sums over every dim but ``dim``).  They
are two ops because they reduce differently: a split batch dim leaves the param
gradients a lazy partial sum (reduced like any weight gradient) and dx not.

Lowering: ``dim`` is whole on a rank (gathered when split), every other dim may be
split.  A scale or bias with other dims keeps the composite (nn.layer_norm).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .registry import ComputeSpec, Op, apply, register


def _stats(x: torch.Tensor, eps: float):
    """(n, mean, rstd) of ``x`` over its last dim, as torch's layer-norm backward reads them."""
    n = x.shape[-1]
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [n], None, None, eps)
    return n, mean, rstd


def _last(pos: int, *xs: torch.Tensor):
    return [x if pos == x.dim() - 1 else x.movedim(pos, -1) for x in xs]


class _Norm(Op):
    """Shared shape rule and spec: elementwise over x (``inputs[attrs['x']]``), ``dim`` whole."""

    def _x(self, inputs, attrs):
        return inputs[attrs.get("x_index", 0)]

    def spec(self, node):
        x = self._x(node.inputs, node.attrs)
        return ComputeSpec({d.name: d.size for d in x.shape}, fixed=frozenset([node.attrs["dim"]]))

    def flops(self, node, local):
        n = 1
        for d in self._x(node.inputs, node.attrs).shape:
            n *= local.get(d.name, d.size)
        return 8 * n


@register
class LayerNormAffine(_Norm):
    """(x, scale, bias) -> y = normalize(x) * scale + bias over ``attrs['dim']``."""

    name = "layer_norm_affine"

    def infer(self, inputs, attrs):
        x = inputs[0]
        attrs["pos"] = x.shape.index(attrs["dim"])
        return [(x.shape, x.dtype)]

    def compute(self, ctx, attrs, x, scale, bias):
        pos = attrs["pos"]
        (v,) = _last(pos, x)
        y = F.layer_norm(v, (v.shape[-1],), scale, bias, eps=attrs["eps"])
        return y if pos == x.dim() - 1 else y.movedim(-1, pos)

    def grad(self, node, douts):
        from .nn import _like
        x, scale, _ = node.inputs
        g = _like(douts[0], x)
        attrs = {"dim": node.attrs["dim"], "eps": node.attrs["eps"]}
        dx = apply("layer_norm_affine_backward", [g, x, scale], {**attrs, "x_index": 1})
        dscale, dbias = apply("layer_norm_param_grads", [g, x, scale], {**attrs, "x_index": 1})
        return [dx, dscale, dbias]


@register
class LayerNormAffineBackward(_Norm):
    """(g, x, scale) -> dx; linear in the cotangent ``g``."""

    name = "layer_norm_affine_backward"
    linear_args = (0,)
    differentiable = False

    def infer(self, inputs, attrs):
        x = inputs[1]
        attrs["pos"] = x.shape.index(attrs["dim"])
        return [(x.shape, x.dtype)]

    def compute(self, ctx, attrs, g, x, scale):
        pos = attrs["pos"]
        g, v = _last(pos, g, x)
        n, mean, rstd = _stats(v, attrs["eps"])
        dx = torch.ops.aten.native_layer_norm_backward(g, v, [n], mean, rstd, scale, None, [True, False, False])[0]
        return dx if pos == x.dim() - 1 else dx.movedim(-1, pos)


@register
class LayerNormParamGrads(_Norm):
    """(g, x, scale) -> (dscale, dbias), each ``[dim]``: sums over x's other dims.
    ``scale`` is read only because torch's kernel wants it defined."""

    name = "layer_norm_param_grads"
    linear_args = (0,)
    differentiable = False

    def infer(self, inputs, attrs):
        x, scale = inputs[1], inputs[2]
        attrs["pos"] = x.shape.index(attrs["dim"])
        return [(scale.shape, x.dtype), (scale.shape, x.dtype)]

    def compute(self, ctx, attrs, g, x, scale):
        g, v = _last(attrs["pos"], g, x)
        n, mean, rstd = _stats(v, attrs["eps"])
        _, dscale, dbias = torch.ops.aten.native_layer_norm_backward(g, v, [n], mean, rstd, scale, scale,
                                                                     [False, True, True])
        return dscale, dbias

    def spec(self, node):
        s = super().spec(node)
        s.reduce = {n: "sum" for n in s.dims if n != node.attrs["dim"]}
        return s
