"""When an ``add`` may write its sum into one of its operands: the one rule both
program runners use (the dense interpreter :mod:`meshdsl.ir.interpret` and the
plan executor :mod:`meshdsl.runtime.executor`).

Autograd sums the gradients of a value read twice in place; a careful torch
programmer adds a residual into the block's fresh output.  An ``add`` may do
the same when the operand it overwrites is new storage (its producer never
returns a view of an input), nothing else reads or returns it, and it already
has the sum's dims, order, dtype and shape.  Each runner counts readers in
its own program and asks :func:`add_kernel` which kernel to run.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .broadcasting import align

#: Ops whose kernels return new storage, never a view of an input (a 2-operand einsum
#: is a matmul, see :func:`makes_fresh`).
FRESH_OPS = frozenset({"add", "sub", "mul", "gelu_backward", "gelu_tanh_backward", "silu_backward", "softmax_backward",
                       "normalize_backward",
                       "layer_norm", "layer_norm_backward", "rms_norm", "rms_norm_backward",
                       "attention_backward"})


def makes_fresh(op: str, num_inputs: int) -> bool:
    """Whether op ``op`` with ``num_inputs`` operands always returns new storage."""
    return op in FRESH_OPS or (op == "einsum" and num_inputs == 2)


@dataclass(frozen=True)
class Operand:
    """What a runner knows about one operand of an ``add``.

    Attributes:
      producer: the op that made it ('' for a leaf or a collective's result).
      num_producer_inputs: how many operands that op read.
      readers: how many operand slots of the whole program read it (both of this add's, if twice).
      kept: the program returns it (an output, or a value a later program reads).
      fits: it has the sum's dtype and (local) shape.
    """

    producer: str
    num_producer_inputs: int
    readers: int
    kept: bool
    fits: bool


def add_into_first(ctx, attrs, x, y):
    """``x + y`` written into ``x`` (x has the output's dims in order); out of place when
    autograd watches ``x`` (a caller differentiating through the program)."""
    if x.requires_grad:
        return torch.add(x, align(y, attrs["align"][1]))
    return x.add_(align(y, attrs["align"][1]))


def add_into_second(ctx, attrs, x, y):
    """``x + y`` written into ``y`` (the residual ``x + block(x)``: x is read again)."""
    if y.requires_grad:
        return torch.add(align(x, attrs["align"][0]), y)
    return y.add_(align(x, attrs["align"][0]))


def _plain_first(x, y):
    """:func:`add_into_first` of operands already in the sum's dims, without ctx and attrs."""
    return torch.add(x, y) if x.requires_grad else x.add_(y)


def _plain_second(x, y):
    """:func:`add_into_second` of operands already in the sum's dims, without ctx and attrs."""
    return torch.add(x, y) if y.requires_grad else y.add_(x)


def direct_add(fn, attrs):
    """The in-place add kernel ``fn`` as ``fn(x, y)``, called without its ctx and attrs (the
    straight-line program's direct call, as ``Op.direct``) where neither operand is moved
    (no align), or None."""
    if attrs.get("align") != ((None, None), (None, None)):
        return None
    return {add_into_first: _plain_first, add_into_second: _plain_second}.get(fn)


def may_overwrite(attrs, i: int, a: Operand) -> bool:
    """An add with ``attrs`` may write its sum into operand ``i`` (described by ``a``)."""
    return (makes_fresh(a.producer, a.num_producer_inputs) and a.readers == 1 and not a.kept and a.fits
            and attrs["align"][i] == (None, None))


def add_kernel(attrs, operands: tuple[Operand, Operand]):
    """The in-place kernel an ``add`` with ``attrs`` runs, or None to keep its own.

    The first operand is preferred (a gradient sum's running total); the second
    serves the residual ``x + block(x)``, where ``x`` is read again.
    """
    for i, fn in ((0, add_into_first), (1, add_into_second)):
        if may_overwrite(attrs, i, operands[i]):
            return fn
    return None
