"""DCN-v2 (a deep & cross network), written from the README and docs/ alone (a held-out model).

The input row ``x0 [batch, d]`` joins the categorical fields' embeddings (one table, field
offsets, ``md.gather``, flattened to ``(field k)``) and the dense features, by ``md.concat``
along ``d`` after renaming both to it. Cross layers ``x_{l+1} = x0 * (W_l x_l + b_l) + x_l``
run in a ``md.repeat`` over ``layer`` (full-rank ``W_l [d, d2]``), each layer reading ``x0``
from outside the repeat. Then an MLP to one logit and the mean binary cross-entropy written as
``-y log sigmoid(z) - (1 - y) log sigmoid(-z)`` with ``log sigmoid(z) = -softplus(-z)``.

Legend: batch; field; vocab; k; dense (dense features); d (x0's width); d2 (the cross layer's
output before it is renamed back to d); layer; h (MLP width).
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 256
    fields: int = 8
    field_rows: int = 100
    k: int = 8
    dense: int = 13
    layers: int = 3
    hidden: int = 128
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=8, fields=3, field_rows=5, k=4, dense=4, layers=2, hidden=6)


def build(cfg: Config = Config()) -> md.Model:
    batch, field, k = md.Dim("batch", cfg.batch), md.Dim("field", cfg.fields), md.Dim("k", cfg.k)
    vocab, dense = md.Dim("vocab", cfg.fields * cfg.field_rows), md.Dim("dense", cfg.dense)
    width = cfg.fields * cfg.k + cfg.dense
    d, d2, layer, h = md.Dim("d", width), md.Dim("d2", width), md.Dim("layer", cfg.layers), md.Dim("h", cfg.hidden)
    with md.Graph("heldout_dcnv2") as g:
        ids = md.input("ids", [batch, field], dtype=torch.int64)
        xd = md.input("xd", [batch, dense])
        label = md.input("label", [batch])
        p = {"emb": md.param("emb", [vocab, k], scale=0.5),
             "w_up": md.param("w_up", [d, h], fan_out=["h"]),
             "b_up": md.param("b_up", [h], init="zeros"),
             "w_out": md.param("w_out", [h]),
             "b_out": md.param("b_out", [], init="zeros")}
        cross = {"w": md.param("w", [layer, d, d2], fan_out=["layer", "d2"]),
                 "b": md.param("b", [layer, d2], init="zeros")}
        offsets = md.constant(torch.arange(cfg.fields) * cfg.field_rows, [field])
        v = md.gather(p["emb"], ids + offsets, "vocab")                   # [batch, field, k]
        flat = md.rename(md.rearrange(v, "batch field k -> batch (field k)"), field_k="d")
        x0 = md.concat([flat, md.rename(xd, dense="d")], "d")            # [batch, d]

        def cross_layer(xl: md.Tensor, q: dict) -> md.Tensor:
            lin = md.einsum("batch d, d d2 -> batch d2", xl, q["w"]) + q["b"]
            return x0 * md.rename(lin, d2="d") + xl                       # x0: read from outside

        x = md.repeat(cross_layer, x0, cross, "layer", remat=cfg.remat)
        a = md.relu(md.einsum("batch d, d h -> batch h", x, p["w_up"]) + p["b_up"])
        z = md.einsum("batch h, h -> batch", a, p["w_out"]) + p["b_out"]
        log_sig = -md.softplus(-z)                 # log sigmoid(z)
        log_sig_neg = -md.softplus(z)              # log sigmoid(-z)
        loss = md.reduce_mean(-(label * log_sig) - (1.0 - label) * log_sig_neg)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, cfg.field_rows, (cfg.batch, cfg.fields), generator=gen)
        xd = torch.randn(cfg.batch, cfg.dense, generator=gen)
        label = ((xd[:, 0] * xd[:, 1] > 0) ^ (ids[:, 0] % 2 == 0)).float()
        return {"ids": ids, "xd": xd, "label": label}

    return md.Model(g, loss, {**p, **cross}, feeds, cfg)
