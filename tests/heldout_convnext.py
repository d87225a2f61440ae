"""A ConvNeXt-style image classifier, written from the README and docs/ alone (a held-out model).

Images ``[batch, height, width, channels]`` go through a patchify stem (a ``md.rearrange`` of
2x2 patches and an einsum, then a LayerNorm over the channels), a first stage of ConvNeXt
blocks under ``md.repeat`` over ``layer``: a depthwise 3x3 conv over ``row`` and ``col`` (one
filter per channel: ``md.conv`` needed a ``c_out`` dim when this was written, so it is the sum
over the 9 taps of a 2-D ``md.shift`` times that tap's filter; ``dw_op=True`` uses ``md.conv``'s
depthwise form, ``w [kh, kw, ch]``, added since), a LayerNorm over the channels, an inverted
bottleneck MLP (``d_model -> d_ff -> d_model``, GELU) and a per-channel layer scale on the
residual branch (stochastic depth off). A downsampling layer (LayerNorm, 2x2 patch merge by
``md.rearrange``, an einsum to ``d2``) leads to a second stage under a second ``md.repeat``
over ``layer2``; global mean pooling over the positions, a LayerNorm and a linear head give
the class logits (cross-entropy over ``classes``).
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    image: int = 32
    channels: int = 3
    d_model: int = 32
    d_ff: int = 128
    d2: int = 64
    ff2: int = 256
    layers: int = 2
    layers2: int = 2
    batch: int = 8
    classes: int = 10
    scale_init: float = 0.5     # the layer scale's init (1e-6 in ConvNeXt; larger here so the blocks matter)
    dw_op: bool = False         # the depthwise conv as md.conv(x, w [kh, kw, ch]) instead of written out

    @classmethod
    def tiny(cls) -> "Config":
        return cls(image=16, channels=3, d_model=8, d_ff=16, d2=12, ff2=24, layers=2, layers2=2, batch=4, classes=5)


def depthwise2d(x: md.Tensor, w: md.Tensor) -> md.Tensor:
    """``y[.., r, c, ch] = sum_{i,j} x[.., r + i - 1, c + j - 1, ch] * w[i, j, ch]`` ('same' 3x3)."""
    out = None
    for i in range(3):
        for j in range(3):
            tap = md.squeeze(md.squeeze(md.slice_(md.slice_(w, "kh", i, i + 1), "kw", j, j + 1), "kh"), "kw")
            term = md.shift(md.shift(x, "row", 1 - i), "col", 1 - j) * tap
            out = term if out is None else out + term
    return out


def build(cfg: Config = Config()) -> md.Model:
    side = cfg.image // 2
    batch, height, width = md.Dim("batch", cfg.batch), md.Dim("height", cfg.image), md.Dim("width", cfg.image)
    channels, d_model, d_ff = md.Dim("channels", cfg.channels), md.Dim("d_model", cfg.d_model), md.Dim("d_ff", cfg.d_ff)
    d2, ff2, classes = md.Dim("d2", cfg.d2), md.Dim("ff2", cfg.ff2), md.Dim("classes", cfg.classes)
    layer, layer2, kh, kw = md.Dim("layer", cfg.layers), md.Dim("layer2", cfg.layers2), md.Dim("kh", 3), md.Dim("kw", 3)
    patch = md.Dim("ph_pw_channels", 4 * cfg.channels)
    merged = md.Dim("pr_pc_d_model", 4 * cfg.d_model)
    with md.Graph("heldout_convnext") as g:
        images = md.input("images", [batch, height, width, channels])
        labels = md.input("labels", [batch], dtype=torch.int64)
        w_stem = md.param("w_stem", [patch, d_model], fan_out=[d_model])
        stem_ln = md.param("stem_ln", [d_model], init="ones")
        down_ln = md.param("down_ln", [d_model], init="ones")
        w_down = md.param("w_down", [merged, d2], fan_out=[d2])
        head_ln = md.param("head_ln", [d2], init="ones")
        head_ln_b = md.param("head_ln_b", [d2], init="zeros")
        w_head = md.param("w_head", [d2, classes], fan_out=[classes])

        def stack(prefix: str, lay: md.Dim, dm: md.Dim, ff: md.Dim) -> dict[str, md.Tensor]:
            return {
                f"{prefix}dw": md.param(f"{prefix}dw", [lay, kh, kw, dm], fan_out=[lay.name, dm.name]),
                f"{prefix}ln": md.param(f"{prefix}ln", [lay, dm], init="ones"),
                f"{prefix}ln_b": md.param(f"{prefix}ln_b", [lay, dm], init="zeros"),
                f"{prefix}up": md.param(f"{prefix}up", [lay, dm, ff], fan_out=[lay.name, ff.name]),
                f"{prefix}down": md.param(f"{prefix}down", [lay, ff, dm], fan_out=[lay.name, dm.name]),
                f"{prefix}gamma": md.param(f"{prefix}gamma", [lay, dm], init="ones"),
            }

        s1, s2 = stack("s1_", layer, d_model, d_ff), stack("s2_", layer2, d2, ff2)

        def block(prefix: str, dm: str, ff: str):
            def run(x: md.Tensor, p: dict) -> md.Tensor:
                w = p[f"{prefix}dw"]
                h = md.conv(x, w, {"row": "kh", "col": "kw"}) if cfg.dw_op else depthwise2d(x, w)
                h = md.layer_norm(h, dm, p[f"{prefix}ln"], p[f"{prefix}ln_b"])
                h = md.gelu(md.einsum(f"batch row col {dm}, {dm} {ff} -> batch row col {ff}", h, p[f"{prefix}up"]))
                h = md.einsum(f"batch row col {ff}, {ff} {dm} -> batch row col {dm}", h, p[f"{prefix}down"])
                return x + h * (p[f"{prefix}gamma"] * cfg.scale_init)
            return run

        x = md.rearrange(images, "batch (hp ph) (wp pw) channels -> batch hp wp (ph pw channels)", ph=2, pw=2)
        x = md.rename(x, hp="row", wp="col")
        x = md.einsum("batch row col ph_pw_channels, ph_pw_channels d_model -> batch row col d_model", x, w_stem)
        x = md.layer_norm(x, "d_model", stem_ln)
        x = md.repeat(block("s1_", "d_model", "d_ff"), x, s1, "layer")
        x = md.layer_norm(x, "d_model", down_ln)
        x = md.rearrange(x, "batch (r2 pr) (c2 pc) d_model -> batch r2 c2 (pr pc d_model)", pr=2, pc=2)
        x = md.rename(x, r2="row", c2="col")
        x = md.einsum("batch row col pr_pc_d_model, pr_pc_d_model d2 -> batch row col d2", x, w_down)
        x = md.repeat(block("s2_", "d2", "ff2"), x, s2, "layer2")
        pooled = md.layer_norm(md.reduce_mean(x, ["row", "col"]), "d2", head_ln, head_ln_b)
        logits = md.einsum("batch d2, d2 classes -> batch classes", pooled, w_head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))
        assert side % 2 == 0

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"images": torch.randn(cfg.batch, cfg.image, cfg.image, cfg.channels, generator=gen),
                "labels": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    params = {"w_stem": w_stem, "stem_ln": stem_ln, **s1, "down_ln": down_ln, "w_down": w_down, **s2,
              "head_ln": head_ln, "head_ln_b": head_ln_b, "w_head": w_head}
    return md.Model(g, loss, params, feeds, cfg)
