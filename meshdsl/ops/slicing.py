"""Ops along one dim: slice, pad, concat, and shift/roll.

concat needs its dim whole on each rank (the compiler gathers it when it is
split).  slice, pad, shift and roll read a window of their dim: on a split dim
each rank trades a halo with its neighbours along the axes that split it (two
collective permutes, shared by every such reader of one tensor; see
:mod:`meshdsl.lowering.halo`), and gathers the dim only where no such exchange reaches.
"""
from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F

from ..core.graph import Tensor
from ..core.shape import Dim, Shape
from ..errors import ShapeError, message
from .registry import ComputeSpec, Op, apply, register


def _dim(x: Tensor, dim, what: str) -> str:
    name = dim.name if isinstance(dim, Dim) else dim
    x.shape.index(name)  # raises a ShapeError naming the shape
    return name


def _ints(what: str, x: Tensor, name: str, **args) -> None:
    """Refuse an offset or bound of ``what`` that is no Python int (0.5 or "1" would be cut or parsed)."""
    bad = {k: v for k, v in args.items() if isinstance(v, bool) or not isinstance(v, numbers.Integral)}
    if bad:
        k, v = next(iter(bad.items()))
        raise ShapeError(message(
            f"{what}: {k}={v!r} ({type(v).__name__}) along dim '{name}' of {x!r} is not an int.",
            rule=f"{what} counts whole elements along a dim: {', '.join(args)} must be Python ints",
            fix=f"pass an int, e.g. {k}={int(v) if isinstance(v, float) and v == v and abs(v) != float('inf') else 1}"))


def _resized(x: Tensor, name: str, size: int) -> Shape:
    return Shape(Dim(d.name, size) if d.name == name else d for d in x.shape)


class _AlongDim(Op):
    linear = True

    def spec(self, node):
        dims = {}
        for t in list(node.inputs) + list(node.outputs):
            dims.update({d.name: d.size for d in t.shape})
        return ComputeSpec(dims, fixed=frozenset([node.attrs["dim"]]))


@register
class Slice(_AlongDim):
    name = "slice"

    def infer(self, inputs, attrs):
        (x,) = inputs
        attrs["pos"] = x.shape.index(attrs["dim"])
        return [(_resized(x, attrs["dim"], attrs["stop"] - attrs["start"]), x.dtype)]

    def compute(self, ctx, attrs, x):
        return x.narrow(attrs["pos"], attrs["start"], attrs["stop"] - attrs["start"])

    def grad(self, node, douts):
        x, a = node.inputs[0], node.attrs
        return [pad(douts[0], a["dim"], a["start"], x.shape.get(a["dim"]).size - a["stop"])]


@register
class Pad(_AlongDim):
    name = "pad"

    def infer(self, inputs, attrs):
        (x,) = inputs
        pos = x.shape.index(attrs["dim"])
        attrs["torch_pad"] = (0, 0) * (len(x.shape) - 1 - pos) + (attrs["before"], attrs["after"])
        size = x.shape.get(attrs["dim"]).size + attrs["before"] + attrs["after"]
        return [(_resized(x, attrs["dim"], size), x.dtype)]

    def compute(self, ctx, attrs, x):
        return F.pad(x, attrs["torch_pad"], value=attrs["value"])

    def is_linear(self, node):
        return node.attrs["value"] == 0.0

    def grad(self, node, douts):
        a = node.attrs
        n = node.inputs[0].shape.get(a["dim"]).size
        return [slice_(douts[0], a["dim"], a["before"], a["before"] + n)]


@register
class Concat(_AlongDim):
    name = "concat"

    def infer(self, inputs, attrs):
        first = inputs[0]
        name = attrs["dim"]
        for k, x in enumerate(inputs[1:], 1):
            # Same dims in the same order: torch.cat concatenates by position.
            if x.shape.names != first.shape.names or x.shape.without([name]) != first.shape.without([name]):
                raise ShapeError(message(
                    f"concat along '{name}': operand {k} {x.shape} does not line up with operand 0 {first.shape}.",
                    rule=f"concat operands have the same dims in the same order, and equal sizes outside '{name}'",
                    fix=f"transpose or rename operand {k} to the dims of operand 0, in order"))
        attrs["pos"] = first.shape.index(name)
        attrs["sizes"] = tuple(x.shape.get(name).size for x in inputs)
        return [(_resized(first, name, sum(attrs["sizes"])), first.dtype)]

    def compute(self, ctx, attrs, *xs):
        return torch.cat(xs, dim=attrs["pos"])

    def grad(self, node, douts):
        out, start = [], 0
        for s in node.attrs["sizes"]:
            out.append(slice_(douts[0], node.attrs["dim"], start, start + s))
            start += s
        return out


@register
class Shift(Op):
    """Shift along ``dim`` by ``offset`` (zero fill), or roll when ``wrap``."""

    name = "shift"
    linear = True

    def infer(self, inputs, attrs):
        (x,) = inputs
        attrs["pos"] = x.shape.index(attrs["dim"])
        return [(x.shape, x.dtype)]

    def compute(self, ctx, attrs, x):
        k, pos = attrs["offset"], attrs["pos"]
        if attrs["wrap"]:
            return torch.roll(x, k, dims=pos)
        return shift_local(x, None, k, pos)

    def grad(self, node, douts):
        a = node.attrs
        return [shift_into(douts[0], a["dim"], -a["offset"], a["wrap"])]


#: products a shift along a dim only one operand carries commutes with (zeros in give zeros out)
_PRODUCTS = ("einsum", "mul")


