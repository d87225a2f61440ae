"""Held-out model (round 26c): a small BERT-style masked LM written from the docs alone.

Padded rows of token ids with per-row lengths; token and learned position embeddings; pre-norm
encoder blocks under ``md.repeat`` with bidirectional attention masked by
the padding (``md.attention(mask=)``, the mask ``[key_seq, batch]`` from the lengths) and a
gelu(tanh) MLP; an LM head and the MLM cross-entropy with ``ignore_index=-100`` on every
position not masked for prediction, averaged over the kept labels as torch's mean.

Legend: ``batch`` rows, ``seq`` query positions, ``key_seq`` the same positions as keys,
``d_model`` width, ``heads``/``d_head`` attention, ``d_ff`` the MLP, ``layer`` the stack,
``vocab`` tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md

IGNORE = -100


@dataclass
class Config:
    vocab: int = 64
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 2
    seq: int = 16
    batch: int = 8
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=16, d_model=8, heads=2, d_head=4, d_ff=16, layers=2, seq=8, batch=4)


def _block(x, p, mask):
    h = md.layer_norm(x, "d_model", p["ln1"], p["ln1_b"])
    q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wq"])
    k = md.rename(md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wk"]), seq="key_seq")
    v = md.rename(md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wv"]), seq="key_seq")
    a = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=False, mask=mask)
    x = x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", a, p["wo"])
    h = md.layer_norm(x, "d_model", p["ln2"], p["ln2_b"])
    f = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w1"]), approximate="tanh")
    return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", f, p["w2"])


def build(cfg: Config) -> md.Model:
    b, s, ks = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("key_seq", cfg.seq)
    d, hd, e = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    f, lyr, voc = md.Dim("d_ff", cfg.d_ff), md.Dim("layer", cfg.layers), md.Dim("vocab", cfg.vocab)
    with md.Graph() as g:
        ids = md.input("ids", [b, s], dtype=torch.int64)
        labels = md.input("labels", [b, s], dtype=torch.int64)
        lengths = md.input("lengths", [b], dtype=torch.int64)
        wte = md.param("wte", [voc, d], fan_out=[d])
        wpe = md.param("wpe", [s, d], fan_out=[d])
        stacked = {
            "ln1": md.param("ln1", [lyr, d], init="ones"), "ln1_b": md.param("ln1_b", [lyr, d], init="zeros"),
            "wq": md.param("wq", [lyr, d, hd, e], fan_out=["layer", hd, e]),
            "wk": md.param("wk", [lyr, d, hd, e], fan_out=["layer", hd, e]),
            "wv": md.param("wv", [lyr, d, hd, e], fan_out=["layer", hd, e]),
            "wo": md.param("wo", [lyr, hd, e, d], fan_out=["layer", d]),
            "ln2": md.param("ln2", [lyr, d], init="ones"), "ln2_b": md.param("ln2_b", [lyr, d], init="zeros"),
            "w1": md.param("w1", [lyr, d, f], fan_out=["layer", f]),
            "w2": md.param("w2", [lyr, f, d], fan_out=["layer", d]),
        }
        mask = md.less(md.arange(ks), lengths)                       # [key_seq, batch]: real tokens
        x = md.gather(wte, ids, "vocab") + wpe
        x = md.repeat(lambda h, p: _block(h, p, mask), x, stacked, "layer", remat=cfg.remat)
        x = md.layer_norm(x, "d_model", md.param("lnf", [d], init="ones"), md.param("lnf_b", [d], init="zeros"))
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", x, md.param("head", [d, voc], fan_out=[voc]))
        ce = md.cross_entropy(logits, labels, "vocab", ignore_index=IGNORE)
        kept = md.reduce_sum(md.cast(md.not_equal(labels, IGNORE), torch.float32))
        loss = md.reduce_sum(ce) / kept

    def make_feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.randint(2, cfg.seq + 1, (cfg.batch,), generator=gen)
        lengths[0] = cfg.seq
        pos = torch.arange(cfg.seq)[None, :]
        real = pos < lengths[:, None]
        tokens = torch.randint(1, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)
        chosen = real & (torch.rand(cfg.batch, cfg.seq, generator=gen) < 0.3)
        chosen[:, 0] = True                                   # every row predicts something
        labels = torch.where(chosen, tokens, torch.full_like(tokens, IGNORE))
        ids = torch.where(chosen, torch.zeros_like(tokens), tokens)   # id 0 is [MASK] (and padding)
        return {"ids": torch.where(real, ids, torch.zeros_like(ids)), "labels": labels, "lengths": lengths}

    return md.Model(g, loss, g.params(), make_feeds, cfg)


def torch_reference(cfg: Config, weights: dict, feeds: dict) -> torch.Tensor:
    """The same model in plain torch (float64, SDPA with a boolean attn_mask), from ``weights``."""
    F = torch.nn.functional
    w = {k: v.double() for k, v in weights.items()}
    keep = torch.arange(cfg.seq)[None, :] < feeds["lengths"][:, None]          # [batch, key]
    x = w["wte"][feeds["ids"]] + w["wpe"]
    for i in range(cfg.layers):
        h = F.layer_norm(x, (cfg.d_model,), w["ln1"][i], w["ln1_b"][i])
        q, k, v = (torch.einsum("bsd,dhe->bhse", h, w[n][i]) for n in ("wq", "wk", "wv"))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        x = x + torch.einsum("bhse,hed->bsd", a, w["wo"][i])
        h = F.layer_norm(x, (cfg.d_model,), w["ln2"][i], w["ln2_b"][i])
        x = x + F.gelu(h @ w["w1"][i], approximate="tanh") @ w["w2"][i]
    x = F.layer_norm(x, (cfg.d_model,), w["lnf"], w["lnf_b"])
    logits = x @ w["head"]
    return F.cross_entropy(logits.reshape(-1, cfg.vocab), feeds["labels"].reshape(-1), ignore_index=IGNORE)
