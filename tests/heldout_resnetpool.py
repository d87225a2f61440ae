"""Held-out model (round 26c): a ResNet-18-lite written from the docs alone.

A 7x7 stride-2 stem conv, batch norm with torch's running statistics, ReLU and a 3x3 stride-2
max pool; two stages of basic blocks (the second opens with a stride-2 conv and a 1x1 stride-2
projection shortcut); a global average pool, a linear head and a label-smoothed cross-entropy.

Legend: ``batch`` images, ``height``/``width`` pixels, ``rgb`` the image's channels, ``ch`` a
feature map's channels (every conv's ``co`` renamed back to ``ch``), ``kh``/``kw`` taps,
``classes`` the head's outputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 8
    image: int = 32
    c1: int = 16
    c2: int = 32
    classes: int = 10
    smoothing: float = 0.1

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, image=16, c1=4, c2=8, classes=5)


def _conv(x, name, k, c_in, c_out, stride=1, pad=None):
    """A bias-free k x k conv from ``c_in`` to ``c_out`` channels, torch's padding ``pad``."""
    kh, kw, co = md.Dim("kh", k), md.Dim("kw", k), md.Dim("co", c_out)
    w = md.param(name, [kh, kw, x.shape[c_in], co], fan_out=[co])
    pad = (k - 1) // 2 if pad is None else pad
    y = md.conv(x, w, {"height": "kh", "width": "kw"}, padding=(pad, pad), stride=stride)
    return md.rename(y, co="ch")


def _bn(x, name, frozen):
    """Batch norm over batch and pixels, with running statistics kept as torch keeps them."""
    ch = x.shape["ch"]
    scale = md.param(f"{name}_s", [ch], init="ones")
    bias = md.param(f"{name}_b", [ch], init="zeros")
    mean = md.param(f"{name}_rm", [ch], init="zeros")
    var = md.param(f"{name}_rv", [ch], init="ones")
    frozen.update({mean.name: mean, var.name: var})
    return md.batch_norm(x, ["batch", "height", "width"], scale, bias, running=(mean, var))


def _block(x, name, c_out, stride, frozen):
    """A basic block: conv-BN-ReLU-conv-BN plus the shortcut (projected where it changes shape)."""
    h = md.relu(_bn(_conv(x, f"{name}_c1", 3, "ch", c_out, stride), f"{name}_bn1", frozen))
    h = _bn(_conv(h, f"{name}_c2", 3, "ch", c_out), f"{name}_bn2", frozen)
    if stride != 1 or x.shape["ch"].size != c_out:
        x = _bn(_conv(x, f"{name}_proj", 1, "ch", c_out, stride, pad=0), f"{name}_bnp", frozen)
    return md.relu(h + x)


def build(cfg: Config) -> md.Model:
    b, hgt = md.Dim("batch", cfg.batch), md.Dim("height", cfg.image)
    wid, rgb = md.Dim("width", cfg.image), md.Dim("rgb", 3)
    classes = md.Dim("classes", cfg.classes)
    frozen: dict = {}
    with md.Graph() as g:
        x = md.input("x", [b, hgt, wid, rgb])
        labels = md.input("labels", [b], dtype=torch.int64)
        h = md.relu(_bn(_conv(x, "stem", 7, "rgb", cfg.c1, stride=2), "bn0", frozen))
        h = md.max_pool(h, {"height": 3, "width": 3}, stride=2, padding=1)
        h = _block(h, "s1", cfg.c1, 1, frozen)
        h = _block(h, "s2", cfg.c2, 2, frozen)
        pooled = md.reduce_mean(h, ["height", "width"])
        head = md.param("head", [pooled.shape["ch"], classes], fan_out=[classes])
        logits = md.einsum("batch ch, ch classes -> batch classes", pooled, head)
        ce = md.cross_entropy(logits, labels, "classes", label_smoothing=cfg.smoothing)
        loss = md.reduce_mean(ce)
    params = {n: p for n, p in g.params().items() if n not in frozen}

    def make_feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(cfg.batch, cfg.image, cfg.image, 3, generator=gen),
                "labels": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    return md.Model(g, loss, params, make_feeds, cfg)


def torch_reference(cfg: Config, weights: dict, feeds: dict, running: dict | None = None) -> torch.Tensor:
    """The same model in plain torch (float64, NCHW), the loss from ``weights`` by name.

    ``running``: norm name -> ``[mean, var]`` tensors that torch's training-mode batch norm
    updates in place (momentum 0.1, the variance unbiased), as ``BatchNorm2d`` does."""
    w = {k: v.double() for k, v in weights.items()}

    def conv(x, name, stride, pad):  # meshdsl's [kh, kw, c_in, c_out] -> torch's [c_out, c_in, kh, kw]
        return torch.nn.functional.conv2d(x, w[name].permute(3, 2, 0, 1), stride=stride, padding=pad)

    def bn(x, name):
        stats = running.get(name, (None, None)) if running is not None else (None, None)
        return torch.nn.functional.batch_norm(x, *stats, w[f"{name}_s"], w[f"{name}_b"], training=True)

    def block(x, name, stride, project):
        h = torch.relu(bn(conv(x, f"{name}_c1", stride, 1), f"{name}_bn1"))
        h = bn(conv(h, f"{name}_c2", 1, 1), f"{name}_bn2")
        if project:
            x = bn(conv(x, f"{name}_proj", stride, 0), f"{name}_bnp")
        return torch.relu(h + x)

    x = feeds["x"].double().permute(0, 3, 1, 2)
    h = torch.relu(bn(conv(x, "stem", 2, 3), "bn0"))
    h = torch.nn.functional.max_pool2d(h, 3, stride=2, padding=1)
    h = block(h, "s1", 1, cfg.c1 != cfg.c1)
    h = block(h, "s2", 2, True)
    logits = h.mean((2, 3)) @ w["head"]
    return torch.nn.functional.cross_entropy(logits, feeds["labels"], label_smoothing=cfg.smoothing)
