"""Lowering of the fused norms: fused where the normalised dim is whole, composite where it arrives split.

``rms_norm``, ``layer_norm``, ``normalize`` (a layer norm without affine) and their backwards
are one kernel each that needs the normalised dim whole on a rank (``fixed`` in their spec), so
lowered generically a split dim is gathered first: the whole activation, as a DeepSeek-V2
latent's norm under ``kv_latent:model`` or every norm under a ``d_model`` split would move it.
Where the input already arrives split along that dim, the node is lowered as the composite of
the same math instead (as :mod:`.softmax` does):

* RMS norm: ``rstd = rsqrt(mean(x^2) + eps)``, ``y = x * rstd * scale``; backward, with
  ``x̂ = x * rstd`` and ``gw = g * scale``: ``dx = (gw - x̂ * mean(gw * x̂)) * rstd``;
* layer norm: ``mean``, ``rstd = rsqrt(mean((x - mean)^2) + eps)``, ``y = (x - mean) * rstd *
  scale + bias``; backward ``dx = (gw - mean(gw) - x̂ * mean(gw * x̂)) * rstd``;
* the scale's gradient is ``g * x̂`` and the bias's ``g``, summed over the other dims.

The means over the split dim are small allreduces of one value per row (the layer norm
backward's two row sums packed into one allreduce); the outputs stay split
as the input was, and the statistics are those the fused kernel saves (fp32 for a 16-bit ``x``),
so a fused forward and a composite backward (or the reverse) agree.

The layer norm's mean and variance would be two dependent allreduces (the mean, then the centred
variance).  Instead each rank's part gives its own mean and centred M2 and one collective joins
them by Chan's parallel-variance formula (:mod:`meshdsl.ops.moments`): an allgather of the parts'
two moments a row (``part_moments``, lowered below as each rank's own row), or one allreduce of
two fp64 sums a row, whichever the cost model prices lower for the group (:func:`moments_form`),
or the two passes where their fewer bytes outweigh a latency (very many rows on a large group).
"""
from __future__ import annotations

import math

import torch

from ..core.shape import Dim
from ..layout.sharding import Sharding, part_sizes
from ..ops.elementwise import cast, rsqrt
from ..ops.moments import PART_DIM, own_part_moments, row_moments
from ..ops.reduce import reduce_mean, reduce_sum
from ..ops.scan import squeeze, unsqueeze
from ..ops.slicing import concat, slice_
from .composite import lower_composite
from .generic import lower_generic
from .plan import MB_AXIS
from .rules import lowering

#: the layer norm's statistics over a split dim as a mean, then the centred variance: two allreduces
TWO_PASS = "two_pass"


def _acc(x):
    """``x`` in the statistics' dtype: fp32 for a 16-bit ``x``, else its own."""
    return cast(x, torch.float32) if x.dtype in (torch.bfloat16, torch.float16) else x


def _as(t, dtype):
    return t if t.dtype == dtype else cast(t, dtype)


def _sum_but(t, dim: str):
    """``t`` summed over every dim but ``dim`` (an affine param's gradient)."""
    others = [n for n in t.shape.names if n != dim]
    return reduce_sum(t, others) if others else t


def composite_rms_norm(x, *scale, dim: str, eps: float):
    """``(y, rstd)`` of ``rms_norm(x, dim, scale)``."""
    xf = _acc(x)
    rstd = rsqrt(reduce_mean(xf * xf, dim) + eps)
    y = xf * rstd
    if scale:
        y = y * _acc(scale[0])
    return [_as(y, x.dtype), rstd]


def composite_rms_norm_backward(g, x, rstd, *scale, dim: str):
    """``dx`` (and ``d_scale`` with a scale) of the RMS norm, from the saved ``rstd``."""
    xhat, gf = _acc(x) * rstd, _acc(g)
    gw = gf * _acc(scale[0]) if scale else gf
    dx = (gw - xhat * reduce_mean(gw * xhat, dim)) * rstd
    return [_as(dx, x.dtype)] + ([_as(_sum_but(gf * xhat, dim), scale[0].dtype)] if scale else [])


