"""Held-out model (round 22a): a GPT with expert-choice MoE layers (Zhou et al. 2022), from the docs alone.

Legend: b = batch, s = seq, k = key_seq, d = d_model, h = heads, e = d_head, x = experts,
c = cap (each expert's chosen tokens), f = d_ff, v = vocab, l = layer.

Each expert picks its top-`cap` tokens of each sequence by router score (md.top_k over the
TOKEN dim `seq`, not over experts); the picked tokens are dispatched by a one-hot contraction,
run through the expert's gelu MLP, and combined back weighted by their router scores. Blocks
(causal attention + the MoE) are pre-norm, under md.repeat; next-token cross-entropy.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    vocab: int = 256
    batch: int = 8
    seq: int = 32
    d_model: int = 64
    heads: int = 4
    d_head: int = 16
    experts: int = 4
    cap: int = 16
    d_ff: int = 128
    layers: int = 2
    remat: str | None = None

    @classmethod
    def tiny(cls):
        return cls(vocab=32, batch=4, seq=8, d_model=8, heads=2, d_head=4, experts=4, cap=4, d_ff=8, layers=2)


def _attend(x, p):
    h = md.layer_norm(x, "d_model", p["ln1"])
    q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wq"])
    hk = md.rename(h, seq="key_seq")
    k = md.einsum("batch key_seq d_model, d_model heads d_head -> batch key_seq heads d_head", hk, p["wk"])
    v = md.einsum("batch key_seq d_model, d_model heads d_head -> batch key_seq heads d_head", hk, p["wv"])
    a = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=True)
    return x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", a, p["wo"])


def _expert_choice(x, p, cap):
    """Each expert takes its top-`cap` tokens of each sequence; their outputs are scattered back."""
    h = md.layer_norm(x, "d_model", p["ln2"])
    scores = md.softmax(md.einsum("batch seq d_model, d_model experts -> batch seq experts", h, p["router"]),
                        "experts")
    gate, idx = md.top_k(scores, "seq", cap, "cap")                        # [batch, experts, cap]
    dispatch = md.one_hot(idx, x.shape["seq"])                             # [batch, experts, cap, seq]
    xin = md.einsum("batch experts cap seq, batch seq d_model -> batch experts cap d_model", dispatch, h)
    f = md.gelu(md.einsum("batch experts cap d_model, experts d_model d_ff -> batch experts cap d_ff",
                          xin, p["w1"]))
    y = md.einsum("batch experts cap d_ff, experts d_ff d_model -> batch experts cap d_model", f, p["w2"])
    combine = dispatch * gate
    return x + md.einsum("batch experts cap seq, batch experts cap d_model -> batch seq d_model", combine, y)


def build(cfg: Config) -> md.Model:
    B, S, V = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("vocab", cfg.vocab)
    D, H, E = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    X, F, L = md.Dim("experts", cfg.experts), md.Dim("d_ff", cfg.d_ff), md.Dim("layer", cfg.layers)
    with md.Graph() as g:
        ids, labels = md.input("ids", [B, S], dtype=torch.int64), md.input("labels", [B, S], dtype=torch.int64)
        wte, wpe = md.param("wte", [V, D], scale=0.1), md.param("wpe", [S, D], scale=0.1)
        p = {"ln1": md.param("ln1", [L, D], init="ones"), "ln2": md.param("ln2", [L, D], init="ones"),
             "wq": md.param("wq", [L, D, H, E], fan_out=["layer", H, E]),
             "wk": md.param("wk", [L, D, H, E], fan_out=["layer", H, E]),
             "wv": md.param("wv", [L, D, H, E], fan_out=["layer", H, E]),
             "wo": md.param("wo", [L, H, E, D], fan_out=["layer", D]),
             "router": md.param("router", [L, D, X], fan_out=["layer", X]),
             "w1": md.param("w1", [L, X, D, F], fan_out=["layer", X, F]),
             "w2": md.param("w2", [L, X, F, D], fan_out=["layer", X, D])}
        lnf, head = md.param("lnf", [D], init="ones"), md.param("lm_head", [D, V], fan_out=[V])

        x = md.gather(wte, ids, "vocab") + wpe
        x = md.repeat(lambda c, q: _expert_choice(_attend(c, q), q, cfg.cap), x, p, "layer", remat=cfg.remat)
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab",
                           md.layer_norm(x, "d_model", lnf), head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def make_feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        toks = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": toks[:, :-1].contiguous(), "labels": toks[:, 1:].contiguous()}

    return md.Model(g, loss, g.params(), make_feeds, cfg, logits=logits)


REF_INPUTS = ("ids", "labels")


def reference_loss(cfg: Config, params: dict, ids, labels):
    """The same loss in plain torch: torch.topk over each sequence's tokens per expert, the picked
    rows gathered and their outputs scattered back (index_add) weighted by the router score."""
    import torch.nn.functional as F

    def norm(x, w):
        return F.layer_norm(x, (cfg.d_model,), eps=1e-5) * w

    x = params["wte"][ids] + params["wpe"]
    for i in range(cfg.layers):
        p = {k: v[i] for k, v in params.items() if v.dim() and k not in ("wte", "wpe", "lnf", "lm_head")}
        h = norm(x, p["ln1"])
        q, k, v = (torch.einsum("bsd,dhe->bhse", h, p[n]) for n in ("wq", "wk", "wv"))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + torch.einsum("bhse,hed->bsd", a, p["wo"])
        h = norm(x, p["ln2"])
        scores = torch.softmax(h @ p["router"], -1)                    # [batch, seq, experts]
        gate, idx = torch.topk(scores.transpose(1, 2), cfg.cap, dim=-1)  # [batch, experts, cap]
        out = torch.zeros_like(x)
        for b in range(cfg.batch):
            for e in range(cfg.experts):
                rows = h[b, idx[b, e]]                                  # [cap, d_model]
                y = F.gelu(rows @ p["w1"][e]) @ p["w2"][e]
                out[b].index_add_(0, idx[b, e], y * gate[b, e, :, None])
        x = x + out
    logits = norm(x, params["lnf"]) @ params["lm_head"]
    return F.cross_entropy(logits.reshape(-1, cfg.vocab), labels.reshape(-1))
