"""A RetNet-style retention ViT (RMT-like 2-D decay), a held-out model (round 24a).

Legend: batch = images, height/width/rgb = pixels, patches = grid*grid image patches (row-major),
key_patches = the same patches as keys, d_in = a patch's pixels, d_model/heads/d_head/d_ff as in a
transformer, classes = image classes. Retention (parallel form, no softmax): (q k^T * D) v, with
D[h, i, j] = gamma_h ** manhattan(i, j), the Manhattan distance of patch i's and j's grid cells from
md.arange's integer math (// and %), each row of D normalised by its sum; then a per-head RMS norm.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 8
    image: int = 16
    patch: int = 4
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 2
    classes: int = 10
    remat: str | None = None

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=2, image=8, patch=2, d_model=8, heads=2, d_head=4, d_ff=16, layers=2, classes=3)


def _decay(P, KP, Hh, grid: int):
    """[heads, patches, key_patches]: gamma_h ** |row_i - row_j| + |col_i - col_j|, rows summing to 1."""
    i, j = md.arange(P), md.arange(KP)
    dist = abs(i // grid - j // grid) + abs(i % grid - j % grid)              # int64 [patches, key_patches]
    log_gamma = md.constant(torch.tensor([math.log(1 - 2.0 ** (-2 - h)) for h in range(Hh.size)]), [Hh])
    d = md.exp(md.cast(dist, torch.float32) * log_gamma)
    return d / md.reduce_sum(d, "key_patches")


def _block(x, p, decay):
    h = md.layer_norm(x, "d_model", p["ln1"], p["ln1_b"])
    q = md.einsum("batch patches d_model, d_model heads d_head -> batch patches heads d_head", h, p["wq"])
    k = md.rename(md.einsum("batch patches d_model, d_model heads d_head -> batch patches heads d_head", h, p["wk"]),
                  {"patches": "key_patches"})
    v = md.rename(md.einsum("batch patches d_model, d_model heads d_head -> batch patches heads d_head", h, p["wv"]),
                  {"patches": "key_patches"})
    s = md.einsum("batch patches heads d_head, batch key_patches heads d_head -> batch heads patches key_patches", q, k)
    o = md.einsum("batch heads patches key_patches, batch key_patches heads d_head -> batch patches heads d_head",
                  s * decay, v)
    o = md.rms_norm(o, "d_head", p["gn"])
    x = x + md.einsum("batch patches heads d_head, heads d_head d_model -> batch patches d_model", o, p["wo"])
    h = md.layer_norm(x, "d_model", p["ln2"], p["ln2_b"])
    h = md.gelu(md.einsum("batch patches d_model, d_model d_ff -> batch patches d_ff", h, p["fc"]))
    return x + md.einsum("batch patches d_ff, d_ff d_model -> batch patches d_model", h, p["proj"])


def build(cfg: Config) -> md.Model:
    grid = cfg.image // cfg.patch
    B, S, W, R = md.Dim("batch", cfg.batch), md.Dim("height", cfg.image), md.Dim("width", cfg.image), md.Dim("rgb", 3)
    P, KP = md.Dim("patches", grid * grid), md.Dim("key_patches", grid * grid)
    D, Hh, E, F = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    L, K, I = md.Dim("layer", cfg.layers), md.Dim("classes", cfg.classes), md.Dim("d_in", cfg.patch * cfg.patch * 3)
    with md.Graph() as g:
        img = md.input("image", [B, S, W, R])
        labels = md.input("labels", [B], dtype=torch.int64)
        x = md.rearrange(img, "batch (gh ph) (gw pw) rgb -> batch (gh gw) (ph pw rgb)", ph=cfg.patch, pw=cfg.patch)
        x = md.rename(x, {"gh_gw": "patches", "ph_pw_rgb": "d_in"})
        x = md.einsum("batch patches d_in, d_in d_model -> batch patches d_model", x, md.param("w_emb", [I, D], fan_out=[D]))
        x = x + md.param("pos", [P, D], scale=0.02)
        decay = _decay(P, KP, Hh, grid)
        stacked = {n: md.param(n, [L, D, Hh, E], fan_out=["layer", "heads", "d_head"]) for n in ("wq", "wk", "wv")}
        stacked["wo"] = md.param("wo", [L, Hh, E, D], fan_out=["layer", "d_model"])
        stacked["fc"] = md.param("fc", [L, D, F], fan_out=["layer", "d_ff"])
        stacked["proj"] = md.param("proj", [L, F, D], fan_out=["layer", "d_model"])
        stacked["gn"] = md.param("gn", [L, E], init="ones")
        for n in ("ln1", "ln2"):
            stacked[n] = md.param(n, [L, D], init="ones")
            stacked[f"{n}_b"] = md.param(f"{n}_b", [L, D], init="zeros")
        x = md.repeat(lambda c, p: _block(c, p, decay), x, stacked, "layer", remat=cfg.remat)
        pooled = md.reduce_mean(md.layer_norm(x, "d_model", md.param("ln_f", [D], init="ones"),
                                              md.param("ln_f_b", [D], init="zeros")), "patches")
        logits = md.einsum("batch d_model, d_model classes -> batch classes", pooled, md.param("w_head", [D, K], fan_out=[K]))
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))

    def feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        return {"image": torch.randn(cfg.batch, cfg.image, cfg.image, 3, generator=gen),
                "labels": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    return md.Model(g, loss, g.params(), feeds, cfg)


REF_INPUTS = ("image", "labels")


def reference_loss(cfg: Config, p: dict, image, labels):
    """The same model in plain torch: the decay mask from a meshgrid of patch coordinates."""
    F = torch.nn.functional
    g, P, D = cfg.image // cfg.patch, cfg.patch, cfg.d_model
    b = image.shape[0]
    x = image.reshape(b, g, P, g, P, 3).permute(0, 1, 3, 2, 4, 5).reshape(b, g * g, P * P * 3)
    x = x @ p["w_emb"] + p["pos"]
    r, c = torch.div(torch.arange(g * g), g, rounding_mode="floor"), torch.arange(g * g) % g
    dist = ((r[:, None] - r[None]).abs() + (c[:, None] - c[None]).abs()).to(x.dtype)
    gamma = torch.tensor([1 - 2.0 ** (-2 - h) for h in range(cfg.heads)], dtype=x.dtype)
    dec = gamma[:, None, None] ** dist
    dec = dec / dec.sum(-1, keepdim=True)
    for i in range(cfg.layers):
        h = F.layer_norm(x, (D,), p["ln1"][i], p["ln1_b"][i])
        q, k, v = (torch.einsum("bpd,dhe->bhpe", h, p[w][i]) for w in ("wq", "wk", "wv"))
        o = (q @ k.transpose(-1, -2) * dec) @ v                               # [b, heads, patches, d_head]
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * p["gn"][i]     # md.rms_norm's eps
        x = x + torch.einsum("bhpe,hed->bpd", o, p["wo"][i])
        x = x + F.gelu(F.layer_norm(x, (D,), p["ln2"][i], p["ln2_b"][i]) @ p["fc"][i]) @ p["proj"][i]
    x = F.layer_norm(x, (D,), p["ln_f"], p["ln_f_b"]).mean(1)
    return F.cross_entropy(x @ p["w_head"], labels)