def composite_layer_norm(x, *affine, dim: str, eps: float, has_scale: bool, has_bias: bool, form=TWO_PASS):
    """``(y, mean, rstd)`` of ``layer_norm(x, dim, scale, bias)``; ``form``: how the statistics are
    joined over a split ``dim`` (:func:`moments_form`)."""
    xf = _acc(x)
    if form == TWO_PASS:
        mean = reduce_mean(xf, dim)
        xc = xf - mean
        rstd = rsqrt(reduce_mean(xc * xc, dim) + eps)
    else:
        mean, rstd = row_moments(x, dim, eps, None if form == "sums" else form)
        xc = xf - mean
    y = xc * rstd
    params = list(affine)
    if has_scale:
        y = y * _acc(params.pop(0))
    if has_bias:
        y = y + _acc(params.pop(0))
    return [_as(y, x.dtype), mean, rstd]


def composite_layer_norm_backward(g, x, mean, rstd, *scale, dim: str, has_bias: bool):
    """``dx`` (then ``d_scale``, ``d_bias`` as the node has them) of the layer norm."""
    xhat, gf = (_acc(x) - mean) * rstd, _acc(g)
    gw = gf * _acc(scale[0]) if scale else gf
    sum_g, sum_gx = _row_sums([gw, gw * xhat], dim)
    n = x.shape[dim].size
    dx = (gw - sum_g / n - xhat * (sum_gx / n)) * rstd
    outs = [_as(dx, x.dtype)]
    if scale:
        outs.append(_as(_sum_but(gf * xhat, dim), x.dtype))
    if has_bias:
        outs.append(_as(_sum_but(gf, dim), x.dtype))
    return outs


def composite_normalize_backward(g, x, dim: str, eps: float, form=TWO_PASS):
    """``[dx]`` of the affine-free layer norm (``normalize``), which saves no statistics: they are
    made again from ``x``, as its fused backward kernel makes them."""
    _, mean, rstd = composite_layer_norm(x, dim=dim, eps=eps, has_scale=False, has_bias=False, form=form)
    return composite_layer_norm_backward(g, x, mean, rstd, dim=dim, has_bias=False)


def _row_sums(ts, dim: str) -> list:
    """``reduce_sum(t, dim)`` of each of ``ts``, packed along a new dim after the sums: over a split
    ``dim`` the partial sums (one value per row each) go in one allreduce instead of one each, as
    batch_norm's backward sends its two."""
    k = Dim("norm_row_sums", 1)
    both = concat([unsqueeze(reduce_sum(t, dim), k) for t in ts], k.name)
    return [squeeze(slice_(both, k.name, i, i + 1), k.name) for i in range(len(ts))]


def _build(node, form):
    """The composite of ``node``'s op, as a function of its inputs; ``form``: how a layer norm joins
    its statistics (:func:`moments_form`)."""
    a, name = node.attrs, node.op.name
    if name == "rms_norm":
        return lambda *ins: composite_rms_norm(*ins, dim=a["dim"], eps=a["eps"])
    if name == "rms_norm_backward":
        return lambda *ins: composite_rms_norm_backward(*ins, dim=a["dim"])
    if name == "layer_norm":
        return lambda *ins: composite_layer_norm(*ins, dim=a["dim"], eps=a["eps"], has_scale=a["scale"],
                                                 has_bias=a["bias"], form=form)
    if name == "normalize":
        return lambda x: composite_layer_norm(x, dim=a["dim"], eps=a["eps"], has_scale=False, has_bias=False,
                                              form=form)[:1]
    if name == "normalize_backward":
        return lambda g, x: composite_normalize_backward(g, x, dim=a["dim"], eps=a["eps"], form=form)
    return lambda *ins: composite_layer_norm_backward(*ins, dim=a["dim"], has_bias=a["bias"])


