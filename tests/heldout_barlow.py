"""Barlow Twins, written from the README and docs/ alone (a held-out model).

Examples ``x [ex, feat]`` and two augmentations of each by additive noise (``noise_a``,
``noise_b``, fed), one shared encoder: a linear stem, residual relu MLP blocks under ``md.repeat``
over ``layer`` (pre-LayerNorm), and a projector (linear, relu, linear to ``emb``). Each view's
embedding is batch-normalised over the examples (mean and biased variance over ``ex``, as
``BatchNorm1d`` without affine); the cross-correlation matrix is ``C = z_a^T z_b / N``, an
einsum over ``ex`` into ``[emb, emb2]``. Loss: ``sum_i (1 - C_ii)^2 + lambda sum_{i != j} C_ij^2``,
the diagonal picked by an identity constant. ``views="stacked"`` runs the encoder once on both
views joined on a ``view`` dim (one repeat; a pipeline of it is still refused: the batch norm after
the stack reads every micro-batch). The point of the model: reductions over ``ex`` (the batch
statistics and the correlation) under a split of the examples.

Legend: ex (examples), feat (input features), d (width), hid (MLP width), proj, emb / emb2 (the
embedding, its copy for the correlation's second side).
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    ex: int = 32
    feat: int = 16
    d: int = 32
    hid: int = 64
    proj: int = 32
    emb: int = 16
    layers: int = 2
    lam: float = 0.05
    noise: float = 0.3
    views: str = "two"          # or "stacked": both views on a `view` dim, one encoder call
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(ex=8, feat=6, d=8, hid=12, proj=8, emb=6, layers=2)


def build(cfg: Config = Config()) -> md.Model:
    ex, feat, d, hid = md.Dim("ex", cfg.ex), md.Dim("feat", cfg.feat), md.Dim("d", cfg.d), md.Dim("hid", cfg.hid)
    proj, emb, emb2 = md.Dim("proj", cfg.proj), md.Dim("emb", cfg.emb), md.Dim("emb2", cfg.emb)
    layer = md.Dim("layer", cfg.layers)
    with md.Graph("heldout_barlow") as g:
        x = md.input("x", [ex, feat])
        noise = {v: md.input(f"noise_{v}", [ex, feat]) for v in "ab"}
        p = {"stem": md.param("stem", [feat, d], fan_out=["d"]),
             "p1": md.param("p1", [d, proj], fan_out=["proj"]),
             "p2": md.param("p2", [proj, emb], fan_out=["emb"])}
        st = {"ln": md.param("ln", [layer, d], init="ones"),
              "w1": md.param("w1", [layer, d, hid], fan_out=["layer", "hid"]),
              "w2": md.param("w2", [layer, hid, d], fan_out=["layer", "d"])}

        e = "view ex" if cfg.views == "stacked" else "ex"                  # the encoder's example dims

        def block(h: md.Tensor, q: dict) -> md.Tensor:                     # h [(view,) ex, d]
            u = md.relu(md.einsum(f"{e} d, d hid -> {e} hid", md.layer_norm(h, "d", q["ln"]), q["w1"]))
            return h + md.einsum(f"{e} hid, hid d -> {e} d", u, q["w2"])

        def embed(view: md.Tensor) -> md.Tensor:
            h = md.einsum(f"{e} feat, feat d -> {e} d", view, p["stem"])
            h = md.repeat(block, h, st, "layer", remat=cfg.remat)
            z = md.einsum(f"{e} proj, proj emb -> {e} emb",
                          md.relu(md.einsum(f"{e} d, d proj -> {e} proj", h, p["p1"])), p["p2"])
            z = z - md.reduce_mean(z, "ex")
            return z * md.rsqrt(md.reduce_mean(z * z, "ex") + 1e-5)             # batch norm over ex

        if cfg.views == "stacked":
            both = md.concat([md.unsqueeze(x + noise[v] * cfg.noise, "view", 0) for v in "ab"], "view")
            z = embed(both)                                                  # [view, ex, emb]
            za, zb = (md.squeeze(md.slice_(z, "view", i, i + 1), "view") for i in (0, 1))
        else:
            za, zb = embed(x + noise["a"] * cfg.noise), embed(x + noise["b"] * cfg.noise)
        zb = md.rename(zb, emb="emb2")
        c = md.einsum("ex emb, ex emb2 -> emb emb2", za, zb) / cfg.ex
        eye = md.constant(torch.eye(cfg.emb), [emb, emb2])
        on = md.reduce_sum(md.square(1.0 - c) * eye)
        off = md.reduce_sum(md.square(c) * (1.0 - eye))
        loss = on + cfg.lam * off

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(cfg.ex, cfg.feat, generator=gen),
                "noise_a": torch.randn(cfg.ex, cfg.feat, generator=gen),
                "noise_b": torch.randn(cfg.ex, cfg.feat, generator=gen)}

    return md.Model(g, loss, {**p, **st}, feeds, cfg)
