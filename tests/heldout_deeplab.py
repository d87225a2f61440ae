"""A DeepLab-style atrous spatial pyramid for segmentation, written from the README and docs/ alone (a held-out model).

Images in NHWC letters: ``N`` images of ``H`` x ``W`` pixels with ``I`` channels, a label per
pixel (``-1``: ignored). Backbone: a 3x3 conv and ReLU, a 3x3 conv of stride 2 to the half grid
``Y`` x ``X`` with ``C`` channels and ReLU, and a ``md.repeat`` over ``R`` residual 3x3 conv
blocks. The atrous spatial pyramid: parallel 3x3 convs dilated 1, 2 and 4 (``md.conv(...,
dilation=r)``), and a global pooling branch (the mean over ``Y`` and ``X``, a 1x1 projection,
ReLU, added back to every pixel); the four joined by ``md.concat`` on the channels (``K``) and a
1x1 conv (an einsum), ReLU. A 1x1 classifier to ``Q`` classes at stride 2 times four (an einsum to
``(a b Q)``), and a ``md.rearrange`` back to full resolution. Loss: per-pixel cross entropy
averaged over the labelled pixels (labels ``< 0`` masked, as the docs show).

Legend: N = image, H/W = pixel rows/cols, Y/X = the half grid, I = input channels, C = features,
K = the pyramid's joined channels, Q = classes, R = backbone blocks.
"""
from dataclasses import dataclass

import torch

import meshdsl as md

RATES = (1, 2, 4)


@dataclass(frozen=True)
class Config:
    images: int = 4
    size: int = 64
    inputs: int = 3
    C: int = 32
    blocks: int = 2
    classes: int = 8
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(images=2, size=16, inputs=3, C=4, blocks=2, classes=3)


def build(cfg: Config = Config()) -> md.Model:
    N, H, W, I = md.Dim("N", cfg.images), md.Dim("H", cfg.size), md.Dim("W", cfg.size), md.Dim("I", cfg.inputs)
    C, C2, K, R = md.Dim("C", cfg.C), md.Dim("C2", cfg.C), md.Dim("K", 4 * cfg.C), md.Dim("R", cfg.blocks)
    U, S, kh, kw = md.Dim("U", 4 * cfg.classes), md.Dim("S", cfg.C), md.Dim("kh", 3), md.Dim("kw", 3)
    grid = {"Y": "kh", "X": "kw"}
    with md.Graph("heldout_deeplab") as g:
        img = md.input("img", [N, H, W, I])
        labels = md.input("labels", [N, H, W], dtype=torch.int64)
        p = {"conv1": md.param("conv1", [kh, kw, I, S], fan_out=["S"]),
             "conv2": md.param("conv2", [kh, kw, S, C], fan_out=["C"]),
             **{f"aspp{r}": md.param(f"aspp{r}", [kh, kw, C, C2], fan_out=["C2"]) for r in RATES},
             "pool": md.param("pool", [C, C2], fan_out=["C2"]),
             "proj": md.param("proj", [K, C2], fan_out=["C2"]),
             "cls": md.param("cls", [C2, U], fan_out=["U"])}
        res = {"res_a": md.param("res_a", [R, kh, kw, C, C2], fan_out=["R", "C2"]),
               "res_b": md.param("res_b", [R, kh, kw, C2, C], fan_out=["R", "C"])}

        def res_block(x: md.Tensor, q: dict) -> md.Tensor:
            y = md.relu(md.conv(x, q["res_a"], grid))
            return md.relu(x + md.conv(y, q["res_b"], grid))

        h = md.relu(md.conv(img, p["conv1"], {"H": "kh", "W": "kw"}))                  # [N, H, W, S]
        h = md.relu(md.conv(h, p["conv2"], {"H": "kh", "W": "kw"}, padding=(1, 1), stride=2))
        h = md.rename(h, H="Y", W="X")                                                   # [N, Y, X, C]
        h = md.repeat(res_block, h, res, "R", remat=cfg.remat)
        branches = [md.conv(h, p[f"aspp{r}"], grid, dilation=r) for r in RATES]          # [N, Y, X, C2] each
        pooled = md.relu(md.einsum("N C, C C2 -> N C2", md.reduce_mean(h, ["Y", "X"]), p["pool"]))
        branches.append(md.broadcast_to(pooled, branches[0].shape))
        y = md.relu(md.rename(md.concat([md.relu(b) for b in branches], "C2"), C2="K"))
        y = md.relu(md.einsum("N Y X K, K C2 -> N Y X C2", y, p["proj"]))
        logits = md.einsum("N Y X C2, C2 U -> N Y X U", y, p["cls"])
        logits = md.rename(md.rearrange(logits, "N Y X (a b Q) -> N (Y a) (X b) Q", a=2, b=2), Y_a="H", X_b="W")
        keep = labels >= 0
        ce = md.cross_entropy(logits, md.where(keep, labels, 0), "Q") * md.cast(keep, torch.float32)
        loss = md.reduce_sum(ce) / md.reduce_sum(md.cast(keep, torch.float32))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        img = torch.randn(cfg.images, cfg.size, cfg.size, cfg.inputs, generator=gen)
        labels = (img[..., 0] > 0).long() + (img[..., 1] > 0.5).long()
        labels = labels.clamp(max=cfg.classes - 1)
        labels[torch.rand(labels.shape, generator=gen) < 0.2] = -1                  # ~20% unlabelled
        return {"img": img, "labels": labels}

    return md.Model(g, loss, {**p, **res}, feeds, cfg)
