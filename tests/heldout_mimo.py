"""MIMO-UNet-lite (multi-input multi-output image restoration), a held-out model (round 24a).

Legend: batch = images; height/width (full), height2/width2 (half), height4/width4 (quarter) = the
three scales' pixels; rgb = colour; channels = features (c_out a conv's output before its rename);
ph/pw = a small patch's pixels, fh/fw = its DFT frequencies. Three blurred scales in (fed), three
restored out (each its input plus a residual), L1 to each fed sharp scale, and a frequency loss:
the L1 of the real and imaginary parts of a 2-D DFT (md.constant cos/sin tables, no FFT op) of the
full-scale output's top-left patch against the sharp one's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 4
    size: int = 16
    channels: int = 8
    patch: int = 4
    freq_weight: float = 0.1

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=2, size=8, channels=4, patch=4)


def _conv(x, name, c_in, c_out, taps=("kh", "kw"), stride=1):
    KH, KW = md.Dim(taps[0], 3), md.Dim(taps[1], 3)
    w = md.param(name, [KH, KW, x.shape[c_in], md.Dim("c_out", c_out)])
    hw = [d for d in x.shape.names if d.startswith("height") or d.startswith("width")]
    y = md.conv(x, w, {hw[0]: taps[0], hw[1]: taps[1]}, stride=stride)
    return md.rename(y, {"c_out": "channels"} if c_in == "channels" or c_in == "rgb" else {})


def _up(x, small, big, h, w):
    """Nearest 2x upsampling as an einsum with two constant 0/1 tables."""
    up_h = md.constant(torch.repeat_interleave(torch.eye(small), 2, dim=1), [f"height{h}", f"height{big}"])
    up_w = md.constant(torch.repeat_interleave(torch.eye(small), 2, dim=1), [f"width{h}", f"width{big}"])
    return md.einsum(f"batch height{h} width{h} channels, height{h} height{big}, width{h} width{big} "
                     f"-> batch height{big} width{big} channels", x, up_h, up_w)


def _dft(img, n: int, P, Fq):
    """Real and imaginary parts of the 2-D DFT of img [batch, ph, pw, rgb]."""
    k = torch.arange(n, dtype=torch.float64)
    ang = 2 * math.pi * torch.outer(k, k) / n
    ch, sh = md.constant(torch.cos(ang).float(), ["ph", "fh"]), md.constant(torch.sin(ang).float(), ["ph", "fh"])
    cw, sw = md.rename(ch, {"ph": "pw", "fh": "fw"}), md.rename(sh, {"ph": "pw", "fh": "fw"})
    e = "batch ph pw rgb, ph fh, pw fw -> batch fh fw rgb"
    re = md.einsum(e, img, ch, cw) - md.einsum(e, img, sh, sw)
    im = -(md.einsum(e, img, sh, cw) + md.einsum(e, img, ch, sw))
    return re, im


def build(cfg: Config) -> md.Model:
    n, c = cfg.size, cfg.channels
    B, R = md.Dim("batch", cfg.batch), md.Dim("rgb", 3)
    dims = {s: [B, md.Dim(f"height{s}", n // int(s or 1)), md.Dim(f"width{s}", n // int(s or 1)), R] for s in ("", "2", "4")}
    with md.Graph() as g:
        blur = {s: md.input(f"blur{s or 1}", d) for s, d in dims.items()}
        sharp = {s: md.input(f"sharp{s or 1}", d) for s, d in dims.items()}
        e1 = md.relu(_conv(blur[""], "in1", "rgb", c))
        d2 = md.rename(_conv(e1, "down2", "channels", c, stride=2), {"height": "height2", "width": "width2"})
        e2 = md.relu(d2 + _conv(blur["2"], "in2", "rgb", c))
        d4 = md.rename(_conv(e2, "down4", "channels", c, stride=2), {"height2": "height4", "width2": "width4"})
        e4 = md.relu(d4 + _conv(blur["4"], "in4", "rgb", c))
        f4 = md.relu(_conv(e4, "mid4", "channels", c))
        f2 = md.relu(_conv(e2 + _up(f4, n // 4, "2", "4", "4"), "mid2", "channels", c))
        f1 = md.relu(_conv(e1 + _up(f2, n // 2, "", "2", "2"), "mid1", "channels", c))
        out = {s: blur[s] + md.rename(_conv(f, f"out{s or 1}", "channels", 3), {"channels": "rgb"})
               for s, f in (("", f1), ("2", f2), ("4", f4))}
        loss = sum(md.reduce_mean(abs(out[s] - sharp[s])) for s in out)
        P = cfg.patch
        patch = {k: md.rename(md.slice_(md.slice_(v, "height", 0, P), "width", 0, P), {"height": "ph", "width": "pw"})
                 for k, v in (("out", out[""]), ("sharp", sharp[""]))}
        (ro, io), (rs, is_) = _dft(patch["out"], P, P, P), _dft(patch["sharp"], P, P, P)
        loss = loss + cfg.freq_weight * (md.reduce_mean(abs(ro - rs)) + md.reduce_mean(abs(io - is_)))

    def feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        out = {}
        for s, k in (("", 1), ("2", 2), ("4", 4)):
            m = n // k
            out[f"sharp{s or 1}"] = torch.rand(cfg.batch, m, m, 3, generator=gen)
            out[f"blur{s or 1}"] = out[f"sharp{s or 1}"] + 0.1 * torch.randn(cfg.batch, m, m, 3, generator=gen)
        return out

    return md.Model(g, loss, g.params(), feeds, cfg)


REF_INPUTS = ("blur1", "blur2", "blur4", "sharp1", "sharp2", "sharp4")


def reference_loss(cfg: Config, p: dict, blur1, blur2, blur4, sharp1, sharp2, sharp4):
    """The same net in plain torch: F.conv2d, F.interpolate (nearest), torch.fft.fft2 for the DFT."""
    F = torch.nn.functional

    def conv(x, name, stride=1):
        return F.conv2d(x, p[name].permute(3, 2, 0, 1), padding=1, stride=stride)

    b1, b2, b4 = (t.permute(0, 3, 1, 2) for t in (blur1, blur2, blur4))
    up = lambda t: F.interpolate(t, scale_factor=2, mode="nearest")
    e1 = torch.relu(conv(b1, "in1"))
    e2 = torch.relu(conv(e1, "down2", 2) + conv(b2, "in2"))
    e4 = torch.relu(conv(e2, "down4", 2) + conv(b4, "in4"))
    f4 = torch.relu(conv(e4, "mid4"))
    f2 = torch.relu(conv(e2 + up(f4), "mid2"))
    f1 = torch.relu(conv(e1 + up(f2), "mid1"))
    outs = [(b + conv(f, f"out{k}")).permute(0, 2, 3, 1) for b, f, k in ((b1, f1, 1), (b2, f2, 2), (b4, f4, 4))]
    loss = sum((o - s).abs().mean() for o, s in zip(outs, (sharp1, sharp2, sharp4)))
    P = cfg.patch
    fo, fs = (torch.fft.fft2(t[:, :P, :P].permute(0, 3, 1, 2)) for t in (outs[0], sharp1))
    return loss + cfg.freq_weight * ((fo.real - fs.real).abs().mean() + (fo.imag - fs.imag).abs().mean())
