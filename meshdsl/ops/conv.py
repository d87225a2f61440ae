"""Convolution along named dims: ``conv`` (stride 1 as one op; a strided one as stride-1 convs
over the input's phases) and its fused weight gradient.

``conv(x, w, {"seq": "tap"})`` slides ``w [tap, c_in, c_out]`` along ``seq`` of
``x [batch, seq, c_in]`` (cross-correlation, as torch's ``conv1d``), with one tap dim per
spatial dim (one or two of them).  The channel dim x and w share is summed; w's other
dims (one or several output channel dims, a ConvLSTM's ``[gate, hid]``) take its place in the
output, in w's order.  Padding is per spatial dim, ``(before, after)``
zeros, each at most ``taps - 1``.

Gradients: the input's is a conv of the output's gradient with the taps mirrored (the
``flip`` attribute) and the padding mirrored too (``taps - 1 - before``); the weight's is
:class:`ConvWeightGrad`, one torch kernel that has no gradient itself (as attention's
backward).  In a repeat's block the weight's gradient is built as that of the input
gradient's conv (input dy, output gradient x: the same sums), so a split spatial dim reads
the halo of dy the input gradient trades, not a second halo of x (outside a block the
forward's halo of x is reused).  Lowering: :mod:`meshdsl.lowering.conv` (batch and output
channels split freely, a split input channel dim leaves a partial sum, a split spatial dim
trades a halo with its neighbours).

Per-sample (or per-group) weights: ``w`` may hold dims of ``x`` besides c_in (the ``per``
attribute), one filter per entry; the input's gradient is the mirrored conv with the same
``per``, the weight's keeps those dims (not summed, nor a partial sum when they are split).

Kernel layout: x is viewed as ``(N, G, c_in, spatial...)`` with every batch dim folded into
N and the per dims into G (1 without them), w as ``(G, c_out, c_in, taps...)``, several output
(a gradient's input) channel dims folded into one c_out (c_in) and unfolded after: views; torch's
convolution takes G as its ``groups`` (x as ``(N, G * c_in, ...)``); the result is permuted
back to the output's dim order.
Below :data:`SMALL_MACS` multiply-adds the kernels run as one einsum over x's unfolded
windows (im2col) instead of torch's convolution, whose oneDNN call costs a fixed ~60 us on
one thread and milliseconds when its threads contend for cores (measured on the 2-core
test machine: (2, 16, 64) x 5 taps, 89 us against 42 us on one thread).  Per-sample weights
(StyleGAN's 3x3, one thread, 2026-11-28, the same machine under load) cross over at about the same
size: batch 4, 6 channels, 6x6: grouped 47 us, unfolded 26 us; batch 8, 16 channels, 16x16 (4.7M):
128 against 179 us; batch 16, 64 channels, 32x32: 18 against 53 ms.
"""
from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from ..core.graph import Tensor
from ..core.shape import Dim, Shape
from ..errors import ShapeError, message
from .arguments import per_dim_ints
from .registry import ComputeSpec, Op, apply, register

_CONV = {1: F.conv1d, 2: F.conv2d}
_WEIGHT_GRAD = {1: torch.nn.grad.conv1d_weight, 2: torch.nn.grad.conv2d_weight}
#: (unfolded x, w) -> y and (unfolded x, dy) -> dw, per count of spatial dims (g: the per dims' entries,
#: a, b: positions; i, j: taps)
_UNFOLDED = {1: ("ngcai,goci->ngoa", "ngcai,ngoa->goci"),
             2: ("ngcabij,gocij->ngoab", "ngcabij,ngoab->gocij")}
#: multiply-adds below which the kernels run as an einsum over unfolded windows (see the module docstring)
SMALL_MACS = 1 << 22
PADDINGS = ("same", "valid", "causal")


