"""Every op, on every layout of its dims, on meshes (2), (4), (2,2) and (2,2,2),
gives the dense program's forward values and gradients.

Each case builds a tiny graph (dims of size 2-12); :func:`conftest.build_case`
adds ``loss = sum(y * W)`` with fixed random weights W and the gradients of the
loss w.r.t. every float param, so the backward of each op is checked too.
Layouts assign each dim an ordered tuple of distinct mesh axes (none, one, or
several: ``(x,y)`` is x-major), skipping sizes the axes do not divide and
layouts that would put two dims of a param or input on one axis (those are
errors, see test_errors.py).  Intermediates may still have such conflicts; the
compiler resolves them.

Coverage: exhaustive on (2), (4) and (2,2) ((2) with ``-m slow`` only: its layouts are (2,2)'s
that leave one axis unused), except for cases with more layouts
than EXHAUSTIVE_CAP (those with 4+ dims: reshape, rearrange) or a case-specific
``cap`` (the two largest graphs), which take a deterministic sample of that many;
on (2,2,2), where three dims alone have 16**3 layouts, a deterministic sample of
SAMPLE_2X2X2 layouts per case (``sample`` for the largest graphs, whose compile
alone takes ~0.5 s on this mesh; with ``-m slow`` only for an elementwise op on the one dim [seq],
see ``_slow``).  Samples are seeded by the case name, so a
failure message's layout string always reproduces.  Together this keeps the file
at about 80 s of CPU on 2 cores (compiling is most of it).

Every op of the registry has a case, or (a backward op, a leaf) is run by the case that
EXERCISED_BY names: test_every_op_has_a_case walks each claiming case's graph to check.

Legend: batch (b) 4, seq (s) 8, feat (f) 4, vocab (v) 8; tensors are named by
their dims where it helps (x_bs = [batch, seq]).
"""
from __future__ import annotations

import importlib
import math
import pkgutil
import random
import zlib

import pytest
import torch

import meshdsl as md
from meshdsl.ops.moments import row_moments
from meshdsl.ops.registry import OPS
from meshdsl.train.optimizers import global_norm
from meshdsl.train.step import optimizer_outputs
from conftest import (MESHES, axis_tuples, build_case, check_layouts, check_plan, layout_string, leaf_ok,
                      mesh_axes)

EXHAUSTIVE_CAP = 160
SAMPLE_2X2X2 = 12

B, S, F, V = md.Dim("batch", 4), md.Dim("seq", 8), md.Dim("feat", 4), md.Dim("vocab", 8)


def _p(name, dims, **kw):
    return md.param(name, dims, scale=1.0, **kw)


def _x(name, dims):
    """An activation of rank one: the outer product of a 1-D param per dim.

    Unlike a param with all of ``dims``, it lets a layout put several of its dims on
    one mesh axis (only leaves reject that), so the compiler's resolution of such
    conflicts is exercised; its gradients reach every 1-D factor.
    """
    out = None
    for d in dims:
        v = _p(f"{name}_{d.name}", [d])
        out = v if out is None else out * v
    return out


def _pos(t):
    """A positive tensor (for log, sqrt, rsqrt, pow and division)."""
    return t * t + 0.5


CASES: dict = {}
#: cases of one elementwise op on the one dim [seq] (the generic rule, no conflicts): see _OP_PARAMS
SEQ_ONLY: set = set()


def case(name, **kw):
    """Register ``fn() -> (outputs, feeds)`` as a case; ``kw`` goes to build_case, except
    ``cap`` / ``sample`` (layout counts for the largest graphs, see the module docstring)."""
    def deco(fn):
        CASES[name] = (fn, kw)
        return fn
    return deco


# ----------------------------------------------------------------------------- elementwise, unary

# On [batch, seq]: the generic rule's two-dim conflicts (both dims on one axis, resolved by the
# compiler), for a plain op, one of several terms with numbers, a dtype round trip and a fuse
# identity (lowering/fuse.py).
_UNARY = {
    "tanh": md.tanh,
    "pow": lambda x: md.pow(x, 3.0) + md.pow(_pos(x), 0.5) + x ** 2,
    "stop_gradient": lambda x: md.stop_gradient(x) * x,
    "cast": lambda x: md.cast(md.cast(x, torch.float64) * 3.0, torch.float32),
}
for _name, _fn in _UNARY.items():
    case(_name)(lambda fn=_fn: (fn(_x("x_bs", [B, S])), {}))

# Every other elementwise op on one dim: the generic rule lowers every unary op alike (the cases
# above cover its two-dim conflicts), so a case only needs the op's own kernel and gradient on every
# layout of [seq], a quarter of the time of [batch, seq].
_UNARY_1D = {
    "neg": md.neg, "abs": md.abs, "exp": md.exp, "relu": md.relu, "gelu": md.gelu,
    "silu": md.silu, "sigmoid": md.sigmoid,
    "log": lambda x: md.log(_pos(x)), "sqrt": lambda x: md.sqrt(_pos(x)),
    "rsqrt": lambda x: md.rsqrt(_pos(x)),
    "erf": md.erf, "expm1": md.expm1, "square": md.square, "gelu_tanh": lambda x: md.gelu(x, approximate="tanh"), "mish": md.mish, "log_sigmoid": md.log_sigmoid,
    "log1p": lambda x: md.log1p(_pos(x)), "reciprocal": lambda x: md.reciprocal(_pos(x)),
    # beta * x on both sides of the threshold: both branches of the kernel and of the gradient
    "softplus": lambda x: md.softplus(x) + md.softplus(x, beta=2.0, threshold=1.0),
    "leaky_relu": lambda x: md.leaky_relu(x, 0.1), "elu": lambda x: md.elu(x, 1.5),
    "floor": lambda x: md.floor(x * 3.0) * x, "ceil": lambda x: md.ceil(x * 3.0) * x,
    "round": lambda x: md.round(x * 3.0) * x,
}
for _name, _fn in _UNARY_1D.items():
    case(_name)(lambda fn=_fn: (fn(_x("x_s", [S])), {}))
