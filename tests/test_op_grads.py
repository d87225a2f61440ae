"""Every op's gradient rule against an oracle that does not use the DSL's rules.

The layout-equivalence tests compare a plan with the dense program, and both build
their gradients from the same ``Op.grad`` rules: a wrong rule would pass them all.
Here each rule meets an independent oracle, in float64:

* ``autograd``: torch autograd through the ops' own forward kernels (``Op.compute``),
  run node by node on the case's forward graph;
* ``fd``: central finite differences of the dense forward program, for kernels torch
  cannot differentiate (the optimizer updates read their hyperparameters as numbers,
  a repeat runs a sub-program per layer).

A case builds a small forward graph on float64 inputs (sizes 3, 4, 5 so a transposed
gradient cannot fit by accident); the DSL side is ``vjp(outputs, cotangents, inputs)``
on the dense interpreter with random cotangents.  The op table drives the coverage:
:func:`test_every_op_is_checked` fails for any registered op that no case exercises and
that is not listed among the ops without a gradient, which are tested to refuse
differentiation with a clear error.

``tests/mutation_check.py`` (run by hand) breaks each rule in turn and shows which
case here catches it.

Legend: dims a (3), b (4), c (5); q (3) / k (4) query and key positions, h (2) heads,
e (4) the attention feature dim.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import meshdsl as md
import meshdsl.ir.repeat  # noqa: F401  (registers repeat and repeat_grad)
import meshdsl.train.optim  # noqa: F401  (registers sgd_update)
from meshdsl.core.graph import topo_nodes
from meshdsl.ops.moments import row_moments
from meshdsl.ops.registry import DENSE_CTX, OPS, apply, has_gradient

F64 = torch.float64
A, B, C = md.Dim("a", 3), md.Dim("b", 4), md.Dim("c", 5)
Q, K, H, E = md.Dim("q", 3), md.Dim("k", 4), md.Dim("h", 2), md.Dim("e", 4)
LEAVES = ("input", "param", "placeholder")

# autograd and the rules compute the same float64 numbers in other orders (a rule may use
# another but equal formula: y * (g - sum(g * y)) for softmax): rounding only, ~1e-15 of
# the values.  1e-9 of the largest gradient still misses no doubled or dropped term (O(1)).
AUTOGRAD_TOL = 1e-9
# central differences with step 1e-6: truncation ~1e-12 * f''', rounding ~1e-16 * |f| / 1e-6.
FD_STEP, FD_TOL = 1e-6, 1e-6


# ----------------------------------------------------------------------------- cases


class Inputs:
    """Makes the case's float64 inputs and their random values (``kind`` says how drawn)."""

    def __init__(self, gen: torch.Generator):
        self.gen, self.feeds, self.wrt = gen, {}, []

    def __call__(self, name, dims, kind="normal", dtype=F64, wrt=True, high=None):
        t = md.input(name, dims, dtype)
        self.feeds[name] = _draw(t.shape.sizes, kind, dtype, self.gen, high)
        if wrt and dtype.is_floating_point:
            self.wrt.append(t)
        return t


def _draw(sizes, kind, dtype, gen, high):
    if not dtype.is_floating_point:
        return torch.randint(0, high, sizes, generator=gen, dtype=dtype)
    if kind == "normal":
        return torch.randn(sizes, generator=gen, dtype=dtype)
    if kind == "positive":  # log, sqrt, division, fractional powers
        return torch.rand(sizes, generator=gen, dtype=dtype) * 1.5 + 0.5
    if kind == "ties":  # few distinct values: ties for max, min, top-k, maximum
        return torch.randint(-2, 3, sizes, generator=gen).to(dtype)
    if kind == "zeros":  # exact zeros among both signs (relu's kink)
        return torch.randint(-2, 3, sizes, generator=gen).to(dtype) * torch.rand(sizes, generator=gen, dtype=dtype)
    if kind == "unit":  # probabilities and decay rates in (0, 1)
        return torch.rand(sizes, generator=gen, dtype=dtype) * 0.8 + 0.1
    raise ValueError(kind)


@dataclass
class Case:
    fn: object           # fn(inputs) -> output Tensor(s)
    oracle: str          # "autograd" or "fd"
    seeds: tuple = (0, 1)


CASES: dict[str, Case] = {}


def case(name, oracle="autograd", seeds=(0, 1)):
    def deco(fn):
        assert name not in CASES, name
        CASES[name] = Case(fn, oracle, seeds)
        return fn
    return deco


# ---- elementwise, binary: operands in other dim orders, broadcasting both ways, scalars

