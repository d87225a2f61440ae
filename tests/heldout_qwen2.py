"""A Qwen2-style decoder written from the README and docs/ alone (a held-out model).

Biases on the q, k and v projections (none on the output projection or the MLP), grouped-query
attention written with the query heads as ``[kv_heads, group]`` in the weights themselves (so
``kv_heads:model`` splits q, k, v and their biases alike with no rearrange), rotary embeddings
(rotate-half form) with theta 1e6 computed in the graph, RMSNorm pre-norm blocks, a SwiGLU MLP,
the input embedding tied to the output head, blocks under ``md.repeat``.

Legend: b batch, s seq, t key_seq, d d_model, k kv_heads, g group, e d_head, f d_ff.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    d_model: int = 32
    kv_heads: int = 2
    group: int = 2
    d_head: int = 8
    d_ff: int = 48
    layers: int = 2
    seq: int = 16
    batch: int = 4
    rope_theta: float = 1e6
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=32, d_model=16, kv_heads=2, group=2, d_head=4, d_ff=24, layers=2, seq=8, batch=4)


def rotary(x: md.Tensor, cos: md.Tensor, sin: md.Tensor, d_head: int) -> md.Tensor:
    """Rotate-half rotary embedding: the pairs (i, i + d_head/2) turn by the angle of i."""
    half = d_head // 2
    x1, x2 = md.slice_(x, "d_head", 0, half), md.slice_(x, "d_head", half, d_head)
    return md.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], "d_head")


def build(cfg: Config = Config()) -> md.Model:
    b, s = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq)
    d, k, g = md.Dim("d_model", cfg.d_model), md.Dim("kv_heads", cfg.kv_heads), md.Dim("group", cfg.group)
    e, f, v, L = md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    half = cfg.d_head // 2
    with md.Graph("heldout_qwen2") as graph:
        ids = md.input("ids", [b, s], dtype=torch.int64)
        labels = md.input("labels", [b, s], dtype=torch.int64)
        wte = md.param("wte", [v, d], scale=0.5)
        p = {
            "ln1": md.param("ln1", [L, d], init="ones"),
            "wq": md.param("wq", [L, d, k, g, e], fan_out=["layer", "kv_heads", "group", "d_head"]),
            "bq": md.param("bq", [L, k, g, e], scale=0.1),
            "wk": md.param("wk", [L, d, k, e], fan_out=["layer", "kv_heads", "d_head"]),
            "bk": md.param("bk", [L, k, e], scale=0.1),
            "wv": md.param("wv", [L, d, k, e], fan_out=["layer", "kv_heads", "d_head"]),
            "bv": md.param("bv", [L, k, e], scale=0.1),
            "wo": md.param("wo", [L, k, g, e, d], fan_out=["layer", "d_model"]),
            "ln2": md.param("ln2", [L, d], init="ones"),
            "w_gate": md.param("w_gate", [L, d, f], fan_out=["layer", "d_ff"]),
            "w_up": md.param("w_up", [L, d, f], fan_out=["layer", "d_ff"]),
            "w_down": md.param("w_down", [L, f, d], fan_out=["layer", "d_model"]),
        }
        norm_f = md.param("norm_f", [d], init="ones")

        inv_freq = md.constant(cfg.rope_theta ** (-torch.arange(half, dtype=torch.float32) / half),
                               [md.Dim("d_head", half)])
        angles = md.cast(md.arange(s), torch.float32) * inv_freq                     # [seq, d_head/2]
        cos, sin = md.cos(angles), md.sin(angles)
        cos_k, sin_k = md.rename(cos, seq="key_seq"), md.rename(sin, seq="key_seq")

        def block(x, p):
            h = md.rms_norm(x, "d_model", p["ln1"])
            q = md.einsum("batch seq d_model, d_model kv_heads group d_head -> batch seq kv_heads group d_head",
                          h, p["wq"]) + p["bq"]
            kk = md.einsum("batch seq d_model, d_model kv_heads d_head -> batch seq kv_heads d_head", h, p["wk"]) + p["bk"]
            vv = md.einsum("batch seq d_model, d_model kv_heads d_head -> batch seq kv_heads d_head", h, p["wv"]) + p["bv"]
            q = rotary(q, cos, sin, cfg.d_head)
            kk = rotary(md.rename(kk, seq="key_seq"), cos_k, sin_k, cfg.d_head)
            o = md.attention(q, kk, md.rename(vv, seq="key_seq"), "seq", "key_seq", "d_head", causal=True)
            x = x + md.einsum("batch seq kv_heads group d_head, kv_heads group d_head d_model -> batch seq d_model",
                              o, p["wo"])
            h = md.rms_norm(x, "d_model", p["ln2"])
            gate = md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w_gate"])
            up = md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w_up"])
            return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", md.silu(gate) * up, p["w_down"])

        x = md.repeat(block, md.gather(wte, ids, "vocab"), p, "layer", remat=cfg.remat)
        logits = md.einsum("batch seq d_model, vocab d_model -> batch seq vocab",
                           md.rms_norm(x, "d_model", norm_f), wte)                      # tied head
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        toks = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=torch.Generator().manual_seed(seed))
        return {"ids": toks[:, :-1], "labels": toks[:, 1:]}

    return md.Model(graph, loss, {"wte": wte, **p, "norm_f": norm_f}, feeds, cfg, logits=logits)
