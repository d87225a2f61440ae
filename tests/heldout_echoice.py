"""A held-out expert-choice mixture of experts with a router z-loss, written from README.md and docs/ only.

Legend: b batch (one routing group per sequence), s seq, d d_model, x experts, c capacity
(tokens each expert picks), f d_ff, v vocab, l layer.

    ids_bs -> wte -> md.repeat over layers of:
        z = RMSNorm(h); router logits r_bsx = z . w_router
        z-loss (ST-MoE) = mean over tokens of logsumexp_x(r)^2, a per-layer output
        probs = softmax over experts; each expert picks its top-c tokens of the group
        (md.top_k over seq of probs [b, x, s]): dispatch = one_hot(picked, seq) [b, x, c, s]
        expert FFN on its c tokens; combine weighted by the picked probabilities
        h = h + combine  (a token no expert picked passes through unchanged)
      -> RMSNorm -> logits -> cross-entropy + z_weight * sum of the layers' z-losses
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 8
    seq: int = 16
    vocab: int = 64
    d_model: int = 32
    experts: int = 4
    capacity: int = 4
    d_ff: int = 64
    layers: int = 2
    z_weight: float = 0.01
    router_scale: float | None = None   # None: the default init; 0.0: a zero router (every score ties)

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, seq=6, vocab=16, d_model=8, experts=4, capacity=2, d_ff=8, layers=2)


def block(h_bsd, p, cfg: Config):
    z_bsd = md.rms_norm(h_bsd, "d_model", p["norm"])
    r_bsx = md.einsum("batch seq d_model, d_model experts -> batch seq experts", z_bsd, p["w_router"])
    z_loss = md.reduce_mean(md.logsumexp(r_bsx, "experts") ** 2)
    probs_bxs = md.rearrange(md.softmax(r_bsx, "experts"), "batch seq experts -> batch experts seq")
    top_p, top_i = md.top_k(probs_bxs, "seq", cfg.capacity, "capacity")        # [b, x, c]
    dispatch = md.one_hot(top_i, h_bsd.shape["seq"])                            # [b, x, c, s]
    xin = md.einsum("batch experts capacity seq, batch seq d_model -> batch experts capacity d_model",
                    dispatch, z_bsd)
    u = md.gelu(md.einsum("batch experts capacity d_model, experts d_model d_ff -> batch experts capacity d_ff",
                          xin, p["w_in"]))
    y = md.einsum("batch experts capacity d_ff, experts d_ff d_model -> batch experts capacity d_model",
                  u, p["w_out"]) * top_p
    out = md.einsum("batch experts capacity seq, batch experts capacity d_model -> batch seq d_model", dispatch, y)
    return h_bsd + out, {"z_loss": z_loss}


def build(cfg: Config = Config()) -> md.Model:
    b, s, d = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("d_model", cfg.d_model)
    x, f = md.Dim("experts", cfg.experts), md.Dim("d_ff", cfg.d_ff)
    v, l = md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    with md.Graph("echoice") as g:
        ids = md.input("ids", [b, s], torch.int64)
        labels = md.input("labels", [b, s], torch.int64)
        wte = md.param("wte", [v, d], scale=0.5)
        blocks = {
            "norm": md.param("norm", [l, d], init="ones"),
            "w_router": md.param("w_router", [l, d, x], fan_out=[l, x])
            if cfg.router_scale is None else md.param("w_router", [l, d, x], scale=cfg.router_scale),
            "w_in": md.param("w_in", [l, x, d, f], fan_out=[l, x, f]),
            "w_out": md.param("w_out", [l, x, f, d], fan_out=[l, x, d]),
        }
        lnf = md.param("lnf", [d], init="ones")
        head = md.param("head", [v, d], fan_out=[v])
        h, aux = md.repeat(lambda h_, p: block(h_, p, cfg), md.gather(wte, ids, "vocab"), blocks, l)
        logits = md.einsum("batch seq d_model, vocab d_model -> batch seq vocab", md.rms_norm(h, "d_model", lnf), head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab")) + cfg.z_weight * md.reduce_sum(aux["z_loss"])

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=torch.Generator().manual_seed(seed))
        return {"ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}

    return md.Model(g, loss, {"wte": wte, **blocks, "lnf": lnf, "head": head}, feeds, cfg, logits=logits)
