"""Held-out model: Hash-layer MoE (h17a), "Hash Layers For Large Sparse Models".

A GPT-style decoder whose MLP is a mixture of experts routed by a fixed hash of the token id, with
no learned router. Config.route: ``mod`` (expert = id % experts) or ``table`` (a random
vocab -> expert table fed as the input ``route``, one-hot [vocab, gate_experts]). Config.dispatch:
``capacity`` (each expert takes at most ``capacity`` tokens per sequence, its queue place by a
cumsum over seq; overflow passes through the residual; dispatched [gate_experts, batch, capacity,
d_model] renamed to [experts, expert_batch, ..] so ``experts:data`` moves the split) or ``dense``
(every expert on every token, the one-hot picks the output: no drops). Causal attention, pre-norm,
blocks under ``md.repeat``; LM loss.

Legend: b batch, s seq, k key_seq, d d_model, h heads, e d_head, x experts, c capacity, f d_ff.
"""
import math
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    vocab: int = 64
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    experts: int = 4
    d_ff: int = 32
    layers: int = 2
    seq: int = 16
    batch: int = 4
    capacity_factor: float = 1.5
    route: str = "mod"
    dispatch: str = "capacity"
    remat: str | None = None

    @classmethod
    def tiny(cls):
        return cls(vocab=16, d_model=8, heads=2, d_head=4, experts=4, d_ff=8, layers=2, seq=8, batch=4)


def _moe(h, gate, p, cfg, cap_dim):
    """gate [batch, seq, gate_experts] one-hot; returns the experts' output [batch, seq, d_model]."""
    def ffn(x, lead):
        x_dims = " ".join(n for n in lead.split() if n != "experts" or n in x.shape.names)
        f = md.gelu(md.einsum(f"{x_dims} d_model, experts d_model d_ff -> {lead} d_ff", x, p["w1"]))
        return md.einsum(f"{lead} d_ff, experts d_ff d_model -> {lead} d_model", f, p["w2"])

    if cfg.dispatch == "dense":
        every = ffn(h, "batch seq experts")
        return md.einsum("batch seq experts d_model, batch seq experts -> batch seq d_model", every,
                         md.rename(gate, gate_experts="experts"))
    place = md.cumsum(gate, "seq", exclusive=True)                   # tokens before, same expert
    slot = md.one_hot(md.cast(md.reduce_sum(place * gate, "gate_experts"), torch.int64), cap_dim)  # past capacity: zeros
    disp = md.einsum("batch seq gate_experts, batch seq capacity -> batch seq gate_experts capacity", gate, slot)
    xin = md.einsum("batch seq gate_experts capacity, batch seq d_model -> gate_experts batch capacity d_model", disp, h)
    xin = md.rename(xin, {"gate_experts": "experts", "batch": "expert_batch"})
    out = md.rename(ffn(xin, "experts expert_batch capacity"), {"experts": "gate_experts", "expert_batch": "batch"})
    return md.einsum("batch seq gate_experts capacity, gate_experts batch capacity d_model -> batch seq d_model", disp, out)


def build(cfg: Config) -> md.Model:
    if cfg.route not in ("mod", "table") or cfg.dispatch not in ("capacity", "dense"):
        raise ValueError(f"route must be 'mod' or 'table', dispatch 'capacity' or 'dense'; got {cfg.route!r}, {cfg.dispatch!r}")
    B, S, D, V = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("d_model", cfg.d_model), md.Dim("vocab", cfg.vocab)
    H, E, F, L = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff), md.Dim("layer", cfg.layers)
    X, GX = md.Dim("experts", cfg.experts), md.Dim("gate_experts", cfg.experts)
    cap = md.Dim("capacity", math.ceil(cfg.capacity_factor * cfg.seq / cfg.experts))
    with md.Graph() as g:
        ids, labels = md.input("ids", [B, S], torch.int64), md.input("labels", [B, S], torch.int64)
        if cfg.route == "table":
            table = md.input("route", [V, GX])
            gate = md.einsum("batch seq vocab, vocab gate_experts -> batch seq gate_experts", md.one_hot(ids, V), table)
        else:
            gate = md.one_hot(ids % cfg.experts, GX)
        params = {
            "wte": md.param("wte", [V, D], scale=0.5),
            "n1": md.param("n1", [L, D], init="ones"), "n2": md.param("n2", [L, D], init="ones"),
            "wq": md.param("wq", [L, D, H, E], fan_out=["layer", "heads", "d_head"]),
            "wk": md.param("wk", [L, D, H, E], fan_out=["layer", "heads", "d_head"]),
            "wv": md.param("wv", [L, D, H, E], fan_out=["layer", "heads", "d_head"]),
            "wo": md.param("wo", [L, H, E, D], fan_out=["layer", "d_model"]),
            "w1": md.param("w1", [L, X, D, F], fan_out=["layer", "experts", "d_ff"]),
            "w2": md.param("w2", [L, X, F, D], fan_out=["layer", "experts", "d_model"]),
            "normf": md.param("normf", [D], init="ones"),
            "head": md.param("head", [D, V], fan_out=["vocab"]),
        }

        def block(x, p):
            z = md.rms_norm(x, "d_model", p["n1"])
            q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", z, p["wq"])
            k = md.einsum("batch key_seq d_model, d_model heads d_head -> batch key_seq heads d_head",
                          md.rename(z, seq="key_seq"), p["wk"])
            v = md.einsum("batch key_seq d_model, d_model heads d_head -> batch key_seq heads d_head",
                          md.rename(z, seq="key_seq"), p["wv"])
            y = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=True)
            x = x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", y, p["wo"])
            return x + _moe(md.rms_norm(x, "d_model", p["n2"]), gate, p, cfg, cap)

        stacked = {n: params[n] for n in ("n1", "n2", "wq", "wk", "wv", "wo", "w1", "w2")}
        x = md.repeat(block, md.gather(params["wte"], ids, "vocab"), stacked, "layer", remat=cfg.remat)
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab",
                           md.rms_norm(x, "d_model", params["normf"]), params["head"])
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def make_feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        feeds = {"ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
        if cfg.route == "table":
            # the hash is fixed for the model's life: its own generator, not the batch's seed
            pick = torch.randint(0, cfg.experts, (cfg.vocab,), generator=torch.Generator().manual_seed(1234))
            feeds["route"] = torch.nn.functional.one_hot(pick, cfg.experts).float()
        return feeds

    return md.Model(g, loss, params, make_feeds, cfg, logits=logits)