SEQ_ONLY.update(_UNARY_1D)


@case("clamp")
def _clamp():
    x = _x("x_s", [S])
    ids = md.cast(x * 4.0, torch.int64)   # integers of both signs: a relative position clipped to a window
    return {"both": md.clamp(x, -0.5, 0.5), "min": md.clamp(x, min=0.2), "max": md.clamp(x, max=-0.1),
            "int": md.clamp(ids, -1, 2)}, {}


@case("sign")
def _sign():
    x = _x("x_s", [S])
    return {"y": md.sign(x) * x, "int": md.sign(md.cast(x * 4.0, torch.int64))}, {}


# ----------------------------------------------------------------------------- elementwise, n-ary
# a[batch, seq] op c[seq, feat] broadcasts by name to [batch, seq, feat]: the generic rule's
# broadcast (a gradient summed over the dims its operand lacks) and its three-dim conflicts, for
# add, mul, div, greater, equal, where, where_numbers and logical_and.  The rule lowers every n-ary
# op alike, so the others need only their kernels and gradients on every layout of [seq] (as the
# unary ops above): a[seq] op c[seq], a fifth of the time.


def _operands(broadcast: bool):
    """(a, c): [batch, seq] and [seq, feat] params, or both [seq]."""
    return (_p("a_bs", [B, S]), _p("c_sf", [S, F])) if broadcast else (_p("a_s", [S]), _p("c_s", [S]))


_BINARY = {
    "add": md.add, "sub": md.sub, "mul": md.mul, "div": lambda a, c: a / _pos(c),
    "maximum": md.maximum, "minimum": md.minimum,
}
_BINARY_BROADCAST = ("add", "mul", "div")
for _name, _fn in _BINARY.items():
    case(_name)(lambda fn=_fn, b=_name in _BINARY_BROADCAST: (fn(*_operands(b)), {}))
SEQ_ONLY.update(set(_BINARY) - set(_BINARY_BROADCAST))

_COMPARE = {"less": md.less, "less_equal": md.less_equal, "greater": md.greater,
            "greater_equal": md.greater_equal, "equal": md.equal, "not_equal": md.not_equal}


_COMPARE_BROADCAST = ("greater", "equal")


def _compare(fn, broadcast: bool):
    a, c = _operands(broadcast)
    # equal/not_equal need ties: compare with a rounded copy, which ties on some elements.
    r = md.stop_gradient(md.cast(md.cast(c * 2.0, torch.int64), torch.float32) * 0.5)
    m = fn(a, r)
    return {"mask": m, "y": md.where(m, a * c, c - a)}, {}


for _name, _fn in _COMPARE.items():
    case(_name)(lambda fn=_fn, b=_name in _COMPARE_BROADCAST: _compare(fn, b))
SEQ_ONLY.update(set(_COMPARE) - set(_COMPARE_BROADCAST))


@case("where")
def _where():
    a, c = _p("a_bs", [B, S]), _p("c_sf", [S, F])
    return md.where(md.greater(a, 0.0), a * 2.0, c), {}


@case("where_numbers")
def _where_numbers():   # two Python numbers: cond's dims, torch's dtype (int64 here)
    a, c = _p("a_bs", [B, S]), _p("c_sf", [S, F])
    sign = md.where(md.greater(a, 0.0), -1, 1)
    return {"sign": sign, "y": md.cast(sign, torch.float32) * c}, {}


