"""Constants: a scalar, or a fixed tensor with named dims (a table the model reads).

A tensor constant is built from a torch tensor (or anything ``torch.as_tensor``
takes) and one name per axis.  It is like a param that is never trained: the
whole value lives in the graph, and each rank takes its slice of it by the
layout (the kernel narrows every split dim to the rank's offset, as ``iota``
counts from it), so a constant never needs communication and has no gradient.
"""
from __future__ import annotations

import torch

from ..core.graph import Tensor, graph_of, not_a_tensor
from ..core.shape import Dim, Shape
from ..errors import ShapeError, message
from .registry import Op, apply, register, run_device

#: (id of a constant's CPU tensor, device) -> (that tensor, its copy on the device)
_ON_DEVICE: dict = {}


def _traced(t: torch.Tensor) -> bool:
    """Whether ``t`` was made under a trace (a functionalized or proxy-tracked value)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    return torch._is_functional_tensor(t) or bool(_get_current_dispatch_mode_stack())


@register
class Constant(Op):
    name = "constant"
    differentiable = False

    def infer(self, inputs, attrs):
        if "shape" not in attrs:  # the scalar form
            attrs["tensor"] = torch.tensor(attrs["value"], dtype=attrs["dtype"])
            return [(Shape(), attrs["dtype"])]
        attrs["tensor"] = attrs["value"]
        return [(attrs["shape"], attrs["dtype"])]

    def compute(self, ctx, attrs):
        t, dev = attrs["tensor"], run_device()
        if dev is not None and dev != t.device:
            key = (id(t), dev)   # the constant, once per device it runs on (t kept alive: ids stay unique)
            got = _ON_DEVICE.get(key)
            if got is None:
                got = (t, t.to(dev))
                if not _traced(got[1]):   # a trace's copy (--compile) is no tensor the eager kernels may read
                    _ON_DEVICE[key] = got
            t = got[1]
        for i, d in enumerate(attrs.get("shape", ())):  # this rank's slice of each split dim
            if d.name in ctx.offsets:
                t = t.narrow(i, ctx.offset(d.name), ctx.size(d.name, d.size))
        return t

    def grad(self, node, douts):
        return []


def _dims_of(t: torch.Tensor, dims) -> Shape:
    """The named shape of constant ``t``: ``dims`` are Dims or names (sizes from ``t``)."""
    given = [d if isinstance(d, Dim) else repr(d) for d in dims]

    def refuse(what, fix):
        return ShapeError(message(f"constant: {what}.",
                                  inputs=[f"tensor shape: {tuple(t.shape)}", f"dims: {given}"],
                                  rule="a tensor constant names each axis of its tensor, in order: a Dim of "
                                       "that axis's size, or a name that takes the size",
                                  fix=fix))
    if not isinstance(dims, (list, tuple)) or any(not isinstance(d, (Dim, str)) for d in dims):
        raise refuse(f"dims {dims!r} are not a list of Dims or names",
                     "pass e.g. [md.Dim('seq', 8), 'half'] (one entry per axis of the tensor)")
    if len(dims) != t.dim():
        raise refuse(f"the tensor of shape {tuple(t.shape)} has {t.dim()} axes but {len(dims)} dims were given",
                     f"give one dim per axis: {t.dim()} of them")
    out = []
    for i, (d, n) in enumerate(zip(dims, t.shape)):
        if isinstance(d, str):
            d = Dim(d, int(n))
        elif d.size != n:
            raise refuse(f"dim {d!r} has size {d.size} but axis {i} of the tensor has {n}",
                         f"use Dim({d.name!r}, {n}), or pass the name {d.name!r} to take the tensor's size")
        out.append(d)
    return Shape(out)


def _filled(value, dims, dtype: torch.dtype) -> torch.Tensor:
    """A Python number repeated over ``dims`` (``md.constant(0.0, [batch, heads])``), as
    ``torch.full``; its dtype is the scalar form's (float32 unless ``dtype`` says)."""
    names = [d for d in dims if not isinstance(d, Dim)]
    if names:
        raise ShapeError(message(f"constant: the number {value!r} is filled over dims {list(dims)!r}, "
                                 f"and {names[0]!r} is no Dim.",
                                 rule="a number filled over dims takes each dim's size from a Dim (a name alone "
                                      "takes its size from a tensor's axis, and a number has none)",
                                 fix=f"pass Dims, e.g. md.constant({value!r}, [md.Dim('batch', 8)]), or a "
                                     "tensor's dim: x.shape['batch']"))
    return torch.full([d.size for d in dims], value, dtype=dtype)


