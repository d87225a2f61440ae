"""Held-out model (round 16b): ConvMixer, written from the docs alone.

A patch-embedding conv (kernel = stride = patch), gelu and a norm; ``layers`` blocks under
md.repeat of a depthwise conv (5x5, 'same') + gelu + norm with a residual, then a pointwise
(1x1) conv + gelu + norm; a global mean pool and a linear head with cross-entropy. The norm is
BatchNorm's batch statistics per channel, as a composite of means (form=batch) or as
md.batch_norm (form=bnorm: one collective for the statistics forward, one backward), or a layer
norm over channels (form=layer).

Legend: b batch, h/w height/width, c channels (image), d hidden, kh/kw taps, K classes.
"""
import dataclasses

import torch

import meshdsl as md


@dataclasses.dataclass
class Config:
    form: str = "layer"         # "layer": layer norm over channels; "batch": batch statistics; "bnorm": md.batch_norm
    batch: int = 4
    image: int = 16
    channels: int = 3
    patch: int = 2
    hidden: int = 32
    kernel: int = 5
    layers: int = 2
    classes: int = 10

    remat: str = "none"        # md.repeat's remat: none | full | selective

    @classmethod
    def tiny(cls):
        return cls(batch=2, image=8, channels=2, patch=2, hidden=8, layers=2, classes=4)


def _norm(cfg, x, scale, bias):
    if cfg.form == "layer":
        return md.layer_norm(x, "hidden", scale, bias)
    if cfg.form == "bnorm":
        return md.batch_norm(x, ["batch", "height", "width"], scale, bias)
    mean = md.reduce_mean(x, ["batch", "height", "width"])
    c = x - mean
    var = md.reduce_mean(c * c, ["batch", "height", "width"])
    return c * md.rsqrt(var + 1e-5) * scale + bias


def build(cfg: Config) -> md.Model:
    if cfg.form not in ("layer", "batch", "bnorm"):
        raise ValueError(f"form={cfg.form!r}: 'layer', 'batch' or 'bnorm'")
    B, Hh, Ww = md.Dim("batch", cfg.batch), md.Dim("height", cfg.image), md.Dim("width", cfg.image)
    C, D, K, L = md.Dim("channels", cfg.channels), md.Dim("hidden", cfg.hidden), md.Dim("classes", cfg.classes), md.Dim("layer", cfg.layers)
    PH, PW = md.Dim("ph", cfg.patch), md.Dim("pw", cfg.patch)
    KH, KW = md.Dim("kh", cfg.kernel), md.Dim("kw", cfg.kernel)
    DI = md.Dim("d_in", cfg.hidden)
    fo = ["layer", "hidden"]
    with md.Graph() as g:
        img = md.input("image", [B, Hh, Ww, C])
        labels = md.input("labels", [B], torch.int64)
        w_patch = md.param("w_patch", [PH, PW, C, D], fan_out=["hidden"])
        n0_s, n0_b = md.param("n0_s", [D], init="ones"), md.param("n0_b", [D], init="zeros")
        w_head = md.param("w_head", [D, K], fan_out=["classes"])
        stacked = {
            "w_dw": md.param("w_dw", [L, KH, KW, D], fan_out=fo),
            "n1_s": md.param("n1_s", [L, D], init="ones"), "n1_b": md.param("n1_b", [L, D], init="zeros"),
            "w_pw": md.param("w_pw", [L, DI, D], fan_out=fo),
            "n2_s": md.param("n2_s", [L, D], init="ones"), "n2_b": md.param("n2_b", [L, D], init="zeros"),
        }
        x = md.conv(img, w_patch, {"height": "ph", "width": "pw"}, padding="valid", stride=cfg.patch)
        x = _norm(cfg, md.gelu(x), n0_s, n0_b)

        def block(h, p):
            y = md.conv(h, p["w_dw"], {"height": "kh", "width": "kw"}, padding="same")
            h = h + _norm(cfg, md.gelu(y), p["n1_s"], p["n1_b"])
            z = md.einsum("batch height width d_in, d_in hidden -> batch height width hidden",
                          md.rename(h, hidden="d_in"), p["w_pw"])
            return _norm(cfg, md.gelu(z), p["n2_s"], p["n2_b"])

        h = md.repeat(block, x, stacked, L, remat=cfg.remat)
        pooled = md.reduce_mean(h, ["height", "width"])
        logits = md.einsum("batch hidden, hidden classes -> batch classes", pooled, w_head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))
    params = {"w_patch": w_patch, "n0_s": n0_s, "n0_b": n0_b, "w_head": w_head, **stacked}

    def make_feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        return {"image": torch.randn(cfg.batch, cfg.image, cfg.image, cfg.channels, generator=gen),
                "labels": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    return md.Model(g, loss, params, make_feeds, cfg)
