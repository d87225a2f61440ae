"""Inception-lite, a held-out model (round 27a): parallel branches concatenated on channels.

Legend: batch = images, height/width = pixels, c_in = input colours, ch = the trunk's channels,
c1/c3/c5/cp = the branches' output channels, cat = the concatenated channels (c1 + c3 + c5 + cp),
co = the merging conv's output channels (renamed to ch), kh/kw = 3x3 taps, kh5/kw5 = 5x5 taps,
layer = the stacked inception blocks, classes. A 1x1 stem (an einsum) makes the trunk; each
block runs four branches on it (a 1x1 einsum, a 3x3 conv, a 5x5 conv, a 3x3 max pool of stride 1
and padding 1 then a 1x1 einsum), renames each output channel dim to ``cat``, concatenates them
along ``cat`` and relu's, then a 3x3 conv over the concat (``cat`` is its c_in) back to ``ch``,
added to the trunk. Head: mean over pixels, an einsum to classes, cross-entropy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 8
    height: int = 8
    width: int = 8
    c_in: int = 3
    ch: int = 8
    c1: int = 4
    c3: int = 6
    c5: int = 4
    cp: int = 2
    classes: int = 10
    layers: int = 2
    remat: str | None = None

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=2, height=4, width=4, c_in=3, ch=4, c1=2, c3=3, c5=2, cp=1, classes=5, layers=2)


SP3, SP5 = {"height": "kh", "width": "kw"}, {"height": "kh5", "width": "kw5"}


def _block(x, p):
    b1 = md.einsum("batch height width ch, ch c1 -> batch height width c1", x, p["w1"])
    b3 = md.conv(x, p["w3"], SP3, padding="same")
    b5 = md.conv(x, p["w5"], SP5, padding="same")
    pooled = md.max_pool(x, {"height": 3, "width": 3}, stride=1, padding=1)
    bp = md.einsum("batch height width ch, ch cp -> batch height width cp", pooled, p["wp"])
    parts = [md.rename(b, {c: "cat"}) for b, c in ((b1, "c1"), (b3, "c3"), (b5, "c5"), (bp, "cp"))]
    cat = md.relu(md.concat(parts, "cat"))
    y = md.rename(md.conv(cat, p["wc"], SP3, padding="same"), {"co": "ch"})
    return md.relu(x + y)


def build(cfg: Config) -> md.Model:
    B, H, W, C = md.Dim("batch", cfg.batch), md.Dim("height", cfg.height), md.Dim("width", cfg.width), md.Dim("c_in", cfg.c_in)
    Ch, Co, Cat = md.Dim("ch", cfg.ch), md.Dim("co", cfg.ch), md.Dim("cat", cfg.c1 + cfg.c3 + cfg.c5 + cfg.cp)
    C1, C3, C5, Cp = (md.Dim(n, getattr(cfg, n)) for n in ("c1", "c3", "c5", "cp"))
    Kh, Kw, Kh5, Kw5 = md.Dim("kh", 3), md.Dim("kw", 3), md.Dim("kh5", 5), md.Dim("kw5", 5)
    K, L = md.Dim("classes", cfg.classes), md.Dim("layer", cfg.layers)
    with md.Graph() as g:
        img = md.input("img", [B, H, W, C])
        labels = md.input("labels", [B], dtype=torch.int64)
        stem = md.param("stem", [C, Ch], fan_out=["ch"])
        stacked = {"w1": md.param("w1", [L, Ch, C1], fan_out=["layer", "c1"]),
                   "w3": md.param("w3", [L, Kh, Kw, Ch, C3], fan_out=["layer", "c3"]),
                   "w5": md.param("w5", [L, Kh5, Kw5, Ch, C5], fan_out=["layer", "c5"]),
                   "wp": md.param("wp", [L, Ch, Cp], fan_out=["layer", "cp"]),
                   "wc": md.param("wc", [L, Kh, Kw, Cat, Co], fan_out=["layer", "co"])}
        head = md.param("head", [Ch, K], fan_out=["classes"])
        x = md.relu(md.einsum("batch height width c_in, c_in ch -> batch height width ch", img, stem))
        x = md.repeat(_block, x, stacked, "layer", remat=cfg.remat)
        logits = md.einsum("batch ch, ch classes -> batch classes", md.reduce_mean(x, ["height", "width"]), head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))

    def feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        return {"img": torch.randn(cfg.batch, cfg.height, cfg.width, cfg.c_in, generator=gen),
                "labels": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    return md.Model(g, loss, g.params(), feeds, cfg)


REF_INPUTS = ("img", "labels")


def reference_loss(cfg: Config, p: dict, img, labels):
    """The same net in plain torch, NCHW: F.conv2d per branch, F.max_pool2d, torch.cat on channels."""
    F = torch.nn.functional

    def conv(x, w, pad):                       # w [kh, kw, c_in, c_out]
        return F.conv2d(x, w.permute(3, 2, 0, 1), padding=pad)

    def mix(x, w):                             # a 1x1 conv, w [c_in, c_out]
        return torch.einsum("nchw,cd->ndhw", x, w)

    x = F.relu(mix(img.permute(0, 3, 1, 2), p["stem"]))
    for i in range(cfg.layers):
        parts = [mix(x, p["w1"][i]), conv(x, p["w3"][i], 1), conv(x, p["w5"][i], 2),
                 mix(F.max_pool2d(x, 3, stride=1, padding=1), p["wp"][i])]
        x = F.relu(x + conv(F.relu(torch.cat(parts, 1)), p["wc"][i], 1))
    return F.cross_entropy(x.mean((2, 3)) @ p["head"], labels)
