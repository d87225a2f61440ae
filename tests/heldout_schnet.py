"""A SchNet-style molecular energy model, written from the README and docs/ alone (a held-out model).

A padded batch of molecules: atom species ``[mol, atom]`` (0 is padding) and coordinates
``[mol, atom, xyz]``. Pairwise distances over ``(atom, atom2)`` (the neighbour's copy is a
rename), expanded on ``rbf`` Gaussians and weighted by a smooth cosine cutoff (zero past
``cutoff``, on self pairs and on padding). Each interaction block of the ``md.repeat`` stack over
``interaction`` is a continuous-filter convolution: a filter network maps the expansion to
``[mol, atom, atom2, filt]``, which multiplies the neighbours' features and is summed over
``atom2`` by an einsum; then an atom-wise MLP and a residual. Shifted softplus is written
``max(x, 0) + log(1 + exp(-|x|)) - log 2`` (there is no ``md.softplus``). The energy is an
atom-wise readout summed over the real atoms per molecule; the loss a mean squared error
against a fed energy.

Legend: m = mol, a = atom, n = atom2 (neighbour), k = rbf, h = hidden, f = filt.
"""
import math
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    mols: int = 8
    atoms: int = 24
    species: int = 10
    hidden: int = 64
    filt: int = 64
    rbf: int = 32
    interactions: int = 3
    cutoff: float = 5.0
    remat: str = "none"    # md.repeat's remat: none, full, selective

    @classmethod
    def tiny(cls) -> "Config":
        return cls(mols=4, atoms=6, species=5, hidden=8, filt=6, rbf=5, interactions=2, cutoff=2.5)


def ssp(x: md.Tensor) -> md.Tensor:
    """Shifted softplus, stable for large |x|."""
    return md.maximum(x, 0.0) + md.log(1.0 + md.exp(-md.abs(x))) - math.log(2.0)


def build(cfg: Config = Config()) -> md.Model:
    mol, atom, atom2 = md.Dim("mol", cfg.mols), md.Dim("atom", cfg.atoms), md.Dim("atom2", cfg.atoms)
    xyz, rbf, species = md.Dim("xyz", 3), md.Dim("rbf", cfg.rbf), md.Dim("species", cfg.species)
    hidden, filt, inter = md.Dim("hidden", cfg.hidden), md.Dim("filt", cfg.filt), md.Dim("interaction", cfg.interactions)
    with md.Graph("heldout_schnet") as g:
        z = md.input("z", [mol, atom], dtype=torch.int64)
        pos = md.input("pos", [mol, atom, xyz])
        energy = md.input("energy", [mol])
        embed = md.param("embed", [species, hidden], scale=1.0)
        blocks = {
            "w_f1": md.param("w_f1", [inter, rbf, filt], fan_out=["interaction", filt]),
            "w_f2": md.param("w_f2", [inter, filt, md.Dim("filt2", cfg.filt)], fan_out=["interaction", "filt2"]),
            "w_in": md.param("w_in", [inter, hidden, filt], fan_out=["interaction", filt]),
            "w_out": md.param("w_out", [inter, filt, hidden], fan_out=["interaction", hidden]),
            "w_mlp": md.param("w_mlp", [inter, hidden, md.Dim("hidden2", cfg.hidden)], fan_out=["interaction", "hidden2"]),
        }
        w_r1 = md.param("w_r1", [hidden, md.Dim("half", max(cfg.hidden // 2, 1))], fan_out=["half"])
        w_r2 = md.param("w_r2", [md.Dim("half", max(cfg.hidden // 2, 1))])

        real = md.cast(md.greater(z, 0), torch.float32)                       # [mol, atom]
        real2 = md.rename(real, atom="atom2")
        diff = pos - md.rename(pos, atom="atom2")                               # [mol, atom, xyz, atom2]
        dist = md.sqrt(md.reduce_sum(diff * diff, "xyz") + 1e-6)                # [mol, atom, atom2]
        centers = md.constant(torch.linspace(0.0, cfg.cutoff, cfg.rbf), [rbf])
        gamma = 0.5 / (cfg.cutoff / cfg.rbf) ** 2
        expansion = md.exp(-gamma * (dist - centers) ** 2)                      # [mol, atom, atom2, rbf]
        not_self = md.cast(md.not_equal(md.arange(atom), md.arange(atom2)), torch.float32)
        inside = md.cast(md.less(dist, cfg.cutoff), torch.float32)
        cut = 0.5 * (md.cos(dist * (math.pi / cfg.cutoff)) + 1.0) * inside * not_self * real * real2

        def interaction(x: md.Tensor, p: dict) -> md.Tensor:
            w = ssp(md.einsum("mol atom atom2 rbf, rbf filt -> mol atom atom2 filt", expansion, p["w_f1"]))
            w = md.rename(md.einsum("mol atom atom2 filt, filt filt2 -> mol atom atom2 filt2", w, p["w_f2"]),
                          filt2="filt") * cut
            xj = md.rename(md.einsum("mol atom hidden, hidden filt -> mol atom filt", x, p["w_in"]), atom="atom2")
            v = md.einsum("mol atom atom2 filt, mol atom2 filt -> mol atom filt", w, xj)     # cfconv
            v = md.einsum("mol atom filt, filt hidden -> mol atom hidden", ssp(v), p["w_out"])
            v = md.rename(md.einsum("mol atom hidden, hidden hidden2 -> mol atom hidden2", v, p["w_mlp"]),
                          hidden2="hidden")
            return x + v

        x = md.gather(embed, z, "species")                                      # [mol, atom, hidden]
        x = md.repeat(interaction, x, blocks, "interaction", remat=cfg.remat)
        e_atom = md.einsum("mol atom half, half -> mol atom",
                           ssp(md.einsum("mol atom hidden, hidden half -> mol atom half", x, w_r1)), w_r2)
        e_mol = md.reduce_sum(e_atom * real, "atom")
        loss = md.reduce_mean((e_mol - energy) ** 2)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        n_real = torch.randint(cfg.atoms // 2, cfg.atoms + 1, (cfg.mols, 1), generator=gen)
        z_t = torch.randint(1, cfg.species, (cfg.mols, cfg.atoms), generator=gen)
        z_t = torch.where(torch.arange(cfg.atoms) < n_real, z_t, 0)
        pos_t = torch.randn(cfg.mols, cfg.atoms, 3, generator=gen) * (cfg.cutoff / 3)
        return {"z": z_t, "pos": pos_t, "energy": torch.randn(cfg.mols, generator=gen)}

    return md.Model(g, loss, {"embed": embed, **blocks, "w_r1": w_r1, "w_r2": w_r2}, feeds, cfg)
