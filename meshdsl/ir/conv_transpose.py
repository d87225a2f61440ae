"""``conv_transpose``: torch's ``conv_transpose1d``/``conv_transpose2d`` over named dims, built as
what it is, the input gradient of the strided conv it transposes.

``conv_transpose(x, w)`` is the adjoint of ``z -> conv(z, w, stride, padding)`` applied to ``x``:
``md.vjp`` of that conv, at a zero ``z`` of the upsampled shape (the conv is linear in ``z``, so
the value of ``z`` is never read and the forward conv itself is never run), with ``x`` as the
cotangent.  The result is therefore made of the strided conv's backward: stride-1 convs of
``x`` over the kernel's phases, interleaved by a rearrange, with no zeros inserted between
``x``'s positions and no wasted products.  Its own gradients are those ops' rules (a conv's),
and a split spatial dim trades halos as the strided conv's backward does.
"""
from __future__ import annotations

from ..core.graph import Tensor
from ..core.shape import Dim
from ..errors import ShapeError, message
from ..ops.arguments import per_dim_ints
from ..ops.constant import constant
from ..ops.conv import conv
from .autodiff import vjp


def conv_transpose(x: Tensor, w: Tensor, taps: dict, stride=1, padding=0, output_padding=0,
                   dilation=1) -> Tensor:
    """The transposed convolution of ``x`` with ``w`` along named spatial dims, as
    ``torch.nn.functional.conv_transpose2d`` (a U-Net decoder's or a GAN generator's upsampling).

    Args:
      x: ``[batch..., spatial..., c_in]`` in any order.
      w: ``[tap..., c_in, c_out]`` in any order (torch's weight ``[c_in, c_out, kh, kw]``, named):
        one tap dim per spatial dim, the channel dim it shares with ``x`` and the output's.
      taps: spatial dim of ``x`` -> its tap dim of ``w``, e.g. ``{"height": "kh", "width": "kw"}``.
      stride, padding, output_padding, dilation: torch's, each an int or a dict spatial dim ->
        int (``padding`` may also be a pair ``(before, after)``): ``padding`` crops the output,
        ``output_padding`` (less than the stride) lengthens it at the end.

    Returns:
      ``x``'s dims in ``x``'s order, ``c_out`` in ``c_in``'s place, each spatial dim
      ``(n - 1) * stride - before - after + dilation * (taps - 1) + output_padding + 1`` long.
    """
    spatial = _spatial(x, w, taps)
    strides, dils, extra = (per_dim_ints(v, spatial, "conv_transpose", name, least) for v, name, least in
                            ((stride, "stride", 1), (dilation, "dilation", 1), (output_padding, "output_padding", 0)))
    pads = {d: _pair(padding, d) for d in spatial}
    c_in, c_out = _channels(x, w, taps)
    dims = []
    for dim in x.shape:
        if dim.name in spatial:
            d, k = dim.name, w.shape.get(taps[dim.name]).size
            span = dils[d] * (k - 1) + 1
            _check_fit(d, pads[d], span, extra[d], strides[d])
            dims.append(Dim(d, (dim.size - 1) * strides[d] - sum(pads[d]) + span + extra[d]))
        else:
            dims.append(Dim(c_out, w.shape.get(c_out).size) if dim.name == c_in else dim)
    with x.graph.scope("conv_transpose"):
        z = constant(0.0, dims, dtype=x.dtype, name="conv_transpose_shape")
        y = conv(z, w, taps, padding=pads, stride=strides, dilation=dils)
        (out,) = vjp([y], [x], [z])
    return out


def _spatial(x: Tensor, w: Tensor, taps) -> list[str]:
    if not isinstance(x, Tensor) or not isinstance(w, Tensor):
        raise ShapeError(message("conv_transpose: x and w must be Tensors.",
                                 rule="conv_transpose convolves a tensor of the graph with a weight",
                                 fix="pass md tensors, e.g. an md.param for w"))
    if not isinstance(taps, dict) or not taps or any(d not in x.shape for d in taps) \
            or any(t not in w.shape for t in taps.values()):
        raise ShapeError(message(f"conv_transpose: taps={taps!r} must map spatial dims of {x!r} to tap dims "
                                 f"of {w!r}.", rule="taps is a dict spatial dim of x -> tap dim of w",
                                 fix="pass e.g. {'height': 'kh', 'width': 'kw'}"))
    return list(taps)


def _channels(x: Tensor, w: Tensor, taps: dict) -> tuple[str, str]:
    """(c_in, c_out): the one dim of ``w`` besides the taps that ``x`` has, and the one it lacks."""
    rest = [d for d in w.shape.names if d not in taps.values()]
    shared, new = [d for d in rest if d in x.shape], [d for d in rest if d not in x.shape]
    if len(shared) != 1 or len(new) != 1:
        raise ShapeError(message(
            f"conv_transpose: w's dims besides the taps, {rest}, are not one channel dim of x (c_in) and one "
            "it lacks (c_out).", rule="w holds one tap dim per spatial dim, x's channel dim and the output's",
            fix="e.g. x [batch, height, width, c_in] and w [kh, kw, c_in, c_out]"))
    return shared[0], new[0]


def _pair(padding, d: str) -> tuple[int, int]:
    p = padding.get(d, 0) if isinstance(padding, dict) else padding
    if isinstance(p, int) and not isinstance(p, bool) and p >= 0:
        return (p, p)
    if isinstance(p, (tuple, list)) and len(p) == 2 and all(isinstance(v, int) and not isinstance(v, bool)
                                                         and v >= 0 for v in p):
        return (p[0], p[1])
    raise ShapeError(message(f"conv_transpose: padding {p!r} for '{d}' is not an int >= 0 or a pair of them.",
                             rule="padding crops the output: an int (both ends, torch's) or (before, after)",
                             fix="pass e.g. padding=1"))


def _check_fit(d: str, pad: tuple[int, int], span: int, extra: int, stride: int) -> None:
    if max(pad) > span - 1:
        raise ShapeError(message(f"conv_transpose: padding {pad} along '{d}' crops more than the kernel's "
                                 f"reach, {span - 1}.", rule="each end crops at most dilation * (taps - 1)",
                                 fix="crop less, or slice the output with md.slice_"))
    if extra >= stride:
        raise ShapeError(message(f"conv_transpose: output_padding {extra} along '{d}' is not less than the "
                                 f"stride ({stride}).",
                                 rule="output_padding < stride: it picks one of the output lengths a strided "
                                      "conv maps to the same input length",
                                 fix="use a smaller output_padding, or md.pad the output"))


__all__ = ["conv_transpose"]
