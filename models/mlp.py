"""A two-layer MLP regression model, the smallest example of the model protocol.

Dims:
  batch    examples in the batch
  d_model  input / output features
  d_ff     hidden features

    x_bd -> w1 (d_model d_ff) -> relu -> w2 (d_ff d_model) -> y_bd
    loss = mean((y_bd - target_bd) ** 2)

Layouts stay out of this file; try ``"batch:data"`` (DP), ``"d_ff:model"``
(Megatron TP) or ``"batch:data; params.d_model:data"`` (FSDP).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md
from meshdsl import Model


@dataclass(frozen=True)
class Config:
    batch: int = 64
    d_model: int = 512
    d_ff: int = 2048

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=8, d_model=8, d_ff=16)


def build(cfg: Config = Config()) -> Model:
    """Build the MLP and its mean-squared-error loss."""
    batch, d_model, d_ff = md.Dim("batch", cfg.batch), md.Dim("d_model", cfg.d_model), md.Dim("d_ff", cfg.d_ff)
    with md.Graph("mlp") as g:
        x_bd = md.input("x", [batch, d_model])
        target_bd = md.input("target", [batch, d_model])
        w1 = md.param("w1", [d_model, d_ff], fan_out=[d_ff])
        w2 = md.param("w2", [d_ff, d_model], fan_out=[d_model])
        h_bf = md.relu(md.einsum("batch d_model, d_model d_ff -> batch d_ff", x_bd, w1))
        y_bd = md.einsum("batch d_ff, d_ff d_model -> batch d_model", h_bf, w2)
        loss = md.reduce_mean((y_bd - target_bd) ** 2)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(cfg.batch, cfg.d_model, generator=gen),
                "target": torch.randn(cfg.batch, cfg.d_model, generator=gen)}

    return Model(g, loss, {"w1": w1, "w2": w2}, feeds, cfg)
