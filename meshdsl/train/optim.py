"""Optimizers built as graph ops, so their updates are lowered like everything else.

The update runs in the layout of the params (``params.`` rules), which makes a
ZeRO/FSDP-sharded update a matter of layout.
"""
from __future__ import annotations

from ..core.graph import Tensor
from ..ops.registry import apply


def sgd(params: dict[str, Tensor], grads: dict[str, Tensor], lr: float) -> dict[str, Tensor]:
    """Plain SGD: ``p - lr * g`` for every param; returns name -> updated param."""
    out = {}
    for k, p in params.items():
        g = grads[k]
        with p.graph.in_phase("update"):
            new = apply("sub", [p, g * lr], name=f"update/{k}")
            new = apply("stop_gradient", [new], name=f"new/{k}")
        new.scopes = p.scopes
        out[k] = new
    return out
