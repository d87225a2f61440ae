"""Activations beyond relu/gelu/silu: softplus, log_sigmoid, leaky_relu, elu, mish, and clamp
(relu6 and hardtanh are clamps).

Each is one elementwise torch kernel, lowered by the generic rule as every unary op is (no
communication: a split dim stays split).  Number parameters are attrs, handed to the kernel as
torch's own arguments, so every layout computes torch's numbers; each gradient is a rule built
from other ops, written after torch's derivative (its branches, its ties at the kinks).
"""
from __future__ import annotations

import functools
import numbers

import torch
import torch.nn.functional as F

from ..core.graph import Tensor
from ..errors import ShapeError, message
from .elementwise import Unary, greater, greater_equal, less_equal, logical_and, sigmoid, tanh, where
from .registry import apply, register


class Parametric(Unary):
    """A unary op whose kernel takes number parameters: ``fn(x, *attrs["params"])``, whose torch
    keywords are ``keywords``."""

    keywords: tuple[str, ...] = ()

    def compute(self, ctx, attrs, x):
        return type(self).fn(x, *attrs["params"])

    def direct(self, attrs):
        # a partial, not a lambda: the executor's program calls the torch function without a frame of ours
        return functools.partial(type(self).fn, **dict(zip(self.keywords, attrs["params"])))


@register
class Softplus(Parametric):
    name = "softplus"
    fn = staticmethod(F.softplus)
    keywords = ("beta", "threshold")

    def grad(self, node, douts):
        x, g = node.inputs[0], douts[0]
        beta, threshold = node.attrs["params"]
        bx = x if beta == 1.0 else x * beta
        # torch's branch: linear (slope 1) where beta * x > threshold
        return [where(greater(bx, threshold), g, g * sigmoid(bx))]


@register
class LeakyRelu(Parametric):
    name = "leaky_relu"
    fn = staticmethod(F.leaky_relu)
    keywords = ("negative_slope",)

    def grad(self, node, douts):
        (slope,) = node.attrs["params"]
        return [where(greater(node.inputs[0], 0.0), douts[0], douts[0] * slope)]   # x = 0: the slope, as torch


@register
class Elu(Parametric):
    name = "elu"
    fn = staticmethod(F.elu)
    keywords = ("alpha",)

    def grad(self, node, douts):
        (alpha,) = node.attrs["params"]
        x, y, g = node.inputs[0], node.outputs[0], douts[0]
        # alpha * exp(x) = y + alpha where x <= 0: the saved result, no second exp
        return [where(greater(x, 0.0), g, g * (y + alpha))]


@register
class Mish(Unary):
    name = "mish"
    fn = staticmethod(F.mish)

    def grad(self, node, douts):
        x, g = node.inputs[0], douts[0]
        t = tanh(softplus(x))
        return [g * (t + x * sigmoid(x) * (1.0 - t * t))]


@register
class LogSigmoid(Unary):
    name = "log_sigmoid"
    fn = staticmethod(F.logsigmoid)

    def grad(self, node, douts):
        return [douts[0] * sigmoid(-node.inputs[0])]   # d/dx log(sigmoid(x)) = 1 - sigmoid(x)


@register
class Clamp(Parametric):
    name = "clamp"
    fn = staticmethod(torch.clamp)
    keywords = ("min", "max")
    integers = True   # a relative position clipped to a window (T5, DeBERTa)

    def grad(self, node, douts):
        x, g = node.inputs[0], douts[0]
        lo, hi = node.attrs["params"]
        # torch's rule: the gradient passes where lo <= x <= hi, bounds included
        inside = ([] if lo is None else [greater_equal(x, lo)]) + ([] if hi is None else [less_equal(x, hi)])
        mask = inside[0] if len(inside) == 1 else logical_and(*inside)
        return [where(mask, g, 0.0)]


# ----------------------------------------------------------------------------- public API


def _number(what: str, name: str, value, x: Tensor, allow_none: bool = False):
    """``value`` if it is a Python number (or None where allowed), else a ShapeError naming it."""
    if (value is None and allow_none) or (isinstance(value, numbers.Real) and not isinstance(value, bool)):
        return value
    extra = "; for a tensor bound use meshdsl.maximum / meshdsl.minimum" if isinstance(value, Tensor) else ""
    raise ShapeError(message(f"{what}: {name}={value!r} ({type(value).__name__}) is not a number.",
                             inputs=[f"x: {x!r}"], rule=f"{what}'s {name} is a Python number{extra}",
                             fix=f"pass a float, e.g. {name}=1.0"))


