"""HRNet-lite, a held-out model (round 27a): two resolution branches exchanging features.

Legend: batch = images, height/width = pixels (the low branch has the same dims at half the size),
c_in = input colours, ch = high-resolution channels, cl = low-resolution channels, co/col = a conv's
output channels (renamed back), kh/kw = taps, layer = the stages (a tuple carry ``(hi, lo)``),
classes. A stem conv makes ``hi``; a 1x1 einsum and a 2x2 average pool make ``lo``. Each stage runs
a 3x3 conv per branch, then exchanges: ``hi`` gets the low branch (a 1x1 einsum to ``ch``, then
``md.upsample`` x2, nearest or bilinear), ``lo`` gets the high branch brought down (``down=conv``: a
3x3 conv of stride 2, padding 1; ``down=pool``: ``md.max_pool`` 2x2 then a 1x1 einsum), each summed
and relu'd. Head: each branch mean-pooled, one einsum each to classes, summed; cross-entropy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 8
    height: int = 16
    width: int = 16
    c_in: int = 3
    ch: int = 8
    cl: int = 16
    classes: int = 10
    layers: int = 2
    down: str = "conv"          # or "pool"
    up: str = "nearest"         # or "bilinear"
    remat: str | None = None

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=2, height=8, width=8, c_in=3, ch=4, cl=6, classes=5, layers=2)


SPATIAL = {"height": "kh", "width": "kw"}


def _stage(carry, p, cfg: Config):
    hi, lo = carry
    hi = md.relu(md.rename(md.conv(hi, p["wh"], SPATIAL, padding="same"), {"co": "ch"}))
    lo = md.relu(md.rename(md.conv(lo, p["wl"], SPATIAL, padding="same"), {"col": "cl"}))
    up = md.upsample(md.einsum("batch height width cl, cl ch -> batch height width ch", lo, p["up"]),
                     {"height": 2, "width": 2}, mode=cfg.up)
    if cfg.down == "conv":
        down = md.rename(md.conv(hi, p["down"], SPATIAL, padding=(1, 1), stride=2), {"col": "cl"})
    else:
        pooled = md.max_pool(hi, {"height": 2, "width": 2})
        down = md.einsum("batch height width ch, ch cl -> batch height width cl", pooled, p["down"])
    return md.relu(hi + up), md.relu(lo + down)


def build(cfg: Config) -> md.Model:
    B, H, W, C = md.Dim("batch", cfg.batch), md.Dim("height", cfg.height), md.Dim("width", cfg.width), md.Dim("c_in", cfg.c_in)
    Ch, Cl, Co, Col = md.Dim("ch", cfg.ch), md.Dim("cl", cfg.cl), md.Dim("co", cfg.ch), md.Dim("col", cfg.cl)
    K, Kh, Kw, L = md.Dim("classes", cfg.classes), md.Dim("kh", 3), md.Dim("kw", 3), md.Dim("layer", cfg.layers)
    with md.Graph() as g:
        img = md.input("img", [B, H, W, C])
        labels = md.input("labels", [B], dtype=torch.int64)
        stem = md.param("stem", [Kh, Kw, C, Ch], fan_out=["ch"])
        to_lo = md.param("to_lo", [Ch, Cl], fan_out=["cl"])
        stacked = {"wh": md.param("wh", [L, Kh, Kw, Ch, Co], fan_out=["layer", "co"]),
                   "wl": md.param("wl", [L, Kh, Kw, Cl, Col], fan_out=["layer", "col"]),
                   "up": md.param("up", [L, Cl, Ch], fan_out=["layer", "ch"])}
        if cfg.down == "conv":
            stacked["down"] = md.param("down", [L, Kh, Kw, Ch, Col], fan_out=["layer", "col"])
        else:
            stacked["down"] = md.param("down", [L, Ch, Cl], fan_out=["layer", "cl"])
        head_h = md.param("head_h", [Ch, K], fan_out=["classes"])
        head_l = md.param("head_l", [Cl, K], fan_out=["classes"])
        hi = md.relu(md.conv(img, stem, SPATIAL, padding="same"))
        lo = md.avg_pool(md.einsum("batch height width ch, ch cl -> batch height width cl", hi, to_lo),
                         {"height": 2, "width": 2})
        hi, lo = md.repeat(lambda c, p: _stage(c, p, cfg), (hi, lo), stacked, "layer", remat=cfg.remat)
        logits = (md.einsum("batch ch, ch classes -> batch classes", md.reduce_mean(hi, ["height", "width"]), head_h)
                  + md.einsum("batch cl, cl classes -> batch classes", md.reduce_mean(lo, ["height", "width"]), head_l))
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))

    def feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        return {"img": torch.randn(cfg.batch, cfg.height, cfg.width, cfg.c_in, generator=gen),
                "labels": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    return md.Model(g, loss, g.params(), feeds, cfg)


REF_INPUTS = ("img", "labels")


def reference_loss(cfg: Config, p: dict, img, labels):
    """The same net in plain torch, NCHW: F.conv2d, F.avg_pool2d, F.max_pool2d, F.interpolate."""
    F = torch.nn.functional

    def conv(x, w, **kw):                      # w [kh, kw, c_in, c_out]
        return F.conv2d(x, w.permute(3, 2, 0, 1), **kw)

    def mix(x, w):                             # a 1x1 conv, w [c_in, c_out]
        return torch.einsum("nchw,cd->ndhw", x, w)

    hi = F.relu(conv(img.permute(0, 3, 1, 2), p["stem"], padding=1))
    lo = F.avg_pool2d(mix(hi, p["to_lo"]), 2)
    for i in range(cfg.layers):
        hi = F.relu(conv(hi, p["wh"][i], padding=1))
        lo = F.relu(conv(lo, p["wl"][i], padding=1))
        up = F.interpolate(mix(lo, p["up"][i]), scale_factor=2, mode=cfg.up,
                           **({} if cfg.up == "nearest" else {"align_corners": False}))
        if cfg.down == "conv":
            down = conv(hi, p["down"][i], stride=2, padding=1)
        else:
            down = mix(F.max_pool2d(hi, 2), p["down"][i])
        hi, lo = F.relu(hi + up), F.relu(lo + down)
    logits = hi.mean((2, 3)) @ p["head_h"] + lo.mean((2, 3)) @ p["head_l"]
    return F.cross_entropy(logits, labels)
