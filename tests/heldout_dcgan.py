"""Held-out model (round 26c): a DCGAN-lite written from the docs alone.

The generator projects ``z`` to a 4x4 map and doubles it twice with 4x4 stride-2 transposed
convs (padding 1), batch norm and ReLU between, tanh out; the discriminator halves twice with
4x4 stride-2 convs and LeakyReLU(0.2) (batch norm on the second) and a linear logit. Both
losses are one objective: the discriminator's (real and detached fake images) plus the
generator's non-saturating one, whose discriminator params are detached, so each net gets
only its own loss's gradient.

Legend: ``batch`` samples, ``z`` the latent, ``height``/``width`` pixels, ``ch`` feature
channels (each conv's ``co`` renamed back), ``rgb`` an image's channels, ``kh``/``kw`` taps.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 8
    z: int = 16
    g_ch: int = 32
    d_ch: int = 16
    slope: float = 0.2

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, z=4, g_ch=8, d_ch=4)


TAPS = {"height": "kh", "width": "kw"}


def _kernel(name, c_in, c_out):
    kh, kw, co = md.Dim("kh", 4), md.Dim("kw", 4), md.Dim("co", c_out)
    return md.param(name, [kh, kw, c_in, co], fan_out=[co])


def _bn(x, name, dims=("batch", "height", "width")):
    ch = x.shape["ch"]
    return md.batch_norm(x, list(dims), md.param(f"{name}_s", [ch], init="ones"),
                         md.param(f"{name}_b", [ch], init="zeros"))


def generator(z, cfg: Config):
    """z [batch, z] -> images [batch, height:16, width:16, rgb] in (-1, 1)."""
    h4, w4, ch = md.Dim("height", 4), md.Dim("width", 4), md.Dim("ch", cfg.g_ch)
    proj = md.param("g_proj", [z.shape["z"], h4, w4, ch], fan_out=[h4, w4, ch])
    h = md.relu(_bn(md.einsum("batch z, z height width ch -> batch height width ch", z, proj), "g_bn0"))
    w1 = _kernel("g_up1", h.shape["ch"], cfg.g_ch // 2)
    h = md.rename(md.conv_transpose(h, w1, TAPS, stride=2, padding=1), co="ch")
    h = md.relu(_bn(h, "g_bn1"))
    w2 = _kernel("g_up2", h.shape["ch"], 3)
    return md.tanh(md.rename(md.conv_transpose(h, w2, TAPS, stride=2, padding=1), co="rgb"))


def discriminator_params(cfg: Config, image: int):
    rgb, ch = md.Dim("rgb", 3), md.Dim("ch", cfg.d_ch)
    q = image // 4
    return {"d_c1": _kernel("d_c1", rgb, cfg.d_ch), "d_c2": _kernel("d_c2", ch, 2 * cfg.d_ch),
            "d_bn_s": md.param("d_bn_s", [md.Dim("ch", 2 * cfg.d_ch)], init="ones"),
            "d_bn_b": md.param("d_bn_b", [md.Dim("ch", 2 * cfg.d_ch)], init="zeros"),
            "d_out": md.param("d_out", [md.Dim("height", q), md.Dim("width", q), md.Dim("ch", 2 * cfg.d_ch)])}


def discriminator(x, p, slope):
    """images [batch, height, width, rgb] -> logits [batch] (real is positive)."""
    h = md.leaky_relu(md.rename(md.conv(x, p["d_c1"], TAPS, padding=(1, 1), stride=2), co="ch"), slope)
    h = md.rename(md.conv(h, p["d_c2"], TAPS, padding=(1, 1), stride=2), co="ch")
    h = md.batch_norm(h, ["batch", "height", "width"], p["d_bn_s"], p["d_bn_b"])
    h = md.leaky_relu(h, slope)
    return md.einsum("batch height width ch, height width ch -> batch", h, p["d_out"])


def build(cfg: Config) -> md.Model:
    b, zd = md.Dim("batch", cfg.batch), md.Dim("z", cfg.z)
    img, rgb = md.Dim("height", 16), md.Dim("rgb", 3)
    with md.Graph() as g:
        z = md.input("z", [b, zd])
        real = md.input("x", [b, img, md.Dim("width", 16), rgb])
        fake = generator(z, cfg)
        p = discriminator_params(cfg, 16)
        frozen_d = {k: md.stop_gradient(v) for k, v in p.items()}
        d_loss = (md.reduce_mean(md.softplus(-discriminator(real, p, cfg.slope)))
                  + md.reduce_mean(md.softplus(discriminator(md.stop_gradient(fake), p, cfg.slope))))
        g_loss = md.reduce_mean(md.softplus(-discriminator(fake, frozen_d, cfg.slope)))
        loss = d_loss + g_loss

    def make_feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        return {"z": torch.randn(cfg.batch, cfg.z, generator=gen),
                "x": torch.rand(cfg.batch, 16, 16, 3, generator=gen) * 2 - 1}

    return md.Model(g, loss, g.params(), make_feeds, cfg, outputs={"d_loss": d_loss, "g_loss": g_loss})


def torch_reference(cfg: Config, weights: dict, feeds: dict) -> torch.Tensor:
    """The same objective in plain torch (float64, NCHW), from ``weights`` by name."""
    F = torch.nn.functional
    w = {k: v.double() for k, v in weights.items()}

    def bn(x, name):
        return F.batch_norm(x, None, None, w[f"{name}_s"], w[f"{name}_b"], training=True)

    def gen(z):
        h = torch.einsum("bz,zhwc->bchw", z, w["g_proj"])
        h = torch.relu(bn(h, "g_bn0"))
        h = torch.relu(bn(F.conv_transpose2d(h, w["g_up1"].permute(2, 3, 0, 1), stride=2, padding=1), "g_bn1"))
        return torch.tanh(F.conv_transpose2d(h, w["g_up2"].permute(2, 3, 0, 1), stride=2, padding=1))

    def disc(x, p):
        h = F.leaky_relu(F.conv2d(x, p["d_c1"].permute(3, 2, 0, 1), stride=2, padding=1), cfg.slope)
        h = F.conv2d(h, p["d_c2"].permute(3, 2, 0, 1), stride=2, padding=1)
        h = F.leaky_relu(F.batch_norm(h, None, None, p["d_bn_s"], p["d_bn_b"], training=True), cfg.slope)
        return torch.einsum("bchw,hwc->b", h, p["d_out"])

    p = {k: w[k] for k in ("d_c1", "d_c2", "d_bn_s", "d_bn_b", "d_out")}
    frozen = {k: v.detach() for k, v in p.items()}
    real = feeds["x"].double().permute(0, 3, 1, 2)
    fake = gen(feeds["z"].double())
    d_loss = F.softplus(-disc(real, p)).mean() + F.softplus(disc(fake.detach(), p)).mean()
    return d_loss + F.softplus(-disc(fake, frozen)).mean()
