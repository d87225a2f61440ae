"""Held-out model (round 22a): SPLADE (Formal et al. 2021), from the docs alone.

Legend: p = side (query, document), b = batch, s = seq, k = key_seq, d = d_model, h = heads,
e = d_head, f = d_ff, v = vocab, l = layer, o = doc (the in-batch documents).

A small BERT-like encoder (token and position embeddings, post-norm blocks under md.repeat)
reads the queries and their documents together (`side` first); the MLM head's logits over the
vocab become term weights log(1 + relu(.)), max-pooled over the sequence into one sparse vector
per text. The loss is the in-batch contrastive cross-entropy of each query against every
document (its own is the label) plus the FLOPS regulariser (sum over the vocab of the squared
mean weight over the batch), on both sides.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    vocab: int = 512
    batch: int = 8
    seq: int = 16
    d_model: int = 64
    heads: int = 4
    d_head: int = 16
    d_ff: int = 256
    layers: int = 2
    flops_weight: float = 0.01
    remat: str | None = None

    @classmethod
    def tiny(cls):
        return cls(vocab=32, batch=4, seq=6, d_model=8, heads=2, d_head=4, d_ff=16, layers=2)


def _block(x, p):
    """A post-norm BERT block: bidirectional attention, then a gelu MLP."""
    q = md.einsum("side batch seq d_model, d_model heads d_head -> side batch seq heads d_head", x, p["wq"])
    kx = md.rename(x, seq="key_seq")
    k = md.einsum("side batch key_seq d_model, d_model heads d_head -> side batch key_seq heads d_head", kx, p["wk"])
    v = md.einsum("side batch key_seq d_model, d_model heads d_head -> side batch key_seq heads d_head", kx, p["wv"])
    a = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=False)
    a = md.einsum("side batch seq heads d_head, heads d_head d_model -> side batch seq d_model", a, p["wo"])
    x = md.layer_norm(x + a, "d_model", p["ln1"], p["ln1_b"])
    h = md.gelu(md.einsum("side batch seq d_model, d_model d_ff -> side batch seq d_ff", x, p["w_fc"]))
    h = md.einsum("side batch seq d_ff, d_ff d_model -> side batch seq d_model", h, p["w_proj"])
    return md.layer_norm(x + h, "d_model", p["ln2"], p["ln2_b"])


def build(cfg: Config) -> md.Model:
    P, B, S = md.Dim("side", 2), md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq)
    V, D, L = md.Dim("vocab", cfg.vocab), md.Dim("d_model", cfg.d_model), md.Dim("layer", cfg.layers)
    H, E, F = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    with md.Graph() as g:
        ids = md.input("ids", [P, B, S], dtype=torch.int64)
        wte = md.param("wte", [V, D], scale=0.1)
        wpe = md.param("wpe", [S, D], scale=0.1)
        p = {"wq": md.param("wq", [L, D, H, E], fan_out=["layer", H, E]),
             "wk": md.param("wk", [L, D, H, E], fan_out=["layer", H, E]),
             "wv": md.param("wv", [L, D, H, E], fan_out=["layer", H, E]),
             "wo": md.param("wo", [L, H, E, D], fan_out=["layer", D]),
             "w_fc": md.param("w_fc", [L, D, F], fan_out=["layer", F]),
             "w_proj": md.param("w_proj", [L, F, D], fan_out=["layer", D])}
        for n in ("ln1", "ln2"):
            p[n] = md.param(n, [L, D], init="ones")
            p[n + "_b"] = md.param(n + "_b", [L, D], init="zeros")
        head_w = md.param("head_w", [D, md.Dim("d_tr", cfg.d_model)], fan_out=["d_tr"])
        head_ln = md.param("head_ln", [D], init="ones")
        vocab_b = md.param("vocab_b", [V], init="zeros")

        x = md.layer_norm(md.gather(wte, ids, "vocab") + wpe, "d_model")
        x = md.repeat(_block, x, p, "layer", remat=cfg.remat)
        t = md.rename(md.gelu(md.einsum("side batch seq d_model, d_model d_tr -> side batch seq d_tr", x, head_w)),
                      d_tr="d_model")
        t = md.layer_norm(t, "d_model", head_ln)
        logits = md.einsum("side batch seq d_model, vocab d_model -> side batch seq vocab", t, wte) + vocab_b
        rep = md.reduce_max(md.log1p(md.relu(logits)), "seq")             # [side, batch, vocab]
        q_rep = md.squeeze(md.slice_(rep, "side", 0, 1), "side")
        d_rep = md.rename(md.squeeze(md.slice_(rep, "side", 1, 2), "side"), batch="doc")
        scores = md.einsum("batch vocab, doc vocab -> batch doc", q_rep, d_rep)
        labels = md.arange(B)
        contrastive = md.reduce_mean(md.cross_entropy(scores, labels, "doc"))
        flops = md.reduce_sum(md.reduce_mean(rep, "batch") ** 2)
        loss = contrastive + cfg.flops_weight * flops

    def make_feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        return {"ids": torch.randint(0, cfg.vocab, (2, cfg.batch, cfg.seq), generator=gen)}

    return md.Model(g, loss, g.params(), make_feeds, cfg,
                    outputs={"contrastive": contrastive, "flops": flops})


REF_INPUTS = ("ids",)


def reference_loss(cfg: Config, p: dict, ids):
    """The same loss in plain torch: a BERT loop over the layers, amax over the sequence."""
    import torch.nn.functional as F

    def ln(x, w=None, b=None):
        return F.layer_norm(x, (cfg.d_model,), w, b, eps=1e-5)

    x = ln(p["wte"][ids] + p["wpe"])                                   # [side, batch, seq, d_model]
    for i in range(cfg.layers):
        q, k, v = (torch.einsum("pbsd,dhe->pbhse", x, p[n][i]) for n in ("wq", "wk", "wv"))
        a = torch.einsum("pbhse,hed->pbsd", F.scaled_dot_product_attention(q, k, v), p["wo"][i])
        x = ln(x + a, p["ln1"][i], p["ln1_b"][i])
        x = ln(x + F.gelu(x @ p["w_fc"][i]) @ p["w_proj"][i], p["ln2"][i], p["ln2_b"][i])
    t = ln(F.gelu(x @ p["head_w"]), p["head_ln"])
    rep = torch.log1p(F.relu(t @ p["wte"].T + p["vocab_b"])).amax(2)  # [side, batch, vocab]
    scores = rep[0] @ rep[1].T
    contrastive = F.cross_entropy(scores, torch.arange(cfg.batch))
    return contrastive + cfg.flops_weight * (rep.mean(1) ** 2).sum()
