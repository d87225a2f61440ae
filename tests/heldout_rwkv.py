"""An RWKV-style recurrent language model written from the README and docs/ alone (a held-out model).

No softmax attention: each block's *time mix* is a linear attention with a per-head decay,
computed in its recurrent form with ``md.cumsum`` over ``seq``. With ``r, k, v`` the
receptance, key and value of a position and ``lam`` a head's decay rate, the state after
position t is ``S_t = sum_{j<=t} exp(-lam (t - j)) k_j v_j^T`` (``[d_key, d_value]`` per head),
made as ``exp(-lam t) * cumsum_j(exp(lam j) k_j v_j^T)``; the output reads it with the
receptance, ``r_t . S_{t-1}``, plus RWKV's bonus for the current token, ``(r_t . (u * k_t)) v_t``.
Every projection's input is RWKV's *token shift*: a learned per-channel mix of the position
and the one before it (``md.shift`` over ``seq``, zero-filled). The output of the time mix is
normed per head (RMSNorm over ``d_value``), gated by ``silu`` of a gate projection, and
projected back. The *channel mix* is ``sigmoid(r) * (relu(k)^2 W_v)`` of token-shifted inputs.
Pre-LayerNorm blocks under ``md.repeat``, a tied head.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    d_model: int = 32
    heads: int = 4
    d_key: int = 8
    d_value: int = 8
    d_ff: int = 64
    layers: int = 2
    seq: int = 16
    batch: int = 4
    max_decay: float = 0.5

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=20, d_model=16, heads=2, d_key=4, d_value=6, d_ff=24, layers=2, seq=8, batch=4)


def shift_mix(x: md.Tensor, mu: md.Tensor) -> md.Tensor:
    """RWKV's token shift: ``mu * x + (1 - mu) * x_prev`` per channel (the first position's prev is 0)."""
    return x * mu + md.shift(x, "seq", 1) * (1.0 - mu)


def build(cfg: Config = Config()) -> md.Model:
    batch, seq = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq)
    d_model, heads = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads)
    d_key, d_value = md.Dim("d_key", cfg.d_key), md.Dim("d_value", cfg.d_value)
    d_ff, vocab, layer = md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    L = "layer"
    with md.Graph("heldout_rwkv") as g:
        ids = md.input("ids", [batch, seq], dtype=torch.int64)
        labels = md.input("labels", [batch, seq], dtype=torch.int64)
        wte = md.param("wte", [vocab, d_model], scale=0.3)
        blocks = {
            "ln1": md.param("ln1", [layer, d_model], init="ones"),
            "ln1_b": md.param("ln1_b", [layer, d_model], init="zeros"),
            "mu_r": md.param("mu_r", [layer, d_model], scale=0.3),
            "mu_k": md.param("mu_k", [layer, d_model], scale=0.3),
            "mu_v": md.param("mu_v", [layer, d_model], scale=0.3),
            "wr": md.param("wr", [layer, d_model, heads, d_key], fan_out=[L, heads, d_key]),
            "wk": md.param("wk", [layer, d_model, heads, d_key], fan_out=[L, heads, d_key]),
            "wv": md.param("wv", [layer, d_model, heads, d_value], fan_out=[L, heads, d_value]),
            "wg": md.param("wg", [layer, d_model, heads, d_value], fan_out=[L, heads, d_value]),
            "decay": md.param("decay", [layer, heads], scale=1.0),
            "bonus": md.param("bonus", [layer, heads, d_key], scale=0.5),
            "ln_x": md.param("ln_x", [layer, heads, d_value], init="ones"),
            "wo": md.param("wo", [layer, heads, d_value, d_model], fan_out=[L, d_model]),
            "ln2": md.param("ln2", [layer, d_model], init="ones"),
            "ln2_b": md.param("ln2_b", [layer, d_model], init="zeros"),
            "mu_ck": md.param("mu_ck", [layer, d_model], scale=0.3),
            "mu_cr": md.param("mu_cr", [layer, d_model], scale=0.3),
            "ck": md.param("ck", [layer, d_model, d_ff], fan_out=[L, d_ff]),
            "cv": md.param("cv", [layer, d_ff, d_model], fan_out=[L, d_model]),
            "cr": md.param("cr", [layer, d_model, md.Dim("d_out", cfg.d_model)], fan_out=[L, "d_out"]),
        }
        lnf, lnf_b = md.param("lnf", [d_model], init="ones"), md.param("lnf_b", [d_model], init="zeros")
        pos = md.arange(seq, torch.float32)

        def time_mix(x: md.Tensor, p: dict) -> md.Tensor:
            r = md.einsum("batch seq d_model, d_model heads d_key -> batch seq heads d_key", shift_mix(x, p["mu_r"]), p["wr"])
            k = md.einsum("batch seq d_model, d_model heads d_key -> batch seq heads d_key", shift_mix(x, p["mu_k"]), p["wk"])
            v = md.einsum("batch seq d_model, d_model heads d_value -> batch seq heads d_value",
                          shift_mix(x, p["mu_v"]), p["wv"])
            lam = md.sigmoid(p["decay"]) * cfg.max_decay                           # [heads], in (0, max_decay)
            grow = md.exp(pos * lam)                                               # [seq, heads]
            kv = md.einsum("batch seq heads d_key, batch seq heads d_value -> batch seq heads d_key d_value", k * grow, v)
            state = md.cumsum(kv, "seq", exclusive=True)                           # positions before t, grown
            past = md.einsum("batch seq heads d_key, batch seq heads d_key d_value -> batch seq heads d_value",
                             r * (1.0 / grow), state)
            now = md.reduce_sum(r * p["bonus"] * k, "d_key") * v
            o = md.rms_norm(past + now, "d_value", p["ln_x"])
            gate = md.silu(md.einsum("batch seq d_model, d_model heads d_value -> batch seq heads d_value", x, p["wg"]))
            return md.einsum("batch seq heads d_value, heads d_value d_model -> batch seq d_model", o * gate, p["wo"])

        def channel_mix(x: md.Tensor, p: dict) -> md.Tensor:
            k = md.relu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", shift_mix(x, p["mu_ck"]), p["ck"]))
            r = md.sigmoid(md.rename(md.einsum("batch seq d_model, d_model d_out -> batch seq d_out",
                                               shift_mix(x, p["mu_cr"]), p["cr"]), d_out="d_model"))
            return r * md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", k * k, p["cv"])

        def block(x: md.Tensor, p: dict) -> md.Tensor:
            x = x + time_mix(md.layer_norm(x, "d_model", p["ln1"], p["ln1_b"]), p)
            return x + channel_mix(md.layer_norm(x, "d_model", p["ln2"], p["ln2_b"]), p)

        x = md.repeat(block, md.gather(wte, ids, "vocab"), blocks, "layer")
        x = md.layer_norm(x, "d_model", lnf, lnf_b)
        logits = md.einsum("batch seq d_model, vocab d_model -> batch seq vocab", x, wte)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": tokens[:, :-1], "labels": tokens[:, 1:]}

    params = {"wte": wte, **blocks, "lnf": lnf, "lnf_b": lnf_b}
    return md.Model(g, loss, params, feeds, cfg, logits=logits)