def _check_arguments(value, dims, like) -> None:
    """A name given first (``md.constant("eye", t, dims)``, as ``md.param`` takes it) is one error
    saying so, before ``like`` (then the dims) is checked as a Tensor (``like`` is not annotated
    ``Tensor``, so that :mod:`.arguments` leaves this order to us)."""
    if isinstance(value, str) and (isinstance(dims, torch.Tensor) or like is not None):
        raise ShapeError(message(f"constant: the value is the str {value!r}, then {type(dims).__name__} dims.",
                                 rule="md.constant(value, dims, like=None, *, dtype=None, name=None): the value comes "
                                      "first; a constant's name is the keyword name=",
                                 fix=f"md.constant(tensor, [dims], name={value!r})"))
    if like is not None and not isinstance(like, Tensor):
        raise not_a_tensor("constant", "argument 'like'", like)


def constant(value, dims=None, like=None, *, dtype: torch.dtype | None = None,
             name: str | None = None) -> Tensor:
    """A constant: a scalar, or a tensor with named dims that is never trained.

    Each rank reads its slice of a tensor constant by the layout, without
    communication; a tensor constant is copied when built, so changing the
    torch tensor afterwards does not change the model.

    Args:
      value: a Python number (the scalar form, shape ``[]``; with dims, filled over them),
        or a torch tensor or array-like (nested lists, a NumPy array).
      dims: for a tensor, one entry per axis: a :class:`~meshdsl.Dim` of that size,
        or a name (str) that takes the axis's size.  For a scalar, None, or a
        torch dtype (``constant(0.0, torch.float16)``, the scalar form's dtype), or
        Dims to fill it over (``constant(0.0, [batch, heads])``, as ``torch.full``).
      like: a tensor of the graph to build into (default: the active graph).
      dtype: the constant's dtype; default float32 for a number (filled over dims too),
        the tensor's own otherwise (a list of Python floats is float32, as in torch).
      name: the node's name in plans and reports (default ``constant``).

    Returns:
      The constant Tensor.

    Raises:
      ShapeError: dims that do not fit the tensor (both shapes named), a
        tensor with more than zero axes and no dims, or a number filled over a
        dim given by name only (no size).

    Example::

        half = md.Dim("half", d_k // 2)
        inv_freq = md.constant(1.0 / 10000 ** (torch.arange(0, d_k, 2) / d_k), [half])
        angles = md.cast(md.arange(seq), torch.float32) * inv_freq   # [seq, half]
    """
    _check_arguments(value, dims, like)
    if isinstance(dims, torch.dtype):  # the scalar form's historical signature: (value, dtype, like)
        dtype, dims = dims, None
    if isinstance(value, (bool, int, float)) and dims is None:
        attrs = {"value": value, "dtype": dtype or torch.float32}
    else:
        if isinstance(value, (bool, int, float)) and isinstance(dims, (list, tuple)) and dims:
            value = _filled(value, dims, dtype or torch.float32)
        try:
            t = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ShapeError(message(f"constant: {type(value).__name__} value cannot become a tensor ({e}).",
                                     rule="a constant is a number, a torch tensor or an array-like of numbers",
                                     fix="pass a torch tensor, e.g. torch.tensor([...])")) from None
        t = t.detach().to(device="cpu", dtype=dtype or t.dtype).clone().contiguous()
        if dims is None and t.dim() > 0:
            raise ShapeError(message(f"constant: a tensor of shape {tuple(t.shape)} was given without dims.",
                                     rule="a tensor constant names each axis of its tensor",
                                     fix="pass its dims, e.g. md.constant(t, [md.Dim('seq', 8), 'half'])"))
        attrs = {"value": t, "dtype": t.dtype, "shape": _dims_of(t, () if dims is None else dims)}
    with graph_of(like) if like is not None else graph_of():
        return apply("constant", [], attrs, name=name)


__all__ = ["constant"]