def _y_names(x_names, in_dims, out_dims) -> tuple[str, ...]:
    """The output's dims: ``x``'s, the summed ``in_dims`` taken out and ``out_dims`` put in the first
    one's place (a conv's gradient sums its output dims, which sit together, and gives back ``x``'s order)."""
    at = min(x_names.index(d) for d in in_dims)
    kept = [d for d in x_names if d not in in_dims]
    head = sum(1 for d in x_names[:at] if d not in in_dims)
    return tuple(kept[:head]) + tuple(out_dims) + tuple(kept[head:])


def _layout(x: Shape, w: Shape, attrs: dict) -> None:
    """Put the kernel's permutations in ``attrs`` (see the module docstring)."""
    spatial = [d for d, *_ in attrs["spatial"]]
    c_in, c_out, per = list(attrs["in_dims"]), list(attrs["out_dims"]), list(attrs.get("per", ()))
    batch = [d for d in x.names if d not in c_in and d not in spatial and d not in per]
    names = _y_names(x.names, c_in, c_out)
    std_x, std_y = batch + per + c_in + spatial, batch + per + c_out + spatial
    std_w = per + c_out + c_in + [tap for _, tap, *_ in attrs["spatial"]]
    attrs["num_batch"], attrs["num_per"] = len(batch), len(per)
    attrs["num_in"], attrs["num_out"] = len(c_in), len(c_out)
    attrs["x_perm"] = tuple(x.names.index(d) for d in std_x)
    attrs["y_perm"] = tuple(std_y.index(d) for d in names)          # kernel order -> output order
    attrs["y_std"] = tuple(names.index(d) for d in std_y)           # output order -> kernel order
    attrs["w_perm"] = tuple(w.names.index(d) for d in std_w)
    attrs["w_back"] = tuple(std_w.index(d) for d in w.names)


def _std(t, perm, attrs, num_c: int):
    """``t`` permuted by ``perm`` and viewed as (N, G, C, spatial...): its leading batch dims
    folded into N, the per dims into G (1 where there are none), its ``num_c`` channel dims into
    C; and the sizes of the batch and per dims and of the channel dims."""
    t = t.permute(perm)
    nb, npr = attrs["num_batch"], attrs.get("num_per", 0)
    lead, chans = tuple(t.shape[:nb + npr]), tuple(t.shape[nb + npr:nb + npr + num_c])
    return t.reshape((-1, math.prod(t.shape[nb:nb + npr]), math.prod(chans))
                     + tuple(t.shape[nb + npr + num_c:])), lead, chans


def _kernel_weight(w, attrs):
    """``w`` as (G, c_out, c_in, taps...), each of c_out and c_in its channel dims folded, mirrored
    where ``flip`` says; and the sizes of its output channel dims."""
    ws = w.permute(attrs["w_perm"])
    npr, nout, nin = attrs.get("num_per", 0), attrs["num_out"], attrs["num_in"]
    outs = tuple(ws.shape[npr:npr + nout])
    ws = ws.reshape((-1, math.prod(outs), math.prod(ws.shape[npr + nout:npr + nout + nin]))
                    + tuple(ws.shape[npr + nout + nin:]))
    return (ws.flip(tuple(range(3, ws.dim()))) if attrs["flip"] else ws), outs


def dilations(attrs: dict) -> tuple[int, ...]:
    """Each spatial dim's dilation (the distance between its taps; 1 where none was given)."""
    return attrs.get("dilation") or (1,) * len(attrs["spatial"])


def span(k: int, dilation: int) -> int:
    """The positions ``k`` taps ``dilation`` apart cover: ``dilation * (k - 1) + 1``."""
    return dilation * (k - 1) + 1


def _unfolded(xs, taps, dils):
    """``xs`` (N, G, C, spatial...) -> (N, G, C, out positions..., taps...): every window, as views."""
    for i, (k, dl) in enumerate(zip(taps, dils)):
        xs = xs.unfold(3 + i, span(k, dl), 1)
    if any(dl > 1 for dl in dils):
        xs = xs[(...,) + tuple(slice(None, None, dl) for dl in dils)]
    return xs


