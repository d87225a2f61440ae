"""Held-out model (round 17b): SE-ResNet, or a CoAtNet-lite (SE-ResNet stage + transformer stage).

Legend: b = batch, y = height, x = width, c = channels (c_in of a conv; c_out its output, renamed
back), kh/kw = conv taps, r = se (squeeze width), n = classes; CoAtNet stage: s = seq (the flattened
map), h = heads, e = d_head, f = d_ff, rel = the 2-D relative positions ((2H-1) x (2W-1)).

Stem: a 3x3 'same' conv, relu. Residual blocks under ``md.repeat`` over ``layer``: conv 3x3, layer
norm over channels, relu, conv 3x3, layer norm, squeeze-and-excitation (global mean over height and
width, FC to ``se``, relu, FC back, sigmoid, a channel gate), residual add, relu. Form ``se``: mean
pool, linear head, cross-entropy. Form ``coatnet``: the map flattened to ``seq`` by a rearrange
(``(height width)``), pre-norm transformer blocks under ``md.repeat`` over ``tlayer`` whose attention
adds a learned relative position bias per head (a table ``[heads, rel]`` gathered by each
(query, key)'s 2-D offset, made from ``arange`` with ``//`` and ``%``), then mean pool and the head.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    height: int = 16
    width: int = 16
    c_img: int = 3
    channels: int = 32
    se: int = 8
    layers: int = 2
    heads: int = 4
    d_ff: int = 64
    tlayers: int = 2
    classes: int = 10
    batch: int = 8
    form: str = "se"    # se | coatnet
    remat: str = "none"

    @classmethod
    def tiny(cls):
        return cls(height=6, width=4, c_img=3, channels=8, se=4, layers=2, heads=2, d_ff=16, tlayers=2,
                   classes=5, batch=4)


def _conv(x, w):
    y = md.conv(x, w, {"height": "kh", "width": "kw"}, padding="same")
    return md.rename(y, c_out="channels")


def _se_block(x, p):
    h = md.relu(md.layer_norm(_conv(x, p["c1"]), "channels", p["n1"]))
    h = md.layer_norm(_conv(md.rename(h, channels="c_in"), p["c2"]), "channels", p["n2"])
    pooled = md.reduce_mean(h, ["height", "width"])                              # [batch, channels]
    z = md.relu(md.einsum("batch channels, channels se -> batch se", pooled, p["fc1"]))
    gate = md.sigmoid(md.einsum("batch se, se channels -> batch channels", z, p["fc2"]) + p["fc2_b"])
    return md.rename(md.relu(h * gate + md.rename(x, c_in="channels")), channels="c_in")


def _rel_bias_ids(cfg, S, KS):
    """The flat 2-D relative offset of each (query, key) pair, ``[seq, key_seq]`` in [0, rel)."""
    q, k = md.arange(S), md.arange(KS)
    dy = q // cfg.width - k // cfg.width + (cfg.height - 1)
    dx = q % cfg.width - k % cfg.width + (cfg.width - 1)
    return dy * (2 * cfg.width - 1) + dx


def _transformer_stage(x, cfg, D):
    S, KS = md.Dim("seq", cfg.height * cfg.width), md.Dim("key_seq", cfg.height * cfg.width)
    H, E, F = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.channels // cfg.heads), md.Dim("d_ff", cfg.d_ff)
    L, R = md.Dim("tlayer", cfg.tlayers), md.Dim("rel", (2 * cfg.height - 1) * (2 * cfg.width - 1))
    ps = {"t_ln1": md.param("t_ln1", [L, D], init="ones"), "t_ln2": md.param("t_ln2", [L, D], init="ones"),
          "t_rel": md.param("t_rel", [L, H, R], scale=0.1)}
    for n, shape, fo in (("t_wq", [L, D, H, E], ["heads", "d_head"]), ("t_wk", [L, D, H, E], ["heads", "d_head"]),
                         ("t_wv", [L, D, H, E], ["heads", "d_head"]), ("t_wo", [L, H, E, D], ["d_model"]),
                         ("t_w1", [L, D, F], ["d_ff"]), ("t_w2", [L, F, D], ["d_model"])):
        ps[n] = md.param(n, shape, fan_out=["tlayer", *fo])
    rel_ids = _rel_bias_ids(cfg, S, KS)

    def block(h, p):
        a = md.layer_norm(h, "d_model", p["t_ln1"])
        q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", a, p["t_wq"])
        kv = md.rename(a, seq="key_seq")
        k = md.einsum("batch key_seq d_model, d_model heads d_head -> batch key_seq heads d_head", kv, p["t_wk"])
        v = md.einsum("batch key_seq d_model, d_model heads d_head -> batch key_seq heads d_head", kv, p["t_wv"])
        scores = md.einsum("batch seq heads d_head, batch key_seq heads d_head -> batch heads seq key_seq", q, k)
        bias = md.gather(p["t_rel"], rel_ids, "rel")                          # [heads, seq, key_seq]
        att = md.softmax(scores * E.size ** -0.5 + bias, "key_seq")
        y = md.einsum("batch heads seq key_seq, batch key_seq heads d_head -> batch seq heads d_head", att, v)
        h = h + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", y, p["t_wo"])
        m = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff",
                              md.layer_norm(h, "d_model", p["t_ln2"]), p["t_w1"]))
        return h + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", m, p["t_w2"])

    return md.repeat(block, x, ps, L, remat=cfg.remat), ps


def build(cfg: Config) -> md.Model:
    if cfg.form not in ("se", "coatnet"):
        raise ValueError(f"form must be 'se' or 'coatnet', not {cfg.form!r}")
    B, Y, X = md.Dim("batch", cfg.batch), md.Dim("height", cfg.height), md.Dim("width", cfg.width)
    CI, C = md.Dim("c_in", cfg.channels), md.Dim("c_out", cfg.channels)
    KH, KW, L = md.Dim("kh", 3), md.Dim("kw", 3), md.Dim("layer", cfg.layers)
    Ch, R, N = md.Dim("channels", cfg.channels), md.Dim("se", cfg.se), md.Dim("classes", cfg.classes)
    with md.Graph() as g:
        img = md.input("img", [B, Y, X, md.Dim("c_img", cfg.c_img)])
        labels = md.input("labels", [B], dtype=torch.int64)
        stem = md.param("stem", [KH, KW, md.Dim("c_img", cfg.c_img), C], fan_out=["c_out"])
        x = md.rename(md.relu(md.conv(img, stem, {"height": "kh", "width": "kw"}, padding="same")), c_out="c_in")
        ps = {"c1": md.param("c1", [L, KH, KW, CI, C], fan_out=["layer", "c_out"]),
              "c2": md.param("c2", [L, KH, KW, CI, C], fan_out=["layer", "c_out"]),
              "n1": md.param("n1", [L, Ch], init="ones"), "n2": md.param("n2", [L, Ch], init="ones"),
              "fc1": md.param("fc1", [L, Ch, R], fan_out=["layer", "se"]),
              "fc2": md.param("fc2", [L, R, Ch], fan_out=["layer", "channels"]),
              "fc2_b": md.param("fc2_b", [L, Ch], init="zeros")}
        x = md.repeat(_se_block, x, ps, L, remat=cfg.remat)                                    # [batch, height, width, c_in]
        params = {"stem": stem, **ps}
        if cfg.form == "coatnet":
            D = md.Dim("d_model", cfg.channels)
            seq = md.rearrange(x, "batch height width c_in -> batch (height width) c_in")
            seq = md.rename(seq, {"height_width": "seq", "c_in": "d_model"})
            seq, tps = _transformer_stage(seq, cfg, D)
            params.update(tps)
            lnf = md.param("lnf", [D], init="ones")
            params["lnf"] = lnf
            pooled = md.rename(md.reduce_mean(md.layer_norm(seq, "d_model", lnf), "seq"), d_model="c_in")
        else:
            pooled = md.reduce_mean(x, ["height", "width"])
        head = md.param("head", [CI, N], fan_out=["classes"])
        params["head"] = head
        logits = md.einsum("batch c_in, c_in classes -> batch classes", pooled, head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))

    def make_feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        return {"img": torch.randn(cfg.batch, cfg.height, cfg.width, cfg.c_img, generator=gen),
                "labels": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    return md.Model(g, loss, params, make_feeds, cfg)
