"""Batch norm over several dims: one collective for the statistics forward, one backward.

``batch_norm(x, dims, scale, bias)`` normalises ``x`` over ``dims`` (``["batch", "height",
"width"]``) per value of its remaining dims, the *features*.  Written as a composite (a mean,
then the variance of the centred value) a layout that splits ``dims`` sends the mean and the
variance as two dependent allreduces, and the backward two more.  Here it is four ops whose
only reductions over ``dims`` are two tensors of two rows:

* ``batch_norm_stats``: ``x -> S = [sum x, sum x^2]`` over ``dims`` (dim ``bn_stat`` of 2, then
  the features), accumulated in fp64.  Its spec reduces ``dims`` by ``sum``, so a split one
  leaves ``S`` a partial sum, reduced by ONE allreduce where ``batch_norm`` reads it;
* ``batch_norm``: ``(x, S, [scale], [bias]) -> (y, mean, var)``: ``mean = S0/N``, ``var =
  max(S1/N - mean^2, 0)`` (the biased batch variance), ``y = (x - mean) * rsqrt(var + eps) *
  scale + bias``; elementwise over ``x``, so it runs on each rank's slice as it arrives;
* backward, with ``x̂ = (x - mean) * rstd``: ``batch_norm_backward_sums``: ``(g, x, S) -> T =
  [sum g, sum g * x̂]`` over ``dims`` (partial where they are split: ONE allreduce), then
  ``batch_norm_backward``: ``dx = rstd * scale * (g - T0/N - x̂ * T1/N)``; the bias's gradient
  is ``T0`` and the scale's ``T1``, rows of the reduced ``T`` (no collective of their own).

Numerics: the sums are fp64 whatever ``x``'s dtype (``S`` is a few values per feature, so its
allreduce costs nothing more), so ``S1/N - mean^2`` loses ~1e-16 * (mean/std)^2 of the
variance to cancellation instead of fp32's ~1e-7 * (mean/std)^2; ``mean``, ``var`` and the
backward's arithmetic are in the statistics' dtype (fp32 for a 16-bit ``x``, fp64 for fp64).
The dense program runs the same kernels on the whole tensor, so a split layout differs from it
only by the order of the fp64 additions and of ``T``'s.

The ``mean`` and ``var`` outputs are for running statistics (``md.Model(updates=...)``); a
loss that reads them gets their gradient through ``S`` (``batch_norm_stats``' rule).

Running statistics kept by the op itself (``running=(mean, var)``, two frozen params, as
``torch.nn.BatchNorm2d`` keeps them): the ``batch_norm`` node carries their names and the
momentum in its attrs (:func:`running_attrs`) and computes nothing more; the training step sets
them after each update (``train/state_updates.py``'s ``running_updates``: ``(1 - m) * mean +
m * batch mean``, the variance unbiased as torch's), and eval mode normalises with them
(``ir/eval_mode.py``).
"""
from __future__ import annotations

import math

import torch

from ..core.graph import Tensor
from ..errors import ShapeError, message
from ..core.shape import Dim, Shape
from .elementwise import cast
from .layernorm import _stats_dtype
from .registry import ComputeSpec, Op, apply, register
from .scan import squeeze, unsqueeze
from .shape_ops import transpose
from .slicing import concat, slice_

#: the dim of ``S`` and ``T`` that holds their two rows
STAT_DIM = "bn_stat"


def _bcast(t: torch.Tensor, x: torch.Tensor, pos: tuple[int, ...]) -> torch.Tensor:
    """A per-feature ``t`` viewed to broadcast against ``x`` (size 1 at the normalised ``pos``)."""
    return t.reshape([1 if i in pos else s for i, s in enumerate(x.shape)])


def _moments(S: torch.Tensor, n: int, dtype: torch.dtype, eps: float):
    """(mean, var, rstd) per feature from the reduced sums, in ``dtype``."""
    mean = S[0] / n
    var = (S[1] / n - mean * mean).clamp(min=0)
    return mean.to(dtype), var.to(dtype), (var + eps).rsqrt().to(dtype)