def _small(xs, taps, dils, out_channels: int) -> bool:
    n = math.prod(xs.shape[:3]) * out_channels
    for i, (k, dl) in enumerate(zip(taps, dils)):
        n *= k * (xs.shape[3 + i] - span(k, dl) + 1)
    return n < SMALL_MACS


def _grouped(t):
    """(N, G, C, spatial...) as torch's grouped layout (N, G * C, spatial...)."""
    return t.reshape((t.shape[0], -1) + tuple(t.shape[3:]))


def conv_valid(attrs: dict, x, w):
    """The conv of ``x`` (already padded: every spatial dim holds ``out + taps - 1`` positions).
    Per dims (per-sample weights) are torch's groups: x's (N, G * c_in), w's (G * c_out, c_in);
    several output (input) channel dims are one c_out (c_in), unflattened after: views."""
    xs, lead, _ = _std(x, attrs["x_perm"], attrs, attrs["num_in"])
    ws, outs = _kernel_weight(w, attrs)
    taps, dils = tuple(ws.shape[3:]), dilations(attrs)
    num_g, c_out = ws.shape[0], ws.shape[1]
    if _small(xs, taps, dils, c_out):
        y = torch.einsum(_UNFOLDED[len(taps)][0], _unfolded(xs, taps, dils), ws)
    else:
        y = _CONV[len(taps)](_grouped(xs), ws.reshape((-1,) + tuple(ws.shape[2:])), dilation=dils, groups=num_g)
        y = y.reshape((y.shape[0], num_g, c_out) + tuple(y.shape[2:]))
    y = y.reshape(lead + outs + tuple(y.shape[3:])).permute(attrs["y_perm"])
    return y if y.is_contiguous() else y.contiguous()


def weight_grad_valid(attrs: dict, x, dy):
    """The gradient of ``conv_valid(attrs, x, w)`` w.r.t. ``w``, given the output's gradient ``dy``."""
    xs, lead, ins = _std(x, attrs["x_perm"], attrs, attrs["num_in"])
    ds, _, outs = _std(dy, attrs["y_std"], attrs, attrs["num_out"])
    taps, dils = tuple(k for _, _, k, _, _ in attrs["spatial"]), dilations(attrs)
    num_g, c_out, c_in = ds.shape[1], ds.shape[2], xs.shape[2]
    if _small(xs, taps, dils, c_out):
        dw = torch.einsum(_UNFOLDED[len(taps)][1], _unfolded(xs, taps, dils), ds)
    else:
        dw = _WEIGHT_GRAD[len(taps)](_grouped(xs), (num_g * c_out, c_in) + taps, _grouped(ds), dilation=dils,
                                     groups=num_g)
        dw = dw.reshape((num_g, c_out, c_in) + taps)
    if attrs["flip"]:
        dw = dw.flip(tuple(range(3, dw.dim())))
    dw = dw.reshape(lead[attrs["num_batch"]:] + outs + ins + taps)
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
        # and tap dims whole, the input channels summed.
        dims = {d.name: d.size for t in node.inputs for d in t.shape}
        fixed = {d for d, *_ in node.attrs["spatial"]} | {tap for _, tap, *_ in node.attrs["spatial"]}
        return ComputeSpec(dims, fixed=frozenset(fixed), reduce={d: "sum" for d in node.attrs["in_dims"]})

    def flops(self, node, local):
        """Two per multiply-add: every output position (of conv's output, or of the output
        gradient the weight gradient reads) meets every tap of every input channel."""
        a = node.attrs
        positions = node.outputs[0] if self.name == "conv" else node.inputs[1]
        n = 2
        for d in a["in_dims"]:
            n *= local.get(d, node.inputs[0].shape.get(d).size)
        for d in positions.shape:
            n *= local.get(d.name, d.size)
        for *_, k, _, _ in a["spatial"]:
            n *= k
        return n