for _op in ("add", "sub", "mul"):
    case(f"{_op}_same_dims")(lambda x, op=_op: getattr(md, op)(x("x", [A, B]), x("y", [A, B])))
    case(f"{_op}_other_order")(lambda x, op=_op: getattr(md, op)(x("x", [A, B]), x("y", [B, A])))
    case(f"{_op}_broadcast")(lambda x, op=_op: getattr(md, op)(x("x", [A, B, C]), x("y", [C, A])))
    case(f"{_op}_outer")(lambda x, op=_op: getattr(md, op)(x("x", [B]), x("y", [A])))
    case(f"{_op}_scalar_right")(lambda x, op=_op: getattr(md, op)(x("x", [A, B]), 1.7))
    case(f"{_op}_scalar_input")(lambda x, op=_op: getattr(md, op)(x("x", [A, B]), x("s", [])))
case("sub_scalar_left")(lambda x: 1.7 - x("x", [A, B]))
case("sub_same_input")(lambda x: (lambda t: md.sub(t, md.transpose(t, ["b", "a"])))(x("x", [A, B])))
case("mul_same_input")(lambda x: (lambda t: t * t)(x("x", [B, C])))
case("div_same_dims")(lambda x: md.div(x("x", [A, B]), x("y", [A, B], "positive")))
case("div_broadcast")(lambda x: md.div(x("x", [A, B, C]), x("y", [C, A], "positive")))
case("div_outer")(lambda x: md.div(x("x", [B], "positive"), x("y", [A], "positive")))
case("div_scalar_left")(lambda x: 2.5 / x("x", [A, B], "positive"))
case("div_same_input")(lambda x: (lambda t: t / (t * t + 1.0))(x("x", [A, B])))
for _op in ("maximum", "minimum"):
    case(f"{_op}_normal")(lambda x, op=_op: getattr(md, op)(x("x", [A, B]), x("y", [B, A])))
    case(f"{_op}_ties", seeds=(0, 1, 2))(
        lambda x, op=_op: getattr(md, op)(x("x", [A, B], "ties"), x("y", [A, B], "ties")))
    case(f"{_op}_broadcast")(lambda x, op=_op: getattr(md, op)(x("x", [A, B]), x("y", [B])))
    case(f"{_op}_scalar")(lambda x, op=_op: getattr(md, op)(x("x", [A, B], "zeros"), 0.0))
case("where_same_dims")(lambda x: md.where(md.greater(x("c", [A, B], wrt=False), 0.0),
                                           x("x", [A, B]), x("y", [B, A])))
case("where_broadcast")(lambda x: md.where(md.less(x("c", [A, B], wrt=False), 0.3),
                                           x("x", [B]), x("y", [A, B, C])))
case("where_scalar")(lambda x: md.where(md.greater(x("c", [A, B], wrt=False), 0.0), x("x", [A, B]), 0.0))

# ---- elementwise, unary

case("neg")(lambda x: md.neg(x("x", [A, B])))
case("abs")(lambda x: md.abs(x("x", [A, B])))   # both signs; no element at the kink 0
case("exp")(lambda x: md.exp(x("x", [A, B])))
case("log")(lambda x: md.log(x("x", [A, B], "positive")))
case("sqrt")(lambda x: md.sqrt(x("x", [A, B], "positive")))
case("rsqrt")(lambda x: md.rsqrt(x("x", [A, B], "positive")))
case("tanh")(lambda x: md.tanh(x("x", [A, B])))
case("sin")(lambda x: md.sin(x("x", [A, B]) * 3.0))  # angles over several periods, both signs
case("cos")(lambda x: md.cos(x("x", [A, B]) * 3.0))
case("sigmoid")(lambda x: md.sigmoid(x("x", [A, B])))
case("silu")(lambda x: md.silu(x("x", [A, B])))
case("gelu")(lambda x: md.gelu(x("x", [A, B]) * 2.0))
case("gelu_tanh")(lambda x: md.gelu(x("x", [A, B]) * 2.0, approximate="tanh"))
case("relu")(lambda x: md.relu(x("x", [A, B])))
case("relu_zeros")(lambda x: md.relu(x("x", [A, B], "zeros")))
for _p in (2.0, 3.0, 1.0, -1.0):  # integer powers of signed inputs
    case(f"pow_{_p:g}")(lambda x, p=_p: md.pow(x("x", [A, B]) + 0.1, p))
for _p in (0.5, -1.5, 2.5):
    case(f"pow_{_p:g}_positive")(lambda x, p=_p: md.pow(x("x", [A, B], "positive"), p))
