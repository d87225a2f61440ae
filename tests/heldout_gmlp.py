"""Held-out model: gMLP (Liu et al. 2021) as a causal LM, written from the docs alone.

Each block: LayerNorm, a channel projection to ``2 * d_sgu`` with gelu, a spatial gating unit
(split the channels into u and v, normalise v, mix v over tokens with a learned
``[seq2, seq]`` weight under a causal mask plus a per-position bias, gate ``u * mix``), a
projection back, a residual. Blocks under ``md.repeat``; next-token loss. The token-mixing
weight meets the activations along ``seq``: a sequence split reads it along that dim.

``form``: ``slice`` (one projection to ``2 * d_sgu``, cut in two by ``md.slice_``) or
``separate`` (two projections, one for u, one for v).

Legend: b batch, s seq, s2 seq2 (the mixed output positions), d d_model, c d_sgu, v vocab.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    vocab: int = 256
    d_model: int = 128
    d_sgu: int = 256
    layers: int = 4
    seq: int = 64
    batch: int = 8
    remat: str | None = None
    form: str = "slice"

    @classmethod
    def tiny(cls):
        return cls(vocab=32, d_model=16, d_sgu=16, layers=2, seq=8, batch=4)


def _spatial_gate(u_bsc, v_bsc, p, causal):
    """u * (W_causal . LN(v) + b): v mixed over positions, then gating u."""
    v_bsc = md.layer_norm(v_bsc, "d_sgu", p["sgu_ln"], p["sgu_ln_b"])
    w = md.where(causal, p["w_sp"], 0.0)
    mix = md.einsum("seq2 seq, batch seq d_sgu -> batch seq2 d_sgu", w, v_bsc) + p["b_sp"]
    return u_bsc * md.rename(mix, seq2="seq")


def _block(x, p, causal, cfg):
    h = md.layer_norm(x, "d_model", p["ln"], p["ln_b"])
    if cfg.form == "slice":
        z = md.gelu(md.einsum("batch seq d_model, d_model d_in -> batch seq d_in", h, p["w_in"]))
        u = md.rename(md.slice_(z, "d_in", 0, cfg.d_sgu), d_in="d_sgu")
        v = md.rename(md.slice_(z, "d_in", cfg.d_sgu, 2 * cfg.d_sgu), d_in="d_sgu")
    else:
        u = md.gelu(md.einsum("batch seq d_model, d_model d_sgu -> batch seq d_sgu", h, p["w_u"]))
        v = md.gelu(md.einsum("batch seq d_model, d_model d_sgu -> batch seq d_sgu", h, p["w_v"]))
    g = _spatial_gate(u, v, p, causal)
    return x + md.einsum("batch seq d_sgu, d_sgu d_model -> batch seq d_model", g, p["w_out"])


def build(cfg: Config) -> md.Model:
    if cfg.form not in ("slice", "separate"):
        raise ValueError(f"form must be 'slice' or 'separate', got {cfg.form!r}")
    B, S, S2 = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("seq2", cfg.seq)
    V, D, C = md.Dim("vocab", cfg.vocab), md.Dim("d_model", cfg.d_model), md.Dim("d_sgu", cfg.d_sgu)
    L = md.Dim("layer", cfg.layers)
    with md.Graph() as g:
        ids, labels = md.input("ids", [B, S], torch.int64), md.input("labels", [B, S], torch.int64)
        params = {
            "wte": md.param("wte", [V, D], scale=0.5),
            "ln": md.param("ln", [L, D], init="ones"), "ln_b": md.param("ln_b", [L, D], init="zeros"),
            "sgu_ln": md.param("sgu_ln", [L, C], init="ones"), "sgu_ln_b": md.param("sgu_ln_b", [L, C], init="zeros"),
            # gMLP starts the spatial weight near zero and its bias at one: the gate starts as u
            "w_sp": md.param("w_sp", [L, S2, S], scale=0.05),
            "b_sp": md.param("b_sp", [L, S2], init="ones"),
            "w_out": md.param("w_out", [L, C, D], fan_out=["layer", "d_model"]),
            "lnf": md.param("lnf", [D], init="ones"),
            "lm_head": md.param("lm_head", [D, V], fan_out=["vocab"]),
        }
        if cfg.form == "slice":
            params["w_in"] = md.param("w_in", [L, D, md.Dim("d_in", 2 * cfg.d_sgu)], fan_out=["layer", "d_in"])
        else:
            params["w_u"] = md.param("w_u", [L, D, C], fan_out=["layer", "d_sgu"])
            params["w_v"] = md.param("w_v", [L, D, C], fan_out=["layer", "d_sgu"])
        causal = md.causal_mask(S2, S)
        x = md.gather(params["wte"], ids, "vocab")
        stacked = {n: t for n, t in params.items() if t.shape.names[0] == "layer"}
        x = md.repeat(lambda c, p: _block(c, p, causal, cfg), x, stacked, "layer", remat=cfg.remat)
        h = md.layer_norm(x, "d_model", params["lnf"])
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", h, params["lm_head"])
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def make_feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        toks = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": toks[:, :-1].contiguous(), "labels": toks[:, 1:].contiguous()}

    return md.Model(g, loss, params, make_feeds, cfg, logits=logits)
