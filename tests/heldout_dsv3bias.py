"""Held-out model (round 18b): DeepSeek-V3-style auxiliary-loss-free MoE, written from the docs alone.

A GPT whose MLP is a mixture of ``experts`` routed experts plus one shared expert (SwiGLU each).
The router's affinities are ``sigmoid`` scores; the top ``top_k`` experts are chosen by score + a
per-expert ``bias`` (a frozen param, used for the choice only, never in the weights); the chosen
scores, normalised to sum to 1, weigh the experts' outputs. After each step the bias moves by
``gamma * sign(mean load - load)`` per layer and expert (``md.Model(updates=...)``), the load
being how many tokens chose each expert in this step's batch. A small sequence-wise balance loss
(``alpha * sum_e f_e P_e`` per sequence, averaged over the batch) joins the LM loss.
Every expert runs on every token (the combine weight is zero where it was not chosen): under
``experts:model`` each rank runs its own experts, and the combine sums their outputs.
form=sigmoid: as above; form=softmax: softmax affinities (DeepSeek-V2's), the same bias rule.

Legend: b batch, s seq, ks key_seq, h heads, e d_head, x experts, r gate_experts (the router's
name for the same experts), k gate_experts_top, d d_model, f d_ff.
"""
import dataclasses

import torch

import meshdsl as md


@dataclasses.dataclass
class Config:
    form: str = "sigmoid"       # sigmoid | softmax
    vocab: int = 64
    batch: int = 4
    seq: int = 32
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 32
    experts: int = 4
    top_k: int = 2
    layers: int = 2
    gamma: float = 0.01
    alpha: float = 0.01
    remat: str = "none"

    @classmethod
    def tiny(cls):
        return cls(vocab=16, batch=2, seq=8, d_model=8, heads=2, d_head=4, d_ff=8, experts=4, top_k=2, layers=2)


def _swiglu(x, w_gate, w_up, w_down, lead):
    gate = md.einsum(f"batch seq d_model, {lead}d_model d_ff -> batch seq {lead}d_ff", x, w_gate)
    up = md.einsum(f"batch seq d_model, {lead}d_model d_ff -> batch seq {lead}d_ff", x, w_up)
    return md.einsum(f"batch seq {lead}d_ff, {lead}d_ff d_model -> batch seq {lead}d_model", md.silu(gate) * up, w_down)


def _route(cfg, a, p, R):
    """Combine weights [batch, seq, gate_experts], this layer's load and its balance loss."""
    logits = md.einsum("batch seq d_model, d_model gate_experts -> batch seq gate_experts", a, p["w_router"])
    score = md.sigmoid(logits) if cfg.form == "sigmoid" else md.softmax(logits, "gate_experts")
    _, idx = md.top_k(score + p["bias"], "gate_experts", cfg.top_k)          # the bias picks, only
    chosen = md.reduce_sum(md.one_hot(idx, R), "gate_experts_top")          # [batch, seq, gate_experts] 0/1
    picked = score * chosen
    weight = picked / md.reduce_sum(picked, "gate_experts")
    load = md.reduce_sum(chosen, ["batch", "seq"])                          # tokens per expert (exact counts)
    f = md.reduce_sum(chosen, "seq") * (cfg.experts / (cfg.top_k * cfg.seq))
    prob = md.reduce_mean(score / md.reduce_sum(score, "gate_experts"), "seq")
    balance = cfg.alpha * md.reduce_mean(md.reduce_sum(f * prob, "gate_experts"), "batch")
    return weight, load, balance


def build(cfg: Config) -> md.Model:
    if cfg.form not in ("sigmoid", "softmax"):
        raise ValueError(f"form={cfg.form!r}: 'sigmoid' or 'softmax'")
    B, S = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq)
    D, V, F, L = md.Dim("d_model", cfg.d_model), md.Dim("vocab", cfg.vocab), md.Dim("d_ff", cfg.d_ff), md.Dim("layer", cfg.layers)
    H, E = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    X, R = md.Dim("experts", cfg.experts), md.Dim("gate_experts", cfg.experts)
    fo, fx = ["layer"], ["layer", "experts"]
    with md.Graph() as g:
        ids, labels = md.input("ids", [B, S], torch.int64), md.input("labels", [B, S], torch.int64)
        wte = md.param("wte", [V, D], scale=1.0)
        lm_head = md.param("lm_head", [D, V], fan_out=["vocab"])
        lnf = md.param("lnf", [D], init="ones")
        bias = md.param("bias", [L, R], init="zeros")                          # frozen: set by the update
        stacked = {
            "ln1": md.param("ln1", [L, D], init="ones"), "ln2": md.param("ln2", [L, D], init="ones"),
            "wq": md.param("wq", [L, D, H, E], fan_out=fo + ["heads", "d_head"]),
            "wk": md.param("wk", [L, D, H, E], fan_out=fo + ["heads", "d_head"]),
            "wv": md.param("wv", [L, D, H, E], fan_out=fo + ["heads", "d_head"]),
            "wo": md.param("wo", [L, H, E, D], fan_out=fo + ["d_model"]),
            "w_router": md.param("w_router", [L, D, R], fan_out=fo + ["gate_experts"]),
            "e_gate": md.param("e_gate", [L, X, D, F], fan_out=fx + ["d_ff"]),
            "e_up": md.param("e_up", [L, X, D, F], fan_out=fx + ["d_ff"]),
            "e_down": md.param("e_down", [L, X, F, D], fan_out=fx + ["d_model"]),
            "s_gate": md.param("s_gate", [L, D, F], fan_out=fo + ["d_ff"]),
            "s_up": md.param("s_up", [L, D, F], fan_out=fo + ["d_ff"]),
            "s_down": md.param("s_down", [L, F, D], fan_out=fo + ["d_model"]),
            "bias": bias,
        }

        def block(x, p):
            a = md.rms_norm(x, "d_model", p["ln1"])
            proj = "batch seq d_model, d_model heads d_head -> batch seq heads d_head"
            q = md.einsum(proj, a, p["wq"])
            k, v = (md.rename(md.einsum(proj, a, p[w]), seq="key_seq") for w in ("wk", "wv"))
            y = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=True)
            x = x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", y, p["wo"])
            b = md.rms_norm(x, "d_model", p["ln2"])
            weight, load, balance = _route(cfg, b, p, R)
            routed = _swiglu(b, p["e_gate"], p["e_up"], p["e_down"], "experts ")   # [batch, seq, experts, d_model]
            moe = md.einsum("batch seq experts d_model, batch seq experts -> batch seq d_model",
                            routed, md.rename(weight, gate_experts="experts"))
            shared = _swiglu(b, p["s_gate"], p["s_up"], p["s_down"], "")
            return x + moe + shared, {"load": load, "balance": balance}

        h, per_layer = md.repeat(block, md.gather(wte, ids, "vocab"), stacked, L, remat=cfg.remat)
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", md.rms_norm(h, "d_model", lnf), lm_head)
        balance = md.reduce_sum(per_layer["balance"], "layer")
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab")) + balance
        load = per_layer["load"]                                                 # [layer, gate_experts]
        new_bias = bias + cfg.gamma * md.sign(md.reduce_mean(load, "gate_experts") - load)

    def make_feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        tok = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": tok[:, :-1].contiguous(), "labels": tok[:, 1:].contiguous()}

    params = {k: v for k, v in g.params().items() if k != "bias"}
    return md.Model(g, loss, params, make_feeds, cfg, logits=logits, updates={"bias": new_bias},
                    outputs={"moe/load": load, "moe/balance": balance})
