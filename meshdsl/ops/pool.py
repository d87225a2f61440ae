"""Pooling over named spatial dims: ``max_pool`` and ``avg_pool``, as torch's ``max_pool2d``
and ``avg_pool2d`` (floor mode).

A pool is built from ops the compiler already lowers, one spatial dim at a time (a window's
max or sum over several dims is the max or sum along each in turn).  Along a dim of window
``K``, stride ``S`` and padding ``before`` (``L`` outputs), window ``i`` reads ``x[S i + t -
before]`` for taps ``t < K``.  With ``t - before = q S + r`` that is row ``i + q`` of phase ``r``
when ``x`` is cut into rows of ``S`` (a rearrange ``(rows phase)``, as a strided conv cuts it),
so each tap is a slice of one phase, padded where it reaches past ``x``, and the window's value
folds the ``K`` slices with ``maximum`` or ``add``.  The padding is ``-inf`` for a max (a window always holds one element
of ``x``: the padding is at most ``K - 1`` a side) and zeros for a sum.  Under a split
spatial dim the slices trade halos with the neighbouring ranks, as a strided conv's do.
"""
from __future__ import annotations

import torch

from ..core.graph import Tensor
from ..core.shape import Dim
from ..errors import ShapeError, message
from .arguments import dims_to_ints, per_dim_ints


def max_pool(x: Tensor, window: dict, stride=None, padding=0) -> Tensor:
    """The max of each window of ``x`` along named spatial dims (``torch.nn.functional.max_pool2d``).

    Args:
      x: a float tensor, e.g. ``[batch, height, width, channels]`` in any order.
      window: spatial dim -> window length, e.g. ``{"height": 3, "width": 3}`` (any number of dims).
      stride: a positive int, or a dict spatial dim -> int; default the window (torch's).
      padding: per side, as :func:`avg_pool`'s; the padding never wins a max.

    Returns:
      ``x``'s dims in ``x``'s order, each pooled dim ``(n + before + after - window) // stride + 1``
      long.  The gradient goes to the window's largest element; where several tie, it is shared
      among them (torch's kernel gives it all to the first).
    """
    return _pool(x, window, stride, padding, "max_pool", None)


def avg_pool(x: Tensor, window: dict, stride=None, padding=0, count_include_pad: bool = True) -> Tensor:
    """The mean of each window of ``x`` along named spatial dims (``torch.nn.functional.avg_pool2d``).

    Args:
      x: a float tensor, e.g. ``[batch, height, width, channels]`` in any order.
      window: spatial dim -> window length, e.g. ``{"height": 2, "width": 2}``.
      stride: a positive int, or a dict spatial dim -> int; default the window (torch's).
      padding: an int (that many zeros on both sides, torch's), a pair ``(before, after)``,
        ``"valid"`` (0) or ``"same"`` (``(window - 1) // 2`` before and the rest after: as long
        as ``x`` at stride 1), or a dict spatial dim -> one of these; at most ``window - 1`` a side.
      count_include_pad: divide by the window length (torch's default), or, False, by the
        number of positions of ``x`` in the window.

    Returns:
      ``x``'s dims in ``x``'s order, each pooled dim ``(n + before + after - window) // stride + 1`` long.
    """
    if not isinstance(count_include_pad, bool):
        raise ShapeError(message(f"avg_pool: count_include_pad={count_include_pad!r} is not a bool.",
                                 rule="count_include_pad is True (divide by the window) or False "
                                      "(by the positions of x in it)", fix="pass True or False"))
    return _pool(x, window, stride, padding, "avg_pool", count_include_pad)


def _pool(x: Tensor, window, stride, padding, what: str, include_pad) -> Tensor:
    dims = dims_to_ints(x, window, what, "window", "window length", "pass e.g. {'height': 2}")
    strides = per_dim_ints(dims if stride is None else stride, dims, what, "stride", default=dims)
    pads = {d: _padding(x, d, k, padding, what) for d, k in dims.items()}
    for d, k in dims.items():
        n, (before, after) = x.shape.get(d).size, pads[d]
        if n + before + after < k:
            raise ShapeError(message(
                f"{what}: '{d}' has {n} positions, {before + after} padded, fewer than its window {k}.",
                rule="a window fits in the padded dim", fix="use a smaller window or pad more"))
    with x.graph.scope(what):   # its steps named as the user's op in plans
        for d, k in dims.items():
            x = _pool_one(x, d, k, strides[d], *pads[d], include_pad, what)
    return x


