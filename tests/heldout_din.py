"""DIN (Deep Interest Network), a held-out model (round 27b): target attention over a user history.

Legend: batch = impressions, hist = the user's padded history of items (its real length per row,
``lengths [batch]``), vocab = the item embedding table's rows, d = the embedding width, att = the
attention unit's hidden width, d_ff/d_ff2 = the prediction MLP's widths. The candidate item
attends to each history item through a small MLP of ``[e, c, e - c, e * c]`` (written as four
einsums summed, no concat) with a PReLU; DIN keeps the raw weights (no softmax), zero at the padded
positions. The user's interest (the weighted sum of the history) and the candidate feed an MLP with
Dice activations (a sigmoid gate of the batch-normalised input, the batch statistics over the
whole batch) and a PReLU, then a logit; the loss is the binary cross-entropy of the click labels.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 8
    hist: int = 8
    vocab: int = 40
    d: int = 8
    att: int = 16
    d_ff: int = 16
    d_ff2: int = 8

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=6, hist=5, vocab=12, d=4, att=6, d_ff=8, d_ff2=4)


def prelu(x, slope):
    return md.maximum(x, 0.0) + slope * md.minimum(x, 0.0)


def dice(x, alpha, eps: float = 1e-8):
    """Dice: p = sigmoid of x normalised by its batch mean and (biased) variance; p x + (1 - p) alpha x."""
    mean = md.reduce_mean(x, "batch")
    var = md.reduce_mean(md.square(x - mean), "batch")
    p = md.sigmoid((x - mean) * md.rsqrt(var + eps))
    return p * x + (1.0 - p) * alpha * x


def build(cfg: Config) -> md.Model:
    B, Hs, V = md.Dim("batch", cfg.batch), md.Dim("hist", cfg.hist), md.Dim("vocab", cfg.vocab)
    D, A, F, F2 = md.Dim("d", cfg.d), md.Dim("att", cfg.att), md.Dim("d_ff", cfg.d_ff), md.Dim("d_ff2", cfg.d_ff2)
    with md.Graph() as g:
        hist = md.input("hist", [B, Hs], dtype=torch.int64)
        lengths = md.input("lengths", [B], dtype=torch.int64)
        cand = md.input("cand", [B], dtype=torch.int64)
        label = md.input("label", [B])
        table = md.param("items", [V, D], scale=1.0)
        wa = {n: md.param(f"att_{n}", [D, A], fan_out=["att"]) for n in ("e", "c", "diff", "prod")}
        ba, slope_a = md.param("att_b", [A], init="zeros"), md.param("att_slope", [A], init=0.25)
        va = md.param("att_out", [A], scale=0.5)
        w1u, w1c = md.param("w1_user", [D, F], fan_out=["d_ff"]), md.param("w1_cand", [D, F], fan_out=["d_ff"])
        w1p = md.param("w1_prod", [D, F], fan_out=["d_ff"])
        b1, alpha1 = md.param("b1", [F], init="zeros"), md.param("dice_alpha", [F], init=0.1)
        w2, b2 = md.param("w2", [F, F2], fan_out=["d_ff2"]), md.param("b2", [F2], init="zeros")
        slope2 = md.param("slope2", [F2], init=0.25)
        w3, b3 = md.param("w3", [F2]), md.param("b3", [], init="zeros")

        e = md.gather(table, hist, "vocab")                           # [batch, hist, d]
        c = md.gather(table, cand, "vocab")                           # [batch, d]
        unit = (md.einsum("batch hist d, d att -> batch hist att", e, wa["e"])
                + md.einsum("batch d, d att -> batch att", c, wa["c"])
                + md.einsum("batch hist d, d att -> batch hist att", e - c, wa["diff"])
                + md.einsum("batch hist d, d att -> batch hist att", e * c, wa["prod"]) + ba)
        w = md.einsum("batch hist att, att -> batch hist", prelu(unit, slope_a), va)
        w = md.where(md.less(md.arange(Hs), lengths), w, 0.0)          # padded positions weigh nothing
        user = md.einsum("batch hist, batch hist d -> batch d", w, e)
        h = (md.einsum("batch d, d d_ff -> batch d_ff", user, w1u) + md.einsum("batch d, d d_ff -> batch d_ff", c, w1c)
             + md.einsum("batch d, d d_ff -> batch d_ff", user * c, w1p) + b1)
        h = dice(h, alpha1)
        h = prelu(md.einsum("batch d_ff, d_ff d_ff2 -> batch d_ff2", h, w2) + b2, slope2)
        z = md.einsum("batch d_ff2, d_ff2 -> batch", h, w3) + b3
        bce = -(label * md.log_sigmoid(z) + (1.0 - label) * md.log_sigmoid(-z))
        loss = md.reduce_mean(bce)

    def feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        return {"hist": torch.randint(0, cfg.vocab, (cfg.batch, cfg.hist), generator=gen),
                "lengths": torch.randint(1, cfg.hist + 1, (cfg.batch,), generator=gen),
                "cand": torch.randint(0, cfg.vocab, (cfg.batch,), generator=gen),
                "label": torch.randint(0, 2, (cfg.batch,), generator=gen).float()}

    return md.Model(g, loss, g.params(), feeds, cfg, outputs={"logit": z})


REF_INPUTS = ("hist", "lengths", "cand", "label")


def reference_loss(cfg: Config, p: dict, hist, lengths, cand, label):
    """The same model in plain torch: the attention unit on the concatenated features."""
    F = torch.nn.functional
    prelu = lambda x, a: torch.where(x > 0, x, a * x)         # F.prelu's channels are dim 1, ours the last
    e, c = p["items"][hist], p["items"][cand]
    cx = c[:, None].expand_as(e)
    feat = torch.cat([e, cx, e - cx, e * cx], -1)
    w_unit = torch.cat([p["att_e"], p["att_c"], p["att_diff"], p["att_prod"]], 0)
    w = prelu(feat @ w_unit + p["att_b"], p["att_slope"]) @ p["att_out"]
    w = w * (torch.arange(cfg.hist)[None] < lengths[:, None])
    user = torch.einsum("bh,bhd->bd", w, e)
    h = torch.cat([user, c, user * c], -1) @ torch.cat([p["w1_user"], p["w1_cand"], p["w1_prod"]], 0) + p["b1"]
    xn = (h - h.mean(0)) / torch.sqrt(h.var(0, unbiased=False) + 1e-8)
    gate = torch.sigmoid(xn)
    h = gate * h + (1 - gate) * p["dice_alpha"] * h
    h = prelu(h @ p["w2"] + p["b2"], p["slope2"])
    z = h @ p["w3"] + p["b3"]
    return F.binary_cross_entropy_with_logits(z, label)
