"""Held-out model (round 20a): MaskGIT-lite, a bidirectional transformer over VQ token ids.

Written from the docs alone. A fed boolean ``mask`` (each row's masked fraction drawn from
MaskGIT's cosine schedule) picks the positions whose embedding is replaced by a learned
[MASK] vector (``md.where``); the cross-entropy is averaged over the masked positions only
(a weighted mean by the mask). Blocks: pre-norm, non-causal fused attention, gelu MLP,
under ``md.repeat`` over ``layer``.

Legend: b batch, s seq, d d_model, h heads, e d_head, f d_ff, v vocab, l layer.
"""
import math
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 4
    seq: int = 16
    batch: int = 8
    remat: str | None = None

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=12, d_model=8, heads=2, d_head=4, d_ff=16, layers=2, seq=6, batch=4)


def _block(x_bsd, p):
    h = md.layer_norm(x_bsd, "d_model", p["ln1"], p["ln1_b"])
    q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wq"])
    k = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wk"])
    v = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wv"])
    k, v = md.rename(k, seq="key_seq"), md.rename(v, seq="key_seq")
    a = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=False)
    x_bsd = x_bsd + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", a, p["wo"])
    h = md.layer_norm(x_bsd, "d_model", p["ln2"], p["ln2_b"])
    f = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w_fc"]))
    return x_bsd + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", f, p["w_proj"])


def build(cfg: Config = Config()) -> md.Model:
    b, s, d = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("d_model", cfg.d_model)
    h, e, f = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    v, l = md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    with md.Graph("maskgit") as g:
        ids = md.input("ids", [b, s], dtype=torch.int64)
        mask = md.input("mask", [b, s], dtype=torch.bool)
        tok = md.param("tok_emb", [v, d], scale=0.5)
        mask_emb = md.param("mask_emb", [d], scale=0.5)
        pos = md.param("pos_emb", [s, d], scale=0.1)
        stacked = {
            "ln1": md.param("ln1", [l, d], init="ones"), "ln1_b": md.param("ln1_b", [l, d], init="zeros"),
            "wq": md.param("wq", [l, d, h, e], fan_out=["layer", "heads", "d_head"]),
            "wk": md.param("wk", [l, d, h, e], fan_out=["layer", "heads", "d_head"]),
            "wv": md.param("wv", [l, d, h, e], fan_out=["layer", "heads", "d_head"]),
            "wo": md.param("wo", [l, h, e, d], fan_out=["layer", "d_model"]),
            "ln2": md.param("ln2", [l, d], init="ones"), "ln2_b": md.param("ln2_b", [l, d], init="zeros"),
            "w_fc": md.param("w_fc", [l, d, f], fan_out=["layer", "d_ff"]),
            "w_proj": md.param("w_proj", [l, f, d], fan_out=["layer", "d_model"]),
        }
        x = md.where(mask, mask_emb, md.gather(tok, ids, "vocab")) + pos
        x = md.repeat(_block, x, stacked, "layer", remat=cfg.remat)
        x = md.layer_norm(x, "d_model", md.param("lnf", [d], init="ones"), md.param("lnf_b", [d], init="zeros"))
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", x, md.param("head", [d, v], fan_out=["vocab"]))
        logits = logits + md.param("head_b", [v], init="zeros")
        weight = md.cast(mask, torch.float32)
        ce = md.cross_entropy(logits, ids, "vocab")
        loss = md.reduce_sum(ce * weight) / md.reduce_sum(weight)
        acc = md.reduce_sum(md.cast(md.equal(md.argmax(logits, "vocab"), ids), torch.float32) * weight) / md.reduce_sum(weight)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        # VQ-ish tokens: a smooth code sequence per row, so the masked ones are predictable.
        start = torch.randint(0, cfg.vocab, (cfg.batch, 1), generator=gen)
        step = torch.randint(1, 3, (cfg.batch, 1), generator=gen)
        ids_ = (start + step * torch.arange(cfg.seq)) % cfg.vocab
        # MaskGIT's cosine schedule: r ~ U(0, 1), mask ceil(cos(pi/2 r) * seq) positions (at least 1).
        r = torch.rand(cfg.batch, generator=gen)
        n_mask = torch.clamp(torch.ceil(torch.cos(math.pi / 2 * r) * cfg.seq), min=1).long()
        order = torch.argsort(torch.rand(cfg.batch, cfg.seq, generator=gen), dim=1)
        rank = torch.argsort(order, dim=1)
        return {"ids": ids_, "mask": rank < n_mask[:, None]}

    return md.Model(g, loss, g.params(), feeds, cfg, metrics={"accuracy": acc})
