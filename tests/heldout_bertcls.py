"""A held-out BERT-style sentence classifier, written from README.md and docs/ only (round 7c).

Legend: b batch, s seq (queries), k key_seq (keys), d d_model, h heads, e d_head, f d_ff,
v vocab, c classes, l layer.

    tokens_bs -> wte[tokens] + wpe[s] -> LN
      -> md.repeat over layers of a post-LN block: attention masked to the real keys
         (key k is real when k < lengths[b], the padding mask from the fed lengths),
         h = LN(h + attn(h)); h = LN(h + mlp(h))
      -> [CLS] (position 0) -> tanh pooler -> classes
      -> label-smoothed cross-entropy: (1 - eps) * CE + eps * mean over classes of -log p

Data (``batches``, one random stream per row): a row's length is in [2, seq]; position 0
is [CLS], tokens past the length are the pad id 0; the class is whether the row holds more
tokens of the upper half of the vocab than of the lower (ties go to class 0), so a model
that reads the padding as tokens learns a worse rule.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md

PAD, CLS = 0, 1


@dataclass(frozen=True)
class Config:
    batch: int = 16
    seq: int = 16
    vocab: int = 32
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 2
    classes: int = 2
    smoothing: float = 0.1

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=8, seq=8, vocab=16, d_model=8, heads=2, d_head=4, d_ff=16, layers=2)


def row(cfg: Config, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One example: its tokens, its length and its class."""
    n = int(torch.randint(2, cfg.seq + 1, (), generator=gen))
    tokens = torch.full((cfg.seq,), PAD, dtype=torch.int64)
    tokens[0] = CLS
    tokens[1:n] = torch.randint(2, cfg.vocab, (n - 1,), generator=gen)
    upper = int((tokens[1:n] >= (cfg.vocab + 2) // 2).sum())
    return {"tokens": tokens, "lengths": torch.tensor(n), "labels": torch.tensor(int(2 * upper > n - 1))}


def build(cfg: Config = Config()) -> md.Model:
    b, s, k = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("key_seq", cfg.seq)
    v, d, h = md.Dim("vocab", cfg.vocab), md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads)
    e, f, l = md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff), md.Dim("layer", cfg.layers)
    c, pool = md.Dim("classes", cfg.classes), md.Dim("d_pool", cfg.d_model)
    with md.Graph("heldout_bertcls") as g:
        tokens_bs = md.input("tokens", [b, s], dtype=torch.int64)
        lengths_b = md.input("lengths", [b], dtype=torch.int64)
        labels_b = md.input("labels", [b], dtype=torch.int64)
        p = {
            "wte": md.param("wte", [v, d], scale=0.5), "wpe": md.param("wpe", [s, d], scale=0.5),
            "ln_e": md.param("ln_e", [d], init="ones"), "ln_e_b": md.param("ln_e_b", [d], init="zeros"),
            "wq": md.param("wq", [l, d, h, e], fan_out=["layer", h, e]),
            "wk": md.param("wk", [l, d, h, e], fan_out=["layer", h, e]),
            "wv": md.param("wv", [l, d, h, e], fan_out=["layer", h, e]),
            "wo": md.param("wo", [l, h, e, d], fan_out=["layer", d]),
            "ln1": md.param("ln1", [l, d], init="ones"), "ln1_b": md.param("ln1_b", [l, d], init="zeros"),
            "w_in": md.param("w_in", [l, d, f], fan_out=["layer", f]), "b_in": md.param("b_in", [l, f], init="zeros"),
            "w_out": md.param("w_out", [l, f, d], fan_out=["layer", d]),
            "ln2": md.param("ln2", [l, d], init="ones"), "ln2_b": md.param("ln2_b", [l, d], init="zeros"),
            "w_pool": md.param("w_pool", [d, pool], fan_out=[pool]),
            "w_cls": md.param("w_cls", [pool, c], fan_out=[c]),
        }
        x_bsd = md.layer_norm(md.gather(p["wte"], tokens_bs, "vocab") + p["wpe"], "d_model", p["ln_e"], p["ln_e_b"])
        key_is_real = md.less(md.arange(k), lengths_b)           # [key_seq, batch]

        def block(x, w):
            q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", x, w["wq"])
            xk = md.rename(x, {"seq": "key_seq"})
            kk = md.einsum("batch key_seq d_model, d_model heads d_head -> batch key_seq heads d_head", xk, w["wk"])
            vv = md.einsum("batch key_seq d_model, d_model heads d_head -> batch key_seq heads d_head", xk, w["wv"])
            sc = md.einsum("batch seq heads d_head, batch key_seq heads d_head -> batch heads seq key_seq", q, kk)
            att = md.softmax(md.where(key_is_real, sc * cfg.d_head ** -0.5, -1e9), "key_seq")
            o = md.einsum("batch heads seq key_seq, batch key_seq heads d_head -> batch seq heads d_head", att, vv)
            a = md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, w["wo"])
            x = md.layer_norm(x + a, "d_model", w["ln1"], w["ln1_b"])
            u = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", x, w["w_in"]) + w["b_in"])
            m = md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", u, w["w_out"])
            return md.layer_norm(x + m, "d_model", w["ln2"], w["ln2_b"])

        stacked = {n: p[n] for n in ("wq", "wk", "wv", "wo", "ln1", "ln1_b", "w_in", "b_in", "w_out", "ln2", "ln2_b")}
        x_bsd = md.repeat(block, x_bsd, stacked, "layer")
        cls_bd = md.squeeze(md.slice_(x_bsd, "seq", 0, 1), "seq")
        pooled = md.tanh(md.einsum("batch d_model, d_model d_pool -> batch d_pool", cls_bd, p["w_pool"]))
        logits_bc = md.einsum("batch d_pool, d_pool classes -> batch classes", pooled, p["w_cls"])
        ce_b = md.cross_entropy(logits_bc, labels_b, "classes")
        uniform_b = -md.reduce_mean(md.log_softmax(logits_bc, "classes"), "classes")
        loss = md.reduce_mean((1 - cfg.smoothing) * ce_b + cfg.smoothing * uniform_b)
        correct = md.greater_equal(md.reduce_sum(logits_bc * md.one_hot(labels_b, c), "classes"),
                                   md.reduce_max(logits_bc, "classes"))
        accuracy = md.reduce_mean(md.cast(correct, torch.float32))

    def batches(seed: int, rows: slice | None = None) -> dict[str, torch.Tensor]:
        drawn = [row(cfg, md.row_generator(seed, r)) for r in range(cfg.batch)[rows or slice(None)]]
        if not drawn:
            return {k: t[None][:0] for k, t in row(cfg, md.row_generator(seed, 0)).items()}
        return {k: torch.stack([x[k] for x in drawn]) for k in drawn[0]}

    return md.Model(g, loss, p, batches=batches, config=cfg, metrics={"accuracy": accuracy})
