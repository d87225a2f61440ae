"""Flow-matching DiT-lite: a rectified-flow loss on a small diffusion transformer.

Images ``x1 [batch, height, width, channels]`` and fed noise ``x0`` are mixed at a fed time
``t`` per sample, ``x_t = (1 - t) x0 + t x1``; the model predicts the velocity ``x1 - x0`` (MSE),
both in patch space (``md.rearrange`` patchify). The condition is a sinusoidal embedding of
``t`` through an MLP plus a class embedding (``md.gather``). Blocks under ``md.repeat`` are
adaLN-zero: six modulations (shift, scale, gate for attention and for the MLP) from the
condition, around LayerNorms without affine. The modulation weights start small but not zero,
so every weight has a gradient to compare.

Legend: b batch, hp wp patch rows and columns, n patches (k key_patches), q pixels (one
patch's values), d d_model, c d_cond, h heads, e d_head, f d_ff, m mod, z freq, y classes,
l layer.
"""
from __future__ import annotations

from dataclasses import dataclass
import math

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    image: int = 16
    patch: int = 4
    channels: int = 3
    classes: int = 10
    d_model: int = 32
    d_cond: int = 32
    freqs: int = 8
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 2
    batch: int = 8
    remat: str | None = None      # md.repeat's activation checkpointing (none, full, selective)

    @classmethod
    def tiny(cls) -> "Config":
        return cls(image=8, patch=2, channels=2, classes=3, d_model=8, d_cond=6, freqs=3, heads=2,
                   d_head=4, d_ff=12, layers=2, batch=4)


def modulate(mod, i: int):
    """The i-th of the six modulations ``mod [batch, mod, d_model]``, as ``[batch, d_model]``."""
    return md.squeeze(md.slice_(mod, "mod", i, i + 1), "mod")


