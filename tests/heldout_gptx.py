"""Held-out GPT written the torch way (round 19a): every projection a batch-agnostic Linear,
`md.einsum("... d_in, d_in d_out -> ... d_out")`, and heads split by `md.rearrange` with `...`;
pre-norm blocks under md.repeat over `layer` (fused causal attention, gelu MLP); an LM head; and
`loss=smooth` a label-smoothed cross-entropy written by hand, or `loss=mixture` the log-likelihood
of a label-noise mixture, log((1 - eps) p_y + eps / V) = logaddexp(log(1 - eps) + log p_y,
log(eps / V)) with the second term a constant fill `md.constant(log(eps / V), [batch, seq])`.
Params come from `g.params()`.

Legend: x_bsd [batch, seq, d_model]; q_bshe [batch, seq, heads, d_head]; logits_bsv [.., vocab].
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
    d_ff: int = 64
    layers: int = 2
    seq: int = 16
    batch: int = 4
    eps: float = 0.1
    loss: str = "smooth"         # smooth | mixture
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=11, d_model=8, heads=2, d_head=4, d_ff=12, layers=2, seq=6, batch=4)


def linear(x, w, d_in: str, d_out: str):
    """torch's nn.Linear over any leading dims."""
    return md.einsum(f"... {d_in}, {d_in} {d_out} -> ... {d_out}", x, w)


def block(x, p, cfg):
    h = md.layer_norm(x, "d_model", p["ln1"] + 1.0, p["ln1_b"])
    qkv = linear(h, p["w_qkv"], "d_model", "qkv")
    q, k, v = (md.rearrange(md.slice_(qkv, "qkv", i * cfg.heads * cfg.d_head, (i + 1) * cfg.heads * cfg.d_head),
                            "... (heads d_head) -> ... heads d_head", heads=cfg.heads) for i in range(3))
    k, v = md.rename(k, seq="key_seq"), md.rename(v, seq="key_seq")
    a = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=True)
    a = md.rearrange(a, "... heads d_head -> ... (heads d_head)")
    x = x + linear(a, p["w_o"], "heads_d_head", "d_model")
    h = md.layer_norm(x, "d_model", p["ln2"] + 1.0, p["ln2_b"])
    return x + linear(md.gelu(linear(h, p["w_fc"], "d_model", "d_ff") + p["b_fc"]), p["w_proj"], "d_ff", "d_model")


def build(cfg: Config = Config()) -> md.Model:
    B, S, V = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("vocab", cfg.vocab)
    D, F, L = md.Dim("d_model", cfg.d_model), md.Dim("d_ff", cfg.d_ff), md.Dim("layer", cfg.layers)
    QKV, HE = md.Dim("qkv", 3 * cfg.heads * cfg.d_head), md.Dim("heads_d_head", cfg.heads * cfg.d_head)
    with md.Graph("gptx") as g:
        ids = md.input("ids", [B, S], dtype=torch.int64)
        labels = md.input("labels", [B, S], dtype=torch.int64)
        wte = md.param("wte", [V, D], scale=0.02)
        wpe = md.param("wpe", [S, D], scale=0.02)
        stack = {
            "ln1": md.param("ln1", [L, D], scale=0.0), "ln1_b": md.param("ln1_b", [L, D], scale=0.0),
            "w_qkv": md.param("w_qkv", [L, D, QKV], fan_out=["layer", "qkv"]),
            "w_o": md.param("w_o", [L, HE, D], fan_out=["layer", "d_model"]),
            "ln2": md.param("ln2", [L, D], scale=0.0), "ln2_b": md.param("ln2_b", [L, D], scale=0.0),
            "w_fc": md.param("w_fc", [L, D, F], fan_out=["layer", "d_ff"]),
            "b_fc": md.param("b_fc", [L, F], scale=0.0),
            "w_proj": md.param("w_proj", [L, F, D], fan_out=["layer", "d_model"]),
        }
        lnf, lnf_b = md.param("lnf", [D], scale=0.0), md.param("lnf_b", [D], scale=0.0)
        head = md.param("lm_head", [D, V], fan_out=["vocab"])
        x = md.gather(wte, ids, "vocab") + wpe
        x = md.repeat(lambda h, p: block(h, p, cfg), x, stack, L, remat=cfg.remat)
        logits = linear(md.layer_norm(x, "d_model", lnf + 1.0, lnf_b), head, "d_model", "vocab")
        logp = logits - md.logsumexp(logits, "vocab")
        logp_y = md.reduce_sum(logp * md.one_hot(labels, V), "vocab")
        if cfg.loss == "smooth":
            per_tok = -(1 - cfg.eps) * logp_y - cfg.eps * md.reduce_mean(logp, "vocab")
        else:
            noise = md.constant(math.log(cfg.eps / cfg.vocab), [B, S])
            per_tok = -md.logaddexp(logp_y + math.log(1 - cfg.eps), noise)
        loss = md.reduce_mean(per_tok)

    def feeds(seed: int = 0) -> dict:
        gen = torch.Generator().manual_seed(seed)
        toks = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": toks[:, :-1], "labels": toks[:, 1:]}

    return md.Model(g, loss, g.params(), feeds, cfg, logits=logits)
