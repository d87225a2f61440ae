"""A small Vision Transformer (ViT) that classifies generated images of shapes, in named dims.

Dims (the legend for every tensor name below, e.g. ``x_bnd`` = [batch, patches, d_model]):
  b  batch        images in the batch
  y  height       pixel rows       = (hp ph): patch rows x rows within a patch
  x  width        pixel columns    = (wp pw): patch columns x columns within a patch
  c  channels     colour channels
  n  patches      = (hp wp), the token positions
  m  key_patches  a second name for the positions, so attention can hold both
  p  patch_feat   = (ph pw channels), one patch's pixels
  d  d_model      residual stream width
  h  heads        attention heads
  e  d_head       features per head
  f  d_ff         MLP hidden width
  k  classes      shape classes
  l  layer        blocks, stacked so that ``md.repeat`` scans over them

The model: images ``[batch, height, width, channels]`` cut into ``patch x patch`` patches by
one ``md.rearrange`` (``batch (hp ph) (wp pw) channels -> batch (hp wp) (ph pw channels)``), a
patch embedding (one einsum and a bias) plus a learned position embedding, ``layers``
pre-norm encoder blocks (non-causal multi-head attention, then a gelu MLP, LayerNorm)
run by ``md.repeat``, a final LayerNorm, the mean over patches, a linear head, and the
cross-entropy over classes; ``accuracy`` (the label's logit is the largest) is its eval metric.

The data is generated in the program (:func:`image`), so nothing is downloaded: each image
holds one shape of a random class (0 a filled square, 1 a disc, 2 a plus-shaped cross, 3 a
patch of horizontal stripes) at a random place and size, in a random colour, on Gaussian
noise.  ``batches(seed, rows)`` draws each row from its own stream (``md.row_generator``),
so a data-parallel rank builds only its own images, the same ones whatever the layout.

Layout families (strings given at compile time, never in this file):
  DP          ``batch:data``
  Megatron    ``heads:model; d_ff:model``
  FSDP        ``batch:data; params.d_model:data``
  pipeline    ``layer:stage`` (with micro-batches)
  spatial     ``height:data``: ``hp`` is the outer part of ``height`` and of ``patches``, so the
              patchify keeps the split and moves no image data (README, "How reshapes lower")
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import meshdsl as md
from meshdsl import Model

CLASSES = ("square", "disc", "cross", "stripes")


@dataclass(frozen=True)
class Config:
    size: int = 16         # height and width, in pixels
    channels: int = 3
    patch: int = 4         # patch height and width
    d_model: int = 64
    heads: int = 4
    d_head: int = 16
    d_ff: int = 128
    layers: int = 2
    classes: int = 4       # the first ``classes`` of CLASSES
    batch: int = 32
    noise: float = 0.3     # std of the Gaussian noise on every pixel

    @classmethod
    def tiny(cls) -> "Config":
        return cls(size=8, channels=3, patch=2, d_model=8, heads=2, d_head=4, d_ff=16, layers=2, batch=8)


# The einsums of attention; keys and values use 'key_patches' so scores can hold both positions.
PROJ = "batch patches d_model, d_model heads d_head -> batch patches heads d_head"
OUT = "batch patches heads d_head, heads d_head d_model -> batch patches d_model"


def attention(z_bnd, p):
    """Non-causal multi-head self-attention of the normed residual ``z_bnd`` (every patch sees all)."""
    q_bnhe = md.einsum(PROJ, z_bnd, p["wq"])
    k_bmhe = md.rename(md.einsum(PROJ, z_bnd, p["wk"]), patches="key_patches")
    v_bmhe = md.rename(md.einsum(PROJ, z_bnd, p["wv"]), patches="key_patches")
    y_bnhe = md.attention(q_bnhe, k_bmhe, v_bmhe, "patches", "key_patches", "d_head", causal=False)
    return md.einsum(OUT, y_bnhe, p["wo"])


def mlp(z_bnd, p):
    u_bnf = md.gelu(md.einsum("batch patches d_model, d_model d_ff -> batch patches d_ff", z_bnd, p["w_fc"]))
    return md.einsum("batch patches d_ff, d_ff d_model -> batch patches d_model", u_bnf, p["w_proj"])


def block(x_bnd, p):
    """One pre-norm encoder block; ``p`` holds this layer's slice of each stacked param."""
    g = x_bnd.graph
    with g.scope("attn"):
        x_bnd = x_bnd + attention(md.layer_norm(x_bnd, "d_model", p["ln1"], p["ln1_b"]), p)
    with g.scope("mlp"):
        return x_bnd + mlp(md.layer_norm(x_bnd, "d_model", p["ln2"], p["ln2_b"]), p)


