"""Elementwise ops with broadcasting by dim name.

Operands are aligned by name: the output has the union of the operands' dims
in order of first appearance (``where`` lists its condition last), and each
operand is permuted and unsqueezed to it locally.  No communication is ever needed beyond matching layouts, which
the generic lowering rule takes care of.
"""
from __future__ import annotations

import functools
import math
import numbers

import torch
import torch.nn.functional as F

from ..core.graph import Tensor, not_a_tensor
from ..core.shape import Shape, broadcast_shapes
from ..errors import ShapeError, message
from .broadcasting import align, align_plan, sum_to
from .constant import constant
from .registry import DENSE_CTX, Op, apply, register

# ----------------------------------------------------------------------------- helpers


#: ops whose result is bool whatever their operands: any scalar compares with any tensor.
_COMPARISONS = ("less", "less_equal", "greater", "greater_equal", "equal", "not_equal")


def lift(xs, name: str = "where"):
    """Turn Python scalars into constants with the dtype of the first tensor operand.

    An integer tensor takes integral scalars only (``1 - mask``), except in comparisons:
    ``ids * 0.5`` would be a float result, which the op's integer dtype would misstate."""
    like = next((x for x in xs if isinstance(x, Tensor)), None)
    for i, x in enumerate(xs):   # a scalar: a number, or a one-element torch tensor
        if not isinstance(x, (Tensor, numbers.Real)) and not (isinstance(x, torch.Tensor) and x.numel() == 1):
            raise not_a_tensor(name, f"operand {i}", x)
    if like is None:
        raise ShapeError(message("elementwise op: at least one operand must be a meshdsl Tensor.",
                                 inputs=[f"operands: {xs!r}"], rule="scalars broadcast against tensors",
                                 fix="make one operand a Tensor"))
    if like.dtype.is_floating_point or name in _COMPARISONS:
        dtype = like.dtype if like.dtype.is_floating_point else torch.float32
        return [x if isinstance(x, Tensor) else constant(float(x), dtype, like) for x in xs]
    out = []
    for x in xs:
        if not isinstance(x, Tensor):
            if like.dtype == torch.bool or isinstance(x, bool) or not float(x).is_integer():
                raise ShapeError(message(f"{name}: scalar {x!r} with {like!r}, which is {like.dtype}.",
                                         rule="an integer or bool tensor takes integral scalars in arithmetic "
                                              "(no silent promotion to float)",
                                         fix=f"cast the tensor first: meshdsl.cast({like.name}, torch.float32)"))
            x = constant(int(x), like.dtype, like)
        out.append(x)
    return out


# ----------------------------------------------------------------------------- unary


class Unary(Op):
    fn = None
    cse = True   # deterministic: the same op of the same tensor is built once (core/graph.py, add_node)
    #: exact on integer tensors as well (a relative position's sign and distance)
    integers = False

    def infer(self, inputs, attrs):
        (x,) = inputs
        integral = self.integers and x.dtype != torch.bool
        if not x.dtype.is_floating_point and not integral and self.name not in ("cast", "stop_gradient", "logical_not"):
            raise ShapeError(message(f"{self.name}: input {x!r} is {x.dtype}, not floating point.",
                                     rule=f"{self.name} is defined on floating-point tensors",
                                     fix="cast it first: meshdsl.cast(x, torch.float32)"))
        return [(x.shape, attrs.get("dtype", torch.bool if self.name == "logical_not" else x.dtype))]

    def compute(self, ctx, attrs, x):
        return type(self).fn(x)

    def direct(self, attrs):
        return type(self).fn if type(self).compute is Unary.compute else None


def _unary(name, fn, grad=None, linear=False, integers=False):
    cls = type(name.title(), (Unary,), {"name": name, "fn": staticmethod(fn), "linear": linear,
                                        "integers": integers})
    if grad is not None:
        cls.grad = lambda self, node, douts: [grad(node.inputs[0], node.outputs[0], douts[0])]
    return register(cls)


