"""Glow: flow steps (actnorm, an invertible 1x1 conv in LU form, an affine coupling) on tiny images.

Held-out model (round 15a), written from the user guides only. Each level squeezes the image
(space to depth, a rearrange), then runs its flow steps under ``md.repeat``; each step returns
its log-determinant as a per-layer output. The loss is the negative log-likelihood of the
dequantised images in bits per dim. ``--config levels=2`` is the multi-scale form: after
level 1 half the channels are factored out to the prior, and the rest is squeezed again.
``--config coupling=additive`` is NICE's coupling (no scale, log-determinant 0).

Legend: b batch, r rows, q cols, c channels of the squeezed image (a level's own names:
rows1/cols1/c1, rows2/cols2/c2), c_out the 1x1 conv's output (renamed back to c).
"""
from dataclasses import dataclass
import math

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 8
    size: int = 8
    channels: int = 1
    hidden: int = 16
    steps: int = 2          # flow steps per level
    levels: int = 1         # 1 | 2 (multi-scale: factor out half the channels between levels)
    coupling: str = "affine"  # affine | additive
    remat: str = "none"   # what each repeated layer saves for its backward (md.repeat's remat=)

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, size=8, channels=1, hidden=4, steps=2)


def _step(x, p, lvl, cfg, perm, sign, lower, upper, eye):
    """One flow step on ``x [batch, rows, cols, c]`` -> (y, {"logdet": [batch]})."""
    r, q, c = f"rows{lvl}", f"cols{lvl}", f"c{lvl}"
    pixels = x.shape[r].size * x.shape[q].size
    x = (x + p["an_bias"]) * md.exp(p["an_logs"])                                   # actnorm
    # invertible 1x1 conv, W = P L (U + diag(sign * exp(log_s))), applied as one matrix
    L = p["l_raw"] * lower + eye
    U = p["u_raw"] * upper + md.rename(eye, {f"m{lvl}": f"n{lvl}", f"n{lvl}": c}) * (sign * md.exp(p["log_s"]))
    W = md.einsum(f"c_out m{lvl}, m{lvl} n{lvl}, n{lvl} {c} -> c_out {c}", perm, L, U)
    x = md.rename(md.einsum(f"batch {r} {q} {c}, c_out {c} -> batch {r} {q} c_out", x, W), {"c_out": c})
    logdet = pixels * (md.reduce_sum(p["an_logs"]) + md.reduce_sum(p["log_s"]))
    # affine coupling: the first half of the channels sets the second's shift and scale
    half = x.shape[c].size // 2
    xa, xb = md.slice_(x, c, 0, half), md.slice_(x, c, half, 2 * half)
    h = md.relu(md.conv(xa, p["w1"], {r: "kh", q: "kw"}, padding="same"))
    shift = md.conv(h, p["w_shift"], {r: "kh", q: "kw"}, padding="same")
    if cfg.coupling == "affine":
        s = md.sigmoid(md.conv(h, p["w_scale"], {r: "kh", q: "kw"}, padding="same") + 2.0)
        yb = (xb + shift) * s
        logdet = logdet + md.reduce_sum(md.log(s), [r, q, c])
    else:
        yb = xb + shift
        logdet = logdet + md.reduce_sum(xb * 0.0, [r, q, c])     # [batch] zeros, the carry's batch
    return md.concat([xa, yb], c), {"logdet": logdet}


