"""A CaiT-style image classifier, written from README.md and docs/ only (a held-out model).

Images ``[batch, height, width, channels]`` are cut into patches by ``md.rearrange`` and embedded
(``[batch, patches, d_model]``, plus learned position embeddings). Two stacks follow:

- a self-attention stack over ``layer`` (``md.repeat``): pre-LN attention and a gelu MLP over the
  patches, each branch scaled per channel by LayerScale (``gamma [layer, d_model]``, small init);
- a class-attention stack over ``ca_layer`` (a second ``md.repeat``): its carry is the class token
  ``[batch, d_model]`` (a param broadcast over the batch); every layer's block reads the patches
  made by the first stack (frozen: they are not updated here), the class token attends to
  ``[class token; patches]`` (a concat along ``tokens``), then a gelu MLP, both LayerScaled.

A final layer norm of the class token, a linear head and the cross-entropy over classes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 8
    size: int = 16
    channels: int = 3
    patch: int = 4
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 4
    ca_layers: int = 2
    classes: int = 10
    layer_scale: float = 0.1

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, size=8, channels=2, patch=2, d_model=8, heads=2, d_head=4, d_ff=16,
                   layers=2, ca_layers=2, classes=5)


def build(cfg: Config = Config()) -> md.Model:
    npatch = (cfg.size // cfg.patch) ** 2
    batch, height, width = md.Dim("batch", cfg.batch), md.Dim("height", cfg.size), md.Dim("width", cfg.size)
    channels, d_model = md.Dim("channels", cfg.channels), md.Dim("d_model", cfg.d_model)
    pix = md.Dim("pix", cfg.patch * cfg.patch * cfg.channels)
    patches = md.Dim("patches", npatch)
    heads, d_head, d_ff = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    layer, ca_layer, classes = md.Dim("layer", cfg.layers), md.Dim("ca_layer", cfg.ca_layers), md.Dim("classes", cfg.classes)
    scale = cfg.d_head ** -0.5

    def stack_params(prefix: str, L: md.Dim) -> dict[str, md.Tensor]:
        n = L.name
        return {
            f"{prefix}ln1": md.param(f"{prefix}ln1", [L, d_model], init="ones"),
            f"{prefix}wq": md.param(f"{prefix}wq", [L, d_model, heads, d_head], fan_out=[n, "heads", "d_head"]),
            f"{prefix}wk": md.param(f"{prefix}wk", [L, d_model, heads, d_head], fan_out=[n, "heads", "d_head"]),
            f"{prefix}wv": md.param(f"{prefix}wv", [L, d_model, heads, d_head], fan_out=[n, "heads", "d_head"]),
            f"{prefix}wo": md.param(f"{prefix}wo", [L, heads, d_head, d_model], fan_out=[n, "d_model"]),
            f"{prefix}g1": md.param(f"{prefix}g1", [L, d_model], init=cfg.layer_scale),
            f"{prefix}ln2": md.param(f"{prefix}ln2", [L, d_model], init="ones"),
            f"{prefix}w_fc": md.param(f"{prefix}w_fc", [L, d_model, d_ff], fan_out=[n, "d_ff"]),
            f"{prefix}w_proj": md.param(f"{prefix}w_proj", [L, d_ff, d_model], fan_out=[n, "d_model"]),
            f"{prefix}g2": md.param(f"{prefix}g2", [L, d_model], init=cfg.layer_scale),
        }

    with md.Graph("heldout_cait") as g:
        images = md.input("images", [batch, height, width, channels])
        labels = md.input("labels", [batch], dtype=torch.int64)
        w_embed = md.param("w_embed", [pix, d_model], fan_out=["d_model"])
        wpe = md.param("wpe", [patches, d_model], scale=0.5)
        cls = md.param("cls", [d_model], scale=0.5)
        sa, ca = stack_params("sa_", layer), stack_params("ca_", ca_layer)
        lnf = md.param("lnf", [d_model], init="ones")
        w_head = md.param("w_head", [d_model, classes], fan_out=["classes"])

        def mlp(x, p, pre, names):
            h = md.layer_norm(x, "d_model", p[f"{pre}ln2"])
            h = md.gelu(md.einsum(f"{names} d_model, d_model d_ff -> {names} d_ff", h, p[f"{pre}w_fc"]))
            return md.einsum(f"{names} d_ff, d_ff d_model -> {names} d_model", h, p[f"{pre}w_proj"]) * p[f"{pre}g2"]

        def self_block(x, p):
            h = md.layer_norm(x, "d_model", p["sa_ln1"])
            q, k, v = (md.einsum("batch patches d_model, d_model heads d_head -> batch patches heads d_head",
                                 h, p[f"sa_w{n}"]) for n in "qkv")
            k, v = md.rename(k, patches="key_patches"), md.rename(v, patches="key_patches")
            o = md.attention(q, k, v, "patches", "key_patches", "d_head", causal=False)
            x = x + md.einsum("batch patches heads d_head, heads d_head d_model -> batch patches d_model",
                              o, p["sa_wo"]) * p["sa_g1"]
            return x + mlp(x, p, "sa_", "batch patches")

        x = md.einsum("batch patches pix, pix d_model -> batch patches d_model",
                      md.rename(md.rearrange(images, "batch (hp ph) (wp pw) channels -> batch (hp wp) (ph pw channels)",
                                             ph=cfg.patch, pw=cfg.patch), hp_wp="patches", ph_pw_channels="pix"),
                      w_embed) + wpe
        x = md.repeat(self_block, x, sa, "layer")
        one = md.Dim("tokens", 1)
        keys_of_patches = md.rename(x, patches="tokens")        # the patches, frozen in the class stack

        def class_block(c, p):
            tokens = md.concat([md.unsqueeze(c, one, 1), keys_of_patches], "tokens")
            h = md.layer_norm(tokens, "d_model", p["ca_ln1"])
            hc = md.layer_norm(c, "d_model", p["ca_ln1"])
            q = md.einsum("batch d_model, d_model heads d_head -> batch heads d_head", hc, p["ca_wq"])
            k, v = (md.einsum("batch tokens d_model, d_model heads d_head -> batch tokens heads d_head",
                              h, p[f"ca_w{n}"]) for n in "kv")
            att = md.softmax(md.einsum("batch heads d_head, batch tokens heads d_head -> batch heads tokens",
                                       q, k) * scale, "tokens")
            o = md.einsum("batch heads tokens, batch tokens heads d_head -> batch heads d_head", att, v)
            c = c + md.einsum("batch heads d_head, heads d_head d_model -> batch d_model", o, p["ca_wo"]) * p["ca_g1"]
            return c + mlp(c, p, "ca_", "batch")

        c = md.repeat(class_block, md.broadcast_to(cls, md.Shape([batch, d_model])), ca, "ca_layer")
        logits = md.einsum("batch d_model, d_model classes -> batch classes", md.layer_norm(c, "d_model", lnf), w_head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"images": torch.randn(cfg.batch, cfg.size, cfg.size, cfg.channels, generator=gen),
                "labels": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    params = {"w_embed": w_embed, "wpe": wpe, "cls": cls, **sa, **ca, "lnf": lnf, "w_head": w_head}
    return md.Model(g, loss, params, feeds, cfg)