def softplus(x: Tensor, beta: float = 1.0, threshold: float = 20.0) -> Tensor:
    """Elementwise ``log(1 + exp(beta * x)) / beta``, as ``torch.nn.functional.softplus``.

    Args:
      x: a floating-point Tensor.
      beta: the sharpness (torch's default 1).
      threshold: where ``beta * x`` exceeds it, the result is ``x`` itself (torch's default 20).

    Returns:
      ``softplus(x)``, dims and dtype of ``x``.  Its gradient is ``g * sigmoid(beta * x)``, and
      ``g`` above the threshold, as torch's.

    Raises:
      ShapeError: ``x`` is not floating point, or a parameter is not a number.
    """
    params = (float(_number("softplus", "beta", beta, x)), float(_number("softplus", "threshold", threshold, x)))
    if params[0] == 0.0:
        raise ShapeError(message("softplus: beta=0 divides by zero (log(1 + exp(0 * x)) / 0 is inf everywhere).",
                                 inputs=[f"x: {x!r}"], rule="softplus's beta is a non-zero number",
                                 fix="pass beta=1.0 (torch's default), or leave it out"))
    return apply("softplus", [x], {"params": params})


def leaky_relu(x: Tensor, slope: float = 0.01) -> Tensor:
    """Elementwise ``x`` where positive, else ``slope * x`` (``F.leaky_relu``'s ``negative_slope``).

    Args:
      x: a floating-point Tensor.
      slope: the slope below zero.

    Returns:
      Dims and dtype of ``x``; the gradient is ``g`` where ``x > 0``, else ``slope * g``.

    Raises:
      ShapeError: ``x`` is not floating point, or ``slope`` is not a number.
    """
    return apply("leaky_relu", [x], {"params": (float(_number("leaky_relu", "slope", slope, x)),)})


def elu(x: Tensor, alpha: float = 1.0) -> Tensor:
    """Elementwise ``x`` where positive, else ``alpha * (exp(x) - 1)``, as ``F.elu``.

    Args:
      x: a floating-point Tensor.
      alpha: the value the negative side saturates at, negated.

    Returns:
      Dims and dtype of ``x``; the gradient is ``g`` where ``x > 0``, else ``g * alpha * exp(x)``.

    Raises:
      ShapeError: ``x`` is not floating point, or ``alpha`` is not a number.
    """
    return apply("elu", [x], {"params": (float(_number("elu", "alpha", alpha, x)),)})


def mish(x: Tensor) -> Tensor:
    """Elementwise ``x * tanh(softplus(x))``, as ``F.mish``.

    Raises:
      ShapeError: ``x`` is not floating point.
    """
    return apply("mish", [x])


def log_sigmoid(x: Tensor) -> Tensor:
    """Elementwise ``log(sigmoid(x))``, as ``F.logsigmoid``: stable for large ``|x|`` (a binary
    cross-entropy is ``-(y * log_sigmoid(z) + (1 - y) * log_sigmoid(-z))``).

    Raises:
      ShapeError: ``x`` is not floating point.
    """
    return apply("log_sigmoid", [x])


def clamp(x: Tensor, min: float | None = None, max: float | None = None) -> Tensor:  # noqa: A002 - torch's names
    """Elementwise ``x`` limited to ``[min, max]``, as ``torch.clamp`` (``relu6`` is ``clamp(x, 0, 6)``).

    Args:
      x: a floating-point or integer Tensor (a relative position clipped to a window).
      min: the lower bound, or None for none.
      max: the upper bound, or None for none; where ``min > max`` every element is ``max``.

    Returns:
      Dims and dtype of ``x``.  The gradient passes where ``min <= x <= max`` (bounds included,
      as torch's) and is zero elsewhere.

    Raises:
      ShapeError: both bounds are None; a bound is not a Python number (a tensor bound is
        ``meshdsl.maximum`` / ``meshdsl.minimum``); a fractional bound for an integer ``x``.
    """
    lo = _number("clamp", "min", min, x, allow_none=True)
    hi = _number("clamp", "max", max, x, allow_none=True)
    if lo is None and hi is None:
        raise ShapeError(message("clamp: both min and max are None.", inputs=[f"x: {x!r}"],
                                 rule="clamp limits x to [min, max]: at least one bound is given",
                                 fix="pass min=..., max=... or both"))
    integral = not x.dtype.is_floating_point and x.dtype != torch.bool
    bounds = []
    for name, b in (("min", lo), ("max", hi)):
        if b is not None and integral and not float(b).is_integer():
            raise ShapeError(message(f"clamp: {name}={b!r} for {x!r}, which is {x.dtype}.",
                                     rule="an integer tensor is clamped to integer bounds (no silent promotion)",
                                     fix=f"round the bound, or cast x first: meshdsl.cast({x.name}, torch.float32)"))
        bounds.append(None if b is None else int(b) if integral else float(b))
    return apply("clamp", [x], {"params": tuple(bounds)})


__all__ = ["softplus", "log_sigmoid", "leaky_relu", "elu", "mish", "clamp"]
