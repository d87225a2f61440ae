"""Byte Latent Transformer-lite: bytes pooled into patches, a global transformer over patches,
and a local decoder that predicts the next byte.

Each byte carries a fed patch id (monotone along ``bytes``, below ``patches``). A patch's
representation is the mean of its bytes' embeddings (a one-hot of the patch ids contracted with
the embeddings, divided by the count, zero for an empty patch). A causal transformer runs over
the patches under ``md.repeat``; each byte then reads its own patch's state (the same one-hot)
and cross-attends over the patches up to its own (a composite attention with a mask from the
patch ids), and a byte-level MLP and head give the next byte's cross-entropy.

Legend: b batch, n bytes, p patches (k key_patches), d d_model, h heads, e d_head, f d_ff,
v vocab, l layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    vocab: int = 256
    bytes: int = 32
    patches: int = 8
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 2
    batch: int = 8
    remat: str | None = None      # md.repeat's activation checkpointing (none, full, selective)

    @classmethod
    def tiny(cls) -> "Config":
        return cls(vocab=16, bytes=9, patches=4, d_model=8, heads=2, d_head=4, d_ff=12, layers=2, batch=4)


def build(cfg: Config = Config()) -> md.Model:
    b, n, p = md.Dim("batch", cfg.batch), md.Dim("bytes", cfg.bytes), md.Dim("patches", cfg.patches)
    d, h, e = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    f, v, lyr = md.Dim("d_ff", cfg.d_ff), md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    with md.Graph("blt") as g:
        ids = md.input("ids", [b, n], dtype=torch.int64)
        labels = md.input("labels", [b, n], dtype=torch.int64)
        patch_id = md.input("patch_id", [b, n], dtype=torch.int64)
        emb = md.param("emb", [v, d], fan_out=[d])
        wpe = md.param("wpe", [p, d], scale=0.02)
        stacked = {
            "ln1": md.param("ln1", [lyr, d], init="ones"), "ln2": md.param("ln2", [lyr, d], init="ones"),
            "wq": md.param("wq", [lyr, d, h, e], fan_out=["layer", "heads", "d_head"]),
            "wk": md.param("wk", [lyr, d, h, e], fan_out=["layer", "heads", "d_head"]),
            "wv": md.param("wv", [lyr, d, h, e], fan_out=["layer", "heads", "d_head"]),
            "wo": md.param("wo", [lyr, h, e, d], fan_out=["layer", "d_model"]),
            "w1": md.param("w1", [lyr, d, f], fan_out=["layer", "d_ff"]),
            "w2": md.param("w2", [lyr, f, d], fan_out=["layer", "d_model"]),
        }
        cq = md.param("cq", [d, h, e], fan_out=["heads", "d_head"])
        ck = md.param("ck", [d, h, e], fan_out=["heads", "d_head"])
        cv = md.param("cv", [d, h, e], fan_out=["heads", "d_head"])
        co = md.param("co", [h, e, d], fan_out=["d_model"])
        lw1 = md.param("lw1", [d, f], fan_out=[f])
        lw2 = md.param("lw2", [f, d], fan_out=[d])
        lnl = md.param("lnl", [d], init="ones")
        head = md.param("head", [d, v], fan_out=[v])

        x_bnd = md.gather(emb, ids, "vocab")
        onehot_bnp = md.one_hot(patch_id, p)
        sums_bpd = md.einsum("batch bytes patches, batch bytes d_model -> batch patches d_model", onehot_bnp, x_bnd)
        counts_bp = md.reduce_sum(onehot_bnp, "bytes")
        patch_bpd = md.where(counts_bp > 0, sums_bpd / md.maximum(counts_bp, 1.0), 0.0) + wpe

        def block(x, w):
            a = md.layer_norm(x, "d_model", w["ln1"])
            q = md.einsum("batch patches d_model, d_model heads d_head -> batch patches heads d_head", a, w["wq"])
            k = md.rename(md.einsum("batch patches d_model, d_model heads d_head -> batch patches heads d_head", a, w["wk"]), patches="key_patches")
            val = md.rename(md.einsum("batch patches d_model, d_model heads d_head -> batch patches heads d_head", a, w["wv"]), patches="key_patches")
            y = md.attention(q, k, val, "patches", "key_patches", "d_head", causal=True)
            x = x + md.einsum("batch patches heads d_head, heads d_head d_model -> batch patches d_model", y, w["wo"])
            m = md.layer_norm(x, "d_model", w["ln2"])
            u = md.gelu(md.einsum("batch patches d_model, d_model d_ff -> batch patches d_ff", m, w["w1"]))
            return x + md.einsum("batch patches d_ff, d_ff d_model -> batch patches d_model", u, w["w2"])

        g_bpd = md.repeat(block, patch_bpd, stacked, "layer", remat=cfg.remat)
        own_bnd = md.einsum("batch bytes patches, batch patches d_model -> batch bytes d_model", onehot_bnp, g_bpd)
        q = md.einsum("batch bytes d_model, d_model heads d_head -> batch bytes heads d_head", x_bnd, cq)
        k = md.einsum("batch patches d_model, d_model heads d_head -> batch patches heads d_head", g_bpd, ck)
        val = md.einsum("batch patches d_model, d_model heads d_head -> batch patches heads d_head", g_bpd, cv)
        scores = md.einsum("batch bytes heads d_head, batch patches heads d_head -> batch heads bytes patches", q, k)
        visible = md.less_equal(md.arange(p), patch_id)            # [patches, batch, bytes]
        att = md.softmax(md.where(visible, scores * cfg.d_head ** -0.5, -1e9), "patches")
        cross = md.einsum("batch heads bytes patches, batch patches heads d_head -> batch bytes heads d_head", att, val)
        z = x_bnd + own_bnd + md.einsum("batch bytes heads d_head, heads d_head d_model -> batch bytes d_model", cross, co)
        u = md.gelu(md.einsum("batch bytes d_model, d_model d_ff -> batch bytes d_ff", md.layer_norm(z, "d_model", lnl), lw1))
        z = z + md.einsum("batch bytes d_ff, d_ff d_model -> batch bytes d_model", u, lw2)
        logits = md.einsum("batch bytes d_model, d_model vocab -> batch bytes vocab", z, head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        toks = torch.randint(0, cfg.vocab, (cfg.batch, cfg.bytes + 1), generator=gen)
        # monotone patch ids: a patch starts at a byte with probability 1/2, capped at patches - 1
        starts = torch.rand(cfg.batch, cfg.bytes, generator=gen) < 0.5
        starts[:, 0] = False
        pid = torch.cumsum(starts.long(), dim=1).clamp(max=cfg.patches - 1)
        return {"ids": toks[:, :-1], "labels": toks[:, 1:], "patch_id": pid}

    return md.Model(g, loss, g.params(), feeds, cfg, logits=logits)


# ---- the plain-torch reference (tests/test_heldout_round26a.py compares it with the model) ----

REF_INPUTS = ["ids", "labels", "patch_id"]


def _ref_attention_in(x, wq, wk, wv):
    """q, k, v ``[batch, heads, n, d_head]`` of ``x [batch, n, d]`` (weights ``[d, heads, d_head]``)."""
    return [torch.einsum("bnd,dhe->bhne", x, w) for w in (wq, wk, wv)]


def reference_loss(cfg: Config, p: dict, ids, labels, patch_id):
    """The model in plain torch: segment means by scatter_add, sdpa for the global stack, a
    boolean mask of patch ids for the cross-attention."""
    F = torch.nn.functional
    x = p["emb"][ids]                                             # [b, n, d]
    idx = patch_id.unsqueeze(-1).expand_as(x)
    sums = torch.zeros(cfg.batch, cfg.patches, cfg.d_model, dtype=x.dtype).scatter_add(1, idx, x)
    counts = torch.zeros(cfg.batch, cfg.patches, dtype=x.dtype).scatter_add(1, patch_id, torch.ones_like(patch_id, dtype=x.dtype))
    z = sums / counts.clamp(min=1).unsqueeze(-1) + p["wpe"]
    for i in range(cfg.layers):
        a = F.layer_norm(z, (cfg.d_model,), p["ln1"][i])
        y = F.scaled_dot_product_attention(*_ref_attention_in(a, p["wq"][i], p["wk"][i], p["wv"][i]), is_causal=True)
        z = z + torch.einsum("bhne,hed->bnd", y, p["wo"][i])
        m = F.layer_norm(z, (cfg.d_model,), p["ln2"][i])
        z = z + F.gelu(m @ p["w1"][i]) @ p["w2"][i]
    own = torch.gather(z, 1, idx)
    q = torch.einsum("bnd,dhe->bhne", x, p["cq"])
    k, v = (torch.einsum("bpd,dhe->bhpe", z, p[w]) for w in ("ck", "cv"))
    visible = torch.arange(cfg.patches) <= patch_id.unsqueeze(-1)   # [b, n, p]
    cross = F.scaled_dot_product_attention(q, k, v, attn_mask=visible.unsqueeze(1))
    h = x + own + torch.einsum("bhne,hed->bnd", cross, p["co"])
    h = h + F.gelu(F.layer_norm(h, (cfg.d_model,), p["lnl"]) @ p["lw1"]) @ p["lw2"]
    return F.cross_entropy((h @ p["head"]).reshape(-1, cfg.vocab), labels.reshape(-1))