case("cast_down_up")(lambda x: md.cast(md.cast(x("x", [A, B]), torch.float32) * 3.0, F64))
case("cast_up")(lambda x: md.cast(x("x", [A, B], dtype=torch.float32), F64))
case("stop_gradient")(lambda x: md.stop_gradient(x("x", [A, B])) * x("y", [A, B]))
case("erf")(lambda x: md.erf(x("x", [A, B]) * 1.5))
case("log1p")(lambda x: md.log1p(x("x", [A, B], "unit") - 0.5))   # both signs, above -1
case("expm1")(lambda x: md.expm1(x("x", [A, B])))
case("square")(lambda x: md.square(x("x", [A, B])))
case("reciprocal")(lambda x: md.reciprocal(x("x", [A, B], "positive")))
case("softplus")(lambda x: md.softplus(x("x", [A, B]) * 15.0))   # some beyond torch's threshold 20
case("softplus_beta")(lambda x: md.softplus(x("x", [A, B]), beta=2.0, threshold=1.0))
case("leaky_relu")(lambda x: md.leaky_relu(x("x", [A, B], "zeros"), 0.2))   # exact zeros: torch's slope at 0
case("elu")(lambda x: md.elu(x("x", [A, B], "zeros"), 1.5))
case("mish")(lambda x: md.mish(x("x", [A, B]) * 3.0))
case("log_sigmoid")(lambda x: md.log_sigmoid(x("x", [A, B]) * 30.0))   # both tails: log(sigmoid) underflows without the stable form
case("clamp")(lambda x: md.clamp(x("x", [A, B]), -0.5, 0.7))
case("clamp_ties", seeds=(0, 1, 2))(lambda x: md.clamp(x("x", [A, B], "ties"), -1.0, 1.0))   # on the bounds
case("clamp_min")(lambda x: md.clamp(x("x", [A, B], "ties"), min=0.0))
case("clamp_max")(lambda x: md.clamp(x("x", [A, B]), max=0.3))
# step functions: a zero gradient, as torch's; the other operand's gradient is the step's value
for _op in ("sign", "floor", "ceil", "round"):
    case(_op)(lambda x, op=_op: getattr(md, op)(x("x", [A, B]) * 3.0) * x("y", [A, B]))
