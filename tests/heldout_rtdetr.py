"""A DETR-style detector on two-scale conv features, a held-out model (round 24a).

Legend: batch = images, height/width/rgb = pixels, channels = the stem's features, tokens = the
flattened features of both scales (8x8 then a stride-2 4x4, concatenated), d_model/heads/d_head/d_ff
as in a transformer, queries = object queries, objects = ground-truth objects per image, classes =
object classes plus the last one, "no object", box = (cx, cy, w, h). The matching is fed: object j of
an image is matched to query match[b, j] (distinct per image). Loss: class cross-entropy over every
query (an unmatched query's target is "no object") + the L1 distance of each matched query's box.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 4
    size: int = 16
    channels: int = 16
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 2
    queries: int = 8
    objects: int = 3
    classes: int = 5
    remat: str | None = None

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=2, size=8, channels=4, d_model=8, heads=2, d_head=4, d_ff=16, layers=2,
                   queries=6, objects=2, classes=3)


def _mha(xq, xk, p, pre, query, src, key):
    q = md.einsum("... d_model, d_model heads d_head -> ... heads d_head", xq, p[f"{pre}q"])
    k = md.rename(md.einsum("... d_model, d_model heads d_head -> ... heads d_head", xk, p[f"{pre}k"]), {src: key})
    v = md.rename(md.einsum("... d_model, d_model heads d_head -> ... heads d_head", xk, p[f"{pre}v"]), {src: key})
    o = md.attention(q, k, v, query, key, "d_head", causal=False)
    return md.einsum("... heads d_head, heads d_head d_model -> ... d_model", o, p[f"{pre}o"])


def _mlp(x, p, pre):
    h = md.relu(md.einsum("... d_model, d_model d_ff -> ... d_ff", x, p[f"{pre}fc"]))
    return md.einsum("... d_ff, d_ff d_model -> ... d_model", h, p[f"{pre}proj"])


def _encoder_block(x, p):
    x = md.layer_norm(x + _mha(x, x, p, "e", "tokens", "tokens", "key_tokens"), "d_model", p["e_ln1"], p["e_ln1_b"])
    return md.layer_norm(x + _mlp(x, p, "e"), "d_model", p["e_ln2"], p["e_ln2_b"])


def _stack(pre, L, D, Hh, E, F):
    p = {f"{pre}{w}": md.param(f"{pre}{w}", [L, D, Hh, E], fan_out=["layer", "heads", "d_head"]) for w in "qkv"}
    p[f"{pre}o"] = md.param(f"{pre}o", [L, Hh, E, D], fan_out=["layer", "d_model"])
    p[f"{pre}fc"] = md.param(f"{pre}fc", [L, D, F], fan_out=["layer", "d_ff"])
    p[f"{pre}proj"] = md.param(f"{pre}proj", [L, F, D], fan_out=["layer", "d_model"])
    for n in ("ln1", "ln2"):
        p[f"{pre}_{n}"] = md.param(f"{pre}_{n}", [L, D], init="ones")
        p[f"{pre}_{n}_b"] = md.param(f"{pre}_{n}_b", [L, D], init="zeros")
    return p


def _backbone(img, cfg, D):
    KH, KW, C = md.Dim("kh", 3), md.Dim("kw", 3), md.Dim("channels", cfg.channels)
    w1 = md.param("conv1", [KH, KW, img.shape["rgb"], C])
    w2 = md.param("conv2", [KH, KW, C, md.Dim("c_out", cfg.channels)])
    f1 = md.relu(md.conv(img, w1, {"height": "kh", "width": "kw"}))
    f2 = md.rename(md.relu(md.conv(f1, w2, {"height": "kh", "width": "kw"}, stride=2)), {"c_out": "channels"})
    s1 = md.rename(md.rearrange(f1, "batch height width channels -> batch (height width) channels"), {"height_width": "tokens"})
    s2 = md.rename(md.rearrange(f2, "batch height width channels -> batch (height width) channels"), {"height_width": "tokens"})
    x = md.concat([s1, s2], "tokens")
    x = md.einsum("batch tokens channels, channels d_model -> batch tokens d_model", x, md.param("w_in", [C, D], fan_out=[D]))
    return x + md.param("pos", [x.shape["tokens"], D], scale=0.02)


def build(cfg: Config) -> md.Model:
    B, S = md.Dim("batch", cfg.batch), md.Dim("height", cfg.size)
    Wd, R = md.Dim("width", cfg.size), md.Dim("rgb", 3)
    D, L, Hh, E, F = (md.Dim("d_model", cfg.d_model), md.Dim("layer", cfg.layers), md.Dim("heads", cfg.heads),
                      md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff))
    Q, O, K, X = (md.Dim("queries", cfg.queries), md.Dim("objects", cfg.objects),
                  md.Dim("classes", cfg.classes + 1), md.Dim("box", 4))
    with md.Graph() as g:
        img = md.input("image", [B, S, Wd, R])
        labels = md.input("labels", [B, O], dtype=torch.int64)
        boxes = md.input("boxes", [B, O, X])
        match = md.input("match", [B, O], dtype=torch.int64)
        mem = md.repeat(_encoder_block, _backbone(img, cfg, D), _stack("e", L, D, Hh, E, F), "layer", remat=cfg.remat)
        qe = md.param("query_embed", [Q, D], scale=0.5)
        dp = _stack("d", md.Dim("layer", 1), D, Hh, E, F)
        dp = {k: md.squeeze(v, "layer") for k, v in dp.items()}
        y = md.broadcast_to(qe, [B, Q, D])
        y = md.layer_norm(y + _mha(y, mem, dp, "d", "queries", "tokens", "key_tokens"), "d_model", dp["d_ln1"], dp["d_ln1_b"])
        y = md.layer_norm(y + _mlp(y, dp, "d"), "d_model", dp["d_ln2"], dp["d_ln2_b"])
        logits = md.einsum("batch queries d_model, d_model classes -> batch queries classes", y,
                           md.param("w_cls", [D, K], fan_out=[K]))
        pbox = md.sigmoid(md.einsum("batch queries d_model, d_model box -> batch queries box", y,
                                    md.param("w_box", [D, X], fan_out=[X])))
        assign = md.one_hot(match, Q)                                            # [batch objects queries]
        matched = md.reduce_sum(assign, "objects")                               # 1 for a matched query
        target = (md.einsum("batch objects queries, batch objects classes -> batch queries classes", assign, md.one_hot(labels, K))
                  + md.einsum("batch queries, classes -> batch queries classes", 1.0 - matched,
                              md.one_hot(md.constant(cfg.classes, dtype=torch.int64), K)))
        ce = -md.reduce_sum(target * md.log_softmax(logits, "classes"), "classes")
        box_of_obj = md.einsum("batch objects queries, batch queries box -> batch objects box", assign, pbox)
        l1 = md.reduce_sum(abs(box_of_obj - boxes)) / (cfg.batch * cfg.objects)
        loss = md.reduce_mean(ce) + 5.0 * l1

    def feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        return {"image": torch.randn(cfg.batch, cfg.size, cfg.size, 3, generator=gen),
                "labels": torch.randint(0, cfg.classes, (cfg.batch, cfg.objects), generator=gen),
                "boxes": torch.rand(cfg.batch, cfg.objects, 4, generator=gen),
                "match": torch.stack([torch.randperm(cfg.queries, generator=gen)[:cfg.objects] for _ in range(cfg.batch)])}

    return md.Model(g, loss, g.params(), feeds, cfg)


REF_INPUTS = ("image", "labels", "boxes", "match")


def _ref_mha(xq, xk, p, pre, i=None):
    F = torch.nn.functional
    w = {k: (p[f"{pre}{k}"] if i is None else p[f"{pre}{k}"][i]) for k in "qkvo"}
    q = torch.einsum("bsd,dhe->bhse", xq, w["q"])
    k, v = (torch.einsum("bsd,dhe->bhse", xk, w[n]) for n in "kv")
    return torch.einsum("bhse,hed->bsd", F.scaled_dot_product_attention(q, k, v), w["o"])


def _ref_layer(x, mem, p, pre, i=None):
    F = torch.nn.functional
    at = (lambda n: p[f"{pre}{n}"]) if i is None else (lambda n: p[f"{pre}{n}"][i])
    D = x.shape[-1]
    x = F.layer_norm(x + _ref_mha(x, mem, p, pre, i), (D,), at("_ln1"), at("_ln1_b"))
    return F.layer_norm(x + torch.relu(x @ at("fc")) @ at("proj"), (D,), at("_ln2"), at("_ln2_b"))


def reference_loss(cfg: Config, p: dict, image, labels, boxes, match):
    """The same detector in plain torch (F.conv2d, sdpa, F.cross_entropy on gathered targets)."""
    F = torch.nn.functional
    img = image.permute(0, 3, 1, 2)
    f1 = torch.relu(F.conv2d(img, p["conv1"].permute(3, 2, 0, 1), padding=1))
    f2 = torch.relu(F.conv2d(f1, p["conv2"].permute(3, 2, 0, 1), padding=1, stride=2))
    x = torch.cat([f1.flatten(2), f2.flatten(2)], 2).transpose(1, 2) @ p["w_in"] + p["pos"]
    for i in range(cfg.layers):
        x = _ref_layer(x, x, p, "e", i)
    dp = {k: v[0] for k, v in p.items() if k.startswith("d")}
    y = _ref_layer(p["query_embed"].expand(x.shape[0], -1, -1), x, dp, "d")
    logits, pbox = y @ p["w_cls"], torch.sigmoid(y @ p["w_box"])
    target = torch.full(logits.shape[:2], cfg.classes, dtype=torch.int64)
    target.scatter_(1, match, labels)
    ce = F.cross_entropy(logits.transpose(1, 2), target)
    l1 = (torch.gather(pbox, 1, match[..., None].expand(-1, -1, 4)) - boxes).abs().sum() / match.numel()
    return ce + 5.0 * l1
