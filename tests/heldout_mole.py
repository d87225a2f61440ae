"""Held-out model (round 20b): MoLE, a mixture of LoRA experts on a frozen GPT.

Written from the user docs alone. The base model (embeddings, attention, MLP, norms, LM head) is
frozen: its params are left out of the ``Model``'s params, so they get no gradient, no update and
no optimizer state (docs/guide/api.md). Each layer adds ``experts`` LoRA adapters to the MLP's up
and down projections (``x A_e B_e``, rank ``lora_rank``), mixed per token by a router: softmax over
``experts``, ``md.top_k`` keeps ``top_k`` of them, their probabilities renormalised into combine
weights (zero for the others). Every token runs through every adapter (the adapters are tiny);
the combine weights pick. A Switch-style balance loss per layer, ``experts * sum_e f_e P_e``
(``f`` the fraction of routings to ``e``, no gradient; ``P`` the mean router probability), is
taken per sequence and averaged over the batch last (what micro-batches need, api.md), returned
per layer by the repeat and added to the LM loss.

``lora_b_scale`` starts the B matrices small but not at LoRA's usual zero, so every adapter
gradient is non-zero in the checks.

Legend: b batch, s seq, d d_model, h heads, e d_head, f d_ff, x experts, r lora_rank, t top.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    d_model: int = 32
    heads: int = 4
    d_ff: int = 64
    layers: int = 4
    seq: int = 16
    batch: int = 8
    experts: int = 4
    lora_rank: int = 4
    top_k: int = 2
    lora_b_scale: float = 0.1
    balance: float = 0.01
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=16, d_model=8, heads=2, d_ff=16, layers=2, seq=4, batch=4, experts=4,
                   lora_rank=2, top_k=2)


def _router(x, p, cfg):
    """Combine weights [batch, seq, experts] (top-k renormalised) and this layer's balance loss."""
    logits = md.einsum("batch seq d_model, d_model experts -> batch seq experts", x, p["router"])
    probs = md.softmax(logits, "experts")
    top, idx = md.top_k(probs, "experts", cfg.top_k, "top")
    top = top / md.reduce_sum(top, "top")
    picked = md.one_hot(idx, probs.shape["experts"])                       # [batch, seq, top, experts]
    combine = md.einsum("batch seq top experts, batch seq top -> batch seq experts", picked, top)
    frac = md.stop_gradient(md.reduce_mean(md.reduce_sum(picked, "top"), "seq")) / cfg.top_k
    mean_p = md.reduce_mean(probs, "seq")                                  # [batch, experts]
    balance = cfg.experts * md.reduce_mean(md.reduce_sum(frac * mean_p, "experts"), "batch")
    return combine, balance


def _lora(x, a, b, combine, d_in, d_out):
    """sum_e combine_e (x A_e) B_e: every token through every adapter, weighted."""
    low = md.einsum(f"batch seq {d_in}, experts {d_in} lora_rank -> batch seq experts lora_rank", x, a)
    return md.einsum(f"batch seq experts lora_rank, experts lora_rank {d_out}, batch seq experts "
                     f"-> batch seq {d_out}", low, b, combine)


def _block(x, p, cfg):
    h = md.layer_norm(x, "d_model", p["ln1"])
    proj = lambda w: md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, w)  # noqa: E731
    q, k, v = proj(p["wq"]), proj(p["wk"]), proj(p["wv"])
    k, v = md.rename(k, seq="key_seq"), md.rename(v, seq="key_seq")
    att = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=True)
    x = x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", att, p["wo"])
    h = md.layer_norm(x, "d_model", p["ln2"])
    combine, balance = _router(h, p, cfg)
    up = md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w_fc"])
    up = md.gelu(up + _lora(h, p["lora_a_fc"], p["lora_b_fc"], combine, "d_model", "d_ff"))
    down = md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", up, p["w_proj"])
    down = down + _lora(up, p["lora_a_proj"], p["lora_b_proj"], combine, "d_ff", "d_model")
    return x + down, {"balance": balance}


def build(cfg: Config = Config()) -> md.Model:
    V, D, S = md.Dim("vocab", cfg.vocab), md.Dim("d_model", cfg.d_model), md.Dim("seq", cfg.seq)
    H, E = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_model // cfg.heads)
    F, L, B = md.Dim("d_ff", cfg.d_ff), md.Dim("layer", cfg.layers), md.Dim("batch", cfg.batch)
    X, R = md.Dim("experts", cfg.experts), md.Dim("lora_rank", cfg.lora_rank)
    with md.Graph("mole") as g:
        ids, labels = md.input("ids", [B, S], torch.int64), md.input("labels", [B, S], torch.int64)
        wte, wpe = md.param("wte", [V, D], scale=0.5), md.param("wpe", [S, D], scale=0.1)
        base = {
            "ln1": md.param("ln1", [L, D], init="ones"), "ln2": md.param("ln2", [L, D], init="ones"),
            "wq": md.param("wq", [L, D, H, E], fan_out=["layer", "heads", "d_head"]),
            "wk": md.param("wk", [L, D, H, E], fan_out=["layer", "heads", "d_head"]),
            "wv": md.param("wv", [L, D, H, E], fan_out=["layer", "heads", "d_head"]),
            "wo": md.param("wo", [L, H, E, D], fan_out=["layer", "d_model"]),
            "w_fc": md.param("w_fc", [L, D, F], fan_out=["layer", "d_ff"]),
            "w_proj": md.param("w_proj", [L, F, D], fan_out=["layer", "d_model"]),
        }
        adapters = {
            "router": md.param("router", [L, D, X], fan_out=["layer", "experts"]),
            "lora_a_fc": md.param("lora_a_fc", [L, X, D, R], fan_out=["layer", "experts", "lora_rank"]),
            "lora_b_fc": md.param("lora_b_fc", [L, X, R, F], scale=cfg.lora_b_scale),
            "lora_a_proj": md.param("lora_a_proj", [L, X, F, R], fan_out=["layer", "experts", "lora_rank"]),
            "lora_b_proj": md.param("lora_b_proj", [L, X, R, D], scale=cfg.lora_b_scale),
        }
        x = md.gather(wte, ids, "vocab") + wpe
        x, per_layer = md.repeat(lambda c, p: _block(c, p, cfg), x, {**base, **adapters}, "layer",
                                  remat=None if cfg.remat == "none" else cfg.remat)
        x = md.layer_norm(x, "d_model", md.param("lnf", [D], init="ones"))
        logits = md.einsum("batch seq d_model, vocab d_model -> batch seq vocab", x,
                           md.param("lm_head", [V, D], fan_out=["vocab"]))
        lm = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))
        balance = md.reduce_sum(per_layer["balance"], "layer")
        loss = lm + cfg.balance * balance

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}

    trainable = {p.name: p for p in adapters.values()}
    return md.Model(g, loss, trainable, feeds, cfg, logits=logits,
                    outputs={"mole/balance": balance, "mole/lm": lm})
