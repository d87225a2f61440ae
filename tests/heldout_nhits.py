"""N-HiTS + DLinear (held-out round 26b), written from the guides alone.

Legend: B batch, T time (lookback), O horizon, C series (channel-independent: every series
through the same weights), H hidden, P{s} the pooled lookback of stack s, Q{s}/R{s} its
backcast/forecast coefficients, ``blk{s}`` the blocks of stack s (a layer stack).

DLinear: the lookback is decomposed into a moving-average trend (a depthwise 'valid' conv of
constant 1/k taps over the lookback padded by repeating its first and last values, as
DLinear's edge padding) and the seasonal rest; each gets a linear map to the horizon.
N-HiTS: stacks of MLP blocks, stack s max-pooling its input by ``pools[s]`` (multi-rate); each
block's backcast and forecast coefficients are interpolated up to the lookback and the horizon
by a fixed linear-interpolation matrix (``md.constant``), the backcast is subtracted from the
residual passed to the next block (the repeat's carry) and the forecasts are summed (the
repeat's per-layer outputs). Loss: MSE of DLinear's plus N-HiTS's forecast.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import meshdsl as md


@dataclass
class Config:
    batch: int = 16
    time: int = 48
    horizon: int = 24
    series: int = 3
    hidden: int = 64
    blocks: int = 2        # blocks per stack
    kernel: int = 5        # moving-average window (odd)
    pools: tuple = (4, 2, 1)
    rates: tuple = (4, 2, 1)   # horizon / forecast coefficients per stack
    remat: str = "none"
    form: str = "outputs"      # "outputs": forecasts as per-layer outputs; "carry": summed in the carry

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, time=16, horizon=8, series=2, hidden=8, blocks=2, kernel=3,
                   pools=(4, 1), rates=(4, 1))


def _interp(n_coef: int, n_out: int) -> torch.Tensor:
    """[n_coef, n_out]: linear interpolation of n_coef knots up to n_out points (N-HiTS's)."""
    eye = torch.eye(n_coef)[:, None, :]
    return F.interpolate(eye, size=n_out, mode="linear", align_corners=False)[:, 0, :]


def _decompose(x, cfg):
    """(trend, seasonal) of x [batch, time, series]: a moving average over edge-padded time."""
    half = (cfg.kernel - 1) // 2
    edge = [x.shape["batch"], md.Dim("time", half), x.shape["series"]]
    first = md.broadcast_to(md.squeeze(md.slice_(x, "time", 0, 1), "time"), edge)
    last = md.broadcast_to(md.squeeze(md.slice_(x, "time", cfg.time - 1, cfg.time), "time"), edge)
    padded = md.concat([first, x, last], "time")
    taps = md.constant(torch.full((cfg.kernel, cfg.series), 1.0 / cfg.kernel), ["tap", "series"])
    trend = md.conv(padded, taps, {"time": "tap"}, padding="valid")
    return trend, x - trend


def _stack(residual, s: int, cfg, T, O, H):
    """One N-HiTS stack: its blocks as a repeat over ``blk{s}``; returns (residual, forecast)."""
    k, r = cfg.pools[s], cfg.rates[s]
    blk = md.Dim(f"blk{s}", cfg.blocks)
    P, Q, R = md.Dim(f"p{s}", cfg.time // k), md.Dim(f"q{s}", cfg.time // k), md.Dim(f"r{s}", cfg.horizon // r)
    h2 = md.Dim("h2", cfg.hidden)
    stacked = {
        "w1": md.param(f"s{s}_w1", [blk, P, H], fan_out=[blk.name, "hidden"]),
        "b1": md.param(f"s{s}_b1", [blk, H], init="zeros"),
        "w2": md.param(f"s{s}_w2", [blk, H, h2], fan_out=[blk.name, "h2"]),
        "b2": md.param(f"s{s}_b2", [blk, h2], init="zeros"),
        "wb": md.param(f"s{s}_wb", [blk, h2, Q], fan_out=[blk.name, Q.name]),
        "wf": md.param(f"s{s}_wf", [blk, h2, R], fan_out=[blk.name, R.name]),
    }
    up_b = md.constant(_interp(Q.size, cfg.time), [Q, T])
    up_f = md.constant(_interp(R.size, cfg.horizon), [R, O])

    def block(res, p):
        pooled = md.reduce_max(md.rearrange(res, f"batch (p{s} k) series -> batch p{s} k series", k=k), "k")
        h = md.relu(md.einsum(f"batch p{s} series, p{s} hidden -> batch series hidden", pooled, p["w1"]) + p["b1"])
        h = md.relu(md.einsum("batch series hidden, hidden h2 -> batch series h2", h, p["w2"]) + p["b2"])
        back = md.einsum(f"batch series h2, h2 q{s} -> batch series q{s}", h, p["wb"])
        fore = md.einsum(f"batch series h2, h2 r{s} -> batch series r{s}", h, p["wf"])
        back = md.einsum(f"batch series q{s}, q{s} time -> batch time series", back, up_b)
        fore = md.einsum(f"batch series r{s}, r{s} horizon -> batch horizon series", fore, up_f)
        return res - back, fore

    def with_output(res, p):
        res, fore = block(res, p)
        return res, {"forecast": fore}

    if cfg.form == "outputs":
        res, outs = md.repeat(with_output, residual, stacked, blk, remat=cfg.remat)
        return res, md.reduce_sum(outs["forecast"], blk.name)
    # the running forecast rides in the carry (a pipeline reads it per stage): [time + horizon]
    def carried(c, p):
        res, fore = block(md.rename(md.slice_(c, "span", 0, cfg.time), span="time"), p)
        acc = md.rename(md.slice_(c, "span", cfg.time, cfg.time + cfg.horizon), span="horizon") + fore
        return md.concat([md.rename(res, time="span"), md.rename(acc, horizon="span")], "span")

    zeros = md.constant(0.0, [residual.shape["batch"], md.Dim("span", cfg.horizon), residual.shape["series"]])
    start = md.concat([md.rename(residual, time="span"), zeros], "span")
    c = md.repeat(carried, start, stacked, blk, remat=cfg.remat)
    return (md.rename(md.slice_(c, "span", 0, cfg.time), span="time"),
            md.rename(md.slice_(c, "span", cfg.time, cfg.time + cfg.horizon), span="horizon"))


def build(cfg: Config) -> md.Model:
    B, T, O = md.Dim("batch", cfg.batch), md.Dim("time", cfg.time), md.Dim("horizon", cfg.horizon)
    C, H = md.Dim("series", cfg.series), md.Dim("hidden", cfg.hidden)
    with md.Graph() as g:
        x = md.input("x", [B, T, C])
        y = md.input("y", [B, O, C])
        trend, seasonal = _decompose(x, cfg)
        w_trend = md.param("w_trend", [T, O], fan_out=["horizon"])
        w_season = md.param("w_season", [T, O], fan_out=["horizon"])
        pred = md.einsum("batch time series, time horizon -> batch horizon series", trend, w_trend)
        pred = pred + md.einsum("batch time series, time horizon -> batch horizon series", seasonal, w_season)
        residual = x
        for s in range(len(cfg.pools)):
            residual, fore = _stack(residual, s, cfg, T, O, H)
            pred = pred + fore
        loss = md.reduce_mean((pred - y) ** 2)

    def make_feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        n = cfg.time + cfg.horizon
        t = torch.arange(n, dtype=torch.float32)
        slope = torch.randn(cfg.batch, 1, cfg.series, generator=gen) * 0.05
        phase = torch.rand(cfg.batch, 1, cfg.series, generator=gen) * 6.28
        z = slope * t[None, :, None] + torch.sin(0.5 * t[None, :, None] + phase)
        z = z + 0.1 * torch.randn(cfg.batch, n, cfg.series, generator=gen)
        return {"x": z[:, :cfg.time], "y": z[:, cfg.time:]}

    return md.Model(g, loss, g.params(), make_feeds, cfg)


REF_INPUTS = ("x", "y")


def reference_loss(cfg: Config, p: dict, x, y):
    """The same model in plain torch: replicate padding + avg_pool1d, max_pool1d, F.interpolate."""
    half = (cfg.kernel - 1) // 2
    xs = x.transpose(1, 2)                                               # [batch, series, time]
    trend = F.avg_pool1d(F.pad(xs, (half, half), mode="replicate"), cfg.kernel, stride=1)
    pred = trend @ p["w_trend"] + (xs - trend) @ p["w_season"]           # [batch, series, horizon]
    res = xs
    for s, (k, r) in enumerate(zip(cfg.pools, cfg.rates)):
        for b in range(cfg.blocks):
            w = {n: p[f"s{s}_{n}"][b] for n in ("w1", "b1", "w2", "b2", "wb", "wf")}
            h = torch.relu(F.max_pool1d(res, k, stride=k) @ w["w1"] + w["b1"])
            h = torch.relu(h @ w["w2"] + w["b2"])
            back = F.interpolate(h @ w["wb"], size=cfg.time, mode="linear", align_corners=False)
            pred = pred + F.interpolate(h @ w["wf"], size=cfg.horizon, mode="linear", align_corners=False)
            res = res - back
    return ((pred.transpose(1, 2) - y) ** 2).mean()
