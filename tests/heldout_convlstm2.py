"""Held-out model (round 26d): a ConvLSTM predicting the next frame of a video, MSE.

Written from README.md and docs/guide/*.md only. The four gates are their own dim: each step's
gates are `md.conv(x, w [kh, kw, c_in, gate, hid])` of the frame plus the same of the hidden state,
so a layout splits `hid` with no collective between the gates. (h, c) is the tuple carry of an
`md.repeat` over `time`; each step's h is a per-step output, read out by a 1x1 conv into a
prediction of the next frame.

Legend: b batch, t time, y height, x width, c c_in (frame channels), g gate (i, f, g, o),
h hid, i hid_in (the hidden features a conv reads).
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 4
    time: int = 8
    height: int = 16
    width: int = 16
    c_in: int = 2
    hid: int = 16
    kernel: int = 3
    remat: str | None = None

    @classmethod
    def tiny(cls):
        return cls(batch=4, time=4, height=6, width=5, c_in=2, hid=6, kernel=3)


def build(cfg: Config) -> md.Model:
    b, t = md.Dim("batch", cfg.batch), md.Dim("time", cfg.time)
    y, x, c = md.Dim("height", cfg.height), md.Dim("width", cfg.width), md.Dim("c_in", cfg.c_in)
    g, h, i = md.Dim("gate", 4), md.Dim("hid", cfg.hid), md.Dim("hid_in", cfg.hid)
    kh, kw = md.Dim("kh", cfg.kernel), md.Dim("kw", cfg.kernel)
    taps = {"height": "kh", "width": "kw"}
    with md.Graph() as graph:
        video = md.input("video", [b, t, y, x, c])
        wx = md.param("wx", [kh, kw, c, g, h], fan_out=["gate", "hid"])
        wh = md.param("wh", [kh, kw, i, g, h], fan_out=["gate", "hid"])
        bias = md.param("bias", [g, h], scale=0.1)
        w_read = md.param("w_read", [h, c], fan_out=["c_in"])
        frames = md.transpose(md.slice_(video, "time", 0, cfg.time - 1), ["time", "batch", "height", "width", "c_in"])
        zero = md.constant(0.0, [b, y, x, h])

        def step(hc, s):
            h_prev, c_prev = hc
            gates = (md.conv(s["frame"], wx, taps, padding="same")
                     + md.conv(md.rename(h_prev, hid="hid_in"), wh, taps, padding="same") + bias)
            ig, fg, gg, og = (md.squeeze(md.slice_(gates, "gate", k, k + 1), "gate") for k in range(4))
            c_new = md.sigmoid(fg) * c_prev + md.sigmoid(ig) * md.tanh(gg)
            h_new = md.sigmoid(og) * md.tanh(c_new)
            return (h_new, c_new), {"h": h_new}

        _, per = md.repeat(step, (zero, zero), {"frame": frames}, "time", remat=cfg.remat)
        pred = md.einsum("time batch height width hid, hid c_in -> batch time height width c_in", per["h"], w_read)
        nxt = md.slice_(video, "time", 1, cfg.time)
        loss = md.reduce_mean((pred - nxt) ** 2)

    def make_feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        # a blob drifting one pixel a frame: the next frame follows from the last ones
        base = torch.randn(cfg.batch, 1, cfg.height, cfg.width, cfg.c_in, generator=gen)
        vid = torch.cat([torch.roll(base, (k, k), (2, 3)) for k in range(cfg.time)], 1)
        return {"video": vid + 0.1 * torch.randn(vid.shape, generator=gen)}

    return md.Model(graph, loss, graph.params(), make_feeds, cfg)


# ----------------------------------------------------------------------------- torch reference

REF_INPUTS = ["video"]


def reference_loss(cfg: Config, p: dict, video):
    """The same model with F.conv2d (channels first, gates x hid flattened as torch's out channels)."""
    F, pad = torch.nn.functional, cfg.kernel // 2
    wx = p["wx"].permute(3, 4, 2, 0, 1).reshape(4 * cfg.hid, cfg.c_in, cfg.kernel, cfg.kernel)
    wh = p["wh"].permute(3, 4, 2, 0, 1).reshape(4 * cfg.hid, cfg.hid, cfg.kernel, cfg.kernel)
    bias = p["bias"].reshape(-1)
    frames = video.permute(0, 1, 4, 2, 3)                    # [b, t, c, y, x]
    h = c = torch.zeros(cfg.batch, cfg.hid, cfg.height, cfg.width, dtype=video.dtype)
    preds = []
    for t in range(cfg.time - 1):
        g = F.conv2d(frames[:, t], wx, bias, padding=pad) + F.conv2d(h, wh, padding=pad)
        ig, fg, gg, og = g.reshape(cfg.batch, 4, cfg.hid, cfg.height, cfg.width).unbind(1)
        c = torch.sigmoid(fg) * c + torch.sigmoid(ig) * torch.tanh(gg)
        h = torch.sigmoid(og) * torch.tanh(c)
        preds.append(torch.einsum("bhyx,hc->byxc", h, p["w_read"]))
    return ((torch.stack(preds, 1) - video[:, 1:]) ** 2).mean()
