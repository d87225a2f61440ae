"""A Perceiver-style classifier, written from the README and docs/ alone (a held-out model).

A learned latent array ``[latents, d_model]`` (broadcast over the batch with
``md.broadcast_to``) is the carry of a ``md.repeat`` stack. Each layer cross-attends from the
latents to a long input array ``[batch, seq, d_model]`` (the inputs' embedding plus Fourier
position features, made once before the stack and read by every layer from outside it, so
its gradient sums every layer's), then runs latent self-attention and an MLP. The input is
projected to keys and values by each layer's own weights; the latents attend to ``seq``
positions, many more than there are latents. LayerNorm, gelu, a mean over the latents, a
cross-entropy over classes.
"""
from dataclasses import dataclass
import math

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    seq: int = 256
    d_in: int = 8
    latents: int = 16
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    bands: int = 4
    layers: int = 2
    classes: int = 10
    batch: int = 4
    fused: bool = True        # the cross-attention as md.attention, or as einsums and a softmax

    @classmethod
    def tiny(cls) -> "Config":
        return cls(seq=32, d_in=4, latents=4, d_model=16, heads=2, d_head=8, d_ff=32, bands=2, layers=2,
                   classes=5, batch=4)


def build(cfg: Config = Config()) -> md.Model:
    batch, seq, d_in = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("d_in", cfg.d_in)
    latents, key_latents = md.Dim("latents", cfg.latents), md.Dim("key_latents", cfg.latents)
    d_model, heads, d_head = md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    d_ff, classes, layer = md.Dim("d_ff", cfg.d_ff), md.Dim("classes", cfg.classes), md.Dim("layer", cfg.layers)
    bands = md.Dim("bands", cfg.bands)
    with md.Graph("heldout_perceiver") as g:
        x_in = md.input("x", [batch, seq, d_in])
        labels = md.input("labels", [batch], dtype=torch.int64)
        w_in = md.param("w_in", [d_in, d_model], fan_out=[d_model])
        w_pos = md.param("w_pos", [md.Dim("sincos", 2), bands, d_model], fan_out=[d_model])
        latent0 = md.param("latent0", [latents, d_model], scale=0.5)
        stack = {
            "ln_x": md.param("ln_x", [layer, d_model], init="ones"),
            "ln_q": md.param("ln_q", [layer, d_model], init="ones"),
            "cq": md.param("cq", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head]),
            "ck": md.param("ck", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head]),
            "cv": md.param("cv", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head]),
            "co": md.param("co", [layer, heads, d_head, d_model], fan_out=["layer", d_model]),
            "ln_s": md.param("ln_s", [layer, d_model], init="ones"),
            "sq": md.param("sq", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head]),
            "sk": md.param("sk", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head]),
            "sv": md.param("sv", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head]),
            "so": md.param("so", [layer, heads, d_head, d_model], fan_out=["layer", d_model]),
            "ln_m": md.param("ln_m", [layer, d_model], init="ones"),
            "w1": md.param("w1", [layer, d_model, d_ff], fan_out=["layer", d_ff]),
            "w2": md.param("w2", [layer, d_ff, d_model], fan_out=["layer", d_model]),
        }
        ln_f = md.param("ln_f", [d_model], init="ones")
        w_head = md.param("w_head", [d_model, classes], fan_out=[classes])

        # Fourier features of the position in [0, 1): sin and cos of pi * 2^b * pos, projected
        freqs = md.constant(math.pi * 2.0 ** torch.arange(cfg.bands, dtype=torch.float32), [bands])
        phase = md.cast(md.arange(seq), torch.float32) * (1.0 / cfg.seq) * freqs         # [seq, bands]
        fourier = md.concat([md.unsqueeze(md.sin(phase), "sincos"), md.unsqueeze(md.cos(phase), "sincos")], "sincos")
        pos = md.einsum("seq bands sincos, sincos bands d_model -> seq d_model", fourier, w_pos)
        inputs = md.einsum("batch seq d_in, d_in d_model -> batch seq d_model", x_in, w_in) + pos

        def block(z: md.Tensor, p: dict[str, md.Tensor]) -> md.Tensor:
            # cross-attention: latents (queries) over the input array (keys, values)
            hx = md.layer_norm(inputs, "d_model", p["ln_x"])
            hz = md.layer_norm(z, "d_model", p["ln_q"])
            q = md.einsum("batch latents d_model, d_model heads d_head -> batch latents heads d_head", hz, p["cq"])
            k = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", hx, p["ck"])
            v = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", hx, p["cv"])
            if cfg.fused:
                o = md.attention(q, k, v, "latents", "seq", "d_head", causal=False)
            else:   # a split seq stays split: softmax's sums and the value sum are allreduced
                s = md.einsum("batch latents heads d_head, batch seq heads d_head -> batch heads latents seq", q, k)
                att = md.softmax(s * cfg.d_head ** -0.5, "seq")
                o = md.einsum("batch heads latents seq, batch seq heads d_head -> batch latents heads d_head", att, v)
            z = z + md.einsum("batch latents heads d_head, heads d_head d_model -> batch latents d_model", o, p["co"])
            # latent self-attention
            h = md.layer_norm(z, "d_model", p["ln_s"])
            q = md.einsum("batch latents d_model, d_model heads d_head -> batch latents heads d_head", h, p["sq"])
            k = md.einsum("batch latents d_model, d_model heads d_head -> batch latents heads d_head", h, p["sk"])
            v = md.einsum("batch latents d_model, d_model heads d_head -> batch latents heads d_head", h, p["sv"])
            k, v = md.rename(k, latents="key_latents"), md.rename(v, latents="key_latents")
            o = md.attention(q, k, v, "latents", "key_latents", "d_head", causal=False)
            z = z + md.einsum("batch latents heads d_head, heads d_head d_model -> batch latents d_model", o, p["so"])
            h = md.layer_norm(z, "d_model", p["ln_m"])
            h = md.gelu(md.einsum("batch latents d_model, d_model d_ff -> batch latents d_ff", h, p["w1"]))
            return z + md.einsum("batch latents d_ff, d_ff d_model -> batch latents d_model", h, p["w2"])

        z0 = md.broadcast_to(latent0, [batch, latents, d_model])
        z = md.repeat(block, z0, stack, "layer")
        pooled = md.reduce_mean(md.layer_norm(z, "d_model", ln_f), "latents")
        logits = md.einsum("batch d_model, d_model classes -> batch classes", pooled, w_head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(cfg.batch, cfg.seq, cfg.d_in, generator=gen),
                "labels": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    params = {"w_in": w_in, "w_pos": w_pos, "latent0": latent0, **stack, "ln_f": ln_f, "w_head": w_head}
    return md.Model(g, loss, params, feeds, cfg)
