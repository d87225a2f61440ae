"""CoAtNet-lite: an MBConv stage, a strided downsample, then transformer blocks with a 2-D
relative position bias, global average pooling and a classifier.

MBConv: a 1x1 expand, batch norm (torch's running statistics, ``running=``), gelu, a depthwise
3x3 conv, batch norm, gelu, squeeze-excite (mean over the image, two small linears, a sigmoid
gate), a 1x1 project and a batch norm, added to its input. A 2x2 stride-2 conv downsamples to
``d_model`` and the grid becomes ``tokens`` (``md.rearrange``). Each transformer block adds to its
attention scores a learned table ``[rel_h, rel_w, heads]`` read at every (query, key) pair's
offset: row and column of a token from ``md.arange`` integer math (``//`` and ``%``), the offset
shifted to be non-negative, and the table read by two one-hots in one einsum.

Legend: b batch, y x height width (of the image), c channels, g c_exp (expanded), r c_se,
d d_model, n tokens (k key_tokens), u rel_h, w rel_w, h heads, e d_head, f d_ff, o classes,
l layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    image: int = 16
    channels: int = 3
    c_stem: int = 16
    expand: int = 4
    c_se: int = 4
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 2
    classes: int = 10
    batch: int = 8
    remat: str | None = None      # md.repeat's activation checkpointing (none, full, selective)

    @classmethod
    def tiny(cls) -> "Config":
        return cls(image=8, channels=2, c_stem=4, expand=2, c_se=2, d_model=8, heads=2, d_head=4,
                   d_ff=12, layers=2, classes=3, batch=4)


def build(cfg: Config = Config()) -> md.Model:
    b, hh, ww = md.Dim("batch", cfg.batch), md.Dim("height", cfg.image), md.Dim("width", cfg.image)
    c_img, c = md.Dim("c_img", cfg.channels), md.Dim("channels", cfg.c_stem)
    ce, cs = md.Dim("c_exp", cfg.c_stem * cfg.expand), md.Dim("c_se", cfg.c_se)
    kh, kw = md.Dim("kh", 3), md.Dim("kw", 3)
    dh, dw = md.Dim("dh", 2), md.Dim("dw", 2)
    d, h, e = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    f, ncls, lyr = md.Dim("d_ff", cfg.d_ff), md.Dim("classes", cfg.classes), md.Dim("layer", cfg.layers)
    side = cfg.image // 2
    n, k = md.Dim("tokens", side * side), md.Dim("key_tokens", side * side)
    ru, rw = md.Dim("rel_h", 2 * side - 1), md.Dim("rel_w", 2 * side - 1)
    with md.Graph("coatnet") as g:
        img = md.input("image", [b, hh, ww, c_img])
        labels = md.input("labels", [b], dtype=torch.int64)
        w_stem = md.param("w_stem", [kh, kw, c_img, c], fan_out=["channels"])
        w_exp = md.param("w_exp", [c, ce], fan_out=[ce])
        w_dw = md.param("w_dw", [kh, kw, ce], fan_out=["c_exp"])
        w_se1 = md.param("w_se1", [ce, cs], fan_out=[cs])
        w_se2 = md.param("w_se2", [cs, ce], fan_out=[ce])
        w_proj = md.param("w_proj", [ce, c], fan_out=[c])
        bn = {}
        for i, dim in enumerate([ce, ce, c]):
            bn[i] = (md.param(f"bn{i}_s", [dim], init="ones"), md.param(f"bn{i}_b", [dim], init="zeros"),
                     md.param(f"bn{i}_rm", [dim], init="zeros"), md.param(f"bn{i}_rv", [dim], init="ones"))
        w_down = md.param("w_down", [dh, dw, c, d], fan_out=["d_model"])
        stacked = {
            "ln1": md.param("ln1", [lyr, d], init="ones"), "ln2": md.param("ln2", [lyr, d], init="ones"),
            "wq": md.param("wq", [lyr, d, h, e], fan_out=["layer", "heads", "d_head"]),
            "wk": md.param("wk", [lyr, d, h, e], fan_out=["layer", "heads", "d_head"]),
            "wv": md.param("wv", [lyr, d, h, e], fan_out=["layer", "heads", "d_head"]),
            "wo": md.param("wo", [lyr, h, e, d], fan_out=["layer", "d_model"]),
            "rel": md.param("rel", [lyr, ru, rw, h], scale=0.5),
            "w1": md.param("w1", [lyr, d, f], fan_out=["layer", "d_ff"]),
            "w2": md.param("w2", [lyr, f, d], fan_out=["layer", "d_model"]),
        }
        lnf = md.param("lnf", [d], init="ones")
        w_cls = md.param("w_cls", [d, ncls], fan_out=[ncls])

        def norm(x, i, dims=("batch", "height", "width")):
            s, bias, rm, rv = bn[i]
            return md.batch_norm(x, list(dims), s, bias, running=(rm, rv))

        taps = {"height": "kh", "width": "kw"}
        x = md.conv(img, w_stem, taps, padding="same")                        # [b, y, x, channels]
        u = md.gelu(norm(md.einsum("batch height width channels, channels c_exp -> batch height width c_exp", x, w_exp), 0))
        u = md.gelu(norm(md.conv(u, w_dw, taps, padding="same"), 1))          # depthwise
        se = md.relu(md.einsum("batch c_exp, c_exp c_se -> batch c_se", md.reduce_mean(u, ["height", "width"]), w_se1))
        u = u * md.sigmoid(md.einsum("batch c_se, c_se c_exp -> batch c_exp", se, w_se2))
        x = x + norm(md.einsum("batch height width c_exp, c_exp channels -> batch height width channels", u, w_proj), 2)
        x = md.conv(x, w_down, {"height": "dh", "width": "dw"}, padding="valid", stride=2)   # [b, y/2, x/2, d]
        tok = md.rename(md.rearrange(x, "batch height width d_model -> batch (height width) d_model"), height_width="tokens")

        # relative offsets: token i sits at row i // side, column i % side
        qi, ki = md.arange(n), md.arange(k)
        off_h = qi // side - ki // side + (side - 1)                          # [tokens, key_tokens] in [0, 2 side - 1)
        off_w = qi % side - ki % side + (side - 1)
        oh_h, oh_w = md.one_hot(off_h, ru), md.one_hot(off_w, rw)

        def block(z, w):
            bias = md.einsum("tokens key_tokens rel_h, tokens key_tokens rel_w, rel_h rel_w heads -> heads tokens key_tokens",
                             oh_h, oh_w, w["rel"])
            a = md.layer_norm(z, "d_model", w["ln1"])
            q = md.einsum("batch tokens d_model, d_model heads d_head -> batch tokens heads d_head", a, w["wq"])
            kk = md.einsum("batch tokens d_model, d_model heads d_head -> batch tokens heads d_head", a, w["wk"])
            vv = md.einsum("batch tokens d_model, d_model heads d_head -> batch tokens heads d_head", a, w["wv"])
            kk, vv = md.rename(kk, tokens="key_tokens"), md.rename(vv, tokens="key_tokens")
            s = md.einsum("batch tokens heads d_head, batch key_tokens heads d_head -> batch heads tokens key_tokens", q, kk)
            att = md.softmax(s * cfg.d_head ** -0.5 + bias, "key_tokens")
            y = md.einsum("batch heads tokens key_tokens, batch key_tokens heads d_head -> batch tokens heads d_head", att, vv)
            z = z + md.einsum("batch tokens heads d_head, heads d_head d_model -> batch tokens d_model", y, w["wo"])
            m = md.gelu(md.einsum("batch tokens d_model, d_model d_ff -> batch tokens d_ff", md.layer_norm(z, "d_model", w["ln2"]), w["w1"]))
            return z + md.einsum("batch tokens d_ff, d_ff d_model -> batch tokens d_model", m, w["w2"])

        z = md.repeat(block, tok, stacked, "layer", remat=cfg.remat)
        pooled = md.layer_norm(md.reduce_mean(z, "tokens"), "d_model", lnf)
        logits = md.einsum("batch d_model, d_model classes -> batch classes", pooled, w_cls)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))
        trained = {name: t for name, t in g.params().items() if not name.endswith(("_rm", "_rv"))}

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"image": torch.randn(cfg.batch, cfg.image, cfg.image, cfg.channels, generator=gen),
                "labels": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    return md.Model(g, loss, trained, feeds, cfg)


# ---- the plain-torch reference (tests/test_heldout_round26a.py compares it with the model) ----

REF_INPUTS = ["image", "labels"]


def _ref_bn(x, p: dict, i: int):
    """Training-mode batch norm over batch, height, width (channels last)."""
    mean, var = x.mean((0, 1, 2)), x.var((0, 1, 2), unbiased=False)
    return (x - mean) * torch.rsqrt(var + 1e-5) * p[f"bn{i}_s"] + p[f"bn{i}_b"]


def _ref_conv(x, w, **kw):
    """``x [b, y, x, c]`` by ``w [kh, kw, c_in, c_out]`` (or ``[kh, kw, c]`` depthwise, groups=c)."""
    F = torch.nn.functional
    if w.dim() == 3:
        out = F.conv2d(x.permute(0, 3, 1, 2), w.permute(2, 0, 1).unsqueeze(1), groups=w.shape[-1], **kw)
    else:
        out = F.conv2d(x.permute(0, 3, 1, 2), w.permute(3, 2, 0, 1), **kw)
    return out.permute(0, 2, 3, 1)


def reference_loss(cfg: Config, p: dict, image, labels):
    """The model in plain torch: F.conv2d convs, the bias table indexed by a meshgrid's offsets."""
    F = torch.nn.functional
    x = _ref_conv(image, p["w_stem"], padding=1)
    u = F.gelu(_ref_bn(x @ p["w_exp"], p, 0))
    u = F.gelu(_ref_bn(_ref_conv(u, p["w_dw"], padding=1), p, 1))
    u = u * torch.sigmoid(F.relu(u.mean((1, 2)) @ p["w_se1"]) @ p["w_se2"])[:, None, None]
    x = x + _ref_bn(u @ p["w_proj"], p, 2)
    z = _ref_conv(x, p["w_down"], stride=2).flatten(1, 2)           # [b, tokens, d]
    side = cfg.image // 2
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    rows, cols = rows.flatten(), cols.flatten()
    dr, dc = rows[:, None] - rows[None] + side - 1, cols[:, None] - cols[None] + side - 1
    for i in range(cfg.layers):
        bias = p["rel"][i][dr, dc].permute(2, 0, 1)                   # [heads, tokens, key_tokens]
        a = F.layer_norm(z, (cfg.d_model,), p["ln1"][i])
        q, k, v = (torch.einsum("bnd,dhe->bhne", a, p[w][i]) for w in ("wq", "wk", "wv"))
        att = torch.softmax(q @ k.transpose(-1, -2) * cfg.d_head ** -0.5 + bias, -1)
        z = z + torch.einsum("bhne,hed->bnd", att @ v, p["wo"][i])
        z = z + F.gelu(F.layer_norm(z, (cfg.d_model,), p["ln2"][i]) @ p["w1"][i]) @ p["w2"][i]
    logits = F.layer_norm(z.mean(1), (cfg.d_model,), p["lnf"]) @ p["w_cls"]
    return F.cross_entropy(logits, labels)
