"""argmax and argmin over one named dim: where the largest (smallest) element lies, as int64.

The kernel is torch's, which needs the dim whole on a rank (it is ``fixed`` in the spec).  Where
a layout splits the dim, :mod:`meshdsl.lowering.argmax` lowers the node instead as the same
answer from reductions: the extreme (an allreduce of the other dims), the positions that hold
it, and the first of them (an allreduce min); nothing of the split dim moves.
"""
from __future__ import annotations

import torch

from ..core.graph import Tensor
from ..core.shape import Dim
from ..errors import ShapeError, message
from .reduce import reduced_dims
from .registry import ComputeSpec, Op, apply, local_elements, register


class ArgExtreme(Op):
    """The index of the extreme along ``attrs["dim"]``: the first one on a tie, and a NaN's (a
    NaN is the extreme), as torch's kernel."""

    differentiable = False   # an integer result: no gradient reaches x
    fn = None

    def infer(self, inputs, attrs):
        (x,) = inputs
        if x.dtype == torch.bool or x.dtype.is_complex:
            raise ShapeError(message(f"{self.name}: input {x!r} is {x.dtype}.",
                                     rule=f"{self.name} orders real numbers", fix="cast it: meshdsl.cast(x, torch.float32)"))
        attrs["pos"] = x.shape.index(attrs["dim"])
        return [(x.shape.without([attrs["dim"]]), torch.int64)]

    def spec(self, node):
        x = node.inputs[0]
        return ComputeSpec({d.name: d.size for d in x.shape}, fixed=frozenset([node.attrs["dim"]]))

    def compute(self, ctx, attrs, x):
        return type(self).fn(x, dim=attrs["pos"])

    def flops(self, node, local):
        return local_elements(node.inputs[0].shape, local)


@register
class Argmax(ArgExtreme):
    name = "argmax"
    fn = staticmethod(torch.argmax)


@register
class Argmin(ArgExtreme):
    name = "argmin"
    fn = staticmethod(torch.argmin)


def _one_dim(x: Tensor, dim, what: str) -> str:
    if not isinstance(dim, (str, Dim)):
        raise ShapeError(message(f"{what}: dim={dim!r} is not one dim.", inputs=[f"x: {x!r}"],
                                 rule=f"{what} searches along one named dim",
                                 fix=f"name it, e.g. {what}(x, '{x.shape.names[-1] if x.shape else 'dim'}')"))
    return reduced_dims(x, dim, what)[0]


def _arg_extreme(name: str, which: str):
    def f(x: Tensor, dim) -> Tensor:
        return apply(name, [x], {"dim": _one_dim(x, dim, name)})
    f.__name__ = f.__qualname__ = name
    f.__doc__ = f"""The index of the {which} element along ``dim`` (the first one on a tie), as ``torch.{name}``.

    Args:
      x: a floating-point or integer Tensor.
      dim: the dim to search (a name or a Dim); any layout, split or not.

    Returns:
      An int64 Tensor with the dims of ``x`` but ``dim``.  It has no gradient.

    Raises:
      ShapeError: ``dim`` is not one dim of ``x``, or ``x`` is bool.
    """
    return f


argmax = _arg_extreme("argmax", "largest")
argmin = _arg_extreme("argmin", "smallest")


__all__ = ["argmax", "argmin"]
