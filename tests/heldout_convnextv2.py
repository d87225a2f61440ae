"""ConvNeXt-V2 with Global Response Normalization, written from the README and docs/ alone (a held-out model).

Images ``[batch, height, width, rgb]``. A 2x2 patchify stem (``md.conv`` with stride 2, valid) to
``chan``, a LayerNorm over ``chan``. Two stages, each a ``md.repeat`` of ConvNeXt-V2 blocks: a 7x7
depthwise conv (``w [kh, kw, chan]``, no output channel dim), LayerNorm, a 1x1 expansion to ``ff``
(an einsum), GELU, GRN, a 1x1 projection back, the residual. GRN: the L2 norm of each channel over
the spatial dims (``sqrt(reduce_sum(x^2, [row, col]))``), divided by its mean over the channels,
``gamma * (x * nx) + beta + x``. The first stage's depthwise convs are dilated by ``dilation`` (2:
a 13-pixel span from 7 taps). Between the stages a LayerNorm and a 2x2 stride-2 conv to ``chan2``
on the half grid ``row`` x ``col``. Head: global mean pool, LayerNorm, a linear classifier, the
cross entropy over ``classes``.

Legend: batch, height/width (stage 1 grid), row/col (stage 2 grid), chan/chan2, ff/ff2, blk/blk2.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 8
    image: int = 64
    chan: int = 32
    chan2: int = 64
    depth1: int = 2
    depth2: int = 2
    taps: int = 7
    dilation: int = 2
    classes: int = 10
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, image=24, chan=4, chan2=6, depth1=2, depth2=2, taps=7, dilation=2, classes=5)


def grn(x: md.Tensor, ch: str, spatial: list[str], gamma: md.Tensor, beta: md.Tensor) -> md.Tensor:
    """Global Response Normalization of ``x [batch, spatial..., ch]``."""
    gx = md.sqrt(md.reduce_sum(x * x, spatial))                   # [batch, ch]
    nx = gx / (md.reduce_mean(gx, ch) + 1e-6)
    return gamma * (x * nx) + beta + x


def build(cfg: Config = Config()) -> md.Model:
    batch, height, width = md.Dim("batch", cfg.batch), md.Dim("image_h", cfg.image), md.Dim("image_w", cfg.image)
    rgb, chan, chan2 = md.Dim("rgb", 3), md.Dim("chan", cfg.chan), md.Dim("chan2", cfg.chan2)
    ff, ff2 = md.Dim("ff", 4 * cfg.chan), md.Dim("ff2", 4 * cfg.chan2)
    blk, blk2, classes = md.Dim("blk", cfg.depth1), md.Dim("blk2", cfg.depth2), md.Dim("classes", cfg.classes)
    kh, kw, ph, pw = md.Dim("kh", cfg.taps), md.Dim("kw", cfg.taps), md.Dim("ph", 2), md.Dim("pw", 2)
    with md.Graph("heldout_convnextv2") as g:
        images = md.input("images", [batch, height, width, rgb])
        labels = md.input("labels", [batch], dtype=torch.int64)

        def stage_params(pre: str, L: md.Dim, c: md.Dim, f: md.Dim) -> dict:
            cn = md.Dim(f"{c.name}_out", c.size)
            return {f"{pre}dw": md.param(f"{pre}dw", [L, kh, kw, c], fan_out=[L.name]),
                    f"{pre}dw_b": md.param(f"{pre}dw_b", [L, c], init="zeros"),
                    f"{pre}ln_g": md.param(f"{pre}ln_g", [L, c], init="ones"),
                    f"{pre}ln_b": md.param(f"{pre}ln_b", [L, c], init="zeros"),
                    f"{pre}w1": md.param(f"{pre}w1", [L, c, f], fan_out=[L.name, f.name]),
                    f"{pre}grn_g": md.param(f"{pre}grn_g", [L, f], init="ones"),  # not V2's zeros: GRN's path gets a gradient
                    f"{pre}grn_b": md.param(f"{pre}grn_b", [L, f], init="zeros"),
                    f"{pre}w2": md.param(f"{pre}w2", [L, f, cn], fan_out=[L.name, cn.name])}

        s1, s2 = stage_params("s1_", blk, chan, ff), stage_params("s2_", blk2, chan2, ff2)
        p = {"stem": md.param("stem", [ph, pw, rgb, chan], fan_out=["chan"]),
             "stem_g": md.param("stem_g", [chan], init="ones"), "stem_b": md.param("stem_b", [chan], init="zeros"),
             "down_g": md.param("down_g", [chan], init="ones"), "down_b": md.param("down_b", [chan], init="zeros"),
             "down": md.param("down", [ph, pw, chan, chan2], fan_out=["chan2"]),
             "head_g": md.param("head_g", [chan2], init="ones"), "head_b": md.param("head_b", [chan2], init="zeros"),
             "head": md.param("head", [chan2, classes], fan_out=["classes"])}

        def block(pre: str, c: str, f: str, sp: list[str], dilation: int):
            def run(x: md.Tensor, q: dict) -> md.Tensor:
                y = md.conv(x, q[f"{pre}dw"], {sp[0]: "kh", sp[1]: "kw"}, dilation=dilation) + q[f"{pre}dw_b"]
                y = md.layer_norm(y, c, q[f"{pre}ln_g"], q[f"{pre}ln_b"], eps=1e-6)
                y = md.gelu(md.einsum(f"batch {sp[0]} {sp[1]} {c}, {c} {f} -> batch {sp[0]} {sp[1]} {f}", y, q[f"{pre}w1"]))
                y = grn(y, f, sp, q[f"{pre}grn_g"], q[f"{pre}grn_b"])
                y = md.einsum(f"batch {sp[0]} {sp[1]} {f}, {f} {c}_out -> batch {sp[0]} {sp[1]} {c}_out", y, q[f"{pre}w2"])
                return x + md.rename(y, {f"{c}_out": c})
            return run

        h = md.conv(images, p["stem"], {"image_h": "ph", "image_w": "pw"}, padding="valid", stride=2)
        h = md.rename(h, image_h="height", image_w="width")
        h = md.layer_norm(h, "chan", p["stem_g"], p["stem_b"], eps=1e-6)
        h = md.repeat(block("s1_", "chan", "ff", ["height", "width"], cfg.dilation), h, s1, "blk", remat=cfg.remat)
        h = md.layer_norm(h, "chan", p["down_g"], p["down_b"], eps=1e-6)
        h = md.conv(h, p["down"], {"height": "ph", "width": "pw"}, padding="valid", stride=2)
        h = md.rename(h, height="row", width="col")
        h = md.repeat(block("s2_", "chan2", "ff2", ["row", "col"], 1), h, s2, "blk2", remat=cfg.remat)
        pooled = md.layer_norm(md.reduce_mean(h, ["row", "col"]), "chan2", p["head_g"], p["head_b"], eps=1e-6)
        logits = md.einsum("batch chan2, chan2 classes -> batch classes", pooled, p["head"])
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"images": torch.randn(cfg.batch, cfg.image, cfg.image, 3, generator=gen),
                "labels": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    return md.Model(g, loss, {**p, **s1, **s2}, feeds, cfg)
