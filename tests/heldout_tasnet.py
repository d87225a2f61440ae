"""Conv-TasNet-lite, written from the docs alone: a strided 1-D conv encoder, a TCN separator
(1x1 conv, PReLU, a norm, a dilated depthwise conv, PReLU, a norm, 1x1 back, residual) stacked
``repeats`` times with dilations 1, 2, 4, ... inside each repeat, sigmoid masks per speaker, a
decoder written as an einsum to frames and an overlap-add (frames shifted by one and summed), and
the negative SI-SNR with permutation-invariant training over two speakers (min over the two).

``norm=gln`` is the global layer norm (over frames and channels), ``norm=cln`` a per-frame one.

Legend: b batch, t time, f frames, n n_basis, c channels (bottleneck), k hidden, s spk, r rep.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 4
    hop: int = 8
    frames: int = 32
    n_basis: int = 32
    channels: int = 16
    hidden: int = 32
    levels: int = 3
    repeats: int = 2
    norm: str = "gln"       # gln | cln
    remat: str = "none"

    @classmethod
    def tiny(cls):
        return cls(batch=4, hop=2, frames=12, n_basis=6, channels=4, hidden=6, levels=2, repeats=2)


def _prelu(x, a):
    return md.relu(x) - a * md.relu(-x)


def _norm(cfg, x, scale, bias, feat):
    over = ["frames", feat] if cfg.norm == "gln" else [feat]
    mean = md.reduce_mean(x, over)
    var = md.reduce_mean((x - mean) ** 2, over)
    return (x - mean) * md.rsqrt(var + 1e-8) * scale + bias


def _separator(cfg, d, y, p):
    """The TCN: ``repeats`` blocks under md.repeat (dim ``rep``), each ``levels`` dilated levels."""
    def block(x, q):
        for i in range(cfg.levels):
            h = md.einsum("batch frames channels, channels hidden -> batch frames hidden", x, q[f"in{i}"])
            h = _norm(cfg, _prelu(h, q[f"a1_{i}"]), q[f"g1_{i}"], q[f"b1_{i}"], "hidden")
            h = md.conv(h, q[f"dw{i}"], {"frames": "tap"}, padding="same", dilation=2 ** i)
            h = _norm(cfg, _prelu(h, q[f"a2_{i}"]), q[f"g2_{i}"], q[f"b2_{i}"], "hidden")
            out = md.einsum("batch frames hidden, hidden c_out -> batch frames c_out", h, q[f"out{i}"])
            x = x + md.rename(out, c_out="channels")
        return x

    return md.repeat(block, y, {k: v for k, v in p.items() if k not in ("enc", "bott", "mask", "dec")}, "rep",
                     remat=cfg.remat)


def _params(cfg, d):
    r, c, k, tap = d["r"], d["c"], d["k"], md.Dim("tap", 3)
    p = {"enc": md.param("enc", [d["t2"], d["mic"], d["n"]], fan_out=["n_basis"]),
         "bott": md.param("bott", [d["n"], c], fan_out=["channels"]),
         "mask": md.param("mask", [c, d["s"], d["n"]], fan_out=["spk", "n_basis"]),
         "dec": md.param("dec", [d["n"], d["t2"]], fan_out=["tap2"])}
    for i in range(cfg.levels):
        p[f"in{i}"] = md.param(f"in{i}", [r, c, k], fan_out=["rep", "hidden"])
        p[f"dw{i}"] = md.param(f"dw{i}", [r, tap, k], fan_out=["rep", "hidden"])
        p[f"out{i}"] = md.param(f"out{i}", [r, k, md.Dim("c_out", cfg.channels)], fan_out=["rep", "c_out"])
        for a in ("a1", "a2"):
            p[f"{a}_{i}"] = md.param(f"{a}_{i}", [r], init=0.25)
        for g in ("g1", "g2"):
            p[f"{g}_{i}"] = md.param(f"{g}_{i}", [r, k], init="ones")
        for b in ("b1", "b2"):
            p[f"{b}_{i}"] = md.param(f"{b}_{i}", [r, k], init="zeros")
    return p


def _decode(cfg, masked, p):
    """Frames -> waveform: each frame's 2*hop samples, overlap-added with a hop of ``hop``."""
    seg = md.einsum("batch frames spk n_basis, n_basis tap2 -> batch frames spk tap2", masked, p["dec"])
    first = md.rename(md.slice_(seg, "tap2", 0, cfg.hop), tap2="hop")
    second = md.rename(md.slice_(seg, "tap2", cfg.hop, 2 * cfg.hop), tap2="hop")
    ola = md.pad(first, "frames", 0, 1) + md.pad(second, "frames", 1, 0)        # frames + 1 segments
    return md.rename(md.rearrange(ola, "batch frames spk hop -> batch spk (frames hop)"), frames_hop="time")


def _si_snr(est, ref):
    """SI-SNR in dB per (batch, spk), both zero-mean over time."""
    est = est - md.reduce_mean(est, "time")
    ref = ref - md.reduce_mean(ref, "time")
    s_t = md.reduce_sum(est * ref, "time") / (md.reduce_sum(ref * ref, "time") + 1e-8) * ref
    e = est - s_t
    ratio = md.reduce_sum(s_t * s_t, "time") / (md.reduce_sum(e * e, "time") + 1e-8)
    return 10.0 / 2.302585092994046 * md.log(ratio + 1e-8)


def build(cfg: Config) -> md.Model:
    if cfg.norm not in ("gln", "cln"):
        raise ValueError(f"norm must be gln or cln, got {cfg.norm!r}")
    T = (cfg.frames + 1) * cfg.hop
    d = dict(b=md.Dim("batch", cfg.batch), t=md.Dim("time", T), mic=md.Dim("mic", 1),
             t2=md.Dim("tap2", 2 * cfg.hop), n=md.Dim("n_basis", cfg.n_basis), c=md.Dim("channels", cfg.channels),
             k=md.Dim("hidden", cfg.hidden), s=md.Dim("spk", 2), r=md.Dim("rep", cfg.repeats))
    with md.Graph() as g:
        mix = md.input("mix", [d["b"], d["t"], d["mic"]])
        ref = md.input("ref", [d["b"], d["s"], d["t"]])
        p = _params(cfg, d)
        enc = md.relu(md.conv(mix, p["enc"], {"time": "tap2"}, padding="valid", stride=cfg.hop))
        enc = md.rename(enc, time="frames")                                     # [b, frames, n_basis]
        y = md.einsum("batch frames n_basis, n_basis channels -> batch frames channels", enc, p["bott"])
        y = _separator(cfg, d, y, p)
        masks = md.sigmoid(md.einsum("batch frames channels, channels spk n_basis -> batch frames spk n_basis",
                                     y, p["mask"]))
        est = _decode(cfg, enc * masks, p)                                      # [b, spk, time]
        same = md.reduce_mean(_si_snr(est, ref), "spk")
        swapped = md.reduce_mean(_si_snr(est, md.roll(ref, "spk", 1)), "spk")
        loss = md.reduce_mean(md.minimum(-same, -swapped))

    def feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        src = torch.randn(cfg.batch, 2, T, generator=gen)
        return {"mix": src.sum(1).unsqueeze(-1), "ref": src}

    return md.Model(g, loss, g.params(), feeds, cfg)
