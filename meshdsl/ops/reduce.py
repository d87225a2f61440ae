"""Reductions over one or more named dims: sum, mean, max, min, logsumexp.

A sum over a split dim leaves a lazy partial sum (Mesh-TF); max and min are
allreduced at once since they cannot be combined with later additions.
"""
from __future__ import annotations

import torch

from ..core.graph import Tensor
from ..core.shape import Dim
from ..errors import ShapeError, message
from .elementwise import lift
from .registry import ComputeSpec, Op, apply, local_elements, register


def reduced_dims(x: Tensor, dims, what: str) -> tuple[str, ...]:
    """The dim names a reduction of ``x`` over ``dims`` reduces (all when None), checked for ``what``."""
    if dims is None:
        return x.shape.names
    if isinstance(dims, (str, Dim)):
        dims = [dims]
    if not isinstance(dims, (list, tuple)) or not all(isinstance(d, (str, Dim)) for d in dims):
        raise ShapeError(message(
            f"{what}: dims={dims!r} of {x!r} names no dim: dims are named, not numbered.",
            rule=f"{what} takes a dim name, a Dim or a list of them (None: every dim)",
            fix=f"name it: {what}(x, '{x.shape.names[-1] if x.shape.names else 'dim'}')"))
    names = tuple(d.name if isinstance(d, Dim) else d for d in dims)
    other = [d for d in dims if isinstance(d, Dim) and d.name in x.shape and x.shape.get(d.name) != d]
    if other:
        raise ShapeError(message(
            f"{what}: {other[0]!r} is not a dim of {x!r}: its '{other[0].name}' has size "
            f"{x.shape.get(other[0].name).size}.", rule="a Dim names a dim of the same name and size",
            fix=f"pass the name, {what}(x, '{other[0].name}'), or x.shape['{other[0].name}']"))
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ShapeError(message(f"{what}: dim(s) {dup} listed twice in {list(names)}.",
                                 rule="each reduced dim is named once", fix="list each dim once"))
    for n in names:
        if n not in x.shape:
            from ..errors import did_you_mean
            raise ShapeError(message(
                f"{what}: dim '{n}' is not a dim of {x!r}.{did_you_mean(n, x.shape.names)}",
                rule="reductions name the dims they reduce", fix=f"use dims from {list(x.shape.names)}"))
    return names


class Reduce(Op):
    kind = "sum"
    fn = None
    # deterministic: an identical reduction of the same tensor is the first one again (core/graph.py,
    # add_node): a log_softmax and a z-loss's logsumexp of the same logits share one logsumexp, whose
    # max and sum are allreduced once, not twice, under a split vocab
    cse = True

    def infer(self, inputs, attrs):
        (x,) = inputs
        keep = x.shape.without(attrs["dims"])
        attrs["pos"] = tuple(x.shape.index(n) for n in attrs["dims"])
        return [(keep, x.dtype)]

    def spec(self, node):
        x = node.inputs[0]
        return ComputeSpec({d.name: d.size for d in x.shape}, reduce={n: self.kind for n in node.attrs["dims"]})

    def flops(self, node, local):
        return local_elements(node.inputs[0].shape, local)


@register
class ReduceSum(Reduce):
    name = "reduce_sum"
    kind = "sum"
    linear = True

    def compute(self, ctx, attrs, x):
        return torch.sum(x, dim=attrs["pos"]) if attrs["pos"] else x

    def grad(self, node, douts):
        from .shape_ops import broadcast_to
        return [broadcast_to(douts[0], node.inputs[0].shape)]


class _Extreme(Reduce):
    def compute(self, ctx, attrs, x):
        return type(self).fn(x, dim=attrs["pos"]) if attrs["pos"] else x

    def grad(self, node, douts):
        from .elementwise import cast, equal
        from .shape_ops import broadcast_to
        x, y = node.inputs[0], node.outputs[0]
        mask = cast(equal(x, y), x.dtype)
        count = broadcast_to(reduce_sum(mask, node.attrs["dims"]), x.shape)
        return [broadcast_to(douts[0], x.shape) * mask / count]


@register
class ReduceMax(_Extreme):
    name = "reduce_max"
    kind = "max"
    fn = staticmethod(torch.amax)


@register
class ReduceMin(_Extreme):
    name = "reduce_min"
    kind = "min"
    fn = staticmethod(torch.amin)


def reduce_sum(x: Tensor, dims=None) -> Tensor:
    """Sum over ``dims`` (names or Dims; all dims when None)."""
    return apply("reduce_sum", [x], {"dims": reduced_dims(x, dims, "reduce_sum")})


def reduce_mean(x: Tensor, dims=None) -> Tensor:
    """Mean over ``dims``."""
    names = reduced_dims(x, dims, "reduce_mean")
    n = 1
    for d in names:
        n *= x.shape.get(d).size
    # A sum times 1/n, named as the user wrote it: messages and plan rows say 'reduce_mean', not 'mul'.
    return apply("mul", lift([reduce_sum(x, names), 1.0 / n], "mul"), name="reduce_mean")


def reduce_max(x: Tensor, dims=None) -> Tensor:
    """Maximum over ``dims``."""
    return apply("reduce_max", [x], {"dims": reduced_dims(x, dims, "reduce_max")})


def reduce_min(x: Tensor, dims=None) -> Tensor:
    """Minimum over ``dims``."""
    return apply("reduce_min", [x], {"dims": reduced_dims(x, dims, "reduce_min")})


def logsumexp(x: Tensor, dims=None) -> Tensor:
    """``log(sum(exp(x)))`` over ``dims``, stabilised by the (gradient-free) max."""
    from .elementwise import exp, log, stop_gradient
    names = reduced_dims(x, dims, "logsumexp")
    m = stop_gradient(reduce_max(x, names))
    return log(reduce_sum(exp(x - m), names)) + m


__all__ = ["reduce_sum", "reduce_mean", "reduce_max", "reduce_min", "logsumexp"]
