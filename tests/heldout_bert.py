"""A held-out BERT-style encoder, written from README.md and docs/ only.

Legend: b batch, s seq (queries), k key_seq (keys), d d_model, h heads, e d_head, f d_ff,
v vocab, t types, c classes.

    tokens_bs -> wte + wtt[types_bs] + wpe[s] -> layer norm (post-LN BERT)
      -> md.repeat over layers of a post-LN block:
           attention with the padding mask (key k is real when k < lengths[b]),
           h = LN(h + attn(h));  h = LN(h + mlp(h))
      -> MLM logits at every position, cross-entropy averaged over the masked positions
         only (mlm_weights_bs is 1 at a masked position, else 0)
      -> [CLS] (position 0) -> tanh pooler -> classes, cross-entropy
    loss = mlm loss + cls loss

Data (``batches``, one random stream per row): a row has a length in [2, seq]; tokens
past it are the pad id 0; about a quarter of the real positions after [CLS] are masked
(replaced by the mask id 1, with the original token as the MLM label); the class is
the parity of the number of tokens of id 2 in the row (over ``classes``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md

PAD, MASK, CLS = 0, 1, 2


@dataclass(frozen=True)
class Config:
    batch: int = 16
    seq: int = 16
    vocab: int = 32
    types: int = 2
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 2
    classes: int = 2
    mlm_norm: str = "batch"   # "batch": divide by the masked count summed in the graph; "input": fed


    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=6, seq=8, vocab=16, d_model=8, heads=2, d_head=4, d_ff=16, layers=2)


def row(cfg: Config, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One example: its tokens, types, length, MLM labels and weights, and class."""
    n = int(torch.randint(2, cfg.seq + 1, (), generator=gen))
    tokens = torch.full((cfg.seq,), PAD, dtype=torch.int64)
    tokens[0] = CLS
    tokens[1:n] = torch.randint(2, cfg.vocab, (n - 1,), generator=gen)
    types = torch.zeros(cfg.seq, dtype=torch.int64)
    types[n // 2:n] = 1
    label = int((tokens[1:n] == 2).sum()) % cfg.classes
    masked = torch.zeros(cfg.seq)
    masked[1:n] = (torch.rand(n - 1, generator=gen) < 0.25).float()
    masked[1 + int(torch.randint(n - 1, (), generator=gen))] = 1.0  # at least one per row
    mlm_labels = tokens.clone()
    tokens = torch.where(masked > 0, torch.full_like(tokens, MASK), tokens)
    return {"tokens": tokens, "types": types, "lengths": torch.tensor(n), "mlm_labels": mlm_labels,
            "mlm_weights": masked, "cls_labels": torch.tensor(label)}


def build(cfg: Config = Config()) -> md.Model:
    batch, seq, key_seq = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("key_seq", cfg.seq)
    vocab, types, d_model = md.Dim("vocab", cfg.vocab), md.Dim("types", cfg.types), md.Dim("d_model", cfg.d_model)
    heads, d_head, d_ff = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    layer, classes, d_pool = md.Dim("layer", cfg.layers), md.Dim("classes", cfg.classes), md.Dim("d_pool", cfg.d_model)
    with md.Graph("heldout_bert") as g:
        tokens = md.input("tokens", [batch, seq], dtype=torch.int64)
        type_ids = md.input("types", [batch, seq], dtype=torch.int64)
        lengths = md.input("lengths", [batch], dtype=torch.int64)
        mlm_labels = md.input("mlm_labels", [batch, seq], dtype=torch.int64)
        mlm_weights = md.input("mlm_weights", [batch, seq])
        cls_labels = md.input("cls_labels", [batch], dtype=torch.int64)

        params = {
            "wte": md.param("wte", [vocab, d_model], scale=0.5),
            "wtt": md.param("wtt", [types, d_model], scale=0.5),
            "wpe": md.param("wpe", [seq, d_model], scale=0.5),
            "ln_e": md.param("ln_e", [d_model], init="ones"),
            "ln_e_b": md.param("ln_e_b", [d_model], init="zeros"),
            "wq": md.param("wq", [layer, d_model, heads, d_head], fan_out=[heads, d_head]),
            "wk": md.param("wk", [layer, d_model, heads, d_head], fan_out=[heads, d_head]),
            "wv": md.param("wv", [layer, d_model, heads, d_head], fan_out=[heads, d_head]),
            "wo": md.param("wo", [layer, heads, d_head, d_model], fan_out=[d_model]),
            "ln1": md.param("ln1", [layer, d_model], init="ones"),
            "ln1_b": md.param("ln1_b", [layer, d_model], init="zeros"),
            "w_in": md.param("w_in", [layer, d_model, d_ff], fan_out=[d_ff]),
            "b_in": md.param("b_in", [layer, d_ff], init="zeros"),
            "w_out": md.param("w_out", [layer, d_ff, d_model], fan_out=[d_model]),
            "ln2": md.param("ln2", [layer, d_model], init="ones"),
            "ln2_b": md.param("ln2_b", [layer, d_model], init="zeros"),
            "w_mlm": md.param("w_mlm", [d_model, vocab], fan_out=[vocab]),
            "w_pool": md.param("w_pool", [d_model, d_pool], fan_out=[d_pool]),
            "w_cls": md.param("w_cls", [d_pool, classes], fan_out=[classes]),
        }
        p = params
        x = md.gather(p["wte"], tokens, "vocab") + md.gather(p["wtt"], type_ids, "types") + p["wpe"]
        x = md.layer_norm(x, "d_model", p["ln_e"], p["ln_e_b"])
        key_is_real = md.less(md.arange(key_seq), lengths)          # [key_seq, batch]

        def block(h, w):
            q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, w["wq"])
            hk = md.rename(h, {"seq": "key_seq"})
            k = md.einsum("batch key_seq d_model, d_model heads d_head -> batch key_seq heads d_head", hk, w["wk"])
            v = md.einsum("batch key_seq d_model, d_model heads d_head -> batch key_seq heads d_head", hk, w["wv"])
            s = md.einsum("batch seq heads d_head, batch key_seq heads d_head -> batch heads seq key_seq", q, k)
            att = md.softmax(md.where(key_is_real, s * cfg.d_head ** -0.5, -1e9), "key_seq")
            o = md.einsum("batch heads seq key_seq, batch key_seq heads d_head -> batch seq heads d_head", att, v)
            a = md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, w["wo"])
            h = md.layer_norm(h + a, "d_model", w["ln1"], w["ln1_b"])
            f = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, w["w_in"]) + w["b_in"])
            m = md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", f, w["w_out"])
            return md.layer_norm(h + m, "d_model", w["ln2"], w["ln2_b"])

        stacked = {n: p[n] for n in ("wq", "wk", "wv", "wo", "ln1", "ln1_b", "w_in", "b_in", "w_out", "ln2", "ln2_b")}
        h = md.repeat(block, x, stacked, "layer")

        mlm_logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", h, p["w_mlm"])
        mlm_ce = md.cross_entropy(mlm_logits, mlm_labels, "vocab")   # [batch, seq]
        if cfg.mlm_norm == "input":   # the count fed, the same for every micro-batch: pipelines take it
            count = md.input("mlm_count", [])
        else:                         # summed over the whole batch in the graph
            count = md.reduce_sum(mlm_weights)
        mlm_loss = md.reduce_sum(mlm_ce * mlm_weights) / count

        cls_h = md.squeeze(md.slice_(h, "seq", 0, 1), "seq")            # [batch, d_model]
        pooled = md.tanh(md.einsum("batch d_model, d_model d_pool -> batch d_pool", cls_h, p["w_pool"]))
        cls_logits = md.einsum("batch d_pool, d_pool classes -> batch classes", pooled, p["w_cls"])
        cls_loss = md.reduce_mean(md.cross_entropy(cls_logits, cls_labels, "classes"))
        loss = mlm_loss + cls_loss
        correct = md.greater_equal(md.reduce_sum(cls_logits * md.one_hot(cls_labels, classes), "classes"),
                                   md.reduce_max(cls_logits, "classes"))
        accuracy = md.reduce_mean(md.cast(correct, torch.float32))

    def batches(seed: int, rows: slice | None = None) -> dict[str, torch.Tensor]:
        drawn = [row(cfg, md.row_generator(seed, r)) for r in range(cfg.batch)[rows or slice(None)]]
        if not drawn:
            empty = row(cfg, md.row_generator(seed, 0))
            out = {k: v[None][:0] for k, v in empty.items()}
        else:
            out = {k: torch.stack([d[k] for d in drawn]) for k in drawn[0]}
        if cfg.mlm_norm == "input":   # every row's mask: the count is the whole batch's
            out["mlm_count"] = sum(row(cfg, md.row_generator(seed, r))["mlm_weights"].sum()
                                   for r in range(cfg.batch)).reshape(())
        return out

    return md.Model(g, loss, params, batches=batches, config=cfg,
                    outputs={"mlm_loss": mlm_loss, "cls_loss": cls_loss}, metrics={"accuracy": accuracy})
