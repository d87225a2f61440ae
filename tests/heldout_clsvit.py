"""A small ViT written as a user would, from the guides only: a model file the CLI loads.

Legend: b batch, y height, x width, c channels, p patches (hp * wp, then the class token
in front: tokens), i/j patch rows and columns (ph, pw), d d_model, m heads, e d_head,
f d_ff, k classes, l layer.

Patches by ``md.rearrange``, a patch embedding by one einsum over (ph, pw, channels), a learned
class token concatenated in front, learned position embeddings, pre-norm LayerNorm encoder blocks
under ``md.repeat``, and an MLP head on the class token's final state. Data: generated images
(a bright square in one of four quadrants, on noise), the class is the quadrant.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 16
    size: int = 8
    channels: int = 2
    patch: int = 4
    d_model: int = 16
    heads: int = 2
    d_head: int = 8
    d_ff: int = 32
    layers: int = 2
    classes: int = 4

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, size=4, channels=2, patch=2, d_model=8, heads=2, d_head=4, d_ff=8, layers=2)


def image(cfg: Config, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """One noisy image with a bright square in quadrant ``label``."""
    label = int(torch.randint(0, 4, (), generator=gen))
    img = 0.3 * torch.randn(cfg.size, cfg.size, cfg.channels, generator=gen)
    h = cfg.size // 2
    r0, c0 = (label // 2) * h, (label % 2) * h
    img[r0:r0 + h, c0:c0 + h] += 1.0
    return img, label


def block(x_btd, p):
    z = md.layer_norm(x_btd, "d_model", p["ln1"], p["ln1_b"])
    q = md.einsum("batch tokens d_model, d_model heads d_head -> batch tokens heads d_head", z, p["wq"])
    k = md.einsum("batch tokens d_model, d_model heads d_head -> batch tokens heads d_head", z, p["wk"])
    v = md.einsum("batch tokens d_model, d_model heads d_head -> batch tokens heads d_head", z, p["wv"])
    y = md.attention(q, md.rename(k, tokens="key_tokens"), md.rename(v, tokens="key_tokens"),
                     "tokens", "key_tokens", "d_head", causal=False)
    x_btd = x_btd + md.einsum("batch tokens heads d_head, heads d_head d_model -> batch tokens d_model", y, p["wo"])
    z = md.layer_norm(x_btd, "d_model", p["ln2"], p["ln2_b"])
    h = md.gelu(md.einsum("batch tokens d_model, d_model d_ff -> batch tokens d_ff", z, p["w1"]) + p["b1"])
    return x_btd + md.einsum("batch tokens d_ff, d_ff d_model -> batch tokens d_model", h, p["w2"])


def build(cfg: Config = Config()) -> md.Model:
    hp = cfg.size // cfg.patch
    b, y, x = md.Dim("batch", cfg.batch), md.Dim("height", cfg.size), md.Dim("width", cfg.size)
    c, d = md.Dim("channels", cfg.channels), md.Dim("d_model", cfg.d_model)
    i, j = md.Dim("ph", cfg.patch), md.Dim("pw", cfg.patch)
    t, m, e = md.Dim("tokens", hp * hp + 1), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    f, k, l = md.Dim("d_ff", cfg.d_ff), md.Dim("classes", cfg.classes), md.Dim("layer", cfg.layers)
    with md.Graph("clsvit") as g:
        images = md.input("images", [b, y, x, c])
        labels = md.input("labels", [b], torch.int64)
        w_patch = md.param("w_patch", [i, j, c, d], fan_out=[d])
        cls_d = md.param("cls", [d], scale=0.02)
        pos_td = md.param("pos", [t, d], scale=0.02)
        stack = {
            "ln1": md.param("ln1", [l, d], init="ones"), "ln1_b": md.param("ln1_b", [l, d], init="zeros"),
            "wq": md.param("wq", [l, d, m, e], fan_out=[l, m, e]),
            "wk": md.param("wk", [l, d, m, e], fan_out=[l, m, e]),
            "wv": md.param("wv", [l, d, m, e], fan_out=[l, m, e]),
            "wo": md.param("wo", [l, m, e, d], fan_out=[l, d]),
            "ln2": md.param("ln2", [l, d], init="ones"), "ln2_b": md.param("ln2_b", [l, d], init="zeros"),
            "w1": md.param("w1", [l, d, f], fan_out=[l, f]), "b1": md.param("b1", [l, f], init="zeros"),
            "w2": md.param("w2", [l, f, d], fan_out=[l, d]),
        }
        lnf, lnf_b = md.param("lnf", [d], init="ones"), md.param("lnf_b", [d], init="zeros")
        w_h1, w_h2 = md.param("w_h1", [d, f], fan_out=[f]), md.param("w_h2", [f, k], fan_out=[k])

        grid = md.rearrange(images, "batch (hp ph) (wp pw) channels -> batch (hp wp) ph pw channels",
                            ph=cfg.patch, pw=cfg.patch)
        emb = md.einsum("batch hp_wp ph pw channels, ph pw channels d_model -> batch hp_wp d_model",
                        grid, w_patch)
        cls_b1d = md.unsqueeze(md.broadcast_to(cls_d, [b, d]), md.Dim("hp_wp", 1), 1)
        x_btd = md.rename(md.concat([cls_b1d, emb], "hp_wp"), hp_wp="tokens") + pos_td
        x_btd = md.repeat(block, x_btd, stack, l)
        z_bd = md.squeeze(md.slice_(md.layer_norm(x_btd, "d_model", lnf, lnf_b), "tokens", 0, 1), "tokens")
        logits_bk = md.einsum("batch d_ff, d_ff classes -> batch classes",
                              md.gelu(md.einsum("batch d_model, d_model d_ff -> batch d_ff", z_bd, w_h1)), w_h2)
        loss = md.reduce_mean(md.cross_entropy(logits_bk, labels, "classes"))
        label_logit_b = md.reduce_sum(logits_bk * md.one_hot(labels, k), "classes")
        accuracy = md.reduce_mean(md.cast(md.greater_equal(label_logit_b, md.reduce_max(logits_bk, "classes")),
                                          torch.float32))

    def batches(seed: int, rows: slice | None = None) -> dict[str, torch.Tensor]:
        drawn = [image(cfg, md.row_generator(seed, r)) for r in range(cfg.batch)[rows or slice(None)]]
        imgs = torch.stack([im for im, _ in drawn]) if drawn else torch.zeros(0, cfg.size, cfg.size, cfg.channels)
        return {"images": imgs, "labels": torch.tensor([lab for _, lab in drawn], dtype=torch.int64)}

    return md.Model(g, loss, g.params(), batches=batches, config=cfg, metrics={"accuracy": accuracy},
                    outputs={"logits": logits_bk})