@register
class Conv(_ConvBase):
    """``conv``: attrs ``spatial`` ((dim, tap, taps, before, after), ...), ``in_dims`` (the channel dims
    of x it sums: one, or a gradient's several), ``out_dims`` (w's channel dims x lacks, in w's
    order, in the output where the first of ``in_dims`` was), ``flip``, ``dilation`` (one per
    spatial dim; absent: all 1) and ``per`` (dims of x that w holds too, one filter per entry;
    absent: none)."""

    name = "conv"
    linear_args = (0, 1)

    def infer(self, inputs, attrs):
        x, w = inputs
        sizes = {d: x.shape.get(d).size + b + a - span(k, dl) + 1
                 for (d, _, k, b, a), dl in zip(attrs["spatial"], dilations(attrs))}
        out = Shape(w.shape.get(d) if d in attrs["out_dims"] else Dim(d, sizes.get(d, x.shape.get(d).size))
                    for d in _y_names(x.shape.names, attrs["in_dims"], attrs["out_dims"]))
        _layout(x.shape, w.shape, attrs)
        attrs["x_pos"] = {d.name: i for i, d in enumerate(x.shape)}
        return [(out, x.dtype)]

    def compute(self, ctx, attrs, x, w):
        return conv_valid(attrs, pad_spatial(attrs, x, attrs["x_pos"]), w)

    def grad(self, node, douts):
        (dy,), (x, w), a = douts, node.inputs, node.attrs
        # dilated taps mirror over their span: padding span - 1 - before (after)
        dil = {k: a[k] for k in ("dilation", "per") if k in a}
        mirrored = tuple((d, tap, k, span(k, dl) - 1 - b, span(k, dl) - 1 - af)
                         for (d, tap, k, b, af), dl in zip(a["spatial"], dilations(a)))
        dx = apply("conv", [dy, w], {"spatial": mirrored, "in_dims": a["out_dims"], "out_dims": a["in_dims"],
                                     "flip": not a["flip"], **dil})
        if node.graph.outer is None:
            dw = apply("conv_weight_grad", [x, dy], {**{k: a[k] for k in ("spatial", "in_dims", "out_dims", "flip")},
                                                     "w_names": w.shape.names, **dil})
        else:
            # In a repeat's block the forward's halo of x is in the forward's sub-plan: the same
            # dw is the weight gradient of dx's conv (its input dy, its output's gradient x), which
            # reads dy's halo, the one dx trades (lowering/halo.py shares it), not x's again.
            dw = apply("conv_weight_grad", [dy, x], {"spatial": mirrored, "in_dims": a["out_dims"],
                                                     "out_dims": a["in_dims"], "flip": not a["flip"],
                                                     "w_names": w.shape.names, **dil})
        return [dx, dw]


@register
class ConvWeightGrad(_ConvBase):
    """The gradient of ``conv`` w.r.t. its weight: inputs (x, the output's gradient), conv's attrs."""

    name = "conv_weight_grad"
    linear_args = (0, 1)

    def infer(self, inputs, attrs):
        x, dy = inputs
        w = Shape([x.shape.get(d) for d in attrs.get("per", ())]
                  + [dy.shape.get(d) for d in attrs["out_dims"]] + [x.shape.get(d) for d in attrs["in_dims"]]
                  + [Dim(tap, k) for _, tap, k, _, _ in attrs["spatial"]])
        w = Shape(w.get(n) for n in attrs.setdefault("w_names", w.names))
        _layout(x.shape, w, attrs)
        attrs["x_pos"] = {d.name: i for i, d in enumerate(x.shape)}
        return [(w, x.dtype)]

    def compute(self, ctx, attrs, x, dy):
        return weight_grad_valid(attrs, pad_spatial(attrs, x, attrs["x_pos"]), dy)


# ----------------------------------------------------------------------------- public API


def _padding(spec, k: int, d: str) -> tuple[int, int]:
    """``spec`` as (before, after) for ``k`` positions (taps, or a dilated conv's span)."""
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
        raise ShapeError(message(f"conv: padding {spec!r} for '{d}' (span: {k}) is not a pair of ints in 0..{k - 1}.",
                                 rule="explicit padding is (before, after) zeros, each at most span - 1 "
                                      "(span = dilation * (taps - 1) + 1: taps - 1 undilated)",
                                 fix="pass e.g. (1, 1), or 'same' / 'valid' / 'causal'"))
    return int(spec[0]), int(spec[1])


