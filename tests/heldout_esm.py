"""Held-out model: an ESM-2-style protein masked LM, written from the docs alone.

A pre-LN encoder (bidirectional fused ``md.attention``) with rotary position embeddings
computed in the graph (a constant of inverse frequencies, ``md.cos``/``md.sin``, read by every
block), a final LayerNorm, and ESM's LM head (dense, gelu, LayerNorm, projection to the
vocabulary plus a bias). The masked-LM loss counts the masked positions only: the mask is an
input (``mlm_mask``, 1.0 where a residue was masked), the loss ``sum(ce * mask) / sum(mask)``.

``form``: ``tied`` (the projection is the token embedding, as ESM-2's) or ``untied`` (a
separate ``[d_model, vocab]`` weight).

Legend: b batch, s seq, k key_seq, h heads, e d_head, r half (d_head / 2), d d_model,
f d_ff, v vocab.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    vocab: int = 33
    d_model: int = 128
    heads: int = 4
    d_head: int = 32
    d_ff: int = 512
    layers: int = 4
    seq: int = 64
    batch: int = 8
    mask_rate: float = 0.15
    remat: str | None = None
    form: str = "tied"

    @classmethod
    def tiny(cls):
        return cls(vocab=24, d_model=16, heads=2, d_head=8, d_ff=32, layers=2, seq=8, batch=4)


def rotate(x, cos, sin, pos_dim):
    """Rotary embedding of ``x [.., pos_dim, .., d_head]`` (rotate-half form, as ESM's)."""
    half = cos.shape["half"].size
    x1 = md.rename(md.slice_(x, "d_head", 0, half), d_head="half")
    x2 = md.rename(md.slice_(x, "d_head", half, 2 * half), d_head="half")
    cos, sin = md.rename(cos, seq=pos_dim), md.rename(sin, seq=pos_dim)
    rot = md.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], "half")
    return md.rename(rot, half="d_head")


def _block(x, p, cos, sin):
    h = md.layer_norm(x, "d_model", p["ln1"], p["ln1_b"])
    q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wq"])
    k = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wk"])
    v = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wv"])
    q, k = rotate(q, cos, sin, "seq"), rotate(k, cos, sin, "seq")
    k, v = md.rename(k, seq="key_seq"), md.rename(v, seq="key_seq")
    o = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=False)
    x = x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, p["wo"])
    h = md.layer_norm(x, "d_model", p["ln2"], p["ln2_b"])
    h = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w_fc"]))
    return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", h, p["w_proj"])


def _params(cfg, V, D, H, E, F, L):
    params = {
        "wte": md.param("wte", [V, D], scale=0.5),
        "ln1": md.param("ln1", [L, D], init="ones"), "ln1_b": md.param("ln1_b", [L, D], init="zeros"),
        "wq": md.param("wq", [L, D, H, E], fan_out=["layer", "heads", "d_head"]),
        "wk": md.param("wk", [L, D, H, E], fan_out=["layer", "heads", "d_head"]),
        "wv": md.param("wv", [L, D, H, E], fan_out=["layer", "heads", "d_head"]),
        "wo": md.param("wo", [L, H, E, D], fan_out=["layer", "d_model"]),
        "ln2": md.param("ln2", [L, D], init="ones"), "ln2_b": md.param("ln2_b", [L, D], init="zeros"),
        "w_fc": md.param("w_fc", [L, D, F], fan_out=["layer", "d_ff"]),
        "w_proj": md.param("w_proj", [L, F, D], fan_out=["layer", "d_model"]),
        "lnf": md.param("lnf", [D], init="ones"), "lnf_b": md.param("lnf_b", [D], init="zeros"),
        "w_dense": md.param("w_dense", [D, md.Dim("d_lm", cfg.d_model)], fan_out=["d_lm"]),
        "ln_lm": md.param("ln_lm", [md.Dim("d_lm", cfg.d_model)], init="ones"),
        "lm_bias": md.param("lm_bias", [V], init="zeros"),
    }
    if cfg.form == "untied":
        params["lm_head"] = md.param("lm_head", [md.Dim("d_lm", cfg.d_model), V], fan_out=["vocab"])
    return params


def build(cfg: Config) -> md.Model:
    if cfg.form not in ("tied", "untied"):
        raise ValueError(f"form must be 'tied' or 'untied', got {cfg.form!r}")
    B, S, V, D = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("vocab", cfg.vocab), md.Dim("d_model", cfg.d_model)
    H, E, F, L = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff), md.Dim("layer", cfg.layers)
    R = md.Dim("half", cfg.d_head // 2)
    with md.Graph() as g:
        ids, labels = md.input("ids", [B, S], torch.int64), md.input("labels", [B, S], torch.int64)
        mlm_mask = md.input("mlm_mask", [B, S])
        params = _params(cfg, V, D, H, E, F, L)
        inv_freq = md.constant(1.0 / 10000 ** (torch.arange(0, cfg.d_head, 2) / cfg.d_head), [R])
        angles = md.arange(S, torch.float32) * inv_freq                      # [seq, half]
        cos, sin = md.cos(angles), md.sin(angles)
        x = md.gather(params["wte"], ids, "vocab")
        stacked = {n: t for n, t in params.items() if t.shape.names[0] == "layer"}
        x = md.repeat(lambda c, p: _block(c, p, cos, sin), x, stacked, "layer", remat=cfg.remat)
        h = md.layer_norm(x, "d_model", params["lnf"], params["lnf_b"])
        h = md.gelu(md.einsum("batch seq d_model, d_model d_lm -> batch seq d_lm", h, params["w_dense"]))
        h = md.layer_norm(h, "d_lm", params["ln_lm"])
        if cfg.form == "tied":
            head = md.rename(params["wte"], d_model="d_lm")
        else:
            head = params["lm_head"]
        logits = md.einsum("batch seq d_lm, vocab d_lm -> batch seq vocab", h, head) + params["lm_bias"]
        ce = md.cross_entropy(logits, labels, "vocab")
        loss = md.reduce_sum(ce * mlm_mask) / md.reduce_sum(mlm_mask)

    def make_feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        labels_ = torch.randint(4, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)
        mask = torch.rand(cfg.batch, cfg.seq, generator=gen) < cfg.mask_rate
        mask[:, 0] = True                                   # at least one masked residue per row
        ids_ = torch.where(mask, torch.full_like(labels_, 3), labels_)   # 3: the <mask> token
        return {"ids": ids_, "labels": labels_, "mlm_mask": mask.float()}

    return md.Model(g, loss, params, make_feeds, cfg)
