"""A held-out Switch Transformer MLP stack (top-1 routing, a capacity factor, dropped tokens, a
router z-loss and a load-balancing loss), written from README.md and docs/ only.

Legend: b batch, s seq, t tokens (batch x seq flattened: ONE routing group for the whole
batch, unlike models/moe.py's group per sequence), d d_model, x experts, c capacity,
f d_ff, v vocab, l layer.

    ids_bs -> wte -> md.repeat over layers of:
        z = LN(h) flattened to tokens [t, d]; router logits r_tx = z . w_router
        z-loss = mean_t logsumexp_x(r)^2;  probs = softmax_x(r)
        top-1 expert per token (md.top_k, k=1); its place in the expert's queue = an exclusive
        cumsum over tokens of the one-hot choice; kept when place < capacity
        (capacity = ceil(capacity_factor * tokens / experts)); a dropped token passes through
        balance loss = experts * sum_x(mean_t one_hot_x * mean_t probs_x)
        dispatch [t, x, c] -> expert FFN -> combine weighted by the top-1 probability
      -> LN -> logits -> cross-entropy + 0.01 * balance + 0.001 * z-loss (summed over layers)
"""
from __future__ import annotations

import math
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
    capacity_factor: float = 1.0
    d_ff: int = 64
    layers: int = 2

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, seq=4, vocab=16, d_model=8, experts=4, capacity_factor=1.0, d_ff=8, layers=2)

    @property
    def capacity(self) -> int:
        return math.ceil(self.capacity_factor * self.batch * self.seq / self.experts)


def block(h_bsd, p, cfg: Config):
    t_dim, x_dim, c_dim = md.Dim("tokens", cfg.batch * cfg.seq), md.Dim("experts", cfg.experts), \
        md.Dim("capacity", cfg.capacity)
    z_td = md.reshape(md.layer_norm(h_bsd, "d_model", p["ln"]), [t_dim, h_bsd.shape["d_model"]])
    r_tx = md.einsum("tokens d_model, d_model experts -> tokens experts", z_td, p["w_router"])
    z_loss = md.reduce_mean(md.logsumexp(r_tx, "experts") ** 2)
    probs_tx = md.softmax(r_tx, "experts")
    top_p, top_i = md.top_k(probs_tx, "experts", 1, "top")
    choice_tx = md.one_hot(md.squeeze(top_i, "top"), x_dim)                          # float [t, x]
    place_tx = md.cumsum(choice_tx, "tokens", exclusive=True)                         # queue position
    kept_tx = choice_tx * md.cast(md.less(place_tx, float(cfg.capacity)), torch.float32)
    slot_txc = kept_tx * md.one_hot(md.cast(md.reduce_sum(place_tx * choice_tx, "experts"), torch.int64), c_dim)
    balance = cfg.experts * md.reduce_sum(md.reduce_mean(choice_tx, "tokens") * md.reduce_mean(probs_tx, "tokens"))
    xin = md.einsum("tokens experts capacity, tokens d_model -> experts capacity d_model", slot_txc, z_td)
    u = md.relu(md.einsum("experts capacity d_model, experts d_model d_ff -> experts capacity d_ff", xin, p["w_in"]))
    y = md.einsum("experts capacity d_ff, experts d_ff d_model -> experts capacity d_model", u, p["w_out"])
    out_td = md.einsum("tokens experts capacity, experts capacity d_model -> tokens d_model", slot_txc, y) \
        * md.squeeze(top_p, "top")
    out_bsd = md.reshape(out_td, h_bsd.shape)
    return h_bsd + out_bsd, {"z_loss": z_loss, "balance": balance, "dropped": md.reduce_sum(choice_tx - kept_tx)}


def build(cfg: Config = Config()) -> md.Model:
    b, s, d = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("d_model", cfg.d_model)
    x, f = md.Dim("experts", cfg.experts), md.Dim("d_ff", cfg.d_ff)
    v, l = md.Dim("vocab", cfg.vocab), md.Dim("layer", cfg.layers)
    with md.Graph("switch") as g:
        ids = md.input("ids", [b, s], torch.int64)
        labels = md.input("labels", [b, s], torch.int64)
        wte = md.param("wte", [v, d], scale=0.5)
        blocks = {
            "ln": md.param("ln", [l, d], init="ones"),
            "w_router": md.param("w_router", [l, d, x], fan_out=[l, x]),
            "w_in": md.param("w_in", [l, x, d, f], fan_out=[l, x, f]),
            "w_out": md.param("w_out", [l, x, f, d], fan_out=[l, x, d]),
        }
        lnf = md.param("lnf", [d], init="ones")
        head = md.param("head", [v, d], fan_out=[v])
        h, aux = md.repeat(lambda h_, p: block(h_, p, cfg), md.gather(wte, ids, "vocab"), blocks, l)
        logits = md.einsum("batch seq d_model, vocab d_model -> batch seq vocab", md.layer_norm(h, "d_model", lnf), head)
        loss = (md.reduce_mean(md.cross_entropy(logits, labels, "vocab")) + 0.01 * md.reduce_sum(aux["balance"])
                + 0.001 * md.reduce_sum(aux["z_loss"]))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=torch.Generator().manual_seed(seed))
        return {"ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}

    return md.Model(g, loss, {"wte": wte, **blocks, "lnf": lnf, "head": head}, feeds, cfg, logits=logits,
                    outputs={"dropped": md.reduce_sum(aux["dropped"])})