def conv(x: Tensor, w: Tensor, taps: dict, padding="same", stride=1, dilation=1, per=()) -> Tensor:
    """Convolve ``x`` with ``w`` along named spatial dims (cross-correlation, as torch's).

    Args:
      x: ``[batch..., spatial..., c_in]`` in any order; every dim that is neither spatial nor
        shared with ``w`` is a batch dim.
      w: ``[tap..., c_in, c_out...]`` in any order: one tap dim per spatial dim, the channel dim
        it shares with ``x`` (summed), and the output channel dims, every other dim of ``w`` (those
        ``x`` lacks): one, or several, as a ConvLSTM's four gates ``w [kh, kw, c_in, gate, hid]``,
        where ``hid:model`` splits each gate's ``hid`` alike (no flat ``gate * hid`` to slice). A
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
      dilation: a positive int, or a dict spatial dim -> int (1 for a dim it leaves out): the
        distance between taps (torch's ``dilation``; a TCN's or WaveNet's 1, 2, 4, ...). The taps
        then cover ``span = dilation * (taps - 1) + 1`` positions, and ``span`` takes the place of
        ``taps`` in the padding rules above ('same': ``(span - 1) // 2`` before, as torch's;
        'causal': ``span - 1``; a pair: at most ``span - 1`` each) and in the output's length.
        With a stride, each phase's taps are a stride-1 conv dilated ``dilation / gcd(dilation,
        stride)``. A split spatial dim trades ``span - 1`` rows in all with its neighbours.
      per: a dim of ``x`` (or a list of them) that ``w`` holds too, besides c_in: one filter per
        entry (per-sample weights, StyleGAN2's modulated conv: ``w [batch, kh, kw, c_in, c_out]``
        and ``per="batch"``; per-group weights: ``per="groups"``). Needed where ``w`` shares more
        than one dim with ``x`` and has a c_out; the gradient of ``w`` keeps these dims.

    Returns:
      ``x``'s dims in ``x``'s order, the output channel dims (in ``w``'s order) in ``c_in``'s place
      (one ``c_out`` shown; several are indexed together as one):
      ``out[.., i, co] = sum over t, ci of x[.., stride * i + dilation * t - before, ci] * w[t, ci,
      co]`` (zero outside ``x``; with ``per``, ``w[p, t, ci, co]`` for ``x``'s entry p); depthwise, ``out[.., i, c] = sum over t of x[.., stride * i +
      dilation * t - before, c] * w[t, c]``, built as the sum over the taps of ``md.shift``-ed copies of ``x``
      (``pad`` and ``slice_`` where the output is shorter) times that tap's filter, so a split
      spatial dim trades one halo per tap.

    Raises:
      ShapeError: a spatial or tap dim that is missing, more than two spatial dims, channel
        dims that are not exactly one shared and one or more new (besides ``per``'s), several
        shared without ``per`` (one of another size than ``x``'s: an output dim named as a dim of
        ``x``, to rename), a ``per`` dim missing from ``x`` or ``w``, mismatched dtypes, bad padding.

    Layouts split ``batch`` (a ``per`` dim too: ``w`` is cut as ``x`` is) and any output channel dims
    (``"hid:model"``, ``"gate:data; hid:model"``, evenly or not) with no communication in the forward
    (the input's gradient sums over them: a partial sum), ``c_in`` with a partial sum
    (as an einsum), and a spatial dim (``"seq:data"``) by a halo exchange: each rank trades
    ``span - 1`` rows (``taps - 1`` undilated) with its neighbours, forward and backward.

    Example::

        y = md.conv(x, w, {"seq": "tap"}, padding="same")   # x [batch, seq, c_in], w [tap, c_in, c_out]
        z = md.conv(x, w, {"seq": "tap"}, padding="causal", dilation=4)   # taps at i - 8, i - 4, i
        s = md.conv(img, w_bhwco, {"height": "kh", "width": "kw"}, per="batch")  # w [batch, kh, kw, c_in, c_out]
        g = md.conv(img, w_gates, {"height": "kh", "width": "kw"})   # w [kh, kw, c_in, gate, hid]: g [.., gate, hid]
    """
    what = f"conv(x {x.shape}, w {w.shape}, taps={taps!r})"
    summed, new, per = _channels(x, w, taps, padding, per, what)
    dims = [n for n in x.shape.names if n in taps]
    strides = per_dim_ints(stride, dims, what, "stride")
    dils = per_dim_ints(dilation, dims, what, "dilation")
    spatial = [_spatial_dim(x, w, d, taps[d], padding, dils[d], what) for d in dims]
    if any(v > 1 for v in strides.values()):
        return _strided(x, w, spatial, strides, dils, per)
    if not new:
        return _depthwise(x, w, spatial, dils)
    dil = {"dilation": tuple(dils[d] for d in dims)} if any(v > 1 for v in dils.values()) else {}
    dil.update({"per": per} if per else {})
    return apply("conv", [x, w], {"spatial": tuple(spatial), "in_dims": tuple(summed), "out_dims": tuple(new),
                                  "flip": False, **dil})