# floored division and remainder (torch's): floats, and integer positions of both signs
@case("floor_divide")
def _floor_divide():
    a, c = _operands(False)
    return {"y": (a * 3.0) // _pos(c) * c, "int": md.cast(a * 4.0, torch.int64) // 3}, {}


@case("remainder")
def _remainder():
    a, c = _operands(False)
    return {"y": md.remainder(a * 3.0, _pos(c)) * c, "int": md.cast(a * 4.0, torch.int64) % 3,
            "left": 7 % (md.cast(a * 4.0, torch.int64) * 2 + 9)}, {}


# a hash's integer mix (Instant-NGP's corner hash); no gradient
@case("bitwise_xor")
def _bitwise_xor():
    a, c = _operands(False)
    h = md.bitwise_xor(md.cast(a * 40.0, torch.int64) * 2654435761, md.cast(c * 40.0, torch.int64)) % 13
    return {"int": h, "y": md.cast(h, torch.float32) * c}, {}


# log(exp(a) + exp(b)), and against a Python number; both sides' gradients
@case("logaddexp")
def _logaddexp():
    a, c = _operands(False)
    return {"y": md.logaddexp(a, c) + md.logaddexp(a, -0.5)}, {}


@case("logical_not")
def _logical_not():
    a, c = _operands(False)
    m = md.logical_not(md.greater(a, c))
    return {"mask": m, "y": md.where(m, a * c, c)}, {}


@case("logical_and")
def _logical_and():
    a, c = _p("a_bs", [B, S]), _p("c_sf", [S, F])
    m = md.logical_and(md.greater(a, 0.0), md.less(c, 0.5))   # [batch, seq] and [seq, feat]: [batch, seq, feat]
    return {"mask": m, "y": md.where(m, a * c, c)}, {}


@case("logical_or")
def _logical_or():
    a, c = _operands(False)
    m = md.logical_or(md.greater(a, 0.0), md.less(c, -0.5))
    return {"mask": m, "y": md.where(m, a * c, c)}, {}


SEQ_ONLY.update({"clamp", "sign", "floor_divide", "remainder", "bitwise_xor", "logaddexp", "logical_not", "logical_or"})


# ----------------------------------------------------------------------------- einsum

@case("einsum_matmul")
def _einsum_matmul():
    return md.einsum("batch seq, seq feat -> batch feat", _x("x_bs", [B, S]), _p("w_sf", [S, F])), {}


@case("einsum_batched")
def _einsum_batched():
    return md.einsum("batch seq feat, batch feat -> batch seq", _x("x_bsf", [B, S, F]), _p("w_bf", [B, F])), {}


@case("einsum_outer_transpose")
def _einsum_outer():
    x, w = _p("x_b", [B]), _p("w_sf", [S, F])
    return {"outer": md.einsum("batch, seq feat -> feat batch seq", x, w),
            "t": md.einsum("seq feat -> feat seq", w)}, {}


@case("einsum_three_operands")
def _einsum_three():
    return md.einsum("batch seq, seq feat, feat -> batch", _x("x_bs", [B, S]), _p("w_sf", [S, F]),
                     _p("v_f", [F])), {}


# ----------------------------------------------------------------------------- reductions

@case("reduce_sum")
def _reduce_sum():
    x = _x("x_bsf", [B, S, F])
    return {"s": md.reduce_sum(x, "seq"), "sf": md.reduce_sum(x, ["seq", "feat"]), "all": md.reduce_sum(x)}, {}


@case("reduce_mean")
def _reduce_mean():
    x = _x("x_bs", [B, S])
    return {"s": md.reduce_mean(x, "seq"), "all": md.reduce_mean(x)}, {}


@case("reduce_max")
def _reduce_max():
    x = _x("x_bsf", [B, S, F])
    return md.reduce_max(x, ["batch", "feat"]), {}


@case("reduce_min")
def _reduce_min():
    x = _x("x_bs", [B, S])
    return {"s": md.reduce_min(x, "seq"), "all": md.reduce_min(x)}, {}


@case("logsumexp")
def _logsumexp():
    x = _x("x_bs", [B, S])
    return {"s": md.logsumexp(x, "seq"), "all": md.logsumexp(x)}, {}


# ----------------------------------------------------------------------------- shape ops

@case("transpose")
def _transpose():
    return md.transpose(_x("x_bsf", [B, S, F]), ["feat", "batch", "seq"]), {}


@case("broadcast_to")
def _broadcast_to():
    return md.broadcast_to(_x("x_sb", [S, B]), [B, F, S]), {}


@case("rename_moves_split")
def _rename():
    # 'seq' -> 'tok': a layout that splits them differently moves the split (alltoall,
    # gather or local split); 'batch' -> 'seq' reuses a name the input already had.
    x = _x("x_bs", [B, S])
    y = md.rename(x, seq="tok")
    return {"y": y, "z": md.rename(y, batch="seq") * 2.0}, {}


@case("reshape")
def _reshape():
    x = _x("x_bs", [B, S])
    return {"split": md.reshape(x, [B, md.Dim("hi", 2), md.Dim("lo", 4)]),
            "as_rename": md.reshape(x, [md.Dim("rows", 4), md.Dim("cols", 8)])}, {}


@case("rearrange_split")
def _rearrange_split():
    x = _x("x_bs", [B, S])
    return md.rearrange(x, "batch (heads d_k) -> d_k batch heads", heads=2), {}


@case("rearrange_merge")
def _rearrange_merge():
    x = _x("x_bhd", [B, md.Dim("heads", 2), md.Dim("d_k", 4)])
    return md.rearrange(x, "batch heads d_k -> (heads d_k) batch"), {}


# ----------------------------------------------------------------------------- along one dim

@case("slice")
def _slice():
    x = _x("x_bs", [B, S])
    return {"mid": md.slice_(x, "seq", 2, 6), "odd": md.slice_(x, "seq", 1, 5)}, {}


@case("pad")
def _pad():
    x = _x("x_bs", [B, S])
    return {"zero": md.pad(x, "seq", 1, 3), "one": md.pad(x, "seq", 8, 0, value=1.0)}, {}


@case("concat")
def _concat():
    a, c = _x("a_bs", [B, md.Dim("seq", 4)]), _x("c_bs", [B, md.Dim("seq", 4)])
    return {"two": md.concat([a, c], "seq"), "three": md.concat([a, c, a * c], "seq")}, {}


_OFFSETS = (1, -1, 2, -2, 3, -5, 7, 8)


@case("shift")
def _shift():
    x = _x("x_bs", [B, S])
    return {f"k{k}": md.shift(x, "seq", k) for k in _OFFSETS}, {}


@case("roll")
def _roll():
    x = _x("x_bs", [B, S])
    return {f"k{k}": md.roll(x, "seq", k) for k in _OFFSETS}, {}


@case("flip")
def _flip():
    """One reversing permute where seq is split evenly (over one axis or two: the group index
    reversed reverses both); over batch and seq at once, one permute over all their axes."""
    x = _x("x_bs", [B, S])
    return {"seq": md.flip(x, "seq"), "both": md.flip(x * x, ["batch", "seq"])}, {}


@case("rfft", cap=24, sample=8)
def _rfft():
    """A spectral filter along seq: rfft, fft and ifft along its frequencies, irfft back (each op's
    gradient the adjoint transform).  A split batch moves nothing; a split seq is gathered (the
    transformed dims are whole on a rank), and its gradient's irfft keeps each rank's rows.  24 of
    its 75 layouts on (2,2), 8 on (2,2,2): the splits of freq (5) and reim (2), which every
    transform gathers alike, multiply them."""
    x = _x("x_bs", [B, S])
    spec = md.ifft(md.fft(md.rfft(x, "seq"), "freq") * _p("w_f", [md.Dim("freq", 5)]), "freq")
    return {"y": md.irfft(spec, "freq", "reim", "seq", n=8)}, {}


@case("part_moments", loss=False, cap=12)
def _part_moments():
    """A layer norm's row statistics as the lowering builds them over a split dim
    (meshdsl/ops/moments.py): parts' moments joined by Chan's formula, and fp64 sums; x far from
    0, where the E[x^2] - E[x]^2 form would lose the variance.  No gradient (built after it)."""
    x = _x("x_bs", [B, S]) * 0.1 + 100.0
    mean, rstd = row_moments(x, "seq", 1e-5, (3, 5))
    mean2, rstd2 = row_moments(x, "seq", 1e-5, None)
    return {"mean": mean, "rstd": rstd, "mean_sums": mean2, "rstd_sums": rstd2}, {}


# ----------------------------------------------------------------------------- convolution
# A split spatial dim trades halos with its neighbours (forward: x's, backward: the output
# gradient's; the weight gradient reuses x's); batch and c_out split freely, c_in leaves a
# partial sum.  Samples keep the 5-dim cases' layouts (up to 5**4 on (2,2)) affordable.
CI, CO = md.Dim("c_in", 2), md.Dim("c_out", 2)


@case("conv", cap=48, sample=8)
def _conv():
    x, w = _x("x_bsc", [md.Dim("batch", 2), S, CI]), _p("w_tco", [md.Dim("tap", 3), CI, CO])
    return {"same": md.conv(x, w, {"seq": "tap"}), "causal": md.conv(x, w, {"seq": "tap"}, padding="causal"),
            "ends": md.conv(x, w, {"seq": "tap"}, padding=(0, 2))}, {}


@case("conv_valid", cap=24, sample=6)
def _conv_valid():
    # seq 8 -> 4: every output block reads across a block boundary of the input.
    x, w = _x("x_sc", [S, CI]), _p("w_tco", [md.Dim("tap", 5), CI, CO])
    return md.conv(x, w, {"seq": "tap"}, padding="valid"), {}


@case("conv_2d", cap=48, sample=8)
def _conv_2d():
    h, wd = md.Dim("h", 4), md.Dim("w", 4)
    x, k = _x("x_hwc", [h, wd, CI]), _p("k_hwco", [md.Dim("kh", 3), md.Dim("kw", 2), CI, CO])
    return md.conv(x, k, {"h": "kh", "w": "kw"}, padding={"h": "same", "w": "causal"}), {}


@case("conv_dilated", cap=24, sample=4)
def _conv_dilated():
    # taps 3 dilated 2: 4 rows of halo in all ('same': 2 each side, causal: 4 before)
    x, w = _x("x_bsc", [md.Dim("batch", 2), S, CI]), _p("w_tco", [md.Dim("tap", 3), CI, CO])
    return {"same": md.conv(x, w, {"seq": "tap"}, dilation=2),
            "causal": md.conv(x, w, {"seq": "tap"}, padding="causal", dilation=2)}, {}


# ----------------------------------------------------------------------------- nn

@case("softmax")
def _softmax():
    return md.softmax(_x("x_bv", [B, V]), "vocab"), {}


@case("log_softmax")
def _log_softmax():
    return md.log_softmax(_x("x_bv", [B, V]), "vocab"), {}


@case("layer_norm")
def _layer_norm():
    x = _x("x_bf", [B, F])
    return md.layer_norm(x, "feat", _p("g_f", [F]), _p("b_f", [F])), {}


@case("normalize", sample=6)  # a normalised dim split on (2,2,2) is gathered: ~0.25 s a layout
def _normalize():
    # layer_norm without an affine, or with a scale over more dims than its own, is the bare
    # normalize op (the affine then elementwise).  x is a full param, not an outer product:
    # normalising x_b * x_s over seq would cancel x_b and leave its gradient ~0.
    x = _p("x_bs", [B, S])
    affine = md.layer_norm(x, "batch", _p("g_bs", [B, S]), _p("b_s", [S]))
    return {"plain": md.layer_norm(x, "seq"), "affine": affine}, {}


@case("batch_norm")
def _batch_norm():
    # over two dims per feature, with the batch variance as an output too.  x is a full param
    # (as in "normalize" above): an outer product's factors along the normalised dims would cancel.
    y, _, var = md.batch_norm(_p("x_bsf", [B, md.Dim("seq", 2), F]), ["batch", "seq"], _p("g_f", [F]),
                              _p("b_f", [F]), stats=True)
    return {"y": y, "var": var}, {}


@case("rms_norm")
def _rms_norm():
    # one op with its scale over its own dim ("scale", "plain": no scale), and over the first
    # dim; a scale over more dims than its own (the op without it, then elementwise).  x is a
    # full param where batch is normalised (as in "normalize" above).
    x, x_bs = _x("x_bs", [B, S]), _p("p_bs", [B, S])
    return {"scale": md.rms_norm(x, "seq", _p("g_s", [S])), "plain": md.rms_norm(x, "seq"),
            "first_dim": md.rms_norm(x_bs, "batch", _p("g_b", [B])),
            "wide": md.rms_norm(x_bs, "seq", _p("g_bs", [B, S]))}, {}


def _labels(*shape, high=8):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(7))


