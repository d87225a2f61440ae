"""A held-out Transformer-XL-style decoder with dropout, written from README.md and docs/ only.

Legend: b batch, s seq (this segment's queries), m mem (the previous segment's positions),
k key_seq (mem + seq keys), d d_model, h heads, e d_head, f d_ff, v vocab, l layer.

    ids_bs -> wte -> dropout
      -> md.repeat over layers: each layer reads its own slice of the fed memory
         mem_lbmd (the previous segment's hidden states at that layer, under stop_gradient),
           kv input = concat(LN(mem), LN(h)) along key_seq; a query i sees keys j <= mem + i;
           attention probabilities dropped out (the composite, as the docs say),
           h = h + dropout(attn);  h = h + dropout(mlp(LN(h)))
      -> LN -> logits -> next-token cross-entropy

``dropout=0.0`` turns every dropout off; ``mem_mode="stacked"`` feeds the memory as a stacked
per-layer tensor read through ``md.repeat``'s stacked dict, ``"closure"`` reads one memory
[batch, mem, d_model] shared by every layer from the graph around the stack.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 8
    seq: int = 16
    mem: int = 16
    vocab: int = 64
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 2
    dropout: float = 0.1
    mem_mode: str = "stacked"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, seq=4, mem=4, vocab=16, d_model=8, heads=2, d_head=4, d_ff=16, layers=2)


PROJ = "batch key_seq d_model, d_model heads d_head -> batch key_seq heads d_head"
QPROJ = "batch seq d_model, d_model heads d_head -> batch seq heads d_head"
SCORES = "batch seq heads d_head, batch key_seq heads d_head -> batch heads seq key_seq"
MIX = "batch heads seq key_seq, batch key_seq heads d_head -> batch seq heads d_head"
OUT = "batch seq heads d_head, heads d_head d_model -> batch seq d_model"


def drop(x, cfg: Config, seed: int):
    return md.dropout(x, cfg.dropout, seed) if cfg.dropout else x


def block(h_bsd, mem_bmd, p, cfg: Config, allowed_sk):
    z_bsd = md.layer_norm(h_bsd, "d_model", p["ln1"])
    zm_bmd = md.layer_norm(md.stop_gradient(mem_bmd), "d_model", p["ln1"])
    kv_bkd = md.concat([md.rename(zm_bmd, mem="key_seq"), md.rename(z_bsd, seq="key_seq")], "key_seq")
    q = md.einsum(QPROJ, z_bsd, p["wq"])
    k, v = md.einsum(PROJ, kv_bkd, p["wk"]), md.einsum(PROJ, kv_bkd, p["wv"])
    att = md.where(allowed_sk, md.einsum(SCORES, q, k) * cfg.d_head ** -0.5, -1e9)
    att = drop(md.softmax(att, "key_seq"), cfg, seed=1)
    h_bsd = h_bsd + drop(md.einsum(OUT, md.einsum(MIX, att, v), p["wo"]), cfg, seed=2)
    u = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff",
                          md.layer_norm(h_bsd, "d_model", p["ln2"]), p["w_fc"]))
    return h_bsd + drop(md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", u, p["w_proj"]), cfg, seed=3)


def build(cfg: Config = Config()) -> md.Model:
    if cfg.mem_mode not in ("stacked", "closure"):
        raise md.GraphError(f"heldout_txl: mem_mode is {cfg.mem_mode!r}; use 'stacked' or 'closure'")
    b, s, m = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("mem", cfg.mem)
    kd = md.Dim("key_seq", cfg.mem + cfg.seq)
    d, h, e = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    f, v, l = md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    with md.Graph("txl") as g:
        ids_bs = md.input("ids", [b, s], torch.int64)
        labels_bs = md.input("labels", [b, s], torch.int64)
        mem_shape = [l, b, m, d] if cfg.mem_mode == "stacked" else [b, m, d]
        mem = md.input("memory", mem_shape)
        wte = md.param("wte", [v, d], scale=0.1)
        blocks = {
            "ln1": md.param("ln1", [l, d], init="ones"),
            "wq": md.param("wq", [l, d, h, e], fan_out=[l, h, e]),
            "wk": md.param("wk", [l, d, h, e], fan_out=[l, h, e]),
            "wv": md.param("wv", [l, d, h, e], fan_out=[l, h, e]),
            "wo": md.param("wo", [l, h, e, d], fan_out=[l, d]),
            "ln2": md.param("ln2", [l, d], init="ones"),
            "w_fc": md.param("w_fc", [l, d, f], fan_out=[l, f]),
            "w_proj": md.param("w_proj", [l, f, d], fan_out=[l, d]),
        }
        lnf = md.param("lnf", [d], init="ones")
        head = md.param("head", [v, d], fan_out=[v])
        # query i (at absolute position mem + i) sees key j when j <= mem + i
        allowed_sk = md.less_equal(md.arange(kd), md.arange(s) + cfg.mem)
        x = drop(md.gather(wte, ids_bs, "vocab"), cfg, seed=0)
        if cfg.mem_mode == "stacked":
            step = lambda x_, p: block(x_, p["memory"], p, cfg, allowed_sk)
            x = md.repeat(step, x, {**blocks, "memory": mem}, l)
        else:
            x = md.repeat(lambda x_, p: block(x_, mem, p, cfg, allowed_sk), x, blocks, l)
        logits = md.einsum("batch seq d_model, vocab d_model -> batch seq vocab",
                           md.layer_norm(x, "d_model", lnf), head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels_bs, "vocab"))
    params = {"wte": wte, **blocks, "lnf": lnf, "head": head}

    def batches(seed: int, rows: slice | None = None) -> dict[str, torch.Tensor]:
        """Each row from its own stream: tokens, and this row's memory at every layer."""
        ids, labels, mems = [], [], []
        for r in range(cfg.batch)[rows or slice(None)]:
            gen = md.row_generator(seed, r)
            tokens = torch.randint(0, cfg.vocab, (cfg.seq + 1,), generator=gen)
            ids.append(tokens[:-1])
            labels.append(tokens[1:])
            mems.append(torch.randn(cfg.layers, cfg.mem, cfg.d_model, generator=gen))
        n = len(ids)
        mem_t = torch.stack(mems, 1) if n else torch.zeros(cfg.layers, 0, cfg.mem, cfg.d_model)
        if cfg.mem_mode == "closure":
            mem_t = mem_t[0]
        if not n:
            return {"ids": torch.zeros(0, cfg.seq, dtype=torch.int64),
                    "labels": torch.zeros(0, cfg.seq, dtype=torch.int64), "memory": mem_t}
        return {"ids": torch.stack(ids), "labels": torch.stack(labels), "memory": mem_t.contiguous()}

    return md.Model(g, loss, params, batches=batches, config=cfg)
