"""Held-out model (round 17b): knowledge-graph embeddings, TransE or DistMult.

Legend: b = batch (true triples), n = negs (corrupted triples per true one), e = entities,
r = relations, d = dim (embedding width).

Form ``transe``: score(h, r, t) = -||e_h + w_r - e_t||_2 and the margin ranking loss
``relu(margin - score(true) + score(corrupted))`` averaged over the batch and its corruptions.
Form ``distmult``: score = sum_d e_h * w_r * e_t and the softplus (logistic) loss
``softplus(-score(true)) + mean_n softplus(score(corrupted))``. The corrupted triples are fed as
inputs (a head or a tail replaced by a random entity, chosen per triple on the host).
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    entities: int = 256
    relations: int = 16
    dim: int = 32
    batch: int = 32
    negs: int = 8
    margin: float = 1.0
    form: str = "transe"    # transe | distmult

    @classmethod
    def tiny(cls):
        return cls(entities=24, relations=5, dim=8, batch=8, negs=3)


def _score(eh, wr, et, form: str):
    """Triple scores over the dims the operands share but ``dim``."""
    if form == "transe":
        diff = eh + wr - et
        return -md.sqrt(md.reduce_sum(diff * diff, "dim") + 1e-9)
    return md.reduce_sum(eh * wr * et, "dim")


def build(cfg: Config) -> md.Model:
    if cfg.form not in ("transe", "distmult"):
        raise ValueError(f"form must be 'transe' or 'distmult', not {cfg.form!r}")
    B, N = md.Dim("batch", cfg.batch), md.Dim("negs", cfg.negs)
    E, R, D = md.Dim("entities", cfg.entities), md.Dim("relations", cfg.relations), md.Dim("dim", cfg.dim)
    with md.Graph() as g:
        head, rel, tail = (md.input(n, [B], dtype=torch.int64) for n in ("head", "rel", "tail"))
        neg_head = md.input("neg_head", [B, N], dtype=torch.int64)
        neg_tail = md.input("neg_tail", [B, N], dtype=torch.int64)
        ent = md.param("ent", [E, D], scale=cfg.dim ** -0.5)
        rel_w = md.param("rel_emb", [R, D], scale=cfg.dim ** -0.5)
        wr = md.gather(rel_w, rel, "relations")                       # [batch, dim]
        pos = _score(md.gather(ent, head, "entities"), wr, md.gather(ent, tail, "entities"), cfg.form)
        neg = _score(md.gather(ent, neg_head, "entities"), wr,
                     md.gather(ent, neg_tail, "entities"), cfg.form)     # [batch, negs]
        if cfg.form == "transe":
            loss = md.reduce_mean(md.relu(cfg.margin - pos + neg))
        else:
            loss = md.reduce_mean(md.softplus(-pos)) + md.reduce_mean(md.softplus(neg))

    def make_feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        h = torch.randint(0, cfg.entities, (cfg.batch,), generator=gen)
        t = torch.randint(0, cfg.entities, (cfg.batch,), generator=gen)
        corrupt = torch.randint(0, cfg.entities, (cfg.batch, cfg.negs), generator=gen)
        head_side = torch.rand(cfg.batch, cfg.negs, generator=gen) < 0.5
        return {"head": h, "tail": t,
                "rel": torch.randint(0, cfg.relations, (cfg.batch,), generator=gen),
                "neg_head": torch.where(head_side, corrupt, h[:, None]),
                "neg_tail": torch.where(head_side, t[:, None], corrupt)}

    return md.Model(g, loss, {"ent": ent, "rel_emb": rel_w}, make_feeds, cfg)