def _piecewise_constant(name, fn, integers=False):
    """A step function: its derivative is zero wherever it exists (torch's gradient is zero), so
    reverse mode stops at it, as at ``stop_gradient``."""
    cls = _unary(name, fn, integers=integers)
    cls.blocks_gradient = True
    cls.grad = lambda self, node, douts: [None]
    return cls


_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)

_unary("neg", torch.neg, lambda x, y, g: -g, linear=True, integers=True)
_unary("abs", torch.abs, lambda x, y, g: where(less(x, 0.0), -g, where(greater(x, 0.0), g, 0.0)),   # g * sign(x)
       integers=True)
_unary("exp", torch.exp, lambda x, y, g: g * y)
_unary("log", torch.log, lambda x, y, g: g / x)
_unary("sqrt", torch.sqrt, lambda x, y, g: g * 0.5 / y)
_unary("rsqrt", torch.rsqrt, lambda x, y, g: g * (-0.5) * y / x)
_unary("tanh", torch.tanh, lambda x, y, g: g * (1.0 - y * y))
_unary("sin", torch.sin, lambda x, y, g: g * cos(x))
_unary("cos", torch.cos, lambda x, y, g: -(g * sin(x)))
_unary("relu", torch.relu, lambda x, y, g: apply("relu_backward", [g, x]))
_unary("sigmoid", torch.sigmoid, lambda x, y, g: g * y * (1.0 - y))
_unary("gelu", F.gelu, lambda x, y, g: apply("gelu_backward", [g, x]))
_unary("gelu_tanh", functools.partial(F.gelu, approximate="tanh"), lambda x, y, g: apply("gelu_tanh_backward", [g, x]))
_unary("silu", F.silu, lambda x, y, g: apply("silu_backward", [g, x]))
_unary("erf", torch.erf, lambda x, y, g: g * exp(-(x * x)) * _TWO_OVER_SQRT_PI)
_unary("log1p", torch.log1p, lambda x, y, g: g / (x + 1.0))
_unary("expm1", torch.expm1, lambda x, y, g: g * (y + 1.0))
_unary("square", torch.square, lambda x, y, g: g * (x + x))   # 2x = x + x, exact
_unary("reciprocal", torch.reciprocal, lambda x, y, g: -(g * (y * y)))
_piecewise_constant("sign", torch.sign, integers=True)
_piecewise_constant("floor", torch.floor)
_piecewise_constant("ceil", torch.ceil)
_piecewise_constant("round", torch.round)   # halves to even, as torch.round
_unary("logical_not", torch.logical_not).differentiable = False  # bool in, bool out


@register
class StopGradient(Unary):
    name = "stop_gradient"
    linear = True
    blocks_gradient = True

    def compute(self, ctx, attrs, x):
        return x

    def grad(self, node, douts):
        return [None]


@register
class Cast(Unary):
    name = "cast"
    linear = True

    def compute(self, ctx, attrs, x):
        return x.to(attrs["dtype"])

    def grad(self, node, douts):
        x = node.inputs[0]
        return [cast(douts[0], x.dtype) if x.dtype.is_floating_point else None]


@register
class Pow(Unary):
    name = "pow"

    def compute(self, ctx, attrs, x):
        return torch.pow(x, attrs["exponent"])

    def grad(self, node, douts):
        x, p = node.inputs[0], node.attrs["exponent"]
        if p == 2.0:  # the square: g * 2x, with 2x = x + x exact
            return [douts[0] * (x + x)]
        if p == 1.0:
            return [douts[0]]
        return [douts[0] * p * pow(x, p - 1.0)]


# ----------------------------------------------------------------------------- n-ary


def _scalar_constant(x: Tensor) -> bool:
    return x.node.op.name == "constant" and not x.shape


