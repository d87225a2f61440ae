"""TokenFormer-lite: a causal LM whose every linear projection is a Pattention layer.

A Pattention layer lets each token attend over learnable parameter tokens instead of
multiplying by a weight matrix: ``scores = x . K_p`` over ``ptok`` param-token keys, normalised
as TokenFormer does (``gelu(scores * sqrt(ptok) / ||scores||_2)``, the L2 norm over ``ptok`` in
place of a softmax), then ``out = weights . V_p``. q, k, v, the attention output, the FFN and the
LM head are all Pattention layers; the blocks are pre-RMSNorm under ``md.repeat``.

Legend: b batch, s seq (t key_seq), d d_model, h heads, e d_head, p ptok (attention
projections' param tokens), f ptok_ff (the FFN's), v vocab, l layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    ptok: int = 32
    ptok_ff: int = 64
    ptok_head: int = 48
    layers: int = 2
    seq: int = 16
    batch: int = 8
    remat: str | None = None      # md.repeat's activation checkpointing (none, full, selective)

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=12, d_model=8, heads=2, d_head=4, ptok=6, ptok_ff=9, ptok_head=6,
                   layers=2, seq=6, batch=4)


def pattention(x, keys, values, in_spec: str, tok: str, out_spec: str):
    """One Pattention layer: ``x [..., in_spec]`` attends over the param tokens ``tok`` of
    ``keys [tok, in_spec]`` and reads ``values [tok, out_spec]``."""
    scores = md.einsum(f"... {in_spec}, {tok} {in_spec} -> ... {tok}", x, keys)
    n_tok = keys.shape[tok].size
    norm = md.sqrt(md.reduce_sum(scores * scores, tok) + 1e-6)
    weights = md.gelu(scores * (n_tok ** 0.5) / norm)
    return md.einsum(f"... {tok}, {tok} {out_spec} -> ... {out_spec}", weights, values)


def build(cfg: Config = Config()) -> md.Model:
    b, s, d = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("d_model", cfg.d_model)
    h, e, v = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("vocab", cfg.vocab)
    p, f = md.Dim("ptok", cfg.ptok), md.Dim("ptok_ff", cfg.ptok_ff)
    ph, lyr = md.Dim("ptok_head", cfg.ptok_head), md.Dim("layer", cfg.layers)
    with md.Graph("tokenformer") as g:
        ids = md.input("ids", [b, s], dtype=torch.int64)
        labels = md.input("labels", [b, s], dtype=torch.int64)
        wte = md.param("wte", [v, d], fan_out=[d])
        stacked = {"ln1": md.param("ln1", [lyr, d], init="ones"),
                   "ln2": md.param("ln2", [lyr, d], init="ones")}
        for name in ("q", "k", "v"):
            stacked[f"{name}_keys"] = md.param(f"{name}_keys", [lyr, p, d], fan_out=["layer", "ptok"])
            stacked[f"{name}_vals"] = md.param(f"{name}_vals", [lyr, p, h, e], fan_out=["layer", "heads", "d_head"])
        stacked["o_keys"] = md.param("o_keys", [lyr, p, h, e], fan_out=["layer", "ptok"])
        stacked["o_vals"] = md.param("o_vals", [lyr, p, d], fan_out=["layer", "d_model"])
        stacked["f_keys"] = md.param("f_keys", [lyr, f, d], fan_out=["layer", "ptok_ff"])
        stacked["f_vals"] = md.param("f_vals", [lyr, f, d], fan_out=["layer", "d_model"])
        lnf = md.param("lnf", [d], init="ones")
        head_keys = md.param("head_keys", [ph, d], fan_out=["ptok_head"])
        head_vals = md.param("head_vals", [ph, v], fan_out=["vocab"])

        def block(x, w):
            a = md.rms_norm(x, "d_model", w["ln1"])
            q = pattention(a, w["q_keys"], w["q_vals"], "d_model", "ptok", "heads d_head")
            k = md.rename(pattention(a, w["k_keys"], w["k_vals"], "d_model", "ptok", "heads d_head"), seq="key_seq")
            val = md.rename(pattention(a, w["v_keys"], w["v_vals"], "d_model", "ptok", "heads d_head"), seq="key_seq")
            y = md.attention(q, k, val, "seq", "key_seq", "d_head", causal=True)
            x = x + pattention(y, w["o_keys"], w["o_vals"], "heads d_head", "ptok", "d_model")
            m = md.rms_norm(x, "d_model", w["ln2"])
            return x + pattention(m, w["f_keys"], w["f_vals"], "d_model", "ptok_ff", "d_model")

        x = md.gather(wte, ids, "vocab")                       # [batch, seq, d_model]
        x = md.repeat(block, x, stacked, "layer", remat=cfg.remat)
        logits = pattention(md.rms_norm(x, "d_model", lnf), head_keys, head_vals, "d_model", "ptok_head", "vocab")
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        toks = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": toks[:, :-1], "labels": toks[:, 1:]}

    return md.Model(g, loss, g.params(), feeds, cfg, logits=logits)


# ---- the plain-torch reference (tests/test_heldout_round26a.py compares it with the model) ----

REF_INPUTS = ["ids", "labels"]


def _ref_pattention(x, keys, values):
    """``x [..., i]``, ``keys [t, i]``, ``values [t, o]`` (flattened as the model's dims)."""
    scores = x @ keys.T
    norm = torch.sqrt((scores * scores).sum(-1, keepdim=True) + 1e-6)
    return torch.nn.functional.gelu(scores * keys.shape[0] ** 0.5 / norm) @ values


def _ref_rms(x, scale):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * scale


def reference_loss(cfg: Config, p: dict, ids, labels):
    """The model in plain torch: params by name (full tensors), the causal attention by sdpa."""
    b, s, h, e = cfg.batch, cfg.seq, cfg.heads, cfg.d_head
    x = p["wte"][ids]
    for i in range(cfg.layers):
        a = _ref_rms(x, p["ln1"][i])
        qkv = [_ref_pattention(a, p[f"{n}_keys"][i], p[f"{n}_vals"][i].reshape(cfg.ptok, h * e))
               .reshape(b, s, h, e).transpose(1, 2) for n in "qkv"]
        y = torch.nn.functional.scaled_dot_product_attention(*qkv, is_causal=True)
        y = y.transpose(1, 2).reshape(b, s, h * e)
        x = x + _ref_pattention(y, p["o_keys"][i].reshape(cfg.ptok, h * e), p["o_vals"][i])
        x = x + _ref_pattention(_ref_rms(x, p["ln2"][i]), p["f_keys"][i], p["f_vals"][i])
    logits = _ref_pattention(_ref_rms(x, p["lnf"]), p["head_keys"], p["head_vals"])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab), labels.reshape(-1))
