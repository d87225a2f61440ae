"""A small diffusion U-Net, written from the README and docs/ alone (a held-out model).

A denoiser trained to predict the noise: clean images ``x0`` ``[batch, height, width,
channels]``, fed noise and a fed integer timestep per example ``t`` ``[batch]`` make the noisy
input ``a(t) x0 + sqrt(1 - a(t)^2) noise`` with a cosine schedule ``a(t) = cos(t / T * pi / 2)``
computed in the graph. The timestep's sinusoidal features (``md.cast(t)`` times a constant of
frequencies, ``md.sin`` and ``md.cos`` joined by ``md.concat``) go through a SiLU MLP and are
added, projected per level, to the feature maps. Two levels: 3x3 ``md.conv`` blocks with a
batch norm (mean and variance over ``batch``, ``height`` and ``width`` per channel, a statistic
over a split batch under data parallelism), a 2x2 downsample by ``md.rearrange`` and an
einsum, a bottleneck conv block, an upsample by an einsum to four times the channels and a
``md.rearrange`` back to twice the rows and columns, a skip connection joined by ``md.concat``
on the channels, and a last conv to the image channels. Loss: the mean squared error of the
predicted noise.
"""
from dataclasses import dataclass
import math

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    image: int = 16
    channels: int = 3
    c1: int = 16
    c2: int = 32
    t_feat: int = 16        # sinusoidal features of the timestep (sines then cosines)
    d_t: int = 32
    steps: int = 1000
    batch: int = 8
    bn_eps: float = 1e-5
    down_conv: bool = False     # downsample by a 3x3 md.conv of stride 2 instead of a 2x2 patch merge

    @classmethod
    def tiny(cls) -> "Config":
        return cls(image=8, channels=3, c1=4, c2=6, t_feat=8, d_t=8, steps=100, batch=4)


def batch_norm(x: md.Tensor, g: md.Tensor, b: md.Tensor, dims: list[str], eps: float) -> md.Tensor:
    mean = md.reduce_mean(x, dims)
    var = md.reduce_mean((x - mean) ** 2, dims)
    return (x - mean) * md.rsqrt(var + eps) * g + b


