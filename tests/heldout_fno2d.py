"""FNO-2D (Li et al. 2021) with meshdsl's Fourier ops: a spectral convolution that keeps the low modes.

Dims:
  batch      fields        gx, gy  the grid (kx: gx's kept modes, low and high; ky: gy's rfft modes)
  c_in       input channels        width  the lifted channels (width_out: a layer's output, renamed back)
  reim       (real, imaginary)     layer  the stack

    a -> lift (c_in width) -> [layer x: gelu(spectral(x) + x W)] -> project (width) -> u
    spectral(x) = irfft_gy(ifft_gx(zero-fill(R * keep(fft_gx(rfft_gy(x))))))   (irfft pads ky)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 8
    gx: int = 16
    gy: int = 16
    c_in: int = 3
    width: int = 16
    modes_x: int = 4
    modes_y: int = 4
    layers: int = 3

    remat: str | None = None          # what each layer saves (md.repeat remat=): None, "full", "selective"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, gx=6, gy=8, c_in=3, width=4, modes_x=2, modes_y=3, layers=2)


def part(t, k):
    return md.squeeze(md.slice_(t, "reim", k, k + 1), "reim")


def spectral(x, r, cfg):
    """The kept modes of x times the complex weights r [kx, ky, width, width_out, reim]."""
    f = md.slice_(md.rfft(x, "gy", freq="ky", part="reim"), "ky", 0, cfg.modes_y)
    f = md.fft(f, "gx", "reim")
    m = cfg.modes_x
    f = md.rename(md.concat([md.slice_(f, "gx", 0, m), md.slice_(f, "gx", cfg.gx - m, cfg.gx)], "gx"), gx="kx")
    eq = "batch kx ky width, kx ky width width_out -> batch kx ky width_out"
    fr, fi, rr, ri = part(f, 0), part(f, 1), part(r, 0), part(r, 1)
    re = md.einsum(eq, fr, rr) - md.einsum(eq, fi, ri)
    im = md.einsum(eq, fr, ri) + md.einsum(eq, fi, rr)
    g = md.concat([md.unsqueeze(re, "reim"), md.unsqueeze(im, "reim")], "reim")
    low, high = md.slice_(g, "kx", 0, m), md.slice_(g, "kx", m, 2 * m)
    g = md.rename(md.concat([md.pad(low, "kx", 0, cfg.gx - 2 * m), high], "kx"), kx="gx")
    return md.irfft(md.ifft(g, "gx", "reim"), "ky", "reim", "gy", n=cfg.gy)


def build(cfg: Config = Config()) -> md.Model:
    batch, gx, gy = md.Dim("batch", cfg.batch), md.Dim("gx", cfg.gx), md.Dim("gy", cfg.gy)
    c_in, width, width_out = md.Dim("c_in", cfg.c_in), md.Dim("width", cfg.width), md.Dim("width_out", cfg.width)
    kx, ky, reim = md.Dim("kx", 2 * cfg.modes_x), md.Dim("ky", cfg.modes_y), md.Dim("reim", 2)
    layer = md.Dim("layer", cfg.layers)
    with md.Graph("fno2d") as g:
        a = md.input("a", [batch, gx, gy, c_in])
        u = md.input("u", [batch, gx, gy])
        w_lift = md.param("w_lift", [c_in, width], fan_out=["width"])
        stack = {"r": md.param("r", [layer, kx, ky, width, width_out, reim], scale=1.0 / cfg.width),
                 "w": md.param("w", [layer, width, width_out], fan_out=["width_out"])}
        w_proj = md.param("w_proj", [width], scale=cfg.width ** -0.5)
        x = md.einsum("batch gx gy c_in, c_in width -> batch gx gy width", a, w_lift)

        def block(x, p):
            local = md.einsum("batch gx gy width, width width_out -> batch gx gy width_out", x, p["w"])
            return md.rename(md.gelu(spectral(x, p["r"], cfg) + local), width_out="width")

        x = md.repeat(block, x, stack, "layer", remat=cfg.remat)
        pred = md.einsum("batch gx gy width, width -> batch gx gy", x, w_proj)
        loss = md.reduce_mean((pred - u) ** 2)

    def feeds(seed: int = 0) -> dict:
        gen = torch.Generator().manual_seed(seed)
        a = torch.randn(cfg.batch, cfg.gx, cfg.gy, cfg.c_in, generator=gen)
        u = torch.fft.irfft2(torch.fft.rfft2(a[..., 0]) * 0.3, s=(cfg.gx, cfg.gy)) + a[..., 1] ** 2 * 0.1
        return {"a": a, "u": u}

    return md.Model(g, loss, g.params(), feeds, cfg)


REF_INPUTS = ("a", "u")


def reference_loss(cfg: Config, p: dict, a, u):
    """The same model in plain torch: torch.fft.rfft2 / irfft2 and the kept corners of the spectrum."""
    F = torch.nn.functional
    m1, m2, x = cfg.modes_x, cfg.modes_y, a @ p["w_lift"]
    for i in range(cfg.layers):
        spec = torch.fft.rfft2(x, dim=(1, 2))
        r = torch.view_as_complex(p["r"][i])                                    # [kx, ky, width, width_out]
        out = torch.zeros(*spec.shape[:3], cfg.width, dtype=spec.dtype)
        out[:, :m1, :m2] = torch.einsum("bxyi,xyio->bxyo", spec[:, :m1, :m2], r[:m1])
        out[:, cfg.gx - m1:, :m2] = torch.einsum("bxyi,xyio->bxyo", spec[:, cfg.gx - m1:, :m2], r[m1:])
        x = F.gelu(torch.fft.irfft2(out, s=(cfg.gx, cfg.gy), dim=(1, 2)) + x @ p["w"][i])
    return ((x @ p["w_proj"] - u) ** 2).mean()
