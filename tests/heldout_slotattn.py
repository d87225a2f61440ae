"""Slot Attention, a held-out model (round 27a): slots refined iteratively over the inputs.

Legend: batch = scenes, n_in = input positions (a set), d_in = input features, d = slot features,
d_ff = the slot MLP's hidden features, d2 = a square weight's output (renamed back to d), slots,
iter = the refinement iterations. Keys and values are made once from the layer-normed inputs; the
slots start at a learned mean plus the fed noise times a learned scale. Each iteration (one
``md.repeat`` over ``iter`` with no stacked params: every iteration reads the same weights, and
the keys and values, from outside) takes a softmax over the SLOTS of q . k (the slots compete for
each input), adds 1e-8 and renormalises over the inputs, takes the weighted mean of the values,
updates the slots with a GRU cell (torch's gate equations) and adds an MLP of the normed slots.
Decoder: each slot broadcast over the positions plus a position embedding, relu, a per-slot
reconstruction and alpha logit; the alphas softmax'ed over the slots mix the reconstructions; the
loss is the mean squared error against the inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 8
    n_in: int = 16
    d_in: int = 4
    d: int = 16
    d_ff: int = 32
    slots: int = 4
    iters: int = 3
    remat: str | None = None

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=2, n_in=6, d_in=3, d=8, d_ff=8, slots=4, iters=2)


GATES = ("r", "z", "n")


def _lin(x, w):
    """x [.., d] times a square w [d, d2], back to d."""
    return md.rename(md.einsum("... d, d d2 -> ... d2", x, w), {"d2": "d"})


def _iteration(slots, k, v, p, cfg: Config):
    prev = slots
    q = _lin(md.layer_norm(slots, "d", p["ln_s"], p["ln_s_b"]), p["wq"])
    logits = md.einsum("batch slots d, batch n_in d -> batch slots n_in", q, k) * cfg.d ** -0.5
    attn = md.softmax(logits, "slots") + 1e-8
    attn = attn / md.reduce_sum(attn, "n_in")
    updates = md.einsum("batch slots n_in, batch n_in d -> batch slots d", attn, v)
    r = md.sigmoid(_lin(updates, p["wi_r"]) + p["bi_r"] + _lin(prev, p["wh_r"]) + p["bh_r"])
    z = md.sigmoid(_lin(updates, p["wi_z"]) + p["bi_z"] + _lin(prev, p["wh_z"]) + p["bh_z"])
    n = md.tanh(_lin(updates, p["wi_n"]) + p["bi_n"] + r * (_lin(prev, p["wh_n"]) + p["bh_n"]))
    h = (1 - z) * n + z * prev
    m = md.relu(md.einsum("batch slots d, d d_ff -> batch slots d_ff", md.layer_norm(h, "d", p["ln_m"], p["ln_m_b"]), p["fc1"]))
    return h + md.einsum("batch slots d_ff, d_ff d -> batch slots d", m, p["fc2"])


def build(cfg: Config) -> md.Model:
    B, N, Din, D = md.Dim("batch", cfg.batch), md.Dim("n_in", cfg.n_in), md.Dim("d_in", cfg.d_in), md.Dim("d", cfg.d)
    D2, F, S, It = md.Dim("d2", cfg.d), md.Dim("d_ff", cfg.d_ff), md.Dim("slots", cfg.slots), md.Dim("iter", cfg.iters)
    with md.Graph() as g:
        x = md.input("x", [B, N, Din])
        noise = md.input("noise", [B, S, D])
        p = {"ln_in": md.param("ln_in", [Din], init="ones"), "ln_in_b": md.param("ln_in_b", [Din], init="zeros"),
             "wk": md.param("wk", [Din, D], fan_out=["d"]), "wv": md.param("wv", [Din, D], fan_out=["d"]),
             "mu": md.param("mu", [D], scale=1.0), "sigma": md.param("sigma", [D], init="ones"),
             "wq": md.param("wq", [D, D2], fan_out=["d2"]),
             "fc1": md.param("fc1", [D, F], fan_out=["d_ff"]), "fc2": md.param("fc2", [F, D], fan_out=["d"]),
             "pos": md.param("pos", [N, D], scale=1.0), "w_out": md.param("w_out", [D, Din], fan_out=["d_in"]),
             "w_alpha": md.param("w_alpha", [D])}
        for n in ("ln_s", "ln_m"):
            p[n], p[f"{n}_b"] = md.param(n, [D], init="ones"), md.param(f"{n}_b", [D], init="zeros")
        for gname in GATES:
            for side in ("i", "h"):
                p[f"w{side}_{gname}"] = md.param(f"w{side}_{gname}", [D, D2], fan_out=["d2"])
                p[f"b{side}_{gname}"] = md.param(f"b{side}_{gname}", [D], init="zeros")
        xn = md.layer_norm(x, "d_in", p["ln_in"], p["ln_in_b"])
        k = md.einsum("batch n_in d_in, d_in d -> batch n_in d", xn, p["wk"])
        v = md.einsum("batch n_in d_in, d_in d -> batch n_in d", xn, p["wv"])
        slots = p["mu"] + noise * p["sigma"]
        slots = md.repeat(lambda s, _: _iteration(s, k, v, p, cfg), slots, {}, It, remat=cfg.remat)
        dec = md.relu(slots + p["pos"])                                      # [batch, slots, d, n_in]
        rgb = md.einsum("batch slots n_in d, d d_in -> batch slots n_in d_in", dec, p["w_out"])
        alpha = md.softmax(md.einsum("batch slots n_in d, d -> batch slots n_in", dec, p["w_alpha"]), "slots")
        recon = md.reduce_sum(alpha * rgb, "slots")
        loss = md.reduce_mean((recon - x) ** 2)

    def feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(cfg.batch, cfg.n_in, cfg.d_in, generator=gen),
                "noise": torch.randn(cfg.batch, cfg.slots, cfg.d, generator=gen)}

    return md.Model(g, loss, g.params(), feeds, cfg, outputs={"slots": slots})


REF_INPUTS = ("x", "noise")


def reference_loss(cfg: Config, p: dict, x, noise):
    """The same model in plain torch: a Python loop over the iterations, torch's GRUCell
    equations written out (gate weights [d, d2] applied as x @ w)."""
    F = torch.nn.functional
    D = cfg.d
    xn = F.layer_norm(x, (cfg.d_in,), p["ln_in"], p["ln_in_b"])
    k, v = xn @ p["wk"], xn @ p["wv"]
    slots = p["mu"] + noise * p["sigma"]
    for _ in range(cfg.iters):
        prev = slots
        q = F.layer_norm(slots, (D,), p["ln_s"], p["ln_s_b"]) @ p["wq"]
        attn = torch.softmax(torch.einsum("bsd,bnd->bsn", q, k) * D ** -0.5, dim=1) + 1e-8
        updates = torch.einsum("bsn,bnd->bsd", attn / attn.sum(-1, keepdim=True), v)
        gi = {g: updates @ p[f"wi_{g}"] + p[f"bi_{g}"] for g in GATES}
        gh = {g: prev @ p[f"wh_{g}"] + p[f"bh_{g}"] for g in GATES}
        r, z = torch.sigmoid(gi["r"] + gh["r"]), torch.sigmoid(gi["z"] + gh["z"])
        h = (1 - z) * torch.tanh(gi["n"] + r * gh["n"]) + z * prev
        slots = h + F.relu(F.layer_norm(h, (D,), p["ln_m"], p["ln_m_b"]) @ p["fc1"]) @ p["fc2"]
    dec = F.relu(slots[:, :, None, :] + p["pos"])                          # [b, s, n, d]
    alpha = torch.softmax(dec @ p["w_alpha"], dim=1)
    recon = (alpha[..., None] * (dec @ p["w_out"])).sum(1)
    return ((recon - x) ** 2).mean()