def _stats(pos, x):
    """``S``: [sum x, sum x^2] over ``pos``, fp64."""
    s1 = x.sum(pos, dtype=torch.float64)
    s2 = torch.linalg.vector_norm(x, 2, dim=pos, dtype=torch.float64).square()
    return torch.stack([s1, s2])


def _forward(pos, n, eps, has_scale, has_bias, x, S, *params):
    acc = _stats_dtype(x.dtype)
    mean, var, rstd = _moments(S, n, acc, eps)
    a = rstd * params[0].to(acc) if has_scale else rstd
    b = -mean * a
    if has_bias:
        b = b + params[-1].to(acc)
    y = torch.addcmul(_bcast(b, x, pos), x.to(acc), _bcast(a, x, pos))
    return y.to(x.dtype), mean, var


def _backward_sums(pos, n, eps, g, x, S):
    """``T``: [sum g, sum g * x̂] over ``pos``, in the statistics' dtype."""
    acc = _stats_dtype(x.dtype)
    mean, _, rstd = _moments(S, n, acc, eps)
    gf = g.to(acc)
    t1 = (gf * (x.to(acc) - _bcast(mean, x, pos))).sum(pos) * rstd
    return torch.stack([gf.sum(pos), t1])


def _backward(pos, n, eps, has_scale, g, x, S, T, *scale):
    acc = _stats_dtype(x.dtype)
    mean, _, rstd = _moments(S, n, acc, eps)
    k = rstd * scale[0].to(acc) if has_scale else rstd
    # dx = k * (g - T0/N) - k * rstd * T1/N * (x - mean): x centred first, as the sums saw it
    dx = (g.to(acc) - _bcast(T[0] / n, x, pos)) * _bcast(k, x, pos)
    dx -= (x.to(acc) - _bcast(mean, x, pos)) * _bcast(k * rstd * T[1] / n, x, pos)
    return dx.to(x.dtype)


def _positions(x: Tensor, dims) -> tuple[int, ...]:
    return tuple(x.shape.index(d) for d in dims)


def _stat_shape(x: Tensor, dims) -> Shape:
    return Shape([Dim(STAT_DIM, 2), *x.shape.without(dims)])


def _spec(x: Tensor, dims, reduce: bool) -> ComputeSpec:
    sizes = {STAT_DIM: 2, **{t.name: t.size for t in x.shape}}
    return ComputeSpec(sizes, fixed=frozenset({STAT_DIM}), reduce={d: "sum" for d in dims} if reduce else {})


def _count(x: Tensor, dims) -> int:
    return math.prod(x.shape.get(d).size for d in dims)


@register
class BatchNormStats(Op):
    """x -> S [bn_stat, *features]: [sum x, sum x^2] over attr ``dims`` (fp64)."""

    name = "batch_norm_stats"

    def infer(self, inputs, attrs):
        attrs["pos"] = _positions(inputs[0], attrs["dims"])
        return [(_stat_shape(inputs[0], attrs["dims"]), torch.float64)]

    def compute(self, ctx, attrs, x):
        return _stats(attrs["pos"], x)

    def spec(self, node):
        return _spec(node.inputs[0], node.attrs["dims"], reduce=True)

    def flops(self, node, local):
        return 3 * math.prod(local.get(d.name, d.size) for d in node.inputs[0].shape)

    def grad(self, node, douts):
        (gS,) = douts
        x = node.inputs[0]
        gS = cast(gS, x.dtype)
        g0, g1 = (squeeze(slice_(gS, STAT_DIM, i, i + 1), STAT_DIM) for i in (0, 1))
        return [g0 + 2.0 * x * g1]


