"""A Mixtral-8x7B-style decoder written from the README and docs/ alone (a held-out model).

Grouped-query attention with rotary embeddings and RMSNorm pre-norm blocks under ONE
``md.repeat``, whose MLP is a top-2 mixture of SwiGLU experts with no shared expert: the router's
top 2 logits softmaxed over the two (Mixtral's renormalised gates), each token placed in its two
experts' queues by a ``cumsum`` over ``seq`` and cut at a capacity per expert and sequence
(``capacity_factor=0``: ``seq``, dropless). The dispatched tokens ``[gate_experts, batch,
capacity, d_model]`` are renamed to ``[experts, expert_batch, ...]``, so ``experts:data`` moves
them by alltoall. Each layer returns two per-layer outputs, summed over the layers into the
loss: Switch's load-balancing loss per sequence (``E * sum_e f_e P_e``, averaged over the batch)
and ST-MoE's router z-loss (the mean squared logsumexp of the router logits).

Legend: b batch, s seq, t key_seq, d d_model, k kv_heads, g group, e d_head, x experts,
gx gate_experts, c capacity, f d_ff.
"""
import math
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    d_model: int = 32
    kv_heads: int = 2
    group: int = 2
    d_head: int = 8
    d_ff: int = 32
    experts: int = 4
    layers: int = 2
    seq: int = 16
    batch: int = 8
    capacity_factor: float = 0.0
    aux_weight: float = 0.02
    z_weight: float = 0.001
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=24, d_model=8, kv_heads=2, group=2, d_head=4, d_ff=12, experts=4, layers=2, seq=6, batch=4)


def rotary(x: md.Tensor, seq: str, d_head: int) -> md.Tensor:
    half = d_head // 2
    inv = md.constant(1e6 ** (-torch.arange(half, dtype=torch.float32) / half), [md.Dim("d_head", half)])
    angles = md.cast(md.arange(x.shape[seq]), torch.float32) * inv
    cos, sin = md.cos(angles), md.sin(angles)
    x1, x2 = md.slice_(x, "d_head", 0, half), md.slice_(x, "d_head", half, d_head)
    return md.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], "d_head")


