"""iTransformer-lite: attention across the variates of a multivariate series.

A series ``[batch, variate, time]`` is normalised per variate (mean and std over ``time``); each
variate's whole normalised series is one token, embedded by one linear ``time -> d_model``.
Post-norm encoder blocks under ``md.repeat`` attend across variates (no mask), with LayerNorm
over ``d_model`` and a gelu FFN. A linear head ``d_model -> horizon`` forecasts each variate, the
normalisation is undone (times std, plus mean), and the loss is the MSE against the fed future.

Legend: b batch, c variate (k key_variate), t time, o horizon, d d_model, h heads, e d_head,
f d_ff, l layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    variates: int = 16
    time: int = 48
    horizon: int = 12
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 2
    batch: int = 8
    remat: str | None = None      # md.repeat's activation checkpointing (none, full, selective)

    @classmethod
    def tiny(cls) -> "Config":
        return cls(variates=6, time=10, horizon=4, d_model=8, heads=2, d_head=4, d_ff=12, layers=2, batch=4)


def build(cfg: Config = Config()) -> md.Model:
    b, c, t = md.Dim("batch", cfg.batch), md.Dim("variate", cfg.variates), md.Dim("time", cfg.time)
    o, d = md.Dim("horizon", cfg.horizon), md.Dim("d_model", cfg.d_model)
    h, e, f = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    lyr = md.Dim("layer", cfg.layers)
    with md.Graph("itransformer") as g:
        x = md.input("x", [b, c, t])
        y = md.input("y", [b, c, o])
        w_emb = md.param("w_emb", [t, d], fan_out=[d])
        b_emb = md.param("b_emb", [d], init="zeros")
        stacked = {
            "wq": md.param("wq", [lyr, d, h, e], fan_out=["layer", "heads", "d_head"]),
            "wk": md.param("wk", [lyr, d, h, e], fan_out=["layer", "heads", "d_head"]),
            "wv": md.param("wv", [lyr, d, h, e], fan_out=["layer", "heads", "d_head"]),
            "wo": md.param("wo", [lyr, h, e, d], fan_out=["layer", "d_model"]),
            "ln1": md.param("ln1", [lyr, d], init="ones"), "ln1_b": md.param("ln1_b", [lyr, d], init="zeros"),
            "w1": md.param("w1", [lyr, d, f], fan_out=["layer", "d_ff"]),
            "b1": md.param("b1", [lyr, f], init="zeros"),
            "w2": md.param("w2", [lyr, f, d], fan_out=["layer", "d_model"]),
            "ln2": md.param("ln2", [lyr, d], init="ones"), "ln2_b": md.param("ln2_b", [lyr, d], init="zeros"),
        }
        w_head = md.param("w_head", [d, o], fan_out=[o])
        b_head = md.param("b_head", [o], init="zeros")

        mean_bc = md.reduce_mean(x, "time")
        centred = x - mean_bc
        std_bc = md.sqrt(md.reduce_mean(centred * centred, "time") + 1e-5)
        tok = md.einsum("batch variate time, time d_model -> batch variate d_model", centred / std_bc, w_emb) + b_emb

        def block(z, w):
            q = md.einsum("batch variate d_model, d_model heads d_head -> batch variate heads d_head", z, w["wq"])
            k = md.rename(md.einsum("batch variate d_model, d_model heads d_head -> batch variate heads d_head", z, w["wk"]), variate="key_variate")
            val = md.rename(md.einsum("batch variate d_model, d_model heads d_head -> batch variate heads d_head", z, w["wv"]), variate="key_variate")
            a = md.attention(q, k, val, "variate", "key_variate", "d_head", causal=False)
            z = md.layer_norm(z + md.einsum("batch variate heads d_head, heads d_head d_model -> batch variate d_model", a, w["wo"]),
                              "d_model", w["ln1"], w["ln1_b"])
            u = md.gelu(md.einsum("batch variate d_model, d_model d_ff -> batch variate d_ff", z, w["w1"]) + w["b1"])
            u = md.einsum("batch variate d_ff, d_ff d_model -> batch variate d_model", u, w["w2"])
            return md.layer_norm(z + u, "d_model", w["ln2"], w["ln2_b"])

        z = md.repeat(block, tok, stacked, "layer", remat=cfg.remat)
        pred = md.einsum("batch variate d_model, d_model horizon -> batch variate horizon", z, w_head) + b_head
        pred = pred * std_bc + mean_bc
        loss = md.reduce_mean((pred - y) ** 2)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        steps = torch.arange(cfg.time + cfg.horizon, dtype=torch.float32)
        freq = 0.2 + torch.rand(cfg.batch, cfg.variates, 1, generator=gen)
        level = 3 * torch.randn(cfg.batch, cfg.variates, 1, generator=gen)
        series = level + torch.sin(freq * steps) + 0.1 * torch.randn(cfg.batch, cfg.variates, len(steps), generator=gen)
        return {"x": series[..., :cfg.time], "y": series[..., cfg.time:]}

    return md.Model(g, loss, g.params(), feeds, cfg)


# ---- the plain-torch reference (tests/test_heldout_round26a.py compares it with the model) ----

REF_INPUTS = ["x", "y"]


def reference_loss(cfg: Config, p: dict, x, y):
    """The model in plain torch: instance norm by hand, sdpa across variates, post-norm blocks."""
    F = torch.nn.functional
    mean = x.mean(-1, keepdim=True)
    std = torch.sqrt(((x - mean) ** 2).mean(-1, keepdim=True) + 1e-5)
    z = ((x - mean) / std) @ p["w_emb"] + p["b_emb"]                 # [b, c, d]
    for i in range(cfg.layers):
        q, k, v = (torch.einsum("bcd,dhe->bhce", z, p[w][i]) for w in ("wq", "wk", "wv"))
        a = torch.einsum("bhce,hed->bcd", F.scaled_dot_product_attention(q, k, v), p["wo"][i])
        z = F.layer_norm(z + a, (cfg.d_model,), p["ln1"][i], p["ln1_b"][i])
        u = F.gelu(z @ p["w1"][i] + p["b1"][i]) @ p["w2"][i]
        z = F.layer_norm(z + u, (cfg.d_model,), p["ln2"][i], p["ln2_b"][i])
    pred = (z @ p["w_head"] + p["b_head"]) * std + mean
    return ((pred - y) ** 2).mean()
