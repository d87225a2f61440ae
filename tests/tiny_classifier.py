"""A tiny image classifier on generated images: the model protocol's own ``batches`` and ``metrics``.

Legend: b batch, h height, w width, c channels; the image is cut into ``patch x patch``
patches: ``height = (hp ph)``, ``width = (wp pw)``, ``patches = (hp wp)``,
``patch_feat = (ph pw channels)``; d d_model, k classes.

    images_bhwc -> rearrange -> x_bnf [batch, patches, patch_feat]
                -> w_embed (patch_feat d_model) -> relu -> mean over patches
                -> w_head (d_model classes) -> logits_bk
    loss = mean cross-entropy over classes;  accuracy = mean(logit of the label is the largest)

The data is generated in the program, one random stream per row (``md.row_generator``):
each image holds one shape of a random class at a random place, plus noise; class 0 a
horizontal bar, 1 a vertical bar, 2 a square.  ``batches(seed, rows)`` builds only the
rows asked for, so a data-parallel rank never draws the other ranks' images.  Used by
tests/test_feeder.py (dense against ``data:2``, ``meshdsl train`` on 2 gloo processes, resume).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md
from meshdsl import Model


@dataclass(frozen=True)
class Config:
    batch: int = 32
    size: int = 8          # height and width
    channels: int = 1
    patch: int = 4
    d_model: int = 32
    classes: int = 3
    noise: float = 0.2     # 200 SGD steps at lr 2: eval accuracy 0.86 (chance 0.33), in about a second

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=8, d_model=8)


def image(cfg: Config, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """One ``[size, size, channels]`` image and its class, drawn from ``gen``."""
    n, bar = cfg.size, cfg.size // 2
    label = int(torch.randint(cfg.classes, (), generator=gen))
    i, j = (int(v) for v in torch.randint(n - bar + 1, (2,), generator=gen))
    img = torch.zeros(n, n)
    if label == 0:
        img[i, j:j + bar] = 1.0
    elif label == 1:
        img[i:i + bar, j] = 1.0
    else:
        img[i:i + 2, j:j + 2] = 1.0
    noise = cfg.noise * torch.randn(n, n, cfg.channels, generator=gen)
    return img[:, :, None] + noise, label


def build(cfg: Config = Config()) -> Model:
    """Build the classifier, its cross-entropy loss and its accuracy metric."""
    p = cfg.patch
    batch, height, width = md.Dim("batch", cfg.batch), md.Dim("height", cfg.size), md.Dim("width", cfg.size)
    channels, d_model, classes = md.Dim("channels", cfg.channels), md.Dim("d_model", cfg.d_model), \
        md.Dim("classes", cfg.classes)
    patch_feat = md.Dim("patch_feat", p * p * cfg.channels)
    with md.Graph("tiny_classifier") as g:
        images = md.input("images", [batch, height, width, channels])
        labels = md.input("labels", [batch], dtype=torch.int64)
        w_embed = md.param("w_embed", [patch_feat, d_model], fan_out=[d_model])
        w_head = md.param("w_head", [d_model, classes], fan_out=[classes])
        x = md.rearrange(images, "batch (hp ph) (wp pw) channels -> batch (hp wp) (ph pw channels)", ph=p, pw=p)
        x_bnf = md.rename(x, hp_wp="patches", ph_pw_channels="patch_feat")
        h_bnd = md.relu(md.einsum("batch patches patch_feat, patch_feat d_model -> batch patches d_model",
                                  x_bnf, w_embed))
        logits_bk = md.einsum("batch d_model, d_model classes -> batch classes",
                              md.reduce_mean(h_bnd, "patches"), w_head)
        loss = md.reduce_mean(md.cross_entropy(logits_bk, labels, "classes"))
        label_logit_b = md.reduce_sum(logits_bk * md.one_hot(labels, classes), "classes")
        correct_b = md.greater_equal(label_logit_b, md.reduce_max(logits_bk, "classes"))
        accuracy = md.reduce_mean(md.cast(correct_b, torch.float32))

    def batches(seed: int, rows: slice | None = None) -> dict[str, torch.Tensor]:
        drawn = [image(cfg, md.row_generator(seed, r)) for r in range(cfg.batch)[rows or slice(None)]]
        imgs = torch.stack([x for x, _ in drawn]) if drawn else torch.zeros(0, cfg.size, cfg.size, cfg.channels)
        return {"images": imgs, "labels": torch.tensor([k for _, k in drawn], dtype=torch.int64)}

    return Model(g, loss, {"w_embed": w_embed, "w_head": w_head}, batches=batches, config=cfg,
                 metrics={"accuracy": accuracy})
