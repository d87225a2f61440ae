"""Held-out model: nGPT, the normalized transformer (h17a).

Every hidden vector lives on the unit sphere: after each block h = norm(h + alpha * (norm(block(h)) - h))
with a learned per-dim step alpha (an "eigen learning rate", stored scaled as nGPT does). Weight
matrices are normalised in the graph along d_model (the embedding dim) at every use; q and k are
normalised per head and scaled by a learned s_qk, so attention uses scale sqrt(d_head); the MLP's
u and v are scaled by s_u and s_v * sqrt(d_model); logits are scaled by a learned s_z. No norm layers.
RoPE: cos/sin of arange(seq) x a constant table of inverse frequencies, halves rotated by slice_/concat.
Config.form: ``fused`` (md.attention) or ``composite`` (einsum + causal mask + softmax).

Legend: b batch, s seq, k key_seq, d d_model, h heads, e d_head, f d_ff.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    vocab: int = 64
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 4
    seq: int = 16
    batch: int = 4
    form: str = "fused"
    remat: str | None = None

    @classmethod
    def tiny(cls):
        return cls(vocab=16, d_model=16, heads=2, d_head=4, d_ff=24, layers=2, seq=8, batch=2)


def _norm(x, dim):
    return x * md.rsqrt(md.reduce_sum(x * x, dim) + 1e-8)


def _rope(x, cos, sin, half):
    x1, x2 = md.slice_(x, "d_head", 0, half), md.slice_(x, "d_head", half, 2 * half)
    return md.concat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], "d_head")


def _attend(q, k, v, cfg, seq, key):
    if cfg.form == "fused":
        return md.attention(q, k, v, "seq", "key_seq", "d_head", causal=True, scale=cfg.d_head ** 0.5)
    scores = md.einsum("batch seq heads d_head, batch key_seq heads d_head -> batch heads seq key_seq", q, k)
    att = md.softmax(md.where(md.causal_mask(seq, key), scores * cfg.d_head ** 0.5, -1e9), "key_seq")
    return md.einsum("batch heads seq key_seq, batch key_seq heads d_head -> batch seq heads d_head", att, v)


def build(cfg: Config) -> md.Model:
    if cfg.form not in ("fused", "composite") or cfg.d_head % 2:
        raise ValueError(f"form must be 'fused' or 'composite' and d_head even, got {cfg.form!r}, {cfg.d_head}")
    B, S, D, V = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("d_model", cfg.d_model), md.Dim("vocab", cfg.vocab)
    H, E, F, L = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff), md.Dim("layer", cfg.layers)
    half = cfg.d_head // 2
    a_init, a_scale = 0.05, cfg.d_model ** -0.5          # nGPT: alpha = alpha_param * (a_init / a_scale)
    with md.Graph() as g:
        ids, labels = md.input("ids", [B, S], torch.int64), md.input("labels", [B, S], torch.int64)
        params = {
            "wte": md.param("wte", [V, D], scale=1.0),
            "wq": md.param("wq", [L, D, H, E], fan_out=["layer", "heads", "d_head"]),
            "wk": md.param("wk", [L, D, H, E], fan_out=["layer", "heads", "d_head"]),
            "wv": md.param("wv", [L, D, H, E], fan_out=["layer", "heads", "d_head"]),
            "wo": md.param("wo", [L, H, E, D], fan_out=["layer", "d_model"]),
            "w_u": md.param("w_u", [L, D, F], fan_out=["layer", "d_ff"]),
            "w_v": md.param("w_v", [L, D, F], fan_out=["layer", "d_ff"]),
            "w_o": md.param("w_o", [L, F, D], fan_out=["layer", "d_model"]),
            "s_qk": md.param("s_qk", [L, H, E], init="ones"),
            "s_u": md.param("s_u", [L, F], init="ones"), "s_v": md.param("s_v", [L, F], init="ones"),
            "alpha_a": md.param("alpha_a", [L, D], init=a_scale), "alpha_m": md.param("alpha_m", [L, D], init=a_scale),
            "head": md.param("head", [V, D], scale=1.0),
            "s_z": md.param("s_z", [V], init=1.0),
        }
        inv_freq = md.constant(1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half)), [md.Dim("d_head", half)])
        angle = md.arange(S, torch.float32) * inv_freq                            # [seq, d_head:half]
        cos, sin = md.cos(angle), md.sin(angle)
        key = md.Dim("key_seq", cfg.seq)

        def block(h, p):
            q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, _norm(p["wq"], "d_model"))
            k = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, _norm(p["wk"], "d_model"))
            v = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, _norm(p["wv"], "d_model"))
            q = _norm(_rope(q, cos, sin, half), "d_head") * p["s_qk"]
            k = md.rename(_norm(_rope(k, cos, sin, half), "d_head") * p["s_qk"], seq="key_seq")
            y = _attend(q, k, md.rename(v, seq="key_seq"), cfg, S, key)
            att = md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", y, _norm(p["wo"], "d_model"))
            h = _norm(h + p["alpha_a"] * (a_init / a_scale) * (_norm(att, "d_model") - h), "d_model")
            u = md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, _norm(p["w_u"], "d_model")) * p["s_u"]
            gate = md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, _norm(p["w_v"], "d_model"))
            m = md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model",
                          u * md.silu(gate * p["s_v"] * cfg.d_model ** 0.5), _norm(p["w_o"], "d_model"))
            return _norm(h + p["alpha_m"] * (a_init / a_scale) * (_norm(m, "d_model") - h), "d_model")

        stacked = {n: params[n] for n in ("wq", "wk", "wv", "wo", "w_u", "w_v", "w_o", "s_qk", "s_u", "s_v",
                                          "alpha_a", "alpha_m")}
        x = md.gather(_norm(params["wte"], "d_model"), ids, "vocab")
        x = md.repeat(block, x, stacked, "layer", remat=cfg.remat)
        logits = md.einsum("batch seq d_model, vocab d_model -> batch seq vocab", x,
                           _norm(params["head"], "d_model")) * params["s_z"]
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def make_feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}

    return md.Model(g, loss, params, make_feeds, cfg, logits=logits)
