"""N-BEATS (generic) for univariate forecasting, written from the README and docs/ alone, in a
user's own dim names (a held-out model).

A batch of ``series``, each a ``lookback`` window to read and a ``horizon`` to forecast. Each
block of the ``md.repeat`` over ``blk`` is a four-layer fully connected stack over ``units``
(relu), then two linear heads: a backcast ``[series, lookback]`` subtracted from the residual
input and a forecast ``[series, horizon]`` added to the output. ``collect="aux"`` returns each
block's forecast as a per-layer output and sums it over ``blk`` after the stack;
``collect="carry"`` carries the forecast with the residual, the two concatenated along one
``window`` dim (``lookback + horizon``) and sliced apart in each block (the form that
pipelines: the loss, a squared error of the sum, is a function of every block at once).
The inputs are scaled by their window's mean absolute value, as forecasters do; the loss is the
mean squared error of the scaled forecast.

Legend: s = series, l = lookback, h = horizon, u = units, b = blk.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    series: int = 32
    lookback: int = 48
    horizon: int = 12
    units: int = 128
    blocks: int = 6
    collect: str = "aux"     # or "carry"
    remat: str = "none"    # md.repeat's remat: none, full, selective

    @classmethod
    def tiny(cls) -> "Config":
        return cls(series=4, lookback=9, horizon=4, units=8, blocks=2)


def build(cfg: Config = Config()) -> md.Model:
    series, lookback, horizon = md.Dim("series", cfg.series), md.Dim("lookback", cfg.lookback), md.Dim("horizon", cfg.horizon)
    units, blk = md.Dim("units", cfg.units), md.Dim("blk", cfg.blocks)
    u2 = md.Dim("units2", cfg.units)
    with md.Graph("heldout_nbeats") as g:
        history = md.input("history", [series, lookback])
        future = md.input("future", [series, horizon])
        p = {
            "fc1": md.param("fc1", [blk, lookback, units], fan_out=["blk", units]),
            "b1": md.param("b1", [blk, units], init="zeros"),
            "fc2": md.param("fc2", [blk, units, u2], fan_out=["blk", u2]),
            "fc3": md.param("fc3", [blk, u2, units], fan_out=["blk", units]),
            "fc4": md.param("fc4", [blk, units, u2], fan_out=["blk", u2]),
            "back": md.param("back", [blk, u2, lookback], fan_out=["blk", lookback]),
            "fore": md.param("fore", [blk, u2, horizon], fan_out=["blk", horizon]),
        }
        scale = md.reduce_mean(md.abs(history), "lookback") + 1e-3           # [series]
        x = history / scale

        def mlp(r: md.Tensor, q: dict) -> md.Tensor:
            h = md.relu(md.einsum("series lookback, lookback units -> series units", r, q["fc1"]) + q["b1"])
            h = md.relu(md.einsum("series units, units units2 -> series units2", h, q["fc2"]))
            h = md.relu(md.einsum("series units2, units2 units -> series units", h, q["fc3"]))
            return md.relu(md.einsum("series units, units units2 -> series units2", h, q["fc4"]))

        def heads(h: md.Tensor, q: dict):
            return (md.einsum("series units2, units2 lookback -> series lookback", h, q["back"]),
                    md.einsum("series units2, units2 horizon -> series horizon", h, q["fore"]))

        if cfg.collect == "aux":
            def block(r: md.Tensor, q: dict):
                back, fore = heads(mlp(r, q), q)
                return r - back, {"forecast": fore}

            _, per_block = md.repeat(block, x, p, "blk", remat=cfg.remat)
            forecast = md.reduce_sum(per_block["forecast"], "blk")
        else:
            window = cfg.lookback + cfg.horizon

            def block(c: md.Tensor, q: dict) -> md.Tensor:
                r = md.rename(md.slice_(c, "window", 0, cfg.lookback), window="lookback")
                back, fore = heads(mlp(r, q), q)
                return c + md.concat([md.rename(-back, lookback="window"), md.rename(fore, horizon="window")], "window")

            start = md.concat([md.rename(x, lookback="window"),
                               md.rename(md.broadcast_to(md.constant(0.0), [series, horizon]), horizon="window")],
                              "window")
            out = md.repeat(block, start, p, "blk", remat=cfg.remat)
            forecast = md.rename(md.slice_(out, "window", cfg.lookback, window), window="horizon")
        loss = md.reduce_mean((forecast - future / scale) ** 2)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        t = torch.arange(cfg.lookback + cfg.horizon, dtype=torch.float32)
        freq = torch.rand(cfg.series, 1, generator=gen) * 0.5 + 0.1
        phase = torch.rand(cfg.series, 1, generator=gen) * 6.28
        level = torch.rand(cfg.series, 1, generator=gen) * 4 + 1
        y = level + torch.sin(freq * t + phase) + 0.1 * torch.randn(cfg.series, len(t), generator=gen)
        return {"history": y[:, :cfg.lookback], "future": y[:, cfg.lookback:]}

    return md.Model(g, loss, p, feeds, cfg)
