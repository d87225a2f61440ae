"""Convolution along named dims: ``conv`` (stride 1 as one op; a strided one as stride-1 convs
over the input's phases) and its fused weight gradient.

``conv(x, w, {"seq": "tap"})`` slides ``w [tap, c_in, c_out]`` along ``seq`` of
``x [batch, seq, c_in]`` (cross-correlation, as torch's ``conv1d``), with one tap dim per
spatial dim (one or two of them).  The channel dim x and w share is summed; w's other
dim takes its place in the output.  Padding is per spatial dim, ``(before, after)``
zeros, each at most ``taps - 1``.

Gradients: the input's is a conv of the output's gradient with the taps mirrored (the
``flip`` attribute) and the padding mirrored too (``taps - 1 - before``); the weight's is
:class:`ConvWeightGrad`, one torch kernel that has no gradient itself (as attention's
backward).  Lowering: :mod:`meshdsl.lowering.conv` (batch and output channels split
freely, a split input channel dim leaves a partial sum, a split spatial dim trades a
halo with its neighbours).

Kernel layout: x is viewed as ``(N, c_in, spatial...)`` with every batch dim folded into
N, w as ``(c_out, c_in, taps...)``; the result is permuted back to the output's dim order.
Below :data:`SMALL_MACS` multiply-adds the kernels run as one einsum over x's unfolded
windows (im2col) instead of torch's convolution, whose oneDNN call costs a fixed ~60 us on
one thread and milliseconds when its threads contend for cores (measured on the 2-core
test machine: (2, 16, 64) x 5 taps, 89 us against 42 us on one thread).
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from ..core.graph import Tensor
from ..core.shape import Dim, Shape
from ..errors import ShapeError, message
from .registry import ComputeSpec, Op, apply, register

_CONV = {1: F.conv1d, 2: F.conv2d}
_WEIGHT_GRAD = {1: torch.nn.grad.conv1d_weight, 2: torch.nn.grad.conv2d_weight}
#: (unfolded x, w) -> y and (unfolded x, dy) -> dw, per count of spatial dims (a, b: positions; i, j: taps)
_UNFOLDED = {1: ("ncai,oci->noa", "ncai,noa->oci"), 2: ("ncabij,ocij->noab", "ncabij,noab->ocij")}
#: multiply-adds below which the kernels run as an einsum over unfolded windows (see the module docstring)
SMALL_MACS = 1 << 22
PADDINGS = ("same", "valid", "causal")


def _layout(x: Shape, w: Shape, attrs: dict) -> None:
    """Put the kernel's permutations in ``attrs`` (see the module docstring)."""
    spatial = [d for d, *_ in attrs["spatial"]]
    c_in, c_out = attrs["in_dim"], attrs["out_dim"]
    batch = [d for d in x.names if d != c_in and d not in spatial]
    y_names = tuple(c_out if d == c_in else d for d in x.names)
    std_x, std_y = batch + [c_in] + spatial, batch + [c_out] + spatial
    std_w = [c_out, c_in] + [tap for _, tap, *_ in attrs["spatial"]]
    attrs["num_batch"] = len(batch)
    attrs["x_perm"] = tuple(x.names.index(d) for d in std_x)
    attrs["y_perm"] = tuple(std_y.index(d) for d in y_names)        # kernel order -> output order
    attrs["y_std"] = tuple(y_names.index(d) for d in std_y)         # output order -> kernel order
    attrs["w_perm"] = tuple(w.names.index(d) for d in std_w)
    attrs["w_back"] = tuple(std_w.index(d) for d in w.names)


def _std(t, perm, num_batch: int):
    """``t`` permuted by ``perm`` with its leading ``num_batch`` dims folded into one."""
    t = t.permute(perm)
    return t.reshape((-1,) + tuple(t.shape[num_batch:])), tuple(t.shape[:num_batch])


