"""A Conformer-style speech encoder, written from the README and docs/ alone (a held-out model).

Frames of fed features ``[batch, seq, feat]`` are projected to ``d_model`` and run through
Conformer blocks under ``md.repeat``: a macaron pair of half-step feed-forward modules (SiLU)
around multi-head self-attention (the fused, non-causal ``md.attention``) and a convolution
module: a pointwise GLU (two einsums, ``a * sigmoid(b)``), a depthwise conv over ``seq`` (one
filter per channel: ``md.conv`` needed a ``c_out`` dim when this was written, so it is the sum
over taps of ``md.shift``-ed copies times that tap's filter; ``dw_op=True`` uses ``md.conv``'s
depthwise form, ``w [tap, ch]``, added since), a batch norm (mean and variance over
``batch`` and ``seq`` per channel, a whole-batch statistic inside the stack), SiLU and a
pointwise einsum; each block ends in a LayerNorm. The head classifies every frame
(cross-entropy over ``classes``, a CTC-free frame loss).
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    feat: int = 16
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    taps: int = 7
    layers: int = 2
    seq: int = 32
    batch: int = 4
    classes: int = 12
    bn_eps: float = 1e-5
    dw_op: bool = False     # the depthwise conv as md.conv(x, w [tap, ch]) instead of written out

    @classmethod
    def tiny(cls) -> "Config":
        return cls(feat=6, d_model=8, heads=2, d_head=4, d_ff=16, taps=3, layers=2, seq=8, batch=4, classes=5)


def depthwise(x: md.Tensor, w: md.Tensor, k: int) -> md.Tensor:
    """``y[.., i, c] = sum_t x[.., i + t - k // 2, c] * w[t, c]`` along ``seq`` ('same' padding)."""
    out = None
    for t in range(k):
        tap = md.squeeze(md.slice_(w, "tap", t, t + 1), "tap")       # [d_model]
        term = md.shift(x, "seq", k // 2 - t) * tap
        out = term if out is None else out + term
    return out


def build(cfg: Config = Config()) -> md.Model:
    batch, seq, key_seq = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("key_seq", cfg.seq)
    feat, d_model, heads = md.Dim("feat", cfg.feat), md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads)
    d_head, d_ff, tap = md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff), md.Dim("tap", cfg.taps)
    classes, layer = md.Dim("classes", cfg.classes), md.Dim("layer", cfg.layers)
    with md.Graph("heldout_conformer") as g:
        frames = md.input("frames", [batch, seq, feat])
        labels = md.input("labels", [batch, seq], dtype=torch.int64)
        w_in = md.param("w_in", [feat, d_model], fan_out=[d_model])
        blocks = {}
        for name in ("ff1", "ff2"):
            blocks[f"{name}_ln"] = md.param(f"{name}_ln", [layer, d_model], init="ones")
            blocks[f"{name}_up"] = md.param(f"{name}_up", [layer, d_model, d_ff], fan_out=["layer", d_ff])
            blocks[f"{name}_down"] = md.param(f"{name}_down", [layer, d_ff, d_model], fan_out=["layer", d_model])
        blocks.update({
            "att_ln": md.param("att_ln", [layer, d_model], init="ones"),
            "wq": md.param("wq", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head]),
            "wk": md.param("wk", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head]),
            "wv": md.param("wv", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head]),
            "wo": md.param("wo", [layer, heads, d_head, d_model], fan_out=["layer", d_model]),
            "conv_ln": md.param("conv_ln", [layer, d_model], init="ones"),
            "glu_a": md.param("glu_a", [layer, d_model, md.Dim("ch", cfg.d_model)], fan_out=["layer", "ch"]),
            "glu_b": md.param("glu_b", [layer, d_model, md.Dim("ch", cfg.d_model)], fan_out=["layer", "ch"]),
            "dw": md.param("dw", [layer, tap, md.Dim("ch", cfg.d_model)], fan_out=["layer", "ch"]),
            "bn_g": md.param("bn_g", [layer, md.Dim("ch", cfg.d_model)], init="ones"),
            "bn_b": md.param("bn_b", [layer, md.Dim("ch", cfg.d_model)], init="zeros"),
            "pw": md.param("pw", [layer, md.Dim("ch", cfg.d_model), d_model], fan_out=["layer", d_model]),
            "out_ln": md.param("out_ln", [layer, d_model], init="ones"),
            "out_ln_b": md.param("out_ln_b", [layer, d_model], init="zeros"),
        })
        w_head = md.param("w_head", [d_model, classes], fan_out=[classes])

        def ffn(x: md.Tensor, p: dict, name: str) -> md.Tensor:
            h = md.layer_norm(x, "d_model", p[f"{name}_ln"])
            h = md.silu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p[f"{name}_up"]))
            return md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", h, p[f"{name}_down"])

        def mhsa(x: md.Tensor, p: dict) -> md.Tensor:
            h = md.layer_norm(x, "d_model", p["att_ln"])
            q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wq"])
            k = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wk"])
            v = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wv"])
            k, v = md.rename(k, seq="key_seq"), md.rename(v, seq="key_seq")
            o = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=False)
            return md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, p["wo"])

        def conv_module(x: md.Tensor, p: dict) -> md.Tensor:
            h = md.layer_norm(x, "d_model", p["conv_ln"])
            a = md.einsum("batch seq d_model, d_model ch -> batch seq ch", h, p["glu_a"])
            b = md.einsum("batch seq d_model, d_model ch -> batch seq ch", h, p["glu_b"])
            h = a * md.sigmoid(b)
            h = md.conv(h, p["dw"], {"seq": "tap"}) if cfg.dw_op else depthwise(h, p["dw"], cfg.taps)
            mean = md.reduce_mean(h, ["batch", "seq"])
            var = md.reduce_mean((h - mean) ** 2, ["batch", "seq"])
            h = (h - mean) * md.rsqrt(var + cfg.bn_eps) * p["bn_g"] + p["bn_b"]
            return md.einsum("batch seq ch, ch d_model -> batch seq d_model", md.silu(h), p["pw"])

        def block(x: md.Tensor, p: dict) -> md.Tensor:
            x = x + 0.5 * ffn(x, p, "ff1")
            x = x + mhsa(x, p)
            x = x + conv_module(x, p)
            x = x + 0.5 * ffn(x, p, "ff2")
            return md.layer_norm(x, "d_model", p["out_ln"], p["out_ln_b"])

        x = md.einsum("batch seq feat, feat d_model -> batch seq d_model", frames, w_in)
        x = md.repeat(block, x, blocks, "layer")
        logits = md.einsum("batch seq d_model, d_model classes -> batch seq classes", x, w_head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"frames": torch.randn(cfg.batch, cfg.seq, cfg.feat, generator=gen),
                "labels": torch.randint(0, cfg.classes, (cfg.batch, cfg.seq), generator=gen)}

    return md.Model(g, loss, {"w_in": w_in, **blocks, "w_head": w_head}, feeds, cfg)
