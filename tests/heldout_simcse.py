"""Unsupervised SimCSE, a held-out model (round 24a).

Legend: batch = sentences, batch2 = the same sentences as the second view, seq = tokens, vocab,
d_model/heads/d_head/d_ff as in a transformer encoder (post-norm, BERT-like). The encoder runs twice
on the same ids; its dropout masks (seeds 1 and 2) are the only augmentation (``joined``: once over
the ids concatenated with themselves along batch, as the paper's code, whose masks differ by position). Each view is
mean-pooled and L2-normalised; the loss is the cross-entropy of the cosine similarities / temperature
[batch, batch2] with the diagonal as the positives. Eval (md.evaluate) runs it without dropout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 8
    seq: int = 16
    vocab: int = 64
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 2
    dropout: float = 0.1
    temperature: float = 0.05
    joined: bool = False        # both views as one batch of 2x the sentences through one md.repeat
    remat: str | None = None

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, seq=4, vocab=16, d_model=8, heads=2, d_head=4, d_ff=16, layers=2, dropout=0.2)


def _block(x, p, rate: float, seed: int):
    q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", x, p["wq"])
    k = md.rename(md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", x, p["wk"]), {"seq": "key_seq"})
    v = md.rename(md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", x, p["wv"]), {"seq": "key_seq"})
    o = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=False)
    a = md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, p["wo"])
    x = md.layer_norm(x + md.dropout(a, rate, seed), "d_model", p["ln1"], p["ln1_b"])
    h = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", x, p["fc"]) + p["fc_b"])
    h = md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", md.dropout(h, rate, seed + 100), p["proj"])
    return md.layer_norm(x + h, "d_model", p["ln2"], p["ln2_b"])


def _encode(ids, table, pos, stacked, cfg, seed: int):
    x = md.layer_norm(md.gather(table, ids, "vocab") + pos, "d_model", stacked["ln_e"], stacked["ln_e_b"])
    x = md.dropout(x, cfg.dropout, seed + 200) if cfg.dropout else x
    layers = {k: v for k, v in stacked.items() if not k.startswith("ln_e")}
    x = md.repeat(lambda c, p: _block(c, p, cfg.dropout, seed), x, layers, "layer", remat=cfg.remat)
    e = md.reduce_mean(x, "seq")
    return e * md.rsqrt(md.reduce_sum(e * e, "d_model") + 1e-12)


def build(cfg: Config) -> md.Model:
    B, S, V = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("vocab", cfg.vocab)
    D, Hh, E, F = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    L = md.Dim("layer", cfg.layers)
    with md.Graph() as g:
        ids = md.input("ids", [B, S], dtype=torch.int64)
        table = md.param("wte", [V, D], scale=1.0)
        pos = md.param("wpe", [S, D], scale=0.1)
        stacked = {n: md.param(n, [L, D, Hh, E], fan_out=["layer", "heads", "d_head"]) for n in ("wq", "wk", "wv")}
        stacked["wo"] = md.param("wo", [L, Hh, E, D], fan_out=["layer", "d_model"])
        stacked["fc"] = md.param("fc", [L, D, F], fan_out=["layer", "d_ff"])
        stacked["fc_b"] = md.param("fc_b", [L, F], init="zeros")
        stacked["proj"] = md.param("proj", [L, F, D], fan_out=["layer", "d_model"])
        for n in ("ln1", "ln2"):
            stacked[n] = md.param(n, [L, D], init="ones")
            stacked[f"{n}_b"] = md.param(f"{n}_b", [L, D], init="zeros")
        stacked["ln_e"] = md.param("ln_e", [D], init="ones")
        stacked["ln_e_b"] = md.param("ln_e_b", [D], init="zeros")
        if cfg.joined:      # one stack run once (a pipeline can take it): the masks differ by position
            z = _encode(md.concat([ids, ids], "batch"), table, pos, stacked, cfg, 1)
            z1 = md.slice_(z, "batch", 0, cfg.batch)
            z2 = md.rename(md.slice_(z, "batch", cfg.batch, 2 * cfg.batch), {"batch": "batch2"})
        else:
            z1 = _encode(ids, table, pos, stacked, cfg, 1)
            z2 = md.rename(_encode(ids, table, pos, stacked, cfg, 2), {"batch": "batch2"})
        sim = md.einsum("batch d_model, batch2 d_model -> batch batch2", z1, z2) / cfg.temperature
        loss = md.reduce_mean(md.cross_entropy(sim, md.arange(B), "batch2"))

    def feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        return {"ids": torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)}

    return md.Model(g, loss, g.params(), feeds, cfg, outputs={"z1": z1, "z2": z2})


REF_INPUTS = ("ids",)


def reference_loss(cfg: Config, p: dict, ids):
    """The same model in plain torch without dropout (md.dropout's masks are its own): both views
    are then equal, and the loss is InfoNCE of each sentence against itself."""
    F = torch.nn.functional
    D = cfg.d_model
    x = F.layer_norm(p["wte"][ids] + p["wpe"], (D,), p["ln_e"], p["ln_e_b"])
    for i in range(cfg.layers):
        q, k, v = (torch.einsum("bsd,dhe->bhse", x, p[w][i]) for w in ("wq", "wk", "wv"))
        a = torch.einsum("bhse,hed->bsd", F.scaled_dot_product_attention(q, k, v), p["wo"][i])
        x = F.layer_norm(x + a, (D,), p["ln1"][i], p["ln1_b"][i])
        h = F.gelu(x @ p["fc"][i] + p["fc_b"][i]) @ p["proj"][i]
        x = F.layer_norm(x + h, (D,), p["ln2"][i], p["ln2_b"][i])
    z = F.normalize(x.mean(1), dim=-1, eps=0.0)
    return F.cross_entropy(z @ z.T / cfg.temperature, torch.arange(ids.shape[0]))
