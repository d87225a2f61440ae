"""A 1-D convolutional regression model, to show and test how spatial splits lower.

Legend: b batch, s seq, c channels, t tap (the conv's window, ``taps`` wide).

    x_bsc -> conv (same) -> relu -> conv (causal) -> relu -> conv (same) -> y_bsc
    loss = mean((y_bsc - target_bsc) ** 2)

``Config.form`` says how the three convolutions are written:

* ``"op"``: ``md.conv(x, w, {"seq": "tap"}, padding=...)``;
* ``"pad"``: ``pad`` along ``seq`` then one ``slice_`` and one einsum per tap (the causal one
  pads ``taps - 1`` before only);
* ``"shift"``: one ``shift`` along ``seq`` and one einsum per tap.

All three compute the same function of the same params (``w1``..``w3`` are ``[tap, c_in,
c_out]``).  Split over ``seq`` (``seq:data``) every form trades halos of ``taps - 1`` rows with
its neighbours (see meshdsl/lowering/halo.py).  Used by tests/test_halo.py and by docs/guide/cookbook.md,
"Spatial splits" (``meshdsl plan tests/conv_tiny.py ...``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md
from meshdsl import Model

FORMS = ("op", "pad", "shift")
TAP_EINSUM = "batch seq c_in, c_in c_out -> batch seq c_out"


@dataclass(frozen=True)
class Config:
    batch: int = 8
    seq: int = 1024
    channels: int = 64
    taps: int = 5
    form: str = "op"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, seq=16, channels=4, taps=5)


def _tap(w, t: int):
    """Tap ``t`` of ``w [tap, c_in, c_out]`` as ``[c_in, c_out]``."""
    return md.squeeze(md.slice_(w, "tap", t, t + 1), "tap")


def conv_layer(x, w, taps: int, form: str, causal: bool):
    """``x [batch, seq, c_in]`` convolved with ``w [tap, c_in, c_out]``, written as ``form`` says."""
    before = taps - 1 if causal else (taps - 1) // 2
    if form == "op":
        return md.conv(x, w, {"seq": "tap"}, padding="causal" if causal else "same")
    n = x.shape.get("seq").size
    padded = md.pad(x, "seq", before, taps - 1 - before) if form == "pad" else None
    out = None
    for t in range(taps):
        # Output position i reads x[i + t - before]: a slice of the padded x, or x shifted by before - t.
        win = md.slice_(padded, "seq", t, t + n) if form == "pad" else md.shift(x, "seq", before - t)
        y = md.einsum(TAP_EINSUM, win, _tap(w, t))
        out = y if out is None else out + y
    return out


def build(cfg: Config = Config()) -> Model:
    """Build the three-layer conv net and its mean-squared-error loss."""
    if cfg.form not in FORMS:
        raise md.GraphError(f"conv_tiny: Config.form is {cfg.form!r}; use one of {list(FORMS)}")
    batch, seq = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq)
    c_in, c_out, tap = md.Dim("c_in", cfg.channels), md.Dim("c_out", cfg.channels), md.Dim("tap", cfg.taps)
    with md.Graph("conv") as g:
        x_bsc = md.input("x", [batch, seq, c_in])
        target_bsc = md.input("target", [batch, seq, c_in])
        ws = {f"w{i}": md.param(f"w{i}", [tap, c_in, c_out], fan_out=[c_out]) for i in (1, 2, 3)}
        h = x_bsc
        for i, causal in ((1, False), (2, True), (3, False)):
            h = md.rename(conv_layer(h, ws[f"w{i}"], cfg.taps, cfg.form, causal), c_out="c_in")
            if i < 3:
                h = md.relu(h)
        loss = md.reduce_mean((h - target_bsc) ** 2)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(cfg.batch, cfg.seq, cfg.channels, generator=gen),
                "target": torch.randn(cfg.batch, cfg.seq, cfg.channels, generator=gen)}

    return Model(g, loss, ws, feeds, cfg)