@register
class BatchNorm(Op):
    """(x, S, [scale], [bias]) -> (y, mean, var); attrs ``dims``, ``eps``, ``scale``, ``bias``."""

    name = "batch_norm"

    def infer(self, inputs, attrs):
        x, dims = inputs[0], attrs["dims"]
        attrs["pos"], attrs["count"] = _positions(x, dims), _count(x, dims)
        stats = (x.shape.without(dims), _stats_dtype(x.dtype))
        return [(x.shape, x.dtype), stats, stats]

    def compute(self, ctx, attrs, x, S, *params):
        return _forward(attrs["pos"], attrs["count"], attrs["eps"], attrs["scale"], attrs["bias"], x, S, *params)

    def spec(self, node):
        return _spec(node.inputs[0], node.attrs["dims"], reduce=False)

    def flops(self, node, local):
        return 2 * math.prod(local.get(d.name, d.size) for d in node.inputs[0].shape)

    def grad(self, node, douts):
        g, g_mean, g_var = douts
        x, S, a = node.inputs[0], node.inputs[1], node.attrs
        gx = gscale = gbias = gS = None
        if g is not None:
            g = g if g.shape.names == x.shape.names else transpose(g, x.shape.names)
            T = apply("batch_norm_backward_sums", [g, x, S], {k: a[k] for k in ("dims", "eps")})
            gx = apply("batch_norm_backward", [g, x, S, T] + ([node.inputs[2]] if a["scale"] else []),
                       {k: a[k] for k in ("dims", "eps", "scale")})
            params = node.inputs[2:]
            row = [squeeze(slice_(T, STAT_DIM, i, i + 1), STAT_DIM) for i in (0, 1)]
            if a["scale"]:
                gscale = cast(row[1], params[0].dtype)
            if a["bias"]:
                gbias = cast(row[0], params[-1].dtype)
        if g_mean is not None or g_var is not None:
            gS = _moments_grad(node, g_mean, g_var)
        return [gx, gS] + ([gscale] if a["scale"] else []) + ([gbias] if a["bias"] else [])


def _moments_grad(node, g_mean, g_var):
    """The cotangent of ``S`` from those of the ``mean`` and ``var`` outputs: ``mean = S0/N``,
    ``var = S1/N - mean^2``."""
    mean, n = node.outputs[1], float(node.attrs["count"])
    zero = mean * 0.0
    gm = g_mean if g_mean is not None else zero
    gv = g_var if g_var is not None else zero
    rows = [(gm - 2.0 * mean * gv) / n, gv / n]
    gS = concat([unsqueeze(r, STAT_DIM, 0) for r in rows], STAT_DIM)
    return cast(gS, node.inputs[1].dtype)


@register
class BatchNormBackwardSums(Op):
    """(g, x, S) -> T [bn_stat, *features]: [sum g, sum g * x̂] over attr ``dims``; no gradient."""

    name = "batch_norm_backward_sums"
    linear_args = (0,)
    differentiable = False

    def infer(self, inputs, attrs):
        x, dims = inputs[1], attrs["dims"]
        attrs["pos"], attrs["count"] = _positions(x, dims), _count(x, dims)
        return [(_stat_shape(x, dims), _stats_dtype(x.dtype))]

    def compute(self, ctx, attrs, g, x, S):
        return _backward_sums(attrs["pos"], attrs["count"], attrs["eps"], g, x, S)

    def spec(self, node):
        return _spec(node.inputs[1], node.attrs["dims"], reduce=True)

    def flops(self, node, local):
        return 4 * math.prod(local.get(d.name, d.size) for d in node.inputs[1].shape)


@register
class BatchNormBackward(Op):
    """(g, x, S, T, [scale]) -> dx, from the reduced sums ``S`` and ``T``; no gradient."""

    name = "batch_norm_backward"
    differentiable = False

    def infer(self, inputs, attrs):
        x, dims = inputs[1], attrs["dims"]
        attrs["pos"], attrs["count"] = _positions(x, dims), _count(x, dims)
        return [(x.shape, x.dtype)]

    def compute(self, ctx, attrs, g, x, S, T, *scale):
        return _backward(attrs["pos"], attrs["count"], attrs["eps"], attrs["scale"], g, x, S, T, *scale)

    def spec(self, node):
        return _spec(node.inputs[1], node.attrs["dims"], reduce=False)

    def flops(self, node, local):
        return 5 * math.prod(local.get(d.name, d.size) for d in node.inputs[1].shape)


