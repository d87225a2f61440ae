"""Held-out model: minGRU language model (h17a), "Were RNNs All We Needed?".

h_t = (1 - z_t) h_{t-1} + z_t h~_t with z_t = sigmoid(x W_z), h~_t = x W_h, h_0 = 0. Three forms
(Config.form) of the same numbers:

- ``scan``: parallel over seq in log space: A_t = cumsum_t log(1 - z_t) (= -softplus(x W_z)),
  h_t = sum_{j <= t} exp(A_t - A_j) z_j h~_j, a masked einsum over a [seq, key_seq] decay matrix;
- ``cumsum``: the same sum as exp(A_t) * cumsum_j(exp(-A_j) z_j h~_j) (fine for short sequences);
- ``seq``: the sequential recurrence, an inner ``md.repeat`` over ``seq``.

Pre-norm residual layers (minGRU mixer, then a gelu MLP) under ``md.repeat`` over ``layer``, LM loss.
Legend: b batch, s seq, j key_seq, d d_model, e hidden (the recurrent state's features).
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    vocab: int = 64
    d_model: int = 32
    hidden: int = 48
    d_ff: int = 64
    layers: int = 2
    seq: int = 16
    batch: int = 4
    form: str = "scan"
    remat: str | None = None

    @classmethod
    def tiny(cls):
        return cls(vocab=16, d_model=8, hidden=12, d_ff=16, layers=2, seq=8, batch=2)


def _scan(log_a, b, seq, form):
    """h_t = sum_{j<=t} exp(A_t - A_j) b_j, A the running sum of log_a over seq."""
    big_a = md.cumsum(log_a, "seq")
    if form == "cumsum":
        return md.exp(big_a) * md.cumsum(md.exp(-big_a) * b, "seq")
    key = md.Dim("key_seq", seq.size)
    diff = big_a - md.rename(big_a, seq="key_seq")                     # [batch, seq, hidden, key_seq]
    decay = md.exp(md.where(md.causal_mask(seq, key), diff, -1e9))     # masked: exp(-1e9) = 0
    return md.einsum("batch seq hidden key_seq, batch key_seq hidden -> batch seq hidden",
                     decay, md.rename(b, seq="key_seq"))


def _sequential(a, b, cfg):
    order = ["seq", "batch", "hidden"]
    h0 = md.broadcast_to(md.constant(0.0), md.Shape([md.Dim("batch", cfg.batch), md.Dim("hidden", cfg.hidden)]))

    def step(h, p):
        h = p["a"] * h + p["b"]
        return h, {"h": h}

    _, per = md.repeat(step, h0, {"a": md.transpose(a, order), "b": md.transpose(b, order)}, "seq")
    return md.transpose(per["h"], ["batch", "seq", "hidden"])


def build(cfg: Config) -> md.Model:
    if cfg.form not in ("scan", "cumsum", "seq"):
        raise ValueError(f"form must be 'scan', 'cumsum' or 'seq', got {cfg.form!r}")
    B, S, D, V = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("d_model", cfg.d_model), md.Dim("vocab", cfg.vocab)
    E, F, L = md.Dim("hidden", cfg.hidden), md.Dim("d_ff", cfg.d_ff), md.Dim("layer", cfg.layers)
    with md.Graph() as g:
        ids, labels = md.input("ids", [B, S], torch.int64), md.input("labels", [B, S], torch.int64)
        params = {
            "wte": md.param("wte", [V, D], scale=0.5),
            "norm1": md.param("norm1", [L, D], init="ones"), "norm2": md.param("norm2", [L, D], init="ones"),
            "w_z": md.param("w_z", [L, D, E], fan_out=["layer", "hidden"]),
            "w_h": md.param("w_h", [L, D, E], fan_out=["layer", "hidden"]),
            "w_o": md.param("w_o", [L, E, D], fan_out=["layer", "d_model"]),
            "w_in": md.param("w_in", [L, D, F], fan_out=["layer", "d_ff"]),
            "w_out": md.param("w_out", [L, F, D], fan_out=["layer", "d_model"]),
            "normf": md.param("normf", [D], init="ones"),
            "head": md.param("head", [D, V], fan_out=["vocab"]),
        }

        def block(x, p):
            h = md.rms_norm(x, "d_model", p["norm1"])
            k = md.einsum("batch seq d_model, d_model hidden -> batch seq hidden", h, p["w_z"])
            cand = md.einsum("batch seq d_model, d_model hidden -> batch seq hidden", h, p["w_h"])
            b = md.sigmoid(k) * cand
            if cfg.form == "seq":
                hs = _sequential(md.sigmoid(-k), b, cfg)
            else:
                hs = _scan(md.log_sigmoid(-k), b, S, cfg.form)       # log(1 - sigmoid(k)), stable
            x = x + md.einsum("batch seq hidden, hidden d_model -> batch seq d_model", hs, p["w_o"])
            f = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff",
                                  md.rms_norm(x, "d_model", p["norm2"]), p["w_in"]))
            return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", f, p["w_out"])

        stacked = {n: params[n] for n in ("norm1", "norm2", "w_z", "w_h", "w_o", "w_in", "w_out")}
        x = md.repeat(block, md.gather(params["wte"], ids, "vocab"), stacked, "layer", remat=cfg.remat)
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab",
                           md.rms_norm(x, "d_model", params["normf"]), params["head"])
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def make_feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}

    return md.Model(g, loss, params, make_feeds, cfg, logits=logits)
