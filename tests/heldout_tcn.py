"""A temporal convolutional network (TCN), written from the README and docs/ alone (a held-out model).

Signals ``[clip, time, chan]``. Each cycle of the ``md.repeat`` over ``cycle`` holds four
residual levels with dilations 1, 2, 4 and 8; a level is two dilated causal convolutions of
``taps`` taps (relu after each) and a residual add, so one cycle sees ``2 * (taps - 1) * 15 + 1``
steps back. A dilated causal conv is written two ways: ``form="shift"`` sums ``md.shift``-ed
copies of the input (tap ``t`` reads ``time - d * (taps - 1 - t)``) each contracted with its
tap's filter by an einsum; ``form="conv"`` is ``md.conv(..., padding="causal", dilation=d)``
(torch's ``dilation``: the taps ``d`` apart, ``d * (taps - 1)`` steps back). A linear input
projection, and a per-step linear head predicting the next value of the first input channel;
the loss is the mean squared error over every step.

Legend: b = clip, t = time, c = chan, k = tap.
"""
from dataclasses import dataclass

import torch

import meshdsl as md

DILATIONS = (1, 2, 4, 8)


@dataclass(frozen=True)
class Config:
    clips: int = 8
    time: int = 512
    inputs: int = 4
    chan: int = 32
    taps: int = 3
    cycles: int = 2
    form: str = "shift"     # or "conv"
    remat: str = "none"    # md.repeat's remat: none, full, selective

    @classmethod
    def tiny(cls) -> "Config":
        return cls(clips=4, time=48, inputs=2, chan=4, taps=3, cycles=2)


def dilated_causal(x: md.Tensor, w: md.Tensor, dilation: int, taps: int, form: str) -> md.Tensor:
    """``x [clip, time, chan]`` by ``w [tap, chan, chan_out]`` with the taps ``dilation`` apart."""
    if form == "shift":
        out = None
        for t in range(taps):
            wt = md.squeeze(md.slice_(w, "tap", t, t + 1), "tap")
            xt = md.shift(x, "time", dilation * (taps - 1 - t))
            term = md.einsum("clip time chan, chan chan_out -> clip time chan_out", xt, wt)
            out = term if out is None else out + term
    else:
        out = md.conv(x, w, {"time": "tap"}, padding="causal", dilation=dilation)
    return md.rename(out, chan_out="chan")


def build(cfg: Config = Config()) -> md.Model:
    clip, time, inputs = md.Dim("clip", cfg.clips), md.Dim("time", cfg.time), md.Dim("inputs", cfg.inputs)
    chan, chan_out, tap, cycle = md.Dim("chan", cfg.chan), md.Dim("chan_out", cfg.chan), md.Dim("tap", cfg.taps), md.Dim("cycle", cfg.cycles)
    with md.Graph("heldout_tcn") as g:
        signal = md.input("signal", [clip, time, inputs])
        target = md.input("target", [clip, time])
        w_in = md.param("w_in", [inputs, chan], fan_out=[chan])
        levels = {f"{c}{d}": md.param(f"{c}{d}", [cycle, tap, chan, chan_out], fan_out=["cycle", chan_out])
                  for d in DILATIONS for c in ("conv_a", "conv_b")}
        levels.update({f"bias{d}": md.param(f"bias{d}", [cycle, chan], init="zeros") for d in DILATIONS})
        w_head = md.param("w_head", [chan])

        def cycle_block(h: md.Tensor, p: dict) -> md.Tensor:
            for d in DILATIONS:
                y = md.relu(dilated_causal(h, p[f"conv_a{d}"], d, cfg.taps, cfg.form) + p[f"bias{d}"])
                y = md.relu(dilated_causal(y, p[f"conv_b{d}"], d, cfg.taps, cfg.form))
                h = h + y
            return h

        h = md.einsum("clip time inputs, inputs chan -> clip time chan", signal, w_in)
        h = md.repeat(cycle_block, h, levels, "cycle", remat=cfg.remat)
        pred = md.einsum("clip time chan, chan -> clip time", h, w_head)
        loss = md.reduce_mean((pred - target) ** 2)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        t = torch.arange(cfg.time + 1, dtype=torch.float32)
        freq = torch.rand(cfg.clips, 1, cfg.inputs, generator=gen) * 0.3 + 0.05
        x = torch.sin(freq * t[None, :, None]) + 0.1 * torch.randn(cfg.clips, len(t), cfg.inputs, generator=gen)
        return {"signal": x[:, :-1], "target": x[:, 1:, 0]}

    return md.Model(g, loss, {"w_in": w_in, **levels, "w_head": w_head}, feeds, cfg)
