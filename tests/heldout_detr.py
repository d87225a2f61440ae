"""A DETR-style detector, written from README.md and docs/ only (a held-out model).

Encoder: images ``[batch, height, width, channels]`` patchified by ``md.rearrange`` into
``[batch, mem, d_model]`` (``mem`` = the patch grid, flattened), plus learned positions, and a
post-LN encoder stack over ``enc_layer`` (``md.repeat``).

Decoder: a stack over ``layer`` whose carry starts at zeros ``[batch, queries, d_model]``; the
object queries (a param ``[queries, d_model]``, fixed: the same for every image) are added to the
queries and keys of the self-attention and to the queries of the cross-attention over the
encoder's output (``memory``, read by every layer's block from outside the stack). Post-LN
self-attention, cross-attention and a relu MLP.

Every decoder layer predicts (per-layer outputs of the ``md.repeat``): a shared layer norm, class
logits over ``classes + 1`` (the last is "no object") and a box ``[4]`` (a 2-layer MLP, sigmoid).
The targets are already matched to the queries (fed: ``target_class [batch, queries]``,
``target_box [batch, queries, box]``), so each layer's loss is the cross-entropy (the no-object
class down-weighted by ``eos_coef``, normalised by the weights' sum) plus ``box_weight`` x the L1
over the matched boxes divided by their count. The loss is the sum of every layer's (the last
layer's plus the auxiliary losses of the others).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 4
    size: int = 16
    channels: int = 3
    patch: int = 4
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    enc_layers: int = 2
    layers: int = 3
    queries: int = 8
    classes: int = 5
    eos_coef: float = 0.1
    box_weight: float = 5.0

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, size=8, channels=2, patch=2, d_model=8, heads=2, d_head=4, d_ff=16,
                   enc_layers=2, layers=2, queries=4, classes=3)


def build(cfg: Config = Config()) -> md.Model:
    n_mem = (cfg.size // cfg.patch) ** 2
    batch, height, width = md.Dim("batch", cfg.batch), md.Dim("height", cfg.size), md.Dim("width", cfg.size)
    channels, pix = md.Dim("channels", cfg.channels), md.Dim("pix", cfg.patch * cfg.patch * cfg.channels)
    mem, d_model = md.Dim("mem", n_mem), md.Dim("d_model", cfg.d_model)
    heads, d_head, d_ff = md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff)
    enc_layer, layer = md.Dim("enc_layer", cfg.enc_layers), md.Dim("layer", cfg.layers)
    queries, classes, box = md.Dim("queries", cfg.queries), md.Dim("classes", cfg.classes + 1), md.Dim("box", 4)
    scale = cfg.d_head ** -0.5

    def attn_params(pre: str, L: md.Dim) -> dict[str, md.Tensor]:
        lo = [L.name]
        return {
            **{f"{pre}w{n}": md.param(f"{pre}w{n}", [L, d_model, heads, d_head], fan_out=lo + ["heads", "d_head"])
               for n in "qkv"},
            f"{pre}wo": md.param(f"{pre}wo", [L, heads, d_head, d_model], fan_out=lo + ["d_model"]),
            f"{pre}ln": md.param(f"{pre}ln", [L, d_model], init="ones"),
            f"{pre}ln_b": md.param(f"{pre}ln_b", [L, d_model], init="zeros"),
        }

    def mlp_params(pre: str, L: md.Dim) -> dict[str, md.Tensor]:
        lo = [L.name]
        return {
            f"{pre}w1": md.param(f"{pre}w1", [L, d_model, d_ff], fan_out=lo + ["d_ff"]),
            f"{pre}w2": md.param(f"{pre}w2", [L, d_ff, d_model], fan_out=lo + ["d_model"]),
            f"{pre}ln3": md.param(f"{pre}ln3", [L, d_model], init="ones"),
        }

    def attention(q_in, kv_in, v_in, p, pre, qn, kn):
        """Multi-head attention of ``q_in [batch, qn, d_model]`` over ``kv_in``/``v_in`` ``[batch, kn, d_model]``."""
        q = md.einsum(f"batch {qn} d_model, d_model heads d_head -> batch {qn} heads d_head", q_in, p[f"{pre}wq"])
        k = md.einsum(f"batch {kn} d_model, d_model heads d_head -> batch {kn} heads d_head", kv_in, p[f"{pre}wk"])
        v = md.einsum(f"batch {kn} d_model, d_model heads d_head -> batch {kn} heads d_head", v_in, p[f"{pre}wv"])
        if qn == kn:
            k, v = md.rename(k, **{kn: "key_" + kn}), md.rename(v, **{kn: "key_" + kn})
            kn = "key_" + kn
        o = md.attention(q, k, v, qn, kn, "d_head", causal=False)
        return md.einsum(f"batch {qn} heads d_head, heads d_head d_model -> batch {qn} d_model", o, p[f"{pre}wo"])

    def mlp(x, p, pre, qn):
        h = md.relu(md.einsum(f"batch {qn} d_model, d_model d_ff -> batch {qn} d_ff", x, p[f"{pre}w1"]))
        return md.layer_norm(x + md.einsum(f"batch {qn} d_ff, d_ff d_model -> batch {qn} d_model", h, p[f"{pre}w2"]),
                             "d_model", p[f"{pre}ln3"])

    with md.Graph("heldout_detr") as g:
        images = md.input("images", [batch, height, width, channels])
        target_class = md.input("target_class", [batch, queries], dtype=torch.int64)
        target_box = md.input("target_box", [batch, queries, box])
        w_embed = md.param("w_embed", [pix, d_model], fan_out=["d_model"])
        mem_pos = md.param("mem_pos", [mem, d_model], scale=0.5)
        enc = {**attn_params("e_", enc_layer), **mlp_params("e_", enc_layer)}
        query_pos = md.param("query_pos", [queries, d_model], scale=1.0)
        dec = {**attn_params("sa_", layer), **attn_params("ca_", layer), **mlp_params("d_", layer)}
        head = {
            "dec_norm": md.param("dec_norm", [d_model], init="ones"),
            "w_class": md.param("w_class", [d_model, classes], fan_out=["classes"]),
            "w_box1": md.param("w_box1", [d_model, md.Dim("d_box", cfg.d_model)], fan_out=["d_box"]),
            "w_box2": md.param("w_box2", [md.Dim("d_box", cfg.d_model), box], fan_out=["box"]),
        }

        def enc_block(x, p):
            x = md.layer_norm(x + attention(x, x, x, p, "e_", "mem", "mem"), "d_model", p["e_ln"], p["e_ln_b"])
            return mlp(x, p, "e_", "mem")

        # the matched targets' weights: made from the inputs only, once for the whole batch
        is_obj = md.cast(md.less(target_class, cfg.classes), torch.float32)            # [batch, queries]
        cls_w = is_obj + (1.0 - is_obj) * cfg.eos_coef
        n_boxes = md.maximum(md.reduce_sum(is_obj), 1.0)
        cls_total = md.reduce_sum(cls_w)       # made here, not in the block: once per step (see round 8b)

        def dec_block(t, p):
            tq = t + query_pos
            t = md.layer_norm(t + attention(tq, tq, t, p, "sa_", "queries", "queries"), "d_model", p["sa_ln"], p["sa_ln_b"])
            t = md.layer_norm(t + attention(t + query_pos, memory_k, memory, p, "ca_", "queries", "mem"),
                              "d_model", p["ca_ln"], p["ca_ln_b"])
            t = mlp(t, p, "d_", "queries")
            # this layer's predictions and loss (an auxiliary loss for all but the last layer)
            y = md.layer_norm(t, "d_model", head["dec_norm"])
            logits = md.einsum("batch queries d_model, d_model classes -> batch queries classes", y, head["w_class"])
            b = md.sigmoid(md.einsum("batch queries d_box, d_box box -> batch queries box",
                                     md.relu(md.einsum("batch queries d_model, d_model d_box -> batch queries d_box",
                                                       y, head["w_box1"])), head["w_box2"]))
            ce = md.reduce_sum(md.cross_entropy(logits, target_class, "classes") * cls_w) / cls_total
            l1 = md.reduce_sum(md.abs(b - target_box) * is_obj) / n_boxes
            return t, {"loss": ce + cfg.box_weight * l1, "boxes": b, "logits": logits}

        px = md.rename(md.rearrange(images, "batch (hp ph) (wp pw) channels -> batch (hp wp) (ph pw channels)",
                                    ph=cfg.patch, pw=cfg.patch), hp_wp="mem", ph_pw_channels="pix")
        memory = md.repeat(enc_block, md.einsum("batch mem pix, pix d_model -> batch mem d_model", px, w_embed) + mem_pos,
                           enc, "enc_layer")
        memory_k = memory + mem_pos                    # the keys see the positions, the values do not
        start = md.broadcast_to(md.constant(torch.zeros(cfg.queries, cfg.d_model), [queries, d_model]),
                                [batch, queries, d_model])
        _, per_layer = md.repeat(dec_block, start, dec, "layer")
        loss = md.reduce_sum(per_layer["loss"], "layer")
        last_boxes, last_logits = (md.squeeze(md.slice_(per_layer[k], "layer", cfg.layers - 1, cfg.layers), "layer")
                                   for k in ("boxes", "logits"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"images": torch.randn(cfg.batch, cfg.size, cfg.size, cfg.channels, generator=gen),
                "target_class": torch.randint(0, cfg.classes + 1, (cfg.batch, cfg.queries), generator=gen),
                "target_box": torch.rand(cfg.batch, cfg.queries, 4, generator=gen)}

    params = {"w_embed": w_embed, "mem_pos": mem_pos, **enc, "query_pos": query_pos, **dec, **head}
    return md.Model(g, loss, params, feeds, cfg, outputs={"layer_losses": per_layer["loss"], "boxes": last_boxes, "logits": last_logits})
