"""A DeepFM click-through-rate model, written from the README and docs/ alone (a held-out model).

Each example has one categorical id per field (``ids [batch, field]``, each id local to its
field: ``[0, field_rows)``). All fields share one embedding table ``[vocab, k]`` of ``field *
field_rows`` rows: a field's rows start at its offset (a constant ``[field]``), added to the ids
before ``md.gather``; a first-order weight per row comes from a second table ``[vocab]`` by the
same ids. The FM term is the pairwise dot products of the fields' embeddings,
``((sum_f v)^2 - sum_f v^2) / 2`` summed over ``k``; the deep part is an MLP over the fields'
embeddings flattened to ``(field k)`` by ``md.rearrange``. The logit is bias + first order +
FM + deep; the loss is the mean binary cross-entropy written from softplus,
``softplus(z) - y * z`` (= ``-y log sigmoid(z) - (1 - y) log sigmoid(-z)``).

Legend: batch; field; vocab (every field's rows); k (embedding); field_k (flattened); h1, h2
(MLP widths).
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 256
    fields: int = 16
    field_rows: int = 1000
    k: int = 16
    h1: int = 256
    h2: int = 128

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=8, fields=6, field_rows=5, k=4, h1=12, h2=8)


def build(cfg: Config = Config()) -> md.Model:
    batch, field = md.Dim("batch", cfg.batch), md.Dim("field", cfg.fields)
    vocab, k = md.Dim("vocab", cfg.fields * cfg.field_rows), md.Dim("k", cfg.k)
    fk, h1, h2 = md.Dim("field_k", cfg.fields * cfg.k), md.Dim("h1", cfg.h1), md.Dim("h2", cfg.h2)
    with md.Graph("heldout_deepfm") as g:
        ids = md.input("ids", [batch, field], dtype=torch.int64)
        click = md.input("click", [batch])
        p = {"emb": md.param("emb", [vocab, k], scale=0.5),
             "first": md.param("first", [vocab], scale=0.1),
             "bias": md.param("bias", [], init="zeros"),
             "w1": md.param("w1", [fk, h1], fan_out=["h1"]),
             "b1": md.param("b1", [h1], init="zeros"),
             "w2": md.param("w2", [h1, h2], fan_out=["h2"]),
             "b2": md.param("b2", [h2], init="zeros"),
             "w3": md.param("w3", [h2])}
        offsets = md.constant(torch.arange(cfg.fields) * cfg.field_rows, [field])
        rows = ids + offsets                                             # [batch, field], global rows
        v = md.gather(p["emb"], rows, "vocab")                           # [batch, field, k]
        first = md.reduce_sum(md.gather(p["first"], rows, "vocab"), "field")      # [batch]
        s = md.reduce_sum(v, "field")                                    # [batch, k]
        fm = 0.5 * md.reduce_sum(s * s - md.reduce_sum(v * v, "field"), "k")    # [batch]
        flat = md.rearrange(v, "batch field k -> batch (field k)")      # [batch, field_k]
        a = md.relu(md.einsum("batch field_k, field_k h1 -> batch h1", flat, p["w1"]) + p["b1"])
        a = md.relu(md.einsum("batch h1, h1 h2 -> batch h2", a, p["w2"]) + p["b2"])
        deep = md.einsum("batch h2, h2 -> batch", a, p["w3"])
        z = p["bias"] + first + fm + deep                                # [batch]
        loss = md.reduce_mean(md.softplus(z) - click * z)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, cfg.field_rows, (cfg.batch, cfg.fields), generator=gen)
        # clicks that depend on the ids (fields 0 and 1 agree), so there is something to learn
        click = ((ids[:, 0] + ids[:, 1]) % 2 == 0).float()
        return {"ids": ids, "click": click}

    return md.Model(g, loss, p, feeds, cfg)
