"""Layer norm with its scale and bias: one torch kernel forward, one backward.

``layer_norm(x, dim, scale, bias)`` is ``normalize(x) * scale + bias`` along ``dim``.
As the three ops it costs three passes over the activation forward and five
backward (the normalisation's, then ``g * scale``, ``sum(g)`` and ``sum(g * x̂)``
for the two parameter gradients), and the backward reads the saved ``x̂``.  As one
op it runs ``native_layer_norm`` forward, which also returns each row's mean and
rstd (two extra outputs, read only by the gradient rule), and
``native_layer_norm_backward`` backward, which reads those statistics and returns the
input gradient and both parameter gradients at once, as torch's autograd does: the
backward never recomputes the forward's statistics.  The statistics are one value per
row (``x``'s shape without ``dim``), so inside a repeat block saving them costs
``1/size(dim)`` of saving ``x``; a remat policy that recomputes the layer norm
recomputes them with it.

Lowering is the generic rule's: ``dim`` is ``fixed`` (gathered where a layout
splits it, with the scale and bias whole along it: the kernel always sees whole
rows, so the statistics it saves are those of the whole row under every layout),
and the backward's parameter
gradients reduce over every other dim (``reduce``), so a batch or sequence dim
split over a mesh axis leaves them partial sums over that axis, reduced once where
they are read, exactly as the composite's ``reduce_sum`` did.
"""
from __future__ import annotations

import contextlib
import functools
import math

import torch

from ..core.graph import Tensor
from ..errors import ShapeError
from .registry import ComputeSpec, Op, apply, register


def _last(fn, pos: int, *xs):
    """``fn`` (which works on the last dim) of ``xs`` with dim ``pos`` moved last; its result (or
    the first of its results) moved back."""
    if pos == xs[0].dim() - 1:
        return fn(*xs)
    out = fn(*(x.movedim(pos, -1) for x in xs))
    if isinstance(out, tuple):
        return (out[0].movedim(-1, pos), *out[1:])
    return out.movedim(-1, pos)


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the saved mean and rstd: fp32 (fp64 for an fp64 ``x``), as torch's GPU kernel
    keeps them for a low-precision ``x``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


#: dtypes whose saved statistics are kept in their own dtype (:func:`_stats_dtype`)
_OWN_STATS = frozenset({torch.float32, torch.float64})


def _kernel_stats(s: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Saved statistic ``s`` ([rows]) as ``native_layer_norm_backward`` reads it for ``x`` (with
    the normalised dim last): [rows, 1], in ``x``'s dtype on the CPU (whose forward computes
    them in it), in fp32 for a low-precision ``x`` elsewhere."""
    s = s.unsqueeze(-1)
    return s.to(x.dtype) if s.dtype != x.dtype and x.device.type == "cpu" else s


def _forward(pos: int, eps: float, scale: bool, bias: bool, x, *params):
    """The forward kernel: (y, mean, rstd) of ``x`` normalised along dim ``pos``; ``params``: the
    scale and bias where ``scale`` and ``bias`` say they are given."""
    if pos == x.dim() - 1:   # the normalised dim last (the usual case): no moves
        y, mean, rstd = torch.native_layer_norm(x, x.shape[-1:], params[0] if scale else None,
                                                params[-1] if bias else None, eps)
        if mean.dtype is x.dtype and x.dtype in _OWN_STATS:   # (no conversion to call)
            return y, mean.squeeze(-1), rstd.squeeze(-1)
        dtype = _stats_dtype(x.dtype)
        return y, mean.squeeze(-1).to(dtype), rstd.squeeze(-1).to(dtype)
    w, b = _affine({"scale": scale, "bias": bias}, params)
    dtype = _stats_dtype(x.dtype)

    def fwd(v):
        y, mean, rstd = torch.ops.aten.native_layer_norm(v, [v.shape[-1]], w, b, eps)
        if mean.dtype == dtype:   # (fp32 stats of an fp32 x: no conversion to call)
            return y, mean.squeeze(-1), rstd.squeeze(-1)
        return y, mean.squeeze(-1).to(dtype), rstd.squeeze(-1).to(dtype)
    return _last(fwd, pos, x)


_LN_BWD = torch.ops.aten.native_layer_norm_backward.default

#: whether the backward runs as the opaque op below (see :func:`opaque_backward`)
_OPAQUE = [False]


@torch.library.custom_op("meshdsl::layer_norm_backward", mutates_args=())
def _opaque_backward(g: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                     scale: torch.Tensor | None, bias: torch.Tensor | None,
                     mask: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``native_layer_norm_backward`` of the last dim, as an op no compiler looks into (a gradient
    not asked for comes back empty)."""
    dx, ds, db = _LN_BWD(g, x, x.shape[-1:], mean, rstd, scale, bias, mask)
    return dx, x.new_empty(0) if ds is None else ds, x.new_empty(0) if db is None else db