@case("cross_entropy")
def _cross_entropy():
    logits = _x("logits_bsv", [B, md.Dim("seq", 2), V])
    labels = md.input("labels", [B, md.Dim("seq", 2)], torch.int64)
    return md.cross_entropy(logits, labels, "vocab"), {"labels": _labels(4, 2)}


# ----------------------------------------------------------------------------- index ops

@case("gather")
def _gather():
    table = _p("table_vf", [V, F])
    ids = md.input("ids", [B, md.Dim("seq", 2)], torch.int64)
    return md.gather(table, ids, "vocab"), {"ids": _labels(4, 2)}


@case("one_hot")
def _one_hot():
    ids = md.input("ids", [B], torch.int64)
    oh = md.one_hot(ids, V)
    return {"oh": oh, "emb": md.einsum("batch vocab, vocab feat -> batch feat", oh, _p("emb_vf", [V, F]))}, \
        {"ids": _labels(4)}


@case("iota")
def _iota():
    x = _x("x_sf", [S, F])
    i = md.iota(S)
    return {"i": i, "y": md.cast(i, torch.float32) * x}, {}


@case("causal_mask")
def _causal_mask():
    q, k = md.Dim("seq", 8), md.Dim("key", 8)
    mask = md.causal_mask(q, k)
    scores = _x("scores_sk", [q, k])
    return {"mask": mask, "attn": md.softmax(md.where(mask, scores, -1e9), "key")}, {}


