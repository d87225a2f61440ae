"""Held-out model: MEGABYTE, a byte LM over patches (h17a).

Bytes are grouped into patches, seq = (patches patch). A global causal transformer runs over the
patch embeddings (each patch's per-byte global embeddings concatenated, shifted right by one
patch, plus a learned patch position); a local causal transformer runs within each patch over the
byte embeddings shifted right by one byte, plus the global output projected per byte. The loss is
the cross-entropy of every byte (inputs are shifted inside the model, so the labels are the bytes).
Config.form: ``fused`` (md.attention in both models) or ``composite`` (einsum + mask + softmax).

Legend: b batch, p patches, t patch (byte in patch), g d_global = (patch ge), ge per-byte global width,
dl d_local; global dims heads/d_head/d_ff/layer, local l_heads/l_head/l_ff/l_layer.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    vocab: int = 256
    patch: int = 4
    patches: int = 8
    ge: int = 8
    heads: int = 4
    d_ff: int = 64
    layers: int = 2
    d_local: int = 16
    l_heads: int = 2
    l_ff: int = 32
    l_layers: int = 2
    batch: int = 4
    form: str = "fused"
    remat: str | None = None

    @classmethod
    def tiny(cls):
        return cls(vocab=16, patch=4, patches=4, ge=4, heads=2, d_ff=16, layers=2, d_local=8, l_heads=2, l_ff=16,
                   l_layers=2, batch=2)


def _attend(x, p, names, form):
    """Pre-norm causal self-attention over names['q'] and a gelu MLP, residual; names maps roles to dims."""
    q_dim, k_dim, d, h, e, f = (names[r] for r in ("q", "k", "d", "h", "e", "f"))
    others = names["batch"]
    z = md.rms_norm(x, d, p["n1"])
    proj = f"{others} {q_dim} {d}, {d} {h} {e} -> {others} {q_dim} {h} {e}"
    q = md.einsum(proj, z, p["wq"])
    k = md.rename(md.einsum(proj, z, p["wk"]), {q_dim: k_dim})
    v = md.rename(md.einsum(proj, z, p["wv"]), {q_dim: k_dim})
    if form == "fused":
        y = md.attention(q, k, v, q_dim, k_dim, e, causal=True)
    else:
        s = md.einsum(f"{others} {q_dim} {h} {e}, {others} {k_dim} {h} {e} -> {others} {h} {q_dim} {k_dim}", q, k)
        mask = md.causal_mask(q.shape[q_dim], k.shape[k_dim])
        a = md.softmax(md.where(mask, s * q.shape[e].size ** -0.5, -1e9), k_dim)
        y = md.einsum(f"{others} {h} {q_dim} {k_dim}, {others} {k_dim} {h} {e} -> {others} {q_dim} {h} {e}", a, v)
    x = x + md.einsum(f"{others} {q_dim} {h} {e}, {h} {e} {d} -> {others} {q_dim} {d}", y, p["wo"])
    m = md.gelu(md.einsum(f"{others} {q_dim} {d}, {d} {f} -> {others} {q_dim} {f}", md.rms_norm(x, d, p["n2"]), p["w1"]))
    return x + md.einsum(f"{others} {q_dim} {f}, {f} {d} -> {others} {q_dim} {d}", m, p["w2"])


def _stack(prefix, L, D, H, E, F):
    lay = L.name
    return {
        "n1": md.param(f"{prefix}n1", [L, D], init="ones"), "n2": md.param(f"{prefix}n2", [L, D], init="ones"),
        "wq": md.param(f"{prefix}wq", [L, D, H, E], fan_out=[lay, H.name, E.name]),
        "wk": md.param(f"{prefix}wk", [L, D, H, E], fan_out=[lay, H.name, E.name]),
        "wv": md.param(f"{prefix}wv", [L, D, H, E], fan_out=[lay, H.name, E.name]),
        "wo": md.param(f"{prefix}wo", [L, H, E, D], fan_out=[lay, D.name]),
        "w1": md.param(f"{prefix}w1", [L, D, F], fan_out=[lay, F.name]),
        "w2": md.param(f"{prefix}w2", [L, F, D], fan_out=[lay, D.name]),
    }


def build(cfg: Config) -> md.Model:
    if cfg.form not in ("fused", "composite"):
        raise ValueError(f"form must be 'fused' or 'composite', got {cfg.form!r}")
    d_global = cfg.patch * cfg.ge
    B, S, V = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.patch * cfg.patches), md.Dim("vocab", cfg.vocab)
    P, T, G = md.Dim("patches", cfg.patches), md.Dim("patch", cfg.patch), md.Dim("d_global", d_global)
    GE, DL = md.Dim("ge", cfg.ge), md.Dim("d_local", cfg.d_local)
    with md.Graph() as g:
        ids = md.input("ids", [B, S], torch.int64)
        glob = _stack("g_", md.Dim("layer", cfg.layers), G, md.Dim("heads", cfg.heads),
                      md.Dim("d_head", d_global // cfg.heads), md.Dim("d_ff", cfg.d_ff))
        loc = _stack("l_", md.Dim("l_layer", cfg.l_layers), DL, md.Dim("l_heads", cfg.l_heads),
                     md.Dim("l_head", cfg.d_local // cfg.l_heads), md.Dim("l_ff", cfg.l_ff))
        params = {
            "g_wte": md.param("g_wte", [V, GE], scale=0.5), "g_pos": md.param("g_pos", [P, G], scale=0.1),
            "l_wte": md.param("l_wte", [V, DL], scale=0.5), "l_pos": md.param("l_pos", [T, DL], scale=0.1),
            "g_to_l": md.param("g_to_l", [GE, DL], fan_out=["d_local"]),
            "normf": md.param("normf", [DL], init="ones"), "head": md.param("head", [DL, V], fan_out=["vocab"]),
            **{p.name: p for p in glob.values()}, **{p.name: p for p in loc.values()},
        }
        g_bytes = md.rearrange(md.gather(params["g_wte"], ids, "vocab"), "batch (patches patch) ge -> batch patches (patch ge)",
                               patch=cfg.patch)
        g_in = md.shift(md.rename(g_bytes, patch_ge="d_global"), "patches", 1) + params["g_pos"]
        g_names = {"q": "patches", "k": "key_patches", "d": "d_global", "h": "heads", "e": "d_head", "f": "d_ff",
                   "batch": "batch"}
        g_out = md.repeat(lambda x, p: _attend(x, p, g_names, cfg.form), g_in, glob, "layer", remat=cfg.remat)
        g_per_byte = md.rearrange(md.rename(g_out, d_global="patch_ge"), "batch patches (patch ge) -> batch patches patch ge",
                                  patch=cfg.patch)
        l_bytes = md.rearrange(md.gather(params["l_wte"], ids, "vocab"),
                               "batch (patches patch) d_local -> batch patches patch d_local",
                               patch=cfg.patch)
        l_in = (md.shift(l_bytes, "patch", 1) + params["l_pos"]
                + md.einsum("batch patches patch ge, ge d_local -> batch patches patch d_local", g_per_byte, params["g_to_l"]))
        l_names = {"q": "patch", "k": "key_patch", "d": "d_local", "h": "l_heads", "e": "l_head", "f": "l_ff",
                   "batch": "batch patches"}
        l_out = md.repeat(lambda x, p: _attend(x, p, l_names, cfg.form), l_in, loc, "l_layer", remat=cfg.remat)
        logits = md.einsum("batch patches patch d_local, d_local vocab -> batch patches patch vocab",
                           md.rms_norm(l_out, "d_local", params["normf"]), params["head"])
        labels = md.rearrange(ids, "batch (patches patch) -> batch patches patch", patch=cfg.patch)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))

    def make_feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        return {"ids": torch.randint(0, cfg.vocab, (cfg.batch, cfg.patch * cfg.patches), generator=gen)}

    return md.Model(g, loss, params, make_feeds, cfg)
