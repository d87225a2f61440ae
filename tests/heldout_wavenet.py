"""A WaveNet, written from the README and docs/ alone (a held-out model).

Audio as 8-bit mu-law ids ``[batch, time]`` (256 classes), predicting each next sample. The ids
are embedded by ``md.gather`` from one table, then a causal conv of 2 taps. Stacks of layers with
dilations 1, 2, 4, ..., 2**(per_stack - 1): a ``md.repeat`` over ``stack`` (the dilation differs
per layer, and a repeat's layers share one block, so each stack unrolls its dilations, with
params stacked over ``stack``). A layer: a filter and a gate conv (``md.conv(..., padding="causal",
dilation=d)``, 2 taps), ``tanh(filter) * sigmoid(gate)``, a 1x1 residual projection added to the
input and a 1x1 skip projection. The skips are summed over every layer: each stack carries its
running sum in the carry, joined to the residual stream by ``md.concat`` on ``ch``
(``res`` channels then ``skip`` channels), so the stacks pipeline. Head: ReLU, 1x1 conv, ReLU,
1x1 conv to the 256 mu-law classes, the cross entropy over them.

Legend: b = batch, t = time, ch = res + skip (the carry), r = res, s = skip, mu = classes.
"""
from dataclasses import dataclass
import math

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 4
    time: int = 1024
    res: int = 32
    skip: int = 64
    per_stack: int = 10
    stacks: int = 2
    classes: int = 256
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=2, time=48, res=4, skip=6, per_stack=4, stacks=2, classes=256)


def mu_law(x: torch.Tensor, classes: int) -> torch.Tensor:
    """mu-law ids in [0, classes) of a signal in [-1, 1]."""
    mu = classes - 1
    y = torch.sign(x) * torch.log1p(mu * x.abs()) / math.log1p(mu)
    return ((y + 1) / 2 * mu + 0.5).long().clamp(0, mu)


def build(cfg: Config = Config()) -> md.Model:
    R, S = cfg.res, cfg.skip
    batch, time, stack = md.Dim("batch", cfg.batch), md.Dim("time", cfg.time), md.Dim("stack", cfg.stacks)
    mu, r, r2, s, tap = md.Dim("mu", cfg.classes), md.Dim("r", R), md.Dim("r2", R), md.Dim("s", S), md.Dim("tap", 2)
    s2, s3 = md.Dim("s2", S), md.Dim("mu2", cfg.classes)
    dilations = [2 ** i for i in range(cfg.per_stack)]
    with md.Graph("heldout_wavenet") as g:
        ids = md.input("ids", [batch, time], dtype=torch.int64)
        target = md.input("target", [batch, time], dtype=torch.int64)
        p = {"embed": md.param("embed", [mu, r], scale=1.0),
             "causal": md.param("causal", [tap, r, r2], fan_out=["r2"]),
             "out1": md.param("out1", [s, s2], fan_out=["s2"]),
             "out2": md.param("out2", [s2, s3], fan_out=["mu2"])}
        layers = {}
        for d in dilations:
            for n in ("filter", "gate"):
                layers[f"{n}{d}"] = md.param(f"{n}{d}", [stack, tap, r, r2], fan_out=["stack", "r2"])
            layers[f"res{d}"] = md.param(f"res{d}", [stack, r2, md.Dim("r3", R)], fan_out=["stack", "r3"])
            layers[f"skip{d}"] = md.param(f"skip{d}", [stack, r2, s], fan_out=["stack", "s"])

        def stack_block(carry: md.Tensor, q: dict) -> md.Tensor:        # carry [batch, time, ch: R + S]
            h = md.rename(md.slice_(carry, "ch", 0, R), ch="r")
            skips = md.rename(md.slice_(carry, "ch", R, R + S), ch="s")
            for d in dilations:
                f = md.conv(h, q[f"filter{d}"], {"time": "tap"}, padding="causal", dilation=d)
                gt = md.conv(h, q[f"gate{d}"], {"time": "tap"}, padding="causal", dilation=d)
                z = md.tanh(f) * md.sigmoid(gt)                                # [batch, time, r2]
                h = h + md.rename(md.einsum("batch time r2, r2 r3 -> batch time r3", z, q[f"res{d}"]), r3="r")
                skips = skips + md.einsum("batch time r2, r2 s -> batch time s", z, q[f"skip{d}"])
            return md.concat([md.rename(h, r="ch"), md.rename(skips, s="ch")], "ch")

        x = md.gather(p["embed"], ids, "mu")                                      # [batch, time, r]
        x = md.rename(md.conv(x, p["causal"], {"time": "tap"}, padding="causal"), r2="r")
        carry = md.pad(md.rename(x, r="ch"), "ch", 0, S)                       # the skips' sum starts at zero
        carry = md.repeat(stack_block, carry, layers, "stack", remat=cfg.remat)
        skips = md.rename(md.slice_(carry, "ch", R, R + S), ch="s")
        y = md.relu(md.einsum("batch time s, s s2 -> batch time s2", md.relu(skips), p["out1"]))
        logits = md.einsum("batch time s2, s2 mu2 -> batch time mu2", y, p["out2"])
        loss = md.reduce_mean(md.cross_entropy(logits, target, "mu2"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        t = torch.arange(cfg.time + 1, dtype=torch.float32)
        freq = torch.rand(cfg.batch, 1, generator=gen) * 0.2 + 0.02
        x = 0.8 * torch.sin(freq * t) + 0.05 * torch.randn(cfg.batch, cfg.time + 1, generator=gen)
        q = mu_law(x.clamp(-1, 1), cfg.classes)
        return {"ids": q[:, :-1], "target": q[:, 1:]}

    return md.Model(g, loss, {**p, **layers}, feeds, cfg)
