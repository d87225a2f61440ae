"""A tiny ViT-style patchify and patch embedding, to show and test how reshapes lower.

Legend: b batch, h height, w width, c channels; the image is cut into patches of
``patch x patch`` pixels: ``height = (hp ph)``, ``width = (wp pw)``; ``patches = (hp wp)``
and ``patch_feat = (ph pw channels)``; d d_model, k classes.

    images_bhwc -> rearrange -> x_bnf [batch, patches, patch_feat]
                -> w_embed (patch_feat d_model) -> relu -> mean over patches
                -> w_head (d_model classes) -> y_bk;  loss = mean((y_bk - target_bk) ** 2)

A spatial split ``height:data`` moves no image data: ``hp`` is the outer part of ``height`` and of
``patches``, so the patch dims inherit the split (see meshdsl/lowering/reshape.py and implied.py).  Used by
tests/test_reshape.py and by docs/guide/cookbook.md, "How reshapes lower" (``meshdsl plan
tests/patchify_tiny.py ...``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md
from meshdsl import Model


@dataclass(frozen=True)
class Config:
    batch: int = 8
    height: int = 32
    width: int = 32
    channels: int = 3
    patch: int = 4
    d_model: int = 64
    classes: int = 10

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=2, height=8, width=8, channels=3, patch=2, d_model=8, classes=4)


def build(cfg: Config = Config()) -> Model:
    """Build the patch embedding and its mean-squared-error loss."""
    p = cfg.patch
    batch, height, width = md.Dim("batch", cfg.batch), md.Dim("height", cfg.height), md.Dim("width", cfg.width)
    channels, d_model, classes = md.Dim("channels", cfg.channels), md.Dim("d_model", cfg.d_model), \
        md.Dim("classes", cfg.classes)
    patch_feat = md.Dim("patch_feat", p * p * cfg.channels)
    with md.Graph("patchify") as g:
        images = md.input("images", [batch, height, width, channels])
        target_bk = md.input("target", [batch, classes])
        w_embed = md.param("w_embed", [patch_feat, d_model], fan_out=[d_model])
        w_head = md.param("w_head", [d_model, classes], fan_out=[classes])
        x = md.rearrange(images, "batch (hp ph) (wp pw) channels -> batch (hp wp) (ph pw channels)", ph=p, pw=p)
        x_bnf = md.rename(x, hp_wp="patches", ph_pw_channels="patch_feat")
        h_bnd = md.relu(md.einsum("batch patches patch_feat, patch_feat d_model -> batch patches d_model",
                                  x_bnf, w_embed))
        y_bk = md.einsum("batch d_model, d_model classes -> batch classes", md.reduce_mean(h_bnd, "patches"), w_head)
        loss = md.reduce_mean((y_bk - target_bk) ** 2)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"images": torch.randn(cfg.batch, cfg.height, cfg.width, cfg.channels, generator=gen),
                "target": torch.randn(cfg.batch, cfg.classes, generator=gen)}

    return Model(g, loss, {"w_embed": w_embed, "w_head": w_head}, feeds, cfg)
