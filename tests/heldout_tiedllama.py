"""A small Llama written as a user would, from the guides only: a model file the CLI loads.

Legend (tensor names end with their dims): b batch, s seq, k key_seq, d d_model,
n kv_heads, g group (query heads per key/value head), e d_head, t two, h half,
f d_ff, v vocab, l layer.

RMSNorm pre-norm blocks under ``md.repeat``, rotary embeddings (rotate-half form) on q and k,
grouped-query attention as named dims, a SwiGLU MLP, and an LM head TIED to the token
embedding (the logits are ``x . tok_emb``), trained on the next token's cross-entropy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 256
    d_model: int = 64
    kv_heads: int = 2
    group: int = 2
    d_head: int = 16
    d_ff: int = 128
    layers: int = 2
    seq: int = 32
    batch: int = 16
    theta: float = 10000.0

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=32, d_model=8, kv_heads=2, group=2, d_head=4, d_ff=12, layers=2, seq=8, batch=4)


def rope_tables(cfg: Config, s: md.Dim):
    """cos [seq, half] and the signed sin [seq, two, half] of each position's angles."""
    two, half = md.Dim("two", 2), md.Dim("half", cfg.d_head // 2)
    inv_freq_h = cfg.theta ** (-torch.arange(0, cfg.d_head, 2, dtype=torch.float64) / cfg.d_head)
    angles_sh = md.arange(s, torch.float32) * md.constant(inv_freq_h.float(), [half])
    sign_t = md.constant(torch.tensor([-1.0, 1.0]), [two])
    return md.cos(angles_sh), md.sin(angles_sh) * sign_t


def rotate(x, cos_sh, sin_sth):
    """Turn each (x1, x2) half pair of d_head by its position's angle."""
    lead = " ".join(x.shape.names[:-1])
    x_th = md.rearrange(x, f"{lead} (two half) -> {lead} two half", two=2)
    return md.reshape(x_th * cos_sh + md.roll(x_th, "two", 1) * sin_sth, x.shape)


def block(x_bsd, p, rope):
    z_bsd = md.rms_norm(x_bsd, "d_model", p["norm1"])
    q = rotate(md.einsum("batch seq d_model, d_model kv_heads group d_head -> batch seq kv_heads group d_head",
                         z_bsd, p["wq"]), *rope)
    k = rotate(md.einsum("batch seq d_model, d_model kv_heads d_head -> batch seq kv_heads d_head", z_bsd, p["wk"]),
               *rope)
    v = md.einsum("batch seq d_model, d_model kv_heads d_head -> batch seq kv_heads d_head", z_bsd, p["wv"])
    y = md.attention(q, md.rename(k, seq="key_seq"), md.rename(v, seq="key_seq"), "seq", "key_seq", "d_head",
                     causal=True)
    x_bsd = x_bsd + md.einsum("batch seq kv_heads group d_head, kv_heads group d_head d_model -> batch seq d_model",
                              y, p["wo"])
    z_bsd = md.rms_norm(x_bsd, "d_model", p["norm2"])
    u_bsf = md.silu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", z_bsd, p["w_gate"])) \
        * md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", z_bsd, p["w_up"])
    return x_bsd + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", u_bsf, p["w_down"])


def build(cfg: Config = Config()) -> md.Model:
    b, s, d = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("d_model", cfg.d_model)
    n, g, e = md.Dim("kv_heads", cfg.kv_heads), md.Dim("group", cfg.group), md.Dim("d_head", cfg.d_head)
    f, v, l = md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    with md.Graph("tiedllama") as graph:
        ids_bs = md.input("ids", [b, s], torch.int64)
        labels_bs = md.input("labels", [b, s], torch.int64)
        emb_vd = md.param("emb", [v, d], scale=0.02)
        stack = {
            "norm1": md.param("norm1", [l, d], init="ones"),
            "wq": md.param("wq", [l, d, n, g, e], fan_out=[l, n, g, e]),
            "wk": md.param("wk", [l, d, n, e], fan_out=[l, n, e]),
            "wv": md.param("wv", [l, d, n, e], fan_out=[l, n, e]),
            "wo": md.param("wo", [l, n, g, e, d], fan_out=[l, d]),
            "norm2": md.param("norm2", [l, d], init="ones"),
            "w_gate": md.param("w_gate", [l, d, f], fan_out=[l, f]),
            "w_up": md.param("w_up", [l, d, f], fan_out=[l, f]),
            "w_down": md.param("w_down", [l, f, d], fan_out=[l, d]),
        }
        norm_d = md.param("norm", [d], init="ones")
        rope = rope_tables(cfg, s)
        x_bsd = md.repeat(lambda x, p: block(x, p, rope), md.gather(emb_vd, ids_bs, "vocab"), stack, l)
        x_bsd = md.rms_norm(x_bsd, "d_model", norm_d)
        logits_bsv = md.einsum("batch seq d_model, vocab d_model -> batch seq vocab", x_bsd, emb_vd)  # tied
        loss = md.reduce_mean(md.cross_entropy(logits_bsv, labels_bs, "vocab"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=torch.Generator().manual_seed(seed))
        return {"ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}

    return md.Model(graph, loss, graph.params(), feeds, cfg, logits=logits_bsv)
