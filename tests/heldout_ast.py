"""An audio spectrogram transformer (AST-style), written from README.md and docs/ only (a held-out model).

A log-mel spectrogram ``[batch, freq, time]`` gets a size-1 ``chan`` dim and is cut into
``patch x patch`` 2-D patches by a strided conv (``md.conv`` over ``freq`` and ``time``, kernel
``patch``, stride ``stride``: ``stride < patch`` overlaps them, as AST's 16/10), a grid
``[batch, freq, time, d_model]`` flattened to ``patches`` by ``md.rearrange``, plus learned position
embeddings. A pre-LN encoder stack over ``layer`` (``md.repeat``, fused non-causal attention, gelu
MLP), a final layer norm, the mean over the patches, a linear head over ``labels`` and the
multi-label binary cross-entropy (with logits, written stably as
``max(z, 0) - z y + log(1 + exp(-|z|))``) against 0/1 targets ``[batch, labels]``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 8
    freq: int = 32
    time: int = 64
    patch: int = 8
    stride: int = 6
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 2
    labels: int = 12

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, freq=8, time=11, patch=3, stride=2, d_model=8, heads=2, d_head=4, d_ff=16,
                   layers=2, labels=5)


def grid(n: int, patch: int, stride: int) -> int:
    """Positions of a 'valid' conv of kernel ``patch`` and ``stride`` over ``n``."""
    return (n - patch) // stride + 1


def build(cfg: Config = Config()) -> md.Model:
    nf, nt = grid(cfg.freq, cfg.patch, cfg.stride), grid(cfg.time, cfg.patch, cfg.stride)
    batch, freq, time = md.Dim("batch", cfg.batch), md.Dim("freq", cfg.freq), md.Dim("time", cfg.time)
    chan, kf, kt = md.Dim("chan", 1), md.Dim("kf", cfg.patch), md.Dim("kt", cfg.patch)
    d_model, heads, d_head = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    d_ff, layer, labels = md.Dim("d_ff", cfg.d_ff), md.Dim("layer", cfg.layers), md.Dim("labels", cfg.labels)
    patches = md.Dim("patches", nf * nt)
    L = ["layer"]
    with md.Graph("heldout_ast") as g:
        spec = md.input("spec", [batch, freq, time])
        targets = md.input("targets", [batch, labels])
        w_patch = md.param("w_patch", [kf, kt, chan, d_model], fan_out=["d_model"])
        b_patch = md.param("b_patch", [d_model], init="zeros")
        wpe = md.param("wpe", [patches, d_model], scale=0.5)
        stack = {
            "ln1": md.param("ln1", [layer, d_model], init="ones"),
            "ln1_b": md.param("ln1_b", [layer, d_model], init="zeros"),
            **{f"w{n}": md.param(f"w{n}", [layer, d_model, heads, d_head], fan_out=L + ["heads", "d_head"]) for n in "qkv"},
            "wo": md.param("wo", [layer, heads, d_head, d_model], fan_out=L + ["d_model"]),
            "ln2": md.param("ln2", [layer, d_model], init="ones"),
            "ln2_b": md.param("ln2_b", [layer, d_model], init="zeros"),
            "w_fc": md.param("w_fc", [layer, d_model, d_ff], fan_out=L + ["d_ff"]),
            "b_fc": md.param("b_fc", [layer, d_ff], init="zeros"),
            "w_proj": md.param("w_proj", [layer, d_ff, d_model], fan_out=L + ["d_model"]),
        }
        lnf = md.param("lnf", [d_model], init="ones")
        w_head = md.param("w_head", [d_model, labels], fan_out=["labels"])
        b_head = md.param("b_head", [labels], init="zeros")

        def block(x, p):
            h = md.layer_norm(x, "d_model", p["ln1"], p["ln1_b"])
            q, k, v = (md.einsum("batch patches d_model, d_model heads d_head -> batch patches heads d_head", h, p[f"w{n}"])
                       for n in "qkv")
            k, v = md.rename(k, patches="key_patches"), md.rename(v, patches="key_patches")
            o = md.attention(q, k, v, "patches", "key_patches", "d_head", causal=False)
            x = x + md.einsum("batch patches heads d_head, heads d_head d_model -> batch patches d_model", o, p["wo"])
            h = md.gelu(md.einsum("batch patches d_model, d_model d_ff -> batch patches d_ff",
                                  md.layer_norm(x, "d_model", p["ln2"], p["ln2_b"]), p["w_fc"]) + p["b_fc"])
            return x + md.einsum("batch patches d_ff, d_ff d_model -> batch patches d_model", h, p["w_proj"])

        x = md.conv(md.unsqueeze(spec, chan), w_patch, {"freq": "kf", "time": "kt"}, padding="valid",
                    stride=cfg.stride) + b_patch                      # [batch, freq:nf, time:nt, d_model]
        x = md.rename(md.rearrange(x, "batch freq time d_model -> batch (freq time) d_model"), freq_time="patches") + wpe
        x = md.repeat(block, x, stack, "layer")
        pooled = md.reduce_mean(md.layer_norm(x, "d_model", lnf), "patches")
        z = md.einsum("batch d_model, d_model labels -> batch labels", pooled, w_head) + b_head
        bce = md.relu(z) - z * targets + md.log(1.0 + md.exp(-md.abs(z)))
        loss = md.reduce_mean(bce)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"spec": torch.randn(cfg.batch, cfg.freq, cfg.time, generator=gen),
                "targets": (torch.rand(cfg.batch, cfg.labels, generator=gen) < 0.3).float()}

    params = {"w_patch": w_patch, "b_patch": b_patch, "wpe": wpe, **stack, "lnf": lnf, "w_head": w_head, "b_head": b_head}
    return md.Model(g, loss, params, feeds, cfg, outputs={"logits": z})
