"""Held-out model (round 16b): MEGA (moving-average equipped gated attention), from the docs alone.

Per block: a multi-dimensional damped EMA over seq, y_t = sum_j q^(t-j) p x_j summed over ema dims
with eta, q = 1 - alpha * delta (alpha, delta sigmoids of params), written as a causal depthwise
conv with the EMA kernel built from the params (form=conv) or as q^t * cumsum(q^-j p x_j)
(form=cumsum); single-head gated attention with the EMA output as q/k (shared z, per-dim scale and
offset), v from x; reset and update gates; LM loss; blocks under md.repeat.

Legend: b batch, s seq, d d_model, h ema dims, z d_qk, v d_v, V vocab.
"""
import dataclasses

import torch

import meshdsl as md


@dataclasses.dataclass
class Config:
    form: str = "conv"          # "conv": causal conv with the EMA kernel; "cumsum": the scan form
    vocab: int = 64
    batch: int = 4
    seq: int = 16
    d_model: int = 32
    ema: int = 4
    d_qk: int = 16
    d_v: int = 32
    layers: int = 2

    remat: str = "none"        # md.repeat's remat: none | full | selective

    @classmethod
    def tiny(cls):
        return cls(vocab=16, batch=2, seq=8, d_model=8, ema=2, d_qk=4, d_v=8, layers=2)


def _ema(cfg, x, p, S):
    alpha = md.sigmoid(p["alpha"])                        # [d_model, ema]
    q = 1.0 - alpha * md.sigmoid(p["delta"])             # damped decay in (0, 1)
    scale = alpha * p["beta"] * p["eta"]                 # [d_model, ema]
    if cfg.form == "conv":
        tap = md.Dim("tap", cfg.seq)
        lag = md.cast(md.arange(tap), torch.float32) * -1.0 + float(cfg.seq - 1)   # tap t reads x[i - lag]
        kern = md.reduce_sum(scale * md.exp(md.log(q) * lag), "ema")               # [d_model, tap]
        return md.conv(x, kern, {"seq": "tap"}, padding="causal")
    t = md.cast(md.arange(S), torch.float32)
    logq = md.log(q)
    inner = md.cumsum(x * md.exp(logq * (t * -1.0)), "seq")                       # sum_j q^-j x_j
    return md.reduce_sum(inner * md.exp(logq * t) * scale, "ema")


def _attend(cfg, u, x, p):
    z = md.silu(md.einsum("batch seq d_model, d_model d_qk -> batch seq d_qk", u, p["w_z"]))
    qq = z * p["gq"] + p["bq"]
    kk = md.rename(z * p["gk"] + p["bk"], seq="key_seq")
    v = md.rename(md.silu(md.einsum("batch seq d_model, d_model d_v -> batch seq d_v", x, p["w_v"])), seq="key_seq")
    scores = md.einsum("batch seq d_qk, batch key_seq d_qk -> batch seq key_seq", qq, kk) * cfg.d_qk ** -0.5
    att = md.softmax(md.where(md.causal_mask(qq.shape["seq"], kk.shape["key_seq"]), scores, -1e9), "key_seq")
    return md.einsum("batch seq key_seq, batch key_seq d_v -> batch seq d_v", att, v)


def build(cfg: Config) -> md.Model:
    if cfg.form not in ("conv", "cumsum"):
        raise ValueError(f"form={cfg.form!r}: 'conv' or 'cumsum'")
    B, S, D, V = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("d_model", cfg.d_model), md.Dim("vocab", cfg.vocab)
    DI = md.Dim("d_in", cfg.d_model)
    H, Z, DV, L = md.Dim("ema", cfg.ema), md.Dim("d_qk", cfg.d_qk), md.Dim("d_v", cfg.d_v), md.Dim("layer", cfg.layers)
    with md.Graph() as g:
        ids, labels = md.input("ids", [B, S], torch.int64), md.input("labels", [B, S], torch.int64)
        wte = md.param("wte", [V, D], scale=1.0)
        lm_head = md.param("lm_head", [D, V], fan_out=["vocab"])
        fo = ["layer"]
        stacked = {
            "alpha": md.param("alpha", [L, D, H], scale=1.0, fan_out=fo + ["d_model", "ema"]),
            "delta": md.param("delta", [L, D, H], scale=1.0, fan_out=fo + ["d_model", "ema"]),
            "beta": md.param("beta", [L, D, H], scale=1.0, fan_out=fo + ["d_model", "ema"]),
            "eta": md.param("eta", [L, D, H], fan_out=fo + ["d_model"]),
            "w_z": md.param("w_z", [L, D, Z], fan_out=fo + ["d_qk"]),
            "gq": md.param("gq", [L, Z], init="ones"), "bq": md.param("bq", [L, Z], init="zeros"),
            "gk": md.param("gk", [L, Z], init="ones"), "bk": md.param("bk", [L, Z], init="zeros"),
            "w_v": md.param("w_v", [L, D, DV], fan_out=fo + ["d_v"]),
            "w_r": md.param("w_r", [L, D, DV], fan_out=fo + ["d_v"]),
            "w_h": md.param("w_h", [L, DI, D], fan_out=fo + ["d_model"]),
            "w_hv": md.param("w_hv", [L, DV, D], fan_out=fo + ["d_model"]),
            "w_u": md.param("w_u", [L, DI, D], fan_out=fo + ["d_model"]),
            "ln": md.param("ln", [L, D], init="ones"),
        }

        def block(x, p):
            u = _ema(cfg, x, p, S)
            o = _attend(cfg, u, x, p)
            r = md.silu(md.einsum("batch seq d_model, d_model d_v -> batch seq d_v", u, p["w_r"]))
            hh = md.silu(_mix(u, p["w_h"]) + md.einsum("batch seq d_v, d_v d_model -> batch seq d_model", r * o, p["w_hv"]))
            upd = md.sigmoid(_mix(u, p["w_u"]))
            return md.layer_norm(upd * hh + (1.0 - upd) * x, "d_model", p["ln"])

        h = md.repeat(block, md.gather(wte, ids, "vocab"), stacked, L, remat=cfg.remat)
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", h, lm_head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def make_feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        tok = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": tok[:, :-1].contiguous(), "labels": tok[:, 1:].contiguous()}

    return md.Model(g, loss, {"wte": wte, "lm_head": lm_head, **stacked}, make_feeds, cfg, logits=logits)


def _mix(u, w):
    """A d_model -> d_model projection, w [d_in, d_model]."""
    return md.einsum("batch seq d_in, d_in d_model -> batch seq d_model", md.rename(u, d_model="d_in"), w)