def _level(x, lvl, cfg, params):
    """Squeeze 2x2 to depth, then ``cfg.steps`` flow steps under md.repeat."""
    _, r, q, ch = x.shape.names                      # height width channels, or the last level's
    x = md.rearrange(x, f"batch ({r} ph) ({q} pw) {ch} -> batch {r} {q} (ph pw {ch})", ph=2, pw=2)
    x = md.rename(x, {r: f"rows{lvl}", q: f"cols{lvl}", f"ph_pw_{ch}": f"c{lvl}"})
    c, half = x.shape[f"c{lvl}"].size, x.shape[f"c{lvl}"].size // 2
    L, C = md.Dim(f"layer{lvl}" if cfg.levels > 1 else "layer", cfg.steps), md.Dim(f"c{lvl}", c)
    M, N, Hd = md.Dim(f"m{lvl}", c), md.Dim(f"n{lvl}", c), md.Dim("hidden", cfg.hidden)
    Kh, Kw, Ch, Ca = md.Dim("kh", 3), md.Dim("kw", 3), md.Dim(f"c{lvl}", half), md.Dim(f"c{lvl}", half)
    gen = torch.Generator().manual_seed(100 + lvl)
    perm = md.constant(torch.eye(c)[torch.randperm(c, generator=gen)], [md.Dim("c_out", c), M])
    sign = md.constant(torch.where(torch.arange(c) % 3 == 1, -1.0, 1.0), [C])
    lower = md.constant(torch.tril(torch.ones(c, c), -1), [M, N])
    upper = md.constant(torch.triu(torch.ones(c, c), 1), [N, C])
    eye = md.constant(torch.eye(c), [M, N])
    ln = L.name
    p = {"an_logs": md.param(f"an_logs{lvl}", [L, C], scale=0.1), "an_bias": md.param(f"an_bias{lvl}", [L, C], scale=0.1),
         "l_raw": md.param(f"l_raw{lvl}", [L, M, N], scale=0.3), "u_raw": md.param(f"u_raw{lvl}", [L, N, C], scale=0.3),
         "log_s": md.param(f"log_s{lvl}", [L, C], scale=0.1),
         "w1": md.param(f"w1{lvl}", [L, Kh, Kw, Ch, Hd], fan_out=[ln, "hidden"]),
         "w_shift": md.param(f"w_shift{lvl}", [L, Kh, Kw, Hd, Ca], scale=0.05)}
    if cfg.coupling == "affine":
        p["w_scale"] = md.param(f"w_scale{lvl}", [L, Kh, Kw, Hd, Ca], scale=0.05)
    params.update({f"{k}{lvl}": v for k, v in p.items()})
    x, per = md.repeat(lambda h, pp: _step(h, pp, lvl, cfg, perm, sign, lower, upper, eye), x, p, L, remat=cfg.remat)
    return x, md.reduce_sum(per["logdet"], ln)


def _log_normal(z, dims):
    """log N(z; 0, 1) summed over ``dims`` (the prior)."""
    return md.reduce_sum(-0.5 * z * z - 0.5 * math.log(2 * math.pi), dims)


def build(cfg: Config = Config()) -> md.Model:
    B, H, W, C = md.Dim("batch", cfg.batch), md.Dim("height", cfg.size), md.Dim("width", cfg.size), md.Dim("channels", cfg.channels)
    num_dims = cfg.size * cfg.size * cfg.channels
    params = {}
    with md.Graph("glow") as g:
        images = md.input("images", [B, H, W, C])          # dequantised: (k + u) / 256, u ~ U[0, 1)
        x = images - 0.5
        loglik = None
        for lvl in range(1, cfg.levels + 1):
            x, logdet = _level(x, lvl, cfg, params)
            if lvl < cfg.levels:                     # factor out half the channels to the prior
                c = x.shape[f"c{lvl}"].size
                out = _log_normal(md.slice_(x, f"c{lvl}", c // 2, c), [f"rows{lvl}", f"cols{lvl}", f"c{lvl}"])
                x = md.slice_(x, f"c{lvl}", 0, c // 2)
                logdet = logdet + out
            loglik = logdet if loglik is None else loglik + logdet
            last = lvl
        loglik = loglik + _log_normal(x, [f"rows{last}", f"cols{last}", f"c{last}"])
        # -log p(images) of the discrete data: the density's, plus D log 256 for the bin width
        bits = (num_dims * math.log(256.0) - loglik) / (num_dims * math.log(2.0))
        loss = md.reduce_mean(bits)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        k = torch.randint(0, 256, (cfg.batch, cfg.size, cfg.size, cfg.channels), generator=gen).float()
        return {"images": (k + torch.rand(k.shape, generator=gen)) / 256.0}

    return md.Model(g, loss, params, feeds, cfg, outputs={"z": x, "log_likelihood": loglik})
