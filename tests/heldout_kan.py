"""A Kolmogorov-Arnold Network regressor, written from the README and docs/ alone (a held-out model).

Two KAN layers, ``d_in -> hid -> d_out``. Each edge (i, j) has its own activation,
``phi_ij(x) = w_base[i, j] silu(x) + w_spline[i, j] sum_k c[i, j, k] B_k(x)``, and node j sums
its edges: ``y_j = sum_i phi_ij(x_i)``. ``B_k`` are the degree-3 B-spline bases over a fixed
uniform grid of ``grid`` intervals on [-1, 1], extended by 3 knots each side (``grid + 3`` bases,
``basis`` dim). ``basis`` picks how they are built:

- ``"cox"``: the Cox-de Boor recursion, degree 0 from where-masks ``t_k <= x < t_{k+1}``, each
  degree mixing neighbouring bases (``md.slice_`` along the basis dim, knots as constants);
- ``"relu"``: the closed form of a uniform cubic B-spline by truncated powers,
  ``B(u) = sum_{j=0..4} (-1)^j C(4, j) relu(u - j)^3 / 6`` with ``u = (x - t_k) / h``.

The loss is the mean squared error against targets from a fixed smooth function of the inputs.

Legend: b batch, i d_in, j hid, o d_out, k basis.
"""
from dataclasses import dataclass
from math import comb

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    d_in: int = 8
    hid: int = 16
    d_out: int = 4
    grid: int = 5
    batch: int = 64
    basis: str = "cox"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(d_in=4, hid=6, d_out=2, grid=5, batch=8)


DEG = 3


def knots(cfg: Config) -> torch.Tensor:
    h = 2.0 / cfg.grid
    return torch.tensor([-1.0 + (i - DEG) * h for i in range(cfg.grid + 2 * DEG + 1)])


def bases_cox(x, cfg: Config, basis: md.Dim):
    """``x [..]`` -> ``[.., basis]`` by Cox-de Boor: degree p has ``len(t) - 1 - p`` bases."""
    t = knots(cfg)
    n = len(t) - 1
    d0 = md.Dim("b0", n)
    lo, hi = md.constant(t[:-1], [d0]), md.constant(t[1:], [d0])
    b = md.cast(md.logical_and(md.greater_equal(x, lo), md.less(x, hi)), torch.float32)
    for p in range(1, DEG + 1):
        m = n - p
        dp = md.Dim(f"b{p}" if p < DEG else basis.name, m)
        prev = f"b{p - 1}"
        left = md.rename(md.slice_(b, prev, 0, m), {prev: dp.name})
        right = md.rename(md.slice_(b, prev, 1, m + 1), {prev: dp.name})
        t_k, t_kp = md.constant(t[:m], [dp]), md.constant(t[p:p + m], [dp])
        t_k1, t_kp1 = md.constant(t[1:m + 1], [dp]), md.constant(t[p + 1:p + 1 + m], [dp])
        b = (x - t_k) / (t_kp - t_k) * left + (t_kp1 - x) / (t_kp1 - t_k1) * right
    return b


def bases_relu(x, cfg: Config, basis: md.Dim):
    """``x [..]`` -> ``[.., basis]`` by truncated powers of the uniform cubic B-spline."""
    t = knots(cfg)
    h = 2.0 / cfg.grid
    u = (x - md.constant(t[:basis.size], [basis])) / h
    out = None
    for j in range(DEG + 2):
        term = (-1) ** j * comb(DEG + 1, j) / 6.0 * md.relu(u - float(j)) ** 3
        out = term if out is None else out + term
    return out


def kan_layer(x, p, d_in: str, d_out: str, cfg: Config, basis: md.Dim):
    """``x [batch, d_in]`` -> ``[batch, d_out]``."""
    b = bases_cox(x, cfg, basis) if cfg.basis == "cox" else bases_relu(x, cfg, basis)
    coef = p["coef"] * p["w_spline"]                                           # [d_in, d_out, basis]
    spline = md.einsum(f"batch {d_in} basis, {d_in} {d_out} basis -> batch {d_out}", b, coef)
    base = md.einsum(f"batch {d_in}, {d_in} {d_out} -> batch {d_out}", md.silu(x), p["w_base"])
    return base + spline


def build(cfg: Config = Config()) -> md.Model:
    b, i, j, o = md.Dim("batch", cfg.batch), md.Dim("d_in", cfg.d_in), md.Dim("hid", cfg.hid), md.Dim("d_out", cfg.d_out)
    k = md.Dim("basis", cfg.grid + DEG)
    with md.Graph("heldout_kan") as g:
        x = md.input("x", [b, i])
        y = md.input("y", [b, o])
        l1 = {"w_base": md.param("l1_w_base", [i, j], fan_out=[j]),
              "w_spline": md.param("l1_w_spline", [i, j], init="ones"),
              "coef": md.param("l1_coef", [i, j, k], scale=0.1)}
        l2 = {"w_base": md.param("l2_w_base", [j, o], fan_out=[o]),
              "w_spline": md.param("l2_w_spline", [j, o], init="ones"),
              "coef": md.param("l2_coef", [j, o, k], scale=0.1)}
        h = kan_layer(x, l1, "d_in", "hid", cfg, k)
        pred = kan_layer(h, l2, "hid", "d_out", cfg, k)
        loss = md.reduce_mean((pred - y) ** 2)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        xs = torch.rand(cfg.batch, cfg.d_in, generator=gen) * 2 - 1
        mix = torch.linspace(0.5, 1.5, cfg.d_in)[:, None] * torch.linspace(1.0, -1.0, cfg.d_out)[None, :]
        return {"x": xs, "y": torch.sin(3.0 * xs) @ mix + 0.1 * xs.pow(2).sum(1, keepdim=True)}

    params = {**{f"l1_{n}": t for n, t in l1.items()}, **{f"l2_{n}": t for n, t in l2.items()}}
    return md.Model(g, loss, params, feeds, cfg)