@case("attention", cap=60, sample=6)
def _attention():
    # q [batch, seq, feat], k and v [batch, key, feat]: batch and seq split locally in the
    # forward (each query slice masks from its offset), key and feat are gathered.
    key = md.Dim("key", 8)
    q = _p("q_bsf", [B, S, F])
    k, v = _p("k_bkf", [B, key, F]), _p("v_bkf", [B, key, F])
    return md.attention(q, k, v, "seq", "key", "feat", causal=True), {}


@case("attention_window", cap=24, sample=4)
def _attention_window():
    # a sliding window of 3 keys: where seq and key are split alike, each rank takes the 2 key and
    # value rows before its block from its neighbour (a halo) and sends their gradients back.
    key = md.Dim("key", 8)
    q = _p("q_bsf", [B, S, F])
    k, v = _p("k_bkf", [B, key, F]), _p("v_bkf", [B, key, F])
    return md.attention(q, k, v, "seq", "key", "feat", causal=True, window=3), {}


@case("top_k")
def _top_k():
    x = _x("x_bv", [B, V])
    vals, idx = md.top_k(x, "vocab", 2, "top")
    return {"vals": vals, "idx": idx}, {}


@case("argmax")
def _argmax():
    x = _x("x_bv", [B, V])
    # few distinct values (halves): ties, where the first extreme wins on every layout
    r = md.cast(md.cast(x * 2.0, torch.int64), torch.float32) * 0.5
    return {"vocab": md.argmax(x, "vocab"), "ties": md.argmax(r, "vocab")}, {}


@case("argmin")
def _argmin():
    x = _x("x_bv", [B, V])
    r = md.cast(md.cast(x * 2.0, torch.int64), torch.float32) * 0.5
    return {"batch": md.argmin(x, "batch"), "ties": md.argmin(r, "vocab")}, {}


@case("dropout")
def _dropout():
    x = _x("x_bs", [B, S])
    return {"r3": md.dropout(x, 0.3, seed=3), "r5": md.dropout(md.transpose(x, ["seq", "batch"]), 0.5, seed=1)}, {}


# ----------------------------------------------------------------------------- running sums, size-1 dims

@case("cumsum")
def _cumsum():
    # More flags, dtypes and the lowering's plan: test_scan.py.
    x = _x("x_bs", [B, S])
    return {f"{d}/{m}": md.cumsum(x, d, exclusive=e, reverse=r) for d in ("batch", "seq")
            for m, (e, r) in {"inc": (False, False), "exc_rev": (True, True)}.items()}, {}


@case("squeeze")
def _squeeze():
    vals, idx = md.top_k(_x("x_bv", [B, V]), "vocab", 1, "top")
    return {"v": md.squeeze(vals, "top"), "i": md.squeeze(idx, "top")}, {}


@case("unsqueeze")
def _unsqueeze():
    return md.unsqueeze(_x("x_bs", [B, S]), md.Dim("one", 1), 1), {}


# ----------------------------------------------------------------------------- scan, autodiff, optimizer

L, D, FF = md.Dim("layer", 2), md.Dim("d_model", 4), md.Dim("d_ff", 8)


def _block(h, p):
    u = md.relu(md.einsum("batch d_model, d_model d_ff -> batch d_ff", h, p["w1"]))
    return h + md.einsum("batch d_ff, d_ff d_model -> batch d_model", u, p["w2"])


@case("repeat", whole=("layer",), sample=8)
def _repeat():
    x = _x("x_bd", [B, D])
    w1, w2 = _p("w1", [L, D, FF]), _p("w2", [L, FF, D])
    return md.repeat(_block, x, {"w1": w1, "w2": w2}, "layer"), {}


