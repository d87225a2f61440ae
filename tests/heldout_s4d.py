"""S4D-lite (Gu et al. 2022, diagonal state spaces): a long convolution whose kernel comes from learned
diagonal complex dynamics, applied through the FFT with zero padding to 2L (no circular wrap).

Dims:
  batch  sequences      seq    positions (2L after the zero padding)      chan  channels (S4's H)
  state  modes per channel (N)  freq  rfft frequencies of 2L  reim  (real, imaginary)  layer  the stack
  chan_out  the output mix's channels (renamed back to chan)

    K[chan, seq] = sum_state dt C exp(dt A_re l) (C_re cos(dt A_im l) - C_im sin(dt A_im l)),
        A_re = -exp(log_a_re), dt = exp(log_dt)
    y = irfft(rfft(pad(u)) * rfft(pad(K)))[:L] + D u  ->  gelu -> chan mix -> residual -> LN
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 8
    seq: int = 64
    chan: int = 32
    state: int = 16
    layers: int = 4

    remat: str | None = None          # what each layer saves (md.repeat remat=): None, "full", "selective"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, seq=8, chan=6, state=3, layers=2)


def cmul(a, b):
    """(a_re + i a_im)(b_re + i b_im), both with a size-2 ``reim`` part dim."""
    ar, ai = (md.squeeze(md.slice_(a, "reim", k, k + 1), "reim") for k in (0, 1))
    br, bi = (md.squeeze(md.slice_(b, "reim", k, k + 1), "reim") for k in (0, 1))
    return md.concat([md.unsqueeze(ar * br - ai * bi, "reim"), md.unsqueeze(ar * bi + ai * br, "reim")], "reim")


def build(cfg: Config = Config()) -> md.Model:
    batch, seq, chan = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("chan", cfg.chan)
    state, layer, chan_out = md.Dim("state", cfg.state), md.Dim("layer", cfg.layers), md.Dim("chan_out", cfg.chan)
    L = cfg.seq
    with md.Graph("s4d") as g:
        u = md.input("u", [batch, seq, chan])
        target = md.input("target", [batch, seq, chan])
        stack = {
            "log_dt": md.param("log_dt", [layer, chan], init=-1.5),
            "log_a_re": md.param("log_a_re", [layer, chan, state], init=-0.7),
            "a_im": md.param("a_im", [layer, chan, state], scale=3.0),
            "c_re": md.param("c_re", [layer, chan, state], scale=0.5),
            "c_im": md.param("c_im", [layer, chan, state], scale=0.5),
            "d": md.param("d", [layer, chan], init="ones"),
            "w_mix": md.param("w_mix", [layer, chan, chan_out], fan_out=["chan_out"]),
            "ln": md.param("ln", [layer, chan], init="ones"),
            "ln_b": md.param("ln_b", [layer, chan], init="zeros"),
        }
        pos = md.cast(md.arange(seq), torch.float32)

        def block(x, p):
            dt = md.exp(p["log_dt"])
            decay = md.exp(-md.exp(p["log_a_re"]) * dt * pos)           # [chan, state, seq]
            phase = p["a_im"] * dt * pos
            k = md.reduce_sum(dt * (p["c_re"] * md.cos(phase) - p["c_im"] * md.sin(phase)) * decay, "state")
            kf = md.rfft(md.pad(k, "seq", 0, L), "seq", freq="freq", part="reim")
            xf = md.rfft(md.pad(x, "seq", 0, L), "seq", freq="freq", part="reim")
            y = md.slice_(md.irfft(cmul(xf, kf), "freq", "reim", "seq", n=2 * L), "seq", 0, L) + p["d"] * x
            y = md.rename(md.einsum("batch seq chan, chan chan_out -> batch seq chan_out", md.gelu(y), p["w_mix"]),
                          chan_out="chan")
            return md.layer_norm(x + y, "chan", p["ln"], p["ln_b"])

        y = md.repeat(block, u, stack, "layer", remat=cfg.remat)
        loss = md.reduce_mean((y - target) ** 2)

    def feeds(seed: int = 0) -> dict:
        gen = torch.Generator().manual_seed(seed)
        u = torch.randn(cfg.batch, cfg.seq, cfg.chan, generator=gen)
        return {"u": u, "target": torch.cumsum(u, 1) / (1 + torch.arange(cfg.seq)).sqrt()[:, None]}

    return md.Model(g, loss, g.params(), feeds, cfg)


REF_INPUTS = ("u", "target")


def reference_loss(cfg: Config, p: dict, u, target):
    """The same model in plain torch: the kernel from complex exponentials, the convolution by
    torch.fft.rfft/irfft with n = 2L."""
    F = torch.nn.functional
    L, pos, x = cfg.seq, torch.arange(cfg.seq, dtype=u.dtype), u
    for i in range(cfg.layers):
        dt = p["log_dt"][i].exp()[:, None]                                     # [chan, 1]
        a = torch.complex(-p["log_a_re"][i].exp(), p["a_im"][i])               # [chan, state]
        c = torch.complex(p["c_re"][i], p["c_im"][i])
        k = ((dt * c)[..., None] * torch.exp((dt * a)[..., None] * pos)).sum(1).real   # [chan, L]
        y = torch.fft.irfft(torch.fft.rfft(x, n=2 * L, dim=1) * torch.fft.rfft(k, n=2 * L).T, n=2 * L, dim=1)[:, :L]
        y = F.gelu(y + p["d"][i] * x) @ p["w_mix"][i]
        x = F.layer_norm(x + y, (cfg.chan,), p["ln"][i], p["ln_b"][i])
    return ((x - target) ** 2).mean()
