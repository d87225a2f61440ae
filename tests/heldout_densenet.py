"""Held-out DenseNet-lite (round 19a), written from the guides: dense blocks whose layers' outputs
are concatenated to their inputs (the channels grow by `growth` a layer), BN-ReLU-conv layers,
transition layers (BN-ReLU, 1x1 conv, 2x2 average pool as a stride-2 depthwise conv of a constant
0.25 filter), a global average pool and cross-entropy. Every md.batch_norm keeps running statistics
(frozen params set by md.Model(updates=)); `mode=eval` normalises with them instead.

Legend: x_bhwc [batch, height, width, channels]; kh, kw the conv taps.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 8
    size: int = 16
    c_in: int = 3
    c0: int = 8
    growth: int = 4
    layers_per_block: int = 3
    blocks: int = 2
    classes: int = 10
    momentum: float = 0.1
    mode: str = "train"        # train: batch statistics (and running ones updated); eval: running ones

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, size=8, c_in=3, c0=4, growth=2, layers_per_block=2, blocks=2, classes=5)


def _bn(x, name, n, cfg, updates):
    """BatchNorm over (batch, height, width) per channel; running stats as frozen params."""
    c = x.shape["channels"]
    scale, bias = md.param(f"{name}_g", [c], scale=0.0), md.param(f"{name}_b", [c], scale=0.0)
    scale = scale + 1.0
    mean_r = md.param(f"{name}_rm", [c], scale=0.0)
    var_r = md.param(f"{name}_rv", [c], scale=0.0)
    if cfg.mode == "eval":
        return (x - mean_r) * md.rsqrt(var_r + 1.0 + 1e-5) * scale + bias
    y, mean, var = md.batch_norm(x, ["batch", "height", "width"], scale, bias, stats=True)
    m = cfg.momentum
    updates[mean_r.name] = (1 - m) * mean_r + m * mean
    # var_r holds (running variance - 1), so the zero init is torch's running_var = 1
    updates[var_r.name] = (1 - m) * var_r + m * (var * (n / (n - 1)) - 1.0)
    return y


def _conv(x, name, c_out_size, k):
    kh, kw = md.Dim("kh", k), md.Dim("kw", k)
    out = md.Dim("c_out", c_out_size)
    w = md.param(name, [kh, kw, x.shape["channels"], out], fan_out=["c_out"])
    y = md.conv(x, w, {"height": "kh", "width": "kw"}, padding="same")
    return md.rename(y, c_out="channels")


def build(cfg: Config = Config()) -> md.Model:
    B, H, W, C = (md.Dim(n, s) for n, s in
                  [("batch", cfg.batch), ("height", cfg.size), ("width", cfg.size), ("channels", cfg.c_in)])
    K = md.Dim("classes", cfg.classes)
    updates: dict = {}
    with md.Graph("densenet") as g:
        x = md.input("images", [B, H, W, C])
        labels = md.input("labels", [B], dtype=torch.int64)
        h = _conv(x, "stem", cfg.c0, 3)
        size = cfg.size
        for b in range(cfg.blocks):
            for i in range(cfg.layers_per_block):
                n = cfg.batch * size * size
                y = md.relu(_bn(h, f"b{b}l{i}_bn", n, cfg, updates))
                y = _conv(y, f"b{b}l{i}_w", cfg.growth, 3)
                h = md.concat([h, y], "channels")          # the dense connection: channels grow
            if b < cfg.blocks - 1:                            # transition: BN-ReLU, 1x1 conv, avg pool 2x2
                n = cfg.batch * size * size
                y = md.relu(_bn(h, f"t{b}_bn", n, cfg, updates))
                y = _conv(y, f"t{b}_w", h.shape["channels"].size // 2, 1)
                pool = md.constant(0.25, [md.Dim("kh", 2), md.Dim("kw", 2), y.shape["channels"]])
                h = md.conv(y, pool, {"height": "kh", "width": "kw"}, padding="valid", stride=2)
                size //= 2
        n = cfg.batch * size * size
        h = md.relu(_bn(h, "final_bn", n, cfg, updates))
        pooled = md.reduce_mean(h, ["height", "width"])
        w_head = md.param("head", [h.shape["channels"], K], fan_out=["classes"])
        logits = md.einsum("... channels, channels classes -> ... classes", pooled, w_head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))
        hit = md.equal(md.argmax(logits, "classes"), labels)
        acc = md.reduce_mean(md.cast(hit, torch.float32))
        params = {k: p for k, p in g.params().items() if not (k.endswith("_rm") or k.endswith("_rv"))}

    def feeds(seed: int = 0) -> dict:
        gen = torch.Generator().manual_seed(seed)
        labels = torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)
        imgs = torch.randn(cfg.batch, cfg.size, cfg.size, cfg.c_in, generator=gen)
        imgs[..., 0] += labels.float()[:, None, None] * 0.5      # a learnable signal
        return {"images": imgs, "labels": labels}

    return md.Model(g, loss, params, feeds, cfg, metrics={"accuracy": acc},
                    updates=updates if cfg.mode == "train" else {})
