"""A one-layer mixture-of-experts regression model: the smallest expert-parallel example.

Dims:
  batch         tokens, as the data pipeline splits them
  expert_batch  the same token slots, seen from the expert side
  d_model       token features
  experts       experts, each an MLP d_model -> d_ff -> d_model
  d_ff          expert hidden features

Routing is top-1 with *dense dispatch*: every expert gets every token slot,
zeroed where the token went to another expert.  That keeps shapes static and
the example short (a capacity-limited dispatch would shrink ``expert_batch``).

The expert-parallel move is a rename, as in Mesh-TensorFlow's MoE layer: with
``"batch:data; experts:data"``, the dispatched tokens [experts, batch, d_model]
are split by ``batch``; renaming ``batch`` to ``expert_batch`` hands the
``data`` axis to ``experts``, which the compiler lowers to one alltoall (and
one more on the way back).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md
from meshdsl import Model


@dataclass(frozen=True)
class Config:
    batch: int = 256
    d_model: int = 256
    experts: int = 8
    d_ff: int = 512

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=8, d_model=8, experts=4, d_ff=8)


def build(cfg: Config = Config()) -> Model:
    """Build the MoE layer and its mean-squared-error loss."""
    b, d = md.Dim("batch", cfg.batch), md.Dim("d_model", cfg.d_model)
    e, f = md.Dim("experts", cfg.experts), md.Dim("d_ff", cfg.d_ff)
    with md.Graph("moe") as g:
        x_bd = md.input("x", [b, d])
        target_bd = md.input("target", [b, d])
        w_gate = md.param("w_gate", [d, e], fan_out=[e])
        w_in = md.param("w_in", [e, d, f], fan_out=[e, f])
        w_out = md.param("w_out", [e, f, d], fan_out=[e, d])

        logits_be = md.einsum("batch d_model, d_model experts -> batch experts", x_bd, w_gate)
        top1_be = md.stop_gradient(md.cast(logits_be >= md.reduce_max(logits_be, "experts"), x_bd.dtype))
        gate_be = md.softmax(logits_be, "experts") * top1_be

        # Dispatch, then hand the mesh axis from the token dim to the experts dim.
        xin_ebd = md.einsum("batch d_model, batch experts -> experts batch d_model", x_bd, top1_be)
        xin_ebd = md.rename(xin_ebd, batch="expert_batch")
        h_ebf = md.relu(md.einsum("experts expert_batch d_model, experts d_model d_ff -> experts expert_batch d_ff",
                                  xin_ebd, w_in))
        y_ebd = md.einsum("experts expert_batch d_ff, experts d_ff d_model -> experts expert_batch d_model",
                          h_ebf, w_out)
        # ... and back to the token layout, weighting each token by its gate.
        y_ebd = md.rename(y_ebd, expert_batch="batch")
        y_bd = md.einsum("experts batch d_model, batch experts -> batch d_model", y_ebd, gate_be)
        loss = md.reduce_mean((y_bd - target_bd) ** 2)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(cfg.batch, cfg.d_model, generator=gen),
                "target": torch.randn(cfg.batch, cfg.d_model, generator=gen)}

    return Model(g, loss, {"w_gate": w_gate, "w_in": w_in, "w_out": w_out}, feeds, cfg)
