"""XLNet-lite, a held-out model (round 27b): two-stream attention over a factorisation order.

Legend: batch, seq = tokens, key_seq = the keys (a memory slot at key 0, then the tokens), vocab,
d_model/heads/d_head/d_ff as in a transformer encoder (pre-norm), layer = the stack, rel = the
clipped relative distances. Each example has its own factorisation order, ``rank [batch, seq]``
(the place of each token in a random permutation). The content stream ``h`` attends to every key
whose rank is at or before its own (itself included) and the memory slot; the query stream ``g``
(started from a learned vector, so it never knows its own token) attends to the keys strictly
before its own rank and the memory slot: ``md.attention(..., mask=)``, whose rows always keep the
memory slot. The content stream's scores add a learned bias per head and clipped relative distance
(a trained additive bias, so the composite softmax). The loss is the cross-entropy of the query
stream at the last ``predict`` tokens of each order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 4
    seq: int = 8
    vocab: int = 32
    d_model: int = 16
    heads: int = 4
    d_head: int = 4
    d_ff: int = 32
    layers: int = 2
    clip: int = 3           # relative distances clipped to [-clip, clip]
    predict: int = 3        # the last `predict` tokens of each order are predicted
    remat: str | None = None

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, seq=6, vocab=16, d_model=8, heads=2, d_head=4, d_ff=16, layers=2, clip=2, predict=2)


def _proj(x, w, out="seq"):
    y = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", x, w)
    return y if out == "seq" else md.rename(y, {"seq": out})


def _block(carry, p, masks, rel_oh, scale):
    h, g = carry
    content_mask, query_mask = masks
    hn = md.layer_norm(h, "d_model", p["ln_h"])
    gn = md.layer_norm(g, "d_model", p["ln_h"])
    mem_k = md.rename(p["mem_k"], {"mem": "key_seq"})                 # [key_seq:1, heads, d_head]
    mem_v = md.rename(p["mem_v"], {"mem": "key_seq"})
    b = hn.shape["batch"]
    k = md.concat([md.broadcast_to(mem_k, [b, *mem_k.shape]), _proj(hn, p["wk"], "key_seq")], "key_seq")
    v = md.concat([md.broadcast_to(mem_v, [b, *mem_v.shape]), _proj(hn, p["wv"], "key_seq")], "key_seq")
    # content stream: composite attention with the trained relative-position bias
    qh = _proj(hn, p["wq"])
    scores = md.einsum("batch seq heads d_head, batch key_seq heads d_head -> batch heads seq key_seq", qh, k) * scale
    bias = md.einsum("seq key_seq rel, heads rel -> heads seq key_seq", rel_oh, p["rel_bias"])
    att = md.softmax(md.where(content_mask, scores + bias, -1e9), "key_seq")
    oh = md.einsum("batch heads seq key_seq, batch key_seq heads d_head -> batch seq heads d_head", att, v)
    # query stream: fused attention, never its own token (strictly earlier ranks and the memory)
    og = md.attention(_proj(gn, p["wq"]), k, v, "seq", "key_seq", "d_head", causal=False, mask=query_mask)
    outs = []
    for x, o in ((h, oh), (g, og)):
        x = x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, p["wo"])
        f = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", md.layer_norm(x, "d_model", p["ln_f"]), p["fc"]))
        outs.append(x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", f, p["proj"]))
    return tuple(outs)


def _masks(rank):
    """[batch, seq, key_seq] masks from the ranks: the memory slot (key 0) ranks 0, token j ranks rank[j] + 1."""
    rq = rank + 1
    rk = md.pad(md.rename(rq, {"seq": "key_seq"}), "key_seq", 1, 0)
    content = md.less_equal(rk, rq)
    query = md.less(rk, rq)
    return content, query


def build(cfg: Config) -> md.Model:
    B, S, V = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("vocab", cfg.vocab)
    D, H, E, F = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    L, K, R, M = md.Dim("layer", cfg.layers), md.Dim("key_seq", cfg.seq + 1), md.Dim("rel", 2 * cfg.clip + 1), md.Dim("mem", 1)
    with md.Graph() as g:
        ids = md.input("ids", [B, S], dtype=torch.int64)
        rank = md.input("rank", [B, S], dtype=torch.int64)
        wte = md.param("wte", [V, D], scale=1.0)
        w_g = md.param("w_g", [D], scale=1.0)
        stacked = {n: md.param(n, [L, D, H, E], fan_out=["layer", "heads", "d_head"]) for n in ("wq", "wk", "wv")}
        stacked["wo"] = md.param("wo", [L, H, E, D], fan_out=["layer", "d_model"])
        stacked["fc"] = md.param("fc", [L, D, F], fan_out=["layer", "d_ff"])
        stacked["proj"] = md.param("proj", [L, F, D], fan_out=["layer", "d_model"])
        stacked["ln_h"] = md.param("ln_h", [L, D], init="ones")
        stacked["ln_f"] = md.param("ln_f", [L, D], init="ones")
        stacked["rel_bias"] = md.param("rel_bias", [L, H, R], scale=0.5)
        stacked["mem_k"] = md.param("mem_k", [L, M, H, E], scale=1.0)
        stacked["mem_v"] = md.param("mem_v", [L, M, H, E], scale=1.0)
        head = md.param("head", [D, V], fan_out=["vocab"])

        dist = md.arange(S) - (md.arange(K) - 1)                       # the memory slot is one before token 0
        rel_oh = md.one_hot(md.clamp(dist, -cfg.clip, cfg.clip) + cfg.clip, R)
        masks = _masks(rank)
        h = md.gather(wte, ids, "vocab")
        g0 = md.broadcast_to(w_g, [B, S, D])
        _, gq = md.repeat(lambda c, p: _block(c, p, masks, rel_oh, cfg.d_head ** -0.5), (h, g0), stacked, "layer",
                          remat=cfg.remat)
        logits = md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", gq, head)
        target = md.cast(md.greater_equal(rank, cfg.seq - cfg.predict), torch.float32)
        ce = md.cross_entropy(logits, ids, "vocab")
        loss = md.reduce_sum(ce * target) / (cfg.batch * cfg.predict)

    def feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        ranks = torch.stack([torch.randperm(cfg.seq, generator=gen) for _ in range(cfg.batch)])
        return {"ids": torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen), "rank": ranks}

    return md.Model(g, loss, g.params(), feeds, cfg)


REF_INPUTS = ("ids", "rank")


def reference_loss(cfg: Config, p: dict, ids, rank):
    """The same model in plain torch: both streams as explicit masked softmaxes."""
    F = torch.nn.functional
    B, S, D = ids.shape[0], cfg.seq, cfg.d_model
    rq = rank + 1
    rk = torch.cat([torch.zeros(B, 1, dtype=rank.dtype), rq], 1)
    cmask = rk[:, None, :] <= rq[:, :, None]                                     # [b, s, k]
    qmask = rk[:, None, :] < rq[:, :, None]
    dist = torch.arange(S)[:, None] - (torch.arange(S + 1)[None, :] - 1)
    rel = dist.clamp(-cfg.clip, cfg.clip) + cfg.clip
    h = p["wte"][ids]
    g = p["w_g"].expand(B, S, D)
    for i in range(cfg.layers):
        hn, gn = F.layer_norm(h, (D,), p["ln_h"][i]), F.layer_norm(g, (D,), p["ln_h"][i])
        k = torch.cat([p["mem_k"][i].expand(B, 1, cfg.heads, cfg.d_head), torch.einsum("bsd,dhe->bshe", hn, p["wk"][i])], 1)
        v = torch.cat([p["mem_v"][i].expand(B, 1, cfg.heads, cfg.d_head), torch.einsum("bsd,dhe->bshe", hn, p["wv"][i])], 1)
        bias = p["rel_bias"][i][:, rel]                                          # [h, s, k]
        outs = []
        for x, xn, mask, b in ((h, hn, cmask, bias), (g, gn, qmask, 0.0)):
            q = torch.einsum("bsd,dhe->bshe", xn, p["wq"][i])
            sc = torch.einsum("bshe,bkhe->bhsk", q, k) * cfg.d_head ** -0.5 + b
            att = torch.softmax(sc.masked_fill(~mask[:, None], float("-inf")), -1)
            o = torch.einsum("bhsk,bkhe->bshe", att, v)
            x = x + torch.einsum("bshe,hed->bsd", o, p["wo"][i])
            x = x + F.gelu(F.layer_norm(x, (D,), p["ln_f"][i]) @ p["fc"][i]) @ p["proj"][i]
            outs.append(x)
        h, g = outs
    logits = g @ p["head"]
    ce = F.cross_entropy(logits.reshape(-1, cfg.vocab), ids.reshape(-1), reduction="none").reshape(B, S)
    return (ce * (rank >= S - cfg.predict)).sum() / (B * cfg.predict)
