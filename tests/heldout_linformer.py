"""A Linformer encoder, written from the README and docs/ alone (a held-out model).

Tokens ``[batch, seq]`` are embedded by ``md.gather`` plus learned positions. Each of the pre-norm
blocks (a ``md.repeat`` over ``layer``) projects its keys and values along the sequence: a learned
``[seq, proj]`` matrix per layer (``e_k`` and ``e_v``, Linformer's E and F) contracts ``seq`` by an
einsum, so attention is over ``proj`` (fewer) key rows, non-causal (an encoder), by the fused
``md.attention``. Then a gelu MLP. Head: LayerNorm and a per-token classifier, cross entropy
against per-token labels (a token-tagging task: the label is a function of the token and its
left neighbour, so attention is needed).

Legend: batch, seq, proj (projected key length), d (model width), heads, dh (head width),
ff (MLP width), vocab, tag (classes).
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 8
    seq: int = 64
    proj: int = 16
    d: int = 64
    heads: int = 4
    dh: int = 16
    ff: int = 256
    vocab: int = 64
    tags: int = 8
    layers: int = 2
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, seq=8, proj=4, d=8, heads=2, dh=4, ff=16, vocab=12, tags=5, layers=2)


def build(cfg: Config = Config()) -> md.Model:
    batch, seq, proj = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("proj", cfg.proj)
    d, heads, dh, ff = md.Dim("d", cfg.d), md.Dim("heads", cfg.heads), md.Dim("dh", cfg.dh), md.Dim("ff", cfg.ff)
    vocab, tag, layer = md.Dim("vocab", cfg.vocab), md.Dim("tag", cfg.tags), md.Dim("layer", cfg.layers)
    with md.Graph("heldout_linformer") as g:
        ids = md.input("ids", [batch, seq], dtype=torch.int64)
        labels = md.input("labels", [batch, seq], dtype=torch.int64)
        p = {"embed": md.param("embed", [vocab, d], scale=1.0),
             "pos": md.param("pos", [seq, d], scale=0.1),
             "lnf": md.param("lnf", [d], init="ones"),
             "head": md.param("head", [d, tag], fan_out=["tag"])}
        st = {"ln1": md.param("ln1", [layer, d], init="ones"),
              "wq": md.param("wq", [layer, d, heads, dh], fan_out=["layer", "heads", "dh"]),
              "wk": md.param("wk", [layer, d, heads, dh], fan_out=["layer", "heads", "dh"]),
              "wv": md.param("wv", [layer, d, heads, dh], fan_out=["layer", "heads", "dh"]),
              "e_k": md.param("e_k", [layer, seq, proj], fan_out=["layer", "proj"]),
              "e_v": md.param("e_v", [layer, seq, proj], fan_out=["layer", "proj"]),
              "wo": md.param("wo", [layer, heads, dh, d], fan_out=["layer", "d"]),
              "ln2": md.param("ln2", [layer, d], init="ones"),
              "w1": md.param("w1", [layer, d, ff], fan_out=["layer", "ff"]),
              "w2": md.param("w2", [layer, ff, d], fan_out=["layer", "d"])}

        def block(x: md.Tensor, q: dict) -> md.Tensor:                 # x [batch, seq, d]
            h = md.layer_norm(x, "d", q["ln1"])
            qh = md.einsum("batch seq d, d heads dh -> batch seq heads dh", h, q["wq"])
            k = md.einsum("batch seq d, d heads dh -> batch seq heads dh", h, q["wk"])
            v = md.einsum("batch seq d, d heads dh -> batch seq heads dh", h, q["wv"])
            kp = md.einsum("batch seq heads dh, seq proj -> batch proj heads dh", k, q["e_k"])
            vp = md.einsum("batch seq heads dh, seq proj -> batch proj heads dh", v, q["e_v"])
            a = md.attention(qh, kp, vp, "seq", "proj", "dh", causal=False)
            x = x + md.einsum("batch seq heads dh, heads dh d -> batch seq d", a, q["wo"])
            h = md.layer_norm(x, "d", q["ln2"])
            f = md.gelu(md.einsum("batch seq d, d ff -> batch seq ff", h, q["w1"]))
            return x + md.einsum("batch seq ff, ff d -> batch seq d", f, q["w2"])

        x = md.gather(p["embed"], ids, "vocab") + p["pos"]
        x = md.repeat(block, x, st, "layer", remat=cfg.remat)
        logits = md.einsum("batch seq d, d tag -> batch seq tag", md.layer_norm(x, "d", p["lnf"]), p["head"])
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "tag"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)
        prev = torch.roll(ids, 1, dims=1)
        return {"ids": ids, "labels": (ids + 2 * prev) % cfg.tags}

    return md.Model(g, loss, {**p, **st}, feeds, cfg)
