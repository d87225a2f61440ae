"""BiFPN-lite (EfficientDet, Tan et al. 2020): fast normalized weighted fusion of a three-level pyramid,
a top-down then a bottom-up path, two BiFPN layers under md.repeat with the three levels as a tuple carry.

Dims:
  batch  images    height, width  a level's grid (16 in, then 8, 4, 2: one name, a size per level)
  rgb    input channels    c1, c2, c3  backbone channels    chan  BiFPN channels (chan_out, renamed back)
  kh, kw  conv taps        f2, f3  a fusion node's 2 or 3 input weights    out  regression targets
  layer  the BiFPN layers

    fuse(xs, w) = sum_i relu(w_i) x_i / (sum_i relu(w_i) + 1e-4), then a depthwise 3x3, a 1x1 and relu
    p4_td = fuse(p4, up(p5)); p3' = fuse(p3, up(p4_td)); p4' = fuse(p4, p4_td, avgpool(p3')); p5' = fuse(p5, maxpool(p4'))
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md

TAPS = {"height": "kh", "width": "kw"}
NODES = {"p4_td": "f2", "p3_out": "f2", "p4_out": "f3", "p5_out": "f2"}


@dataclass(frozen=True)
class Config:
    batch: int = 8
    image: int = 32
    c1: int = 8
    c2: int = 16
    c3: int = 24
    chan: int = 16
    out: int = 4
    layers: int = 3

    remat: str | None = None          # what each layer saves (md.repeat remat=): None, "full", "selective"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, image=16, c1=3, c2=4, c3=5, chan=4, out=2, layers=2)


def fuse(xs, w_raw, dim, p, node):
    """Fast normalized fusion of ``xs`` by the relu'd weights ``w_raw`` [dim], then a separable conv."""
    w = md.relu(w_raw)
    total = md.reduce_sum(w, dim) + 1e-4
    fused = None
    for i, x in enumerate(xs):
        term = x * md.squeeze(md.slice_(w, dim, i, i + 1), dim)
        fused = term if fused is None else fused + term
    h = md.conv(fused / total, p[f"dw_{node}"], TAPS, padding="same")           # depthwise
    h = md.einsum("batch height width chan, chan chan_out -> batch height width chan_out", h, p[f"pw_{node}"])
    return md.relu(md.rename(h, chan_out="chan"))


def bifpn_layer(levels, p):
    p3, p4, p5 = levels
    up = lambda x: md.upsample(x, {"height": 2, "width": 2})
    p4_td = fuse([p4, up(p5)], p["fw_p4_td"], "f2", p, "p4_td")
    p3_out = fuse([p3, up(p4_td)], p["fw_p3_out"], "f2", p, "p3_out")
    p4_out = fuse([p4, p4_td, md.avg_pool(p3_out, {"height": 2, "width": 2})], p["fw_p4_out"], "f3", p, "p4_out")
    p5_out = fuse([p5, md.max_pool(p4_out, {"height": 2, "width": 2})], p["fw_p5_out"], "f2", p, "p5_out")
    return p3_out, p4_out, p5_out


def build(cfg: Config = Config()) -> md.Model:
    d = md.Dim
    batch, rgb, kh, kw = d("batch", cfg.batch), d("rgb", 3), d("kh", 3), d("kw", 3)
    cs = [d("c1", cfg.c1), d("c2", cfg.c2), d("c3", cfg.c3)]
    chan, chan_out, out, layer = d("chan", cfg.chan), d("chan_out", cfg.chan), d("out", cfg.out), d("layer", cfg.layers)
    fk = {"f2": d("f2", 2), "f3": d("f3", 3)}
    with md.Graph("bifpn") as g:
        image = md.input("image", [batch, d("height", cfg.image), d("width", cfg.image), rgb])
        target = md.input("target", [batch, out])
        backbone = [md.param(f"w_b{i + 1}", [kh, kw, cin, cout], fan_out=[cout.name])
                    for i, (cin, cout) in enumerate(zip([rgb] + cs[:2], cs))]
        lat = [md.param(f"lat{i + 1}", [c, chan], fan_out=["chan"]) for i, c in enumerate(cs)]
        stack = {}
        for node, k in NODES.items():
            stack[f"fw_{node}"] = md.param(f"fw_{node}", [layer, fk[k]], init="ones")
            stack[f"dw_{node}"] = md.param(f"dw_{node}", [layer, kh, kw, chan], scale=1.0 / 3)
            stack[f"pw_{node}"] = md.param(f"pw_{node}", [layer, chan, chan_out], fan_out=["chan_out"])
        w_head = md.param("w_head", [chan, out], fan_out=["out"])

        x, feats = image, []
        for w, c in zip(backbone, cs):
            x = md.max_pool(md.relu(md.conv(x, w, TAPS, padding="same")), {"height": 2, "width": 2})
            feats.append(x)
        levels = tuple(md.einsum(f"batch height width {c.name}, {c.name} chan -> batch height width chan", f, w)
                       for f, c, w in zip(feats, cs, lat))
        levels = md.repeat(bifpn_layer, levels, stack, "layer", remat=cfg.remat)
        pooled = sum(md.reduce_mean(lv, ["height", "width"]) for lv in levels)
        pred = md.einsum("batch chan, chan out -> batch out", pooled, w_head)
        loss = md.reduce_mean((pred - target) ** 2)

    def feeds(seed: int = 0) -> dict:
        gen = torch.Generator().manual_seed(seed)
        image = torch.randn(cfg.batch, cfg.image, cfg.image, 3, generator=gen)
        return {"image": image, "target": image.mean((1, 2))[:, : cfg.out] * 4 + 0.5}

    return md.Model(g, loss, g.params(), feeds, cfg)


REF_INPUTS = ("image", "target")


def reference_loss(cfg: Config, p: dict, image, target):
    """The same model in plain torch, NCHW: F.conv2d (groups= for the depthwise ones), max/avg
    pooling, nearest F.interpolate, the fusions written out per node and layer."""
    F = torch.nn.functional
    x, levels = image.permute(0, 3, 1, 2), []
    for i in range(3):
        x = F.max_pool2d(F.relu(F.conv2d(x, p[f"w_b{i + 1}"].permute(3, 2, 0, 1), padding=1)), 2)
        levels.append(torch.einsum("bchw,cf->bfhw", x, p[f"lat{i + 1}"]))

    def fuse(xs, i, node):
        w = F.relu(p[f"fw_{node}"][i])
        h = sum(wk * xk for wk, xk in zip(w, xs)) / (w.sum() + 1e-4)
        h = F.conv2d(h, p[f"dw_{node}"][i].permute(2, 0, 1)[:, None], padding=1, groups=cfg.chan)
        return F.relu(torch.einsum("bchw,cf->bfhw", h, p[f"pw_{node}"][i]))

    up = lambda t: F.interpolate(t, scale_factor=2, mode="nearest")
    p3, p4, p5 = levels
    for i in range(cfg.layers):
        p4_td = fuse([p4, up(p5)], i, "p4_td")
        p3 = fuse([p3, up(p4_td)], i, "p3_out")
        p4 = fuse([p4, p4_td, F.avg_pool2d(p3, 2)], i, "p4_out")
        p5 = fuse([p5, F.max_pool2d(p4, 2)], i, "p5_out")
    pooled = sum(t.mean((2, 3)) for t in (p3, p4, p5))
    return ((pooled @ p["w_head"] - target) ** 2).mean()
