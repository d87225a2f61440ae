"""Held-out model (round 20b): Contrastive Predictive Coding on a 1-D signal.

Written from the user docs alone. A strided conv encoder (two stride-2 convs over ``time``, relu)
turns a signal ``[batch, time, c_in]`` into latents ``z [batch, time, channels]`` at a quarter of
the rate. A GRU over ``time`` (a ``md.repeat`` over ``time`` nested in a one-layer block, so a
split ``time`` stays split around it: docs/guide/api.md) gives the context ``c_t``. For each step
ahead ``s = 1..ahead`` a linear map ``W_s`` predicts ``z_{t+s}`` from ``c_t``; InfoNCE scores the
prediction of row ``b`` against the true future latents of every row ``b2`` of the batch (the
others are the negatives): a ``[batch, batch2]`` score matrix per step, cross-entropy against the
diagonal.

Legend: b batch, b2 batch2 (the candidates), t time, c channels, g hidden (GRU features).
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 8
    samples: int = 64         # signal length; the encoder's two stride-2 convs leave samples / 4
    c_in: int = 1
    channels: int = 16
    hidden: int = 16
    taps: int = 4
    ahead: int = 3

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, samples=32, channels=4, hidden=6, taps=4, ahead=2)


def _encoder(x, cfg):
    """Two stride-2 convs with a relu: [batch, time, c_in] -> [batch, time / 4, channels]."""
    tap, c_in, ch = md.Dim("tap", cfg.taps), x.shape["c_in"], md.Dim("c_out", cfg.channels)
    w1 = md.param("conv1", [tap, c_in, ch], fan_out=["c_out"])
    h = md.relu(md.rename(md.conv(x, w1, {"time": "tap"}, padding="same", stride=2), c_out="c_in2"))
    w2 = md.param("conv2", [tap, md.Dim("c_in2", cfg.channels), ch], fan_out=["c_out"])
    z = md.conv(md.rename(h, c_in2="c_in"), md.rename(w2, c_in2="c_in"), {"time": "tap"},
                padding="same", stride=2)
    return md.rename(z, c_out="channels")


def _gru(z, cfg):
    """A GRU over time; returns the context [batch, time, hidden]."""
    C, G = z.shape["channels"], md.Dim("hidden", cfg.hidden)
    g2 = md.Dim("hidden_in", cfg.hidden)
    w = {n: md.param(f"gru_w{n}", [C, G], fan_out=["hidden"]) for n in "rzn"}
    u = {n: md.param(f"gru_u{n}", [g2, G], fan_out=["hidden"]) for n in "rzn"}
    bias = {n: md.param(f"gru_b{n}", [G], init="zeros") for n in "rzn"}

    def step(h, p):
        xin = lambda n: md.einsum("batch channels, channels hidden -> batch hidden", p["z"], w[n])  # noqa: E731
        hin = lambda n: md.einsum("batch hidden_in, hidden_in hidden -> batch hidden",  # noqa: E731
                                  md.rename(h, hidden="hidden_in"), u[n])
        r = md.sigmoid(xin("r") + hin("r") + bias["r"])
        upd = md.sigmoid(xin("z") + hin("z") + bias["z"])
        n = md.tanh(xin("n") + r * hin("n") + bias["n"])
        h = (1.0 - upd) * n + upd * h
        return h, {"ctx": h}

    z_t = md.transpose(z, ["time", "batch", "channels"])
    h0 = md.constant(0.0, [z.shape["batch"], G])

    def once(h, _):
        return md.repeat(step, h, {"z": z_t}, "time")

    _, per = md.repeat(once, h0, {}, md.Dim("once", 1))
    ctx = md.squeeze(per["ctx"], "once")                                  # [time, batch, hidden]
    return md.transpose(ctx, ["batch", "time", "hidden"])


def _info_nce(z, ctx, cfg):
    """Mean over steps ahead of InfoNCE against the other batch rows' latents."""
    T = z.shape["time"].size
    n = T - cfg.ahead                                                     # steps with every future
    B, B2 = z.shape["batch"], md.Dim("batch2", z.shape["batch"].size)
    diag = md.cast(md.equal(md.arange(B), md.arange(B2)), torch.float32)  # [batch, batch2]
    c = md.slice_(ctx, "time", 0, n)
    total = None
    for s in range(1, cfg.ahead + 1):
        w = md.param(f"w_pred{s}", [ctx.shape["hidden"], z.shape["channels"]], fan_out=["channels"])
        pred = md.einsum("batch time hidden, hidden channels -> batch time channels", c, w)
        future = md.rename(md.slice_(z, "time", s, s + n), batch="batch2")
        scores = md.einsum("batch time channels, batch2 time channels -> batch batch2 time", pred, future)
        logp = md.log_softmax(scores, "batch2")
        loss_s = -md.reduce_mean(md.reduce_sum(logp * diag, "batch2"))
        total = loss_s if total is None else total + loss_s
    return total / cfg.ahead


def build(cfg: Config = Config()) -> md.Model:
    B, T, C = md.Dim("batch", cfg.batch), md.Dim("time", cfg.samples), md.Dim("c_in", cfg.c_in)
    with md.Graph("cpc") as g:
        x = md.input("x", [B, T, C])
        z = _encoder(x, cfg)
        ctx = _gru(z, cfg)
        loss = _info_nce(z, ctx, cfg)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        t = torch.arange(cfg.samples, dtype=torch.float32)
        freq = torch.rand(cfg.batch, 1, generator=gen) * 0.5 + 0.1
        phase = torch.rand(cfg.batch, 1, generator=gen) * 6.28
        sig = torch.sin(freq * t + phase) + 0.1 * torch.randn(cfg.batch, cfg.samples, generator=gen)
        return {"x": sig[:, :, None].expand(cfg.batch, cfg.samples, cfg.c_in).contiguous()}

    return md.Model(g, loss, g.params(), feeds, cfg)


def reference_loss(cfg: Config, params: dict, x: torch.Tensor) -> torch.Tensor:
    """The same model in plain torch (conv1d, a GRU loop, InfoNCE), float64: the loss."""
    p = {k: v.double() for k, v in params.items()}
    F = torch.nn.functional
    pad = (cfg.taps - 1) // 2, cfg.taps - 1 - (cfg.taps - 1) // 2
    h = F.relu(F.conv1d(F.pad(x.double().transpose(1, 2), pad), p["conv1"].permute(2, 1, 0), stride=2))
    z = F.conv1d(F.pad(h, pad), p["conv2"].permute(2, 1, 0), stride=2).transpose(1, 2)  # [b, t, c]
    hs, h = [], torch.zeros(cfg.batch, cfg.hidden, dtype=torch.float64)
    for t in range(z.shape[1]):
        r = torch.sigmoid(z[:, t] @ p["gru_wr"] + h @ p["gru_ur"] + p["gru_br"])
        u = torch.sigmoid(z[:, t] @ p["gru_wz"] + h @ p["gru_uz"] + p["gru_bz"])
        n = torch.tanh(z[:, t] @ p["gru_wn"] + r * (h @ p["gru_un"]) + p["gru_bn"])
        h = (1 - u) * n + u * h
        hs.append(h)
    ctx = torch.stack(hs, 1)
    n = z.shape[1] - cfg.ahead
    total = 0.0
    for s in range(1, cfg.ahead + 1):
        pred = ctx[:, :n] @ p[f"w_pred{s}"]
        scores = torch.einsum("btc,utc->but", pred, z[:, s:s + n])
        logp = scores.log_softmax(1)
        total = total - logp.diagonal(dim1=0, dim2=1).mean()
    return total / cfg.ahead