class Nary(Op):
    out_dtype = None  # None: same as inputs
    cse = True   # deterministic: built once per operands and attrs (core/graph.py, add_node)

    def out_shape(self, inputs) -> Shape:
        """The output dims: the union of the operands', in order of first appearance."""
        return broadcast_shapes([x.shape for x in inputs], self.name)

    def infer(self, inputs, attrs):
        shape = self.out_shape(inputs)
        # A scalar constant takes the others' dtype (torch promotes a 0-d tensor no further);
        # a tensor constant is an operand like any other.
        dtypes = {x.dtype for x in inputs if not _scalar_constant(x)} or {inputs[0].dtype}
        data = [x for x in inputs if self.name != "where" or x is not inputs[0]]
        ddt = {x.dtype for x in data if not _scalar_constant(x)} or {data[0].dtype}
        if len(ddt) > 1:
            raise ShapeError(message(f"{self.name}: operands have different dtypes {sorted(map(str, dtypes))}.",
                                     inputs=[f"operands: {', '.join(map(repr, inputs))}"],
                                     rule="elementwise operands share one dtype (no silent promotion)",
                                     fix="cast one operand with meshdsl.cast(x, dtype)"))
        if self.name == "div" and not next(iter(ddt)).is_floating_point:
            raise ShapeError(message(f"div: operands are {next(iter(ddt))}.",
                                     inputs=[f"operands: {', '.join(map(repr, inputs))}"],
                                     rule="div is true division: its result is floating point",
                                     fix="cast the operands first: meshdsl.cast(x, torch.float32)"))
        attrs["align"] = tuple(align_plan(x.shape, shape) for x in inputs)
        return [(shape, self.out_dtype or next(iter(ddt)))]

    def compute(self, ctx, attrs, *xs):
        return type(self).fn(*(align(x, p) for x, p in zip(xs, attrs["align"])))

    def direct(self, attrs):
        # operands in the result's dims but for leading ones they lack (no permute, no new axis
        # after one they have): torch's broadcasting lines them up, the torch function itself
        plain = type(self).compute is Nary.compute and all(map(_leading_only, attrs["align"]))
        return type(self).fn if plain else None


def _leading_only(plan) -> bool:
    """Whether ``align(x, plan)`` only puts new dims in front of ``x``'s, in order: what torch's
    broadcasting does itself."""
    perm, idx = plan
    if perm is not None:
        return False
    lead = 0 if idx is None else next((k for k, i in enumerate(idx) if i is not None), len(idx))
    return idx is None or all(i is not None for i in idx[lead:])


def _binary(name, fn, grad=None, linear=False, out_dtype=None, linear_args=()):
    cls = type(name.title(), (Nary,), {"name": name, "fn": staticmethod(fn), "linear": linear,
                                       "out_dtype": out_dtype, "linear_args": linear_args})
    if grad is not None:
        def g(self, node, douts):
            a, b = node.inputs
            ga, gb = grad(a, b, node.outputs[0], douts[0])
            return [None if x is None else sum_to(x, like) for x, like in ((ga, a), (gb, b))]
        cls.grad = g
    else:
        cls.differentiable = False
    return register(cls)


def _mask(c, like):
    return cast(c, like.dtype)


_binary("add", torch.add, lambda a, b, y, g: (g, g), linear=True)
_binary("sub", torch.sub, lambda a, b, y, g: (g, -g), linear=True)
_binary("mul", torch.mul, lambda a, b, y, g: (g * b, g * a), linear_args=(0, 1))
_binary("div", torch.div, lambda a, b, y, g: (g / b, -(g * y) / b), linear_args=(0,))


def _pick(wins, ties, g):
    """``g`` where an operand wins, half of it where the two tie (torch's convention)."""
    return g * (_mask(wins, g) + _mask(ties, g) * 0.5)


