"""Reformer-style LSH (bucketed) attention, written from the README and docs/ alone (a held-out model).

A decoder-free encoder over tokens ``[batch, seq]``: an embedding by ``md.gather``, then blocks (a
``md.repeat`` over ``layer``) of shared-QK attention and a relu FFN, each pre-norm. Shared QK: one
projection makes both queries and keys (the keys L2-normalised, as the Reformer does). Each
position's bucket (per head) is the argmax over ``bucket`` of ``[xR, -xR]`` for a fixed random
rotation ``R [dh, half]`` (a constant, the same on every layout; ``bucket`` = 2 * half), a hash
of the shared query/key. A query attends only to the keys of its own bucket (an ``md.equal`` of
the two bucket ids, the key side renamed to ``key_seq``, in an ``md.where`` on the scores) and to
itself (a query's own bucket always holds it, so no row is empty). The hash has no gradient. Head:
LayerNorm and a per-token classifier, cross entropy.

Legend: batch, seq, key_seq, d (width), heads, dh (head width), half/bucket (hash buckets),
ff (FFN width), vocab, tag.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 8
    seq: int = 64
    d: int = 64
    heads: int = 4
    dh: int = 16
    half: int = 4
    ff: int = 256
    vocab: int = 64
    tags: int = 8
    layers: int = 2
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, seq=8, d=8, heads=2, dh=4, half=2, ff=16, vocab=12, tags=5, layers=2)


def build(cfg: Config = Config()) -> md.Model:
    batch, seq, kseq = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("key_seq", cfg.seq)
    d, heads, dh, ff = md.Dim("d", cfg.d), md.Dim("heads", cfg.heads), md.Dim("dh", cfg.dh), md.Dim("ff", cfg.ff)
    vocab, tag, layer = md.Dim("vocab", cfg.vocab), md.Dim("tag", cfg.tags), md.Dim("layer", cfg.layers)
    half = md.Dim("bucket", cfg.half)
    rot = torch.randn(cfg.dh, cfg.half, generator=torch.Generator().manual_seed(1234))
    with md.Graph("heldout_lshattn") as g:
        ids = md.input("ids", [batch, seq], dtype=torch.int64)
        labels = md.input("labels", [batch, seq], dtype=torch.int64)
        R = md.constant(rot, [dh, half])
        p = {"embed": md.param("embed", [vocab, d], scale=1.0),
             "lnf": md.param("lnf", [d], init="ones"),
             "head": md.param("head", [d, tag], fan_out=["tag"])}
        st = {"ln1": md.param("ln1", [layer, d], init="ones"),
              "wqk": md.param("wqk", [layer, d, heads, dh], fan_out=["layer", "heads", "dh"]),
              "wv": md.param("wv", [layer, d, heads, dh], fan_out=["layer", "heads", "dh"]),
              "wo": md.param("wo", [layer, heads, dh, d], fan_out=["layer", "d"]),
              "ln2": md.param("ln2", [layer, d], init="ones"),
              "w1": md.param("w1", [layer, d, ff], fan_out=["layer", "ff"]),
              "w2": md.param("w2", [layer, ff, d], fan_out=["layer", "d"])}
        own = md.equal(md.arange(seq), md.arange(kseq))                       # [seq, key_seq]

        def block(x: md.Tensor, q: dict) -> md.Tensor:                     # x [batch, seq, d]
            h = md.layer_norm(x, "d", q["ln1"])
            qk = md.einsum("batch seq d, d heads dh -> batch seq heads dh", h, q["wqk"])
            v = md.einsum("batch seq d, d heads dh -> batch seq heads dh", h, q["wv"])
            rx = md.einsum("batch seq heads dh, dh bucket -> batch seq heads bucket", md.stop_gradient(qk), R)
            bucket = md.argmax(md.concat([rx, -rx], "bucket"), "bucket")             # [batch, seq, heads]
            same = md.equal(bucket, md.rename(bucket, seq="key_seq"))              # [batch, seq, heads, key_seq]
            keys = qk * md.rsqrt(md.reduce_sum(qk * qk, "dh") + 1e-6)
            keys = md.rename(keys, seq="key_seq")
            s = md.einsum("batch seq heads dh, batch key_seq heads dh -> batch heads seq key_seq", qk, keys)
            s = md.where(md.logical_or(same, own), s * cfg.dh ** -0.5, -1e9)
            att = md.softmax(s, "key_seq")
            a = md.einsum("batch heads seq key_seq, batch key_seq heads dh -> batch seq heads dh", att,
                          md.rename(v, seq="key_seq"))
            x = x + md.einsum("batch seq heads dh, heads dh d -> batch seq d", a, q["wo"])
            h = md.layer_norm(x, "d", q["ln2"])
            f = md.relu(md.einsum("batch seq d, d ff -> batch seq ff", h, q["w1"]))
            return x + md.einsum("batch seq ff, ff d -> batch seq d", f, q["w2"])

        x = md.gather(p["embed"], ids, "vocab")
        x = md.repeat(block, x, st, "layer", remat=cfg.remat)
        logits = md.einsum("batch seq d, d tag -> batch seq tag", md.layer_norm(x, "d", p["lnf"]), p["head"])
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "tag"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)
        first = ids[:, :1].expand_as(ids)
        return {"ids": ids, "labels": (ids + first) % cfg.tags}

    return md.Model(g, loss, {**p, **st}, feeds, cfg)
