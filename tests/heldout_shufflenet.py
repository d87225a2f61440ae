"""ShuffleNet-lite, a held-out model (round 27a).

Legend: batch = images, height/width = pixels, c_in = input colours, groups = channel groups,
ch = channels per group (the flat channel is ``groups * ch``, group-major), ch2 = a grouped 1x1
conv's output channels per group, layer = the stacked units, classes. A stem conv makes
``[groups, ch]`` channels (two output dims); each unit is a grouped 1x1 conv (an einsum over the
group dim: ``w [groups, ch, ch2]``), a channel shuffle, a depthwise 3x3 conv, a second grouped 1x1
conv and a residual. The shuffle is ShuffleNet's ``view(g, c).transpose.view(g*c)``: the channels
``[groups, ch]`` transposed to ``[ch, groups]`` and read back, row-major, as ``[groups, ch]``
(``form=reshape``: ``md.transpose`` then ``md.reshape``; ``form=rearrange``: two rearranges).
Head: mean over pixels, an einsum to classes, cross-entropy.
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
    groups: int = 2
    ch: int = 8
    classes: int = 10
    layers: int = 2
    form: str = "reshape"       # or "rearrange"
    remat: str | None = None

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, height=4, width=4, c_in=3, groups=2, ch=4, classes=5, layers=2)


def shuffle(x, cfg: Config):
    """[.., groups, ch] -> the channels read as [ch, groups], regrouped as [groups, ch]."""
    if cfg.form == "rearrange":
        flat = md.rearrange(x, "... groups ch -> ... (ch groups)")
        return md.rearrange(flat, "... (groups ch) -> ... groups ch", groups=cfg.groups)
    names = [n for n in x.shape.names if n not in ("groups", "ch")]
    t = md.transpose(x, names + ["ch", "groups"])
    return md.reshape(t, [t.shape[n] for n in names] + [md.Dim("groups", cfg.groups), md.Dim("ch", cfg.ch)])


def _unit(x, p, cfg: Config):
    h = md.relu(md.rename(md.einsum("batch height width groups ch, groups ch ch2 -> batch height width groups ch2",
                                    x, p["g1"]), {"ch2": "ch"}))
    h = shuffle(h, cfg)
    h = md.conv(h, p["dw"], {"height": "kh", "width": "kw"}, padding="same")     # depthwise: w [kh, kw, groups, ch]
    h = md.rename(md.einsum("batch height width groups ch, groups ch ch2 -> batch height width groups ch2",
                            h, p["g2"]), {"ch2": "ch"})
    return md.relu(x + h)


def build(cfg: Config) -> md.Model:
    B, H, W, C = md.Dim("batch", cfg.batch), md.Dim("height", cfg.height), md.Dim("width", cfg.width), md.Dim("c_in", cfg.c_in)
    G, Ch, Ch2 = md.Dim("groups", cfg.groups), md.Dim("ch", cfg.ch), md.Dim("ch2", cfg.ch)
    K, Kh, Kw, L = md.Dim("classes", cfg.classes), md.Dim("kh", 3), md.Dim("kw", 3), md.Dim("layer", cfg.layers)
    with md.Graph() as g:
        img = md.input("img", [B, H, W, C])
        labels = md.input("labels", [B], dtype=torch.int64)
        stem = md.param("stem", [Kh, Kw, C, G, Ch], fan_out=["groups", "ch"])
        stacked = {"g1": md.param("g1", [L, G, Ch, Ch2], fan_out=["layer", "ch2"]),
                   "dw": md.param("dw", [L, Kh, Kw, G, Ch], fan_out=["layer", "groups", "ch"]),
                   "g2": md.param("g2", [L, G, Ch, Ch2], fan_out=["layer", "ch2"])}
        head = md.param("head", [G, Ch, K], fan_out=["classes"])
        x = md.relu(md.conv(img, stem, {"height": "kh", "width": "kw"}, padding="same"))
        x = md.repeat(lambda h, p: _unit(h, p, cfg), x, stacked, "layer", remat=cfg.remat)
        pooled = md.reduce_mean(x, ["height", "width"])
        logits = md.einsum("batch groups ch, groups ch classes -> batch classes", pooled, head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))

    def feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        return {"img": torch.randn(cfg.batch, cfg.height, cfg.width, cfg.c_in, generator=gen),
                "labels": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    return md.Model(g, loss, g.params(), feeds, cfg)


REF_INPUTS = ("img", "labels")


def reference_loss(cfg: Config, p: dict, img, labels):
    """The same net in plain torch, NCHW with flat group-major channels: F.conv2d(groups=) for the
    grouped 1x1 and depthwise convs, and ShuffleNet's view/transpose/view shuffle."""
    F = torch.nn.functional
    G, C = cfg.groups, cfg.ch
    x = img.permute(0, 3, 1, 2)
    x = F.relu(F.conv2d(x, p["stem"].reshape(3, 3, cfg.c_in, G * C).permute(3, 2, 0, 1), padding=1))
    for i in range(cfg.layers):
        w1 = p["g1"][i].permute(0, 2, 1).reshape(G * C, C, 1, 1)        # group g's [ch2, ch]
        h = F.relu(F.conv2d(x, w1, groups=G))
        n, _, hh, ww = h.shape
        h = h.view(n, G, C, hh, ww).transpose(1, 2).reshape(n, G * C, hh, ww)
        h = F.conv2d(h, p["dw"][i].reshape(3, 3, G * C).permute(2, 0, 1).unsqueeze(1), padding=1, groups=G * C)
        h = F.conv2d(h, p["g2"][i].permute(0, 2, 1).reshape(G * C, C, 1, 1), groups=G)
        x = F.relu(x + h)
    logits = x.mean((2, 3)) @ p["head"].reshape(G * C, cfg.classes)
    return F.cross_entropy(logits, labels)