def build(cfg: Config = Config()) -> md.Model:
    cap = cfg.seq if cfg.capacity_factor <= 0 else math.ceil(cfg.capacity_factor * cfg.seq * 2 / cfg.experts)
    b, s = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq)
    d, k, g = md.Dim("d_model", cfg.d_model), md.Dim("kv_heads", cfg.kv_heads), md.Dim("group", cfg.group)
    e, f, v, L = md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    x_, gx, c = md.Dim("experts", cfg.experts), md.Dim("gate_experts", cfg.experts), md.Dim("capacity", cap)
    with md.Graph("heldout_mixtral_gqa") as graph:
        ids = md.input("ids", [b, s], dtype=torch.int64)
        labels = md.input("labels", [b, s], dtype=torch.int64)
        wte = md.param("wte", [v, d], scale=0.5)
        p = {
            "ln1": md.param("ln1", [L, d], init="ones"), "ln2": md.param("ln2", [L, d], init="ones"),
            "wq": md.param("wq", [L, d, k, g, e], fan_out=["layer", "kv_heads", "group", "d_head"]),
            "wk": md.param("wk", [L, d, k, e], fan_out=["layer", "kv_heads", "d_head"]),
            "wv": md.param("wv", [L, d, k, e], fan_out=["layer", "kv_heads", "d_head"]),
            "wo": md.param("wo", [L, k, g, e, d], fan_out=["layer", "d_model"]),
            "router": md.param("router", [L, d, gx], fan_out=["layer", "gate_experts"]),
            "w1": md.param("w1", [L, x_, d, f], fan_out=["layer", "experts", "d_ff"]),
            "w3": md.param("w3", [L, x_, d, f], fan_out=["layer", "experts", "d_ff"]),
            "w2": md.param("w2", [L, x_, f, d], fan_out=["layer", "experts", "d_model"]),
        }
        norm_f = md.param("norm_f", [d], init="ones")
        head = md.param("head", [d, v], fan_out=["vocab"])

        def moe(h, p):
            logits = md.einsum("batch seq d_model, d_model gate_experts -> batch seq gate_experts", h, p["router"])
            top_vals, top_idx = md.top_k(logits, "gate_experts", 2, "choice")
            chosen = md.one_hot(top_idx, gx)                                     # [batch seq choice gate_experts]
            routed = md.reduce_sum(chosen, "choice")
            weight = md.reduce_sum(chosen * md.softmax(top_vals, "choice"), "choice")
            place = md.cumsum(routed, "seq", exclusive=True)
            kept = routed * md.cast(md.less(place, float(cap)), torch.float32)
            slot = md.one_hot(md.cast(place * kept, torch.int64), c) * kept      # [batch seq gate_experts capacity]
            sent = md.einsum("batch seq d_model, batch seq gate_experts capacity -> gate_experts batch capacity d_model",
                             h, slot)
            xe = md.rename(sent, {"gate_experts": "experts", "batch": "expert_batch"})
            a = md.einsum("experts expert_batch capacity d_model, experts d_model d_ff "
                          "-> experts expert_batch capacity d_ff", xe, p["w1"])
            u = md.einsum("experts expert_batch capacity d_model, experts d_model d_ff "
                          "-> experts expert_batch capacity d_ff", xe, p["w3"])
            ye = md.einsum("experts expert_batch capacity d_ff, experts d_ff d_model "
                           "-> experts expert_batch capacity d_model", md.silu(a) * u, p["w2"])
            back = md.rename(ye, {"experts": "gate_experts", "expert_batch": "batch"})
            out = md.einsum("gate_experts batch capacity d_model, batch seq gate_experts capacity -> batch seq d_model",
                            back, slot * weight)
            frac = md.reduce_mean(routed, "seq") * 0.5
            balance = md.reduce_mean(md.reduce_sum(frac * md.reduce_mean(md.softmax(logits, "gate_experts"), "seq"),
                                                   "gate_experts")) * float(cfg.experts)
            z = md.reduce_mean(md.logsumexp(logits, "gate_experts") ** 2)
            return out, balance, z

        def block(x, p):
            n = md.rms_norm(x, "d_model", p["ln1"])
            q = rotary(md.einsum("batch seq d_model, d_model kv_heads group d_head -> batch seq kv_heads group d_head",
                                 n, p["wq"]), "seq", cfg.d_head)
            nk = md.rename(n, seq="key_seq")
            kk = rotary(md.einsum("batch key_seq d_model, d_model kv_heads d_head -> batch key_seq kv_heads d_head",
                                  nk, p["wk"]), "key_seq", cfg.d_head)
            vv = md.einsum("batch key_seq d_model, d_model kv_heads d_head -> batch key_seq kv_heads d_head", nk, p["wv"])
            o = md.attention(q, kk, vv, "seq", "key_seq", "d_head", causal=True)
            x = x + md.einsum("batch seq kv_heads group d_head, kv_heads group d_head d_model -> batch seq d_model",
                              o, p["wo"])
            y, balance, z = moe(md.rms_norm(x, "d_model", p["ln2"]), p)
            return x + y, {"balance": balance, "z": z}

        x, per_layer = md.repeat(block, md.gather(wte, ids, "vocab"), p, "layer", remat=cfg.remat)
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", md.rms_norm(x, "d_model", norm_f), head)
        loss = (md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))
                + cfg.aux_weight * md.reduce_sum(per_layer["balance"], "layer")
                + cfg.z_weight * md.reduce_sum(per_layer["z"], "layer"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        toks = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=torch.Generator().manual_seed(seed))
        return {"ids": toks[:, :-1], "labels": toks[:, 1:]}

    outputs = {"moe/balance": per_layer["balance"], "moe/z": per_layer["z"]}
    return md.Model(graph, loss, {"wte": wte, **p, "norm_f": norm_f, "head": head}, feeds, cfg,
                    outputs=outputs, logits=logits)
