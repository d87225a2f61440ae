"""Held-out model (round 21a): a top-k sparse autoencoder on fed activations.

Written from the user docs alone. An SAE reads activations ``x [batch, d_model]`` of some
other model (fed), encodes them to a dictionary much wider than ``d_model``, keeps the ``k``
largest pre-activations of each row (``md.top_k`` over ``dict``), and decodes with a
dictionary whose columns are normalised to unit length in the graph:

- ``pre = (x - b_dec) W_enc + b_enc``; ``z = relu(pre)`` where ``pre`` is among the row's
  top ``k``, 0 elsewhere. ``form="scatter"`` puts the ``k`` values back by a one-hot of their
  indices; ``form="threshold"`` keeps ``pre >= `` the row's ``k``-th value;
- ``x_hat = z W_dec / |W_dec|_col + b_dec``; the loss is the mean squared error plus an
  auxiliary loss on dead latents (OpenAI's top-k SAE): the top ``k_aux`` pre-activations
  among latents fed as dead (``dead [dict]``, 1.0 = dead) reconstruct the residual
  ``stop_gradient(x - x_hat)``, weighted ``aux_coef``.

Legend: b batch, d d_model, n dict (the dictionary), t dict_top (the k kept), a dict_aux.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    d_model: int = 64
    dict_size: int = 512
    k: int = 16
    k_aux: int = 32
    batch: int = 64
    aux_coef: float = 1.0 / 32
    form: str = "scatter"         # "scatter" (one-hot of the top-k indices) or "threshold"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(d_model=8, dict_size=48, k=3, k_aux=4, batch=6)


def _sparse(pre, k: int, new_dim: str, form: str):
    """The row's ``k`` largest pre-activations kept (relu'd), every other latent 0."""
    vals, idx = md.top_k(pre, "dict", k, new_dim=new_dim)
    if form == "threshold":
        kth = md.reduce_min(vals, new_dim)                       # [batch]: the k-th largest
        return md.where(md.greater_equal(pre, kth), md.relu(pre), 0.0)
    onehot = md.one_hot(idx, pre.shape["dict"])                  # [batch, new_dim, dict]
    return md.einsum(f"batch {new_dim}, batch {new_dim} dict -> batch dict", md.relu(vals), onehot)


def build(cfg: Config = Config()) -> md.Model:
    B, D, N = md.Dim("batch", cfg.batch), md.Dim("d_model", cfg.d_model), md.Dim("dict", cfg.dict_size)
    with md.Graph("sae") as g:
        x = md.input("x", [B, D])
        dead = md.input("dead", [N])
        w_enc = md.param("w_enc", [D, N], fan_out=["dict"])
        b_enc = md.param("b_enc", [N], init="zeros")
        w_dec = md.param("w_dec", [N, D], fan_out=["d_model"])
        b_dec = md.param("b_dec", [D], init="zeros")
        pre = md.einsum("batch d_model, d_model dict -> batch dict", x - b_dec, w_enc) + b_enc
        z = _sparse(pre, cfg.k, "dict_top", cfg.form)
        w_unit = w_dec * md.rsqrt(md.reduce_sum(w_dec * w_dec, "d_model"))     # unit columns
        x_hat = md.einsum("batch dict, dict d_model -> batch d_model", z, w_unit) + b_dec
        mse = md.reduce_mean((x_hat - x) ** 2)
        # dead latents only (the live ones pushed to -1e9 before the top-k)
        z_aux = _sparse(md.where(md.greater(dead, 0.5), pre, -1e9), cfg.k_aux, "dict_aux", cfg.form)
        resid = md.stop_gradient(x - x_hat)
        e_hat = md.einsum("batch dict, dict d_model -> batch d_model", z_aux, w_unit)
        aux = md.reduce_mean((e_hat - resid) ** 2)
        loss = mse + cfg.aux_coef * aux

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        # activations with a few heavy directions, as a residual stream has
        basis = torch.randn(4, cfg.d_model, generator=torch.Generator().manual_seed(1234))
        x = torch.randn(cfg.batch, cfg.d_model, generator=gen) * 0.3 + \
            torch.randn(cfg.batch, 4, generator=gen) @ basis
        dead = (torch.rand(cfg.dict_size, generator=torch.Generator().manual_seed(99)) < 0.5).float()
        return {"x": x, "dead": dead}

    return md.Model(g, loss, g.params(), feeds, cfg, outputs={"mse": mse, "aux": aux})


REF_INPUTS = ("x", "dead")


def reference_loss(cfg: Config, params: dict, x: torch.Tensor, dead: torch.Tensor) -> torch.Tensor:
    """The SAE's loss in plain torch (float64): torch.topk + scatter."""
    p = {k: v.double() for k, v in params.items()}
    x = x.double()
    pre = (x - p["b_dec"]) @ p["w_enc"] + p["b_enc"]

    def sparse(t, k):
        vals, idx = t.topk(k, dim=-1)
        return torch.zeros_like(t).scatter(-1, idx, vals.relu())

    w_unit = p["w_dec"] / p["w_dec"].norm(dim=-1, keepdim=True)
    x_hat = sparse(pre, cfg.k) @ w_unit + p["b_dec"]
    mse = ((x_hat - x) ** 2).mean()
    e_hat = sparse(torch.where(dead.double() > 0.5, pre, torch.full_like(pre, -1e9)), cfg.k_aux) @ w_unit
    return mse + cfg.aux_coef * ((e_hat - (x - x_hat)) ** 2).mean()