def _kernel_weight(w, attrs):
    ws = w.permute(attrs["w_perm"])
    return ws.flip(tuple(range(2, ws.dim()))) if attrs["flip"] else ws


def _unfolded(xs, taps):
    """``xs`` (N, C, spatial...) -> (N, C, out positions..., taps...): every window, as views."""
    for i, k in enumerate(taps):
        xs = xs.unfold(2 + i, k, 1)
    return xs


def _small(xs, taps, out_channels: int) -> bool:
    n = xs.shape[0] * xs.shape[1] * out_channels
    for i, k in enumerate(taps):
        n *= k * (xs.shape[2 + i] - k + 1)
    return n < SMALL_MACS


def conv_valid(attrs: dict, x, w):
    """The conv of ``x`` (already padded: every spatial dim holds ``out + taps - 1`` positions)."""
    xs, batch = _std(x, attrs["x_perm"], attrs["num_batch"])
    ws = _kernel_weight(w, attrs)
    taps = tuple(ws.shape[2:])
    if _small(xs, taps, ws.shape[0]):
        y = torch.einsum(_UNFOLDED[len(taps)][0], _unfolded(xs, taps), ws)
    else:
        y = _CONV[len(taps)](xs, ws)
    y = y.reshape(batch + tuple(y.shape[1:])).permute(attrs["y_perm"])
    return y if y.is_contiguous() else y.contiguous()


def weight_grad_valid(attrs: dict, x, dy):
    """The gradient of ``conv_valid(attrs, x, w)`` w.r.t. ``w``, given the output's gradient ``dy``."""
    xs, _ = _std(x, attrs["x_perm"], attrs["num_batch"])
    ds, _ = _std(dy, attrs["y_std"], attrs["num_batch"])
    taps = tuple(k for _, _, k, _, _ in attrs["spatial"])
    if _small(xs, taps, ds.shape[1]):
        dw = torch.einsum(_UNFOLDED[len(taps)][1], _unfolded(xs, taps), ds)
    else:
        dw = _WEIGHT_GRAD[len(taps)](xs, (ds.shape[1], xs.shape[1]) + taps, ds)
    if attrs["flip"]:
        dw = dw.flip(tuple(range(2, dw.dim())))
    return dw.permute(attrs["w_back"]).contiguous()


def pad_spatial(attrs: dict, x, pos_of):
    """``x`` with each spatial dim's (before, after) zeros (``pos_of``: dim name -> position)."""
    pads = [0, 0] * x.dim()
    for d, _, _, before, after in attrs["spatial"]:
        k = 2 * (x.dim() - 1 - pos_of[d])
        pads[k], pads[k + 1] = before, after
    return F.pad(x, pads) if any(pads) else x


class _ConvBase(Op):
    """What conv and its weight gradient share: both are lowered by meshdsl/lowering/conv.py."""

    def spec(self, node):
        # For the generic rule's eyes only (the lowering has a rule of its own): the spatial
        # and tap dims whole, the input channel summed.
        dims = {d.name: d.size for t in node.inputs for d in t.shape}
        fixed = {d for d, *_ in node.attrs["spatial"]} | {tap for _, tap, *_ in node.attrs["spatial"]}
        return ComputeSpec(dims, fixed=frozenset(fixed), reduce={node.attrs["in_dim"]: "sum"})

    def flops(self, node, local):
        """Two per multiply-add: every output position (of conv's output, or of the output
        gradient the weight gradient reads) meets every tap of every input channel."""
        a = node.attrs
        positions = node.outputs[0] if self.name == "conv" else node.inputs[1]
        n = 2 * local.get(a["in_dim"], node.inputs[0].shape.get(a["in_dim"]).size)
        for d in positions.shape:
            n *= local.get(d.name, d.size)
        for *_, k, _, _ in a["spatial"]:
            n *= k
        return n


