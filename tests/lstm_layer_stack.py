"""An LSTM-style stack: each layer's cell updates a carried (h, c), layer after layer (not over time).

Legend: B batch, I d_in, G gate (i, f, g, o), H hidden, HI hidden_in (h read by the next cell), O c_out,
L layer (the stack, scanned by ``md.repeat``).

The stack carries a tuple ``(h, c)`` [batch, hidden] each: every layer reads the input ``x``
through its own ``w`` and the carried ``h`` through its own ``u`` (both stacked over ``layer``),
as one LSTM cell per layer.  A pipeline over ``layer`` hands both carried tensors from stage to
stage.  The loss reads both: a readout of ``h`` against ``y`` and a small penalty on ``c``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 32
    d_in: int = 16
    hidden: int = 64
    layers: int = 8
    c_out: int = 4
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=8, d_in=3, hidden=4, layers=4, c_out=2)


def cell(h, c, x, w, u):
    """One LSTM cell: the new (h, c) from the carried (h, c), the input and one layer's weights."""
    pre = md.einsum("batch d_in, d_in gate hidden -> batch gate hidden", x, w) + \
        md.einsum("batch hidden_in, hidden_in gate hidden -> batch gate hidden", md.rename(h, hidden="hidden_in"), u)
    i, f, g, o = (md.squeeze(md.slice_(pre, "gate", k, k + 1), "gate") for k in range(4))
    c = md.sigmoid(f) * c + md.sigmoid(i) * md.tanh(g)
    return md.sigmoid(o) * md.tanh(c), c


def build(cfg: Config) -> md.Model:
    B, I, G = md.Dim("batch", cfg.batch), md.Dim("d_in", cfg.d_in), md.Dim("gate", 4)
    H, HI, O = md.Dim("hidden", cfg.hidden), md.Dim("hidden_in", cfg.hidden), md.Dim("c_out", cfg.c_out)
    L = md.Dim("layer", cfg.layers)
    with md.Graph() as g:
        x, y = md.input("x", [B, I]), md.input("y", [B, O])
        w_h, w_c = md.param("w_h", [I, H], fan_out=[H]), md.param("w_c", [I, H], fan_out=[H])
        w = md.param("w", [L, I, G, H], fan_out=[L, G, H])
        u = md.param("u", [L, HI, G, H], fan_out=[L, G, H])
        w_out = md.param("w_out", [H, O], fan_out=[O])
        h0 = md.tanh(md.einsum("batch d_in, d_in hidden -> batch hidden", x, w_h))
        c0 = md.einsum("batch d_in, d_in hidden -> batch hidden", x, w_c)

        def layer(hc, p):
            return cell(*hc, x, p["w"], p["u"])
        h, c = md.repeat(layer, (h0, c0), {"w": w, "u": u}, "layer", remat=cfg.remat)
        out = md.einsum("batch hidden, hidden c_out -> batch c_out", h, w_out)
        loss = md.reduce_mean((out - y) ** 2) + 0.01 * md.reduce_mean(c * c)

    def make_feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        x_ = torch.randn(cfg.batch, cfg.d_in, generator=gen)
        return {"x": x_, "y": torch.tanh(x_[:, :1] - x_[:, -1:]).expand(-1, cfg.c_out).contiguous()}

    return md.Model(g, loss, g.params(), make_feeds, cfg)
