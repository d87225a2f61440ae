"""A two-track stack in the way of Evoformer: an MSA track and a pair track of other shapes, carried as a tuple.

Legend: B batch, N res, NJ res_j, M c_m, MO c_mo, Z c_z, L layer (the stack, scanned by ``md.repeat``).

Each layer biases the MSA track ``msa`` [batch, res, c_m] by the pair track's mean over ``res_j``,
then updates the pair track ``pair`` [batch, res, res_j, c_z] by the MSA's outer product: the two
carried tensors read each other every layer, and have different dims.  A pipeline over ``layer``
hands both from stage to stage.  Each layer's pair norm is a per-layer output the loss reads too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    batch: int = 8
    res: int = 16
    c_m: int = 32
    c_z: int = 16
    layers: int = 8
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, res=3, c_m=4, c_z=6, layers=4)


def two_tracks(mp, p):
    """One layer: the MSA biased by the pair, the pair updated by the MSA's outer product."""
    msa, pair = mp
    bias = md.einsum("batch res c_z, c_z c_m -> batch res c_m", md.reduce_mean(pair, "res_j"), p["w_zm"])
    mixed = md.einsum("batch res c_m, c_m c_mo -> batch res c_mo", msa, p["w_m"])
    msa = msa + md.rename(md.tanh(mixed), c_mo="c_m") + bias
    opm = md.einsum("batch res c_m, batch res_j c_m -> batch res res_j c_m", msa, md.rename(msa, res="res_j"))
    pair = pair + md.tanh(md.einsum("batch res res_j c_m, c_m c_z -> batch res res_j c_z", opm, p["w_mz"]))
    return (msa, pair), {"norm": md.reduce_mean(pair * pair)}


def build(cfg: Config) -> md.Model:
    B, N, NJ = md.Dim("batch", cfg.batch), md.Dim("res", cfg.res), md.Dim("res_j", cfg.res)
    M, MO, Z, L = md.Dim("c_m", cfg.c_m), md.Dim("c_mo", cfg.c_m), md.Dim("c_z", cfg.c_z), md.Dim("layer", cfg.layers)
    with md.Graph() as g:
        m0, z0 = md.input("msa", [B, N, M]), md.input("pair", [B, N, NJ, Z])
        ps = {"w_m": md.param("w_m", [L, M, MO], fan_out=[L, MO]),
              "w_zm": md.param("w_zm", [L, Z, M], fan_out=[L, M]),
              "w_mz": md.param("w_mz", [L, M, Z], fan_out=[L, Z])}
        (m, z), per = md.repeat(two_tracks, (m0, z0), ps, "layer", remat=cfg.remat)
        loss = md.reduce_mean(md.tanh(m) ** 2) + md.reduce_mean(z * z) + 0.01 * md.reduce_sum(per["norm"])

    def make_feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        return {"msa": torch.randn(cfg.batch, cfg.res, cfg.c_m, generator=gen) * 0.5,
                "pair": torch.randn(cfg.batch, cfg.res, cfg.res, cfg.c_z, generator=gen) * 0.5}

    return md.Model(g, loss, g.params(), make_feeds, cfg)
