"""TimesNet-lite, a held-out model (round 27b): periods from the DFT amplitude, 2-D convs over cycles.

Legend: batch = series, time = steps, c_in = input variables, channels = the embedded width,
freq = the DFT's frequencies 1 .. time/2 (DC left out), freq_top = the top ``k`` of them, cycles x
period = ``time`` folded for one period, kh/kw = the 2-D conv's taps, d_ff = the inception-lite
conv's hidden channels, branch = the ``k`` period branches. A block embeds the series, takes its
DFT along ``time`` by einsums with constant cosine and sine tables (``md.constant``), and the
amplitude per series and frequency (mean over channels). ``md.top_k`` picks the ``k`` strongest
frequencies; their amplitudes, softmaxed per series, gate the ``k`` branches. Each branch folds
``time`` into ``[cycles, period]`` for a FIXED period (``periods``: ``md.rearrange`` cannot take a
period chosen at run time), runs conv 3x3 -> gelu -> conv 3x3 over (cycles, period), and unfolds;
the gated sum is added to the residual, layer-normed. A linear head maps each step to the target,
the loss the MSE against ``y``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 4
    time: int = 24
    c_in: int = 3
    channels: int = 8
    d_ff: int = 8
    periods: tuple = (4, 6)
    k: int = 2              # top-k frequencies, one gate per branch (k == len(periods))
    blocks: int = 2

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, time=12, c_in=2, channels=4, d_ff=4, periods=(3, 4), k=2, blocks=1)


def dft_tables(n: int):
    """cos and sin of 2 pi f t / n for f = 1 .. n // 2: float64 made, float32 kept."""
    t = torch.arange(n, dtype=torch.float64)[:, None]
    f = torch.arange(1, n // 2 + 1, dtype=torch.float64)[None, :]
    ang = 2 * math.pi * t * f / n
    return torch.cos(ang).float(), torch.sin(ang).float()


def _branch(x, p, period: int):
    z = md.rearrange(x, "batch (cycles period) channels -> batch cycles period channels", period=period)
    taps = {"cycles": "kh", "period": "kw"}
    h = md.gelu(md.conv(z, p["c1"], taps, padding="same") + p["c1_b"])
    z = md.conv(h, p["c2"], taps, padding="same") + p["c2_b"]
    # the merged group is named cycles_period: it is ``time`` again
    return md.rename(md.rearrange(z, "batch cycles period channels -> batch (cycles period) channels"),
                     {"cycles_period": "time"})


def _block(x, p, tables, cfg):
    cos_t, sin_t = tables
    re = md.einsum("batch time channels, time freq -> batch freq channels", x, cos_t)
    im = md.einsum("batch time channels, time freq -> batch freq channels", x, sin_t)
    amp = md.reduce_mean(md.sqrt(re * re + im * im + 1e-12), "channels")     # [batch, freq]
    top, _ = md.top_k(amp, "freq", cfg.k, new_dim="branch")
    gate = md.softmax(top, "branch")                                          # [batch, branch]
    outs = []
    for i, period in enumerate(cfg.periods):
        g_i = md.squeeze(md.slice_(gate, "branch", i, i + 1), "branch")
        outs.append(_branch(x, {k: v[i] for k, v in p.items() if k != "ln"}, period) * g_i)
    s = outs[0]
    for o in outs[1:]:
        s = s + o
    return md.layer_norm(x + s, "channels", p["ln"])


def build(cfg: Config) -> md.Model:
    assert cfg.k == len(cfg.periods), "one gate per branch"
    B, T, C_in, C = md.Dim("batch", cfg.batch), md.Dim("time", cfg.time), md.Dim("c_in", cfg.c_in), md.Dim("channels", cfg.channels)
    Fq, Ff = md.Dim("freq", cfg.time // 2), md.Dim("d_ff", cfg.d_ff)
    KH, KW = md.Dim("kh", 3), md.Dim("kw", 3)
    with md.Graph() as g:
        x_in, y = md.input("x", [B, T, C_in]), md.input("y", [B, T, C_in])
        emb = md.param("embed", [C_in, C], fan_out=["channels"])
        pos = md.param("pos", [T, C], scale=0.1)
        cos_np, sin_np = dft_tables(cfg.time)
        tables = (md.constant(cos_np, [T, Fq]), md.constant(sin_np, [T, Fq]))
        blocks = []
        for b in range(cfg.blocks):
            p = {"c1": [md.param(f"b{b}_p{i}_c1", [KH, KW, C, Ff], fan_out=["d_ff"]) for i in range(cfg.k)],
                 "c1_b": [md.param(f"b{b}_p{i}_c1_b", [Ff], init="zeros") for i in range(cfg.k)],
                 "c2": [md.param(f"b{b}_p{i}_c2", [KH, KW, Ff, C], fan_out=["channels"]) for i in range(cfg.k)],
                 "c2_b": [md.param(f"b{b}_p{i}_c2_b", [C], init="zeros") for i in range(cfg.k)],
                 "ln": md.param(f"b{b}_ln", [C], init="ones")}
            blocks.append(p)
        head = md.param("head", [C, md.Dim("c_out", cfg.c_in)], fan_out=["c_out"])
        x = md.einsum("batch time c_in, c_in channels -> batch time channels", x_in, emb) + pos
        for p in blocks:
            x = _block(x, p, tables, cfg)
        pred = md.rename(md.einsum("batch time channels, channels c_out -> batch time c_out", x, head), {"c_out": "c_in"})
        loss = md.reduce_mean(md.square(pred - y))

    def feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        t = torch.arange(cfg.time, dtype=torch.float32)
        phase = torch.rand(cfg.batch, 1, cfg.c_in, generator=gen) * 6.28
        base = torch.sin(2 * math.pi * t[None, :, None] / cfg.periods[0] + phase)
        x = base + 0.5 * torch.sin(2 * math.pi * t[None, :, None] / cfg.periods[-1]) + 0.3 * torch.randn(
            cfg.batch, cfg.time, cfg.c_in, generator=gen)
        return {"x": x, "y": torch.roll(x, -1, 1)}

    return md.Model(g, loss, g.params(), feeds, cfg)


REF_INPUTS = ("x", "y")


def reference_loss(cfg: Config, p: dict, x, y):
    """The same model in plain torch: torch.fft.rfft's amplitude, torch.topk, F.conv2d over the folds."""
    F = torch.nn.functional
    h = x @ p["embed"] + p["pos"]
    B, T, C = h.shape
    for b in range(cfg.blocks):
        amp = torch.fft.rfft(h, dim=1)[:, 1:T // 2 + 1].abs().mean(-1)      # [batch, freq]
        gate = torch.softmax(torch.topk(amp, cfg.k, dim=1).values, 1)
        s = 0
        for i, period in enumerate(cfg.periods):
            z = h.reshape(B, T // period, period, C).permute(0, 3, 1, 2)
            pre = f"b{b}_p{i}"
            z = F.gelu(F.conv2d(z, p[f"{pre}_c1"].permute(3, 2, 0, 1), p[f"{pre}_c1_b"], padding=1))
            z = F.conv2d(z, p[f"{pre}_c2"].permute(3, 2, 0, 1), p[f"{pre}_c2_b"], padding=1)
            s = s + z.permute(0, 2, 3, 1).reshape(B, T, C) * gate[:, i, None, None]
        h = F.layer_norm(h + s, (C,), p[f"b{b}_ln"])
    return ((h @ p["head"] - y) ** 2).mean()
