"""A space-time (divided attention) video transformer, a held-out model (round 23a).

Legend: batch = clips, time = frames, patches = patches per frame, d_in = a patch's pixels,
d_model / heads / d_head / d_ff as in a transformer, classes = video classes. Each block (md.repeat
over layer) runs temporal attention (every patch position over the frames: time vs key_time), then
spatial attention (every frame over its patches: patches vs key_patches), then a gelu MLP, each
pre-norm with a residual. Head: mean over time and patches, a linear classifier, cross-entropy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 8
    time: int = 8
    patches: int = 16
    d_in: int = 48
    d_model: int = 64
    heads: int = 4
    d_head: int = 16
    d_ff: int = 256
    layers: int = 2
    classes: int = 10
    remat: str | None = None

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=2, time=4, patches=4, d_in=6, d_model=8, heads=2, d_head=4, d_ff=16, layers=2, classes=3)


def _attend(h, p, pre: str, query: str, key: str):
    q = md.einsum("... d_model, d_model heads d_head -> ... heads d_head", h, p[f"{pre}q"])
    k = md.rename(md.einsum("... d_model, d_model heads d_head -> ... heads d_head", h, p[f"{pre}k"]), {query: key})
    v = md.rename(md.einsum("... d_model, d_model heads d_head -> ... heads d_head", h, p[f"{pre}v"]), {query: key})
    o = md.attention(q, k, v, query, key, "d_head", causal=False)
    return md.einsum("... heads d_head, heads d_head d_model -> ... d_model", o, p[f"{pre}o"])


def _block(x, p):
    x = x + _attend(md.layer_norm(x, "d_model", p["ln_t"], p["ln_t_b"]), p, "t", "time", "key_time")
    x = x + _attend(md.layer_norm(x, "d_model", p["ln_s"], p["ln_s_b"]), p, "s", "patches", "key_patches")
    h = md.layer_norm(x, "d_model", p["ln_m"], p["ln_m_b"])
    h = md.gelu(md.einsum("... d_model, d_model d_ff -> ... d_ff", h, p["w_fc"]) + p["b_fc"])
    return x + md.einsum("... d_ff, d_ff d_model -> ... d_model", h, p["w_proj"])


def build(cfg: Config) -> md.Model:
    B, T, P = md.Dim("batch", cfg.batch), md.Dim("time", cfg.time), md.Dim("patches", cfg.patches)
    I, D, L = md.Dim("d_in", cfg.d_in), md.Dim("d_model", cfg.d_model), md.Dim("layer", cfg.layers)
    Hh, E, F = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    K = md.Dim("classes", cfg.classes)
    with md.Graph() as g:
        video = md.input("video", [B, T, P, I])
        labels = md.input("labels", [B], dtype=torch.int64)
        x = md.einsum("batch time patches d_in, d_in d_model -> batch time patches d_model", video,
                      md.param("w_emb", [I, D], fan_out=[D]))
        x = x + md.param("pos_t", [T, D], scale=0.02) + md.param("pos_s", [P, D], scale=0.02)
        stacked = {}
        for pre in ("t", "s"):
            stacked[f"ln_{pre}"] = md.param(f"ln_{pre}", [L, D], init="ones")
            stacked[f"ln_{pre}_b"] = md.param(f"ln_{pre}_b", [L, D], init="zeros")
            for w in "qkv":
                stacked[f"{pre}{w}"] = md.param(f"{pre}{w}", [L, D, Hh, E], fan_out=["layer", "heads", "d_head"])
            stacked[f"{pre}o"] = md.param(f"{pre}o", [L, Hh, E, D], fan_out=["layer", "d_model"])
        stacked["ln_m"] = md.param("ln_m", [L, D], init="ones")
        stacked["ln_m_b"] = md.param("ln_m_b", [L, D], init="zeros")
        stacked["w_fc"] = md.param("w_fc", [L, D, F], fan_out=["layer", "d_ff"])
        stacked["b_fc"] = md.param("b_fc", [L, F], init="zeros")
        stacked["w_proj"] = md.param("w_proj", [L, F, D], fan_out=["layer", "d_model"])
        x = md.repeat(_block, x, stacked, "layer", remat=cfg.remat)
        x = md.layer_norm(x, "d_model", md.param("ln_f", [D], init="ones"), md.param("ln_f_b", [D], init="zeros"))
        pooled = md.reduce_mean(x, ["time", "patches"])
        logits = md.einsum("batch d_model, d_model classes -> batch classes", pooled,
                           md.param("w_head", [D, K], fan_out=[K])) + md.param("b_head", [K], init="zeros")
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))

    def feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        return {"video": torch.randn(cfg.batch, cfg.time, cfg.patches, cfg.d_in, generator=gen),
                "labels": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    return md.Model(g, loss, g.params(), feeds, cfg)


REF_INPUTS = ("video", "labels")


def _ref_attend(h, p, pre, i, along_time: bool):
    F = torch.nn.functional
    q, k, v = (torch.einsum("btpd,dhe->btphe", h, p[f"{pre}{w}"][i]) for w in "qkv")
    # sdpa attends over the second-to-last dim: move the attended dim there, heads before it
    perm = (0, 2, 3, 1, 4) if along_time else (0, 1, 3, 2, 4)
    o = F.scaled_dot_product_attention(*(t.permute(perm) for t in (q, k, v)))
    o = o.permute(0, 3, 1, 2, 4) if along_time else o.permute(0, 1, 3, 2, 4)
    return torch.einsum("btphe,hed->btpd", o, p[f"{pre}o"][i])


def reference_loss(cfg: Config, p: dict, video, labels):
    """The same model in plain torch (F.scaled_dot_product_attention, F.layer_norm, F.cross_entropy)."""
    F = torch.nn.functional
    D = cfg.d_model
    x = video @ p["w_emb"] + p["pos_t"][None, :, None] + p["pos_s"][None, None]
    for i in range(cfg.layers):
        x = x + _ref_attend(F.layer_norm(x, (D,), p["ln_t"][i], p["ln_t_b"][i]), p, "t", i, True)
        x = x + _ref_attend(F.layer_norm(x, (D,), p["ln_s"][i], p["ln_s_b"][i]), p, "s", i, False)
        h = F.gelu(F.layer_norm(x, (D,), p["ln_m"][i], p["ln_m_b"][i]) @ p["w_fc"][i] + p["b_fc"][i])
        x = x + h @ p["w_proj"][i]
    x = F.layer_norm(x, (D,), p["ln_f"], p["ln_f_b"]).mean((1, 2))
    return F.cross_entropy(x @ p["w_head"] + p["b_head"], labels)
