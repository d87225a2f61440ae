"""Held-out SimSiam (round 19a), written from the guides: two augmented views of each example (the
same clean vectors, each with its own fed noise and per-feature gain) through one shared encoder
(a residual MLP backbone, then a projector of linear-BN-ReLU-linear-BN), a predictor
(linear-BN-ReLU-linear), stop-gradient on the targets, and the symmetrised negative cosine loss
D(p1, sg(z2)) / 2 + D(p2, sg(z1)) / 2. Each view's BN normalises over that view's whole batch
(`batch:data` must give the statistics of the whole batch, not of a rank's rows).

Legend: x_bd [batch, d_in]; h_bh [batch, hidden]; z_bp [batch, proj]; p_bp the predictions.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 16
    d_in: int = 16
    hidden: int = 32
    proj: int = 16
    pred_hidden: int = 8

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=6, d_in=5, hidden=6, proj=5, pred_hidden=4)


def _linear(x, w, d_out):
    d_in = [d for d in w.shape.names if d != d_out][0]
    return md.einsum(f"... {d_in}, {d_in} {d_out} -> ... {d_out}", x, w)


def build(cfg: Config = Config()) -> md.Model:
    B, D, Hd = md.Dim("batch", cfg.batch), md.Dim("d_in", cfg.d_in), md.Dim("hidden", cfg.hidden)
    P, Q, P2 = md.Dim("proj", cfg.proj), md.Dim("pred_hidden", cfg.pred_hidden), md.Dim("proj_out", cfg.proj)
    with md.Graph("simsiam") as g:
        clean = md.input("x", [B, D])
        noise = [md.input(f"noise{i}", [B, D]) for i in (1, 2)]
        gain = [md.input(f"gain{i}", [D]) for i in (1, 2)]
        w_in = md.param("w_in", [D, Hd], fan_out=["hidden"])
        w_res = md.param("w_res", [Hd, md.Dim("hidden_out", cfg.hidden)], fan_out=["hidden_out"])
        w_p1 = md.param("w_p1", [Hd, md.Dim("proj_h", cfg.hidden)], fan_out=["proj_h"])
        g_p1, b_p1 = md.param("g_p1", [md.Dim("proj_h", cfg.hidden)], scale=0.0), md.param("b_p1", [md.Dim("proj_h", cfg.hidden)], scale=0.0)
        w_p2 = md.param("w_p2", [md.Dim("proj_h", cfg.hidden), P], fan_out=["proj"])
        w_q1 = md.param("w_q1", [P, Q], fan_out=["pred_hidden"])
        g_q1, b_q1 = md.param("g_q1", [Q], scale=0.0), md.param("b_q1", [Q], scale=0.0)
        w_q2 = md.param("w_q2", [Q, P2], fan_out=["proj_out"])
        b_q2 = md.param("b_q2", [P2], scale=0.0)

        def encode(x):
            h = md.relu(_linear(x, w_in, "hidden"))
            h = h + md.rename(md.relu(_linear(h, w_res, "hidden_out")), hidden_out="hidden")
            z = md.relu(md.batch_norm(_linear(h, w_p1, "proj_h"), ["batch"], g_p1 + 1.0, b_p1))
            return md.batch_norm(_linear(z, w_p2, "proj"), ["batch"])      # projector's last BN: no affine

        def predict(z):
            q = md.relu(md.batch_norm(_linear(z, w_q1, "pred_hidden"), ["batch"], g_q1 + 1.0, b_q1))
            # the bias starts at 0.1 (a constant fill), so no prediction starts at exactly 0
            b = b_q2 + md.constant(0.1, [P2])
            return md.rename(_linear(q, w_q2, "proj_out") + b, proj_out="proj")

        def neg_cos(p, z):
            z = md.stop_gradient(z)
            dot = md.reduce_sum(p * z, "proj")
            norm = md.sqrt(md.reduce_sum(p * p, "proj") * md.reduce_sum(z * z, "proj") + 1e-8)
            return -md.reduce_mean(dot / norm)

        views = [clean * gn + nz for gn, nz in zip(gain, noise)]
        z1, z2 = (encode(v) for v in views)
        p1, p2 = predict(z1), predict(z2)
        loss = neg_cos(p1, z2) * 0.5 + neg_cos(p2, z1) * 0.5

    def feeds(seed: int = 0) -> dict:
        gen = torch.Generator().manual_seed(seed)
        f = {"x": torch.randn(cfg.batch, cfg.d_in, generator=gen)}
        for i in (1, 2):
            f[f"noise{i}"] = 0.3 * torch.randn(cfg.batch, cfg.d_in, generator=gen)
            f[f"gain{i}"] = 1.0 + 0.2 * torch.randn(cfg.d_in, generator=gen)
        return f

    return md.Model(g, loss, g.params(), feeds, cfg)
