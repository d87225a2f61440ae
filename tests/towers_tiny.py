"""A tiny two-tower model: an image tower and a text tower joined only after both.

Legend: b batch, p patches, s seq, d d_model, f d_ff, e d_embed.

The image tower embeds patches and runs a pre-LN MLP stack over ``img_layer``, then means over the
patches; the text tower embeds tokens (a table gathered by id, plus a position table) and runs its
own stack over ``layer``, then takes the last position.  Neither stack reads the other's output: the
towers meet after both, in one of two joins (``Config.join``):

* ``"match"``: each tower projected to ``d_embed`` and L2-normalised (CLIP's embeddings), the row's
  image-text similarity times a learned temperature, and a logistic loss on whether the pair matches
  (a fed 0/1 label per row; an image-text matching head, which unlike CLIP's contrastive loss reads
  one row at a time, so it runs per micro-batch);
* ``"sum"``: the two pooled features summed and classified (a fusion classifier, cross-entropy).

With ``layer:stage; img_layer:stage`` both stacks pipeline on one stage axis (tests/test_two_towers.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    patches: int = 4
    d_patch: int = 6
    vocab: int = 16
    seq: int = 5
    d_model: int = 8
    d_ff: int = 16
    d_embed: int = 4
    classes: int = 3
    img_layers: int = 2
    layers: int = 2
    batch: int = 8
    join: str = "match"

    @classmethod
    def tiny(cls) -> "Config":
        return cls()


def _stack_params(prefix: str, layer: md.Dim, d_model: md.Dim, d_ff: md.Dim) -> dict:
    return {f"{prefix}ln": md.param(f"{prefix}ln", [layer, d_model], init="ones"),
            f"{prefix}w1": md.param(f"{prefix}w1", [layer, d_model, d_ff], fan_out=[layer.name, d_ff]),
            f"{prefix}w2": md.param(f"{prefix}w2", [layer, d_ff, d_model], fan_out=[layer.name, d_model])}


def _block(prefix: str, pos: str):
    """A pre-LN residual MLP layer over the positions ``pos``."""
    def block(h: md.Tensor, p: dict) -> md.Tensor:
        x = md.layer_norm(h, "d_model", p[f"{prefix}ln"])
        x = md.gelu(md.einsum(f"batch {pos} d_model, d_model d_ff -> batch {pos} d_ff", x, p[f"{prefix}w1"]))
        return h + md.einsum(f"batch {pos} d_ff, d_ff d_model -> batch {pos} d_model", x, p[f"{prefix}w2"])
    return block


def _unit(x: md.Tensor) -> md.Tensor:
    return x * md.rsqrt(md.reduce_sum(x * x, "d_embed") + 1e-6)


def build(cfg: Config = Config()) -> md.Model:
    batch, d_model, d_ff = md.Dim("batch", cfg.batch), md.Dim("d_model", cfg.d_model), md.Dim("d_ff", cfg.d_ff)
    patches, d_patch = md.Dim("patches", cfg.patches), md.Dim("d_patch", cfg.d_patch)
    seq, vocab, d_embed = md.Dim("seq", cfg.seq), md.Dim("vocab", cfg.vocab), md.Dim("d_embed", cfg.d_embed)
    img_layer, layer = md.Dim("img_layer", cfg.img_layers), md.Dim("layer", cfg.layers)
    with md.Graph("towers_tiny") as g:
        x_bpq = md.input("images", [batch, patches, d_patch])
        tokens = md.input("tokens", [batch, seq], dtype=torch.int64)
        w_patch = md.param("w_patch", [d_patch, d_model], fan_out=[d_model])
        wte, pos = md.param("wte", [vocab, d_model], scale=0.5), md.param("pos", [seq, d_model], scale=0.1)
        img_stack = _stack_params("img_", img_layer, d_model, d_ff)
        txt_stack = _stack_params("txt_", layer, d_model, d_ff)
        params = {"w_patch": w_patch, "wte": wte, "pos": pos, **img_stack, **txt_stack}

        h_bpd = md.einsum("batch patches d_patch, d_patch d_model -> batch patches d_model", x_bpq, w_patch)
        img_bd = md.reduce_mean(md.repeat(_block("img_", "patches"), h_bpd, img_stack, "img_layer"), "patches")
        t_bsd = md.repeat(_block("txt_", "seq"), md.gather(wte, tokens, "vocab") + pos, txt_stack, "layer")
        txt_bd = md.squeeze(md.slice_(t_bsd, "seq", cfg.seq - 1, cfg.seq), "seq")

        if cfg.join == "match":
            label = md.input("label", [batch])
            proj_img = md.param("proj_img", [d_model, d_embed], fan_out=[d_embed])
            proj_txt = md.param("proj_txt", [d_model, d_embed], fan_out=[d_embed])
            scale = md.param("logit_scale", [], init="zeros")
            params.update(proj_img=proj_img, proj_txt=proj_txt, logit_scale=scale)
            img = _unit(md.einsum("batch d_model, d_model d_embed -> batch d_embed", img_bd, proj_img))
            txt = _unit(md.einsum("batch d_model, d_model d_embed -> batch d_embed", txt_bd, proj_txt))
            z_b = md.reduce_sum(img * txt, "d_embed") * md.exp(scale) * (2.0 * label - 1.0)
            loss = md.reduce_mean(md.log(1.0 + md.exp(-z_b)))    # logistic loss on match / no match
        else:
            label = md.input("label", [batch], dtype=torch.int64)
            head = md.param("head", [d_model, md.Dim("classes", cfg.classes)], fan_out=["classes"])
            params["head"] = head
            logits = md.einsum("batch d_model, d_model classes -> batch classes", img_bd + txt_bd, head)
            loss = md.reduce_mean(md.cross_entropy(logits, label, "classes"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        label = (torch.randint(0, 2, (cfg.batch,), generator=gen).float() if cfg.join == "match"
                 else torch.randint(0, cfg.classes, (cfg.batch,), generator=gen))
        return {"images": torch.randn(cfg.batch, cfg.patches, cfg.d_patch, generator=gen),
                "tokens": torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen), "label": label}

    return md.Model(g, loss, params, feeds, cfg)
