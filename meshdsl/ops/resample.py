"""Upsampling over named spatial dims: ``upsample``, as ``torch.nn.functional.interpolate``
with an integer ``scale_factor`` (``mode="nearest"`` or ``"bilinear"``/``"linear"``,
``align_corners=False``).

Nearest repeats each position ``s`` times: ``x`` broadcast over a new dim of ``s`` and merged
into the spatial dim by a rearrange, so a split spatial dim stays split and moves nothing, and
the gradient sums each run of ``s``.  Linear weighs the two nearest positions of ``x`` (clamped
at the edges, torch's rule): each output phase mixes ``x`` with a neighbour-shifted copy
(``md.shift``), merged as nearest's copies are, so over an even split each rank trades one row
with each neighbour (a halo) and the gradient one row back.
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
    from .shape_ops import broadcast_to

    rep = f"{d}_rep"
    return _merge_phases(broadcast_to(x, list(x.shape) + [Dim(rep, s)]), d, rep)


def _linear(x: Tensor, d: str, s: int) -> Tensor:
    """Output ``s i + p`` is ``x[i]`` mixed with one neighbour, ``x[i - 1]`` or ``x[i + 1]``
    (its weight ``|f_p|`` for ``f_p = (p + 0.5) / s - 0.5``, torch's half-pixel rule), the edges
    clamped: so each phase ``p`` weighs ``x`` and its two neighbour-shifted copies, and a split
    ``d`` trades one row each way rather than the whole dim."""
    from .constant import constant
    from .elementwise import equal, where
    from .embed import arange
    from .slicing import shift

    dim = x.shape.get(d)
    n, pos = dim.size, arange(dim)
    prev = where(equal(pos, 0), x, shift(x, d, 1))            # x[i - 1], x[0] at the first row
    nxt = where(equal(pos, n - 1), x, shift(x, d, -1))        # x[i + 1], x[n - 1] at the last row
    frac = [(p + 0.5) / s - 0.5 for p in range(s)]
    rep = Dim(f"{d}_rep", s)
    w_prev = constant(torch.tensor([max(-f, 0.0) for f in frac], dtype=x.dtype), [rep], name=f"upsample_{d}_prev")
    w_next = constant(torch.tensor([max(f, 0.0) for f in frac], dtype=x.dtype), [rep], name=f"upsample_{d}_next")
    w_self = constant(torch.tensor([1.0 - abs(f) for f in frac], dtype=x.dtype), [rep], name=f"upsample_{d}_self")
    return _merge_phases(prev * w_prev + x * w_self + nxt * w_next, d, rep.name)


def _merge_phases(x: Tensor, d: str, rep: str) -> Tensor:
    """``x [.., d, .., rep]`` -> ``x [.., (d rep), ..]``, renamed ``d``: phase ``rep`` of row ``i``
    lands at ``s i + rep`` (an even split of ``d`` stays split)."""
    from .shape_ops import rearrange, rename

    names = [n for n in x.shape.names if n != rep]
    left = " ".join(names) + f" {rep}"
    right = " ".join((f"({n} {rep})" if n == d else n) for n in names)
    return rename(rearrange(x, f"{left} -> {right}"), {f"{d}_{rep}": d})


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