@register
class Conv(_ConvBase):
    """``conv``: attrs ``spatial`` ((dim, tap, taps, before, after), ...), ``in_dim``, ``out_dim``, ``flip``."""

    name = "conv"
    linear_args = (0, 1)

    def infer(self, inputs, attrs):
        x, w = inputs
        sizes = {d: x.shape.get(d).size + b + a - k + 1 for d, _, k, b, a in attrs["spatial"]}
        out = Shape(Dim(attrs["out_dim"], w.shape.get(attrs["out_dim"]).size) if d.name == attrs["in_dim"]
                    else Dim(d.name, sizes.get(d.name, d.size)) for d in x.shape)
        _layout(x.shape, w.shape, attrs)
        attrs["x_pos"] = {d.name: i for i, d in enumerate(x.shape)}
        return [(out, x.dtype)]

    def compute(self, ctx, attrs, x, w):
        return conv_valid(attrs, pad_spatial(attrs, x, attrs["x_pos"]), w)

    def grad(self, node, douts):
        (dy,), (x, w), a = douts, node.inputs, node.attrs
        mirrored = tuple((d, tap, k, k - 1 - b, k - 1 - af) for d, tap, k, b, af in a["spatial"])
        dx = apply("conv", [dy, w], {"spatial": mirrored, "in_dim": a["out_dim"], "out_dim": a["in_dim"],
                                     "flip": not a["flip"]})
        dw = apply("conv_weight_grad", [x, dy], {**{k: a[k] for k in ("spatial", "in_dim", "out_dim", "flip")},
                                                 "w_names": w.shape.names})
        return [dx, dw]


@register
class ConvWeightGrad(_ConvBase):
    """The gradient of ``conv`` w.r.t. its weight: inputs (x, the output's gradient), conv's attrs."""

    name = "conv_weight_grad"
    linear_args = (0, 1)

    def infer(self, inputs, attrs):
        x, dy = inputs
        w = Shape([Dim(attrs["out_dim"], dy.shape.get(attrs["out_dim"]).size),
                   Dim(attrs["in_dim"], x.shape.get(attrs["in_dim"]).size)]
                  + [Dim(tap, k) for _, tap, k, _, _ in attrs["spatial"]])
        w = Shape(w.get(n) for n in attrs.setdefault("w_names", w.names))
        _layout(x.shape, w, attrs)
        attrs["x_pos"] = {d.name: i for i, d in enumerate(x.shape)}
        return [(w, x.dtype)]

    def compute(self, ctx, attrs, x, dy):
        return weight_grad_valid(attrs, pad_spatial(attrs, x, attrs["x_pos"]), dy)


# ----------------------------------------------------------------------------- public API


def _padding(spec, k: int, d: str) -> tuple[int, int]:
    if isinstance(spec, str):
        if spec not in PADDINGS:
            raise ShapeError(message(f"conv: padding {spec!r} for '{d}' is not one of {list(PADDINGS)}.",
                                     rule="padding is 'same', 'valid', 'causal' or (before, after)",
                                     fix="pass padding='same' (output as long as the input)"))
        before = {"same": (k - 1) // 2, "valid": 0, "causal": k - 1}[spec]
        return before, {"same": k - 1 - before, "valid": 0, "causal": 0}[spec]
    ok = isinstance(spec, (tuple, list)) and len(spec) == 2 and all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= k - 1 for v in spec)
    if not ok:
        raise ShapeError(message(f"conv: padding {spec!r} for '{d}' (taps: {k}) is not a pair of ints in 0..{k - 1}.",
                                 rule="explicit padding is (before, after) zeros, each at most taps - 1",
                                 fix="pass e.g. (1, 1), or 'same' / 'valid' / 'causal'"))
    return int(spec[0]), int(spec[1])


