"""A held-out GPT-2, written from README.md and docs/ only (round 7c: training features).

Legend: b batch, s seq (queries), k key_seq (keys), d d_model, h heads, e d_head, f d_ff,
v vocab, l layer.

    ids_bs -> wte[ids] + wpe[s] -> dropout
      -> md.repeat over layers of a pre-LN block:
           h += dropout(attn(LN(h)))   (causal, the composite: dropout on the probabilities)
           h += dropout(W2 gelu(W1 LN(h) + b1) + b2)
      -> final LN -> logits = h . wte (the input embedding, tied) -> next-token cross-entropy

It reads ``ids``/``labels`` as the docs say a text model does, so ``meshdsl train`` trains it
on the default corpus (byte tokens, ``vocab=256`` given by the train command).
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
    d_ff: int = 128
    layers: int = 2
    dropout: float = 0.1

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=50, seq=8, batch=4, d_model=8, heads=2, d_head=4, d_ff=16, layers=2)


def build(cfg: Config = Config()) -> md.Model:
    b, s, k = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("key_seq", cfg.seq)
    v, d, h = md.Dim("vocab", cfg.vocab), md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads)
    e, f, l = md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff), md.Dim("layer", cfg.layers)

    def drop(x, salt):
        return md.dropout(x, cfg.dropout, seed=salt) if cfg.dropout > 0 else x

    with md.Graph("heldout_gpt2") as g:
        ids_bs = md.input("ids", [b, s], torch.int64)
        labels_bs = md.input("labels", [b, s], torch.int64)
        p = {
            "wte": md.param("wte", [v, d], scale=0.5),
            "wpe": md.param("wpe", [s, d], scale=0.1),
            "ln1": md.param("ln1", [l, d], init="ones"), "ln1_b": md.param("ln1_b", [l, d], init="zeros"),
            "wqkv": md.param("wqkv", [l, md.Dim("qkv", 3), d, h, e], fan_out=["layer", "qkv", h, e]),
            "wo": md.param("wo", [l, h, e, d], fan_out=["layer", d]),
            "ln2": md.param("ln2", [l, d], init="ones"), "ln2_b": md.param("ln2_b", [l, d], init="zeros"),
            "w_fc": md.param("w_fc", [l, d, f], fan_out=["layer", f]), "b_fc": md.param("b_fc", [l, f], init="zeros"),
            "w_proj": md.param("w_proj", [l, f, d], fan_out=["layer", d]),
            "b_proj": md.param("b_proj", [l, d], init="zeros"),
            "lnf": md.param("lnf", [d], init="ones"), "lnf_b": md.param("lnf_b", [d], init="zeros"),
        }
        x_bsd = drop(md.gather(p["wte"], ids_bs, "vocab") + p["wpe"], 1)
        causal = md.causal_mask(s, k)

        def block(x, w):
            a = md.layer_norm(x, "d_model", w["ln1"], w["ln1_b"])
            qkv = md.einsum("batch seq d_model, qkv d_model heads d_head -> qkv batch seq heads d_head", a, w["wqkv"])
            q = md.squeeze(md.slice_(qkv, "qkv", 0, 1), "qkv")
            kk = md.rename(md.squeeze(md.slice_(qkv, "qkv", 1, 2), "qkv"), {"seq": "key_seq"})
            vv = md.rename(md.squeeze(md.slice_(qkv, "qkv", 2, 3), "qkv"), {"seq": "key_seq"})
            sc = md.einsum("batch seq heads d_head, batch key_seq heads d_head -> batch heads seq key_seq", q, kk)
            att = drop(md.softmax(md.where(causal, sc * cfg.d_head ** -0.5, -1e9), "key_seq"), 2)
            o = md.einsum("batch heads seq key_seq, batch key_seq heads d_head -> batch seq heads d_head", att, vv)
            x = x + drop(md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, w["wo"]), 3)
            m = md.layer_norm(x, "d_model", w["ln2"], w["ln2_b"])
            u = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", m, w["w_fc"]) + w["b_fc"])
            y = md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", u, w["w_proj"]) + w["b_proj"]
            return x + drop(y, 4)

        stacked = {n: p[n] for n in ("ln1", "ln1_b", "wqkv", "wo", "ln2", "ln2_b", "w_fc", "b_fc", "w_proj", "b_proj")}
        x_bsd = md.layer_norm(md.repeat(block, x_bsd, stacked, "layer"), "d_model", p["lnf"], p["lnf_b"])
        logits_bsv = md.einsum("batch seq d_model, vocab d_model -> batch seq vocab", x_bsd, p["wte"])   # tied
        loss = md.reduce_mean(md.cross_entropy(logits_bsv, labels_bs, "vocab"))

    def make_feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        # a repeating pattern with noise, so that a few steps visibly learn; labels = ids shifted
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(0, cfg.vocab, (cfg.batch, 1), generator=gen)
        tokens = (start + torch.arange(cfg.seq + 1) * 3) % cfg.vocab
        noise = torch.rand(tokens.shape, generator=gen) < 0.1
        tokens = torch.where(noise, torch.randint(0, cfg.vocab, tokens.shape, generator=gen), tokens)
        return {"ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}

    return md.Model(g, loss, p, make_feeds, cfg, logits=logits_bsv)
