"""CLAP-lite (audio-text contrastive), a held-out model (round 23a).

Legend: batch = audio-text pairs, frames / mels = the fed spectrogram, c_in/c_mid/c_out = conv
channels, seq = text tokens, vocab, d_model / heads / d_head / d_ff = the text transformer, d_emb = the
joint space, text = the batch renamed as the logits matrix's text side. Audio: two 3-tap convs over
frames (relu), mean over frames, a projection; text: embeddings + positions, pre-norm blocks under
md.repeat, mean over seq, a projection. Both L2-normalised; logits = exp(logit_scale) * a . t;
symmetric InfoNCE (audio->text and text->audio cross-entropy, labels arange(batch)).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 8
    frames: int = 32
    mels: int = 16
    c_mid: int = 32
    c_out: int = 32
    vocab: int = 64
    seq: int = 12
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 2
    d_emb: int = 16
    remat: str | None = None

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, frames=6, mels=4, c_mid=6, c_out=6, vocab=11, seq=5, d_model=8, heads=2, d_head=4,
                   d_ff=12, layers=2, d_emb=4)


def _block(x, p):
    h = md.layer_norm(x, "d_model", p["ln1"], p["ln1_b"])
    q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wq"])
    k = md.rename(md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wk"]), seq="key_seq")
    v = md.rename(md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wv"]), seq="key_seq")
    o = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=False)
    x = x + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, p["wo"])
    h = md.layer_norm(x, "d_model", p["ln2"], p["ln2_b"])
    h = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w_fc"]))
    return x + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", h, p["w_proj"])


def _normalise(x, dim: str):
    return x * md.rsqrt(md.reduce_sum(x * x, dim) + 1e-12)


def _text(cfg: Config, ids):
    S, V, D, L = (md.Dim(n, s) for n, s in (("seq", cfg.seq), ("vocab", cfg.vocab), ("d_model", cfg.d_model),
                                            ("layer", cfg.layers)))
    H, E, F = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    x = md.gather(md.param("wte", [V, D], scale=0.5), ids, "vocab") + md.param("wpe", [S, D], scale=0.1)
    stacked = {"ln1": md.param("ln1", [L, D], init="ones"), "ln1_b": md.param("ln1_b", [L, D], init="zeros"),
               "ln2": md.param("ln2", [L, D], init="ones"), "ln2_b": md.param("ln2_b", [L, D], init="zeros"),
               "wo": md.param("wo", [L, H, E, D], fan_out=["layer", "d_model"]),
               "w_fc": md.param("w_fc", [L, D, F], fan_out=["layer", "d_ff"]),
               "w_proj": md.param("w_proj", [L, F, D], fan_out=["layer", "d_model"])}
    for w in ("wq", "wk", "wv"):
        stacked[w] = md.param(w, [L, D, H, E], fan_out=["layer", "heads", "d_head"])
    x = md.repeat(_block, x, stacked, "layer", remat=cfg.remat)
    pooled = md.reduce_mean(x, "seq")
    return md.einsum("batch d_model, d_model d_emb -> batch d_emb", pooled,
                     md.param("proj_t", [D, md.Dim("d_emb", cfg.d_emb)], fan_out=["d_emb"]))


def _audio(cfg: Config, spec):
    C0, C1, C2 = md.Dim("mels", cfg.mels), md.Dim("c_mid", cfg.c_mid), md.Dim("c_out", cfg.c_out)
    tap = md.Dim("tap", 3)
    h = md.relu(md.conv(spec, md.param("conv1", [tap, C0, C1], fan_out=[C1]), {"frames": "tap"}, padding="same"))
    h = md.rename(h, c_mid="c_in")
    h = md.relu(md.conv(h, md.param("conv2", [tap, md.Dim("c_in", cfg.c_mid), C2], fan_out=[C2]),
                        {"frames": "tap"}, padding="same"))
    pooled = md.reduce_mean(h, "frames")
    return md.einsum("batch c_out, c_out d_emb -> batch d_emb", pooled,
                     md.param("proj_a", [C2, md.Dim("d_emb", cfg.d_emb)], fan_out=["d_emb"]))


def build(cfg: Config) -> md.Model:
    B = md.Dim("batch", cfg.batch)
    with md.Graph() as g:
        spec = md.input("spec", [B, md.Dim("frames", cfg.frames), md.Dim("mels", cfg.mels)])
        ids = md.input("ids", [B, md.Dim("seq", cfg.seq)], dtype=torch.int64)
        a = _normalise(_audio(cfg, spec), "d_emb")
        t = md.rename(_normalise(_text(cfg, ids), "d_emb"), batch="text")
        scale = md.exp(md.param("logit_scale", [], init="zeros") + math.log(1 / 0.07))
        logits = md.einsum("batch d_emb, text d_emb -> batch text", a, t) * scale
        labels = md.arange(B)
        a2t = md.cross_entropy(logits, labels, "text")
        t2a = md.cross_entropy(md.rename(logits, {"batch": "text", "text": "batch"}), labels, "text")
        loss = 0.5 * (md.reduce_mean(a2t) + md.reduce_mean(t2a))

    def feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        return {"spec": torch.randn(cfg.batch, cfg.frames, cfg.mels, generator=gen),
                "ids": torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)}

    return md.Model(g, loss, g.params(), feeds, cfg)


REF_INPUTS = ("spec", "ids")


def reference_loss(cfg: Config, p: dict, spec, ids):
    """The same model in plain torch (F.conv1d, sdpa, F.cross_entropy both ways)."""
    F = torch.nn.functional
    h = F.relu(F.conv1d(spec.transpose(1, 2), p["conv1"].permute(2, 1, 0), padding=1))
    h = F.relu(F.conv1d(h, p["conv2"].permute(2, 1, 0), padding=1))
    a = h.mean(2) @ p["proj_a"]
    D = cfg.d_model
    x = p["wte"][ids] + p["wpe"]
    for i in range(cfg.layers):
        h = F.layer_norm(x, (D,), p["ln1"][i], p["ln1_b"][i])
        q, k, v = (torch.einsum("bsd,dhe->bhse", h, p[w][i]) for w in ("wq", "wk", "wv"))
        o = F.scaled_dot_product_attention(q, k, v)
        x = x + torch.einsum("bhse,hed->bsd", o, p["wo"][i])
        h = F.gelu(F.layer_norm(x, (D,), p["ln2"][i], p["ln2_b"][i]) @ p["w_fc"][i])
        x = x + h @ p["w_proj"][i]
    t = x.mean(1) @ p["proj_t"]
    a = a * torch.rsqrt((a * a).sum(1, keepdim=True) + 1e-12)
    t = t * torch.rsqrt((t * t).sum(1, keepdim=True) + 1e-12)
    logits = a @ t.T * torch.exp(p["logit_scale"] + math.log(1 / 0.07))
    labels = torch.arange(cfg.batch)
    return 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels))