def _spatial_dim(x: Tensor, w: Tensor, d: str, tap: str, padding, dilation: int, what: str) -> tuple:
    """Spatial dim ``d``'s (dim, tap, taps, before, after), after checking that its output is not empty."""
    k = w.shape.get(tap).size
    wide = span(k, dilation)
    before, after = _padding(padding.get(d, "same") if isinstance(padding, dict) else padding, wide, d)
    if x.shape.get(d).size + before + after < wide:
        raise ShapeError(message(f"{what}: '{d}' of size {x.shape.get(d).size} is shorter than its {k} taps"
                                 + (f" dilated {dilation} (a span of {wide})" if dilation > 1 else "") + ".",
                                 rule="a conv's output holds n + before + after - span + 1 >= 1 positions "
                                      "(span = dilation * (taps - 1) + 1)",
                                 fix="pad more, or use fewer taps or a smaller dilation"))
    return d, tap, k, before, after


def _depthwise(x: Tensor, w: Tensor, spatial: list, dils: dict[str, int]) -> Tensor:
    """A depthwise stride-1 conv (``w [tap..., c]``, see :func:`conv`): per tap (a product of
    taps over two spatial dims), ``x`` moved to the tap's offset (``dilation * t``) times the
    tap's filter, summed.
    Where the output is as long as ``x`` the move is a ``shift`` (zeros come in where the
    padding is), else ``x`` padded and sliced."""
    from .elementwise import add, mul
    from .scan import squeeze
    from .slicing import pad, shift, slice_

    out = None
    for offsets in itertools.product(*(range(k) for _, _, k, _, _ in spatial)):
        term, wt = x, w
        for (d, tap, k, before, after), t in zip(spatial, offsets):
            wt, at = squeeze(slice_(wt, tap, t, t + 1), tap), dils[d] * t
            if before + after == span(k, dils[d]) - 1:        # y[i] = x[i + at - before]
                term = shift(term, d, before - at) if at != before else term
            else:
                n_out = x.shape.get(d).size + before + after - span(k, dils[d]) + 1
                term = slice_(pad(term, d, before, after), d, at, at + n_out)
        term = mul(term, wt)
        out = term if out is None else add(out, term)
    return out


