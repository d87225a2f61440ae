"""Held-out model (round 17b): two-tower retrieval (YouTube DNN / sampled-softmax style).

Legend: b = batch (users, one positive item each), h = hist (a user's item history, padded),
v = items (the item vocabulary), f = d_feat (item features), d = hidden (item embeddings),
ff = d_ff (tower MLPs), o = d_out (the shared retrieval space), c = cand (candidate items).

User tower: the mean of the looked-up history rows under a padding mask (an embedding bag), then an
MLP. Item tower: the item's id embedding plus a projection of its features, then an MLP. Form
``inbatch`` scores every user against every in-batch positive (``[batch, cand]``, cand = the batch's
items) with a logit temperature and a logQ correction (``log_q`` fed: log of each item's sampling
frequency); form ``sampled`` scores each user against its own positive and ``negs`` shared sampled
negatives fed as inputs (with their logQ), label 0 = the positive.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    items: int = 64
    hist: int = 8
    d_feat: int = 12
    hidden: int = 32
    d_ff: int = 64
    d_out: int = 32
    batch: int = 16
    negs: int = 16
    temperature: float = 0.1
    form: str = "inbatch"   # inbatch | sampled

    @classmethod
    def tiny(cls):
        return cls(items=12, hist=5, d_feat=6, hidden=8, d_ff=12, d_out=8, batch=8, negs=6)


def _item_tower(table, feats, ids, w_f, w_i1, w_i2, rows: str):
    """Item vectors ``[rows, d_out]`` of ``ids [rows]`` and their features ``[rows, d_feat]``."""
    emb = md.gather(table, ids, "items")                           # [rows, hidden]
    x = emb + md.einsum(f"{rows} d_feat, d_feat hidden -> {rows} hidden", feats, w_f)
    z = md.relu(md.einsum(f"{rows} hidden, hidden d_ff -> {rows} d_ff", x, w_i1))
    return md.einsum(f"{rows} d_ff, d_ff d_out -> {rows} d_out", z, w_i2)


def build(cfg: Config) -> md.Model:
    if cfg.form not in ("inbatch", "sampled"):
        raise ValueError(f"form must be 'inbatch' or 'sampled', not {cfg.form!r}")
    B, H, V = md.Dim("batch", cfg.batch), md.Dim("hist", cfg.hist), md.Dim("items", cfg.items)
    F, D = md.Dim("d_feat", cfg.d_feat), md.Dim("hidden", cfg.hidden)
    FF, O = md.Dim("d_ff", cfg.d_ff), md.Dim("d_out", cfg.d_out)
    C = md.Dim("cand", cfg.batch if cfg.form == "inbatch" else cfg.negs)
    with md.Graph() as g:
        hist_ids = md.input("hist_ids", [B, H], dtype=torch.int64)
        hist_len = md.input("hist_len", [B], dtype=torch.int64)
        item_feat = md.input("item_feat", [C, F])
        table = md.param("item_table", [V, D], scale=0.5)
        w_u1 = md.param("w_u1", [D, FF], fan_out=[FF])
        w_u2 = md.param("w_u2", [FF, O], fan_out=[O])
        w_f = md.param("w_f", [F, D], fan_out=[D])
        w_i1 = md.param("w_i1", [D, FF], fan_out=[FF])
        w_i2 = md.param("w_i2", [FF, O], fan_out=[O])

        # user tower: embedding bag (masked mean over the history), then the MLP
        keep = md.cast(md.less(md.arange(H), hist_len), torch.float32)       # [hist, batch]
        rows = md.gather(table, hist_ids, "items")                            # [batch, hist, hidden]
        bag = md.reduce_sum(rows * keep, "hist") / md.reduce_sum(keep, "hist")
        u = md.einsum("batch d_ff, d_ff d_out -> batch d_out",
                      md.relu(md.einsum("batch hidden, hidden d_ff -> batch d_ff", bag, w_u1)), w_u2)

        item_ids = md.input("item_ids", [C], dtype=torch.int64)
        log_q = md.input("log_q", [C])
        v = _item_tower(table, item_feat, item_ids, w_f, w_i1, w_i2, "cand")  # [cand, d_out]
        scores = md.einsum("batch d_out, cand d_out -> batch cand", u, v) / cfg.temperature - log_q
        if cfg.form == "inbatch":
            # user b's positive is candidate b
            loss = md.reduce_mean(md.cross_entropy(scores, md.arange(B), "cand"))
        else:
            pos_ids = md.input("pos_ids", [B], dtype=torch.int64)
            pos_feat = md.input("pos_feat", [B, F])
            pos_log_q = md.input("pos_log_q", [B])
            vp = _item_tower(table, pos_feat, pos_ids, w_f, w_i1, w_i2, "batch")  # [batch, d_out]
            pos = md.reduce_sum(u * vp, "d_out") / cfg.temperature - pos_log_q
            one = md.Dim("cand", 1)
            logits = md.concat([md.broadcast_to(md.unsqueeze(pos, one), [B, one]), scores], "cand")
            loss = md.reduce_mean(md.cross_entropy(logits, md.arange(B) * 0, "cand"))

    params = {"item_table": table, "w_u1": w_u1, "w_u2": w_u2, "w_f": w_f, "w_i1": w_i1, "w_i2": w_i2}

    def make_feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        nc = C.size
        freq = torch.rand(cfg.items, generator=gen) + 0.1
        freq = freq / freq.sum()
        feeds = {
            "hist_ids": torch.randint(0, cfg.items, (cfg.batch, cfg.hist), generator=gen),
            "hist_len": torch.randint(1, cfg.hist + 1, (cfg.batch,), generator=gen),
            "item_feat": torch.randn(nc, cfg.d_feat, generator=gen),
            "item_ids": torch.randint(0, cfg.items, (nc,), generator=gen),
        }
        feeds["log_q"] = freq[feeds["item_ids"]].log()
        if cfg.form == "sampled":
            feeds["pos_ids"] = torch.randint(0, cfg.items, (cfg.batch,), generator=gen)
            feeds["pos_feat"] = torch.randn(cfg.batch, cfg.d_feat, generator=gen)
            feeds["pos_log_q"] = freq[feeds["pos_ids"]].log()
        return feeds

    return md.Model(g, loss, params, make_feeds, cfg)