def conv(x: Tensor, w: Tensor, taps: dict, padding="same", stride=1) -> Tensor:
    """Convolve ``x`` with ``w`` along named spatial dims (cross-correlation, as torch's).

    Args:
      x: ``[batch..., spatial..., c_in]`` in any order; every dim that is neither spatial nor
        shared with ``w`` is a batch dim.
      w: ``[tap..., c_in, c_out]`` in any order: one tap dim per spatial dim, the channel dim
        it shares with ``x`` (summed), and the output channel dim, which ``x`` lacks. A
        depthwise conv (one filter per channel, ConvNeXt's, a Conformer's) has ``w [tap...,
        c_in]``: no output channel dim, ``c_in`` not summed but kept (or several dims of ``x``,
        ``w [tap, experts, c_in]``: one filter per expert and channel).
      taps: spatial dim of ``x`` -> its tap dim of ``w``: ``{"seq": "tap"}``, or
        ``{"height": "kh", "width": "kw"}`` for two.
      padding: ``"same"`` (the output as long as the input; ``(taps - 1) // 2`` zeros before),
        ``"valid"`` (none: ``n - taps + 1`` positions), ``"causal"`` (``taps - 1`` before:
        position i sees i - taps + 1 .. i), a pair ``(before, after)`` of at most ``taps - 1``
        each, or a dict spatial dim -> one of these.
      stride: a positive int, or a dict spatial dim -> int (1 for a dim it leaves out). A
        strided conv is built from stride-1 ones: ``x`` (padded) is cut into its ``stride``
        phases by a rearrange, ``(seq phase)``, and each phase is convolved ('valid') with its
        taps ``w[phase::stride]``; the sum has ``(n + before + after - taps) // stride + 1``
        positions, as torch's (a Whisper stem's kernel 3, stride 2, padding (1, 1)). Under a
        split spatial dim the phases stay split and trade halos, as a stride-1 conv does.

    Returns:
      ``x``'s dims in ``x``'s order, ``c_out`` in ``c_in``'s place:
      ``out[.., i, co] = sum over t, ci of x[.., stride * i + t - before, ci] * w[t, ci, co]``
      (zero outside ``x``); depthwise, ``out[.., i, c] = sum over t of x[.., stride * i + t -
      before, c] * w[t, c]``, built as the sum over the taps of ``md.shift``-ed copies of ``x``
      (``pad`` and ``slice_`` where the output is shorter) times that tap's filter, so a split
      spatial dim trades one halo per tap.

    Raises:
      ShapeError: a spatial or tap dim that is missing, more than two spatial dims, channel
        dims that are not exactly one shared and one new, mismatched dtypes, bad padding.

    Layouts split ``batch`` and ``c_out`` with no communication, ``c_in`` with a partial sum
    (as an einsum), and a spatial dim (``"seq:data"``) by a halo exchange: each rank trades
    ``taps - 1`` rows with its neighbours, forward and backward.

    Example::

        y = md.conv(x, w, {"seq": "tap"}, padding="same")   # x [batch, seq, c_in], w [tap, c_in, c_out]
    """
    what = f"conv(x {x.shape}, w {w.shape}, taps={taps!r})"
    shared, new = _channels(x, w, taps, padding, what)
    spatial = []
    for d in (n for n in x.shape.names if n in taps):
        k = w.shape.get(taps[d]).size
        before, after = _padding(padding.get(d, "same") if isinstance(padding, dict) else padding, k, d)
        if x.shape.get(d).size + before + after < k:
            raise ShapeError(message(f"{what}: '{d}' of size {x.shape.get(d).size} is shorter than its {k} taps.",
                                     rule="a conv's output holds n + before + after - taps + 1 >= 1 positions",
                                     fix="pad more, or use fewer taps"))
        spatial.append((d, taps[d], k, before, after))
    strides = _strides(stride, [d for d, *_ in spatial], what)
    if any(v > 1 for v in strides.values()):
        return _strided(x, w, spatial, strides)
    if not new:
        return _depthwise(x, w, spatial)
    return apply("conv", [x, w], {"spatial": tuple(spatial), "in_dim": shared[0], "out_dim": new[0],
                                  "flip": False})