@case("vjp", loss=False)
def _vjp():
    x, w = _p("x_bs", [B, S]), _p("w_sf", [S, F])
    y = md.tanh(md.einsum("batch seq, seq feat -> batch feat", x, w))
    ct = md.input("ct", [B, F])
    gx, gw = md.vjp([y], [ct], [x, w])
    return {"y": y, "gx": gx, "gw": gw}, {"ct": torch.randn(4, 4, generator=torch.Generator().manual_seed(3))}


def _training_loss():
    """A loss over a fed x [batch, seq] and params w_sf, v_f: (loss, params, feeds)."""
    x = md.input("x", [B, S])
    w = {"w_sf": _p("w_sf", [S, F]), "v_f": _p("v_f", [F])}
    loss = md.reduce_mean(md.tanh(md.einsum("batch seq, seq feat -> batch feat", x, w["w_sf"])) * w["v_f"])
    return loss, w, {"x": torch.randn(4, 8, generator=torch.Generator().manual_seed(4))}


@case("sgd", loss=False)
def _sgd():
    loss, w, feeds = _training_loss()
    new = md.sgd(w, md.grad(loss, w), lr=0.5)
    return {"loss": loss, **{f"new/{k}": t for k, t in new.items()}}, feeds


# The optimizer steps below are the graphs TrainStep builds (optimizer_outputs): the update
# ops see their param's slice on every layout.  Their state starts at zero (params init so).

@case("sgd_step", loss=False)
def _sgd_step():
    # momentum and weight decay on w_sf; on v_f the same SGD without momentum, the op's form
    # with no buffer.  Both read the same hyperparameter inputs (opt/lr, ...).
    loss, w, feeds = _training_loss()
    mom = md.SGD(lr=0.5, momentum=0.9, weight_decay=0.1)
    with_buf = optimizer_outputs(loss, {"w_sf": w["w_sf"]}, mom, clip=False)
    plain = optimizer_outputs(loss, {"v_f": w["v_f"]}, md.SGD(lr=0.5, weight_decay=0.1), clip=False)
    outs = {**{f"momentum/{k}": t for k, t in with_buf.items()},
            **{f"plain/{k}": t for k, t in plain.items() if k != "loss"}}
    return outs, {**feeds, **mom.feeds(0)}


@case("adamw_update", loss=False)
def _adamw_update():
    # Clipped at 0.05, a third of the global gradient norm (0.148), so the gradient scale is < 1;
    # at step 3, so the bias corrections are not 1.
    loss, w, feeds = _training_loss()
    opt = md.AdamW(lr=0.1, weight_decay=0.1)
    return optimizer_outputs(loss, w, opt, clip=True), {**feeds, **opt.feeds(2), "opt/clip_norm": torch.tensor(0.05)}


@case("scalar_sum")
def _scalar_sum():
    # The global norm of tensors split over different axes: each sum of squares is partial over
    # the axes that split its tensor, and scalar_sum's lowering reduces each set of axes once.
    return global_norm({"a": _x("a_bs", [B, S]), "c": _p("c_sf", [S, F]), "v": _p("v_f", [F])}), {}


@case("repeat_norm_dropout", whole=("layer",), cap=20, sample=4)  # the largest graph: sampled
def _repeat_norm_dropout():
    # The dropout mask inside a scan depends on the layer (salt) and the global index only.
    def block(h, p):
        u = md.rms_norm(h, "d_model", p["g"])
        u = md.gelu(md.einsum("batch d_model, d_model d_ff -> batch d_ff", u, p["w1"]))
        u = md.dropout(u, 0.25, seed=5)
        return h + md.einsum("batch d_ff, d_ff d_model -> batch d_model", u, p["w2"])

    x = _x("x_bd", [B, D])
    ps = {"g": _p("g", [L, D]), "w1": _p("w1", [L, D, FF]), "w2": _p("w2", [FF, L, D])}
    return md.repeat(block, x, ps, "layer"), {}


@case("linear_consumers_of_partial_sums", cap=30, sample=8)  # 17 outputs over 5 dims: sampled
def _partial_sums():
    # p is a lazy partial sum over the axes of 'seq', q over those of 'feat' (when split);
    # linear ops may pass a partial sum on, others must reduce it first.
    x, w = _x("x_bs", [B, S]), _p("w_sf", [S, F])
    p = md.einsum("batch seq, seq feat -> batch feat", x, w)
    q = md.einsum("batch seq feat, seq feat -> batch feat", _x("y_bsf", [B, S, F]), _p("v_sf", [S, F]))
    c = _p("c_f", [F])
    return {
        "add_same": p + p * 2.0, "add_other": p - q, "add_plain": p + c, "neg": -md.transpose(p, ["feat", "batch"]),
        "mul": p * c, "div": p / _pos(c), "div_by_partial": c / _pos(p), "rename": md.rename(p, feat="out"),
        "pad": md.pad(p, "feat", 1, 3), "concat": md.concat([p, q], "feat"), "shift": md.shift(p, "batch", 1),
        "reduce": md.reduce_sum(p, "feat"), "bcast": md.broadcast_to(p, [B, F, md.Dim("extra", 2)]),
        "dropout": md.dropout(p, 0.5, seed=2), "cast": md.cast(md.cast(p, torch.float64) * 2.0, torch.float32),
        "relu": md.relu(p), "softmax": md.softmax(q, "batch"),
    }, {}


