"""A BitNet b1.58-style language model, written from the README and docs/ alone (a held-out model).

Every projection inside the blocks is a ternary "BitLinear": its weight quantised per layer to
{-1, 0, 1} times ``mean|w|`` (``clamp(round(w / mean|w|), -1, 1)``), its input activation
quantised per token to 8 bits by its absmax (``round(x * 127 / max|x|)`` clamped to
``[-128, 127]``), each with a straight-through estimator ``w + stop_gradient(q - w)`` (the
forward sees ``q``, the backward the identity). Blocks: RMSNorm, causal multi-head attention, a
squared-ReLU MLP (BitNet b1.58's), under ``md.repeat``; embedding and LM head full precision; the
next-token cross entropy.

Legend: b batch, s seq, k key_seq, d d_model, n heads, e d_head, f d_ff, v vocab, l layer.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 256
    d_model: int = 128
    heads: int = 4
    d_head: int = 32
    d_ff: int = 384
    layers: int = 4
    seq: int = 64
    batch: int = 8
    eps: float = 1e-5
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=16, d_model=8, heads=2, d_head=4, d_ff=12, layers=2, seq=8, batch=4)


def ternary(w: md.Tensor, eps: float) -> md.Tensor:
    """``w`` quantised to ``{-1, 0, 1} * mean|w|`` in the forward, the identity in the backward."""
    scale = md.reduce_mean(md.abs(w)) + eps                   # one scale per weight (per layer)
    q = md.clamp(md.round(w / scale), -1.0, 1.0) * scale
    return w + md.stop_gradient(q - w)


def absmax8(x: md.Tensor, feature: str, eps: float) -> md.Tensor:
    """``x`` quantised per token to 8 bits by its absmax over ``feature``, straight-through."""
    s = 127.0 / md.clamp(md.reduce_max(md.abs(x), feature), min=eps)
    q = md.clamp(md.round(x * s), -128.0, 127.0) / s
    return x + md.stop_gradient(q - x)


def build(cfg: Config = Config()) -> md.Model:
    b, s, d = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("d_model", cfg.d_model)
    n, e, f = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    v, l = md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    with md.Graph("heldout_bitnet") as g:
        ids = md.input("ids", [b, s], torch.int64)
        labels = md.input("labels", [b, s], torch.int64)
        emb = md.param("emb", [v, d], scale=1.0)
        blocks = {
            "norm1": md.param("norm1", [l, d], init="ones"),
            "wq": md.param("wq", [l, d, n, e], fan_out=[l, n, e]),
            "wk": md.param("wk", [l, d, n, e], fan_out=[l, n, e]),
            "wv": md.param("wv", [l, d, n, e], fan_out=[l, n, e]),
            "wo": md.param("wo", [l, n, e, d], fan_out=[l, d]),
            "norm2": md.param("norm2", [l, d], init="ones"),
            "w_up": md.param("w_up", [l, d, f], fan_out=[l, f]),
            "w_down": md.param("w_down", [l, f, d], fan_out=[l, d]),
        }
        norm_f = md.param("norm_f", [d], init="ones")
        head = md.param("head", [d, v], fan_out=[v])

        def block(x, p):
            z = absmax8(md.rms_norm(x, "d_model", p["norm1"], cfg.eps), "d_model", cfg.eps)
            proj = "batch seq d_model, d_model heads d_head -> batch seq heads d_head"
            q = md.einsum(proj, z, ternary(p["wq"], cfg.eps))
            k = md.rename(md.einsum(proj, z, ternary(p["wk"], cfg.eps)), seq="key_seq")
            val = md.rename(md.einsum(proj, z, ternary(p["wv"], cfg.eps)), seq="key_seq")
            y = md.attention(q, k, val, "seq", "key_seq", "d_head", causal=True)
            y = absmax8(y, ("heads", "d_head"), cfg.eps)
            x = x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model",
                              y, ternary(p["wo"], cfg.eps))
            z = absmax8(md.rms_norm(x, "d_model", p["norm2"], cfg.eps), "d_model", cfg.eps)
            u = md.relu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", z, ternary(p["w_up"], cfg.eps)))
            u = absmax8(u * u, "d_ff", cfg.eps)
            return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", u, ternary(p["w_down"], cfg.eps))

        x = md.gather(emb, ids, "vocab")
        x = md.repeat(block, x, blocks, l, remat=cfg.remat)
        x = md.rms_norm(x, "d_model", norm_f, cfg.eps)
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", x, head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        t = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        return {"ids": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()}

    return md.Model(g, loss, {"emb": emb, **blocks, "norm_f": norm_f, "head": head}, feeds, cfg, logits=logits)