# Integer positions (``pos % window``, a block's index ``pos // block``) and floats alike, as torch's
# (floored: the remainder takes the divisor's sign).  floor_divide is a step function: a zero
# gradient (as md.floor's; torch has none); remainder's is torch's: g, and -g times the quotient.
_binary("remainder", torch.remainder, lambda a, b, y, g: (g, -(g * apply("floor_divide", [a, b]))))
# A hash's mixing step (Instant-NGP xors each grid coordinate times a prime): integers only, and
# no gradient (as the comparisons).
_binary("bitwise_xor", torch.bitwise_xor)
_FloorDivide = _binary("floor_divide", torch.floor_divide)
_FloorDivide.differentiable, _FloorDivide.blocks_gradient = True, True   # (as _piecewise_constant's)
_FloorDivide.grad = lambda self, node, douts: [None, None]
_binary("maximum", torch.maximum, lambda a, b, y, g: (_pick(a > b, equal(a, b), g), _pick(a < b, equal(a, b), g)))
_binary("minimum", torch.minimum, lambda a, b, y, g: (_pick(a < b, equal(a, b), g), _pick(a > b, equal(a, b), g)))
# log(exp(a) + exp(b)) as torch's one stable kernel (max + log1p(exp(-|a - b|)): no overflow where
# exp would); each side's gradient is its weight in the sum, exp(side - y) <= 1, as torch's.
_binary("logaddexp", torch.logaddexp, lambda a, b, y, g: (g * exp(a - y), g * exp(b - y)))
# Fused gradients of activations (one kernel each, as torch's autograd uses); linear in g.
_binary("relu_backward", lambda g, x: torch.ops.aten.threshold_backward(g, x, 0.0), linear_args=(0,))
_binary("gelu_backward", lambda g, x: torch.ops.aten.gelu_backward(g, x), linear_args=(0,))
_binary("gelu_tanh_backward", lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate="tanh"), linear_args=(0,))
_binary("silu_backward", lambda g, x: torch.ops.aten.silu_backward(g, x), linear_args=(0,))
for _n, _f in (("less", torch.lt), ("less_equal", torch.le), ("greater", torch.gt),
               ("greater_equal", torch.ge), ("equal", torch.eq), ("not_equal", torch.ne),
               ("logical_and", torch.logical_and), ("logical_or", torch.logical_or)):
    _binary(_n, _f, out_dtype=torch.bool)


@register
class Where(Nary):
    name = "where"
    fn = staticmethod(torch.where)

    def infer(self, inputs, attrs):
        if inputs[0].dtype != torch.bool:
            raise ShapeError(message(f"where: condition {inputs[0]!r} is {inputs[0].dtype}, not bool.",
                                     rule="where(cond, a, b) takes a boolean condition",
                                     fix="build it with a comparison, e.g. x > 0"))
        return super().infer(inputs, attrs)

    def out_shape(self, inputs):
        # The values' dims lead and the condition's follow: a mask [seq, key_seq] over
        # scores [batch, heads, seq, key_seq] keeps the scores' layout, so the softmax
        # and the einsum after it read a contiguous tensor instead of copying it.
        c, a, b = inputs
        return broadcast_shapes([a.shape, b.shape, c.shape], self.name)

    def linear_in(self, node, i: int) -> bool:
        # where(c, g, 0) and where(c, 0, g), its own gradient: linear in g (a partial sum passes
        # through: elu + 1's gradient); where(c, g, b) with any other b is only affine in g.
        if i not in (1, 2):
            return False
        other = node.inputs[3 - i].node
        return (other.op.name == "constant" and "shape" not in other.attrs
                and float(other.attrs["value"]) == 0.0)

    def linear_in_all(self, node, idxs) -> bool:
        # where(c, g, g * s), softplus's and elu's gradient: jointly linear in its two values, the
        # condition fixed (a per-layer weight's gradient in a pipelined block stays a partial sum).
        return set(idxs) == {1, 2}

    def grad(self, node, douts):
        c, a, b = node.inputs
        g = douts[0]
        # A scalar zero (as torch's masked_fill backward): no second full-size tensor.
        return [None, sum_to(where(c, g, 0.0), a), sum_to(where(c, 0.0, g), b)]


# ----------------------------------------------------------------------------- public API


