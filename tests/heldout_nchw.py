"""A small ResNet-style image classifier in PyTorch's NCHW letters, written from the README and
docs/ alone (a held-out model: the user's own dim names).

Dims: ``n`` (images), ``c`` (channels, ``c_in`` the image's 3, ``c2`` a block's hidden
channels), ``h`` and ``w`` (rows and columns), ``kh``/``kw`` (a filter's taps), ``k`` (classes),
``blocks`` (the stack of residual blocks under ``md.repeat``). A 3x3 stem conv, ``blocks``
residual blocks (3x3 conv, ReLU, 3x3 conv, the residual, a per-channel scale), global average
pooling over ``h`` and ``w``, a linear head and the mean cross-entropy.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    n: int = 16
    in_channels: int = 3
    channels: int = 32
    hidden: int = 32
    size: int = 16
    num_blocks: int = 4
    num_classes: int = 10

    @classmethod
    def tiny(cls) -> "Config":
        return cls(n=4, in_channels=3, channels=4, hidden=6, size=8, num_blocks=2, num_classes=5)


def build(cfg: Config = Config()) -> md.Model:
    n, c_in, c = md.Dim("n", cfg.n), md.Dim("c_in", cfg.in_channels), md.Dim("c", cfg.channels)
    c2, h, w = md.Dim("c2", cfg.hidden), md.Dim("h", cfg.size), md.Dim("w", cfg.size)
    kh, kw, k, blocks = md.Dim("kh", 3), md.Dim("kw", 3), md.Dim("k", cfg.num_classes), md.Dim("blocks", cfg.num_blocks)
    taps = {"h": "kh", "w": "kw"}
    with md.Graph("nchw") as g:
        images = md.input("images", [n, c_in, h, w])
        labels = md.input("labels", [n], dtype=torch.int64)
        stem = md.param("stem", [kh, kw, c_in, c], fan_out=["c"])
        stack = {
            "conv1": md.param("conv1", [blocks, kh, kw, c, c2], fan_out=["blocks", "c2"]),
            "conv2": md.param("conv2", [blocks, kh, kw, c2, c], fan_out=["blocks", "c"]),
            "scale": md.param("scale", [blocks, c], init="ones"),
        }
        fc = md.param("fc", [c, k], fan_out=["k"])
        fc_b = md.param("fc_b", [k], init="zeros")

        def block(x, p):
            y = md.relu(md.conv(x, p["conv1"], taps))
            return x + md.conv(y, p["conv2"], taps) * p["scale"] * 0.5

        x = md.relu(md.conv(images, stem, taps))             # [n, c, h, w]
        x = md.repeat(block, x, stack, "blocks")
        pooled = md.reduce_mean(x, ["h", "w"])
        logits = md.einsum("n c, c k -> n k", pooled, fc) + fc_b
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "k"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"images": torch.randn(cfg.n, cfg.in_channels, cfg.size, cfg.size, generator=gen),
                "labels": torch.randint(0, cfg.num_classes, (cfg.n,), generator=gen)}

    return md.Model(g, loss, {"stem": stem, **stack, "fc": fc, "fc_b": fc_b}, feeds, cfg)
