"""A Mixtral-style MoE decoder, written from the README and docs/ alone.

Pre-norm blocks (RMSNorm, causal attention, learned positions) whose MLP is a routed
mixture of SwiGLU experts plus a shared SwiGLU expert (DeepSeek-style) that every token
goes through. ``router="top2"`` (Mixtral): the top 2 router logits, softmaxed over those
two; ``router="switch"``: top-1 with the router's softmax probability as the gate. Each
token goes to its experts' queues (a ``cumsum`` over ``seq`` gives its place), cut at a
capacity per expert and sequence, ``ceil(capacity_factor * seq * top_k / experts)``
(``capacity_factor=0``: ``seq``, so no token is ever dropped). The router's dim is
``gate_experts`` and the dispatched tokens are renamed to ``[experts, expert_batch, ...]``
(the cookbook's expert parallel recipe), so ``experts:data`` moves tokens by alltoall.

Every block returns its load-balancing loss (Switch's ``E * sum_e f_e P_e``, per sequence,
averaged over the batch) and its dropped-routing count as per-layer outputs of the repeat;
the loss adds ``aux_weight`` times the balance losses summed over the layers.
"""
import math
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 32
    d_shared: int = 32
    experts: int = 4
    layers: int = 2
    seq: int = 16
    batch: int = 8
    router: str = "top2"            # or "switch" (top-1)
    capacity_factor: float = 0.0    # 0: capacity = seq (dropless)
    aux_weight: float = 0.01
    balance: str = "sequence"       # or "batch": Switch's f_e and P_e over the whole batch (not linear in it)
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=24, d_model=8, heads=2, d_head=4, d_ff=12, d_shared=8, experts=4, layers=2, seq=6, batch=4)


