"""Upsampling over named spatial dims: ``upsample``, as ``torch.nn.functional.interpolate``
with an integer ``scale_factor`` (``mode="nearest"`` or ``"bilinear"``/``"linear"``,
``align_corners=False``).

Nearest repeats each position ``s`` times: ``x`` broadcast over a new dim of ``s`` and merged
into the spatial dim by a rearrange, so a split spatial dim stays split and moves nothing, and
the gradient sums each run of ``s``.  Linear weighs the two nearest positions of ``x`` (clamped
at the edges, torch's rule): per dim an einsum with a constant ``[n, s n]`` table of weights,
which over a split dim is a partial sum each rank adds up.
"""
from __future__ import annotations

import torch

from ..core.graph import Tensor
from ..core.shape import Dim
from ..errors import ShapeError, message
from .arguments import dims_to_ints

_MODES = ("nearest", "linear", "bilinear")


def upsample(x: Tensor, scale: dict, mode: str = "nearest") -> Tensor:
    """``x`` made ``scale`` times longer along named spatial dims.

    Args:
      x: a float tensor, e.g. ``[batch, height, width, channels]`` in any order.
      scale: spatial dim -> a positive int, e.g. ``{"height": 2, "width": 2}``.
      mode: ``"nearest"`` (each position repeated) or ``"linear"`` (``"bilinear"``: the same,
        per dim), as ``F.interpolate(..., scale_factor=s, mode=..., align_corners=False)``.

    Returns:
      ``x``'s dims in ``x``'s order, each scaled dim ``s`` times as long.
    """
    factors = _factors(x, scale, mode)
    with x.graph.scope("upsample"):
        for d, s in factors.items():
            if s > 1:
                x = _nearest(x, d, s) if mode == "nearest" else _linear(x, d, s)
    return x


def _nearest(x: Tensor, d: str, s: int) -> Tensor:
    from .shape_ops import broadcast_to, rearrange, rename

    rep = f"{d}_rep"
    names = x.shape.names
    left = " ".join((f"{n} {rep}" if n == d else n) for n in names)
    right = " ".join((f"({n} {rep})" if n == d else n) for n in names)
    wide = broadcast_to(x, list(x.shape) + [Dim(rep, s)])
    merged = rearrange(wide, f"{left} -> {right}")
    return rename(merged, {f"{d}_{rep}": d})


def _linear(x: Tensor, d: str, s: int) -> Tensor:
    from .constant import constant
    from .einsum import einsum
    from .shape_ops import rename

    n = x.shape.get(d).size
    table = torch.zeros(n, s * n, dtype=x.dtype)
    for o in range(s * n):
        pos = max((o + 0.5) / s - 0.5, 0.0)      # where output o samples x (torch's half-pixel rule)
        lo = min(int(pos), n - 1)
        hi, w = min(lo + 1, n - 1), pos - lo
        table[lo, o] += 1.0 - w
        table[hi, o] += w
    out = f"{d}_up"
    weights = constant(table, [d, Dim(out, s * n)], name=f"upsample_{d}")
    ins = " ".join(x.shape.names)
    outs = " ".join(out if n_ == d else n_ for n_ in x.shape.names)
    return rename(einsum(f"{ins}, {d} {out} -> {outs}", x, weights), {out: d})


def _factors(x: Tensor, scale, mode) -> dict[str, int]:
    """``scale`` checked (see :func:`upsample`); a non-Tensor ``x`` is refused with every op's arguments."""
    if mode not in _MODES:
        raise ShapeError(message(f"upsample: mode={mode!r} is not one of {_MODES}.",
                                 rule="nearest repeats positions; linear/bilinear weighs the two nearest",
                                 fix="pass mode='nearest' or mode='bilinear'"))
    return dims_to_ints(x, scale, "upsample", "scale", "factor",
                        "pass an int >= 1; for another size, an einsum with a table of weights "
                        "(md.constant) resamples to any length")


__all__ = ["upsample"]
