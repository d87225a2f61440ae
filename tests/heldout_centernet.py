"""CenterNet-lite, written from the docs alone: a conv backbone (a stem and a stack of residual
3x3 convs under md.repeat), a heatmap head trained with the penalty-reduced focal loss against a
fed Gaussian target heatmap (1 at each object's centre), and size/offset regression read at the
object centres, normalised by the number of objects.

``gather=onehot`` reads the regression head at each object's centre by a one-hot contraction over
height and width (centre indices fed per object); ``gather=mask`` takes the L1 loss over a fed
mask of centre pixels against a dense target map (the same numbers).

Legend: b batch, h height, w width, c channels, k classes, o objects, r reg (size x, y, offset x, y).
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 4
    res: int = 16
    channels: int = 16
    classes: int = 4
    objects: int = 3
    layers: int = 4
    gather: str = "onehot"     # onehot | mask
    remat: str = "none"

    @classmethod
    def tiny(cls):
        return cls(batch=4, res=6, channels=4, classes=3, objects=2, layers=4)


def _params(cfg, d):
    l, c, kh, kw = d["l"], d["c"], d["kh"], d["kw"]
    return {"stem": md.param("stem", [kh, kw, d["rgb"], c], fan_out=["channels"]),
            "body": md.param("body", [l, kh, kw, d["c_in"], c], fan_out=["layer", "channels"]),
            "body_b": md.param("body_b", [l, c], init="zeros"),
            "heat": md.param("heat", [kh, kw, d["c_in"], d["k"]], fan_out=["classes"]),
            "heat_b": md.param("heat_b", [d["k"]], init=-2.19),
            "reg": md.param("reg", [d["c_in"], d["r"]], fan_out=["reg"])}


def _focal(logits, target, num_pos):
    """Penalty-reduced focal loss (alpha 2, beta 4), log p and log(1 - p) as log-sigmoids."""
    p = md.sigmoid(logits)
    pos = md.cast(md.greater_equal(target, 1.0), torch.float32)
    pos_term = md.log_sigmoid(logits) * (1 - p) ** 2 * pos
    neg_term = md.log_sigmoid(-logits) * p ** 2 * (1 - target) ** 4 * (1 - pos)
    return -md.reduce_sum(pos_term + neg_term) / num_pos


def build(cfg: Config) -> md.Model:
    if cfg.gather not in ("onehot", "mask"):
        raise ValueError(f"gather must be onehot or mask, got {cfg.gather!r}")
    d = dict(b=md.Dim("batch", cfg.batch), h=md.Dim("height", cfg.res), w=md.Dim("width", cfg.res),
             rgb=md.Dim("rgb", 3), c=md.Dim("channels", cfg.channels), c_in=md.Dim("c_in", cfg.channels),
             k=md.Dim("classes", cfg.classes), o=md.Dim("objects", cfg.objects), r=md.Dim("reg", 4),
             l=md.Dim("layer", cfg.layers), kh=md.Dim("kh", 3), kw=md.Dim("kw", 3))
    taps = {"height": "kh", "width": "kw"}
    with md.Graph() as g:
        img = md.input("image", [d["b"], d["h"], d["w"], d["rgb"]])
        heat_t = md.input("heatmap", [d["b"], d["h"], d["w"], d["k"]])
        p = _params(cfg, d)
        x = md.relu(md.conv(img, p["stem"], taps, padding="same"))

        def block(x, q):
            y = md.conv(md.rename(x, channels="c_in"), q["body"], taps, padding="same") + q["body_b"]
            return x + md.relu(y)

        feat = md.rename(md.repeat(block, x, {"body": p["body"], "body_b": p["body_b"]}, "layer",
                                     remat=cfg.remat), channels="c_in")
        logits = md.conv(feat, p["heat"], taps, padding="same") + p["heat_b"]
        reg = md.einsum("batch height width c_in, c_in reg -> batch height width reg", feat, p["reg"])
        num_pos = md.reduce_sum(md.cast(md.greater_equal(heat_t, 1.0), torch.float32))
        if cfg.gather == "onehot":
            ch = md.input("centre_h", [d["b"], d["o"]], dtype=torch.int64)
            cw = md.input("centre_w", [d["b"], d["o"]], dtype=torch.int64)
            reg_t = md.input("reg_target", [d["b"], d["o"], d["r"]])
            at = md.einsum("batch objects height, batch objects width, batch height width reg -> batch objects reg",
                           md.one_hot(ch, d["h"]), md.one_hot(cw, d["w"]), reg)
            reg_loss = md.reduce_sum(md.abs(at - reg_t)) / num_pos
        else:
            mask = md.input("centre_mask", [d["b"], d["h"], d["w"]])
            reg_t = md.input("reg_map", [d["b"], d["h"], d["w"], d["r"]])
            reg_loss = md.reduce_sum(md.abs(reg - reg_t) * mask) / num_pos
        loss = _focal(logits, heat_t, num_pos) + 0.1 * reg_loss

    def feeds(seed):
        return _feeds(cfg, seed)

    return md.Model(g, loss, g.params(), feeds, cfg)


def _feeds(cfg, seed):
    """Objects at distinct random centres (distinct per image), a Gaussian heatmap around each
    (exactly 1 at the centre), and their size/offset targets, as indices and as dense maps."""
    gen = torch.Generator().manual_seed(seed)
    b, r, o = cfg.batch, cfg.res, cfg.objects
    flat = torch.stack([torch.randperm(r * r, generator=gen)[:o] for _ in range(b)])
    ch, cw = flat // r, flat % r
    cls = torch.randint(0, cfg.classes, (b, o), generator=gen)
    reg_t = torch.rand(b, o, 4, generator=gen)
    yy, xx = torch.meshgrid(torch.arange(r), torch.arange(r), indexing="ij")
    heat = torch.zeros(b, r, r, cfg.classes)
    mask, reg_map = torch.zeros(b, r, r), torch.zeros(b, r, r, 4)
    for i in range(b):
        for j in range(o):
            gauss = torch.exp(-((yy - ch[i, j]) ** 2 + (xx - cw[i, j]) ** 2).float() / 2.0)
            heat[i, :, :, cls[i, j]] = torch.maximum(heat[i, :, :, cls[i, j]], gauss)
            mask[i, ch[i, j], cw[i, j]] = 1.0
            reg_map[i, ch[i, j], cw[i, j]] = reg_t[i, j]
    out = {"image": torch.randn(b, r, r, 3, generator=gen), "heatmap": heat}
    if cfg.gather == "onehot":
        out.update(centre_h=ch, centre_w=cw, reg_target=reg_t)
    else:
        out.update(centre_mask=mask, reg_map=reg_map)
    return out
