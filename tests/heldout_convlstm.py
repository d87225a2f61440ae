"""Held-out model (round 20a): ConvLSTM next-frame prediction, written from the docs alone.

A recurrence over ``time`` (the outermost ``md.repeat`` scans it; each step reads its frame
as a stacked input) of 3x3 convs on ``[batch, height, width, channels]``: the four gates
i, f, o, g come from one conv of the frame and one of the hidden state (``gates`` = 4 x
``hid``, sliced apart), ``c' = f c + i g``, ``h' = o tanh(c')``. The carry is h and c joined
along ``hid`` (one tensor). Each step's per-layer output is a 1x1-conv prediction of the next
frame; the loss is its MSE against the fed next frames. The conv weights are shared by every
step (read from outside the block).

Legend: t time, b batch, y height, x width, c channels, n hid, g gates.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    time: int = 6
    batch: int = 4
    height: int = 16
    width: int = 16
    channels: int = 2
    hid: int = 8
    remat: str | None = None

    @classmethod
    def tiny(cls) -> "Config":
        return cls(time=4, batch=2, height=6, width=5, channels=2, hid=3)


def _step(carry, p, w, hid):
    h = md.slice_(carry, "hid", 0, hid)
    c = md.slice_(carry, "hid", hid, 2 * hid)
    taps = {"height": "kh", "width": "kw"}
    gates = md.conv(p["x"], w["wx"], taps) + md.conv(h, w["wh"], taps) + w["bias"]
    i, f, o, g = (md.rename(md.slice_(gates, "gates", n * hid, (n + 1) * hid), gates="hid") for n in range(4))
    c = md.sigmoid(f) * c + md.sigmoid(i) * md.tanh(g)
    h = md.sigmoid(o) * md.tanh(c)
    pred = md.einsum("batch height width hid, hid channels -> batch height width channels", h, w["out"]) + w["out_b"]
    return md.concat([h, c], "hid"), {"pred": pred}


def build(cfg: Config = Config()) -> md.Model:
    t, b = md.Dim("time", cfg.time), md.Dim("batch", cfg.batch)
    y, x, c = md.Dim("height", cfg.height), md.Dim("width", cfg.width), md.Dim("channels", cfg.channels)
    n, g4 = md.Dim("hid", cfg.hid), md.Dim("gates", 4 * cfg.hid)
    kh, kw, n2 = md.Dim("kh", 3), md.Dim("kw", 3), md.Dim("hid", 2 * cfg.hid)
    with md.Graph("convlstm") as g:
        frames = md.input("frames", [t, b, y, x, c])
        target = md.input("next_frames", [t, b, y, x, c])
        w = {"wx": md.param("wx", [kh, kw, c, g4], fan_out=["gates"]),
             "wh": md.param("wh", [kh, kw, n, g4], fan_out=["gates"]),
             "bias": md.param("bias", [g4], init="zeros"),
             "out": md.param("out", [n, c], fan_out=["channels"]),
             "out_b": md.param("out_b", [c], init="zeros")}
        state = md.constant(0.0, [b, y, x, n2])
        _, per_step = md.repeat(lambda s, p: _step(s, p, w, cfg.hid), state, {"x": frames}, "time", remat=cfg.remat)
        loss = md.reduce_mean((per_step["pred"] - target) ** 2)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        # Gaussian blobs moving at a constant velocity per sample (and channel), wrapping around.
        gen = torch.Generator().manual_seed(seed)
        pos = torch.rand(cfg.batch, cfg.channels, 2, generator=gen) * torch.tensor([cfg.height, cfg.width])
        vel = torch.randn(cfg.batch, cfg.channels, 2, generator=gen)
        yy, xx = torch.arange(cfg.height, dtype=torch.float32), torch.arange(cfg.width, dtype=torch.float32)
        video = []
        for step in range(cfg.time + 1):
            p = pos + step * vel
            dy = (yy[None, None, :] - p[..., 0:1]) % cfg.height
            dx = (xx[None, None, :] - p[..., 1:2]) % cfg.width
            dy, dx = torch.minimum(dy, cfg.height - dy), torch.minimum(dx, cfg.width - dx)
            img = torch.exp(-(dy[..., :, None] ** 2 + dx[..., None, :] ** 2) / 4.0)   # [b, c, y, x]
            video.append(img.permute(0, 2, 3, 1))
        v = torch.stack(video)
        return {"frames": v[:-1].contiguous(), "next_frames": v[1:].contiguous()}

    return md.Model(g, loss, g.params(), feeds, cfg)
