"""A held-out ViT with a class token, written from README.md and docs/ only.

Legend: b batch, h height, w width, c channels; ``height = (hp ph)``, ``width = (wp pw)``;
n patches = (hp wp), f pix = (ph pw channels); s seq = [CLS] + patches; d d_model,
k key_seq, h heads, e d_head, f d_ff, c classes.

    images_bhwc -> rearrange -> x_bnf -> w_embed -> [batch, patches, d_model]
      -> rename patches to seq, concat the class token (a param, [seq:1, d_model]) in front
      -> + wpe [seq, d_model] -> md.repeat over layers of a pre-LN block (fused non-causal
         attention, gelu MLP) -> final layer norm -> the class token's row -> w_head
    loss = mean cross-entropy over classes

Data (``batches``): class k puts a bright ``patch x patch`` square in a random patch of
quadrant-like region k (over ``classes``), on noise.
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
    patch: int = 2
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 2
    classes: int = 4
    noise: float = 0.3

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=6, size=4, channels=2, patch=2, d_model=8, heads=2, d_head=4, d_ff=16, layers=2)


def image(cfg: Config, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    label = int(torch.randint(cfg.classes, (), generator=gen))
    n, p = cfg.size, cfg.patch
    img = cfg.noise * torch.randn(n, n, cfg.channels, generator=gen)
    r = (label * p) % n
    c = ((label * p) // n * p + int(torch.randint(max(1, n // p), (), generator=gen)) * p) % n
    img[r:r + p, c:c + p, :] += 1.0
    return img, label


def build(cfg: Config = Config()) -> md.Model:
    npatch = (cfg.size // cfg.patch) ** 2
    batch, height, width = md.Dim("batch", cfg.batch), md.Dim("height", cfg.size), md.Dim("width", cfg.size)
    channels, d_model = md.Dim("channels", cfg.channels), md.Dim("d_model", cfg.d_model)
    pix = md.Dim("pix", cfg.patch * cfg.patch * cfg.channels)
    one, seq = md.Dim("seq", 1), md.Dim("seq", npatch + 1)
    heads, d_head, d_ff = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    layer, classes = md.Dim("layer", cfg.layers), md.Dim("classes", cfg.classes)
    with md.Graph("heldout_vit_cls") as g:
        images = md.input("images", [batch, height, width, channels])
        labels = md.input("labels", [batch], dtype=torch.int64)
        p = {
            "w_embed": md.param("w_embed", [pix, d_model], fan_out=[d_model]),
            "cls": md.param("cls", [one, d_model], scale=0.5),
            "wpe": md.param("wpe", [seq, d_model], scale=0.5),
            "ln1": md.param("ln1", [layer, d_model], init="ones"),
            "ln1_b": md.param("ln1_b", [layer, d_model], init="zeros"),
            "wq": md.param("wq", [layer, d_model, heads, d_head], fan_out=[heads, d_head]),
            "wk": md.param("wk", [layer, d_model, heads, d_head], fan_out=[heads, d_head]),
            "wv": md.param("wv", [layer, d_model, heads, d_head], fan_out=[heads, d_head]),
            "wo": md.param("wo", [layer, heads, d_head, d_model], fan_out=[d_model]),
            "ln2": md.param("ln2", [layer, d_model], init="ones"),
            "ln2_b": md.param("ln2_b", [layer, d_model], init="zeros"),
            "w_fc": md.param("w_fc", [layer, d_model, d_ff], fan_out=[d_ff]),
            "w_proj": md.param("w_proj", [layer, d_ff, d_model], fan_out=[d_model]),
            "lnf": md.param("lnf", [d_model], init="ones"),
            "lnf_b": md.param("lnf_b", [d_model], init="zeros"),
            "w_head": md.param("w_head", [d_model, classes], fan_out=[classes]),
        }
        x = md.rearrange(images, "batch (hp ph) (wp pw) channels -> batch (hp wp) (ph pw channels)",
                         ph=cfg.patch, pw=cfg.patch)
        x = md.rename(x, hp_wp="patches", ph_pw_channels="pix")
        x = md.einsum("batch patches pix, pix d_model -> batch patches d_model", x, p["w_embed"])
        x = md.rename(x, patches="seq")
        cls_tok = md.broadcast_to(p["cls"], [batch, one, d_model])
        x = md.concat([cls_tok, x], "seq") + p["wpe"]

        def block(h, w):
            a = md.layer_norm(h, "d_model", w["ln1"], w["ln1_b"])
            q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", a, w["wq"])
            ak = md.rename(a, seq="key_seq")
            k = md.einsum("batch key_seq d_model, d_model heads d_head -> batch key_seq heads d_head", ak, w["wk"])
            v = md.einsum("batch key_seq d_model, d_model heads d_head -> batch key_seq heads d_head", ak, w["wv"])
            o = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=False)
            h = h + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, w["wo"])
            m = md.layer_norm(h, "d_model", w["ln2"], w["ln2_b"])
            f = md.gelu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", m, w["w_fc"]))
            return h + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", f, w["w_proj"])

        stacked = {n: p[n] for n in ("ln1", "ln1_b", "wq", "wk", "wv", "wo", "ln2", "ln2_b", "w_fc", "w_proj")}
        h = md.repeat(block, x, stacked, "layer")
        h = md.layer_norm(h, "d_model", p["lnf"], p["lnf_b"])
        cls_h = md.squeeze(md.slice_(h, "seq", 0, 1), "seq")
        logits = md.einsum("batch d_model, d_model classes -> batch classes", cls_h, p["w_head"])
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))
        correct = md.greater_equal(md.reduce_sum(logits * md.one_hot(labels, classes), "classes"),
                                   md.reduce_max(logits, "classes"))
        accuracy = md.reduce_mean(md.cast(correct, torch.float32))

    def batches(seed: int, rows: slice | None = None) -> dict[str, torch.Tensor]:
        drawn = [image(cfg, md.row_generator(seed, r)) for r in range(cfg.batch)[rows or slice(None)]]
        imgs = torch.stack([x for x, _ in drawn]) if drawn else torch.zeros(0, cfg.size, cfg.size, cfg.channels)
        return {"images": imgs, "labels": torch.tensor([k for _, k in drawn], dtype=torch.int64)}

    return md.Model(g, loss, p, batches=batches, config=cfg, metrics={"accuracy": accuracy})
