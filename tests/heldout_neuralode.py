"""A Neural ODE classifier (continuous depth), written from the README and docs/ alone (a held-out
model), in dims of its own names.

An encoder lifts each example's features to a state ``z``; ``dz/dtau = f(z, tau)``, an MLP that
also reads the time (its first layer adds ``tau * w_tau``), is integrated from ``tau = 0`` to
``tau = 1`` by classic fourth-order Runge-Kutta with a fixed step, one ``md.repeat`` entry per
step over the ``step`` dim. Every step reads the same ODE weights from outside the repeat (no
stacked params, as ALBERT's shared layer); the step's start time comes in as a stacked constant
``[step]``. A layer-normed linear head gives class logits (cross-entropy) and, with
``regress=True``, a second head a regression target (mean squared error) besides.

Legend: ex (examples), feat (input features), zd (state width), wid (the ODE MLP's width),
cls (classes), step (RK4 steps).
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    ex: int = 16
    feat: int = 10
    zd: int = 32
    wid: int = 64
    cls: int = 5
    steps: int = 4
    regress: bool = False
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(ex=8, feat=6, zd=12, wid=18, cls=4, steps=4)


def build(cfg: Config = Config()) -> md.Model:
    ex, feat, zd, wid = md.Dim("ex", cfg.ex), md.Dim("feat", cfg.feat), md.Dim("zd", cfg.zd), md.Dim("wid", cfg.wid)
    cls, step = md.Dim("cls", cfg.cls), md.Dim("step", cfg.steps)
    dt = 1.0 / cfg.steps
    with md.Graph("heldout_neuralode") as g:
        x = md.input("x", [ex, feat])
        y = md.input("y", [ex], dtype=torch.int64)
        target = md.input("target", [ex]) if cfg.regress else None
        w_enc = md.param("w_enc", [feat, zd], fan_out=[zd])
        b_enc = md.param("b_enc", [zd], init="zeros")
        w1 = md.param("w1", [zd, wid], fan_out=[wid])
        w_tau = md.param("w_tau", [wid], scale=1.0)
        b1 = md.param("b1", [wid], init="zeros")
        w2 = md.param("w2", [wid, zd], fan_out=[zd], scale=0.5 / cfg.wid ** 0.5)
        ln = md.param("ln", [zd], init="ones")
        w_cls = md.param("w_cls", [zd, cls], fan_out=[cls])
        w_reg = md.param("w_reg", [zd], scale=0.1) if cfg.regress else None

        def f(z, tau):
            hid = md.tanh(md.einsum("ex zd, zd wid -> ex wid", z, w1) + tau * w_tau + b1)
            return md.einsum("ex wid, wid zd -> ex zd", hid, w2)

        def rk4(z, p):
            tau = p["tau"]
            k1 = f(z, tau)
            k2 = f(z + (dt / 2) * k1, tau + dt / 2)
            k3 = f(z + (dt / 2) * k2, tau + dt / 2)
            k4 = f(z + dt * k3, tau + dt)
            return z + (dt / 6) * (k1 + 2 * k2 + 2 * k3 + k4)

        taus = md.constant(torch.arange(cfg.steps, dtype=torch.float32) * dt, [step])
        z0 = md.tanh(md.einsum("ex feat, feat zd -> ex zd", x, w_enc) + b_enc)
        z1 = md.layer_norm(md.repeat(rk4, z0, {"tau": taus}, "step", remat=cfg.remat), "zd", ln)
        logits = md.einsum("ex zd, zd cls -> ex cls", z1, w_cls)
        loss = md.reduce_mean(md.cross_entropy(logits, y, "cls"))
        if cfg.regress:
            loss = loss + md.reduce_mean(md.square(md.einsum("ex zd, zd -> ex", z1, w_reg) - target))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        xs = torch.randn(cfg.ex, cfg.feat, generator=gen)
        out = {"x": xs, "y": (xs[:, 0] * 2 + xs[:, 1]).floor().clamp(0, cfg.cls - 1).long()}
        if cfg.regress:
            out["target"] = xs.sum(1) / cfg.feat ** 0.5
        return out

    params = {"w_enc": w_enc, "b_enc": b_enc, "w1": w1, "w_tau": w_tau, "b1": b1, "w2": w2, "ln": ln, "w_cls": w_cls,
              **({"w_reg": w_reg} if cfg.regress else {})}
    return md.Model(g, loss, params, feeds, cfg)
