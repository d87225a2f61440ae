"""A physics-informed network for viscous Burgers, a held-out model (round 23a).

Legend: batch = collocation points, bnd = boundary/initial points, hidden = the MLP's width.
u(x, t) = MLP(x, t) (tanh). The residual u_t + u u_x - nu u_xx needs derivatives of u with respect
to the INPUTS x and t, the second one a derivative of a derivative: md.vjp (whose results stay
differentiable) with a cotangent of ones, since u at a point depends only on that point's x and t.
Loss = residual MSE + boundary MSE against fed boundary values. The hidden layers are a Python loop,
not an md.repeat: the scan's gradient has no second-order rule (a clear error, tested).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 64
    bnd: int = 16
    hidden: int = 32
    layers: int = 2          # hidden tanh layers after the first
    nu: float = 0.01 / math.pi

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=8, bnd=4, hidden=6, layers=2)


def _layer(h, p):
    return md.rename(md.tanh(md.einsum("... hidden, hidden h_out -> ... h_out", h, p["w"]) + p["b"]), h_out="hidden")


def _mlp(cfg: Config, x, t, ps):
    h = md.tanh(md.einsum("... , hidden -> ... hidden", x, ps["wx"])
                + md.einsum("... , hidden -> ... hidden", t, ps["wt"]) + ps["b0"])
    for i in range(cfg.layers):     # a Python loop: md.repeat's scan has no second-order rule
        h = _layer(h, {"w": ps[f"w{i + 1}"], "b": ps[f"b{i + 1}"]})
    return md.einsum("... hidden, hidden -> ...", h, ps["wu"]) + ps["bu"]


def build(cfg: Config) -> md.Model:
    B, NB, H = md.Dim("batch", cfg.batch), md.Dim("bnd", cfg.bnd), md.Dim("hidden", cfg.hidden)
    HO = md.Dim("h_out", cfg.hidden)
    with md.Graph() as g:
        x, t = md.input("x", [B]), md.input("t", [B])
        xb, tb, ub = md.input("xb", [NB]), md.input("tb", [NB]), md.input("ub", [NB])
        ps = {"wx": md.param("wx", [H], scale=1.0), "wt": md.param("wt", [H], scale=1.0),
              "b0": md.param("b0", [H], scale=0.1)}
        for i in range(cfg.layers):
            ps[f"w{i + 1}"] = md.param(f"w{i + 1}", [H, HO], fan_out=[HO])
            ps[f"b{i + 1}"] = md.param(f"b{i + 1}", [HO], scale=0.1)
        ps["wu"], ps["bu"] = md.param("wu", [H]), md.param("bu", [], scale=0.1)
        u = _mlp(cfg, x, t, ps)
        ones = md.constant(1.0, [B])
        u_x, u_t = md.vjp([u], [ones], [x, t])
        (u_xx,) = md.vjp([u_x], [ones], [x])
        res = u_t + u * u_x - cfg.nu * u_xx
        u_b = _mlp(cfg, xb, tb, ps)
        loss = md.reduce_mean(res * res) + md.reduce_mean((u_b - ub) ** 2)

    def feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        xb = torch.rand(cfg.bnd, generator=gen) * 2 - 1
        return {"x": torch.rand(cfg.batch, generator=gen) * 2 - 1, "t": torch.rand(cfg.batch, generator=gen),
                "xb": xb, "tb": torch.zeros(cfg.bnd), "ub": -torch.sin(math.pi * xb)}

    return md.Model(g, loss, g.params(), feeds, cfg)


REF_INPUTS = ("x", "t", "xb", "tb", "ub")


def _ref_mlp(cfg, p, x, t):
    h = torch.tanh(x[:, None] * p["wx"] + t[:, None] * p["wt"] + p["b0"])
    for i in range(cfg.layers):
        h = torch.tanh(h @ p[f"w{i + 1}"] + p[f"b{i + 1}"])
    return h @ p["wu"] + p["bu"]


def reference_loss(cfg: Config, p: dict, x, t, xb, tb, ub):
    """The same PINN in plain torch: the input derivatives by autograd with create_graph=True."""
    x, t = x.clone().requires_grad_(), t.clone().requires_grad_()
    u = _ref_mlp(cfg, p, x, t)
    u_x, u_t = torch.autograd.grad(u.sum(), [x, t], create_graph=True)
    (u_xx,) = torch.autograd.grad(u_x.sum(), [x], create_graph=True)
    res = u_t + u * u_x - cfg.nu * u_xx
    return (res ** 2).mean() + ((_ref_mlp(cfg, p, xb, tb) - ub) ** 2).mean()
