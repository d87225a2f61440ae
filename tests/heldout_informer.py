"""Informer-lite (held-out round 26b): ProbSparse self-attention, a distilling layer, MSE forecast.

Written from the guides alone. Legend: B batch, T time (encoder 1), U time after distilling
(encoder 2), D d_model, H heads, E d_head, S sampled keys per query, O horizon, C series.

ProbSparse attention: each query's sparsity measure M = max - mean of its scores against a fed
random sample of keys; the top-u queries by M (``md.top_k``) get full attention, the others the
mean of V. The distilling layer between the two encoder layers is a conv over time, ELU and a
max-pool of stride 2. The forecast head reads the distilled sequence; the loss is MSE.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 8
    time: int = 32
    series: int = 3
    d_model: int = 32
    heads: int = 4
    d_ff: int = 64
    sample: int = 8        # keys sampled per query for the sparsity measure
    horizon: int = 8
    factor: int = 1        # u = factor * ceil(ln L) active queries per layer

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, time=16, series=2, d_model=8, heads=2, d_ff=16, sample=4, horizon=4)


def _prob_sparse(x, p, cfg, tdim: str, sample_ids):
    """ProbSparse self-attention over ``tdim`` with its sampled key ids [tdim, sample]."""
    kdim = "key_" + tdim
    q = md.einsum(f"batch {tdim} d_model, d_model heads d_head -> batch {tdim} heads d_head", x, p["wq"])
    k = md.rename(md.einsum(f"batch {tdim} d_model, d_model heads d_head -> batch {tdim} heads d_head",
                            x, p["wk"]), {tdim: kdim})
    v = md.rename(md.einsum(f"batch {tdim} d_model, d_model heads d_head -> batch {tdim} heads d_head",
                            x, p["wv"]), {tdim: kdim})
    # the sampled keys of each query, then its scores against them
    pick = md.one_hot(sample_ids, k.shape[kdim])                       # [tdim, sample, kdim]
    k_s = md.einsum(f"{tdim} sample {kdim}, batch {kdim} heads d_head -> batch {tdim} sample heads d_head", pick, k)
    qk_s = md.einsum(f"batch {tdim} heads d_head, batch {tdim} sample heads d_head -> batch heads {tdim} sample",
                     q, k_s)
    sparsity = md.reduce_max(qk_s, "sample") - md.reduce_mean(qk_s, "sample")   # [batch, heads, tdim]
    n = x.shape[tdim].size
    u = min(n, cfg.factor * math.ceil(math.log(n)))
    _, top = md.top_k(md.stop_gradient(sparsity), tdim, u, new_dim="active")    # [batch, heads, active]
    active = md.reduce_sum(md.one_hot(top, x.shape[tdim]), "active")             # [batch, heads, tdim] 0/1
    full = md.attention(q, k, v, tdim, kdim, "d_head", causal=False)             # [batch, tdim, heads, d_head]
    lazy = md.reduce_mean(v, kdim)                                               # [batch, heads, d_head]
    out = active * full + (1.0 - active) * lazy
    return md.einsum(f"batch {tdim} heads d_head, heads d_head d_model -> batch {tdim} d_model", out, p["wo"])


def _encoder_layer(x, p, cfg, tdim, sample_ids):
    h = md.layer_norm(x + _prob_sparse(x, p, cfg, tdim, sample_ids), "d_model", p["ln1"])
    f = md.gelu(md.einsum(f"batch {tdim} d_model, d_model d_ff -> batch {tdim} d_ff", h, p["w1"]))
    f = md.einsum(f"batch {tdim} d_ff, d_ff d_model -> batch {tdim} d_model", f, p["w2"])
    return md.layer_norm(h + f, "d_model", p["ln2"])


def _layer_params(i, D, H, E, F):
    return {
        "wq": md.param(f"wq{i}", [D, H, E], fan_out=[H, E]),
        "wk": md.param(f"wk{i}", [D, H, E], fan_out=[H, E]),
        "wv": md.param(f"wv{i}", [D, H, E], fan_out=[H, E]),
        "wo": md.param(f"wo{i}", [H, E, D], fan_out=[D]),
        "ln1": md.param(f"ln1_{i}", [D], init="ones"),
        "w1": md.param(f"w1_{i}", [D, F], fan_out=[F]),
        "w2": md.param(f"w2_{i}", [F, D], fan_out=[D]),
        "ln2": md.param(f"ln2_{i}", [D], init="ones"),
    }


def _distil(x, w_conv):
    """Conv over time, ELU, max-pool of stride 2: time T -> u = T / 2."""
    h = md.rename(md.conv(x, w_conv, {"time": "tap"}, padding="same"), {"d_out": "d_model"})
    h = md.elu(h)
    h = md.rearrange(h, "batch (u two) d_model -> batch u two d_model", two=2)
    return md.reduce_max(h, "two")


def build(cfg: Config) -> md.Model:
    B, T, C = md.Dim("batch", cfg.batch), md.Dim("time", cfg.time), md.Dim("series", cfg.series)
    D, H = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads)
    E, F = md.Dim("d_head", cfg.d_model // cfg.heads), md.Dim("d_ff", cfg.d_ff)
    S, O, U = md.Dim("sample", cfg.sample), md.Dim("horizon", cfg.horizon), md.Dim("u", cfg.time // 2)
    with md.Graph() as g:
        x = md.input("x", [B, T, C])
        y = md.input("y", [B, O, C])
        s1 = md.input("sample1", [T, S], dtype=torch.int64)
        s2 = md.input("sample2", [U, S], dtype=torch.int64)
        w_in = md.param("w_in", [C, D], fan_out=[D])
        pos = md.param("pos", [T, D], scale=0.02)
        h = md.einsum("batch time series, series d_model -> batch time d_model", x, w_in) + pos
        h = _encoder_layer(h, _layer_params(1, D, H, E, F), cfg, "time", s1)
        h = _distil(h, md.param("w_conv", [md.Dim("tap", 3), D, md.Dim("d_out", cfg.d_model)],
                                fan_out=["d_out"]))
        h = _encoder_layer(h, _layer_params(2, D, H, E, F), cfg, "u", s2)
        w_out = md.param("w_out", [U, D, O, C], fan_out=[O, C])
        pred = md.einsum("batch u d_model, u d_model horizon series -> batch horizon series", h, w_out)
        loss = md.reduce_mean((pred - y) ** 2)

    def make_feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        t = torch.arange(cfg.time + cfg.horizon, dtype=torch.float32)
        phase = torch.rand(cfg.batch, 1, cfg.series, generator=gen) * 6.28
        series = torch.sin(t[None, :, None] * 0.4 + phase) + 0.1 * torch.randn(
            cfg.batch, cfg.time + cfg.horizon, cfg.series, generator=gen)
        return {"x": series[:, :cfg.time], "y": series[:, cfg.time:],
                "sample1": torch.randint(0, cfg.time, (cfg.time, cfg.sample), generator=gen),
                "sample2": torch.randint(0, cfg.time // 2, (cfg.time // 2, cfg.sample), generator=gen)}

    return md.Model(g, loss, g.params(), make_feeds, cfg)


REF_INPUTS = ("x", "y", "sample1", "sample2")


def reference_loss(cfg: Config, p: dict, x, y, sample1, sample2):
    """The same model in plain torch: a scatter of the top-u queries, sdpa, conv1d + max_pool1d."""
    import torch.nn.functional as F

    def prob_sparse(h, i, samples):
        q, k, v = (torch.einsum("btd,dhe->bhte", h, p[f"w{n}{i}"]) for n in "qkv")
        qk_s = torch.einsum("bhte,bhtse->bhts", q, k[:, :, samples])    # each query's sampled keys
        sparsity = qk_s.amax(-1) - qk_s.mean(-1)
        n = h.shape[1]
        u = min(n, cfg.factor * math.ceil(math.log(n)))
        top = sparsity.detach().topk(u, dim=-1).indices
        active = torch.zeros_like(sparsity).scatter(-1, top, 1.0)[..., None]
        out = active * F.scaled_dot_product_attention(q, k, v) + (1 - active) * v.mean(2, keepdim=True)
        return torch.einsum("bhte,hed->btd", out, p[f"wo{i}"])

    def layer(h, i, samples):
        h = F.layer_norm(h + prob_sparse(h, i, samples), h.shape[-1:], p[f"ln1_{i}"])
        f = F.gelu(h @ p[f"w1_{i}"]) @ p[f"w2_{i}"]
        return F.layer_norm(h + f, h.shape[-1:], p[f"ln2_{i}"])

    h = layer(x @ p["w_in"] + p["pos"], 1, sample1)
    h = F.conv1d(h.transpose(1, 2), p["w_conv"].permute(2, 1, 0), padding=1)
    h = F.max_pool1d(F.elu(h), 2).transpose(1, 2)
    h = layer(h, 2, sample2)
    pred = torch.einsum("bud,udoc->boc", h, p["w_out"])
    return ((pred - y) ** 2).mean()
