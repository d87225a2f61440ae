"""A hypergraph neural net (HGNN-style) for node classification, a held-out model (round 24a).

Legend: nodes = graph nodes, edges = hyperedges, incidence [nodes, edges] = fed 0/1 (a node in a
hyperedge), d_in = node features, hidden = hidden features, classes = node classes, layer = message
passing rounds (md.repeat). Each round: h -> h W, node -> edge mean (divided by the edge's degree),
edge -> node mean (divided by the node's degree); a zero degree (an empty edge, an isolated node)
gives 0 by md.where, not inf. A residual relu. Loss: cross-entropy of the fed labelled nodes (mask).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    nodes: int = 24
    edges: int = 10
    d_in: int = 16
    hidden: int = 32
    classes: int = 4
    layers: int = 2
    remat: str | None = None

    @classmethod
    def tiny(cls) -> "Config":
        return cls(nodes=12, edges=6, d_in=5, hidden=8, classes=3, layers=2)


def _inverse_degree(deg):
    """1/deg, 0 where deg is 0 (the division's inf is in the branch where drops)."""
    return md.where(deg > 0.5, 1.0 / md.maximum(deg, md.constant(1.0)), 0.0)


def build(cfg: Config) -> md.Model:
    N, Ed, I = md.Dim("nodes", cfg.nodes), md.Dim("edges", cfg.edges), md.Dim("d_in", cfg.d_in)
    Hd, K, L = md.Dim("hidden", cfg.hidden), md.Dim("classes", cfg.classes), md.Dim("layer", cfg.layers)
    with md.Graph() as g:
        x = md.input("x", [N, I])
        inc = md.input("incidence", [N, Ed])
        labels = md.input("labels", [N], dtype=torch.int64)
        mask = md.input("mask", [N])
        inv_dv = _inverse_degree(md.reduce_sum(inc, "edges"))       # [nodes]
        inv_de = _inverse_degree(md.reduce_sum(inc, "nodes"))       # [edges]
        h = md.relu(md.einsum("nodes d_in, d_in hidden -> nodes hidden", x, md.param("w_in", [I, Hd], fan_out=[Hd])))

        def block(h, p):
            t = md.rename(md.einsum("nodes hidden, hidden h_out -> nodes h_out", h, p["w"]), {"h_out": "hidden"}) + p["b"]
            e = md.einsum("nodes edges, nodes hidden -> edges hidden", inc, t) * inv_de
            v = md.einsum("nodes edges, edges hidden -> nodes hidden", inc, e) * inv_dv
            return h + md.relu(v)

        stacked = {"w": md.param("w", [L, Hd, md.Dim("h_out", cfg.hidden)], fan_out=["layer", "h_out"]),
                   "b": md.param("b", [L, Hd], init="zeros")}
        h = md.repeat(block, h, stacked, "layer", remat=cfg.remat)
        logits = md.einsum("nodes hidden, hidden classes -> nodes classes", h, md.param("w_out", [Hd, K], fan_out=[K]))
        loss = md.reduce_sum(md.cross_entropy(logits, labels, "classes") * mask) / md.reduce_sum(mask)

    def feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        inc = (torch.rand(cfg.nodes, cfg.edges, generator=gen) < 0.3).float()
        inc[:, -1] = 0.0          # an empty hyperedge
        inc[0] = 0.0              # an isolated node
        mask = (torch.rand(cfg.nodes, generator=gen) < 0.6).float()
        mask[1] = 1.0
        return {"x": torch.randn(cfg.nodes, cfg.d_in, generator=gen), "incidence": inc,
                "labels": torch.randint(0, cfg.classes, (cfg.nodes,), generator=gen), "mask": mask}

    return md.Model(g, loss, g.params(), feeds, cfg)


REF_INPUTS = ("x", "incidence", "labels", "mask")


def reference_loss(cfg: Config, p: dict, x, inc, labels, mask):
    """The same model in plain torch (degrees by sum, 1/deg with 0 for an empty edge or lone node)."""
    dv, de = inc.sum(1), inc.sum(0)
    inv_dv = torch.where(dv > 0, 1 / dv.clamp(min=1), torch.zeros_like(dv))
    inv_de = torch.where(de > 0, 1 / de.clamp(min=1), torch.zeros_like(de))
    h = torch.relu(x @ p["w_in"])
    for i in range(cfg.layers):
        t = h @ p["w"][i] + p["b"][i]
        e = (inc.T @ t) * inv_de[:, None]
        h = h + torch.relu((inc @ e) * inv_dv[:, None])
    ce = torch.nn.functional.cross_entropy(h @ p["w_out"], labels, reduction="none")
    return (ce * mask).sum() / mask.sum()