def build(cfg: Config = Config()) -> md.Model:
    b, hh, ww = md.Dim("batch", cfg.batch), md.Dim("height", cfg.image), md.Dim("width", cfg.image)
    ch, d, cd = md.Dim("channels", cfg.channels), md.Dim("d_model", cfg.d_model), md.Dim("d_cond", cfg.d_cond)
    h, e, f = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    z, ncls, lyr, m = md.Dim("freq", cfg.freqs), md.Dim("classes", cfg.classes), md.Dim("layer", cfg.layers), md.Dim("mod", 6)
    n_p = (cfg.image // cfg.patch) ** 2
    q, n = md.Dim("pixels", cfg.patch * cfg.patch * cfg.channels), md.Dim("patches", n_p)
    with md.Graph("flowdit") as g:
        x1 = md.input("x1", [b, hh, ww, ch])
        x0 = md.input("x0", [b, hh, ww, ch])
        t = md.input("t", [b])
        cls_ids = md.input("cls", [b], dtype=torch.int64)
        w_in = md.param("w_in", [q, d], fan_out=[d])
        pos = md.param("pos", [n, d], scale=0.02)
        w_t1 = md.param("w_t1", [z, cd], fan_out=[cd])                 # applied to sin and cos halves
        w_t1c = md.param("w_t1c", [z, cd], fan_out=[cd])
        w_t2 = md.param("w_t2", [cd, md.Dim("d_cond2", cfg.d_cond)], fan_out=["d_cond2"])
        cls_emb = md.param("cls_emb", [ncls, cd], fan_out=[cd])
        stacked = {
            "w_mod": md.param("w_mod", [lyr, cd, m, d], scale=0.1 / math.sqrt(cfg.d_cond)),
            "wq": md.param("wq", [lyr, d, h, e], fan_out=["layer", "heads", "d_head"]),
            "wk": md.param("wk", [lyr, d, h, e], fan_out=["layer", "heads", "d_head"]),
            "wv": md.param("wv", [lyr, d, h, e], fan_out=["layer", "heads", "d_head"]),
            "wo": md.param("wo", [lyr, h, e, d], fan_out=["layer", "d_model"]),
            "w1": md.param("w1", [lyr, d, f], fan_out=["layer", "d_ff"]),
            "w2": md.param("w2", [lyr, f, d], fan_out=["layer", "d_model"]),
        }
        w_fmod = md.param("w_fmod", [cd, md.Dim("mod2", 2), d], scale=0.1 / math.sqrt(cfg.d_cond))
        w_out = md.param("w_out", [d, q], fan_out=["pixels"])

        xt = (1.0 - t) * x0 + t * x1                                   # t [batch] broadcasts by name
        pattern = "batch (hp ph) (wp pw) channels -> batch (hp wp) (ph pw channels)"
        xt_p = md.rename(md.rearrange(xt, pattern, ph=cfg.patch, pw=cfg.patch), hp_wp="patches", ph_pw_channels="pixels")
        target = md.rename(md.rearrange(x1 - x0, pattern, ph=cfg.patch, pw=cfg.patch), hp_wp="patches", ph_pw_channels="pixels")

        inv_freq = md.constant(torch.exp(-math.log(1000.0) * torch.arange(cfg.freqs) / cfg.freqs), [z])
        ang = t * 1000.0 * inv_freq                                     # [batch, freq]
        temb = md.einsum("batch freq, freq d_cond -> batch d_cond", md.sin(ang), w_t1) \
            + md.einsum("batch freq, freq d_cond -> batch d_cond", md.cos(ang), w_t1c)
        temb = md.rename(md.einsum("batch d_cond, d_cond d_cond2 -> batch d_cond2", md.silu(temb), w_t2), d_cond2="d_cond")
        cond = md.silu(temb + md.gather(cls_emb, cls_ids, "classes"))   # [batch, d_cond]

        def block(x, w):
            mod = md.einsum("batch d_cond, d_cond mod d_model -> batch mod d_model", cond, w["w_mod"])
            a = md.layer_norm(x, "d_model") * (1.0 + modulate(mod, 1)) + modulate(mod, 0)
            qh = md.einsum("batch patches d_model, d_model heads d_head -> batch patches heads d_head", a, w["wq"])
            kh = md.rename(md.einsum("batch patches d_model, d_model heads d_head -> batch patches heads d_head", a, w["wk"]), patches="key_patches")
            vh = md.rename(md.einsum("batch patches d_model, d_model heads d_head -> batch patches heads d_head", a, w["wv"]), patches="key_patches")
            y = md.attention(qh, kh, vh, "patches", "key_patches", "d_head", causal=False)
            x = x + modulate(mod, 2) * md.einsum("batch patches heads d_head, heads d_head d_model -> batch patches d_model", y, w["wo"])
            a = md.layer_norm(x, "d_model") * (1.0 + modulate(mod, 4)) + modulate(mod, 3)
            u = md.gelu(md.einsum("batch patches d_model, d_model d_ff -> batch patches d_ff", a, w["w1"]))
            return x + modulate(mod, 5) * md.einsum("batch patches d_ff, d_ff d_model -> batch patches d_model", u, w["w2"])

        x = md.einsum("batch patches pixels, pixels d_model -> batch patches d_model", xt_p, w_in) + pos
        x = md.repeat(block, x, stacked, "layer", remat=cfg.remat)
        fmod = md.einsum("batch d_cond, d_cond mod2 d_model -> batch mod2 d_model", cond, w_fmod)
        shift, scale = (md.squeeze(md.slice_(fmod, "mod2", i, i + 1), "mod2") for i in range(2))
        x = md.layer_norm(x, "d_model") * (1.0 + scale) + shift
        vel = md.einsum("batch patches d_model, d_model pixels -> batch patches pixels", x, w_out)
        loss = md.reduce_mean((vel - target) ** 2)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        shape = (cfg.batch, cfg.image, cfg.image, cfg.channels)
        return {"x1": torch.randn(shape, generator=gen), "x0": torch.randn(shape, generator=gen),
                "t": torch.rand(cfg.batch, generator=gen),
                "cls": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    return md.Model(g, loss, g.params(), feeds, cfg)


# ---- the plain-torch reference (tests/test_heldout_round26a.py compares it with the model) ----

REF_INPUTS = ["x1", "x0", "t", "cls"]


def _ref_patchify(x, patch: int):
    b, hh, ww, c = x.shape
    x = x.reshape(b, hh // patch, patch, ww // patch, patch, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, (hh // patch) * (ww // patch), patch * patch * c)


def _ref_ln_mod(x, shift, scale):
    return torch.nn.functional.layer_norm(x, (x.shape[-1],)) * (1 + scale[:, None]) + shift[:, None]


def reference_loss(cfg: Config, p: dict, x1, x0, t, cls):
    """The model in plain torch: the rectified-flow target, adaLN modulations by index."""
    F = torch.nn.functional
    tt = t[:, None, None, None]
    xt, target = _ref_patchify((1 - tt) * x0 + tt * x1, cfg.patch), _ref_patchify(x1 - x0, cfg.patch)
    ang = t[:, None] * 1000.0 * torch.exp(-math.log(1000.0) * torch.arange(cfg.freqs) / cfg.freqs).to(t.dtype)
    temb = F.silu(torch.sin(ang) @ p["w_t1"] + torch.cos(ang) @ p["w_t1c"]) @ p["w_t2"]
    cond = F.silu(temb + p["cls_emb"][cls])                           # [b, d_cond]
    x = xt @ p["w_in"] + p["pos"]
    for i in range(cfg.layers):
        mod = torch.einsum("bc,cmd->bmd", cond, p["w_mod"][i])
        a = _ref_ln_mod(x, mod[:, 0], mod[:, 1])
        q, k, v = (torch.einsum("bnd,dhe->bhne", a, p[w][i]) for w in ("wq", "wk", "wv"))
        y = torch.einsum("bhne,hed->bnd", F.scaled_dot_product_attention(q, k, v), p["wo"][i])
        x = x + mod[:, 2, None] * y
        a = _ref_ln_mod(x, mod[:, 3], mod[:, 4])
        x = x + mod[:, 5, None] * (F.gelu(a @ p["w1"][i]) @ p["w2"][i])
    fmod = torch.einsum("bc,cmd->bmd", cond, p["w_fmod"])
    vel = _ref_ln_mod(x, fmod[:, 0], fmod[:, 1]) @ p["w_out"]
    return ((vel - target) ** 2).mean()