# ----------------------------------------------------------------------------- constants, sin and cos
# A tensor constant is sliced by each rank (like a param, never trained); a rotary embedding
# reads one (its inverse frequencies) with position ids, sin and cos.

case("sin")(lambda: (md.sin(_x("x_s", [S]) * 3.0), {}))   # on [seq], as the unary ops above
case("cos")(lambda: (md.cos(_x("x_s", [S]) * 3.0), {}))
SEQ_ONLY.update({"sin", "cos"})


@case("constant_tensor", cap=60)  # three dims: 125 layouts on (2,2), of which a sample keeps the file's time
def _constant_tensor():
    c = md.constant(torch.randn(8, 4, generator=torch.Generator().manual_seed(7)), [S, F])
    return {"c": c, "y": _x("x_bs", [B, S]) * c + md.constant([0.5, -1.0, 2.0, 0.25], ["feat"])}, {}


@case("constant_rope", cap=24, sample=6)  # six dims: sampled
def _constant_rope():
    # feat holds (half two) pairs, each turned by position * inv_freq: (x0, x1) -> x * cos + (-x1, x0) * sin
    half, two = md.Dim("half", 2), md.Dim("two", 2)
    inv_freq = md.constant(1.0 / 100.0 ** (torch.arange(0, 4, 2, dtype=torch.float32) / 4), [half])
    angles = md.arange(S, torch.float32) * inv_freq
    pairs = md.rearrange(_x("x_bsf", [B, S, F]), "batch seq (half two) -> batch seq half two", two=2)
    turn = md.constant([[0.0, 1.0], [-1.0, 0.0]], [two, "two_out"])
    turned = md.rename(md.einsum("batch seq half two, two two_out -> batch seq half two_out", pairs, turn),
                       two_out="two")
    return md.reshape(pairs * md.cos(angles) + turned * md.sin(angles), [B, S, F]), {}


# ----------------------------------------------------------------------------- coverage from the op registry

#: Registry ops that are no case of their own, each with the case whose built graph (forward,
#: gradients, repeat blocks) holds a node of it: test_every_op_has_a_case walks that graph.
EXERCISED_BY = {
    # leaves, which every case builds on
    "param": "add", "input": "cross_entropy", "placeholder": "repeat",  # the block's carry and layer params
    "constant": "where",                              # a Python number operand: greater(a, 0.0), a * 2.0
    # backward ops: only a gradient makes them (build_case differentiates each case's loss)
    "softmax_backward": "softmax", "gelu_backward": "gelu", "relu_backward": "relu", "silu_backward": "silu",
    "gelu_tanh_backward": "gelu_tanh",
    "cross_entropy_backward": "cross_entropy", "layer_norm_backward": "layer_norm",
    "normalize_backward": "normalize", "rms_norm_backward": "rms_norm", "batch_norm_stats": "batch_norm",
    "batch_norm_backward_sums": "batch_norm", "batch_norm_backward": "batch_norm",
    "attention_backward": "attention", "repeat_grad": "repeat", "conv_weight_grad": "conv",
    # reached through another op or a function of another name
    "scatter_add": "gather",                          # the table's gradient
    "sgd_update": "sgd",                              # md.sgd's fused update
    "fft": "rfft", "irfft": "rfft",                   # the spectral filter's other transforms
    "sum_moments": "part_moments", "combine_moments": "part_moments",   # the fp64 sums' form, the join
}

#: Public functions composed of other ops (no registry entry of their own) that keep a case.
COMPOSITES = ("reduce_mean", "logsumexp", "log_softmax", "causal_mask", "roll", "unsqueeze",
              "vjp", "sgd")


def _registry() -> dict:
    """The op table with every meshdsl module loaded: ``import meshdsl`` loads modules on first
    use, and some rooms register ops of their own (``repeat`` in ir/, ``sgd_update`` in train/)."""
    for m in pkgutil.walk_packages(md.__path__, "meshdsl."):
        if m.name != "meshdsl.__main__":  # that one runs the CLI
            importlib.import_module(m.name)
    return OPS


def _ops_in(c) -> set[str]:
    """The op names of every node a built case runs: forward, gradients and sub-graphs (repeat blocks)."""
    seen, names = set(), set()

    def walk(nodes):
        for n in nodes:
            if id(n) not in seen:
                seen.add(id(n))
                names.add(n.op.name)
                for g, _ in n.op.subgraphs(n):
                    walk(g.nodes)
    walk(md.core.graph.topo_nodes(list(c.outputs.values())))
    return names


def _cases_for(op: str) -> list[str]:
    """The cases that claim ``op``: named after it (``op`` or ``op_<variant>``), or EXERCISED_BY's."""
    named = [c for c in CASES if c == op or c.startswith(op + "_")]
    return named + ([EXERCISED_BY[op]] if op in EXERCISED_BY else [])


def test_every_op_has_a_case():
    # An op added to the registry fails here until a case (or an EXERCISED_BY entry) covers it,
    # and a claim only counts when the claiming case's graph really holds a node of the op.
    ops = _registry()
    unclaimed = sorted(op for op in ops if not _cases_for(op))
    assert not unclaimed, (
        f"registry op(s) with no layout-equivalence case: {unclaimed}.  Add a @case named after each "
        "(or '<op>_<variant>'); an op only another op's case reaches (a backward op, a leaf) gets an "
        "EXERCISED_BY entry naming that case instead.")
    stale = sorted(set(EXERCISED_BY) - set(ops))
    assert not stale, f"EXERCISED_BY names op(s) the registry no longer has: {stale}"
    unheld = [f"'{op}': case(s) {_cases_for(op)} build no '{op}' node" for op in sorted(ops)
              if not any(op in _ops_in(_built(c)) for c in _cases_for(op))]
    assert not unheld, "cases that claim an op without running it:\n  " + "\n  ".join(unheld)
    assert not [f for f in COMPOSITES if f not in CASES]