def _bin(name):
    def f(a, b):
        return apply(name, lift([a, b], name))
    f.__name__ = name
    f.__doc__ = f"Elementwise ``{name}`` with broadcasting by dim name."
    return f


add, sub, mul, div = _bin("add"), _bin("sub"), _bin("mul"), _bin("div")
maximum, minimum = _bin("maximum"), _bin("minimum")
less, less_equal, greater = _bin("less"), _bin("less_equal"), _bin("greater")
greater_equal, equal, not_equal = _bin("greater_equal"), _bin("equal"), _bin("not_equal")


def _un(name):
    def f(x):
        return apply(name, [x])
    f.__name__ = name
    f.__doc__ = f"Elementwise ``{name}``."
    return f


neg, exp, log, sqrt, rsqrt = _un("neg"), _un("exp"), _un("log"), _un("sqrt"), _un("rsqrt")
abs = _un("abs")   # noqa: A001 - mirrors torch.abs
abs.__doc__ = """Elementwise ``|x|``, on floating-point or integer tensors (a relative position's distance)."""
neg.__doc__ = """Elementwise ``-x``, on floating-point or integer tensors (``x.__neg__``)."""
tanh, relu, silu, sigmoid = _un("tanh"), _un("relu"), _un("silu"), _un("sigmoid")


def gelu(x, approximate: str = "none"):
    """Elementwise GELU, as ``torch.nn.functional.gelu``: ``x * Phi(x)`` (``approximate="none"``,
    torch's default), or GPT-2's ``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))``
    (``approximate="tanh"``, HF's ``gelu_new``); each one kernel forward and one backward."""
    if approximate not in ("none", "tanh"):
        raise ShapeError(message(f"gelu: approximate={approximate!r} is not 'none' or 'tanh'.",
                                 rule="gelu is exact (erf, 'none') or GPT-2's tanh approximation ('tanh'), "
                                      "as torch's approximate=", fix="pass approximate='tanh' or leave it out"))
    return apply("gelu" if approximate == "none" else "gelu_tanh", [x])


stop_gradient, logical_not = _un("stop_gradient"), _un("logical_not")
erf, log1p, expm1, square, reciprocal = _un("erf"), _un("log1p"), _un("expm1"), _un("square"), _un("reciprocal")
erf.__doc__ = """Elementwise Gauss error function (the exact GELU is ``0.5 * x * (1 + erf(x / sqrt(2)))``)."""
log1p.__doc__ = """Elementwise ``log(1 + x)``, accurate for small ``x``; its gradient is ``g / (1 + x)``."""
expm1.__doc__ = """Elementwise ``exp(x) - 1``, accurate for small ``x``; its gradient is ``g * (y + 1)``."""
square.__doc__ = """Elementwise ``x * x``; its gradient is ``g * 2x``."""
reciprocal.__doc__ = """Elementwise ``1 / x``; its gradient is ``-g / x**2``."""
sign, floor, ceil, round = _un("sign"), _un("floor"), _un("ceil"), _un("round")  # noqa: A001 - mirror torch
sign.__doc__ = """Elementwise sign (-1, 0 or 1), on floating-point or integer tensors (a relative position's
direction).  Its gradient is zero, as torch's: reverse mode does not pass through it."""
floor.__doc__ = """Elementwise ``floor(x)`` of a floating-point tensor (still floating point: ``cast`` it for
an index).  Its gradient is zero, as torch's."""
ceil.__doc__ = """Elementwise ``ceil(x)`` of a floating-point tensor.  Its gradient is zero, as torch's."""
round.__doc__ = """Elementwise ``x`` rounded to the nearest integer, halves to even (``torch.round``), of a
floating-point tensor.  Its gradient is zero, as torch's."""


def logical_and(a: Tensor, b: Tensor) -> Tensor:
    """Elementwise ``a and b`` of boolean masks, broadcasting by dim name: a sliding window's
    mask is ``logical_and(causal, near)`` for ``near = less(arange(seq) - arange(key_seq), window)``."""
    return apply("logical_and", lift([a, b], "logical_and"))


