"""Fused softmax cross-entropy: one torch kernel forward, one backward.

``cross_entropy(logits, labels, dim)`` is ``logsumexp(logits) - logits[label]``
along ``dim``, per example.  As one op it runs torch's fused kernel forward and
a fused ``softmax(logits) - one_hot(label)`` backward, where the composite of the
same math runs about twenty small kernels.  The forward also returns the row-wise
logsumexp (``lse``): the composite backward of a split class dim reads it, so that
dim's max and sums are not reduced twice.

Lowering (:mod:`meshdsl.lowering.xent`): with the class dim whole on a rank the
fused kernels run locally; a layout that splits it (Megatron's vocab-parallel loss)
gets the composite (:func:`composite_forward`, :func:`composite_backward`), whose
max, sums and picked logits reduce over the split dim without gathering it.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from ..core.graph import Tensor
from ..errors import ShapeError
from .embed import check_ids
from .registry import ComputeSpec, Op, apply, register

#: how a range error names cross-entropy's labels (ops/embed.py ``check_ids``)
LABELS = "cross_entropy: labels"


def _rows(x: torch.Tensor, pos: int) -> torch.Tensor:
    """``x`` with the class dim last, as (examples, classes)."""
    if pos != x.dim() - 1:   # (the class dim last, the usual case: no move)
        x = x.movedim(pos, -1)
    return x.reshape(-1, x.shape[-1])


def _forward(pos: int, name: str, logits: torch.Tensor, labels: torch.Tensor):
    """The forward kernel: (loss, lse) per example, the class dim ``name`` at ``pos``.  A label
    outside the class dim raises a GraphError, as the composite of a split class dim does."""
    x = _rows(logits, pos)
    ls = F.log_softmax(x, -1)        # one vectorised pass; lse = x - log_softmax(x), any column
    traced = get_proxy_mode() is not None
    if not labels.is_cpu and not traced and labels.numel():
        check_ids(labels, name, x.shape[-1], LABELS)   # (a GPU's gather would fail asynchronously)
    try:
        picked, err = ls.gather(1, labels.reshape(-1, 1)), None
    except (IndexError, RuntimeError) as e:   # on the CPU, torch's own bounds check
        err = e
    if err is not None:   # the GraphError is raised outside the except (no chained context)
        check_ids(labels, name, x.shape[-1], LABELS)
        raise err
    loss = -picked.squeeze(1)
    lse = x.select(1, 0) - ls.select(1, 0)
    return loss.view(*labels.shape), lse.view(*labels.shape)   # (sizes as arguments: parsed faster)


def _backward(pos: int, logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, g: torch.Tensor):
    """The backward kernel: d_logits (``lse`` is for the composite's backward: unread here)."""
    # torch's softmax kernel recomputes the probabilities faster than exp(logits - lse) here
    last = pos == logits.dim() - 1   # the class dim last (the usual case): no moves
    d = torch.softmax(logits if last else logits.movedim(pos, -1), -1)
    d.scatter_add_(-1, labels.unsqueeze(-1), torch.full_like(labels, -1, dtype=d.dtype).unsqueeze(-1))
    d.mul_(g.unsqueeze(-1))
    return (d if last else d.movedim(-1, pos)).contiguous()


def _spec(node) -> ComputeSpec:
    logits = node.inputs[0]
    return ComputeSpec({d.name: d.size for d in logits.shape}, fixed=frozenset({node.attrs["dim"]}))


@register
class CrossEntropy(Op):
    """(logits, labels) -> (loss per example, logsumexp per example); attrs ``dim``, ``pos``."""

    name = "cross_entropy"

    def infer(self, inputs, attrs):
        logits, labels = inputs
        return [(labels.shape, logits.dtype), (labels.shape, logits.dtype)]

    def compute(self, ctx, attrs, logits, labels):
        return _forward(attrs["pos"], attrs["dim"], logits, labels)

    def direct(self, attrs):   # (reads no ctx)
        return functools.partial(_forward, attrs["pos"], attrs["dim"])

    def spec(self, node):
        return _spec(node)

    def flops(self, node, local):
        return 4 * math.prod(local.get(n, s) for n, s in _spec(node).dims.items())

    def grad(self, node, douts):
        g, g_lse = douts
        if g_lse is not None:
            raise ShapeError("cross_entropy: the logsumexp output is for the backward kernel only; "
                             "it has no gradient")
        if g is None:
            return [None, None]
        logits, labels = node.inputs
        return [apply("cross_entropy_backward", [logits, labels, node.outputs[1], g], dict(node.attrs)), None]


@register
class CrossEntropyBackward(Op):
    """(logits, labels, lse, d_loss) -> d_logits = (exp(logits - lse) - one_hot(labels)) * d_loss."""

    name = "cross_entropy_backward"
    differentiable = False

    def infer(self, inputs, attrs):
        logits = inputs[0]
        return [(logits.shape, logits.dtype)]

    def compute(self, ctx, attrs, logits, labels, lse, g):
        return _backward(attrs["pos"], logits, labels, lse, g)

    def direct(self, attrs):   # (reads no ctx)
        return functools.partial(_backward, attrs["pos"])

    def spec(self, node):
        return _spec(node)

    def flops(self, node, local):
        return 4 * math.prod(local.get(n, s) for n, s in _spec(node).dims.items())


def fused_cross_entropy(logits: Tensor, labels: Tensor, dim: str) -> Tensor:
    """The fused op's per-example loss (``labels`` has ``logits``' dims without ``dim``, in order)."""
    loss, _ = apply("cross_entropy", [logits, labels], {"dim": dim, "pos": logits.shape.index(dim)})
    return loss


def composite_forward(logits: Tensor, labels: Tensor, dim: str) -> tuple[Tensor, Tensor]:
    """(loss, lse) from the primitives, for a layout that splits ``dim``."""
    from .embed import one_hot
    from .reduce import logsumexp, reduce_sum
    lse = logsumexp(logits, [dim])
    picked = reduce_sum(logits * one_hot(labels, logits.shape.get(dim), logits.dtype, check=LABELS), [dim])
    return lse - picked, lse


def composite_backward(logits: Tensor, labels: Tensor, lse: Tensor, g: Tensor, dim: str) -> Tensor:
    """d_logits from the primitives: elementwise along ``dim``, so a split ``dim`` stays split."""
    from .elementwise import exp
    from .embed import one_hot
    from .shape_ops import transpose
    d = (exp(logits - lse) - one_hot(labels, logits.shape.get(dim), logits.dtype)) * g
    return d if d.shape.names == logits.shape.names else transpose(d, logits.shape.names)