def build(cfg: Config = Config()) -> Model:
    """Build the ViT, its cross-entropy loss over classes and its accuracy metric."""
    bad = []
    if cfg.size % cfg.patch:
        bad.append(f"size {cfg.size} is not a multiple of patch {cfg.patch}")
    if not 2 <= cfg.classes <= len(CLASSES):
        bad.append(f"classes {cfg.classes} is not between 2 and {len(CLASSES)}")
    if bad:
        raise md.GraphError(md.errors.message(
            "vit: the Config cannot be built.", bullets=bad,
            rule=f"images are cut into whole patches; the classes are the first of {', '.join(CLASSES)}",
            fix="e.g. --config size=16,patch=4,classes=4"))
    ps = cfg.patch
    b, y, x = md.Dim("batch", cfg.batch), md.Dim("height", cfg.size), md.Dim("width", cfg.size)
    c, k = md.Dim("channels", cfg.channels), md.Dim("classes", cfg.classes)
    n, p = md.Dim("patches", (cfg.size // ps) ** 2), md.Dim("patch_feat", ps * ps * cfg.channels)
    d, h, e = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    f, l = md.Dim("d_ff", cfg.d_ff), md.Dim("layer", cfg.layers)

    with md.Graph("vit") as g:
        images_byxc = md.input("images", [b, y, x, c])
        labels_b = md.input("labels", [b], torch.int64)

        w_patch_pd = md.param("w_patch", [p, d], fan_out=[d])
        b_patch_d = md.param("b_patch", [d], init="zeros")
        pos_nd = md.param("pos", [n, d], scale=0.02)
        # Block params are stacked along 'layer'.  fan_out lists every dim that
        # is not an input feature, so each layer's init has std 1/sqrt(fan_in).
        blocks = {
            "ln1": md.param("ln1", [l, d], init="ones"),
            "ln1_b": md.param("ln1_b", [l, d], init="zeros"),
            "wq": md.param("wq", [l, d, h, e], fan_out=[l, h, e]),
            "wk": md.param("wk", [l, d, h, e], fan_out=[l, h, e]),
            "wv": md.param("wv", [l, d, h, e], fan_out=[l, h, e]),
            "wo": md.param("wo", [l, h, e, d], fan_out=[l, d]),
            "ln2": md.param("ln2", [l, d], init="ones"),
            "ln2_b": md.param("ln2_b", [l, d], init="zeros"),
            "w_fc": md.param("w_fc", [l, d, f], fan_out=[l, f]),
            "w_proj": md.param("w_proj", [l, f, d], fan_out=[l, d]),
        }
        lnf, lnf_b = md.param("lnf", [d], init="ones"), md.param("lnf_b", [d], init="zeros")
        w_head_dk = md.param("w_head", [d, k], fan_out=[k])

        x_bnp = md.rearrange(images_byxc, "batch (hp ph) (wp pw) channels -> batch (hp wp) (ph pw channels)",
                             ph=ps, pw=ps)
        x_bnp = md.rename(x_bnp, hp_wp="patches", ph_pw_channels="patch_feat")
        x_bnd = md.einsum("batch patches patch_feat, patch_feat d_model -> batch patches d_model",
                          x_bnp, w_patch_pd) + b_patch_d + pos_nd
        x_bnd = md.repeat(block, x_bnd, blocks, l)
        pooled_bd = md.reduce_mean(md.layer_norm(x_bnd, "d_model", lnf, lnf_b), "patches")
        logits_bk = md.einsum("batch d_model, d_model classes -> batch classes", pooled_bd, w_head_dk)
        loss = md.reduce_mean(md.cross_entropy(logits_bk, labels_b, "classes"))
        label_logit_b = md.reduce_sum(logits_bk * md.one_hot(labels_b, k, logits_bk.dtype), "classes")
        correct_b = md.greater_equal(label_logit_b, md.reduce_max(logits_bk, "classes"))
        accuracy = md.reduce_mean(md.cast(correct_b, logits_bk.dtype))

    params = {"w_patch": w_patch_pd, "b_patch": b_patch_d, "pos": pos_nd, **blocks,
              "lnf": lnf, "lnf_b": lnf_b, "w_head": w_head_dk}

    def batches(seed: int, rows: slice | None = None) -> dict[str, torch.Tensor]:
        drawn = [image(cfg, md.row_generator(seed, r)) for r in range(cfg.batch)[rows or slice(None)]]
        imgs = torch.stack([im for im, _ in drawn]) if drawn else torch.zeros(0, cfg.size, cfg.size, cfg.channels)
        return {"images": imgs, "labels": torch.tensor([label for _, label in drawn], dtype=torch.int64)}

    return Model(g, loss, params, batches=batches, config=cfg, metrics={"accuracy": accuracy})


def image(cfg: Config, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """One ``[size, size, channels]`` image and its class, drawn from ``gen`` alone.

    The shape's extent ``s`` (from 4 pixels, below which a disc is a square, up to half the
    image) and its top-left corner are uniform; its colour is uniform in [0.5, 1.5) per channel,
    scaled to a mean square of 1 over the channels.
    """
    n = cfg.size
    label = int(torch.randint(cfg.classes, (), generator=gen))
    s = int(torch.randint(4, max(5, n // 2 + 1), (), generator=gen))
    top, left = (int(v) for v in torch.randint(n - s + 1, (2,), generator=gen))
    colour = torch.rand(cfg.channels, generator=gen) + 0.5
    colour = colour / colour.norm() * math.sqrt(cfg.channels)
    noise = cfg.noise * torch.randn(n, n, cfg.channels, generator=gen)
    r = torch.arange(s, dtype=torch.float32)
    rows, cols = r[:, None].expand(s, s), r[None, :].expand(s, s)
    centre = (s - 1) / 2
    if CLASSES[label] == "square":
        mask = torch.ones(s, s)
    elif CLASSES[label] == "disc":
        mask = ((rows - centre) ** 2 + (cols - centre) ** 2 <= (s / 2) ** 2).float()
    elif CLASSES[label] == "cross":
        mask = (((rows - centre).abs() < 0.75) | ((cols - centre).abs() < 0.75)).float()
    else:  # stripes: every other row
        mask = (rows % 2 == 0).float().expand(s, s)
    img = torch.zeros(n, n)
    img[top:top + s, left:left + s] = mask
    return img[:, :, None] * colour + noise, label
