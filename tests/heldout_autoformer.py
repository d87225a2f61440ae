"""Autoformer (Wu et al.), a held-out model written from the docs alone: a forecasting encoder
with series decomposition and auto-correlation in place of attention.

- Series decomposition: the trend is a moving average over ``seq`` (``avg`` positions, zeros
  past the ends), the seasonal part what is left. ``form=conv`` makes the average a depthwise
  ``md.conv`` with a constant filter, ``form=shift`` a sum of ``md.shift``-ed copies.
- Auto-correlation (the DSL has no FFT): the correlation of the queries with the keys delayed by
  each lag ``tau`` (``md.roll`` over ``seq``), averaged over heads, features and positions; the
  ``top`` strongest lags of each series (``md.top_k``) weighted by a softmax of their
  correlations; the output the values rolled back by each lag, summed with those weights (the
  time-delay aggregation).
- Encoder layers under ``md.repeat``: x + auto-correlation, seasonal part, x + MLP, seasonal part.
- The forecast: the encoder's output mapped from ``seq`` to ``pred`` positions and to the
  features, plus the input's trend mapped the same way; the loss the mean squared error.

Legend: b batch, l seq, c feat, d d_model, h heads, e d_head, f d_ff, p pred, g lag.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 8
    seq: int = 24
    pred: int = 8
    feat: int = 4
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 2
    avg: int = 5
    top: int = 3
    form: str = "conv"
    remat: str = "none"

    @classmethod
    def tiny(cls):
        return cls(batch=4, seq=8, pred=4, feat=3, d_model=8, heads=2, d_head=4, d_ff=16, layers=2, avg=3, top=2)


def moving_average(x, cfg, channels: str):
    """The trend of ``x`` over ``seq``: the mean of ``avg`` positions centred on each."""
    if cfg.form == "conv":
        w = md.broadcast_to(md.constant(1.0 / cfg.avg), [md.Dim("tap", cfg.avg), x.shape[channels]])
        return md.conv(x, w, {"seq": "tap"}, padding="same")
    before = (cfg.avg - 1) // 2
    parts = [md.shift(x, "seq", before - t) for t in range(cfg.avg)]
    return sum(parts[1:], parts[0]) * (1.0 / cfg.avg)


def auto_correlation(x, p, cfg):
    """Auto-correlation over ``seq`` of x [batch, seq, d_model]: the top lags' delayed values."""
    L = cfg.seq
    q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", x, p["wq"])
    k = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", x, p["wk"])
    v = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", x, p["wv"])
    delayed = md.concat([md.unsqueeze(md.roll(k, "seq", tau), "lag", 0) for tau in range(L)], "lag")
    corr = md.einsum("batch seq heads d_head, lag batch seq heads d_head -> batch lag", q, delayed)
    corr = corr * (1.0 / (L * cfg.heads * cfg.d_head))
    top, _ = md.top_k(corr, "lag", cfg.top, new_dim="lag_top")
    keep = md.greater_equal(corr, md.reduce_min(top, "lag_top"))
    weights = md.softmax(md.where(keep, corr, -1e9), "lag")
    ahead = md.concat([md.unsqueeze(md.roll(v, "seq", -tau), "lag", 0) for tau in range(L)], "lag")
    out = md.einsum("batch lag, lag batch seq heads d_head -> batch seq heads d_head", weights, ahead)
    return md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", out, p["wo"])


def encoder_layer(x, p, cfg):
    x = x + auto_correlation(x, p, cfg)
    x = x - moving_average(x, cfg, "d_model")
    h = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", x, p["w1"]))
    x = x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", h, p["w2"])
    return x - moving_average(x, cfg, "d_model")


def build(cfg: Config) -> md.Model:
    if cfg.form not in ("conv", "shift"):
        raise md.ModelError(f"autoformer: form={cfg.form!r}; expected 'conv' or 'shift'")
    B, L, P, C = (md.Dim(n, s) for n, s in [("batch", cfg.batch), ("seq", cfg.seq), ("pred", cfg.pred), ("feat", cfg.feat)])
    D, H, E, F = (md.Dim(n, s) for n, s in [("d_model", cfg.d_model), ("heads", cfg.heads), ("d_head", cfg.d_head), ("d_ff", cfg.d_ff)])
    N = md.Dim("layer", cfg.layers)
    with md.Graph() as g:
        x = md.input("x", [B, L, C])
        target = md.input("target", [B, P, C])
        stacked = {
            "wq": md.param("wq", [N, D, H, E], fan_out=["layer", "heads", "d_head"]),
            "wk": md.param("wk", [N, D, H, E], fan_out=["layer", "heads", "d_head"]),
            "wv": md.param("wv", [N, D, H, E], fan_out=["layer", "heads", "d_head"]),
            "wo": md.param("wo", [N, H, E, D], fan_out=["layer", "d_model"]),
            "w1": md.param("w1", [N, D, F], fan_out=["layer", "d_ff"]),
            "w2": md.param("w2", [N, F, D], fan_out=["layer", "d_model"]),
        }
        params = dict(stacked,
                      w_emb=md.param("w_emb", [C, D], fan_out=["d_model"]),
                      ln=md.param("ln", [D], init="ones"),
                      w_time=md.param("w_time", [L, P], fan_out=["pred"]),
                      w_proj=md.param("w_proj", [D, C], fan_out=["feat"]),
                      w_trend=md.param("w_trend", [L, P], fan_out=["pred"]))
        trend = moving_average(x, cfg, "feat")
        h = md.einsum("batch seq feat, feat d_model -> batch seq d_model", x - trend, params["w_emb"])
        h = md.repeat(lambda c, p: encoder_layer(c, p, cfg), h, stacked, N, remat=cfg.remat)
        h = md.layer_norm(h, "d_model", params["ln"])
        seasonal = md.einsum("batch seq d_model, seq pred, d_model feat -> batch pred feat",
                             h, params["w_time"], params["w_proj"])
        forecast = seasonal + md.einsum("batch seq feat, seq pred -> batch pred feat", trend, params["w_trend"])
        loss = md.reduce_mean((forecast - target) ** 2)

    def make_feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        t = torch.arange(cfg.seq + cfg.pred, dtype=torch.float32)
        phase = torch.rand(cfg.batch, 1, cfg.feat, generator=gen) * 6.28
        series = torch.sin(t[None, :, None] * 0.7 + phase) + 0.05 * t[None, :, None]
        series = series + 0.1 * torch.randn(series.shape, generator=gen)
        return {"x": series[:, :cfg.seq].contiguous(), "target": series[:, cfg.seq:].contiguous()}

    return md.Model(g, loss, params, make_feeds, cfg)
