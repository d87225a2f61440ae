"""A DeepSeek-MoE-style decoder written from the README and docs/ alone (a held-out model).

The first block is dense (attention and a SwiGLU MLP, DeepSeek's ``first_k_dense_replace``),
written out before the stack; the other blocks run under ``md.repeat`` and their MLP is a
mixture of experts: ``shared`` always-on shared experts (a SwiGLU over a ``shared`` dim
summed) plus fine-grained routed experts, each token sent to its top 2 by one
``md.top_k(..., 2)`` over sigmoid affinities, the two gates normalised to sum to 1 (V3's
rule). Each expert takes at most ``capacity`` tokens of a sequence, in token order (the
queue place by ``md.cumsum`` over ``seq`` of the one-hot choices); a routing past capacity
is dropped. The expert-parallel move is a rename of the dispatched tokens (``gate_experts ->
experts``, ``batch -> expert_batch``), as the docs' cookbook does. Each MoE layer returns
a sequence-wise balance loss (V3's: ``experts / (top_k * seq) * count`` times the mean
normalised affinity, summed over experts, averaged over sequences) as a per-layer output,
summed into the loss with weight ``aux_weight``. The head is untied.
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
    d_ff: int = 64          # the dense block's and each shared expert's width
    expert_ff: int = 16     # each routed expert's width (fine-grained experts)
    experts: int = 8
    shared: int = 2
    top_k: int = 2
    capacity_factor: float = 1.5
    layers: int = 2         # MoE layers, after the one dense block
    seq: int = 16
    batch: int = 4
    aux_weight: float = 0.01

    @property
    def capacity(self) -> int:
        return math.ceil(self.capacity_factor * self.seq * self.top_k / self.experts)

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=20, d_model=16, heads=2, d_head=8, d_ff=24, expert_ff=8, experts=4, shared=2,
                   capacity_factor=1.0, layers=2, seq=8, batch=4)


ATT_IN = "batch seq d_model, d_model heads d_head -> batch seq heads d_head"
ATT_OUT = "batch seq heads d_head, heads d_head d_model -> batch seq d_model"


def attention(x: md.Tensor, p: dict, prefix: str = "") -> md.Tensor:
    h = md.rms_norm(x, "d_model", p[prefix + "attn_norm"])
    q = md.einsum(ATT_IN, h, p[prefix + "wq"])
    k = md.rename(md.einsum(ATT_IN, h, p[prefix + "wk"]), seq="key_seq")
    v = md.rename(md.einsum(ATT_IN, h, p[prefix + "wv"]), seq="key_seq")
    return x + md.einsum(ATT_OUT, md.attention(q, k, v, "seq", "key_seq", "d_head", causal=True), p[prefix + "wo"])


def route(h: md.Tensor, w_router: md.Tensor, cfg: Config):
    """(dispatch [b, s, g, c], combine [b, s, g, c], the sequence-wise balance loss)."""
    g_dim, c_dim = md.Dim("gate_experts", cfg.experts), md.Dim("capacity", cfg.capacity)
    aff = md.sigmoid(md.einsum("batch seq d_model, d_model gate_experts -> batch seq gate_experts", h, w_router))
    top_v, top_i = md.top_k(aff, "gate_experts", cfg.top_k, "choice")             # [b, s, choice]
    gates = top_v / md.reduce_sum(top_v, "choice")
    chose = md.one_hot(top_i, g_dim, torch.int64)                                   # [b, s, choice, g]
    per_token = md.reduce_sum(chose, "choice")                                      # [b, s, g], 0/1
    before = md.cumsum(per_token, "seq", exclusive=True)                            # earlier tokens, same expert
    place = md.reduce_sum(before * chose, "gate_experts")                           # [b, s, choice]
    kept = md.cast(md.less(place, c_dim.size), torch.int64)
    slot = md.cast(chose * kept * md.one_hot(place, c_dim, torch.int64), h.dtype)  # [b, s, choice, g, c]
    dispatch = md.reduce_sum(slot, "choice")
    combine = md.reduce_sum(slot * gates, "choice")
    frac = md.reduce_sum(md.cast(per_token, h.dtype), "seq") * (cfg.experts / (cfg.top_k * cfg.seq))  # [b, g]
    prob = md.reduce_mean(aff / md.reduce_sum(aff, "gate_experts"), "seq")                         # [b, g]
    aux = md.reduce_mean(md.reduce_sum(frac * prob, "gate_experts"), "batch")
    return dispatch, combine, aux


def swiglu(h: md.Tensor, w_gate, w_up, w_down, ff: str, extra: str = "") -> md.Tensor:
    lhs = f"batch seq d_model, {extra} d_model {ff} -> batch seq {extra} {ff}"
    u = md.silu(md.einsum(lhs, h, w_gate)) * md.einsum(lhs, h, w_up)
    return md.einsum(f"batch seq {extra} {ff}, {extra} {ff} d_model -> batch seq d_model", u, w_down)


def moe_block(x: md.Tensor, p: dict, cfg: Config):
    x = attention(x, p)
    h = md.rms_norm(x, "d_model", p["mlp_norm"])
    shared = swiglu(h, p["s_gate"], p["s_up"], p["s_down"], "d_ff", "shared")
    dispatch, combine, aux = route(h, p["router"], cfg)
    xin = md.einsum("batch seq gate_experts capacity, batch seq d_model -> gate_experts batch capacity d_model", dispatch, h)
    xin = md.rename(xin, gate_experts="experts", batch="expert_batch")
    up = "experts expert_batch capacity d_model, experts d_model expert_ff -> experts expert_batch capacity expert_ff"
    u = md.silu(md.einsum(up, xin, p["e_gate"])) * md.einsum(up, xin, p["e_up"])
    y = md.einsum("experts expert_batch capacity expert_ff, experts expert_ff d_model -> experts expert_batch capacity d_model",
                  u, p["e_down"])
    y = md.rename(y, experts="gate_experts", expert_batch="batch")
    routed = md.einsum("batch seq gate_experts capacity, gate_experts batch capacity d_model -> batch seq d_model", combine, y)
    return x + shared + routed, {"aux": aux}


def build(cfg: Config = Config()) -> md.Model:
    batch, seq = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq)
    d_model, heads, d_head = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    d_ff, e_ff, vocab = md.Dim("d_ff", cfg.d_ff), md.Dim("expert_ff", cfg.expert_ff), md.Dim("vocab", cfg.vocab)
    layer, shared = md.Dim("layer", cfg.layers), md.Dim("shared", cfg.shared)
    g_dim, experts = md.Dim("gate_experts", cfg.experts), md.Dim("experts", cfg.experts)
    with md.Graph("heldout_deepseek") as g:
        ids = md.input("ids", [batch, seq], dtype=torch.int64)
        labels = md.input("labels", [batch, seq], dtype=torch.int64)
        wte = md.param("wte", [vocab, d_model], scale=0.1)
        dense = {
            "d_attn_norm": md.param("d_attn_norm", [d_model], init="ones"),
            "d_wq": md.param("d_wq", [d_model, heads, d_head], fan_out=[heads, d_head]),
            "d_wk": md.param("d_wk", [d_model, heads, d_head], fan_out=[heads, d_head]),
            "d_wv": md.param("d_wv", [d_model, heads, d_head], fan_out=[heads, d_head]),
            "d_wo": md.param("d_wo", [heads, d_head, d_model], fan_out=[d_model]),
            "d_mlp_norm": md.param("d_mlp_norm", [d_model], init="ones"),
            "d_gate": md.param("d_gate", [d_model, d_ff], fan_out=[d_ff]),
            "d_up": md.param("d_up", [d_model, d_ff], fan_out=[d_ff]),
            "d_down": md.param("d_down", [d_ff, d_model], fan_out=[d_model]),
        }
        blocks = {
            "attn_norm": md.param("attn_norm", [layer, d_model], init="ones"),
            "wq": md.param("wq", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head]),
            "wk": md.param("wk", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head]),
            "wv": md.param("wv", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head]),
            "wo": md.param("wo", [layer, heads, d_head, d_model], fan_out=["layer", d_model]),
            "mlp_norm": md.param("mlp_norm", [layer, d_model], init="ones"),
            "s_gate": md.param("s_gate", [layer, shared, d_model, d_ff], fan_out=["layer", shared, d_ff]),
            "s_up": md.param("s_up", [layer, shared, d_model, d_ff], fan_out=["layer", shared, d_ff]),
            "s_down": md.param("s_down", [layer, shared, d_ff, d_model], fan_out=["layer", shared, d_model]),
            "router": md.param("router", [layer, d_model, g_dim], fan_out=["layer", g_dim]),
            "e_gate": md.param("e_gate", [layer, experts, d_model, e_ff], fan_out=["layer", experts, e_ff]),
            "e_up": md.param("e_up", [layer, experts, d_model, e_ff], fan_out=["layer", experts, e_ff]),
            "e_down": md.param("e_down", [layer, experts, e_ff, d_model], fan_out=["layer", experts, d_model]),
        }
        norm_f = md.param("norm_f", [d_model], init="ones")
        lm_head = md.param("lm_head", [vocab, d_model], fan_out=[vocab])

        x = attention(md.gather(wte, ids, "vocab"), dense, "d_")
        x = x + swiglu(md.rms_norm(x, "d_model", dense["d_mlp_norm"]), dense["d_gate"], dense["d_up"], dense["d_down"], "d_ff")
        x, per_layer = md.repeat(lambda h, p: moe_block(h, p, cfg), x, blocks, "layer")
        logits = md.einsum("batch seq d_model, vocab d_model -> batch seq vocab", md.rms_norm(x, "d_model", norm_f), lm_head)
        aux = md.reduce_sum(per_layer["aux"], "layer")
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab")) + cfg.aux_weight * aux

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": tokens[:, :-1], "labels": tokens[:, 1:]}

    params = {"wte": wte, **dense, **blocks, "norm_f": norm_f, "lm_head": lm_head}
    return md.Model(g, loss, params, feeds, cfg, outputs={"moe/aux": aux}, logits=logits)
