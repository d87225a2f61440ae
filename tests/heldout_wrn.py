"""Held-out Wide ResNet-lite (round 19a), written from the guides: a 3x3 stem, a group of pre-activation
residual blocks (BN-ReLU-conv-dropout-BN-ReLU-conv + identity) under md.repeat over `layer`, a
downsampling block (stride-2 3x3 conv, stride-2 1x1 shortcut) into a wider group under md.repeat over
`layer2`, BN-ReLU, global average pool, cross-entropy. Every BN keeps running statistics (frozen
params, stacked per layer inside the repeats, set by md.Model(updates=) from the repeat's per-layer
outputs); `mode=eval` builds the eval graph that normalises with them (torch's model.eval()).

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
    width1: int = 16
    width2: int = 32
    layers: int = 2
    layers2: int = 2
    classes: int = 10
    dropout: float = 0.0
    momentum: float = 0.1
    mode: str = "train"
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, size=8, width1=4, width2=6, layers=2, layers2=2, classes=5, dropout=0.1)


def _norm(x, scale, bias, rm, rv, train: bool):
    """(y, mean, var): batch statistics in training, the running ones (rv stored minus 1) in eval."""
    if train:
        return md.batch_norm(x, ["batch", "height", "width"], scale + 1.0, bias, stats=True)
    return (x - rm) * md.rsqrt(rv + 1.0 + 1e-5) * (scale + 1.0) + bias, None, None


def _conv(x, w, stride=1, padding="same"):
    return md.rename(md.conv(x, w, {"height": "kh", "width": "kw"}, padding=padding, stride=stride),
                     c_out="channels")


def _running(upd, rm, rv, mean, var, n, m):
    upd[rm.name] = (1 - m) * rm + m * mean
    upd[rv.name] = (1 - m) * rv + m * (var * (n / (n - 1)) - 1.0)


def _group(h, name, depth, n, cfg, updates, train, seed):
    L, C = md.Dim(name, depth), h.shape["channels"]
    kh, kw, O = md.Dim("kh", 3), md.Dim("kw", 3), md.Dim("c_out", C.size)
    p = {k: md.param(f"{name}_{k}", [L, kh, kw, C, O], fan_out=[name, "c_out"]) for k in ("w1", "w2")}
    for k in ("g1", "b1", "g2", "b2"):
        p[k] = md.param(f"{name}_{k}", [L, C], scale=0.0)
    run = {k: md.param(f"{name}_{k}", [L, C], scale=0.0) for k in ("rm1", "rv1", "rm2", "rv2")}

    def block(x, q):
        y, m1, v1 = _norm(x, q["g1"], q["b1"], q.get("rm1"), q.get("rv1"), train)
        y = _conv(md.relu(y), q["w1"])
        if cfg.dropout:
            y = md.dropout(y, cfg.dropout, seed=seed)
        y, m2, v2 = _norm(y, q["g2"], q["b2"], q.get("rm2"), q.get("rv2"), train)
        out = x + _conv(md.relu(y), q["w2"])
        return (out, {"m1": m1, "v1": v1, "m2": m2, "v2": v2}) if train else out

    if not train:
        return md.repeat(block, h, {**p, **run}, L, remat=cfg.remat)
    h, st = md.repeat(block, h, p, L, remat=cfg.remat)
    for i in ("1", "2"):
        _running(updates, run["rm" + i], run["rv" + i], st["m" + i], st["v" + i], n, cfg.momentum)
    return h


def _bn_single(h, name, n, cfg, updates, train):
    C = h.shape["channels"]
    g, b, rm, rv = (md.param(f"{name}_{k}", [C], scale=0.0) for k in ("g", "b", "rm", "rv"))
    y, mean, var = _norm(h, g, b, rm, rv, train)
    if train:
        _running(updates, rm, rv, mean, var, n, cfg.momentum)
    return y


def _forward(cfg, x, train, updates):
    kh, kw = md.Dim("kh", 3), md.Dim("kw", 3)
    n1, n2 = cfg.batch * cfg.size ** 2, cfg.batch * (cfg.size // 2) ** 2
    h = _conv(x, md.param("stem", [kh, kw, x.shape["channels"], md.Dim("c_out", cfg.width1)], fan_out=["c_out"]))
    h = _group(h, "layer", cfg.layers, n1, cfg, updates, train, seed=1)
    # downsampling block: pre-activation, a stride-2 3x3 conv, the shortcut a stride-2 1x1 conv
    y = md.relu(_bn_single(h, "down_bn1", n1, cfg, updates, train))
    C2 = md.Dim("c_out", cfg.width2)
    w_d = md.param("down_w1", [kh, kw, h.shape["channels"], C2], fan_out=["c_out"])
    w_s = md.param("down_sc", [md.Dim("kh", 1), md.Dim("kw", 1), h.shape["channels"], C2], fan_out=["c_out"])
    short = _conv(y, w_s, stride=2, padding="valid")
    y = _conv(y, w_d, stride=2, padding=(1, 1))
    y = md.relu(_bn_single(y, "down_bn2", n2, cfg, updates, train))
    w_d2 = md.param("down_w2", [kh, kw, y.shape["channels"], C2], fan_out=["c_out"])
    h = short + _conv(y, w_d2)
    h = _group(h, "layer2", cfg.layers2, n2, cfg, updates, train, seed=2)
    h = md.relu(_bn_single(h, "final_bn", n2, cfg, updates, train))
    pooled = md.reduce_mean(h, ["height", "width"])
    w_head = md.param("head", [h.shape["channels"], md.Dim("classes", cfg.classes)], fan_out=["classes"])
    return md.einsum("... channels, channels classes -> ... classes", pooled, w_head)


def build(cfg: Config = Config()) -> md.Model:
    B, H, W, C = (md.Dim(n, s) for n, s in
                  [("batch", cfg.batch), ("height", cfg.size), ("width", cfg.size), ("channels", cfg.c_in)])
    updates: dict = {}
    with md.Graph("wrn") as g:
        x = md.input("images", [B, H, W, C])
        labels = md.input("labels", [B], dtype=torch.int64)
        logits = _forward(cfg, x, cfg.mode == "train", updates)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))
        metrics = {}
        if cfg.mode == "train":
            metrics["accuracy"] = md.reduce_mean(md.cast(md.equal(md.argmax(logits, "classes"), labels), torch.float32))
        running = {k for k in g.params() if "_rm" in k or "_rv" in k}
        params = {k: p for k, p in g.params().items() if k not in running}

    def feeds(seed: int = 0) -> dict:
        gen = torch.Generator().manual_seed(seed)
        labels = torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)
        imgs = torch.randn(cfg.batch, cfg.size, cfg.size, cfg.c_in, generator=gen)
        imgs[..., 0] += labels.float()[:, None, None] * 0.5
        return {"images": imgs, "labels": labels}

    return md.Model(g, loss, params, feeds, cfg, metrics=metrics,
                    updates=updates if cfg.mode == "train" else {})
