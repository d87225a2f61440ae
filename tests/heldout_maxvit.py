"""A MaxViT-style image classifier, written from README.md and docs/ only (a held-out model).

Images ``[batch, height, width, channels]`` are patchified by ``md.rearrange`` and embedded into
a token grid ``[batch, hp, wp, d_model]``. Each layer of the ``md.repeat`` stack over ``layer``:

1. MBConv: pre-LN, a 1x1 expansion to ``d_exp`` (an einsum), gelu, a 3x3 depthwise conv over
   ``hp`` and ``wp`` (``w [kh, kw, d_exp]``, ``padding="same"``), gelu, a squeeze-excitation gate
   (the grid's mean, two small matmuls, a sigmoid), a 1x1 projection back, a residual;
2. block attention: the grid cut into ``window x window`` local windows,
   ``(nh wh) (nw ww) -> nh nw (wh ww)``; fused non-causal attention inside each window;
   a gelu MLP;
3. grid attention: the grid cut into a dilated ``window x window`` grid,
   ``(wh nh) (ww nw) -> nh nw (wh ww)``: the tokens of one attention group are ``grid / window``
   apart; attention inside each group; a gelu MLP.

A final layer norm, the grid's mean, a linear head and the cross-entropy over classes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 8
    size: int = 32
    channels: int = 3
    patch: int = 2
    window: int = 4
    d_model: int = 32
    expand: int = 2
    se: int = 8
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 2
    classes: int = 10

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=2, size=8, channels=2, patch=1, window=2, d_model=8, expand=2, se=4, heads=2,
                   d_head=4, d_ff=16, layers=2, classes=4)


def build(cfg: Config = Config()) -> md.Model:
    grid = cfg.size // cfg.patch
    assert grid % cfg.window == 0, "the token grid must be a whole number of windows"
    batch, height, width = md.Dim("batch", cfg.batch), md.Dim("height", cfg.size), md.Dim("width", cfg.size)
    channels, pix = md.Dim("channels", cfg.channels), md.Dim("pix", cfg.patch * cfg.patch * cfg.channels)
    d_model, d_exp, d_se = md.Dim("d_model", cfg.d_model), md.Dim("d_exp", cfg.expand * cfg.d_model), md.Dim("d_se", cfg.se)
    heads, d_head, d_ff = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    layer, classes = md.Dim("layer", cfg.layers), md.Dim("classes", cfg.classes)
    kh, kw = md.Dim("kh", 3), md.Dim("kw", 3)
    L = ["layer"]

    with md.Graph("heldout_maxvit") as g:
        images = md.input("images", [batch, height, width, channels])
        labels = md.input("labels", [batch], dtype=torch.int64)
        w_embed = md.param("w_embed", [pix, d_model], fan_out=["d_model"])
        blocks = {
            "mb_ln": md.param("mb_ln", [layer, d_model], init="ones"),
            "mb_exp": md.param("mb_exp", [layer, d_model, d_exp], fan_out=L + ["d_exp"]),
            "mb_dw": md.param("mb_dw", [layer, kh, kw, d_exp], fan_out=L + ["d_exp"]),
            "mb_se1": md.param("mb_se1", [layer, d_exp, d_se], fan_out=L + ["d_se"]),
            "mb_se2": md.param("mb_se2", [layer, d_se, d_exp], fan_out=L + ["d_exp"]),
            "mb_proj": md.param("mb_proj", [layer, d_exp, d_model], fan_out=L + ["d_model"]),
        }
        for part in ("blk", "grd"):
            blocks.update({
                f"{part}_ln1": md.param(f"{part}_ln1", [layer, d_model], init="ones"),
                **{f"{part}_w{n}": md.param(f"{part}_w{n}", [layer, d_model, heads, d_head], fan_out=L + ["heads", "d_head"])
                   for n in "qkv"},
                f"{part}_wo": md.param(f"{part}_wo", [layer, heads, d_head, d_model], fan_out=L + ["d_model"]),
                f"{part}_ln2": md.param(f"{part}_ln2", [layer, d_model], init="ones"),
                f"{part}_w1": md.param(f"{part}_w1", [layer, d_model, d_ff], fan_out=L + ["d_ff"]),
                f"{part}_w2": md.param(f"{part}_w2", [layer, d_ff, d_model], fan_out=L + ["d_model"]),
            })
        ln_f = md.param("ln_f", [d_model], init="ones")
        w_head = md.param("w_head", [d_model, classes], fan_out=["classes"])

        def mbconv(x, p):
            h = md.layer_norm(x, "d_model", p["mb_ln"])
            h = md.gelu(md.einsum("batch hp wp d_model, d_model d_exp -> batch hp wp d_exp", h, p["mb_exp"]))
            h = md.gelu(md.conv(h, p["mb_dw"], {"hp": "kh", "wp": "kw"}, padding="same"))
            s = md.relu(md.einsum("batch d_exp, d_exp d_se -> batch d_se", md.reduce_mean(h, ["hp", "wp"]), p["mb_se1"]))
            h = h * md.sigmoid(md.einsum("batch d_se, d_se d_exp -> batch d_exp", s, p["mb_se2"]))
            return x + md.einsum("batch hp wp d_exp, d_exp d_model -> batch hp wp d_model", h, p["mb_proj"])

        def attend(x, p, part, split, merge):
            """Attention inside the groups that ``split`` cuts the grid into; MLP; back to the grid."""
            t = md.rename(md.rearrange(x, split, wh=cfg.window, ww=cfg.window), wh_ww="win")
            h = md.layer_norm(t, "d_model", p[f"{part}_ln1"])
            q, k, v = (md.einsum("batch nh nw win d_model, d_model heads d_head -> batch nh nw win heads d_head",
                                 h, p[f"{part}_w{n}"]) for n in "qkv")
            k, v = md.rename(k, win="key_win"), md.rename(v, win="key_win")
            o = md.attention(q, k, v, "win", "key_win", "d_head", causal=False)
            t = t + md.einsum("batch nh nw win heads d_head, heads d_head d_model -> batch nh nw win d_model",
                              o, p[f"{part}_wo"])
            h = md.gelu(md.einsum("batch nh nw win d_model, d_model d_ff -> batch nh nw win d_ff",
                                  md.layer_norm(t, "d_model", p[f"{part}_ln2"]), p[f"{part}_w1"]))
            t = t + md.einsum("batch nh nw win d_ff, d_ff d_model -> batch nh nw win d_model", h, p[f"{part}_w2"])
            back = md.rearrange(md.rename(t, win="wh_ww"), merge, wh=cfg.window, ww=cfg.window)
            return md.rename(back, **{n: k for n, k in zip(back.shape.names, x.shape.names) if n != k})

        def block(x, p):
            x = mbconv(x, p)
            x = attend(x, p, "blk", "batch (nh wh) (nw ww) d_model -> batch nh nw (wh ww) d_model",
                       "batch nh nw (wh ww) d_model -> batch (nh wh) (nw ww) d_model")
            return attend(x, p, "grd", "batch (wh nh) (ww nw) d_model -> batch nh nw (wh ww) d_model",
                          "batch nh nw (wh ww) d_model -> batch (wh nh) (ww nw) d_model")

        px = md.rename(md.rearrange(images, "batch (hp ph) (wp pw) channels -> batch hp wp (ph pw channels)",
                                    ph=cfg.patch, pw=cfg.patch), ph_pw_channels="pix")
        x = md.einsum("batch hp wp pix, pix d_model -> batch hp wp d_model", px, w_embed)
        x = md.repeat(block, x, blocks, "layer")
        pooled = md.reduce_mean(md.layer_norm(x, "d_model", ln_f), ["hp", "wp"])
        logits = md.einsum("batch d_model, d_model classes -> batch classes", pooled, w_head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"images": torch.randn(cfg.batch, cfg.size, cfg.size, cfg.channels, generator=gen),
                "labels": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    params = {"w_embed": w_embed, **blocks, "ln_f": ln_f, "w_head": w_head}
    return md.Model(g, loss, params, feeds, cfg)
