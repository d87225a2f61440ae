"""Held-out model (round 26c): a two-level U-Net segmenter written from the docs alone.

Encoder: 3x3 convs with ReLU, 2x2 max pools down; a gated-conv bottleneck (ConvGRU-ish: an
update gate mixing the map with a tanh candidate); decoder: up by ``md.upsample`` (nearest at
the lower level, bilinear at the upper one, ``Config.up``) or by 2x2 stride-2 transposed
convs (``up="transpose"``), the skip joined by ``md.concat`` along the channels, 3x3 convs;
a 1x1 head and the per-pixel cross-entropy with ``ignore_index`` for void pixels, averaged
over the kept pixels.

Legend: ``batch`` images, ``height``/``width`` pixels, ``rgb`` input channels, ``ch`` feature
channels (each conv's ``co`` renamed back), ``kh``/``kw`` taps, ``classes`` per-pixel classes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md

VOID = 255
TAPS = {"height": "kh", "width": "kw"}


@dataclass
class Config:
    batch: int = 4
    image: int = 32
    c1: int = 16
    c2: int = 32
    classes: int = 5
    up: str = "resize"          # "resize": nearest then bilinear; "transpose": conv_transpose

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=2, image=16, c1=4, c2=8, classes=3)


def _conv(x, name, c_out, k=3, c_in="ch"):
    kh, kw, co = md.Dim("kh", k), md.Dim("kw", k), md.Dim("co", c_out)
    w = md.param(name, [kh, kw, x.shape[c_in], co], fan_out=[co])
    return md.rename(md.conv(x, w, TAPS, padding="same"), co="ch")


def _up(x, name, mode, cfg):
    """x twice as tall and wide: resized (then a 1x1 conv to the skip's width) or transposed."""
    c_out = cfg.c2 if x.shape["ch"].size > cfg.c2 else cfg.c1
    if cfg.up == "transpose":
        w = md.param(name, [md.Dim("kh", 2), md.Dim("kw", 2), x.shape["ch"], md.Dim("co", c_out)], fan_out=["co"])
        return md.rename(md.conv_transpose(x, w, TAPS, stride=2), co="ch")
    return _conv(md.upsample(x, {"height": 2, "width": 2}, mode=mode), name, c_out, k=1)


def build(cfg: Config) -> md.Model:
    b, hgt, wid = md.Dim("batch", cfg.batch), md.Dim("height", cfg.image), md.Dim("width", cfg.image)
    with md.Graph() as g:
        x = md.input("x", [b, hgt, wid, md.Dim("rgb", 3)])
        labels = md.input("labels", [b, hgt, wid], dtype=torch.int64)
        e1 = md.relu(_conv(md.relu(_conv(x, "enc1a", cfg.c1, c_in="rgb")), "enc1b", cfg.c1))
        e2 = md.relu(_conv(md.max_pool(e1, {"height": 2, "width": 2}), "enc2", cfg.c2))
        m = md.relu(_conv(md.max_pool(e2, {"height": 2, "width": 2}), "mid", 2 * cfg.c2))
        gate = md.sigmoid(_conv(m, "gate_z", 2 * cfg.c2))
        m = gate * m + (1 - gate) * md.tanh(_conv(m, "gate_h", 2 * cfg.c2))
        d2 = md.relu(_conv(md.concat([_up(m, "up2", "nearest", cfg), e2], "ch"), "dec2", cfg.c2))
        d1 = md.relu(_conv(md.concat([_up(d2, "up1", "bilinear", cfg), e1], "ch"), "dec1", cfg.c1))
        head = md.param("head", [d1.shape["ch"], md.Dim("classes", cfg.classes)], fan_out=["classes"])
        logits = md.einsum("batch height width ch, ch classes -> batch height width classes", d1, head)
        ce = md.cross_entropy(logits, labels, "classes", ignore_index=VOID)
        loss = md.reduce_sum(ce) / md.reduce_sum(md.cast(md.not_equal(labels, VOID), torch.float32))

    def make_feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        n = cfg.image
        labels = torch.randint(0, cfg.classes, (cfg.batch, n, n), generator=gen)
        void = torch.rand(cfg.batch, n, n, generator=gen) < 0.2
        return {"x": torch.randn(cfg.batch, n, n, 3, generator=gen),
                "labels": torch.where(void, torch.full_like(labels, VOID), labels)}

    return md.Model(g, loss, g.params(), make_feeds, cfg)


def torch_reference(cfg: Config, weights: dict, feeds: dict) -> torch.Tensor:
    """The same model in plain torch (float64, NCHW), from ``weights`` by name."""
    F = torch.nn.functional
    w = {k: v.double() for k, v in weights.items()}

    def conv(x, name):
        k = w[name].shape[0]
        return F.conv2d(x, w[name].permute(3, 2, 0, 1), padding=(k - 1) // 2)

    def up(x, name, mode):
        if cfg.up == "transpose":
            return F.conv_transpose2d(x, w[name].permute(2, 3, 0, 1), stride=2)
        return conv(F.interpolate(x, scale_factor=2, mode=mode), name)

    x = feeds["x"].double().permute(0, 3, 1, 2)
    e1 = torch.relu(conv(torch.relu(conv(x, "enc1a")), "enc1b"))
    e2 = torch.relu(conv(F.max_pool2d(e1, 2), "enc2"))
    m = torch.relu(conv(F.max_pool2d(e2, 2), "mid"))
    gate = torch.sigmoid(conv(m, "gate_z"))
    m = gate * m + (1 - gate) * torch.tanh(conv(m, "gate_h"))
    d2 = torch.relu(conv(torch.cat([up(m, "up2", "nearest"), e2], 1), "dec2"))
    d1 = torch.relu(conv(torch.cat([up(d2, "up1", "bilinear"), e1], 1), "dec1"))
    logits = torch.einsum("bchw,ck->bkhw", d1, w["head"])
    return F.cross_entropy(logits, feeds["labels"], ignore_index=VOID)