def _depthwise(x: Tensor, w: Tensor, spatial: list) -> Tensor:
    """A depthwise stride-1 conv (``w [tap..., c]``, see :func:`conv`): per tap (a product of
    taps over two spatial dims), ``x`` moved to the tap's offset times the tap's filter, summed.
    Where the output is as long as ``x`` the move is a ``shift`` (zeros come in where the
    padding is), else ``x`` padded and sliced."""
    from .elementwise import add, mul
    from .scan import squeeze
    from .slicing import pad, shift, slice_

    out = None
    for offsets in itertools.product(*(range(k) for _, _, k, _, _ in spatial)):
        term, wt = x, w
        for (d, tap, k, before, after), t in zip(spatial, offsets):
            wt = squeeze(slice_(wt, tap, t, t + 1), tap)
            if before + after == k - 1:        # y[i] = x[i + t - before]
                term = shift(term, d, before - t) if t != before else term
            else:
                n_out = x.shape.get(d).size + before + after - k + 1
                term = slice_(pad(term, d, before, after), d, t, t + n_out)
        term = mul(term, wt)
        out = term if out is None else add(out, term)
    return out


def _channels(x: Tensor, w: Tensor, taps, padding, what: str) -> tuple[list[str], list[str]]:
    """The channel dims of ``w`` that ``x`` has (c_in) and lacks (c_out, none for a depthwise
    conv), after checking the call (see :func:`conv`'s Raises)."""
    if not isinstance(taps, dict) or not 1 <= len(taps) <= len(_CONV):
        raise ShapeError(message(f"{what}: taps must map one or two spatial dims of x to tap dims of w.",
                                 rule="taps is a dict spatial dim -> tap dim", fix="pass e.g. {'seq': 'tap'}"))
    bad = [f"spatial dim '{d}' is not a dim of x" for d in taps if d not in x.shape]
    bad += [f"tap dim '{t}' is not a dim of w" for t in taps.values() if t not in w.shape]
    bad += [f"tap dim '{t}' is also a dim of x" for t in taps.values() if t in x.shape]
    channels = [d for d in w.shape.names if d not in taps.values()]
    shared, new = [d for d in channels if d in x.shape], [d for d in channels if d not in x.shape]
    if not bad and not (len(shared), len(new)) == (1, 1) and not (shared and not new):
        bad.append(f"w's dims besides the taps, {channels}, are not one channel dim x has (c_in) and one it "
                   f"lacks (c_out), or only dims x has (a depthwise conv)")
    bad += [f"'{d}' is a spatial dim of x, not a channel dim" for d in shared if not bad and d in taps]
    bad += [f"'{d}' has size {x.shape.get(d).size} in x and {w.shape.get(d).size} in w"
            for d in shared if not bad and x.shape.get(d).size != w.shape.get(d).size]
    if isinstance(padding, dict):
        bad += [f"padding names '{d}', which is not a spatial dim" for d in padding if d not in taps]
    if x.dtype != w.dtype:
        bad.append(f"x is {x.dtype} and w is {w.dtype}")
    if bad:
        raise ShapeError(message(f"{what}: cannot convolve.", bullets=bad,
                                 rule="w holds one tap dim per spatial dim of x, the channel dim of x it sums "
                                      "(c_in) and one output channel dim (c_out), or for a depthwise conv only "
                                      "the channel dim of x; x and w share a dtype",
                                 fix="e.g. x [batch, seq, c_in], w [tap, c_in, c_out] and taps={'seq': 'tap'}; "
                                     "depthwise: w [tap, c_in]"))
    return shared, new


