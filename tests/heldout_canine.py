"""CANINE-lite (held-out round 26b), written from the guides alone.

Legend: B batch, S chars, J key_chars (local attention's keys), N buckets (per hash table),
D d_model, H heads, E d_head, F d_ff, M mol (downsampled positions, S / rate), G key_mol,
R rep (the upsampling's copies), V vocab (predicted characters), L layer.

Characters come in hashed: one fed id tensor per hash function, K small embedding tables
summed. A single local-attention layer (a block-diagonal mask made by ``md.arange`` integer
math: query and key in the same window of ``local`` chars) reads them; a strided conv
downsamples x ``rate`` to a deep transformer (``md.repeat``); each molecule is copied back to
its ``rate`` chars (``md.broadcast_to`` a ``rep`` dim and ``md.rearrange`` ``(mol rep)``),
concatenated with the local output, and a conv maps it back to d_model per char. The loss is the
character cross-entropy at fed masked positions.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 8
    chars: int = 64
    hashes: int = 4
    buckets: int = 64
    d_model: int = 32
    heads: int = 4
    d_ff: int = 64
    layers: int = 2
    local: int = 16
    rate: int = 4
    vocab: int = 64
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=2, chars=16, hashes=2, buckets=8, d_model=8, heads=2, d_ff=16, layers=2,
                   local=4, rate=4, vocab=12)


def _local_attention(h, cfg, p):
    """One layer of attention within windows of ``cfg.local`` chars (composite, masked)."""
    q = md.einsum("batch chars d_model, d_model heads d_head -> batch chars heads d_head", h, p["wq"])
    k = md.einsum("batch chars d_model, d_model heads d_head -> batch chars heads d_head", h, p["wk"])
    v = md.einsum("batch chars d_model, d_model heads d_head -> batch chars heads d_head", h, p["wv"])
    k, v = md.rename(k, chars="key_chars"), md.rename(v, chars="key_chars")
    same = md.equal(md.arange(q.shape["chars"]) // cfg.local, md.arange(k.shape["key_chars"]) // cfg.local)
    scores = md.einsum("batch chars heads d_head, batch key_chars heads d_head -> batch heads chars key_chars", q, k)
    att = md.softmax(md.where(same, scores * (cfg.d_model // cfg.heads) ** -0.5, -1e9), "key_chars")
    o = md.einsum("batch heads chars key_chars, batch key_chars heads d_head -> batch chars heads d_head", att, v)
    o = md.einsum("batch chars heads d_head, heads d_head d_model -> batch chars d_model", o, p["wo"])
    return md.layer_norm(h + o, "d_model", p["ln"])


def _deep_block(x, p):
    h = md.layer_norm(x, "d_model", p["ln1"])
    q = md.einsum("batch mol d_model, d_model heads d_head -> batch mol heads d_head", h, p["wq"])
    k = md.einsum("batch mol d_model, d_model heads d_head -> batch mol heads d_head", h, p["wk"])
    v = md.einsum("batch mol d_model, d_model heads d_head -> batch mol heads d_head", h, p["wv"])
    k, v = md.rename(k, mol="key_mol"), md.rename(v, mol="key_mol")
    a = md.attention(q, k, v, "mol", "key_mol", "d_head", causal=False)
    x = x + md.einsum("batch mol heads d_head, heads d_head d_model -> batch mol d_model", a, p["wo"])
    h = md.layer_norm(x, "d_model", p["ln2"])
    f = md.gelu(md.einsum("batch mol d_model, d_model d_ff -> batch mol d_ff", h, p["w1"]))
    return x + md.einsum("batch mol d_ff, d_ff d_model -> batch mol d_model", f, p["w2"])


def _attn_params(prefix, D, H, E, lead=()):
    fo = [d.name for d in lead]
    return {
        "wq": md.param(f"{prefix}wq", [*lead, D, H, E], fan_out=[*fo, "heads", "d_head"]),
        "wk": md.param(f"{prefix}wk", [*lead, D, H, E], fan_out=[*fo, "heads", "d_head"]),
        "wv": md.param(f"{prefix}wv", [*lead, D, H, E], fan_out=[*fo, "heads", "d_head"]),
        "wo": md.param(f"{prefix}wo", [*lead, H, E, D], fan_out=[*fo, "d_model"]),
    }


def build(cfg: Config) -> md.Model:
    B, S, D = md.Dim("batch", cfg.batch), md.Dim("chars", cfg.chars), md.Dim("d_model", cfg.d_model)
    H, E, F = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_model // cfg.heads), md.Dim("d_ff", cfg.d_ff)
    L, V, N = md.Dim("layer", cfg.layers), md.Dim("vocab", cfg.vocab), md.Dim("buckets", cfg.buckets)
    with md.Graph() as g:
        ids = [md.input(f"hash{i}", [B, S], dtype=torch.int64) for i in range(cfg.hashes)]
        labels = md.input("labels", [B, S], dtype=torch.int64)
        masked = md.input("masked", [B, S], dtype=torch.bool)
        tables = [md.param(f"table{i}", [N, D], scale=0.5) for i in range(cfg.hashes)]
        h = md.gather(tables[0], ids[0], "buckets")
        for t, i in zip(tables[1:], ids[1:]):
            h = h + md.gather(t, i, "buckets")
        h = h + md.param("pos", [S, D], scale=0.1)
        local = _local_attention(h, cfg, {**_attn_params("loc_", D, H, E), "ln": md.param("loc_ln", [D], init="ones")})
        # downsample: a strided conv over chars, rate taps and stride rate
        w_down = md.param("w_down", [md.Dim("tap", cfg.rate), D, md.Dim("d_out", cfg.d_model)], fan_out=["d_out"])
        mol = md.conv(local, w_down, {"chars": "tap"}, padding="valid", stride=cfg.rate)
        mol = md.rename(mol, chars="mol", d_out="d_model")
        stacked = {**_attn_params("", D, H, E, lead=(L,)),
                   "ln1": md.param("ln1", [L, D], init="ones"), "ln2": md.param("ln2", [L, D], init="ones"),
                   "w1": md.param("w1", [L, D, F], fan_out=["layer", "d_ff"]),
                   "w2": md.param("w2", [L, F, D], fan_out=["layer", "d_model"])}
        deep = md.repeat(_deep_block, mol, stacked, "layer", remat=cfg.remat)
        # upsample: each molecule copied to its rate chars
        R = md.Dim("rep", cfg.rate)
        up = md.broadcast_to(deep, [deep.shape["batch"], deep.shape["mol"], R, D])
        up = md.rename(md.rearrange(up, "batch mol rep d_model -> batch (mol rep) d_model"), mol_rep="chars")
        both = md.rename(md.concat([local, up], "d_model"), d_model="d_cat")
        w_up = md.param("w_up", [md.Dim("tap", cfg.rate), md.Dim("d_cat", 2 * cfg.d_model), D], fan_out=["d_model"])
        out = md.layer_norm(md.conv(both, w_up, {"chars": "tap"}, padding="same"), "d_model",
                            md.param("ln_f", [D], init="ones"))
        logits = md.einsum("batch chars d_model, d_model vocab -> batch chars vocab", out,
                           md.param("w_out", [D, V], fan_out=["vocab"]))
        keep = md.cast(masked, torch.float32)
        loss = md.reduce_sum(md.cross_entropy(logits, labels, "vocab") * keep) / md.reduce_sum(keep)

    def make_feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        chars = torch.randint(0, cfg.vocab, (cfg.batch, cfg.chars), generator=gen)
        masked_ = torch.rand(cfg.batch, cfg.chars, generator=gen) < 0.25
        masked_[:, 0] = True
        seen = torch.where(masked_, torch.full_like(chars, cfg.vocab), chars)   # a [MASK] code point
        primes = [31, 43, 59, 61, 73, 97, 103, 113]
        feeds = {f"hash{i}": (seen * primes[i] + i) % cfg.buckets for i in range(cfg.hashes)}
        return {**feeds, "labels": chars, "masked": masked_}

    return md.Model(g, loss, g.params(), make_feeds, cfg)


REF_INPUTS = tuple(f"hash{i}" for i in range(Config.tiny().hashes)) + ("labels", "masked")


def reference_loss(cfg: Config, p: dict, *feeds):
    """The same model in plain torch: table rows summed, a block-diagonal mask, conv1d with stride,
    sdpa, repeat_interleave for the upsampling."""
    import torch.nn.functional as F
    *ids, labels, masked = feeds
    h = sum(p[f"table{i}"][t] for i, t in enumerate(ids)) + p["pos"]
    d = cfg.d_model

    def heads(t, w):
        return torch.einsum("bsd,dhe->bhse", t, w)

    q, k, v = (heads(h, p[f"loc_w{n}"]) for n in "qkv")
    pos = torch.arange(cfg.chars)
    same = (pos[:, None] // cfg.local) == (pos[None, :] // cfg.local)
    scores = torch.where(same, q @ k.transpose(-1, -2) * (d // cfg.heads) ** -0.5, torch.tensor(-1e9, dtype=q.dtype))
    o = torch.einsum("bhse,hed->bsd", scores.softmax(-1) @ v, p["loc_wo"])
    local = F.layer_norm(h + o, (d,), p["loc_ln"])
    x = F.conv1d(local.transpose(1, 2), p["w_down"].permute(2, 1, 0), stride=cfg.rate).transpose(1, 2)
    for i in range(cfg.layers):
        n1 = F.layer_norm(x, (d,), p["ln1"][i])
        a = F.scaled_dot_product_attention(heads(n1, p["wq"][i]), heads(n1, p["wk"][i]), heads(n1, p["wv"][i]))
        x = x + torch.einsum("bhse,hed->bsd", a, p["wo"][i])
        x = x + F.gelu(F.layer_norm(x, (d,), p["ln2"][i]) @ p["w1"][i]) @ p["w2"][i]
    both = torch.cat([local, x.repeat_interleave(cfg.rate, 1)], -1).transpose(1, 2)
    before = (cfg.rate - 1) // 2
    out = F.conv1d(F.pad(both, (before, cfg.rate - 1 - before)), p["w_up"].permute(2, 1, 0)).transpose(1, 2)
    logits = F.layer_norm(out, (d,), p["ln_f"]) @ p["w_out"]
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    keep = masked.flatten().to(ce.dtype)
    return (ce * keep).sum() / keep.sum()