def moments_form(lw, x, dim: str):
    """How a layer norm joins the statistics of ``x`` split along ``dim``: the lengths of the
    ranks' parts, whose moments are gathered whole (``part_moments``, one allgather); ``"sums"``,
    one allreduce of two fp64 sums a row (``sum_moments``: not for an fp64 ``x``, whose sums would
    cancel at its own precision); or :data:`TWO_PASS`, the row means then the centred variances
    (two allreduces of one value a row, half the sums' bytes).  The cheapest by the cost model for
    the rows a rank holds, in that order on a tie: on two to four ranks the gather moves no more
    bytes than either allreduce, above that the one allreduce wins where latency outweighs bytes
    (a few thousand rows) and the two passes beyond.  A dim cut otherwise than by the ranks' plain
    parts (micro-batches, given or block-cyclic parts) takes the sums or the two passes."""
    cur, mesh = lw.sharding(lw.value(x)), lw.mesh
    pos, n = x.shape.index(dim), mesh.axis_size(cur.axes_of(dim))
    rows = math.prod(k for i, k in enumerate(cur.local_shape(x.shape, mesh)) if i != pos)
    item = 8 if x.dtype == torch.float64 else 4   # a statistic's bytes
    cost = lw.cost.collective
    forms = {TWO_PASS: 2 * cost("allreduce", rows * item, n)}
    if x.dtype != torch.float64:
        forms["sums"] = cost("allreduce", rows * 16, n)
    parts = _rank_parts(mesh, cur, x, dim)
    if parts:
        forms[parts] = cost("allgather", rows * 2 * item, n)
    return min(reversed(forms), key=forms.get)


def _rank_parts(mesh, cur, x, dim: str) -> tuple[int, ...] | None:
    """The lengths of the ranks' parts of ``x`` (at sharding ``cur``) along split ``dim``, in the
    order of their group over its axes; None where they are cut otherwise (micro-batches, given or
    block-cyclic parts, which a gather of one row a rank would not follow)."""
    axes = cur.axes_of(dim)
    if not axes or MB_AXIS in axes or cur.parts or cur.cyclic:
        return None
    return part_sizes(x.shape.get(dim).size, mesh, mesh.group(0, axes), axes)


@lowering("rms_norm", "rms_norm_backward", "layer_norm", "layer_norm_backward", "normalize", "normalize_backward")
def lower_norm(lw, node) -> None:
    x = node.inputs[0 if node.op.name in ("rms_norm", "layer_norm", "normalize") else 1]
    dim = node.attrs["dim"]
    if not lw.sharding(lw.value(x)).axes_of(dim):
        lower_generic(lw, node)
        return
    lower_composite(lw, node, _build(node, moments_form(lw, x, dim)))


@lowering("part_moments")
def lower_part_moments(lw, node) -> None:
    """Each rank's own part's moments, a row of ``P`` split along ``moment_part`` as the normalised
    dim arrives split (no collective: ``combine_moments`` gathers ``P``); generic (the dim gathered)
    where the rank's parts are not the op's ``lengths``."""
    x, out, dim = node.inputs[0], node.outputs[0], node.attrs["dim"]
    vid = lw.reduced(lw.value(x))
    cur = lw.sharding(vid).with_partial(())
    axes = cur.axes_of(dim)
    if _rank_parts(lw.mesh, cur, x, dim) != tuple(node.attrs["lengths"]):
        lower_generic(lw, node)
        return
    vid = lw.relayout(vid, cur, node, "input of part_moments")
    split = {**{d: a for d, a in cur.split.items() if d != dim}, PART_DIM: axes}
    own = lw.new_value(out.shape, out.dtype, Sharding.of(out.shape, split))
    lw.emit("local", node, [vid], [own], args={"fn": own_part_moments, "attrs": node.attrs, "compute": cur.split,
                                               "sizes": {d.name: d.size for d in x.shape}},
            flops=4 * cur.local_numel(x.shape, lw.mesh))
    lw.bind(out, own)
