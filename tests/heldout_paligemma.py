"""Held-out model: a PaliGemma-style prefix LM, written from the docs alone.

Image patch tokens and a text prefix attend to each other bidirectionally; the text suffix
attends causally (to the whole prefix and the suffix before it). The loss is the next-token
cross-entropy on the suffix tokens only. Pre-norm decoder blocks under ``md.repeat``; the
prefix-LM mask is a composite attention (einsum, ``md.where``, softmax), since the fused
``md.attention`` takes only causal and window masks.

``form``: ``fixed`` (every example's text prefix is ``prefix`` tokens long) or ``ragged``
(a per-example prefix length fed as the input ``prefix_len``).

Legend: b batch, p patches, s seq (patches + text), t text, k key_seq, h heads, e d_head,
d d_model, f d_ff, v vocab.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    vocab: int = 256
    d_model: int = 128
    heads: int = 4
    d_head: int = 32
    d_ff: int = 512
    layers: int = 4
    patches: int = 16
    patch_dim: int = 48
    prefix: int = 8
    suffix: int = 8
    batch: int = 8
    remat: str | None = None
    form: str = "fixed"

    @classmethod
    def tiny(cls):
        return cls(vocab=32, d_model=16, heads=2, d_head=8, d_ff=32, layers=2, patches=4,
                   patch_dim=6, prefix=3, suffix=3, batch=4)


def _block(x_bsd, p, keep, cfg):
    scale = cfg.d_head ** -0.5
    h = md.layer_norm(x_bsd, "d_model", p["ln1"], p["ln1_b"])
    q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wq"])
    k = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wk"])
    v = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wv"])
    k, v = md.rename(k, seq="key_seq"), md.rename(v, seq="key_seq")
    scores = md.einsum("batch seq heads d_head, batch key_seq heads d_head -> batch heads seq key_seq", q, k)
    att = md.softmax(md.where(keep, scores * scale, -1e9), "key_seq")
    o = md.einsum("batch heads seq key_seq, batch key_seq heads d_head -> batch seq heads d_head", att, v)
    x_bsd = x_bsd + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, p["wo"])
    h = md.layer_norm(x_bsd, "d_model", p["ln2"], p["ln2_b"])
    h = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w_fc"]))
    return x_bsd + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", h, p["w_proj"])


def build(cfg: Config) -> md.Model:
    if cfg.form not in ("fixed", "ragged"):
        raise ValueError(f"form must be 'fixed' or 'ragged', got {cfg.form!r}")
    B, P, PD = md.Dim("batch", cfg.batch), md.Dim("patches", cfg.patches), md.Dim("patch_dim", cfg.patch_dim)
    T, V, D = md.Dim("text", cfg.prefix + cfg.suffix), md.Dim("vocab", cfg.vocab), md.Dim("d_model", cfg.d_model)
    S = md.Dim("seq", cfg.patches + T.size)
    K = md.Dim("key_seq", S.size)
    H, E, F, L = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff), md.Dim("layer", cfg.layers)
    with md.Graph() as g:
        img = md.input("image", [B, P, PD])
        ids, labels = md.input("ids", [B, T], torch.int64), md.input("labels", [B, T], torch.int64)
        params = {
            "w_img": md.param("w_img", [PD, D], fan_out=["d_model"]),
            "wte": md.param("wte", [V, D], scale=0.5),
            "wpe": md.param("wpe", [S, D], scale=0.1),
            "ln1": md.param("ln1", [L, D], init="ones"), "ln1_b": md.param("ln1_b", [L, D], init="zeros"),
            "wq": md.param("wq", [L, D, H, E], fan_out=["layer", "heads", "d_head"]),
            "wk": md.param("wk", [L, D, H, E], fan_out=["layer", "heads", "d_head"]),
            "wv": md.param("wv", [L, D, H, E], fan_out=["layer", "heads", "d_head"]),
            "wo": md.param("wo", [L, H, E, D], fan_out=["layer", "d_model"]),
            "ln2": md.param("ln2", [L, D], init="ones"), "ln2_b": md.param("ln2_b", [L, D], init="zeros"),
            "w_fc": md.param("w_fc", [L, D, F], fan_out=["layer", "d_ff"]),
            "w_proj": md.param("w_proj", [L, F, D], fan_out=["layer", "d_model"]),
            "lnf": md.param("lnf", [D], init="ones"),
            "w_head": md.param("w_head", [D, V], fan_out=["vocab"]),
        }
        x_img = md.rename(md.einsum("batch patches patch_dim, patch_dim d_model -> batch patches d_model",
                                    img, params["w_img"]), patches="seq")
        x_txt = md.rename(md.gather(params["wte"], ids, "vocab"), text="seq")
        x = md.concat([x_img, x_txt], "seq") + params["wpe"]
        text_pos = md.arange(T)
        if cfg.form == "fixed":
            bound = cfg.patches + cfg.prefix                       # keys before it: the prefix
            on_suffix = md.cast(text_pos >= cfg.prefix, torch.float32)
        else:
            prefix_len = md.input("prefix_len", [B], torch.int64)
            bound = prefix_len + cfg.patches
            on_suffix = md.cast(text_pos >= prefix_len, torch.float32)   # [text, batch]
        keep = md.logical_or(md.causal_mask(S, K), md.less(md.arange(K), bound))
        stacked = {n: t for n, t in params.items() if t.shape.names[0] == "layer"}
        x = md.repeat(lambda c, p: _block(c, p, keep, cfg), x, stacked, "layer", remat=cfg.remat)
        h = md.layer_norm(md.rename(md.slice_(x, "seq", cfg.patches, S.size), seq="text"), "d_model", params["lnf"])
        logits = md.einsum("batch text d_model, d_model vocab -> batch text vocab", h, params["w_head"])
        ce = md.cross_entropy(logits, labels, "vocab")
        loss = md.reduce_sum(ce * on_suffix) / md.reduce_sum(md.broadcast_to(on_suffix, ce.shape))

    def make_feeds(seed):
        gen = torch.Generator().manual_seed(seed)
        feeds = {"image": torch.randn(cfg.batch, cfg.patches, cfg.patch_dim, generator=gen),
                 "ids": torch.randint(0, cfg.vocab, (cfg.batch, T.size), generator=gen),
                 "labels": torch.randint(0, cfg.vocab, (cfg.batch, T.size), generator=gen)}
        if cfg.form == "ragged":
            feeds["prefix_len"] = torch.randint(1, T.size, (cfg.batch,), generator=gen)
        return feeds

    return md.Model(g, loss, params, make_feeds, cfg)
