"""A held-out mixture-of-experts decoder, written from README.md and docs/ only (round 7c).

Legend: b batch, s seq (queries), k key_seq (keys), d d_model, h heads, e d_head, x experts,
g expert_ff, v vocab, l layer.

    ids_bs -> wte[ids] + wpe[s]
      -> md.repeat over layers of a pre-RMSNorm block that returns (carry, {"balance": ...}):
           h += attn(norm(h))          (the fused causal kernel)
           router: p_bsx = softmax(norm(h) . w_router); the top-1 expert per token
           h += gate * expert_top1(norm(h)), every expert a gelu MLP ([experts] stacked weights)
           balance: experts * mean_b sum_x frac_bx * prob_bx (Switch's, per sequence, averaged
           over the batch last, as the API guide says a micro-batched loss must take it)
      -> norm -> untied head -> next-token cross-entropy + aux_weight * sum of the layers' balance
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    seq: int = 16
    batch: int = 8
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    experts: int = 4
    expert_ff: int = 64
    layers: int = 2
    aux_weight: float = 0.01

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=32, seq=8, batch=4, d_model=8, heads=2, d_head=4, experts=4, expert_ff=8, layers=4)


def build(cfg: Config = Config()) -> md.Model:
    b, s = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq)
    v, d, h = md.Dim("vocab", cfg.vocab), md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads)
    e, x, gf = md.Dim("d_head", cfg.d_head), md.Dim("experts", cfg.experts), md.Dim("expert_ff", cfg.expert_ff)
    l = md.Dim("layer", cfg.layers)
    with md.Graph("heldout_moedec") as g:
        ids_bs = md.input("ids", [b, s], torch.int64)
        labels_bs = md.input("labels", [b, s], torch.int64)
        p = {
            "wte": md.param("wte", [v, d], scale=0.5), "wpe": md.param("wpe", [s, d], scale=0.1),
            "n1": md.param("n1", [l, d], init="ones"), "n2": md.param("n2", [l, d], init="ones"),
            "wq": md.param("wq", [l, d, h, e], fan_out=["layer", h, e]),
            "wk": md.param("wk", [l, d, h, e], fan_out=["layer", h, e]),
            "wv": md.param("wv", [l, d, h, e], fan_out=["layer", h, e]),
            "wo": md.param("wo", [l, h, e, d], fan_out=["layer", d]),
            "w_router": md.param("w_router", [l, d, x], fan_out=["layer", x]),
            "w_up": md.param("w_up", [l, x, d, gf], fan_out=["layer", x, gf]),
            "w_down": md.param("w_down", [l, x, gf, d], fan_out=["layer", x, d]),
            "nf": md.param("nf", [d], init="ones"),
            "head": md.param("head", [d, v], fan_out=[v]),
        }
        x_bsd = md.gather(p["wte"], ids_bs, "vocab") + p["wpe"]

        def block(hid, w):
            a = md.rms_norm(hid, "d_model", w["n1"])
            q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", a, w["wq"])
            ak = md.rename(a, {"seq": "key_seq"})
            kk = md.einsum("batch key_seq d_model, d_model heads d_head -> batch key_seq heads d_head", ak, w["wk"])
            vv = md.einsum("batch key_seq d_model, d_model heads d_head -> batch key_seq heads d_head", ak, w["wv"])
            o = md.attention(q, kk, vv, "seq", "key_seq", "d_head", causal=True)
            hid = hid + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, w["wo"])
            m = md.rms_norm(hid, "d_model", w["n2"])
            prob_bsx = md.softmax(md.einsum("batch seq d_model, d_model experts -> batch seq experts", m,
                                            w["w_router"]), "experts")
            top_p, top_i = md.top_k(prob_bsx, "experts", 1)
            chosen_bsx = md.one_hot(md.squeeze(top_i, "experts_top"), x)            # [batch, seq, experts]
            gate_bsx = chosen_bsx * md.squeeze(top_p, "experts_top")
            up = md.gelu(md.einsum("batch seq d_model, experts d_model expert_ff -> batch seq experts expert_ff",
                                   m, w["w_up"]))
            y = md.einsum("batch seq experts expert_ff, experts expert_ff d_model, batch seq experts "
                          "-> batch seq d_model", up, w["w_down"], gate_bsx)
            frac_bx = md.reduce_mean(chosen_bsx, "seq")
            mean_p_bx = md.reduce_mean(prob_bsx, "seq")
            balance = cfg.experts * md.reduce_mean(md.reduce_sum(frac_bx * mean_p_bx, "experts"))
            return hid + y, {"balance": balance}

        stacked = {n: p[n] for n in ("n1", "n2", "wq", "wk", "wv", "wo", "w_router", "w_up", "w_down")}
        x_bsd, per_layer = md.repeat(block, x_bsd, stacked, "layer")
        logits_bsv = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab",
                               md.rms_norm(x_bsd, "d_model", p["nf"]), p["head"])
        lm_loss = md.reduce_mean(md.cross_entropy(logits_bsv, labels_bs, "vocab"))
        balance = md.reduce_sum(per_layer["balance"], "layer")
        loss = lm_loss + cfg.aux_weight * balance

    def make_feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(0, cfg.vocab, (cfg.batch, 1), generator=gen)
        tokens = (start * 5 + torch.arange(cfg.seq + 1) * 7) % cfg.vocab
        return {"ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}

    return md.Model(g, loss, p, make_feeds, cfg, logits=logits_bsv,
                    outputs={"lm_loss": lm_loss, "balance": per_layer["balance"]})