_BUILT: dict = {}


def _built(name):
    if name not in _BUILT:
        fn, kw = CASES[name]
        kw = {k: v for k, v in kw.items() if k not in ("cap", "sample")}
        _BUILT[name] = build_case(fn, **kw)
    return _BUILT[name]


def _slow(name: str, mesh: str) -> bool:
    """The one-axis meshes run with ``-m slow``: each layout of (2) is one of (2,2)'s that leaves y
    unused (the same collectives over x), and each 4-way split of (4) is one of (2,2)'s over (x,y),
    which the default run checks exhaustively (there the group spans two axes, on (4) one: the
    suite's budget).  So does (2,2,2) for an elementwise op on [seq] (SEQ_ONLY): its one dim has no
    conflict to resolve, the op runs on each rank's slice whatever its axes, and what (2,2,2) adds
    (groups over three axes: the loss's reduction) every other case's (2,2,2) runs."""
    return mesh in ("2", "4") or (mesh == "2x2x2" and name in SEQ_ONLY)


_OP_PARAMS = [pytest.param(n, m, marks=pytest.mark.slow) if _slow(n, m) else pytest.param(n, m, id=f"{n}-{m}")
              for n in sorted(CASES) for m in MESHES]


@pytest.mark.parametrize("name, mesh", _OP_PARAMS)
def test_op_all_layouts(name, mesh):
    c = _built(name)
    cap = CASES[name][1].get("cap", EXHAUSTIVE_CAP)
    if mesh == "2x2x2":
        sample = CASES[name][1].get("sample", SAMPLE_2X2X2)
        n = check_layouts(c, MESHES[mesh], cap=sample, seed=zlib.crc32(name.encode()))
    else:
        n = check_layouts(c, MESHES[mesh], cap=cap, seed=zlib.crc32(name.encode()))
    assert n >= 2


# ----------------------------------------------------------------------------- scoped rules

def _mlp():
    x = md.input("x", [B, D])
    w1, w2 = _p("w1", [D, FF]), _p("w2", [FF, D])
    h = md.relu(md.einsum("batch d_model, d_model d_ff -> batch d_ff", x, w1))
    return md.einsum("batch d_ff, d_ff d_model -> batch d_model", h, w2), \
        {"x": torch.randn(4, 4, generator=torch.Generator().manual_seed(5))}


def _scoped_layouts(mesh: str, count: int, seed: int):
    """Global rules for every dim plus ``params.`` rules for the weights' dims, sampled.

    A ``params.`` rule overrides the global rule for params and their gradients, so
    a layout is skipped only when the *effective* axes of a leaf collide.
    """
    axes = mesh_axes(mesh)
    sizes = {"batch": 4, "d_model": 4, "d_ff": 8}
    opts = {d: [t for t in axis_tuples(axes) if n % math.prod(axes[a] for a in t) == 0]
            for d, n in sizes.items()}
    rng = random.Random(seed)
    out, seen = [], set()
    while len(out) < count:
        glob = {d: rng.choice(o) for d, o in opts.items()}
        scoped = {d: rng.choice(opts[d]) for d in ("d_model", "d_ff") if rng.random() < 0.7}
        scoped = {d: a for d, a in scoped.items() if a}
        eff = {**glob, **scoped}
        leaves_ok = leaf_ok(glob, [("batch", "d_model")]) and leaf_ok(eff, [("d_model", "d_ff")])
        lay = "; ".join(s for s in (layout_string(scoped, "params."), layout_string(glob)) if s)
        if leaves_ok and lay not in seen:
            seen.add(lay)
            out.append(lay)
    return out


@pytest.mark.parametrize("mesh", ["2", "2x2", "2x2x2"])
def test_params_scoped_rules(mesh):
    # FSDP/ZeRO-style: weights (and their gradients) laid out apart from activations,
    # plus rules scoped to one tensor by name.
    c = build_case(_mlp)
    count = {"2": 8, "2x2": 60, "2x2x2": 30}[mesh]
    extra = {
        "2": ["params.d_model:x; batch:x", "w1.d_ff:x; batch:x", "x.batch:x; d_ff:x"],
        "2x2": ["params.d_model:(x,y); batch:(x,y)", "params.d_ff:x; batch:x; d_ff:y",
                "w1.d_ff:(y,x); w2.d_model:x; batch:y", "x.d_model:y; params.d_model:x; batch:x",
                "params.d_model:x; params.d_ff:y; batch:(x,y); d_ff:x"],
        "2x2x2": ["params.d_model:(x,y); batch:(z,x)", "w2.d_ff:(z,y); params.d_model:x; batch:y; d_ff:z"],
    }[mesh]
    layouts = _scoped_layouts(MESHES[mesh], count, seed=11) + extra
    failures = []
    for lay in layouts:
        try:
            check_plan(c, MESHES[mesh], lay)
        except Exception as e:  # noqa: BLE001 - reported below
            failures.append(f"mesh='{MESHES[mesh]}' layout='{lay}': {type(e).__name__}: {e}")
    assert not failures, "\n".join(failures[:5])