def _strides(stride, dims: list[str], what: str) -> dict[str, int]:
    """``stride`` (an int, or a dict spatial dim -> int) as spatial dim -> stride."""
    given = stride if isinstance(stride, dict) else {d: stride for d in dims}
    bad = [f"stride names '{d}', which is not a spatial dim" for d in given if d not in dims]
    bad += [f"stride {v!r} for '{d}' is not a positive int" for d, v in given.items()
            if not isinstance(v, int) or isinstance(v, bool) or v < 1]
    if bad:
        raise ShapeError(message(f"{what}: bad stride {stride!r}.", bullets=bad,
                                 rule="stride is a positive int, or a dict spatial dim -> positive int",
                                 fix="pass e.g. stride=2 or stride={'seq': 2}"))
    return {d: given.get(d, 1) for d in dims}


def _strided(x: Tensor, w: Tensor, spatial: list, strides: dict[str, int]) -> Tensor:
    """A strided conv as a sum of stride-1 convs over the input's phases (see :func:`conv`).

    Along a dim of stride ``S`` (taps ``K``, padding ``before``/``after``, ``L`` outputs), tap
    ``t`` reads ``x[S i + t - before]``: phase ``p = (t - before) mod S`` of ``x`` (its positions
    ``S m + p``) at ``m = i + (t - before) // S``. The taps of one phase are every ``S``-th tap,
    with consecutive offsets, so each phase is a stride-1 conv with its own padding."""
    from .elementwise import add
    from .scan import squeeze
    from .shape_ops import rearrange
    from .slicing import pad, slice_

    def cut(t: Tensor, dim: str, parts: int, name: str) -> Tensor:
        """``t``'s ``dim`` of ``m * parts`` as ``dim`` (m) and ``name`` (parts), the latter inner."""
        left = " ".join(f"({n} {name})" if n == dim else n for n in t.shape.names)
        right = " ".join(f"{n} {name}" if n == dim else n for n in t.shape.names)
        return rearrange(t, f"{left} -> {right}", **{name: parts})

    def pick(t: Tensor, name: str, p: int) -> Tensor:
        return squeeze(slice_(t, name, p, p + 1), name)

    plans, cuts = [], []   # per dim: [(x phase, w phase, taps, before, after)], and the cut dims
    for d, tap, k, before, after in spatial:
        st, n = strides[d], x.shape.get(d).size
        out_len = (n + before + after - k) // st + 1
        if st == 1:
            plans.append([(None, None, k, before, after)])
            continue
        if n % st:     # zeros past the end: read only where the padding after is zero too
            x = pad(x, d, 0, st - n % st)
        if k % st:
            w = pad(w, tap, 0, st - k % st)
        x, w = cut(x, d, st, f"{d}_phase"), cut(w, tap, st, f"{tap}_phase")
        cuts.append((d, tap))
        m, options = x.shape.get(d).size, []
        for r in range(min(st, k)):   # the taps r, r + S, ...: phase (r - before) mod S, offsets from (r - before) // S
            n_taps = -(-(k - r) // st)
            first = -((r - before) // st)
            options.append(((r - before) % st, r, n_taps, first, out_len - 1 - m + n_taps - first))
        plans.append(options)
    out = None
    for choice in itertools.product(*plans):
        xp, wp, pads, trims = x, w, {}, {}
        for (d, tap, *_), opt in zip(spatial, choice):
            if opt[0] is None:
                pads[d] = opt[3:]
                continue
            phase, r, n_taps, first, last = opt
            xp, wp = pick(xp, f"{d}_phase", phase), slice_(pick(wp, f"{tap}_phase", r), tap, 0, n_taps)
            if first <= n_taps - 1 and 0 <= last <= n_taps - 1:
                pads[d] = (first, last)
            else:      # more zeros than a conv pads, or positions past the outputs: pad, then trim
                xp = pad(xp, d, first, max(0, last))
                pads[d], trims[d] = (0, 0), xp.shape.get(d).size - n_taps + 1 - max(0, -last)
        y = conv(xp, wp, {d: tap for d, tap, *_ in spatial}, padding=pads)
        for d, keep in trims.items():
            y = slice_(y, d, 0, keep) if keep < y.shape.get(d).size else y
        out = y if out is None else add(out, y)
    return out


__all__ = ["conv"]
