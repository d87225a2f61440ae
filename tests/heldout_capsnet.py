"""A capsule network with dynamic routing, written from the README and docs/ alone (a held-out model).

Images ``[batch, height, width, chan]``. Primary capsules: a 3x3 'valid' conv (``md.conv``) to
``caps * cd`` channels, cut by ``md.rearrange`` into ``caps`` capsules of ``cd`` per pixel, all
pixels' capsules merged into ``incaps = (height width caps)`` and squashed,
``squash(s) = s |s|^2 / (1 + |s|^2) / sqrt(|s|^2 + eps)`` over the capsule's dims. Each input
capsule predicts every output capsule, ``u_hat = W_ij u_i`` (``W [incaps, outcaps, cd, od]``).
Routing by agreement, 3 iterations unrolled: the logits ``b [batch, incaps, outcaps]`` start
at zero (so the first coupling is the uniform ``1/outcaps``), ``c = softmax_outcaps(b)``,
``s_j = sum_i c_ij u_hat_ij``, ``v_j = squash(s_j)``, ``b += u_hat . v``. Margin loss on the
output capsules' lengths: ``T max(0, 0.9 - |v|)^2 + 0.5 (1 - T) max(0, |v| - 0.1)^2``, summed
over classes, mean over the batch.

Legend: batch; height, width; chan; kh, kw (taps); pc (caps * cd); caps; cd; incaps; outcaps
(the classes); od.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 64
    size: int = 12
    chan: int = 1
    caps: int = 8
    cd: int = 8
    classes: int = 10
    od: int = 16
    iters: int = 3

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, size=6, chan=2, caps=2, cd=4, classes=3, od=4)


def squash(s: md.Tensor, dim: str) -> md.Tensor:
    n2 = md.reduce_sum(s * s, dim)
    return s * (n2 / (1.0 + n2) * md.rsqrt(n2 + 1e-7))


def build(cfg: Config = Config()) -> md.Model:
    out = cfg.size - 2
    batch, height, width = md.Dim("batch", cfg.batch), md.Dim("height", cfg.size), md.Dim("width", cfg.size)
    chan, kh, kw, pc = md.Dim("chan", cfg.chan), md.Dim("kh", 3), md.Dim("kw", 3), md.Dim("pc", cfg.caps * cfg.cd)
    incaps, outcaps = md.Dim("incaps", out * out * cfg.caps), md.Dim("outcaps", cfg.classes)
    cd, od = md.Dim("cd", cfg.cd), md.Dim("od", cfg.od)
    with md.Graph("heldout_capsnet") as g:
        img = md.input("img", [batch, height, width, chan])
        label = md.input("label", [batch], dtype=torch.int64)
        p = {"conv": md.param("conv", [kh, kw, chan, pc], fan_out=["pc"]),
             "conv_b": md.param("conv_b", [pc], init="zeros"),
             "W": md.param("W", [incaps, outcaps, cd, od], fan_out=["incaps", "outcaps", "od"])}
        prim = md.conv(img, p["conv"], {"height": "kh", "width": "kw"}, padding="valid") + p["conv_b"]
        u = md.rearrange(prim, "batch height width (caps cd) -> batch (height width caps) cd", caps=cfg.caps)
        u = squash(md.rename(u, height_width_caps="incaps"), "cd")                 # [batch, incaps, cd]
        u_hat = md.einsum("batch incaps cd, incaps outcaps cd od -> batch incaps outcaps od", u, p["W"])
        logits = None
        for it in range(cfg.iters):
            if logits is None:        # b = 0: softmax is uniform
                s = md.reduce_sum(u_hat, "incaps") * (1.0 / cfg.classes)
            else:
                c = md.softmax(logits, "outcaps")                                   # [batch, incaps, outcaps]
                s = md.einsum("batch incaps outcaps, batch incaps outcaps od -> batch outcaps od", c, u_hat)
            v = squash(s, "od")                                                     # [batch, outcaps, od]
            if it + 1 < cfg.iters:
                agree = md.einsum("batch incaps outcaps od, batch outcaps od -> batch incaps outcaps", u_hat, v)
                logits = agree if logits is None else logits + agree
        length = md.sqrt(md.reduce_sum(v * v, "od") + 1e-7)                       # [batch, outcaps]
        t = md.cast(md.one_hot(label, outcaps), torch.float32)
        margin = t * md.relu(0.9 - length) ** 2 + 0.5 * (1.0 - t) * md.relu(length - 0.1) ** 2
        loss = md.reduce_mean(md.reduce_sum(margin, "outcaps"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        label = torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)
        img = 0.3 * torch.randn(cfg.batch, cfg.size, cfg.size, cfg.chan, generator=gen)
        for b in range(cfg.batch):                 # class c: a bright bar in row band c
            r = int(label[b]) * cfg.size // cfg.classes
            img[b, r:r + 2, :, 0] += 1.0
        return {"img": img, "label": label}

    return md.Model(g, loss, p, feeds, cfg)