@_opaque_backward.register_fake
def _(g, x, mean, rstd, scale, bias, mask):
    def like(p, wanted):
        return torch.empty_like(p) if wanted and p is not None else x.new_empty(0)
    return torch.empty_like(x), like(scale, mask[1]), like(bias, mask[2])


@contextlib.contextmanager
def opaque_backward():
    """Within it, the backward runs as one opaque op (``meshdsl::layer_norm_backward``), which a
    compiler keeps as a call of torch's kernel: ``--compile``'s careful form (inductor's code for the
    decomposed backward gave wrong parameter gradients on an H100 at d_model 1024, seq 512)."""
    _OPAQUE[0] = True
    try:
        yield
    finally:
        _OPAQUE[0] = False


def _ln_backward(g, x, mean, rstd, scale, bias, mask):
    """``native_layer_norm_backward`` of the last dim, or the opaque op under :func:`opaque_backward`."""
    if not _OPAQUE[0]:
        return _LN_BWD(g, x, x.shape[-1:], mean, rstd, scale, bias, mask)
    dx, ds, db = _opaque_backward(g, x, mean, rstd, scale, bias, mask)
    return dx, ds if mask[1] else None, db if mask[2] else None


def _backward(pos: int, has_scale: bool, has_bias: bool, g, x, mean, rstd, *params):
    """The backward kernel: (dx, [d_scale], [d_bias]) from the forward's saved statistics."""
    scale = params[0] if has_scale else None
    mask = [True, bool(has_scale), bool(has_bias)]
    if pos == x.dim() - 1 and x.dtype is mean.dtype and x.is_cpu:
        # the normalised dim last, fp32 or fp64 on the CPU (the usual case): no moves, no conversions
        bias = (scale if scale is not None and scale.dtype is x.dtype and scale.is_contiguous()
                else x.new_empty(x.shape[-1])) if has_bias else None   # (only its shape is read: see bwd below)
        if type(x) is torch.Tensor and not _OPAQUE[0]:
            # eager: the CPU kernel reads the statistics as one value per row, whatever their shape
            # (the forward's, squeezed: no unsqueeze to call); a tracer (a subclass: --compile's
            # functional or fake tensors) gets them shaped as the op's schema and decompositions say
            out = _LN_BWD(g, x, x.shape[-1:], mean, rstd, scale, bias, mask)
        else:
            out = _ln_backward(g, x, mean.unsqueeze(-1), rstd.unsqueeze(-1), scale, bias, mask)
        if has_scale and has_bias:
            return out
        return (out[0],) + ((out[1],) if has_scale else ()) + ((out[2],) if has_bias else ())

    def bwd(g, x):   # mean and rstd lack the moved dim: their dims are x's others, in order
        n = x.shape[-1]
        # the kernel shapes the bias gradient like the bias, whose values it never reads (the
        # scale, where it has the dtype and a plain layout, stands in for it)
        if not has_bias:
            bias = None
        elif scale is not None and scale.dtype == x.dtype and scale.is_contiguous():
            bias = scale
        else:
            bias = x.new_empty(n)
        return _ln_backward(g, x, _kernel_stats(mean, x), _kernel_stats(rstd, x), scale, bias, mask)
    dx, dscale, dbias = _last(bwd, pos, g, x)
    return (dx,) + ((dscale,) if has_scale else ()) + ((dbias,) if has_bias else ())


