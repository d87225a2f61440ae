"""CfC, a closed-form liquid time-constant RNN (held-out round 26b), written from the guides alone.

Legend: B batch, T time (the recurrence, scanned by ``md.repeat``), I c_in, H hidden, K backbone,
O c_out.

Each step reads its input ``x_t`` and its fed time gap ``dt_t`` (irregular sampling) as the
repeat's stacked per-step tensors. A backbone MLP of ``[x_t, h]`` feeds three heads f, g, h;
the new state is ``sigmoid(-f * t) * g + (1 - sigmoid(-f * t)) * h`` with ``t = dt_t``. Each
step's readout is a per-step output of the repeat (stacked over ``time``); the loss is its MSE.
The weights are shared by every step: the block reads them from outside the stack.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 16
    time: int = 24
    c_in: int = 4
    hidden: int = 32
    backbone: int = 32
    c_out: int = 2
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, time=6, c_in=3, hidden=8, backbone=8, c_out=2)


def build(cfg: Config) -> md.Model:
    B, T, I = md.Dim("batch", cfg.batch), md.Dim("time", cfg.time), md.Dim("c_in", cfg.c_in)
    H, K, O = md.Dim("hidden", cfg.hidden), md.Dim("backbone", cfg.backbone), md.Dim("c_out", cfg.c_out)
    with md.Graph() as g:
        x = md.input("x", [B, T, I])
        dt = md.input("dt", [B, T])
        y = md.input("y", [B, T, O])
        w_x = md.param("w_x", [I, K], fan_out=[K])
        w_h = md.param("w_h", [H, K], fan_out=[K])
        b_k = md.param("b_k", [K], init="zeros")
        heads = {n: md.param(f"head_{n}", [K, H], fan_out=[H]) for n in ("f", "g", "h")}
        bias = {n: md.param(f"bias_{n}", [H], init="zeros") for n in ("f", "g", "h")}
        w_out = md.param("w_out", [H, O], fan_out=[O])

        def step(h, s):
            z = md.einsum("batch c_in, c_in backbone -> batch backbone", s["x"], w_x)
            z = md.tanh(z + md.einsum("batch hidden, hidden backbone -> batch backbone", h, w_h) + b_k)
            head = {n: md.einsum("batch backbone, backbone hidden -> batch hidden", z, heads[n]) + bias[n]
                    for n in heads}
            gate = md.sigmoid(-head["f"] * s["dt"])
            new = gate * md.tanh(head["g"]) + (1.0 - gate) * md.tanh(head["h"])
            return new, {"out": md.einsum("batch hidden, hidden c_out -> batch c_out", new, w_out)}

        h0 = md.constant(0.0, [B, H])
        per_step = {"x": md.transpose(x, ["time", "batch", "c_in"]), "dt": md.transpose(dt, ["time", "batch"])}
        _, outs = md.repeat(step, h0, per_step, "time", remat=cfg.remat)
        loss = md.reduce_mean((outs["out"] - y) ** 2)

    def make_feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        dt_ = 0.1 + torch.rand(cfg.batch, cfg.time, generator=gen)
        t = torch.cumsum(dt_, 1)
        x_ = torch.randn(cfg.batch, cfg.time, cfg.c_in, generator=gen)
        y_ = torch.stack([torch.sin(t), torch.cos(0.5 * t)], -1)[..., :cfg.c_out]
        y_ = y_ + 0.1 * x_[..., :1]
        return {"x": x_, "dt": dt_, "y": y_}

    return md.Model(g, loss, g.params(), make_feeds, cfg)


REF_INPUTS = ("x", "dt", "y")


def reference_loss(cfg: Config, p: dict, x, dt, y):
    """The same recurrence as a Python loop over time in plain torch."""
    h = torch.zeros(x.shape[0], cfg.hidden, dtype=x.dtype)
    outs = []
    for t in range(x.shape[1]):
        z = torch.tanh(x[:, t] @ p["w_x"] + h @ p["w_h"] + p["b_k"])
        f, g, hh = (z @ p[f"head_{n}"] + p[f"bias_{n}"] for n in ("f", "g", "h"))
        gate = torch.sigmoid(-f * dt[:, t, None])
        h = gate * torch.tanh(g) + (1 - gate) * torch.tanh(hh)
        outs.append(h @ p["w_out"])
    return ((torch.stack(outs, 1) - y) ** 2).mean()