def shift_into(g: Tensor, dim: str, offset: int, wrap: bool) -> Tensor:
    """``g`` shifted along ``dim``: where ``g`` is a product (einsum, mul) of which one operand
    carries ``dim`` and has no more elements than ``g``, that operand is shifted instead.

    A conv written as shifts (``sum_t einsum(shift(x, o_t), w_t)``) has as the gradient of tap
    ``t``'s input ``shift(einsum(dy, w_t), -o_t)``: each a different tensor, so over a split dim
    each traded a halo of its own (``d + 2d`` rows for taps ``2d, d, 0``).  As ``einsum(shift(dy,
    -o_t), w_t)`` every tap shifts the one ``dy``, whose readers share one exchange as wide as
    the widest (``2d``: meshdsl/lowering/halo.py).  The operand's rows are no wider than ``g``'s
    (its elements at most ``g``'s), so no tap's halo grows; a product that widens the rows
    (``c_out > c_in``) keeps its own shift."""
    op = {"dim": dim, "offset": offset, "wrap": wrap}
    node = g.node
    carriers = [i for i, t in enumerate(node.inputs) if dim in t.shape] if node is not None else []
    if (node is None or node.op.name not in _PRODUCTS or len(carriers) != 1 or len(node.outputs) != 1
            or node.inputs[carriers[0]].shape.numel > g.shape.numel):
        return _shift_inner(g, op)
    ins = list(node.inputs)
    ins[carriers[0]] = _shift_inner(ins[carriers[0]], op)
    return apply(node.op.name, ins, dict(node.attrs))


def _shift_inner(t: Tensor, op: dict) -> Tensor:
    """``t`` shifted as ``op`` says; where ``t`` is itself a shift along another dim, the two
    commute and ``op``'s goes inside.  A 2-D conv written as shifts (depthwise: ``shift(shift(x,
    h, o_h), w, o_w) * w_t``) has as tap ``t``'s input gradient ``shift(shift(dy, w, -o_w), h,
    -o_h) * w_t``: its ``h`` shift read one tensor per ``o_w``, so over a split ``h`` each traded
    its own halo (38 permutes for a 7x7 where the forward sends 2).  Inside, every tap's ``h``
    shift reads ``dy`` itself and shares one exchange, as the forward's shifts of ``x`` do."""
    node = t.node
    if node is not None and node.op.name == "shift" and node.attrs["dim"] != op["dim"]:
        inner = _shift_inner(node.inputs[0], op)
        return apply("shift", [inner], {k: node.attrs[k] for k in ("dim", "offset", "wrap")})
    return apply("shift", [t], op)


def shift_local(x, incoming, k: int, pos: int):
    """Shift ``x`` by ``k`` along ``pos``, filling the gap from ``incoming`` (zeros if None)."""
    n = x.shape[pos]
    if k == 0:
        return x
    if abs(k) >= n and incoming is None:
        return torch.zeros_like(x)
    if incoming is None:
        incoming = torch.zeros_like(x.narrow(pos, 0, abs(k)))
    if k > 0:
        return torch.cat([incoming, x.narrow(pos, 0, n - k)], dim=pos)
    return torch.cat([x.narrow(pos, -k, n + k), incoming], dim=pos)


# ----------------------------------------------------------------------------- public API


def slice_(x: Tensor, dim, start: int, stop: int) -> Tensor:
    """Elements ``start:stop`` of ``x`` along ``dim`` (a dim of the same name, smaller)."""
    name = _dim(x, dim, "slice")
    _ints("slice_", x, name, start=start, stop=stop)
    n = x.shape.get(name).size
    if not 0 <= start < stop <= n:
        raise ShapeError(message(f"slice: [{start}:{stop}] is out of range for dim '{name}' of size {n}.",
                                 rule="0 <= start < stop <= size", fix=f"pick bounds within 0..{n}"))
    return apply("slice", [x], {"dim": name, "start": int(start), "stop": int(stop)})


def pad(x: Tensor, dim, before: int, after: int, value: float = 0.0) -> Tensor:
    """Pad ``x`` along ``dim`` with ``before``/``after`` elements of ``value``."""
    name = _dim(x, dim, "pad")
    _ints("pad", x, name, before=before, after=after)
    if before < 0 or after < 0:
        raise ShapeError(message(f"pad: negative padding ({before}, {after}) on '{name}'.",
                                 rule="padding amounts are >= 0", fix="use slice to shrink a dim"))
    if before == after == 0:
        return x
    return apply("pad", [x], {"dim": name, "before": int(before), "after": int(after), "value": float(value)})


def concat(xs, dim) -> Tensor:
    """Concatenate tensors along ``dim`` (the others must match, in the same order)."""
    xs = list(xs)
    if not xs or not all(isinstance(x, Tensor) for x in xs):
        raise ShapeError(message(f"concat: expected a non-empty list of Tensors, got {xs!r}.",
                                 rule="concat joins one or more tensors along a dim",
                                 fix="pass a list such as [a, b]"))
    name = _dim(xs[0], dim, "concat")
    return apply("concat", list(xs), {"dim": name})


def shift(x: Tensor, dim, offset: int, wrap: bool = False) -> Tensor:
    """Move elements ``offset`` places along ``dim``; zero-filled, or rolled when ``wrap``."""
    name = _dim(x, dim, "shift")
    _ints("roll" if wrap else "shift", x, name, offset=offset)
    return apply("shift", [x], {"dim": name, "offset": int(offset), "wrap": bool(wrap)})


def roll(x: Tensor, dim, offset: int) -> Tensor:
    """``shift`` with wrap-around, like ``torch.roll``."""
    return shift(x, dim, offset, wrap=True)


__all__ = ["slice_", "pad", "concat", "shift", "roll"]