def build(cfg: Config = Config()) -> md.Model:
    if cfg.router not in ("top2", "switch"):
        raise ValueError(f"router must be 'top2' or 'switch', not {cfg.router!r}")
    top_k = 2 if cfg.router == "top2" else 1
    cap = cfg.seq if cfg.capacity_factor <= 0 else math.ceil(cfg.capacity_factor * cfg.seq * top_k / cfg.experts)
    B, S, SK = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("key_seq", cfg.seq)
    V, D = md.Dim("vocab", cfg.vocab), md.Dim("d_model", cfg.d_model)
    H, E = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    F, FS = md.Dim("d_ff", cfg.d_ff), md.Dim("d_shared", cfg.d_shared)
    X, GX = md.Dim("experts", cfg.experts), md.Dim("gate_experts", cfg.experts)
    C, L = md.Dim("capacity", cap), md.Dim("layer", cfg.layers)
    sd = cfg.d_model ** -0.5
    with md.Graph("mixtral") as g:
        ids = md.input("ids", [B, S], dtype=torch.int64)
        labels = md.input("labels", [B, S], dtype=torch.int64)
        wte = md.param("wte", [V, D], scale=0.5)
        wpe = md.param("wpe", [S, D], scale=0.1)
        p = {n: md.param(n, [L, D, H, E], scale=sd) for n in ("wq", "wk", "wv")}
        p["wo"] = md.param("wo", [L, H, E, D], scale=(cfg.heads * cfg.d_head) ** -0.5)
        p["norm1"] = md.param("norm1", [L, D], init="ones")
        p["norm2"] = md.param("norm2", [L, D], init="ones")
        p["router"] = md.param("router", [L, D, GX], scale=sd)
        p["w_gate"] = md.param("w_gate", [L, X, D, F], scale=sd)
        p["w_up"] = md.param("w_up", [L, X, D, F], scale=sd)
        p["w_down"] = md.param("w_down", [L, X, F, D], scale=cfg.d_ff ** -0.5)
        p["s_gate"] = md.param("s_gate", [L, D, FS], scale=sd)
        p["s_up"] = md.param("s_up", [L, D, FS], scale=sd)
        p["s_down"] = md.param("s_down", [L, FS, D], scale=cfg.d_shared ** -0.5)
        norm_f = md.param("norm_f", [D], init="ones")
        head = md.param("head", [D, V], scale=sd)

        def moe(x, p):
            """Routed SwiGLU experts plus the shared one: (output, balance loss, dropped)."""
            logits = md.einsum("batch seq d_model, d_model gate_experts -> batch seq gate_experts", x, p["router"])
            probs = md.softmax(logits, "gate_experts")
            if top_k == 2:
                top_vals, top_idx = md.top_k(logits, "gate_experts", 2, "choice")
                gate = md.softmax(top_vals, "choice")                       # Mixtral: softmax of the top 2
            else:
                top_vals, top_idx = md.top_k(probs, "gate_experts", 1, "choice")
                gate = top_vals                                             # Switch: the router's probability
            chosen = md.one_hot(top_idx, GX)                                # [batch seq choice gate_experts]
            routed = md.reduce_sum(chosen, "choice")                        # 0/1: token -> expert
            weight = md.reduce_sum(chosen * gate, "choice")                 # its gate for that expert
            place = md.cumsum(routed, "seq", exclusive=True)                # its place in the expert's queue
            kept = routed * md.cast(md.less(place, float(cap)), torch.float32)
            slot = md.one_hot(md.cast(place * kept, torch.int64), C) * kept  # [batch seq gate_experts capacity]
            sent = md.einsum("batch seq d_model, batch seq gate_experts capacity -> gate_experts batch capacity d_model",
                             x, slot)
            xe = md.rename(sent, {"gate_experts": "experts", "batch": "expert_batch"})
            h = md.silu(md.einsum("experts expert_batch capacity d_model, experts d_model d_ff "
                                  "-> experts expert_batch capacity d_ff", xe, p["w_gate"]))
            h = h * md.einsum("experts expert_batch capacity d_model, experts d_model d_ff "
                              "-> experts expert_batch capacity d_ff", xe, p["w_up"])
            ye = md.einsum("experts expert_batch capacity d_ff, experts d_ff d_model "
                           "-> experts expert_batch capacity d_model", h, p["w_down"])
            back = md.rename(ye, {"experts": "gate_experts", "expert_batch": "batch"})
            routed_out = md.einsum("gate_experts batch capacity d_model, batch seq gate_experts capacity "
                                   "-> batch seq d_model", back, slot * weight)
            hs = md.silu(md.einsum("batch seq d_model, d_model d_shared -> batch seq d_shared", x, p["s_gate"]))
            hs = hs * md.einsum("batch seq d_model, d_model d_shared -> batch seq d_shared", x, p["s_up"])
            shared = md.einsum("batch seq d_shared, d_shared d_model -> batch seq d_model", hs, p["s_down"])
            # Switch's balance loss per sequence: E * sum_e (share of routings to e) * (mean prob of e)
            over = ("seq",) if cfg.balance == "sequence" else ("batch", "seq")
            frac = md.reduce_mean(routed, over) * (1.0 / top_k)
            mean_p = md.reduce_mean(probs, over)
            balance = md.reduce_mean(md.reduce_sum(frac * mean_p, "gate_experts")) * float(cfg.experts)
            dropped = md.reduce_sum(md.cast(routed - kept, torch.int64))
            return routed_out + shared, balance, dropped

        def block(h, p):
            n = md.rms_norm(h, "d_model", p["norm1"])
            q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", n, p["wq"])
            k = md.rename(md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", n, p["wk"]),
                          {"seq": "key_seq"})
            v = md.rename(md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", n, p["wv"]),
                          {"seq": "key_seq"})
            a = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=True)
            h = h + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", a, p["wo"])
            y, balance, dropped = moe(md.rms_norm(h, "d_model", p["norm2"]), p)
            return h + y, {"balance": balance, "dropped": dropped}

        x = md.gather(wte, ids, "vocab") + wpe
        h, per_layer = md.repeat(block, x, p, "layer", remat=cfg.remat)
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", md.rms_norm(h, "d_model", norm_f), head)
        ce = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))
        aux = md.reduce_sum(per_layer["balance"], "layer")
        loss = ce + cfg.aux_weight * aux

    params = {"wte": wte, "wpe": wpe, "norm_f": norm_f, "head": head, **{t.name: t for t in p.values()}}

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        toks = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=torch.Generator().manual_seed(seed))
        return {"ids": toks[:, :-1], "labels": toks[:, 1:]}

    outputs = {"moe/balance": per_layer["balance"], "moe/dropped": md.reduce_sum(per_layer["dropped"], "layer")}
    return md.Model(g, loss, params, feeds, cfg, outputs=outputs, logits=logits)
