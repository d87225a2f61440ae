"""top_k along a dim, for MoE routing: values and indices along a new dim of size k.

The kernel needs the searched dim whole on a rank: split, it is gathered, or where that pays,
each rank's top k of its part is (:mod:`meshdsl.lowering.topk`).
"""
from __future__ import annotations

import torch

from ..core.graph import Tensor
from ..core.shape import Dim, Shape
from ..errors import ShapeError, message
from .registry import ComputeSpec, Op, apply, register


def first_of_ties(x: torch.Tensor, k: int, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``k`` of a stable descending sort of ``x`` along ``pos``: ``torch.topk``'s values,
    with tied values kept and ordered lowest index first.

    torch.topk leaves open which of tied values it keeps and in which order; a top-k of a split
    dim (each rank's top k, then the top k of those candidates, rank by rank) keeps the lowest
    indices, so the kernel does too: the same indices, dense or on any layout.  One sort, with no
    branch on the values (no host sync on a GPU, nothing that stops ``--compile``'s trace)."""
    vals, idx = torch.sort(x, dim=pos, descending=True, stable=True)
    return vals.narrow(pos, 0, k), idx.narrow(pos, 0, k)


@register
class TopK(Op):
    name = "top_k"

    def infer(self, inputs, attrs):
        (x,) = inputs
        name, new = attrs["dim"], attrs["new_dim"]
        attrs["pos"] = x.shape.index(name)
        shape = Shape(new if d.name == name else d for d in x.shape)
        return [(shape, x.dtype), (shape, torch.int64)]

    def spec(self, node):
        x = node.inputs[0]
        dims = {d.name: d.size for d in x.shape}
        dims[node.attrs["new_dim"].name] = node.attrs["new_dim"].size
        return ComputeSpec(dims, fixed=frozenset([node.attrs["dim"], node.attrs["new_dim"].name]))

    def compute(self, ctx, attrs, x):
        return first_of_ties(x, attrs["new_dim"].size, attrs["pos"])

    def grad(self, node, douts):
        from .einsum import _einsum_named
        from .embed import one_hot
        x = node.inputs[0]
        g = douts[0]
        if g is None:
            return [None]
        oh = one_hot(node.outputs[1], x.shape.get(node.attrs["dim"]), x.dtype)
        return [_einsum_named([g, oh], list(x.shape.names))]


def top_k(x: Tensor, dim, k: int, new_dim: Dim | str | None = None):
    """The ``k`` largest values along ``dim`` and their indices.

    Args:
      x: input.
      dim: dim to search.
      k: how many.
      new_dim: the dim of size k that replaces ``dim`` (default ``f"{dim}_top"``).

    Returns:
      ``(values, indices)``, both with ``dim`` replaced by ``new_dim``; tied values are kept and
      ordered lowest index first (a stable descending sort's first ``k``), on every layout.
    """
    name = dim.name if isinstance(dim, Dim) else dim
    n = x.shape.get(name).size
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise ShapeError(message(f"top_k: k={k!r} is out of range for dim '{name}' of size {n}." if isinstance(k, int)
                                 else f"top_k: k={k!r} ({type(k).__name__}) is not an int.",
                                 rule="1 <= k <= size", fix=f"pick k in 1..{n}"))
    if new_dim is None:
        new_dim = Dim(f"{name}_top", k)
    elif isinstance(new_dim, str):
        new_dim = Dim(new_dim, k)
    if new_dim.size != k:
        raise ShapeError(message(f"top_k: new_dim {new_dim!r} must have size k={k}.",
                                 rule="the new dim holds the k results", fix=f"use Dim('{new_dim.name}', {k})"))
    return apply("top_k", [x], {"dim": name, "new_dim": new_dim})


__all__ = ["top_k"]
