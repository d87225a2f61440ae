"""Held-out model (round 16b): SASRec / BERT4Rec sequential recommendation, from the docs alone.

Item ids [batch, seq] are embedded by an item table (tied: the same table scores the candidates)
plus learned positions, pre-norm transformer blocks under md.repeat. form=sasrec: causal
attention, BCE of each position's next item against one negative item per position (fed as an
input). form=bert4rec: bidirectional attention over ids with some positions replaced by a [mask]
item (id 0), a sampled softmax over [the true item, ``negs`` negative items] at the masked
positions only (a 0/1 weight input).

Legend: b batch, s seq, ks key_seq, n heads, e d_head, d d_model, f d_ff, I items, c cand.
"""
import dataclasses

import torch

import meshdsl as md


@dataclasses.dataclass
class Config:
    form: str = "sasrec"        # "sasrec" (causal + BCE) or "bert4rec" (bidirectional, masked, sampled softmax)
    items: int = 64
    batch: int = 4
    seq: int = 16
    d_model: int = 32
    heads: int = 4
    d_ff: int = 64
    layers: int = 2
    negs: int = 3

    remat: str = "none"        # md.repeat's remat: none | full | selective

    @classmethod
    def tiny(cls):
        return cls(items=16, batch=2, seq=8, d_model=8, heads=2, d_ff=16, layers=2, negs=3)


def _block(cfg, x, p):
    a = md.layer_norm(x, "d_model", p["ln1"])
    q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", a, p["wq"])
    k = md.rename(md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", a, p["wk"]), seq="key_seq")
    v = md.rename(md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", a, p["wv"]), seq="key_seq")
    y = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=cfg.form == "sasrec")
    x = x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", y, p["wo"])
    m = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", md.layer_norm(x, "d_model", p["ln2"]), p["w1"]))
    return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", m, p["w2"])


def _score(h, table, ids):
    """h . e[ids] for ids with h's dims (and maybe more): the tied item embedding as the output."""
    return md.reduce_sum(h * md.gather(table, ids, "items"), "d_model")


def build(cfg: Config) -> md.Model:
    if cfg.form not in ("sasrec", "bert4rec"):
        raise ValueError(f"form={cfg.form!r}: 'sasrec' or 'bert4rec'")
    B, S, D, I = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("d_model", cfg.d_model), md.Dim("items", cfg.items)
    N, E, F, L = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_model // cfg.heads), md.Dim("d_ff", cfg.d_ff), md.Dim("layer", cfg.layers)
    CAND = md.Dim("cand", cfg.negs)
    fo = ["layer"]
    with md.Graph() as g:
        ids = md.input("ids", [B, S], torch.int64)
        pos = md.input("pos", [B, S], torch.int64)
        neg = md.input("neg", [B, S, CAND], torch.int64)
        table = md.param("items_emb", [I, D], scale=0.5)
        wpe = md.param("wpe", [S, D], scale=0.5)
        lnf = md.param("lnf", [D], init="ones")
        stacked = {
            "ln1": md.param("ln1", [L, D], init="ones"), "ln2": md.param("ln2", [L, D], init="ones"),
            "wq": md.param("wq", [L, D, N, E], fan_out=fo + ["heads", "d_head"]),
            "wk": md.param("wk", [L, D, N, E], fan_out=fo + ["heads", "d_head"]),
            "wv": md.param("wv", [L, D, N, E], fan_out=fo + ["heads", "d_head"]),
            "wo": md.param("wo", [L, N, E, D], fan_out=fo + ["d_model"]),
            "w1": md.param("w1", [L, D, F], fan_out=fo + ["d_ff"]),
            "w2": md.param("w2", [L, F, D], fan_out=fo + ["d_model"]),
        }
        x = md.gather(table, ids, "items") + wpe
        h = md.layer_norm(md.repeat(lambda c, p: _block(cfg, c, p), x, stacked, L, remat=cfg.remat), "d_model", lnf)
        s_pos, s_neg = _score(h, table, pos), _score(h, table, neg)          # [b, s], [b, s, cand]
        if cfg.form == "sasrec":
            keep = md.cast(pos > 0, torch.float32)                          # item 0 pads the history
            per = -(md.log_sigmoid(s_pos) + md.reduce_sum(md.log_sigmoid(-s_neg), "cand")) * keep
            loss = md.reduce_sum(per) / md.reduce_sum(keep)
        else:
            weight = md.input("weight", [B, S])                             # 1 at the masked positions
            lse = md.logsumexp(md.concat([md.unsqueeze(s_pos, md.Dim("cand", 1)), s_neg], "cand"), "cand")
            loss = md.reduce_sum((lse - s_pos) * weight) / md.reduce_sum(weight)
    params = {"items_emb": table, "wpe": wpe, "lnf": lnf, **stacked}

    def make_feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        seqs = torch.randint(1, cfg.items, (cfg.batch, cfg.seq + 1), generator=gen)
        neg = torch.randint(1, cfg.items, (cfg.batch, cfg.seq, cfg.negs), generator=gen)
        if cfg.form == "sasrec":
            seqs[0, :3] = 0                                                  # a short history, left-padded
            return {"ids": seqs[:, :-1].contiguous(), "pos": seqs[:, 1:].contiguous(), "neg": neg}
        items = seqs[:, 1:].contiguous()
        masked = torch.rand(cfg.batch, cfg.seq, generator=gen) < 0.3
        masked[:, -1] = True
        return {"ids": torch.where(masked, 0, items), "pos": items, "neg": neg, "weight": masked.float()}

    return md.Model(g, loss, params, make_feeds, cfg)