def logical_or(a: Tensor, b: Tensor) -> Tensor:
    """Elementwise ``a or b`` of boolean masks, broadcasting by dim name: keys always visible
    besides a window (attention sinks, a Longformer's global tokens)."""
    return apply("logical_or", lift([a, b], "logical_or"))


def sin(x: Tensor) -> Tensor:
    """Elementwise sine, e.g. a rotary embedding's table from its angles.

    Args:
      x: a floating-point Tensor of angles in radians.

    Returns:
      ``sin(x)``, dims and dtype of ``x``.  Its gradient is ``g * cos(x)``; under bf16
      it computes in its input's dtype, as ``exp`` and ``tanh`` do.

    Raises:
      ShapeError: ``x`` is not floating point.
    """
    return apply("sin", [x])


def cos(x: Tensor) -> Tensor:
    """Elementwise cosine (see :func:`sin`); its gradient is ``-g * sin(x)``.

    Args:
      x: a floating-point Tensor of angles in radians.

    Returns:
      ``cos(x)``, dims and dtype of ``x``.

    Raises:
      ShapeError: ``x`` is not floating point.
    """
    return apply("cos", [x])


def pow(x: Tensor, exponent: float) -> Tensor:  # noqa: A001 - mirrors torch.pow
    """``x ** exponent`` for a Python-number exponent."""
    if isinstance(exponent, Tensor):
        return exp(log(x) * exponent)
    if not isinstance(exponent, (int, float)) or isinstance(exponent, bool):
        raise ShapeError(message(f"pow: exponent {exponent!r} ({type(exponent).__name__}) is not a number.",
                                 inputs=[f"base: {x!r}"], rule="x ** p takes a Python number or a Tensor p",
                                 fix="pass a float such as 2.0"))
    return apply("pow", [x], {"exponent": float(exponent)})


def cast(x: Tensor, dtype: torch.dtype) -> Tensor:
    """Convert ``x`` to ``dtype``."""
    if not isinstance(dtype, torch.dtype):
        raise ShapeError(message(f"cast: {dtype!r} is not a torch.dtype.", inputs=[f"x: {x!r}"],
                                 rule="cast takes a torch dtype", fix="write e.g. cast(x, torch.float32)"))
    return apply("cast", [x], {"dtype": dtype})


def where(cond: Tensor, a, b) -> Tensor:
    """``a`` where ``cond`` else ``b``, broadcasting by name.

    The result's dims are those of ``a``, then ``b``'s, then ``cond``'s, each
    in order of first appearance: a mask keeps the layout of the values it masks.
    Two Python numbers take ``cond``'s dims and torch's dtype: int64 for two ints
    (``where(cond, -1, 1)``, a direction), float32 where either is a float, bool for two bools.
    """
    if isinstance(cond, Tensor) and all(isinstance(x, numbers.Real) and not isinstance(x, Tensor) for x in (a, b)):
        both_bool = all(isinstance(x, bool) for x in (a, b))
        dtype = torch.bool if both_bool else torch.float32 if any(
            not float(x).is_integer() or isinstance(x, float) for x in (a, b)) else torch.int64
        return apply("where", [cond] + [constant(x if both_bool else float(x) if dtype == torch.float32 else int(x),
                                                 dtype, cond) for x in (a, b)])
    return apply("where", [cond] + lift([a, b]))


def _floored(name: str, a, b) -> Tensor:
    xs = lift([a, b], name)
    if any(x.dtype == torch.bool for x in xs):
        raise ShapeError(message(f"{name}: operands are bool.", inputs=[f"operands: {', '.join(map(repr, xs))}"],
                                 rule=f"{name} takes integer or floating-point tensors",
                                 fix="cast the mask first: meshdsl.cast(mask, torch.int64)"))
    if isinstance(b, numbers.Real) and b == 0 and not xs[0].dtype.is_floating_point:
        # torch raises "ZeroDivisionError" (a RuntimeError) when the kernel runs; a float's is inf/nan
        raise ShapeError(message(f"{name}: integer {'division' if name == 'floor_divide' else 'remainder'} by zero.",
                                 inputs=[f"a: {xs[0]!r}", "b: 0"],
                                 rule="an integer tensor's // and % take a non-zero divisor",
                                 fix="divide by the block size you mean (pos // window, pos % window with "
                                     "window >= 1), or cast to float first for torch's inf / nan"))
    return apply(name, xs)


