"""A PixelCNN-style autoregressive image model, written from the README and docs/ alone
(a held-out model).

Legend: ``x_bhwc`` [batch, height, width, d_model]; ``kh``, ``kw`` the 3x3 taps.

Grey images of 256 levels. The masked convolutions are ``md.conv`` over ``height`` and
``width`` (``padding="same"``) whose weights are multiplied by a fixed ``[kh, kw]`` mask: type
A (the first layer) sees only the pixels above and to the left of the centre, type B (every
later layer) the centre too. Each later layer is a gated unit, ``tanh(conv_f) * sigmoid(conv_g)``
(two masked convs), projected by a 1x1 einsum and added back (residual), under ``md.repeat``
over ``layer``. The head gives 256 logits per pixel, and the loss is the per-pixel
cross-entropy of the image's own levels (pixel i is predicted from the pixels before it).
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    height: int = 16
    width: int = 16
    d_model: int = 32
    layers: int = 4
    levels: int = 256
    batch: int = 8

    @classmethod
    def tiny(cls) -> "Config":
        return cls(height=6, width=5, d_model=6, layers=2, levels=256, batch=2)


def causal_mask_2d(kind: str) -> torch.Tensor:
    """The 3x3 mask of a masked conv: rows above the centre, and the centre row left of it
    (type A), or up to and including it (type B)."""
    m = torch.zeros(3, 3)
    m[0, :] = 1
    m[1, :1] = 1
    if kind == "B":
        m[1, 1] = 1
    return m


def build(cfg: Config = Config()) -> md.Model:
    batch, height, width = md.Dim("batch", cfg.batch), md.Dim("height", cfg.height), md.Dim("width", cfg.width)
    d_model, d_out, c_in = md.Dim("d_model", cfg.d_model), md.Dim("d_out", cfg.d_model), md.Dim("c_in", 1)
    kh, kw, layer, levels = md.Dim("kh", 3), md.Dim("kw", 3), md.Dim("layer", cfg.layers), md.Dim("levels", cfg.levels)
    taps = {"height": "kh", "width": "kw"}
    with md.Graph("heldout_pixelcnn") as g:
        pixels = md.input("pixels", [batch, height, width], dtype=torch.int64)
        mask_a = md.constant(causal_mask_2d("A"), [kh, kw], name="mask_a")
        mask_b = md.constant(causal_mask_2d("B"), [kh, kw], name="mask_b")
        w_in = md.param("w_in", [kh, kw, c_in, d_model], fan_out=[d_model])
        b_in = md.param("b_in", [d_model], init="zeros")
        blocks = {
            "w_f": md.param("w_f", [layer, kh, kw, d_model, d_out], fan_out=["layer", d_out]),
            "w_g": md.param("w_g", [layer, kh, kw, d_model, d_out], fan_out=["layer", d_out]),
            "w_1x1": md.param("w_1x1", [layer, d_out, d_model], fan_out=["layer", d_model]),
        }
        head = md.param("head", [d_model, levels], fan_out=[levels])

        def block(x_bhwc: md.Tensor, p: dict) -> md.Tensor:
            f = md.conv(x_bhwc, p["w_f"] * mask_b, taps, padding="same")
            gt = md.conv(x_bhwc, p["w_g"] * mask_b, taps, padding="same")
            y = md.tanh(f) * md.sigmoid(gt)
            return x_bhwc + md.einsum("batch height width d_out, d_out d_model -> batch height width d_model",
                                      y, p["w_1x1"])

        x = md.unsqueeze(md.cast(pixels, torch.float32) * (2.0 / 255) - 1.0, c_in)
        h = md.relu(md.conv(x, w_in * mask_a, taps, padding="same") + b_in)
        h = md.repeat(block, h, blocks, "layer")
        logits = md.einsum("batch height width d_model, d_model levels -> batch height width levels", md.relu(h), head)
        loss = md.reduce_mean(md.cross_entropy(logits, pixels, "levels"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        # smooth images: a random gradient plus noise, so neighbours predict a pixel
        ramp = torch.linspace(0, 1, cfg.height)[:, None] + torch.linspace(0, 1, cfg.width)[None, :]
        base = torch.rand(cfg.batch, 1, 1, generator=gen) * 100 + ramp * 60
        noise = torch.randint(0, 20, (cfg.batch, cfg.height, cfg.width), generator=gen)
        return {"pixels": (base + noise).long().clamp(0, cfg.levels - 1)}

    params = {"w_in": w_in, "b_in": b_in, **blocks, "head": head}
    return md.Model(g, loss, params, feeds, cfg, outputs={"logits": logits})