def _channels(x: Tensor, w: Tensor, taps, padding, per, what: str) -> tuple[list[str], list[str], tuple[str, ...]]:
    """The channel dims of ``w`` that ``x`` has and ``w`` sums (c_in; for a depthwise conv all
    those ``x`` has), those ``x`` lacks (c_out, none for a depthwise conv) and the per dims, after
    checking the call (see :func:`conv`'s Raises)."""
    if not isinstance(taps, dict) or not 1 <= len(taps) <= len(_CONV):
        raise ShapeError(message(f"{what}: taps must map one or two spatial dims of x to tap dims of w.",
                                 rule="taps is a dict spatial dim -> tap dim", fix="pass e.g. {'seq': 'tap'}"))
    per = (per,) if isinstance(per, str) else per
    bad = [f"spatial dim '{d}' is not a dim of x" for d in taps if d not in x.shape]
    bad += [f"tap dim '{t}' is not a dim of w" for t in taps.values() if t not in w.shape]
    bad += [f"tap dim '{t}' is also a dim of x" for t in taps.values() if t in x.shape]
    bad += _per_errors(x, w, taps, per)
    per = tuple(per) if isinstance(per, (tuple, list)) and all(isinstance(d, str) for d in per) else ()
    channels = [d for d in w.shape.names if d not in taps.values()]
    shared, new = [d for d in channels if d in x.shape], [d for d in channels if d not in x.shape]
    summed = [d for d in shared if d not in per] if new else shared
    if not bad and new and len(summed) > 1:
        _output_named_as_x(x, w, summed, what)
        _ambiguous(x, summed, what)
    if not bad and not (len(summed) == 1 and new) and not (shared and not new):
        bad.append(f"w's dims besides the taps, {channels}, are not one channel dim x has (c_in) and output "
                   f"channel dims it lacks (c_out), or only dims x has (a depthwise conv)")
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
                                      "(c_in) and one or more output channel dims x lacks (c_out; several, as "
                                      "[gate, hid], are all the output's), or for a depthwise conv only "
                                      "the channel dim of x; per-sample or per-group weights also hold the dims "
                                      "of x named by per=; x and w share a dtype",
                                 fix="e.g. x [batch, seq, c_in], w [tap, c_in, c_out] and taps={'seq': 'tap'}; "
                                     "depthwise: w [tap, c_in]; per-sample: w [batch, tap, c_in, c_out] and "
                                     "per='batch'"))
    return summed, new, tuple(d for d in x.shape.names if d in per)


def _per_errors(x: Tensor, w: Tensor, taps: dict, per) -> list[str]:
    """Bullets for a bad ``per`` (dims of x that w holds too: one filter per entry)."""
    if not isinstance(per, (tuple, list)) or not all(isinstance(d, str) for d in per):
        return [f"per={per!r} is not a dim name or a list of them"]
    bad = [f"per names '{d}', which is not a dim of x" for d in per if d not in x.shape]
    bad += [f"per names '{d}', which is not a dim of w" for d in per if d in x.shape and d not in w.shape]
    return bad + [f"per names '{d}', a spatial dim" for d in per if d in taps]


def _output_named_as_x(x: Tensor, w: Tensor, summed: list[str], what: str) -> None:
    """Raise where a dim of w that x has too differs in size and another of them can be c_in: most
    likely an output channel dim named as a dim of x (a ConvLSTM's ``hid`` read from ``h [.., hid]``)."""
    resized = [d for d in summed if x.shape.get(d).size != w.shape.get(d).size]
    if not resized or len(resized) == len(summed):
        return
    d = resized[0]
    raise ShapeError(message(
        f"{what}: w shares {summed} with x besides the taps, and the size of {resized} differs between them.",
        bullets=[f"'{n}' has size {x.shape.get(n).size} in x and {w.shape.get(n).size} in w" for n in resized],
        rule="a dim of w that x also has is summed (c_in) or a per= dim, of one size in both; output channel "
             "dims are the dims of w that x lacks",
        fix=f"if '{d}' is an output channel dim, name it apart from x's: md.rename(w, {d}='{d}_out') "
            f"(or rename x's '{d}', e.g. a hidden state's input channel)"))


