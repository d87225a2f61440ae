"""Running sums along a named dim (``cumsum``) and the size-1 dims routing leaves
behind (``squeeze``, ``unsqueeze``).

These are what a capacity-limited mixture-of-experts layer needs beyond
one_hot and top_k: an exclusive cumsum over the batch of the expert one-hot
gives each token its position in its expert's queue (Mesh-TF's
``position_in_expert``), and a top-1 choice has a size-1 dim to drop.

A cumsum's dim may be split: :mod:`meshdsl.lowering.scan` scans each rank's
slice and adds the sum of the slices before it, all-gathering only the
per-slice totals.  A size-1 dim can never be split, so squeeze and unsqueeze
are local wherever the other dims lie.
"""
from __future__ import annotations

import torch

from ..core.graph import Tensor
from ..core.shape import Dim, Shape
from ..errors import ShapeError, did_you_mean, message
from .registry import ComputeSpec, Op, apply, register


def scan_local(x: torch.Tensor, pos: int, exclusive: bool, reverse: bool) -> torch.Tensor:
    """The running sum of ``x`` along position ``pos`` (the dense kernel, and each rank's on its slice)."""
    if reverse:
        x = x.flip(pos)
    # dtype=: torch.cumsum would turn int32 (and bool) into int64; the shape rule keeps x's dtype
    y = torch.cumsum(x, pos, dtype=x.dtype)
    if reverse:
        y = y.flip(pos)
    return exclusive_of(y, pos, reverse) if exclusive else y


def exclusive_of(inclusive: torch.Tensor, pos: int, reverse: bool) -> torch.Tensor:
    """The exclusive scan from the inclusive one: shifted a place along ``pos``, zero at the start.

    Shifting rather than subtracting ``x`` keeps each float sum the one the
    inclusive scan had a place earlier: no cancellation against a large ``x[i]``
    (in fp32, ``(1 + 1e8) - 1e8`` is 0, not 1).  Integers are exact either way.
    """
    n = inclusive.shape[pos]
    zero = torch.zeros_like(inclusive.narrow(pos, 0, 1))
    if reverse:
        return torch.cat([inclusive.narrow(pos, 1, n - 1), zero], dim=pos)
    return torch.cat([zero, inclusive.narrow(pos, 0, n - 1)], dim=pos)


@register
class Cumsum(Op):
    """Running sum along ``attrs['dim']``; ``exclusive`` and ``reverse`` as :func:`cumsum` says."""

    name = "cumsum"
    linear = True

    def infer(self, inputs, attrs):
        (x,) = inputs
        attrs["pos"] = x.shape.index(attrs["dim"])
        return [(x.shape, x.dtype)]

    def compute(self, ctx, attrs, x):
        return scan_local(x, attrs["pos"], attrs["exclusive"], attrs["reverse"])

    def spec(self, node):
        # The kernel alone needs the whole dim; a split dim is the lowering rule's business.
        x = node.inputs[0]
        return ComputeSpec({d.name: d.size for d in x.shape}, fixed=frozenset([node.attrs["dim"]]))

    def grad(self, node, douts):
        # y_i = sum_{j<=i} x_j, so dL/dx_j = sum_{i>=j} g_i: the scan the other way round
        # (strict inequalities for the exclusive form).
        x, g = node.inputs[0], douts[0]
        if g is None or not x.dtype.is_floating_point:
            return [None]
        a = node.attrs
        return [cumsum(g, a["dim"], exclusive=a["exclusive"], reverse=not a["reverse"])]


@register
class Squeeze(Op):
    """Drop the size-1 dim ``attrs['dim']``."""

    name = "squeeze"
    linear = True

    def infer(self, inputs, attrs):
        (x,) = inputs
        attrs["pos"] = x.shape.index(attrs["dim"])
        return [(x.shape.without([attrs["dim"]]), x.dtype)]

    def compute(self, ctx, attrs, x):
        return x.squeeze(attrs["pos"])

    def spec(self, node):
        # Every input dim, the size-1 one included: the generic rule never splits it
        # (no axis divides 1), so the others keep their sharding and nothing moves.
        return ComputeSpec({d.name: d.size for d in node.inputs[0].shape})

    def grad(self, node, douts):
        from .shape_ops import broadcast_to
        return [broadcast_to(douts[0], node.inputs[0].shape)]


# ----------------------------------------------------------------------------- public API


def _dim_name(x: Tensor, dim, what: str) -> str:
    if not isinstance(x, Tensor):
        raise ShapeError(message(f"{what}: expected a meshdsl Tensor, got {x!r} ({type(x).__name__}).",
                                 rule=f"{what} works on a named tensor", fix="pass a Tensor returned by an op"))
    name = dim.name if isinstance(dim, Dim) else dim
    if not isinstance(name, str) or name not in x.shape:
        raise ShapeError(message(f"{what}: {name!r} is not a dim of {x!r}."
                                 f"{did_you_mean(name, x.shape.names) if isinstance(name, str) else ''}",
                                 inputs=[f"x: {x.shape}"], rule=f"{what} names one of x's dims",
                                 fix=f"use one of {list(x.shape.names)}"))
    if isinstance(dim, Dim) and dim != x.shape.get(name):
        raise ShapeError(message(f"{what}: {dim!r} does not match dim {x.shape.get(name)!r} of {x!r}.",
                                 inputs=[f"x: {x.shape}"], rule="a dim name means one size",
                                 fix=f"pass the name '{name}' or x's own Dim"))
    return name