def fused_batch_norm(x: Tensor, dims: tuple[str, ...], scale: Tensor | None, bias: Tensor | None,
                     eps: float, running: dict | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(y, mean, var): ``scale`` and ``bias`` (if given) have ``x``'s dims but ``dims``, in its order;
    ``running``: :func:`running_attrs`' attrs."""
    S = apply("batch_norm_stats", [x], {"dims": dims})
    ins = [x, S] + [t for t in (scale, bias) if t is not None]
    return apply("batch_norm", ins, {"dims": dims, "eps": float(eps), "scale": scale is not None,
                                     "bias": bias is not None, **(running or {})})


def running_attrs(what: str, x: Tensor, features, running, momentum) -> dict:
    """The attrs of a batch norm that keeps running statistics in ``running`` = (mean, var), two
    params of ``x``'s graph shaped by ``features``: their names and the momentum.

    Raises:
      ShapeError: ``running`` is not two distinct such params (a repeat block's per-layer slice is
        not a param), or ``momentum`` is not in (0, 1] (checked with or without ``running``).
    """
    _check_momentum(what, momentum)
    if running is None:
        return {}
    rule = "running=(mean, var) names two frozen params (md.param, left out of the Model's params) of x's " \
           "feature dims, which the training step sets and eval mode normalises with"
    if not isinstance(running, (tuple, list)) or len(running) != 2 or not all(isinstance(t, Tensor) for t in running):
        raise ShapeError(message(f"{what}: running={running!r} is not a (mean, var) pair of params.", rule=rule,
                                 fix="running=(md.param('bn_mean', [hidden], init='zeros'), "
                                     "md.param('bn_var', [hidden], init='ones'))"))
    for role, p in zip(("mean", "var"), running):
        in_block = p.node.op.name == "placeholder" or (p.graph is not x.graph and x.graph.outer is not None)
        if p.node.op.name != "param" or in_block:
            raise ShapeError(message(
                f"{what}: the running {role} {p!r} is not a param of the graph"
                + (" (inside md.repeat, a block reads each layer's slice of a stacked param)." if in_block else "."),
                rule=rule, fix="outside md.repeat pass the md.param itself; inside a repeat block return the "
                               "statistics with stats=True as per-layer outputs and set the stacked params with "
                               "md.Model(updates=...) (docs/guide/training.md)"))
        if sorted((d.name, d.size) for d in p.shape) != sorted((d.name, d.size) for d in features) \
                or not p.dtype.is_floating_point:
            raise ShapeError(message(f"{what}: the running {role} {p!r} must be a float param of x's features.",
                                     inputs=[f"x: {x.shape}", f"features: {features}", f"{role}: {p.shape} {p.dtype}"],
                                     rule=rule, fix=f"give it dims {list(features.names)} and a float dtype"))
        if p.graph is not x.graph:
            raise ShapeError(message(f"{what}: the running {role} {p!r} is a param of another graph than {x!r}.",
                                     rule=rule, fix="make the running statistics with md.param inside the graph "
                                                    "(the `with md.Graph():` block) that builds x"))
    if running[0].node is running[1].node:
        raise ShapeError(message(f"{what}: running=({running[0].name!r}, {running[1].name!r}) gives one param as "
                                 "both the running mean and the running variance.",
                                 rule=rule + "; the step sets each to its own statistic",
                                 fix="two params: running=(md.param('bn_mean', [hidden], init='zeros'), "
                                     "md.param('bn_var', [hidden], init='ones'))"))
    return {"running": (running[0].node.name, running[1].node.name), "momentum": float(momentum)}


def _check_momentum(what: str, momentum) -> None:
    """Raise unless ``momentum`` is a real number in (0, 1] (a string, a bool or NaN is not)."""
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 < momentum <= 1:
        raise ShapeError(message(f"{what}: momentum={momentum!r} is not a number in (0, 1].",
                                 rule="each step the running statistics move by momentum towards the batch's "
                                      "(torch's convention: new = (1 - momentum) * old + momentum * batch)",
                                 fix="pass e.g. momentum=0.1 (torch's default)"))