def _ambiguous(x: Tensor, summed: list[str], what: str):
    """Raise: w shares several dims with x besides the per dims, and only one can be c_in."""
    c_in = max(summed, key=x.shape.names.index)        # channels-last habit: the last of them in x
    others = [d for d in summed if d != c_in]
    guess = repr(others[0]) if len(others) == 1 else repr(tuple(others))
    raise ShapeError(message(f"{what}: which dim of w the conv sums is ambiguous.",
                             bullets=[f"w holds {summed}, all dims of x besides the spatial ones, and one "
                                      "output channel dim: any of them could be c_in"],
                             rule="w sums exactly one dim of x (c_in); the others it shares with x are per= "
                                  "dims: one filter per entry (per-sample weights: per='batch')",
                             fix=f"did you mean per={guess} (one filter per entry of it, '{c_in}' summed)?"))


def _strided(x: Tensor, w: Tensor, spatial: list, strides: dict[str, int], dils: dict[str, int],
             per: tuple[str, ...]) -> Tensor:
    """A strided conv as a sum of stride-1 convs over the input's phases (see :func:`conv`).

    Along a dim of stride ``S`` and dilation ``D`` (taps ``K``, padding ``before``/``after``,
    ``L`` outputs), tap ``t`` reads ``x[S i + D t - before]``: phase ``p = (D t - before) mod S``
    of ``x`` (its positions ``S m + p``) at ``m = i + (D t - before) // S``. With ``g = gcd(S,
    D)``, the taps of one phase are every ``S / g``-th tap, their offsets ``D / g`` apart, so each
    phase is a stride-1 conv dilated ``D / g`` with its own padding (undilated: every ``S``-th
    tap, consecutive offsets).  A phase whose taps read no row of ``x`` adds nothing."""
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
    phase_dils = {}   # per dim: the dilation of each phase's conv
    for d, tap, k, before, after in spatial:
        st, dl, n = strides[d], dils[d], x.shape.get(d).size
        out_len = (n + before + after - span(k, dl)) // st + 1
        if st == 1:
            plans.append([(None, None, k, before, after)])
            phase_dils[d] = dl
            continue
        sw, phase_dils[d] = st // math.gcd(st, dl), dl // math.gcd(st, dl)   # taps sw apart share a phase
        if n % st:     # zeros past the end: read only where the padding after is zero too
            x = pad(x, d, 0, st - n % st)
        if k % sw:
            w = pad(w, tap, 0, sw - k % sw)
        x, w = cut(x, d, st, f"{d}_phase"), cut(w, tap, sw, f"{tap}_phase")
        cuts.append((d, tap))
        m, options = x.shape.get(d).size, []
        for r in range(min(sw, k)):   # the taps r, r + sw, ...: phase (D r - before) mod S, offsets from (D r - before) // S
            n_taps = -(-(k - r) // sw)
            first = -((dl * r - before) // st)
            wide = span(n_taps, phase_dils[d])
            options.append(((dl * r - before) % st, r, n_taps, first, out_len - 1 - m + wide - first))
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
            wide = span(n_taps, phase_dils[d])
            if 0 <= first <= wide - 1 and 0 <= last <= wide - 1:
                pads[d] = (first, last)
                continue
            # more zeros than a conv pads, rows before the first output's taps (a dilated phase
            # starts past row 0: cut them off), or positions past the outputs: pad, then trim
            m = xp.shape.get(d).size
            if -first >= m:
                break                                  # every tap of this phase reads fill
            xp = slice_(xp, d, -first, m) if first < 0 else xp
            xp = pad(xp, d, max(0, first), max(0, last))
            pads[d], trims[d] = (0, 0), xp.shape.get(d).size - wide + 1 - max(0, -last)
            if trims[d] <= 0:
                break
        else:
            y = conv(xp, wp, {d: tap for d, tap, *_ in spatial}, padding=pads, dilation=phase_dils, per=per)
            for d, keep in trims.items():
                y = slice_(y, d, 0, keep) if keep < y.shape.get(d).size else y
            out = y if out is None else add(out, y)
    return out


__all__ = ["conv"]
