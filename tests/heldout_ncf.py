"""Neural collaborative filtering (NeuMF), a held-out model (round 23a).

Legend: batch = a user's row in the batch, cand = its fed candidates (one positive, then fed
negatives), users/items = embedding table rows, d_gmf / d_mlp = embedding widths, hidden = the MLP
tower's width. GMF tower: user * item embeddings; MLP tower: [user, item] -> hidden -> d_mlp;
NeuMF head over both; BCE (log-sigmoid form) on the fed implicit labels.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    users: int = 64
    items: int = 96
    d_gmf: int = 16
    d_mlp: int = 16
    hidden: int = 32
    batch: int = 16
    cand: int = 4           # one positive and cand - 1 fed negatives per row

    @classmethod
    def tiny(cls) -> "Config":
        return cls(users=12, items=10, d_gmf=4, d_mlp=4, hidden=6, batch=4, cand=3)


def build(cfg: Config) -> md.Model:
    B, C = md.Dim("batch", cfg.batch), md.Dim("cand", cfg.cand)
    U, I = md.Dim("users", cfg.users), md.Dim("items", cfg.items)
    G, M, H = md.Dim("d_gmf", cfg.d_gmf), md.Dim("d_mlp", cfg.d_mlp), md.Dim("hidden", cfg.hidden)
    with md.Graph() as g:
        user = md.input("user", [B], dtype=torch.int64)
        item = md.input("item", [B, C], dtype=torch.int64)
        label = md.input("label", [B, C])
        u_gmf = md.gather(md.param("u_gmf", [U, G], scale=0.5), user, "users")        # [batch, d_gmf]
        i_gmf = md.gather(md.param("i_gmf", [I, G], scale=0.5), item, "items")        # [batch, cand, d_gmf]
        u_mlp = md.gather(md.param("u_mlp", [U, M], scale=0.5), user, "users")
        i_mlp = md.gather(md.param("i_mlp", [I, M], scale=0.5), item, "items")
        gmf = u_gmf * i_gmf
        w1u, w1i = md.param("w1u", [M, H], fan_out=[H]), md.param("w1i", [M, H], fan_out=[H])
        b1 = md.param("b1", [H], init="zeros")
        h = md.relu(md.einsum("batch d_mlp, d_mlp hidden -> batch hidden", u_mlp, w1u)
                    + md.einsum("batch cand d_mlp, d_mlp hidden -> batch cand hidden", i_mlp, w1i) + b1)
        w2 = md.param("w2", [H, md.Dim("d_out", cfg.d_mlp)], fan_out=["d_out"])
        mlp = md.relu(md.einsum("batch cand hidden, hidden d_out -> batch cand d_out", h, w2))
        hg, hm = md.param("h_gmf", [G]), md.param("h_mlp", [md.Dim("d_out", cfg.d_mlp)])
        score = md.einsum("batch cand d_gmf, d_gmf -> batch cand", gmf, hg) + \
            md.einsum("batch cand d_out, d_out -> batch cand", mlp, hm)
        # BCE with logits: -(y log s + (1 - y) log(1 - s)) = -(y logsig(x) + (1 - y) logsig(-x))
        bce = -(label * md.log_sigmoid(score) + (1.0 - label) * md.log_sigmoid(-score))
        loss = md.reduce_mean(bce)

    def feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        label = torch.zeros(cfg.batch, cfg.cand)
        label[:, 0] = 1.0
        return {"user": torch.randint(0, cfg.users, (cfg.batch,), generator=gen),
                "item": torch.randint(0, cfg.items, (cfg.batch, cfg.cand), generator=gen), "label": label}

    return md.Model(g, loss, g.params(), feeds, cfg)


REF_INPUTS = ("user", "item", "label")


def reference_loss(cfg: Config, p: dict, user, item, label):
    """The same NeuMF in plain torch (embedding lookups by indexing, BCE-with-logits)."""
    gmf = p["u_gmf"][user][:, None] * p["i_gmf"][item]
    h = torch.relu((p["u_mlp"][user] @ p["w1u"])[:, None] + p["i_mlp"][item] @ p["w1i"] + p["b1"])
    mlp = torch.relu(h @ p["w2"])
    score = gmf @ p["h_gmf"] + mlp @ p["h_mlp"]
    return torch.nn.functional.binary_cross_entropy_with_logits(score, label)
