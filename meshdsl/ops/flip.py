"""flip: reverse a tensor along one or more named dims, as ``torch.flip``.

The kernel is ``torch.flip`` on the dims' positions; the gradient is the flip of the
cotangent (a flip is its own inverse).  The kernel needs each flipped dim whole on a rank
(``fixed`` in the spec); where a layout splits one evenly, :mod:`meshdsl.lowering.flip`
flips each rank's block and trades it with the mirrored rank in one permute instead of
gathering the dim.
"""
from __future__ import annotations

import torch

from ..core.graph import Tensor
from ..core.shape import Dim
from ..errors import ShapeError, did_you_mean, message
from .registry import ComputeSpec, Op, apply, register


@register
class Flip(Op):
    """``torch.flip`` along ``attrs["dims"]`` (names); ``attrs["pos"]``: their positions."""

    name = "flip"
    linear = True

    def infer(self, inputs, attrs):
        (x,) = inputs
        attrs["pos"] = tuple(x.shape.index(d) for d in attrs["dims"])
        return [(x.shape, x.dtype)]

    def spec(self, node):
        x = node.inputs[0]
        return ComputeSpec({d.name: d.size for d in x.shape}, fixed=frozenset(node.attrs["dims"]))

    def compute(self, ctx, attrs, x):
        return torch.flip(x, attrs["pos"])

    def direct(self, attrs):
        pos = attrs["pos"]
        return lambda x: torch.flip(x, pos)

    def grad(self, node, douts):
        return [flip(douts[0], list(node.attrs["dims"]))]


def _flip_dims(x: Tensor, dim) -> tuple[str, ...]:
    """The names ``dim`` (a dim name, a Dim, or a list of them) gives, each a dim of ``x``."""
    items = list(dim) if isinstance(dim, (list, tuple)) else [dim]
    bad = [d for d in items if not isinstance(d, (str, Dim))]
    if bad:
        raise ShapeError(message(
            f"flip: dim={dim!r} of {x!r}: {bad[0]!r} ({type(bad[0]).__name__}) names no dim: dims are "
            "named, not numbered.", rule="flip takes a dim name, a Dim, or a list of them",
            fix=f"name it: md.flip(x, '{x.shape.names[-1] if x.shape.names else 'dim'}')"))
    names = tuple(d.name if isinstance(d, Dim) else d for d in items)
    for d, n in zip(items, names):
        if n not in x.shape:
            raise ShapeError(message(
                f"flip: dim '{n}' is not a dim of {x!r}.{did_you_mean(n, x.shape.names)}",
                rule="flip reverses the dims it names, each a dim of its input",
                fix=f"use dims from {list(x.shape.names)}"))
        if isinstance(d, Dim) and x.shape.get(n) != d:
            raise ShapeError(message(
                f"flip: {d!r} is not a dim of {x!r}: its '{n}' has size {x.shape.get(n).size}.",
                rule="a Dim names a dim of the same name and size",
                fix=f"pass the name, md.flip(x, '{n}'), or x.shape['{n}']"))
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ShapeError(message(f"flip: dim(s) {dup} listed twice in {list(names)}.",
                                 rule="each flipped dim is named once (flipping twice is no flip)",
                                 fix="list each dim once"))
    return names


def flip(x: Tensor, dim) -> Tensor:
    """Reverse ``x`` along ``dim``, as ``torch.flip`` (``jnp.flip``).

    A bidirectional RNN's backward direction reads its sequence reversed:
    ``md.flip(words, "words")``.

    Args:
      x: a Tensor of any dtype and rank.
      dim: a dim name, a Dim, or a list of them (an empty list: ``x`` itself).

    Returns:
      A Tensor of the shape and dtype of ``x``; its gradient is the cotangent flipped back.
      Under a layout that splits a flipped dim evenly (``"words:model"``) each rank flips its
      block and trades it with the mirrored rank in one permute; an uneven split gathers the dim.

    Raises:
      ShapeError: a dim that is not one of ``x``'s (with the closest name), a number for a dim,
        or a dim listed twice.
    """
    names = _flip_dims(x, dim)
    if not names:
        return x
    return apply("flip", [x], {"dims": names})


__all__ = ["flip"]
