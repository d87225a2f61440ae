"""A StarCoder-style decoder with multi-query attention, written from the README and docs/ alone
(a held-out model).

Multi-query attention: ``heads`` query heads and ONE key/value head, k and v ``[batch, key_seq,
d_head]`` with no ``heads`` dim (the fused attention reads a dim of q that k and v lack as a batch
dim they share), so ``heads:model`` splits the queries and keeps k and v whole on every rank.
GPT-2 style otherwise: learned positions, LayerNorm with biases, biases on every projection, a
gelu MLP, the head tied to the embedding. ``attention="composite"`` writes the attention as
einsums and a softmax instead of ``md.attention``.

Legend: b batch, s seq, t key_seq, d d_model, h heads, e d_head, f d_ff.
"""
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
    attention: str = "fused"     # or "composite"
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=32, d_model=16, heads=4, d_head=4, d_ff=32, layers=2, seq=8, batch=4)


def build(cfg: Config = Config()) -> md.Model:
    if cfg.attention not in ("fused", "composite"):
        raise ValueError(f"attention must be 'fused' or 'composite', not {cfg.attention!r}")
    b, s, t = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("key_seq", cfg.seq)
    d, h, e = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    f, v, L = md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    with md.Graph("heldout_starcoder") as graph:
        ids = md.input("ids", [b, s], dtype=torch.int64)
        labels = md.input("labels", [b, s], dtype=torch.int64)
        wte = md.param("wte", [v, d], scale=0.5)
        wpe = md.param("wpe", [s, d], scale=0.1)
        p = {
            "ln1": md.param("ln1", [L, d], init="ones"), "ln1_b": md.param("ln1_b", [L, d], scale=0.1),
            "wq": md.param("wq", [L, d, h, e], fan_out=["layer", "heads", "d_head"]),
            "bq": md.param("bq", [L, h, e], scale=0.1),
            "wk": md.param("wk", [L, d, e], fan_out=["layer", "d_head"]), "bk": md.param("bk", [L, e], scale=0.1),
            "wv": md.param("wv", [L, d, e], fan_out=["layer", "d_head"]), "bv": md.param("bv", [L, e], scale=0.1),
            "wo": md.param("wo", [L, h, e, d], fan_out=["layer", "d_model"]), "bo": md.param("bo", [L, d], scale=0.1),
            "ln2": md.param("ln2", [L, d], init="ones"), "ln2_b": md.param("ln2_b", [L, d], scale=0.1),
            "w_fc": md.param("w_fc", [L, d, f], fan_out=["layer", "d_ff"]), "b_fc": md.param("b_fc", [L, f], scale=0.1),
            "w_proj": md.param("w_proj", [L, f, d], fan_out=["layer", "d_model"]),
            "b_proj": md.param("b_proj", [L, d], scale=0.1),
        }
        lnf, lnf_b = md.param("lnf", [d], init="ones"), md.param("lnf_b", [d], init="zeros")

        def attend(q, k, val):
            if cfg.attention == "fused":
                return md.attention(q, k, val, "seq", "key_seq", "d_head", causal=True)
            scores = md.einsum("batch seq heads d_head, batch key_seq d_head -> batch heads seq key_seq", q, k)
            att = md.softmax(md.where(md.causal_mask(s, t), scores * cfg.d_head ** -0.5, -1e9), "key_seq")
            return md.einsum("batch heads seq key_seq, batch key_seq d_head -> batch seq heads d_head", att, val)

        def block(x, p):
            n = md.layer_norm(x, "d_model", p["ln1"], p["ln1_b"])
            q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", n, p["wq"]) + p["bq"]
            nk = md.rename(n, seq="key_seq")
            k = md.einsum("batch key_seq d_model, d_model d_head -> batch key_seq d_head", nk, p["wk"]) + p["bk"]
            val = md.einsum("batch key_seq d_model, d_model d_head -> batch key_seq d_head", nk, p["wv"]) + p["bv"]
            o = attend(q, k, val)
            x = x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, p["wo"]) + p["bo"]
            n = md.layer_norm(x, "d_model", p["ln2"], p["ln2_b"])
            y = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", n, p["w_fc"]) + p["b_fc"])
            return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", y, p["w_proj"]) + p["b_proj"]

        x = md.repeat(block, md.gather(wte, ids, "vocab") + wpe, p, "layer", remat=cfg.remat)
        logits = md.einsum("batch seq d_model, vocab d_model -> batch seq vocab",
                           md.layer_norm(x, "d_model", lnf, lnf_b), wte)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        toks = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=torch.Generator().manual_seed(seed))
        return {"ids": toks[:, :-1], "labels": toks[:, 1:]}

    params = {"wte": wte, "wpe": wpe, **p, "lnf": lnf, "lnf_b": lnf_b}
    return md.Model(graph, loss, params, feeds, cfg, logits=logits)
