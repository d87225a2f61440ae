"""Held-out model: a Sparse Transformer (Child et al. 2019), written from the docs alone.

A GPT decoder whose attention follows one of the paper's factorized patterns, as a boolean
mask over (seq, key_seq) in a composite attention (einsum, ``md.where``, softmax):

- ``form=fixed``: a query sees the keys of its own block of ``stride`` positions (causal) and
  the last ``summary`` positions of every earlier block (the "summary" columns);
- ``form=strided``: a query sees the ``stride`` keys before it (a local window) and every
  ``stride``-th key behind it (``(i - j) % stride == 0``).

Causal next-token loss; pre-norm blocks under ``md.repeat``.

Legend: b batch, s seq, k key_seq, h heads, e d_head, d d_model, f d_ff, v vocab.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    vocab: int = 256
    d_model: int = 128
    heads: int = 4
    d_head: int = 32
    d_ff: int = 512
    layers: int = 4
    seq: int = 64
    stride: int = 8
    summary: int = 2
    batch: int = 8
    remat: str | None = None
    form: str = "fixed"

    @classmethod
    def tiny(cls):
        return cls(vocab=32, d_model=16, heads=2, d_head=8, d_ff=32, layers=2, seq=12, stride=4,
                   summary=1, batch=4)


def sparse_mask(S, K, cfg):
    """Boolean [seq, key_seq]: which keys each query attends to under the pattern."""
    q_pos, k_pos = md.arange(S), md.arange(K)
    if cfg.form == "fixed":
        same_block = md.equal(q_pos // cfg.stride, k_pos // cfg.stride)
        summary = (k_pos % cfg.stride) >= cfg.stride - cfg.summary
        pattern = md.logical_or(same_block, summary)
    else:
        dist = q_pos - k_pos
        pattern = md.logical_or(dist < cfg.stride, md.equal(dist % cfg.stride, 0))
    return md.logical_and(md.causal_mask(S, K), pattern)


def _block(x, p, keep, cfg):
    h = md.layer_norm(x, "d_model", p["ln1"], p["ln1_b"])
    q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wq"])
    k = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wk"])
    v = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wv"])
    k, v = md.rename(k, seq="key_seq"), md.rename(v, seq="key_seq")
    scores = md.einsum("batch seq heads d_head, batch key_seq heads d_head -> batch heads seq key_seq", q, k)
    att = md.softmax(md.where(keep, scores * cfg.d_head ** -0.5, -1e9), "key_seq")
    o = md.einsum("batch heads seq key_seq, batch key_seq heads d_head -> batch seq heads d_head", att, v)
    x = x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, p["wo"])
    h = md.layer_norm(x, "d_model", p["ln2"], p["ln2_b"])
    h = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w_fc"]))
    return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", h, p["w_proj"])


def build(cfg: Config) -> md.Model:
    if cfg.form not in ("fixed", "strided"):
        raise ValueError(f"form must be 'fixed' or 'strided', got {cfg.form!r}")
    B, S, K = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("key_seq", cfg.seq)
    V, D, H = md.Dim("vocab", cfg.vocab), md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads)
    E, F, L = md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff), md.Dim("layer", cfg.layers)
    with md.Graph() as g:
        ids, labels = md.input("ids", [B, S], torch.int64), md.input("labels", [B, S], torch.int64)
        params = {
            "wte": md.param("wte", [V, D], scale=0.5),
            "wpe": md.param("wpe", [S, D], scale=0.1),
            "ln1": md.param("ln1", [L, D], init="ones"), "ln1_b": md.param("ln1_b", [L, D], init="zeros"),
            "wq": md.param("wq", [L, D, H, E], fan_out=["layer", "heads", "d_head"]),
            "wk": md.param("wk", [L, D, H, E], fan_out=["layer", "heads", "d_head"]),
            "wv": md.param("wv", [L, D, H, E], fan_out=["layer", "heads", "d_head"]),
            "wo": md.param("wo", [L, H, E, D], fan_out=["layer", "d_model"]),
            "ln2": md.param("ln2", [L, D], init="ones"), "ln2_b": md.param("ln2_b", [L, D], init="zeros"),
            "w_fc": md.param("w_fc", [L, D, F], fan_out=["layer", "d_ff"]),
            "w_proj": md.param("w_proj", [L, F, D], fan_out=["layer", "d_model"]),
            "lnf": md.param("lnf", [D], init="ones"),
            "lm_head": md.param("lm_head", [D, V], fan_out=["vocab"]),
        }
        keep = sparse_mask(S, K, cfg)
        x = md.gather(params["wte"], ids, "vocab") + params["wpe"]
        stacked = {n: t for n, t in params.items() if t.shape.names[0] == "layer"}
        x = md.repeat(lambda c, p: _block(c, p, keep, cfg), x, stacked, "layer", remat=cfg.remat)
        h = md.layer_norm(x, "d_model", params["lnf"])
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", h, params["lm_head"])
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def make_feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        toks = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": toks[:, :-1].contiguous(), "labels": toks[:, 1:].contiguous()}

    return md.Model(g, loss, params, make_feeds, cfg, logits=logits)
