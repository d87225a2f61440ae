"""A held-out DLRM-style recommender, written from README.md and docs/ only.

Legend: b batch, n dense (dense features), d d_emb, t tables (the stacked same-size tables),
r rows (their rows), g bag (ids per sample of a table), u user_rows (a big table's rows),
c cat_rows (a small table's rows, 7: uneven on 2 ranks), f/f2 feat (interaction features),
h d_top.

    dense_bn -> bottom MLP -> x_bd
    ids_btg, mask_btg -> bag sum over g of the rows of 2 stacked tables [t, r, d] (a one-hot
        einsum: the ids and the tables share 't', a per-sample gather) -> e_btd
    user_bg, user_mask_bg -> bag sum of the big table [u, d] (md.gather) -> u_bd
    cat_b -> one row of the small table [c, d] (md.gather) -> c_bd
    features [b, feat:4, d] = concat(x, e (t renamed feat), u, c) along 'feat'
    interaction z_bff2 = features . features over d  (the pairwise dot products)
    top MLP over (z, x) -> logit_b; loss = mean BCE-with-logits against the fed click_b

Layouts: tables:model (table-wise), user_rows:model (row-wise), d_emb:model (column-wise),
batch:data, params.d_emb:data (FSDP).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 64
    dense: int = 8
    d_emb: int = 16
    tables: int = 2
    rows: int = 32
    bag: int = 4
    user_rows: int = 64
    cat_rows: int = 7
    d_top: int = 32

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=8, dense=4, d_emb=4, tables=2, rows=6, bag=3, user_rows=8, cat_rows=7, d_top=8)


def row(cfg: Config, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One sample: dense features, a bag of ids per table with a mask (at least one id kept),
    a category and a click that depends on them (so the model has something to learn)."""
    dense = torch.randn(cfg.dense, generator=gen)
    ids = torch.randint(0, cfg.rows, (cfg.tables, cfg.bag), generator=gen)
    n = torch.randint(1, cfg.bag + 1, (cfg.tables,), generator=gen)
    mask = (torch.arange(cfg.bag)[None, :] < n[:, None]).float()
    user = torch.randint(0, cfg.user_rows, (cfg.bag,), generator=gen)
    user_mask = (torch.arange(cfg.bag) < int(torch.randint(1, cfg.bag + 1, (), generator=gen))).float()
    cat = torch.randint(0, cfg.cat_rows, (), generator=gen)
    click = float((dense[0] + (ids[0, 0] % 2) - 0.5 + (cat % 2)) > 0.5)
    return {"dense": dense, "ids": ids, "mask": mask, "user": user, "user_mask": user_mask,
            "cat": cat, "click": torch.tensor(click)}


def build(cfg: Config = Config()) -> md.Model:
    b, n, d = md.Dim("batch", cfg.batch), md.Dim("dense", cfg.dense), md.Dim("d_emb", cfg.d_emb)
    t, r, g = md.Dim("tables", cfg.tables), md.Dim("rows", cfg.rows), md.Dim("bag", cfg.bag)
    u, c, h = md.Dim("user_rows", cfg.user_rows), md.Dim("cat_rows", cfg.cat_rows), md.Dim("d_top", cfg.d_top)
    nfeat = cfg.tables + 3
    with md.Graph("dlrm") as gr:
        dense_bn = md.input("dense", [b, n])
        ids_btg = md.input("ids", [b, t, g], torch.int64)
        mask_btg = md.input("mask", [b, t, g])
        user_bg = md.input("user", [b, g], torch.int64)
        user_mask_bg = md.input("user_mask", [b, g])
        cat_b = md.input("cat", [b], torch.int64)
        click_b = md.input("click", [b])

        params = {
            "w_bot": md.param("w_bot", [n, d], fan_out=[d]),
            "b_bot": md.param("b_bot", [d], init="zeros"),
            "emb": md.param("emb", [t, r, d], scale=0.5),
            "user_emb": md.param("user_emb", [u, d], scale=0.5),
            "cat_emb": md.param("cat_emb", [c, d], scale=0.5),
            "w_int": md.param("w_int", [md.Dim("feat", nfeat), md.Dim("feat2", nfeat), h], fan_out=[h]),
            "w_x": md.param("w_x", [d, h], fan_out=[h]),
            "b_top": md.param("b_top", [h], init="zeros"),
            "w_out": md.param("w_out", [h], scale=0.3),
        }
        p = params
        x_bd = md.relu(md.einsum("batch dense, dense d_emb -> batch d_emb", dense_bn, p["w_bot"]) + p["b_bot"])
        # the ids and the stacked tables share 'tables': a per-sample gather, the one-hot einsum
        rows_btgd = md.einsum("batch tables bag rows, tables rows d_emb -> batch tables bag d_emb",
                              md.one_hot(ids_btg, r), p["emb"])
        e_btd = md.reduce_sum(rows_btgd * mask_btg, "bag")
        u_bd = md.reduce_sum(md.gather(p["user_emb"], user_bg, "user_rows") * user_mask_bg, "bag")
        c_bd = md.gather(p["cat_emb"], cat_b, "cat_rows")
        one = md.Dim("feat", 1)
        feats = md.concat([md.reshape(x_bd, [b, one, d]), md.rename(e_btd, tables="feat"),
                           md.reshape(u_bd, [b, one, d]), md.reshape(c_bd, [b, one, d])], "feat")
        z_bff = md.einsum("batch feat d_emb, batch feat2 d_emb -> batch feat feat2", feats,
                          md.rename(feats, feat="feat2"))
        top_bh = md.relu(md.einsum("batch feat feat2, feat feat2 d_top -> batch d_top", z_bff, p["w_int"])
                         + md.einsum("batch d_emb, d_emb d_top -> batch d_top", x_bd, p["w_x"]) + p["b_top"])
        logit_b = md.einsum("batch d_top, d_top -> batch", top_bh, p["w_out"])
        # BCE with logits, stable: max(x, 0) - x*y + log(1 + exp(-|x|))
        bce_b = md.relu(logit_b) - logit_b * click_b + md.log(1.0 + md.exp(-md.abs(logit_b)))
        loss = md.reduce_mean(bce_b)
        accuracy = md.reduce_mean(md.cast(md.equal(md.cast(md.greater(logit_b, 0.0), torch.float32), click_b),
                                          torch.float32))

    def batches(seed: int, rows: slice | None = None) -> dict[str, torch.Tensor]:
        drawn = [row(cfg, md.row_generator(seed, i)) for i in range(cfg.batch)[rows or slice(None)]]
        if not drawn:
            empty = row(cfg, md.row_generator(seed, 0))
            return {k: v[None][:0] for k, v in empty.items()}
        return {k: torch.stack([x[k] for x in drawn]) for k in drawn[0]}

    return md.Model(gr, loss, params, batches=batches, config=cfg, metrics={"accuracy": accuracy})
