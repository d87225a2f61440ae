"""Held-out model (round 20a): FNO-lite, a 1-D Fourier neural operator, from the docs alone.

meshdsl has no FFT op (api.md): the spectral convolution's truncated real DFT is an einsum
with constant cosine and sine tables ``[grid, modes]``, the complex weights are two real
tensors ``[modes, channels, c_out]``, and the inverse real DFT of the kept modes is an
einsum with the tables ``[modes, grid]`` that carry irfft's weights (1/n for mode 0, 2/n
for the others). Each layer: spectral conv + a pointwise (1x1) conv + bias, then gelu, under
``md.repeat``. Lift from (a(x), x) to ``channels``, project to one output;
the loss is the MSE against a fed target: the solution of a 1-D heat equation after a fixed
time, u(x) = sum_k exp(-k^2 t) a_k e^{ikx}, computed in the feeds.

Legend: b batch, x grid, k modes, c channels, o c_out, l layer.
"""
import math
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 8
    grid: int = 64
    modes: int = 12
    channels: int = 16
    layers: int = 4
    t: float = 0.05
    remat: str | None = None

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, grid=12, modes=4, channels=6, layers=2)


def dft_tables(grid: int, modes: int) -> dict[str, torch.Tensor]:
    """rfft's first ``modes`` rows as real tables, and irfft's columns for them."""
    ang = 2 * math.pi / grid * torch.outer(torch.arange(grid, dtype=torch.float64), torch.arange(modes, dtype=torch.float64))
    weight = torch.full((modes,), 2.0 / grid, dtype=torch.float64)
    weight[0] = 1.0 / grid
    if modes * 2 == grid:                 # the Nyquist mode counts once
        weight[-1] = 1.0 / grid
    return {"cos": ang.cos().float(), "sin": ang.sin().float(),
            "icos": (ang.cos() * weight).T.float(), "isin": (ang.sin() * weight).T.float()}


def spectral_conv(h_bxc, w_re, w_im, tables):
    """irfft(W * rfft(h)[:modes]) with the DFTs as einsums over ``grid`` and ``modes``."""
    cos, sin, icos, isin = tables
    re = md.einsum("batch grid channels, grid modes -> batch modes channels", h_bxc, cos)
    im = -md.einsum("batch grid channels, grid modes -> batch modes channels", h_bxc, sin)
    y_re = md.einsum("batch modes channels, modes channels c_out -> batch modes c_out", re, w_re) - \
        md.einsum("batch modes channels, modes channels c_out -> batch modes c_out", im, w_im)
    y_im = md.einsum("batch modes channels, modes channels c_out -> batch modes c_out", re, w_im) + \
        md.einsum("batch modes channels, modes channels c_out -> batch modes c_out", im, w_re)
    return md.einsum("batch modes c_out, modes grid -> batch grid c_out", y_re, icos) - \
        md.einsum("batch modes c_out, modes grid -> batch grid c_out", y_im, isin)


def _layer(h_bxc, p, tables):
    spec = spectral_conv(h_bxc, p["w_re"], p["w_im"], tables)
    local = md.einsum("batch grid channels, channels c_out -> batch grid c_out", h_bxc, p["w"])
    out = md.rename(spec + local + p["bias"], c_out="channels")
    return md.gelu(out)


def build(cfg: Config = Config()) -> md.Model:
    b, x, k = md.Dim("batch", cfg.batch), md.Dim("grid", cfg.grid), md.Dim("modes", cfg.modes)
    c, o, l = md.Dim("channels", cfg.channels), md.Dim("c_out", cfg.channels), md.Dim("layer", cfg.layers)
    feat, hid = md.Dim("features", 2), md.Dim("hidden", 2 * cfg.channels)
    t = dft_tables(cfg.grid, cfg.modes)
    with md.Graph("fno") as g:
        a = md.input("a", [b, x])
        u = md.input("u", [b, x])
        tables = (md.constant(t["cos"], [x, k]), md.constant(t["sin"], [x, k]),
                  md.constant(t["icos"], [k, x]), md.constant(t["isin"], [k, x]))
        coord = md.constant(torch.linspace(0, 1, cfg.grid), [x])
        inp = md.concat([md.unsqueeze(a, md.Dim("features", 1)),
                         md.unsqueeze(md.broadcast_to(coord, [b, x]), md.Dim("features", 1))], "features")
        h = md.einsum("batch grid features, features channels -> batch grid channels", inp,
                      md.param("lift", [feat, c], fan_out=["channels"])) + md.param("lift_b", [c], init="zeros")
        scale = 1.0 / cfg.channels
        stacked = {"w_re": md.param("w_re", [l, k, c, o], scale=scale), "w_im": md.param("w_im", [l, k, c, o], scale=scale),
                   "w": md.param("w", [l, c, o], fan_out=["layer", "c_out"]), "bias": md.param("bias", [l, o], init="zeros")}
        h = md.repeat(lambda hh, p: _layer(hh, p, tables), h, stacked, "layer", remat=cfg.remat)
        q = md.gelu(md.einsum("batch grid channels, channels hidden -> batch grid hidden", h,
                              md.param("proj1", [c, hid], fan_out=["hidden"])))
        pred = md.einsum("batch grid hidden, hidden -> batch grid", q, md.param("proj2", [hid]))
        loss = md.reduce_mean((pred - u) ** 2)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        n_k = max(1, cfg.grid // 4)
        coef = torch.randn(cfg.batch, n_k, 2, generator=gen) / (1 + torch.arange(n_k))[:, None]
        xs = 2 * math.pi * torch.arange(cfg.grid) / cfg.grid
        kk = torch.arange(n_k, dtype=torch.float32)
        basis_c, basis_s = torch.cos(torch.outer(kk, xs)), torch.sin(torch.outer(kk, xs))
        a0 = coef[..., 0] @ basis_c + coef[..., 1] @ basis_s
        decay = torch.exp(-kk ** 2 * cfg.t)
        u0 = (coef[..., 0] * decay) @ basis_c + (coef[..., 1] * decay) @ basis_s
        return {"a": a0, "u": u0}

    return md.Model(g, loss, g.params(), feeds, cfg)
