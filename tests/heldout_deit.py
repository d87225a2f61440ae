"""A DeiT-style distilled ViT with register tokens, written from the README and docs/ alone
(a held-out model).

Images ``[batch, height, width, channels]`` are cut into patches by ``md.rearrange`` and
embedded; a learned class token and a distillation token (each ``[seq:1, d_model]``, given
the batch by ``md.broadcast_to``) are joined before the patches by ``md.concat`` and get
learned positions; ``registers`` extra learned tokens (no positions) are joined after them.
Pre-LN encoder blocks under ``md.repeat`` (the fused, non-causal ``md.attention``, a GELU MLP)
scale each residual branch by a per-channel layer scale (CaiT/DeiT-III). After a final
LayerNorm, the class token's row (``md.slice_`` + ``md.squeeze``) feeds the class head, the
distillation token's row a second head, trained on fed teacher labels (hard distillation):
the loss is the mean of the two cross-entropies. The register tokens are read by nothing but
attention.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    image: int = 16
    patch: int = 4
    channels: int = 3
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    layers: int = 2
    registers: int = 4
    batch: int = 8
    classes: int = 10
    ls_init: float = 0.1

    @classmethod
    def tiny(cls) -> "Config":
        return cls(image=8, patch=2, channels=3, d_model=8, heads=2, d_head=4, d_ff=16, layers=2,
                   registers=2, batch=4, classes=5)


def row(x: md.Tensor, i: int) -> md.Tensor:
    """Token ``i`` of ``x`` along ``seq``, without the ``seq`` dim."""
    return md.squeeze(md.slice_(x, "seq", i, i + 1), "seq")


def build(cfg: Config = Config()) -> md.Model:
    n = cfg.image // cfg.patch
    batch, height, width = md.Dim("batch", cfg.batch), md.Dim("height", cfg.image), md.Dim("width", cfg.image)
    channels, d_model, heads = md.Dim("channels", cfg.channels), md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads)
    d_head, d_ff, classes = md.Dim("d_head", cfg.d_head), md.Dim("d_ff", cfg.d_ff), md.Dim("classes", cfg.classes)
    layer, patch_feat = md.Dim("layer", cfg.layers), md.Dim("ph_pw_channels", cfg.patch ** 2 * cfg.channels)
    one, pos_seq, reg_seq = md.Dim("seq", 1), md.Dim("seq", 2 + n * n), md.Dim("seq", cfg.registers)
    with md.Graph("heldout_deit") as g:
        images = md.input("images", [batch, height, width, channels])
        labels = md.input("labels", [batch], dtype=torch.int64)
        teacher = md.input("teacher", [batch], dtype=torch.int64)
        w_patch = md.param("w_patch", [patch_feat, d_model], fan_out=[d_model])
        cls_tok = md.param("cls_tok", [one, d_model], scale=0.5)
        dist_tok = md.param("dist_tok", [one, d_model], scale=0.5)
        pos = md.param("pos", [pos_seq, d_model], scale=0.5)
        regs = md.param("regs", [reg_seq, d_model], scale=0.5)
        blocks = {
            "ln1": md.param("ln1", [layer, d_model], init="ones"),
            "ln1_b": md.param("ln1_b", [layer, d_model], init="zeros"),
            "wq": md.param("wq", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head]),
            "wk": md.param("wk", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head]),
            "wv": md.param("wv", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head]),
            "wo": md.param("wo", [layer, heads, d_head, d_model], fan_out=["layer", d_model]),
            "ls1": md.param("ls1", [layer, d_model], init="ones"),
            "ln2": md.param("ln2", [layer, d_model], init="ones"),
            "ln2_b": md.param("ln2_b", [layer, d_model], init="zeros"),
            "w_fc": md.param("w_fc", [layer, d_model, d_ff], fan_out=["layer", d_ff]),
            "w_proj": md.param("w_proj", [layer, d_ff, d_model], fan_out=["layer", d_model]),
            "ls2": md.param("ls2", [layer, d_model], init="ones"),
        }
        ln_f = md.param("ln_f", [d_model], init="ones")
        ln_f_b = md.param("ln_f_b", [d_model], init="zeros")
        head_cls = md.param("head_cls", [d_model, classes], fan_out=[classes])
        head_dist = md.param("head_dist", [d_model, classes], fan_out=[classes])

        def block(x: md.Tensor, p: dict) -> md.Tensor:
            h = md.layer_norm(x, "d_model", p["ln1"], p["ln1_b"])
            q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wq"])
            k = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wk"])
            v = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", h, p["wv"])
            k, v = md.rename(k, seq="key_seq"), md.rename(v, seq="key_seq")
            o = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=False)
            a = md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", o, p["wo"])
            x = x + a * (p["ls1"] * cfg.ls_init)
            h = md.layer_norm(x, "d_model", p["ln2"], p["ln2_b"])
            m = md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w_fc"])
            m = md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", md.gelu(m), p["w_proj"])
            return x + m * (p["ls2"] * cfg.ls_init)

        x = md.rearrange(images, "batch (hp ph) (wp pw) channels -> batch (hp wp) (ph pw channels)",
                         ph=cfg.patch, pw=cfg.patch)
        x = md.rename(md.einsum("batch hp_wp ph_pw_channels, ph_pw_channels d_model -> batch hp_wp d_model",
                                x, w_patch), hp_wp="seq")
        lead = [md.broadcast_to(t, [batch, one, d_model]) for t in (cls_tok, dist_tok)]
        x = md.concat([*lead, x], "seq") + pos
        x = md.concat([x, md.broadcast_to(regs, [batch, reg_seq, d_model])], "seq")
        x = md.repeat(block, x, blocks, "layer")
        x = md.layer_norm(x, "d_model", ln_f, ln_f_b)
        logits = md.einsum("batch d_model, d_model classes -> batch classes", row(x, 0), head_cls)
        dist_logits = md.einsum("batch d_model, d_model classes -> batch classes", row(x, 1), head_dist)
        loss = 0.5 * md.reduce_mean(md.cross_entropy(logits, labels, "classes")) \
            + 0.5 * md.reduce_mean(md.cross_entropy(dist_logits, teacher, "classes"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"images": torch.randn(cfg.batch, cfg.image, cfg.image, cfg.channels, generator=gen),
                "labels": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen),
                "teacher": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    params = {"w_patch": w_patch, "cls_tok": cls_tok, "dist_tok": dist_tok, "pos": pos, "regs": regs, **blocks,
              "ln_f": ln_f, "ln_f_b": ln_f_b, "head_cls": head_cls, "head_dist": head_dist}
    return md.Model(g, loss, params, feeds, cfg)