def cumsum(x: Tensor, dim, exclusive: bool = False, reverse: bool = False) -> Tensor:
    """Running sum of ``x`` along ``dim``, like ``torch.cumsum`` but by name.

    ``y[i] = x[0] + ... + x[i]``.  With ``exclusive`` the element itself is left
    out (``y[0] = 0``, ``y[i] = x[0] + ... + x[i-1]``): over a one-hot of expert
    choices that counts the earlier tokens sent to the same expert, a token's
    position in its expert's queue.  With ``reverse`` the sum runs from the end
    (``y[i] = x[i] + ... + x[n-1]``); it is also the gradient's form.

    Works for floating-point and integer dtypes (integer sums are exact; they
    carry no gradient).  ``dim`` may be split over mesh axes A: each rank scans
    its slice and adds the totals of the slices before it, which costs one
    allgather of the per-rank totals (x without ``dim``) over A, e.g. layout
    ``"batch:data"`` for a cumsum over ``batch``.  A whole ``dim`` costs nothing.
    A lazy partial sum stays partial (the scan is linear).

    Args:
      x: a tensor of float or integer dtype.
      dim: the dim to sum along (a name or a Dim).
      exclusive: leave each element out of its own sum.
      reverse: sum from the last element towards the first.

    Returns:
      A tensor with ``x``'s dims, sizes and dtype.

    Raises:
      ShapeError: if ``dim`` is not a dim of ``x``, or ``x`` is boolean.
    """
    name = _dim_name(x, dim, "cumsum")
    if x.dtype == torch.bool:
        raise ShapeError(message(f"cumsum: {x!r} is boolean.", inputs=[f"x: {x.shape} {x.dtype}"],
                                 rule="cumsum adds numbers; a boolean sum has no bool result",
                                 fix="count in an integer dtype: cumsum(meshdsl.cast(mask, torch.int64), ...)"))
    return apply("cumsum", [x], {"dim": name, "exclusive": bool(exclusive), "reverse": bool(reverse)})


def squeeze(x: Tensor, dim) -> Tensor:
    """Drop the size-1 dim ``dim`` of ``x`` (e.g. the ``top`` dim of a top-1 choice).

    Local on every layout: a size-1 dim is never split.

    Raises:
      ShapeError: if ``dim`` is not a dim of ``x`` or its size is not 1.
    """
    name = _dim_name(x, dim, "squeeze")
    size = x.shape.get(name).size
    if size != 1:
        raise ShapeError(message(f"squeeze: dim '{name}' of {x!r} has size {size}, not 1.",
                                 inputs=[f"x: {x.shape}"], rule="squeeze removes a dim of size 1 only",
                                 fix=f"sum it away with reduce_sum(x, '{name}') or take one element with "
                                     f"slice_(x, '{name}', i, i + 1) first"))
    return apply("squeeze", [x], {"dim": name})


def unsqueeze(x: Tensor, dim, position: int | None = None) -> Tensor:
    """Add the size-1 dim ``dim`` to ``x`` at ``position`` (the end when None).

    ``position`` counts like ``torch.unsqueeze``: 0 puts the dim first, -1 last.
    A broadcast of ``x`` to one more dim, so local on every layout.

    Args:
      x: a tensor.
      dim: the new dim: a name, or a Dim of size 1.
      position: where it goes among ``x``'s dims, from ``-(len(x.shape) + 1)`` to ``len(x.shape)``.

    Raises:
      ShapeError: if ``x`` already has the name, the Dim's size is not 1, or the position is out of range.
    """
    from .shape_ops import broadcast_to
    new = dim if isinstance(dim, Dim) else Dim(dim, 1)
    if new.size != 1:
        raise ShapeError(message(f"unsqueeze: {new!r} has size {new.size}, not 1.", inputs=[f"x: {x.shape}"],
                                 rule="unsqueeze adds a dim of size 1",
                                 fix="repeat x along it with broadcast_to(x, shape) instead"))
    if new.name in x.shape:
        raise ShapeError(message(f"unsqueeze: {x!r} already has a dim '{new.name}'.", inputs=[f"x: {x.shape}"],
                                 rule="dim names within one tensor are unique", fix="pick another name"))
    rank = len(x.shape)
    at = rank if position is None else position
    if isinstance(at, bool) or not isinstance(at, int) or not -(rank + 1) <= at <= rank:
        raise ShapeError(message(f"unsqueeze: position {position!r} is out of range for {x!r}.",
                                 inputs=[f"x: {x.shape}"], rule=f"-{rank + 1} <= position <= {rank}",
                                 fix="pass an int in that range, or None for the end"))
    if at < 0:
        at += rank + 1
    dims = list(x.shape)
    dims.insert(at, new)
    return broadcast_to(x, Shape(dims))


__all__ = ["cumsum", "squeeze", "unsqueeze"]