def floor_divide(a, b) -> Tensor:
    """Elementwise ``floor(a / b)`` (``a // b``), broadcasting by name, as ``torch.floor_divide``:
    integers stay integers (a position's block, ``pos // block``), floats stay floats.  A step
    function: its gradient is zero (as :func:`floor`'s)."""
    return _floored("floor_divide", a, b)


def remainder(a, b) -> Tensor:
    """Elementwise ``a - floor(a / b) * b`` (``a % b``), broadcasting by name, as ``torch.remainder``:
    the result takes ``b``'s sign (``-7 % 3 == 2``); integers stay integers (``pos % window``).
    Its gradient is torch's: ``g`` for ``a``, ``-g * floor(a / b)`` for ``b``."""
    return _floored("remainder", a, b)


def logaddexp(a, b) -> Tensor:
    """Elementwise ``log(exp(a) + exp(b))``, broadcasting by name, as ``torch.logaddexp``: computed
    as ``max(a, b) + log1p(exp(-|a - b|))``, so large operands do not overflow (a forward
    algorithm's or an RNN-T lattice's log-space sum of two paths).  Its gradient is torch's:
    ``g * exp(a - y)`` for ``a``, ``g * exp(b - y)`` for ``b``.

    Raises:
      ShapeError: if an operand is an integer or bool tensor.
    """
    xs = lift([a, b], "logaddexp")
    bad = [x for x in xs if not x.dtype.is_floating_point]
    if bad:
        raise ShapeError(message("logaddexp: an operand is not a floating-point tensor.",
                                 inputs=[f"operands: {', '.join(map(repr, xs))}"],
                                 bullets=[f"{x!r} is {x.dtype}" for x in bad],
                                 rule="logaddexp is defined on floating-point tensors",
                                 fix="cast it first: meshdsl.cast(x, torch.float32)"))
    return apply("logaddexp", xs)


def bitwise_xor(a, b) -> Tensor:
    """Elementwise ``a ^ b`` of integer tensors (or Python ints), broadcasting by name, as
    ``torch.bitwise_xor``: a spatial hash, ``(x * 1) ^ (y * 2654435761) % table``.  No gradient.

    Raises:
      ShapeError: if an operand is a floating-point or bool tensor.
    """
    xs = lift([a, b], "bitwise_xor")
    bad = [x for x in xs if x.dtype.is_floating_point or x.dtype == torch.bool]
    if bad:
        raise ShapeError(message("bitwise_xor: an operand is not an integer tensor.",
                                 inputs=[f"operands: {', '.join(map(repr, xs))}"],
                                 bullets=[f"{x!r} is {x.dtype}" for x in bad],
                                 rule="bitwise_xor takes integer tensors (int64, int32, ...)",
                                 fix="cast first: meshdsl.cast(x, torch.int64) (floor a float coordinate "
                                     "before, md.floor(x))"))
    return apply("bitwise_xor", xs)


__all__ = ["add", "sub", "mul", "div", "maximum", "minimum", "less", "less_equal", "greater",
           "greater_equal", "equal", "not_equal", "neg", "abs", "exp", "log", "sqrt", "rsqrt", "tanh", "sin", "cos",
           "relu", "gelu", "silu", "sigmoid", "stop_gradient", "logical_not", "logical_and", "logical_or", "pow",
           "cast", "erf", "log1p", "expm1", "square", "reciprocal", "sign", "floor", "ceil", "round",
           "floor_divide", "remainder", "bitwise_xor", "logaddexp", "where", "constant", "align", "DENSE_CTX"]
