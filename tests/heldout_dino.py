"""DINO-style self-distillation of a small ViT, written from the README and docs/ alone (a held-out model).

Each image comes as ``views`` augmented crops, ``images [batch, views, height, width, channels]``.
A student and a teacher tower of the same shape (a patchify by ``md.rearrange``, a patch embedding
plus learned positions, pre-norm encoder blocks under ``md.repeat``: fused non-causal
``md.attention`` and a GELU MLP; mean pooling, a LayerNorm and DINO's projection head: an MLP to a
bottleneck, L2-normalised, then a linear layer to ``protos`` prototype logits) read every view:
the views are one more batch-like dim of every op. The student's stack scans ``layer``, the
teacher's ``t_layer`` (a layer dim of its own name, as a second stack needs).

The teacher is frozen: its params (``t_*``) are left out of the Model's ``params`` and its output
passes ``md.stop_gradient``; in DINO it is the student's exponential moving average, kept outside
the step and loaded as given weights (``md.fit(init=)``, ``TrainStep.set_params``). The teacher's
logits are centred (minus ``center``, an input: DINO's running mean of the teacher outputs, kept
outside the step; ``center_from_batch=True`` takes this batch's mean of them instead, a whole-batch
statistic of frozen params) and sharpened (``softmax(. / t_temp)``); the student's are
``log_softmax(. / s_temp)``. The loss is the cross-entropy of every teacher view against every
*other* student view, averaged over the pairs and the batch.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    image: int = 16
    patch: int = 4
    channels: int = 3
    views: int = 2
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    d_ff: int = 64
    d_proj: int = 64
    d_bott: int = 16
    protos: int = 64
    layers: int = 2
    batch: int = 8
    s_temp: float = 0.1
    t_temp: float = 0.04
    center_from_batch: bool = False

    @classmethod
    def tiny(cls) -> "Config":
        return cls(image=8, patch=4, channels=3, views=2, d_model=8, heads=2, d_head=4, d_ff=12, d_proj=10,
                   d_bott=6, protos=12, layers=2, batch=4)


def build(cfg: Config = Config()) -> md.Model:
    side = cfg.image // cfg.patch
    batch, views = md.Dim("batch", cfg.batch), md.Dim("views", cfg.views)
    height, width, channels = md.Dim("height", cfg.image), md.Dim("width", cfg.image), md.Dim("channels", cfg.channels)
    patches, pix = md.Dim("patches", side * side), md.Dim("pix", cfg.patch * cfg.patch * cfg.channels)
    d_model, heads, d_head, d_ff = (md.Dim(n, s) for n, s in (("d_model", cfg.d_model), ("heads", cfg.heads),
                                                              ("d_head", cfg.d_head), ("d_ff", cfg.d_ff)))
    d_proj, d_bott, protos = md.Dim("d_proj", cfg.d_proj), md.Dim("d_bott", cfg.d_bott), md.Dim("protos", cfg.protos)

    def tower_params(pre: str, lay: md.Dim) -> dict[str, md.Tensor]:
        L = lay.name
        return {
            f"{pre}embed": md.param(f"{pre}embed", [pix, d_model], fan_out=["d_model"]),
            f"{pre}pos": md.param(f"{pre}pos", [patches, d_model], scale=0.02),
            f"{pre}ln1": md.param(f"{pre}ln1", [lay, d_model], init="ones"),
            f"{pre}wq": md.param(f"{pre}wq", [lay, d_model, heads, d_head], fan_out=[L, "heads", "d_head"]),
            f"{pre}wk": md.param(f"{pre}wk", [lay, d_model, heads, d_head], fan_out=[L, "heads", "d_head"]),
            f"{pre}wv": md.param(f"{pre}wv", [lay, d_model, heads, d_head], fan_out=[L, "heads", "d_head"]),
            f"{pre}wo": md.param(f"{pre}wo", [lay, heads, d_head, d_model], fan_out=[L, "d_model"]),
            f"{pre}ln2": md.param(f"{pre}ln2", [lay, d_model], init="ones"),
            f"{pre}w_fc": md.param(f"{pre}w_fc", [lay, d_model, d_ff], fan_out=[L, "d_ff"]),
            f"{pre}w_out": md.param(f"{pre}w_out", [lay, d_ff, d_model], fan_out=[L, "d_model"]),
            f"{pre}lnf": md.param(f"{pre}lnf", [d_model], init="ones"),
            f"{pre}h1": md.param(f"{pre}h1", [d_model, d_proj], fan_out=["d_proj"]),
            f"{pre}h2": md.param(f"{pre}h2", [d_proj, d_bott], fan_out=["d_bott"]),
            f"{pre}last": md.param(f"{pre}last", [d_bott, protos], fan_out=["protos"]),
        }

    def tower(pre: str, lay: str, x: md.Tensor, p: dict) -> md.Tensor:
        def block(h: md.Tensor, q: dict) -> md.Tensor:
            a = md.layer_norm(h, "d_model", q[f"{pre}ln1"])
            proj = "batch views patches d_model, d_model heads d_head -> batch views patches heads d_head"
            qq = md.einsum(proj, a, q[f"{pre}wq"])
            kk = md.rename(md.einsum(proj, a, q[f"{pre}wk"]), patches="key_patches")
            vv = md.rename(md.einsum(proj, a, q[f"{pre}wv"]), patches="key_patches")
            att = md.attention(qq, kk, vv, "patches", "key_patches", "d_head", causal=False)
            h = h + md.einsum("batch views patches heads d_head, heads d_head d_model -> batch views patches d_model",
                              att, q[f"{pre}wo"])
            m = md.gelu(md.einsum("batch views patches d_model, d_model d_ff -> batch views patches d_ff",
                                  md.layer_norm(h, "d_model", q[f"{pre}ln2"]), q[f"{pre}w_fc"]))
            return h + md.einsum("batch views patches d_ff, d_ff d_model -> batch views patches d_model",
                                 m, q[f"{pre}w_out"])

        h = md.einsum("batch views patches pix, pix d_model -> batch views patches d_model", x, p[f"{pre}embed"])
        h = h + p[f"{pre}pos"]
        stacked = {k: v for k, v in p.items() if v.shape.names[0] == lay}
        h = md.repeat(block, h, stacked, lay)
        pooled = md.layer_norm(md.reduce_mean(h, "patches"), "d_model", p[f"{pre}lnf"])
        z = md.gelu(md.einsum("batch views d_model, d_model d_proj -> batch views d_proj", pooled, p[f"{pre}h1"]))
        z = md.einsum("batch views d_proj, d_proj d_bott -> batch views d_bott", z, p[f"{pre}h2"])
        z = z * md.rsqrt(md.reduce_sum(z * z, "d_bott") + 1e-12)
        return md.einsum("batch views d_bott, d_bott protos -> batch views protos", z, p[f"{pre}last"])

    with md.Graph("heldout_dino") as g:
        images = md.input("images", [batch, views, height, width, channels])
        center = None if cfg.center_from_batch else md.input("center", [protos])
        x = md.rearrange(images, "batch views (hp ph) (wp pw) channels -> batch views (hp wp) (ph pw channels)",
                         ph=cfg.patch, pw=cfg.patch)
        x = md.rename(x, {x.shape.names[2]: "patches", x.shape.names[3]: "pix"})
        student = tower_params("s_", md.Dim("layer", cfg.layers))
        teacher = tower_params("t_", md.Dim("t_layer", cfg.layers))
        s_out = tower("s_", "layer", x, student)
        t_out = md.stop_gradient(tower("t_", "t_layer", x, teacher))
        c = md.stop_gradient(md.reduce_mean(t_out, ["batch", "views"])) if cfg.center_from_batch else center
        t_prob = md.softmax((t_out - c) * (1.0 / cfg.t_temp), "protos")
        s_logp = md.rename(md.log_softmax(s_out * (1.0 / cfg.s_temp), "protos"), views="s_views")
        ce = -md.reduce_sum(t_prob * s_logp, "protos")                          # [batch, views, s_views]
        other = md.cast(md.not_equal(md.arange(views), md.arange(md.Dim("s_views", cfg.views))), torch.float32)
        pairs = cfg.views * (cfg.views - 1)
        loss = md.reduce_mean(md.reduce_sum(ce * other, ["views", "s_views"])) * (1.0 / pairs)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        base = torch.randn(cfg.batch, 1, cfg.image, cfg.image, cfg.channels, generator=gen)
        noise = 0.3 * torch.randn(cfg.batch, cfg.views, cfg.image, cfg.image, cfg.channels, generator=gen)
        scale = 1.0 + 0.2 * torch.rand(cfg.batch, cfg.views, 1, 1, 1, generator=gen)
        out = {"images": base * scale + noise, "center": 0.1 * torch.randn(cfg.protos, generator=gen)}
        if cfg.center_from_batch:
            del out["center"]
        return out

    return md.Model(g, loss, student, feeds, cfg,
                    outputs={"student": s_out, "teacher": t_out, "teacher_probs": t_prob})