def build(cfg: Config = Config()) -> md.Model:
    half = cfg.t_feat // 2
    batch, height, width = md.Dim("batch", cfg.batch), md.Dim("height", cfg.image), md.Dim("width", cfg.image)
    channels, c1, c2 = md.Dim("channels", cfg.channels), md.Dim("c1", cfg.c1), md.Dim("c2", cfg.c2)
    kh, kw, t_half, d_t = md.Dim("kh", 3), md.Dim("kw", 3), md.Dim("t_half", half), md.Dim("d_t", cfg.d_t)
    t_feat = md.Dim("t_half", 2 * half)
    c1o, c2o, cat, out_ch = md.Dim("c1o", cfg.c1), md.Dim("c2o", cfg.c2), md.Dim("cat", 2 * cfg.c1), md.Dim("out_ch", cfg.channels)
    merged, up = md.Dim("pr_pc_c1", 4 * cfg.c1), md.Dim("up", 4 * cfg.c1)
    with md.Graph("heldout_unet") as g:
        x0 = md.input("x0", [batch, height, width, channels])
        noise = md.input("noise", [batch, height, width, channels])
        t = md.input("t", [batch], dtype=torch.int64)
        p = {
            "t_w1": md.param("t_w1", [t_feat, d_t], fan_out=[d_t]),
            "t_w2": md.param("t_w2", [d_t, md.Dim("d_t2", cfg.d_t)], fan_out=["d_t2"]),
            "t_c1": md.param("t_c1", [md.Dim("d_t2", cfg.d_t), c1], fan_out=[c1]),
            "t_c2": md.param("t_c2", [md.Dim("d_t2", cfg.d_t), c2], fan_out=[c2]),
            "conv_in": md.param("conv_in", [kh, kw, channels, c1], fan_out=[c1]),
            "bn1_g": md.param("bn1_g", [c1], init="ones"), "bn1_b": md.param("bn1_b", [c1], init="zeros"),
            "w_down": (md.param("w_down", [kh, kw, c1, c2], fan_out=[c2]) if cfg.down_conv
                       else md.param("w_down", [merged, c2], fan_out=[c2])),
            "conv_mid": md.param("conv_mid", [kh, kw, c2, c2o], fan_out=[c2o]),
            "bn2_g": md.param("bn2_g", [c2o], init="ones"), "bn2_b": md.param("bn2_b", [c2o], init="zeros"),
            "w_up": md.param("w_up", [c2o, up], fan_out=[up]),
            "conv_dec": md.param("conv_dec", [kh, kw, cat, c1o], fan_out=[c1o]),
            "bn3_g": md.param("bn3_g", [c1o], init="ones"), "bn3_b": md.param("bn3_b", [c1o], init="zeros"),
            "conv_out": md.param("conv_out", [kh, kw, c1o, out_ch], fan_out=[out_ch]),
        }
        spatial = {"height": "kh", "width": "kw"}

        tf = md.cast(t, torch.float32)
        a = md.cos(tf * (math.pi / 2 / cfg.steps))
        xt = x0 * a + noise * md.sqrt(1.0 - a * a)
        freqs = md.constant(torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half), [t_half])
        ang = tf * freqs                                                   # [batch, t_half]
        temb = md.concat([md.sin(ang), md.cos(ang)], "t_half")
        temb = md.silu(md.einsum("batch t_half, t_half d_t -> batch d_t", temb, p["t_w1"]))
        temb = md.einsum("batch d_t, d_t d_t2 -> batch d_t2", temb, p["t_w2"])

        h1 = md.conv(xt, p["conv_in"], spatial)                            # [batch, height, width, c1]
        h1 = md.silu(batch_norm(h1, p["bn1_g"], p["bn1_b"], ["batch", "height", "width"], cfg.bn_eps))
        h1 = h1 + md.einsum("batch d_t2, d_t2 c1 -> batch c1", temb, p["t_c1"])

        if cfg.down_conv:
            h = md.conv(h1, p["w_down"], spatial, padding=(1, 1), stride=2)   # [batch, height/2, width/2, c2]
            h = md.rename(h, height="r", width="c")
        else:
            h = md.rearrange(h1, "batch (r pr) (c pc) c1 -> batch r c (pr pc c1)", pr=2, pc=2)
            h = md.einsum("batch r c pr_pc_c1, pr_pc_c1 c2 -> batch r c c2", h, p["w_down"])
        h = md.conv(h, p["conv_mid"], {"r": "kh", "c": "kw"})              # [batch, r, c, c2o]
        h = md.silu(batch_norm(h, p["bn2_g"], p["bn2_b"], ["batch", "r", "c"], cfg.bn_eps))
        h = h + md.rename(md.einsum("batch d_t2, d_t2 c2 -> batch c2", temb, p["t_c2"]), c2="c2o")

        h = md.einsum("batch r c c2o, c2o up -> batch r c up", h, p["w_up"])
        h = md.rearrange(h, "batch r c (pr pc c1) -> batch (r pr) (c pc) c1", pr=2, pc=2)
        h = md.rename(h, r_pr="height", c_pc="width")
        h = md.rename(md.concat([h, h1], "c1"), c1="cat")
        h = md.conv(h, p["conv_dec"], spatial)                             # [batch, height, width, c1o]
        h = md.silu(batch_norm(h, p["bn3_g"], p["bn3_b"], ["batch", "height", "width"], cfg.bn_eps))
        pred = md.rename(md.conv(h, p["conv_out"], spatial), out_ch="channels")
        loss = md.reduce_mean((pred - noise) ** 2)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        shape = (cfg.batch, cfg.image, cfg.image, cfg.channels)
        return {"x0": torch.randn(shape, generator=gen), "noise": torch.randn(shape, generator=gen),
                "t": torch.randint(0, cfg.steps, (cfg.batch,), generator=gen)}

    return md.Model(g, loss, p, feeds, cfg)
