"""Optimizers built as graph ops, so their updates are lowered like everything else.

The update runs in the layout of the params (``params.`` rules), which makes a
ZeRO/FSDP-sharded update a matter of layout: every tensor of the update
carries its param's layout scopes.
"""
from __future__ import annotations

import torch

from ..core.graph import Tensor
from ..errors import ShapeError, message
from ..ops.registry import Op, apply, register


@register
class SgdUpdate(Op):
    """``p - lr * g`` in one kernel (one buffer, not two)."""

    name = "sgd_update"

    def infer(self, inputs, attrs):
        p, g = inputs
        if p.shape != g.shape or p.dtype != g.dtype:
            raise ShapeError(message(f"sgd: gradient {g!r} does not match param {p!r}.",
                                     rule="a gradient has its param's dims (in order) and dtype",
                                     fix="pass the gradients md.grad returned for these params"))
        return [(p.shape, p.dtype)]

    def compute(self, ctx, attrs, p, g):
        return torch.add(p, g, alpha=-attrs["lr"])

    def compute_inplace(self, ctx, attrs, p, g):
        """The same update written into ``p`` (used when the executor may donate it)."""
        return p.add_(g, alpha=-attrs["lr"])

    def grad(self, node, douts):
        d = douts[0]
        return [None, None] if d is None else [d, d * -node.attrs["lr"]]


def sgd(params: dict[str, Tensor], grads: dict[str, Tensor], lr: float) -> dict[str, Tensor]:
    """Plain SGD: ``p - lr * g`` for every param; returns name -> updated param."""
    out = {}
    for k, p in params.items():
        with p.graph.in_phase("update"):
            new = apply("sgd_update", [p, grads[k]], {"lr": float(lr)}, name=f"new/{k}")
        new.scopes = p.scopes
        out[k] = new
    return out