def _pool_one(x: Tensor, d: str, k: int, s: int, before: int, after: int, include_pad, what: str) -> Tensor:
    """``x`` pooled along ``d`` alone (window ``k``, stride ``s``): a max, or with
    ``include_pad`` set (True or False) a mean.  Tap ``t`` reads ``x[s i + t - before]``: row
    ``i + q`` of phase ``r`` of ``x``'s cut into rows of ``s``, with ``t - before = q s + r``;
    each phase is padded once for all its taps (rows before 0 or past the end are padding)."""
    from .elementwise import add, maximum, mul
    from .scan import squeeze
    from .slicing import pad, slice_

    n = x.shape.get(d).size
    out = (n + before + after - k) // s + 1
    fill = float("-inf") if include_pad is None else 0.0
    if s > 1:
        cut = _phases(pad(x, d, 0, -n % s, value=fill), d, s)
    m = -(-n // s)                     # rows of each phase
    y = None
    for r in range(s):
        qs = [(t - before) // s for t in range(k) if (t - before) % s == r]
        if not qs:
            continue
        ph = squeeze(slice_(cut, f"{d}_phase", r, r + 1), f"{d}_phase") if s > 1 else x
        lo, hi = max(0, -min(qs)), max(0, max(qs) + out - m)
        ph = pad(ph, d, lo, hi, value=fill)
        for q in qs:
            tap = slice_(ph, d, q + lo, q + lo + out) if (q + lo, out) != (0, m + lo + hi) else ph
            y = tap if y is None else (maximum(y, tap) if include_pad is None else add(y, tap))
    if include_pad is None:
        return y
    return mul(y, _inverse_counts(d, out, n, k, s, before, x.dtype, include_pad))


def _phases(t: Tensor, d: str, s: int) -> Tensor:
    """``t``'s ``d`` of ``rows * s`` positions as ``d`` (rows) and ``{d}_phase`` (s), the latter inner."""
    from .shape_ops import rearrange

    left = " ".join(f"({n} {d}_phase)" if n == d else n for n in t.shape.names)
    right = " ".join(f"{n} {d}_phase" if n == d else n for n in t.shape.names)
    return rearrange(t, f"{left} -> {right}", **{f"{d}_phase": s})


def _inverse_counts(d: str, out: int, n: int, k: int, s: int, before: int, dtype, include_pad: bool):
    """What a window's sum is multiplied by: ``1 / k``, or per window ``1 / (its positions of x)``."""
    from .constant import constant

    if include_pad:
        return constant(1.0 / k, dtype)
    counts = [min(n, s * i - before + k) - max(0, s * i - before) for i in range(out)]
    return constant(torch.tensor([1.0 / c for c in counts], dtype=dtype), [Dim(d, out)],
                    name=f"avg_pool_counts_{d}")


def _padding(x: Tensor, d: str, k: int, padding, what: str) -> tuple[int, int]:
    """``d``'s (before, after) from ``padding`` (see :func:`avg_pool`), each at most ``k - 1``."""
    p = padding.get(d, 0) if isinstance(padding, dict) else padding
    if isinstance(padding, dict) and any(e not in x.shape for e in padding):
        bad = next(e for e in padding if e not in x.shape)
        raise ShapeError(message(f"{what}: padding names {bad!r}, which is not a dim of {x!r}.",
                                 rule="padding's keys are pooled dims", fix="name a dim of the window"))
    if p == "valid":
        pair = (0, 0)
    elif p == "same":
        pair = ((k - 1) // 2, k - 1 - (k - 1) // 2)
    elif isinstance(p, int) and not isinstance(p, bool):
        pair = (p, p)
    elif isinstance(p, (tuple, list)) and len(p) == 2 and all(isinstance(v, int) and not isinstance(v, bool)
                                                             for v in p):
        pair = tuple(p)
    else:
        raise ShapeError(message(f"{what}: padding {p!r} for '{d}' is not an int, a pair, 'same' or 'valid'.",
                                 rule="padding per side: an int (both sides), (before, after), 'same' or 'valid'",
                                 fix="pass e.g. padding=1"))
    if not 0 <= min(pair) <= max(pair) <= k - 1:
        raise ShapeError(message(f"{what}: padding {pair} along '{d}' is outside 0..{k - 1} (window {k}).",
                                 rule="each side pads at most window - 1 positions, so every window holds "
                                      "an element of x", fix="pad less, or use a larger window"))
    return pair


__all__ = ["avg_pool", "max_pool"]