# floored division (torch has no gradient rule for it: finite differences) and remainder, broadcast
case("floor_divide", oracle="fd")(lambda x: (x("x", [A, B]) * 3.0) // x("d", [B], "positive") * x("y", [A, B]))
case("remainder")(lambda x: md.remainder(x("x", [A, B]) * 3.0, x("d", [B], "positive")))
case("remainder_scalar_left")(lambda x: 2.5 % x("x", [A, B], "positive"))
# log(exp(a) + exp(b)): operands far apart (one side's weight ~0), ties (half each), a scalar side
case("logaddexp")(lambda x: md.logaddexp(x("x", [A, B]) * 30.0, x("y", [B, A]) * 30.0))
case("logaddexp_ties", seeds=(0, 1, 2))(lambda x: md.logaddexp(x("x", [A, B], "ties"), x("y", [B], "ties")))
case("logaddexp_scalar")(lambda x: md.logaddexp(x("x", [A, B]), -0.5))

# ---- contractions and reductions

case("einsum_matmul")(lambda x: md.einsum("a b, b c -> a c", x("x", [A, B]), x("w", [B, C])))
case("einsum_transposed")(lambda x: md.einsum("b a, c b -> c a", x("x", [B, A]), x("w", [C, B])))
case("einsum_batched")(lambda x: md.einsum("a b c, a c -> b a", x("x", [A, B, C]), x("w", [A, C])))
case("einsum_outer")(lambda x: md.einsum("a, b -> a b", x("x", [A]), x("w", [B])))
case("einsum_full")(lambda x: md.einsum("a b, b a ->", x("x", [A, B]), x("w", [B, A])))
case("einsum_three")(lambda x: md.einsum("a b, b c, c -> a", x("x", [A, B]), x("w", [B, C]), x("v", [C])))
case("einsum_same_operand")(lambda x: (lambda t: md.einsum("a b, a c -> b c", t, md.rename(t, b="c")))(
    x("x", [A, B])))
case("einsum_sum_out")(lambda x: md.einsum("a b c -> b", x("x", [A, B, C])))


case("reduce_sum_one")(lambda x: md.reduce_sum(x("x", [A, B, C]), "b"))
case("reduce_sum_two")(lambda x: md.reduce_sum(x("x", [A, B, C]), ["c", "a"]))
case("reduce_sum_all")(lambda x: md.reduce_sum(x("x", [A, B, C])))
case("reduce_mean")(lambda x: md.reduce_mean(x("x", [A, B, C]), ["a", "c"]))
for _op in ("reduce_max", "reduce_min"):
    case(f"{_op}_one")(lambda x, op=_op: getattr(md, op)(x("x", [A, B, C]), "b"))
    case(f"{_op}_all")(lambda x, op=_op: getattr(md, op)(x("x", [A, B])))
    case(f"{_op}_ties", seeds=(0, 1, 2))(lambda x, op=_op: getattr(md, op)(x("x", [A, B, C], "ties"), ["a", "c"]))
case("logsumexp")(lambda x: md.logsumexp(x("x", [A, B, C]) * 3.0, "c"))
case("logsumexp_two")(lambda x: md.logsumexp(x("x", [A, B, C]), ["a", "c"]))
case("logsumexp_ties")(lambda x: md.logsumexp(x("x", [A, B], "ties"), "b"))
case("cumsum")(lambda x: md.cumsum(x("x", [A, B]), "b"))
case("cumsum_exclusive")(lambda x: md.cumsum(x("x", [A, B]), "a", exclusive=True))
case("cumsum_reverse")(lambda x: md.cumsum(x("x", [B, C]), "c", reverse=True))
case("cumsum_exclusive_reverse")(lambda x: md.cumsum(x("x", [B, C]), "b", exclusive=True, reverse=True))
case("scalar_sum")(lambda x: apply("scalar_sum", [x("s", []), x("t", []), md.reduce_sum(x("u", [A]) * 2.0)]))

# ---- shapes

case("transpose")(lambda x: md.transpose(x("x", [A, B, C]), ["c", "a", "b"]) * x("w", [C, A, B]))
case("broadcast_to")(lambda x: md.broadcast_to(x("x", [B]), [A, B, C]) * x("w", [A, B, C]))
case("broadcast_to_reorder")(lambda x: md.broadcast_to(x("x", [C, A]), [A, B, C]) * x("w", [A, B, C]))
case("rename")(lambda x: md.rename(x("x", [A, B]), a="q") * x("w", [Q, B]))
case("reshape_merge")(lambda x: md.reshape(x("x", [A, B, C]), [A, md.Dim("bc", 20)]) * x("w", [A, md.Dim("bc", 20)]))
case("reshape_split")(lambda x: md.reshape(x("x", [md.Dim("n", 12), C]), [A, B, C]) * x("w", [A, B, C]))
case("reshape_regroup")(lambda x: md.reshape(x("x", [md.Dim("n", 6), md.Dim("m", 10)]),
                                             [md.Dim("u", 4), md.Dim("v", 15)]) * x("w", [md.Dim("u", 4), md.Dim("v", 15)]))
case("rearrange_split")(lambda x: md.rearrange(x("x", [A, md.Dim("n", 20)]), "a (b c) -> c a b", b=4) * x("w", [C, A, B]))
case("rearrange_merge")(lambda x: md.reduce_sum(md.rearrange(x("x", [A, B, C]), "a b c -> (c a) b") * 1.5
                                                * x("w", [md.Dim("c_a", 15), B])))
case("slice")(lambda x: md.slice_(x("x", [A, B, C]), "c", 1, 4) * x("w", [A, B, md.Dim("c", 3)]))
case("slice_edge")(lambda x: md.slice_(x("x", [A, B]), "a", 0, 1) * x("w", [md.Dim("a", 1), B]))
case("pad")(lambda x: md.pad(x("x", [A, B]), "b", 2, 1, value=0.5) * x("w", [A, md.Dim("b", 7)]))
case("pad_before_only")(lambda x: md.pad(x("x", [A, B]), "a", 1, 0) * x("w", [md.Dim("a", 4), B]))
case("concat")(lambda x: md.concat([x("x", [A, B]), x("y", [A, md.Dim("b", 2)])], "b") * x("w", [A, md.Dim("b", 6)]))
case("concat_three")(lambda x: md.concat([x("x", [A, B]), x("y", [md.Dim("a", 1), B]), x("z", [md.Dim("a", 2), B])],
                                         "a") * x("w", [md.Dim("a", 6), B]))
for _off in (1, -2):
    case(f"shift_{_off}")(lambda x, o=_off: md.shift(x("x", [A, C]), "c", o) * x("w", [A, C]))
    case(f"shift_wrap_{_off}")(lambda x, o=_off: md.shift(x("x", [A, C]), "c", o, wrap=True) * x("w", [A, C]))
case("roll")(lambda x: md.roll(x("x", [A, B]), "b", 3) * x("w", [A, B]))
case("flip")(lambda x: md.flip(x("x", [A, B, C]), ["a", "c"]) * x("w", [A, B, C]))
# Fourier transforms (ops/fourier.py): even (b 4) and odd (c 5) lengths, every norm, the part dim
# not last, and an irfft of fewer frequencies than its n holds (zero-padded)
RI = md.Dim("reim", 2)
case("rfft")(lambda x: md.rfft(x("x", [A, B, C]), "b"))
case("rfft_odd")(lambda x: md.rfft(x("x", [A, B, C]), "c", norm="ortho"))
case("irfft")(lambda x: md.irfft(x("x", [md.Dim("f", 3), RI, A]), "f", "reim", "t", n=4, norm="forward"))
case("irfft_padded")(lambda x: md.irfft(x("x", [A, md.Dim("f", 3), RI]), "f", "reim", "t", n=7))
case("fft")(lambda x: md.fft(x("x", [RI, A, C]), "c", "reim", norm="forward"))
case("fft_inverse")(lambda x: md.ifft(x("x", [A, B, RI]), "b", "reim", norm="ortho"))
case("squeeze")(lambda x: md.squeeze(x("x", [A, md.Dim("one", 1), B]), "one") * x("w", [A, B]))
case("unsqueeze")(lambda x: md.unsqueeze(x("x", [A, B]), md.Dim("one", 1)) * x("w", [A, md.Dim("one", 1), B]))

# ---- nn

case("softmax")(lambda x: md.softmax(x("x", [A, B, C]) * 2.0, "b"))
case("softmax_other_dim")(lambda x: md.softmax(x("x", [A, B, C]), "a"))
case("log_softmax")(lambda x: md.log_softmax(x("x", [A, B, C]), "c"))
case("layer_norm_plain")(lambda x: md.layer_norm(x("x", [A, B, C]), "c"))
case("layer_norm_affine")(lambda x: md.layer_norm(x("x", [A, B, C]), "c", x("s", [C]), x("t", [C])))
case("layer_norm_scale_only")(lambda x: md.layer_norm(x("x", [A, B, C]), "b", scale=x("s", [B])))
case("layer_norm_inner_dim")(lambda x: md.layer_norm(x("x", [A, B, C]), "a", x("s", [A]), x("t", [A])))
# batch norm over two dims with its batch mean and variance as outputs too (their gradient reaches x)
case("batch_norm")(lambda x: md.batch_norm(x("x", [A, B, C]), ["a", "c"], x("s", [B]), x("t", [B]), stats=True))
case("rms_norm_plain")(lambda x: md.rms_norm(x("x", [A, B, C]), "c"))
case("rms_norm_scale")(lambda x: md.rms_norm(x("x", [A, B, C]), "b", x("s", [B])))
case("rms_norm_scale_last")(lambda x: md.rms_norm(x("x", [A, B, C]), "c", x("s", [C])))
case("rms_norm_scale_first")(lambda x: md.rms_norm(x("x", [A, B, C]), "a", x("s", [A])))
case("rms_norm_wide_scale")(lambda x: md.rms_norm(x("x", [A, B, C]), "c", x("s", [B, C])))
case("cross_entropy")(lambda x: md.cross_entropy(x("x", [A, B, C]) * 2.0, x("y", [A, B], dtype=torch.int64, high=5), "c"))
case("cross_entropy_inner")(lambda x: md.cross_entropy(x("x", [A, C, B]), x("y", [A, B], dtype=torch.int64, high=5), "c"))
case("gather")(lambda x: md.gather(x("t", [C, B]), x("i", [A, md.Dim("r", 6)], dtype=torch.int64, high=5), "c"))
case("scatter_add")(lambda x: md.scatter_add(x("s", [B, A]), x("i", [A], dtype=torch.int64, high=5), C))
case("gather_twice")(lambda x: _gather_twice(x))
case("gather_repeats")(lambda x: md.gather(x("t", [B, C]), x("i", [md.Dim("r", 9)], dtype=torch.int64, high=2), "b"))
case("top_k")(lambda x: md.top_k(x("x", [A, C]), "c", 2)[0])
case("top_k_ties", seeds=(0, 1, 2))(lambda x: md.top_k(x("x", [A, B, C], "ties"), "b", 3)[0])
case("top_k_all")(lambda x: md.top_k(x("x", [B, A]), "b", 4, new_dim="kk")[0])
case("dropout")(lambda x: md.dropout(x("x", [A, B, C]), 0.4, seed=3))
case("dropout_zero_rate")(lambda x: md.dropout(x("x", [A, B]), 0.0))
case("one_hot_times")(lambda x: md.one_hot(x("i", [A], dtype=torch.int64, high=4), B, F64) * x("w", [A, B]))
for _causal in (True, False):
    case(f"attention_{'causal' if _causal else 'full'}")(lambda x, c=_causal: md.attention(
        x("q", [H, Q, E]), x("k", [H, K, E]), x("v", [H, K, E]), query_dim="q", key_dim="k", feature_dim="e",
        causal=c))
TAP, O = md.Dim("tap", 3), md.Dim("o", 2)
case("conv_same")(lambda x: md.conv(x("x", [A, C, B]), x("w", [TAP, B, O]), {"c": "tap"}))
case("conv_causal")(lambda x: md.conv(x("x", [C, B]), x("w", [B, O, TAP]), {"c": "tap"}, padding="causal"))
case("conv_valid_uneven")(lambda x: md.conv(x("x", [B, C, A]), x("w", [O, md.Dim("tap", 2), A]), {"c": "tap"},
                                            padding=(1, 0)) * 1.5)
case("conv_2d")(lambda x: md.conv(x("x", [C, A, B]), x("w", [TAP, md.Dim("ka", 2), B, O]), {"c": "tap", "a": "ka"},
                                  padding={"c": "valid", "a": (0, 1)}))
case("conv_dilated")(lambda x: md.conv(x("x", [A, C, B]), x("w", [TAP, B, O]), {"c": "tap"}, dilation=2))
case("conv_dilated_strided")(lambda x: md.conv(x("x", [C, B]), x("w", [B, O, TAP]), {"c": "tap"}, padding=(3, 1),
                                               stride=2, dilation=2))
case("conv_2d_dilated")(lambda x: md.conv(x("x", [C, A, B]), x("w", [md.Dim("tap", 2), md.Dim("ka", 2), B, O]),
                                          {"c": "tap", "a": "ka"}, padding={"c": "causal", "a": (1, 0)},
                                          dilation={"c": 3}))
case("attention_scaled")(lambda x: md.attention(x("q", [Q, E, H]), x("k", [E, K, H]), x("v", [K, H, E]),
                                                query_dim="q", key_dim="k", feature_dim="e", causal=False, scale=0.3))

# ---- optimizer updates (hyperparameters are inputs too: their gradients are checked)


def _hyper(x, names, kinds):
    return [x(n, [], k) for n, k in zip(names, kinds)]


case("sgd_update")(lambda x: apply("sgd_update", [x("p", [A, B]), x("g", [A, B])], {"lr": 0.3}))
case("sgd_step", "fd")(lambda x: apply("sgd_step", [x("p", [A, B]), x("g", [A, B]),
                                                     *_hyper(x, ("lr", "mom", "wd", "scale"), ["unit"] * 4)],
                                       {"momentum": False}))
case("sgd_step_momentum", "fd")(lambda x: apply(
    "sgd_step", [x("p", [A, B]), x("g", [A, B]), x("buf", [A, B]), *_hyper(x, ("lr", "mom", "wd", "scale"), ["unit"] * 4)],
    {"momentum": True}))


def _adamw(x):
    p, g, m, v = x("p", [A, B]), x("g", [A, B]), x("m", [A, B]), x("v", [A, B], "positive")
    lr, b1, b2, eps, wd = _hyper(x, ("lr", "b1", "b2", "eps", "wd"), ["unit"] * 5)
    t = x("t", [], "positive") * 3.0   # the step count enters as b ** t
    scale = x("scale", [], "unit")
    return apply("adamw_update", [p, g, m, v, lr, b1, b2, eps, wd, t, scale])


case("adamw_update", "fd")(_adamw)

# ---- repeat: the layer loop's own rule (carry, stacked params)

L, B2 = md.Dim("layer", 3), md.Dim("b2", 4)


@case("repeat", "fd")
def _repeat(x):
    def block(c, p):
        y = md.einsum("a b, b b2 -> a b2", c, p["w"])
        return md.tanh(md.rename(y, b2="b") * p["s"]) + c
    return md.repeat(block, x("h", [A, B]), {"w": x("w", [L, B, B2]), "s": x("s", [L, B])}, L)


@case("repeat_closure", "fd")
def _repeat_closure(x):
    """A block reading tensors from outside it: a shared param (its gradient sums the
    layers') and an activation computed before the stack."""
    u, e = x("u", [B]), md.tanh(x("e", [A, B]))

    def block(c, p):
        return md.tanh(c * p["s"] + u) * e + c
    return md.repeat(block, x("h", [A, B]), {"s": x("s", [L, B])}, L)


# ----------------------------------------------------------------------------- the two sides


@dataclass
class Built:
    outputs: list        # the case's float outputs
    wrt: list            # its float inputs
    feeds: dict          # input values, cotangents included
    grads: dict          # input name -> the DSL's gradient Tensor (absent: no gradient)
    nodes: list          # the forward graph


def build(name: str, seed: int) -> Built:
    gen = torch.Generator().manual_seed(seed)
    x = Inputs(gen)
    with md.Graph():
        ys = CASES[name].fn(x)
        ys = [y for y in (ys if isinstance(ys, (tuple, list)) else [ys]) if y.dtype.is_floating_point]
        nodes = topo_nodes(ys)
        cots = []
        for i, y in enumerate(ys):
            cots.append(md.input(f"cotangent{i}", y.shape, y.dtype))
            x.feeds[f"cotangent{i}"] = torch.randn(y.shape.sizes, generator=gen, dtype=y.dtype)
        gs = md.vjp(ys, cots, x.wrt)
    grads = {t.name: g for t, g in zip(x.wrt, gs) if g is not None}
    return Built(ys, x.wrt, x.feeds, grads, nodes)


def dsl_grads(b: Built) -> dict:
    got = {}
    if b.grads:
        prog = md.DenseProgram(b.grads)
        got = prog({k: v for k, v in b.feeds.items() if k in prog.inputs})
    return {t.name: got.get(t.name, torch.zeros(t.shape.sizes, dtype=t.dtype)) for t in b.wrt}


def _objective(b: Built, values: dict) -> torch.Tensor:
    """sum_i <y_i, cotangent_i>: the scalar whose gradient the vjp is."""
    return sum((y * b.feeds[f"cotangent{i}"]).sum() for i, y in enumerate(values))


# The oracle's kernels: each op's own, except where the rule is meant to differ from the
# kernel's autograd (stop_gradient is the identity forward and blocks gradients).
ORACLE_KERNELS = {"stop_gradient": lambda ctx, attrs, x: x.detach()}


def autograd_grads(b: Built) -> dict:
    leaves, env = {}, {}
    for n in b.nodes:
        if n.op.name in LEAVES:
            v = b.feeds[n.name].clone()
            if v.dtype.is_floating_point:
                v.requires_grad_(True)
            leaves[n.name] = env[id(n.outputs[0])] = v
            continue
        kernel = ORACLE_KERNELS.get(n.op.name, n.op.compute)
        r = kernel(DENSE_CTX, n.attrs, *[env[id(t)] for t in n.inputs])
        for t, v in zip(n.outputs, r if len(n.outputs) > 1 else (r,)):
            env[id(t)] = v
    total = _objective(b, [env[id(y)] for y in b.outputs])
    gs = torch.autograd.grad(total, [leaves[t.name] for t in b.wrt], allow_unused=True)
    return {t.name: torch.zeros_like(leaves[t.name]) if g is None else g for t, g in zip(b.wrt, gs)}


def fd_grads(b: Built) -> dict:
    prog = md.DenseProgram(b.outputs)
    feeds = {k: v.clone() for k, v in b.feeds.items()}

    def f():
        out = prog({k: v for k, v in feeds.items() if k in prog.inputs})
        return float(_objective(b, [out[k] for k in out]))
    grads = {}
    for t in b.wrt:
        v, g = feeds[t.name].view(-1), torch.zeros(t.shape.numel, dtype=F64)
        for i in range(v.numel()):
            old = float(v[i])
            v[i] = old + FD_STEP
            up = f()
            v[i] = old - FD_STEP
            g[i] = (up - f()) / (2 * FD_STEP)
            v[i] = old
        grads[t.name] = g.view(t.shape.sizes).to(t.dtype)
    return grads


def check_case(name: str) -> None:
    """Raise AssertionError when a seed of case ``name`` disagrees with its oracle."""
    c = CASES[name]
    for seed in c.seeds:
        b = build(name, seed)
        got = dsl_grads(b)
        want = autograd_grads(b) if c.oracle == "autograd" else fd_grads(b)
        tol = AUTOGRAD_TOL if c.oracle == "autograd" else FD_TOL
        for k, ref in want.items():
            # float32 inputs (cast cases) get their own precision's rounding.
            t = tol if ref.dtype == F64 else 1e-6
            scale = max(1.0, float(ref.abs().max()))
            torch.testing.assert_close(got[k], ref, rtol=t, atol=t * scale,
                                       msg=lambda m, k=k, s=seed: f"case '{name}' seed {s}: gradient of '{k}': {m}")


@pytest.mark.parametrize("name", sorted(CASES))
def test_grad(name):
    check_case(name)


# ----------------------------------------------------------------------------- coverage from the op table


def _ops_in(nodes) -> set[str]:
    out = set()
    for n in nodes:
        out.add(n.op.name)
        for g, _ in n.op.subgraphs(n):
            out |= _ops_in(g.nodes)
    return out


#: ops that take no input: nothing to differentiate.
NO_INPUTS = {"constant"}


def test_every_op_is_checked():
    """Every registered op with a gradient rule is in some case's forward graph (so its rule
    meets the oracle); every other op is one the refusal test below covers."""
    exercised = set()
    for name, c in CASES.items():
        exercised |= _ops_in(build(name, c.seeds[0]).nodes)
    unchecked = sorted(n for n, op in OPS.items()
                       if has_gradient(op) and n not in exercised and n not in LEAVES + tuple(NO_INPUTS))
    assert not unchecked, f"ops whose gradient rule no case of tests/test_op_grads.py checks: {unchecked}"
    refused = {n for n, op in OPS.items() if not has_gradient(op) and n not in NO_INPUTS}
    listed = set(SECOND_ORDER) | set(LOWERING_ONLY) | NOT_FLOAT
    assert refused == listed, (
        f"ops without a gradient rule must be listed in SECOND_ORDER or LOWERING_ONLY (float results) or "
        f"NOT_FLOAT: {sorted(refused ^ listed)}")


# ----------------------------------------------------------------------------- ops without a gradient

#: ops without a rule whose results are never floating point, or that take no
#: floating-point input: no gradient can reach or leave them.
NOT_FLOAT = {"equal", "not_equal", "less", "less_equal", "greater", "greater_equal", "logical_not", "logical_and",
             "logical_or", "iota", "one_hot", "argmax", "argmin", "bitwise_xor"}


def _twice(first):
    """A builder for a loss whose gradient goes through ``first``'s backward kernel (``vjp``,
    whose results, unlike ``grad``'s, are not cut from further differentiation)."""
    def build_loss(x):
        t = x("x", [A, B, C])
        y = first(t, x)
        (g,) = md.vjp([y], [x("w", y.shape)], [t])
        return md.reduce_sum(g * g), t
    return build_loss


def _bias_grad_of_batch_norm(x):
    """A loss of batch_norm's bias gradient (a row of ``batch_norm_backward_sums``' result)."""
    t, b = x("x", [A, B, C]), x("b", [C])
    y = md.batch_norm(t, ["a", "b"], bias=b)
    (g,) = md.vjp([y], [x("w", y.shape)], [b])
    return md.reduce_sum(g * g), t


def _gather_twice(x):
    """gather's gradient (a scatter_add) differentiated again: the rows' gradient is a gather."""
    t = x("t", [C, B])
    y = md.tanh(md.gather(t, x("i", [A], dtype=torch.int64, high=5), "c"))
    (g,) = md.vjp([y], [x("w", y.shape)], [t])
    return md.reduce_sum(g * g)


#: backward kernels (float results, no rule): a second-order gradient through them is refused.
SECOND_ORDER = {
    "softmax_backward": _twice(lambda t, x: md.softmax(t, "c")),
    "normalize_backward": _twice(lambda t, x: md.layer_norm(t, "c")),
    "rms_norm_backward": _twice(lambda t, x: md.rms_norm(t, "c", x("s", [C]))),
    "layer_norm_backward": _twice(lambda t, x: md.layer_norm(t, "c", x("s", [C]), x("o", [C]))),
    "batch_norm_backward": _twice(lambda t, x: md.batch_norm(t, ["a", "b"], x("s", [C]))),
    # the bias's gradient is a row of the backward's sums alone
    "batch_norm_backward_sums": lambda x: _bias_grad_of_batch_norm(x),
    "relu_backward": _twice(lambda t, x: md.relu(t)),
    "gelu_backward": _twice(lambda t, x: md.gelu(t)),
    "gelu_tanh_backward": _twice(lambda t, x: md.gelu(t, approximate="tanh")),
    "silu_backward": _twice(lambda t, x: md.silu(t)),
    "cross_entropy_backward": _twice(lambda t, x: md.cross_entropy(t, x("y", [A, B], dtype=torch.int64, high=5), "c")),
    # conv's weight gradient reads the input: a conv whose weight is made of its input reaches it
    "conv_weight_grad": _twice(lambda t, x: md.conv(t, md.rename(t, a="tap", b="o"), {"b": "tap"})),
    "attention_backward": _twice(lambda t, x: md.attention(t, md.rename(t, b="k"), md.rename(t, b="k"),
                                                           query_dim="b", key_dim="k", feature_dim="c")),
    "repeat_grad": _twice(lambda t, x: md.repeat(lambda c, p: md.tanh(c * p["s"]), t, {"s": x("s", [L, C])}, L)),
}


def _moments_loss(op):
    """A loss through a norm's row statistics made as the lowering makes them over a split dim:
    straight from ``op``'s result, or (``combine_moments``) from the mean and rstd."""
    def build_loss(x):
        t = x("x", [A, B, C])
        if op == "combine_moments":
            mean, rstd = row_moments(t, "c", 1e-5, (2, 3))
            return md.reduce_sum(mean * rstd), t
        return md.reduce_sum(apply(op, [t], {"dim": "c", **({"lengths": (2, 3)} if op == "part_moments" else {})})), t
    return build_loss


#: ops only the lowering builds, after the gradient is made (a fused norm's statistics joined over
#: a split dim, ``meshdsl/ops/moments.py``): no rule, and a graph that reaches them is refused.
LOWERING_ONLY = {op: _moments_loss(op) for op in ("part_moments", "sum_moments", "combine_moments")}


@pytest.mark.parametrize("op", sorted(SECOND_ORDER) + sorted(LOWERING_ONLY))
def test_second_order_is_refused(op):
    """A gradient that would have to pass through a kernel without a rule is a clear error
    naming the op, never a gradient with a term silently missing."""
    with md.Graph():
        loss, t = {**SECOND_ORDER, **LOWERING_ONLY}[op](Inputs(torch.Generator().manual_seed(0)))
        assert op in _ops_in(topo_nodes([loss])), f"the case does not reach '{op}'"
        with pytest.raises(md.GraphError, match=rf"op '{op}' .* has no gradient rule"):
            md.grad(loss, [t])


def test_stop_gradient_cuts_the_path_to_an_op_without_a_rule():
    """The refusal's advice works: behind stop_gradient nothing is differentiated."""
    with md.Graph():
        x = Inputs(torch.Generator().manual_seed(0))
        t = x("x", [A, B, C])
        (g,) = md.vjp([md.softmax(t, "c")], [x("w", [A, B, C])], [t])
        loss = md.reduce_sum(md.stop_gradient(g) * t)
        (d,) = md.grad(loss, [t])
        got = md.run_dense({"d": d}, {k: v for k, v in x.feeds.items() if k in ("x", "w")})["d"]
        want = md.run_dense({"g": g}, {k: v for k, v in x.feeds.items() if k in ("x", "w")})["g"]
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # d(sum(sg(g) * t))/dt = g, exactly
