"""An EfficientNet / MobileNetV2-style image classifier, written from the README and docs/ alone
(a held-out model).

Images ``[batch, height, width, channels]``: a stride-2 3x3 stem conv to ``d_model`` and swish
(``x * sigmoid(x)``); a downsampling MBConv block (a 1x1 expansion to ``d_exp`` by an einsum,
swish, a *strided* depthwise 3x3 conv, ``w [kh, kw, d_exp]``, stride 2, swish, a 1x1 projection
to ``d2``; no residual since the shape changes); then a stack of MBConv blocks under
``md.repeat`` over ``layer``: a LayerNorm over the channels (no batch norm: the docs have none),
the 1x1 expansion to ``ff``, swish, a depthwise 3x3 conv, swish, squeeze-and-excitation (the mean
over the positions, a reduction to ``d_se``, swish, back to ``ff``, a sigmoid gate per channel),
the linear 1x1 projection back to ``d2`` and the residual add (MobileNetV2's inverted residual
with a linear bottleneck). A 1x1 head conv to ``d_head`` with swish, global mean pooling, dropout
(off by default) and a linear classifier; cross-entropy over ``classes``.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    image: int = 32
    channels: int = 3
    d_model: int = 16
    d_exp: int = 64
    d2: int = 24
    ff: int = 96
    d_se: int = 8
    d_head: int = 64
    layers: int = 3
    batch: int = 16
    classes: int = 10
    dropout: float = 0.0

    @classmethod
    def tiny(cls) -> "Config":
        return cls(image=12, channels=3, d_model=4, d_exp=8, d2=6, ff=12, d_se=2, d_head=8, layers=2,
                   batch=4, classes=5)


def swish(x: md.Tensor) -> md.Tensor:
    return x * md.sigmoid(x)


def build(cfg: Config = Config()) -> md.Model:
    batch, height, width = md.Dim("batch", cfg.batch), md.Dim("height", cfg.image), md.Dim("width", cfg.image)
    channels, d_model = md.Dim("channels", cfg.channels), md.Dim("d_model", cfg.d_model)
    d_exp, d2, ff = md.Dim("d_exp", cfg.d_exp), md.Dim("d2", cfg.d2), md.Dim("ff", cfg.ff)
    d_se, d_head, classes = md.Dim("d_se", cfg.d_se), md.Dim("d_head", cfg.d_head), md.Dim("classes", cfg.classes)
    layer, kh, kw = md.Dim("layer", cfg.layers), md.Dim("kh", 3), md.Dim("kw", 3)
    taps = {"height": "kh", "width": "kw"}
    with md.Graph("heldout_effnet") as g:
        images = md.input("images", [batch, height, width, channels])
        labels = md.input("labels", [batch], dtype=torch.int64)
        w_stem = md.param("w_stem", [kh, kw, channels, d_model], fan_out=["d_model"])
        w_exp = md.param("w_exp", [d_model, d_exp], fan_out=["d_exp"])
        w_dw = md.param("w_dw", [kh, kw, d_exp], fan_out=["d_exp"])
        w_proj = md.param("w_proj", [d_exp, d2], fan_out=["d2"])
        blocks = {
            "ln": md.param("ln", [layer, d2], init="ones"),
            "ln_b": md.param("ln_b", [layer, d2], init="zeros"),
            "expand": md.param("expand", [layer, d2, ff], fan_out=["layer", "ff"]),
            "dw": md.param("dw", [layer, kh, kw, ff], fan_out=["layer", "ff"]),
            "se_down": md.param("se_down", [layer, ff, d_se], fan_out=["layer", "d_se"]),
            "se_down_b": md.param("se_down_b", [layer, d_se], init="zeros"),
            "se_up": md.param("se_up", [layer, d_se, ff], fan_out=["layer", "ff"]),
            "se_up_b": md.param("se_up_b", [layer, ff], init=1.0),
            "project": md.param("project", [layer, ff, d2], fan_out=["layer", "d2"]),
        }
        w_head_conv = md.param("w_head_conv", [d2, d_head], fan_out=["d_head"])
        w_cls = md.param("w_cls", [d_head, classes], fan_out=["classes"])
        b_cls = md.param("b_cls", [classes], init="zeros")

        def mbconv(x: md.Tensor, p: dict) -> md.Tensor:
            h = md.layer_norm(x, "d2", p["ln"], p["ln_b"])
            h = swish(md.einsum("batch height width d2, d2 ff -> batch height width ff", h, p["expand"]))
            h = swish(md.conv(h, p["dw"], taps))
            s = md.reduce_mean(h, ["height", "width"])
            s = swish(md.einsum("batch ff, ff d_se -> batch d_se", s, p["se_down"]) + p["se_down_b"])
            gate = md.sigmoid(md.einsum("batch d_se, d_se ff -> batch ff", s, p["se_up"]) + p["se_up_b"])
            h = md.einsum("batch height width ff, ff d2 -> batch height width d2", h * gate, p["project"])
            return x + h

        x = swish(md.conv(images, w_stem, taps, padding=(1, 1), stride=2))
        x = swish(md.einsum("batch height width d_model, d_model d_exp -> batch height width d_exp", x, w_exp))
        x = swish(md.conv(x, w_dw, taps, padding=(1, 1), stride=2))
        x = md.einsum("batch height width d_exp, d_exp d2 -> batch height width d2", x, w_proj)
        x = md.repeat(mbconv, x, blocks, "layer")
        x = swish(md.einsum("batch height width d2, d2 d_head -> batch height width d_head", x, w_head_conv))
        pooled = md.dropout(md.reduce_mean(x, ["height", "width"]), cfg.dropout)
        logits = md.einsum("batch d_head, d_head classes -> batch classes", pooled, w_cls) + b_cls
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"images": torch.randn(cfg.batch, cfg.image, cfg.image, cfg.channels, generator=gen),
                "labels": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    params = {"w_stem": w_stem, "w_exp": w_exp, "w_dw": w_dw, "w_proj": w_proj, **blocks,
              "w_head_conv": w_head_conv, "w_cls": w_cls, "b_cls": b_cls}
    return md.Model(g, loss, params, feeds, cfg, outputs={"logits": logits})
