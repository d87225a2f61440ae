"""A soft mixture of depthwise-separable conv experts over audio frames, written from the README
and docs/ alone (a held-out model).

Log-mel frames ``[batch, frames, mels]`` are projected to ``ch`` channels. Each layer of the
``md.repeat`` stack routes every frame softly over ``experts``: a router einsum and a softmax
over ``experts`` give the gates; every expert is a depthwise-separable conv, the frames given
an ``experts`` dim by ``md.broadcast_to``, a depthwise conv over ``frames`` with one filter per
expert and channel (``md.conv`` with ``w [tap, experts, ch]``, no output channel dim), GELU and
a pointwise einsum per expert; the gate-weighted sum over ``experts`` is the residual branch,
after a LayerNorm. Mean pooling over the frames and a linear head classify each clip
(cross-entropy over ``classes``).
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    mels: int = 16
    frames: int = 32
    ch: int = 16
    experts: int = 4
    taps: int = 5
    layers: int = 2
    batch: int = 4
    classes: int = 8

    @classmethod
    def tiny(cls) -> "Config":
        return cls(mels=6, frames=8, ch=4, experts=4, taps=3, layers=2, batch=4, classes=3)


def build(cfg: Config = Config()) -> md.Model:
    batch, frames, mels = md.Dim("batch", cfg.batch), md.Dim("frames", cfg.frames), md.Dim("mels", cfg.mels)
    ch, ch_out, experts = md.Dim("ch", cfg.ch), md.Dim("ch_out", cfg.ch), md.Dim("experts", cfg.experts)
    tap, layer, classes = md.Dim("tap", cfg.taps), md.Dim("layer", cfg.layers), md.Dim("classes", cfg.classes)
    with md.Graph("heldout_sepconv_moe") as g:
        x_in = md.input("mel", [batch, frames, mels])
        labels = md.input("labels", [batch], dtype=torch.int64)
        w_in = md.param("w_in", [mels, ch], fan_out=[ch])
        blocks = {
            "ln": md.param("ln", [layer, ch], init="ones"),
            "router": md.param("router", [layer, ch, experts], fan_out=["layer", experts]),
            "dw": md.param("dw", [layer, tap, experts, ch], fan_out=["layer", experts, ch]),
            "pw": md.param("pw", [layer, experts, ch, ch_out], fan_out=["layer", experts, ch_out]),
        }
        w_head = md.param("w_head", [ch, classes], fan_out=[classes])

        def block(x: md.Tensor, p: dict) -> md.Tensor:
            h = md.layer_norm(x, "ch", p["ln"])
            gates = md.softmax(md.einsum("batch frames ch, ch experts -> batch frames experts", h, p["router"]), "experts")
            he = md.broadcast_to(h, [batch, frames, experts, ch])
            he = md.gelu(md.conv(he, p["dw"], {"frames": "tap"}))               # one filter per expert and channel
            out = md.einsum("batch frames experts ch, experts ch ch_out, batch frames experts -> batch frames ch_out",
                            he, p["pw"], gates)
            return x + md.rename(out, ch_out="ch")

        x = md.einsum("batch frames mels, mels ch -> batch frames ch", x_in, w_in)
        x = md.repeat(block, x, blocks, "layer")
        logits = md.einsum("batch ch, ch classes -> batch classes", md.reduce_mean(x, "frames"), w_head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"mel": torch.randn(cfg.batch, cfg.frames, cfg.mels, generator=gen),
                "labels": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    return md.Model(g, loss, {"w_in": w_in, **blocks, "w_head": w_head}, feeds, cfg)
