"""Medusa, written from the README and docs/ alone (a held-out model).

A small GPT backbone (embedding, learned positions, pre-norm blocks under ``md.repeat``, RMSNorm)
and its LM head predicting token t+1, plus ``heads`` Medusa heads: head k (k = 1..K) predicts
token t+k+1 from the backbone's last hidden state through a residual MLP, ``h + silu(h W_k)``,
and the same (shared) unembedding. The K heads' weights are one param with a ``mhead`` dim;
each head's logits are sliced out (``slice_`` + ``squeeze``) for its own shifted labels. The
labels are cut in the graph from one token stream ``[batch, pos: seq + K + 1]``: the ids are
``pos`` 0..seq-1, head k's labels ``pos`` k+1..k+seq. The loss: the LM loss plus
``sum_k decay**k * CE_k``.

Legend: b batch, s seq, k key_seq, d d_model, n heads, e d_head, f d_ff, v vocab, l layer,
m mhead (Medusa heads), c d_hid (a Medusa head's width = d_model), p pos (the token stream).
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
    d_ff: int = 512
    layers: int = 4
    seq: int = 64
    batch: int = 8
    medusa: int = 3
    decay: float = 0.8
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=16, d_model=8, heads=2, d_head=4, d_ff=16, layers=2, seq=8, batch=4, medusa=3)


def build(cfg: Config = Config()) -> md.Model:
    K = cfg.medusa
    b, s, d = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("d_model", cfg.d_model)
    n, e, f = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    v, l, m = md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers), md.Dim("mhead", K)
    c, pos = md.Dim("d_hid", cfg.d_model), md.Dim("pos", cfg.seq + K + 1)
    with md.Graph("heldout_medusa") as g:
        tokens = md.input("tokens", [b, pos], torch.int64)
        p = {"wte": md.param("wte", [v, d], scale=0.5),
             "wpe": md.param("wpe", [s, d], scale=0.5),
             "norm_f": md.param("norm_f", [d], init="ones"),
             "unembed": md.param("unembed", [d, v], fan_out=[v]),
             "medusa": md.param("medusa", [m, d, c], fan_out=[m, c])}
        blocks = {
            "norm1": md.param("norm1", [l, d], init="ones"),
            "wq": md.param("wq", [l, d, n, e], fan_out=[l, n, e]),
            "wk": md.param("wk", [l, d, n, e], fan_out=[l, n, e]),
            "wv": md.param("wv", [l, d, n, e], fan_out=[l, n, e]),
            "wo": md.param("wo", [l, n, e, d], fan_out=[l, d]),
            "norm2": md.param("norm2", [l, d], init="ones"),
            "w_fc": md.param("w_fc", [l, d, f], fan_out=[l, f]),
            "w_proj": md.param("w_proj", [l, f, d], fan_out=[l, d]),
        }

        def block(x, q):
            z = md.rms_norm(x, "d_model", q["norm1"])
            proj = "batch seq d_model, d_model heads d_head -> batch seq heads d_head"
            qq = md.einsum(proj, z, q["wq"])
            kk = md.rename(md.einsum(proj, z, q["wk"]), seq="key_seq")
            vv = md.rename(md.einsum(proj, z, q["wv"]), seq="key_seq")
            y = md.attention(qq, kk, vv, "seq", "key_seq", "d_head", causal=True)
            x = x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", y, q["wo"])
            z = md.rms_norm(x, "d_model", q["norm2"])
            u = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", z, q["w_fc"]))
            return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", u, q["w_proj"])

        def labels(shift: int) -> md.Tensor:
            return md.rename(md.slice_(tokens, "pos", shift, shift + cfg.seq), pos="seq")

        x = md.gather(p["wte"], labels(0), "vocab") + p["wpe"]
        x = md.repeat(block, x, blocks, l, remat=cfg.remat)
        h = md.rms_norm(x, "d_model", p["norm_f"])                                   # [batch, seq, d_model]
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", h, p["unembed"])
        loss = md.reduce_mean(md.cross_entropy(logits, labels(1), "vocab"))
        hid = md.silu(md.einsum("batch seq d_model, mhead d_model d_hid -> batch seq mhead d_hid", h, p["medusa"]))
        hm = h + md.rename(hid, d_hid="d_model")                                     # [batch, seq, mhead, d_model]
        mlogits = md.einsum("batch seq mhead d_model, d_model vocab -> batch seq mhead vocab", hm, p["unembed"])
        for k in range(1, K + 1):
            lk = md.squeeze(md.slice_(mlogits, "mhead", k - 1, k), "mhead")
            loss = loss + cfg.decay ** k * md.reduce_mean(md.cross_entropy(lk, labels(k + 1), "vocab"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        # a stream with structure the heads can learn: each token the previous plus a small step
        gen = torch.Generator().manual_seed(seed)
        steps = torch.randint(1, 3, (cfg.batch, cfg.seq + K + 1), generator=gen)
        return {"tokens": torch.cumsum(steps, 1) % cfg.vocab}

    return md.Model(g, loss, {**p, **blocks}, feeds, cfg, logits=logits)