def _spec(node, x: Tensor, reduce: bool) -> ComputeSpec:
    d = node.attrs["dim"]
    dims = {t.name: t.size for t in x.shape}
    return ComputeSpec(dims, fixed=frozenset({d}),
                       reduce={n: "sum" for n in dims if n != d} if reduce else {})


def _affine(attrs, params):
    """(scale or None, bias or None) from the op's trailing inputs."""
    params = list(params)
    scale = params.pop(0) if attrs["scale"] else None
    bias = params.pop(0) if attrs["bias"] else None
    return scale, bias


@register
class LayerNorm(Op):
    """(x, [scale], [bias]) -> (y, mean, rstd); attrs ``dim``, ``pos``, ``eps``, ``scale``, ``bias``
    (which inputs follow x).  ``mean`` and ``rstd`` (``x``'s dims but ``dim``) are for the
    backward kernel only."""

    name = "layer_norm"

    def infer(self, inputs, attrs):
        x = inputs[0]
        attrs["pos"] = x.shape.index(attrs["dim"])
        stats = (x.shape.without([attrs["dim"]]), _stats_dtype(x.dtype))
        return [(x.shape, x.dtype), stats, stats]

    def compute(self, ctx, attrs, x, *params):
        return _forward(attrs["pos"], attrs["eps"], attrs["scale"], attrs["bias"], x, *params)

    def direct(self, attrs):   # (reads no ctx)
        return functools.partial(_forward, attrs["pos"], attrs["eps"], attrs["scale"], attrs["bias"])

    def spec(self, node):
        return _spec(node, node.inputs[0], reduce=False)

    def flops(self, node, local):
        return 8 * math.prod(local.get(n, s) for n, s in self.spec(node).dims.items())

    def grad(self, node, douts):
        g, *g_stats = douts
        if any(d is not None for d in g_stats):
            raise ShapeError("layer_norm: the mean and rstd outputs are for the backward kernel only; "
                             "they have no gradient")
        if g is None:
            return [None] * len(node.inputs)
        x = node.inputs[0]
        if g.shape.names != x.shape.names:
            from .shape_ops import transpose
            g = transpose(g, x.shape.names)
        scale = [node.inputs[1]] if node.attrs["scale"] else []
        outs = apply("layer_norm_backward", [g, x, *node.outputs[1:], *scale], dict(node.attrs))
        return list(outs) if isinstance(outs, (list, tuple)) else [outs]


@register
class LayerNormBackward(Op):
    """(g, x, mean, rstd, [scale]) -> (dx, [d_scale], [d_bias]): linear in ``g``; no second-order
    gradient.  ``mean`` and ``rstd`` are the forward's saved statistics."""

    name = "layer_norm_backward"
    linear_args = (0,)
    differentiable = False

    def infer(self, inputs, attrs):
        x = inputs[1]
        d = x.shape.without([n for n in x.shape.names if n != attrs["dim"]])
        return [(x.shape, x.dtype)] + [(d, x.dtype)] * (int(attrs["scale"]) + int(attrs["bias"]))

    def compute(self, ctx, attrs, g, x, mean, rstd, *params):
        return _backward(attrs["pos"], attrs["scale"], attrs["bias"], g, x, mean, rstd, *params)

    def direct(self, attrs):   # (reads no ctx)
        return functools.partial(_backward, attrs["pos"], attrs["scale"], attrs["bias"])

    def spec(self, node):
        return _spec(node, node.inputs[1], reduce=True)

    def flops(self, node, local):
        return 12 * math.prod(local.get(n, s) for n, s in self.spec(node).dims.items())


def fused_layer_norm(x: Tensor, dim: str, scale: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    """The fused op; ``scale`` and ``bias`` (if given) have the single dim ``dim``."""
    ins = [x] + [t for t in (scale, bias) if t is not None]
    y, _, _ = apply("layer_norm", ins, {"dim": dim, "eps": float(eps), "scale": scale is not None,
                                        "bias": bias is not None})
    return y
