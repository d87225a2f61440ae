"""An E(n)-equivariant graph network (EGNN), written from the README and docs/ alone (a held-out model).

Graphs of up to ``node`` nodes (a node mask ``[batch, node]`` pads the smaller ones), every pair
an edge (dense, all-pairs: ``node`` against its copy ``node2``, the diagonal and padded nodes
masked out). Node features ``h`` (atom types embedded by ``md.gather``) and coordinates ``x``
(noisy positions, ``xyz``). A layer (Satorras et al.):

    m_ij  = phi_e(h_i, h_j, |x_i - x_j|^2)                      (two silu layers, masked)
    x_i' = x_i + sum_j (x_i - x_j) phi_x(m_ij) / (node - 1)
    h_i' = h_i + phi_h(h_i, sum_j m_ij / (node - 1))

The layers run in a ``md.repeat`` over ``layer``; a repeat carries one tensor, so ``h`` and ``x``
travel together, joined along ``c`` by ``md.concat`` and sliced apart at each layer's start.
Loss: a graph-level energy (masked sum over nodes of an MLP of h) against a fed target, plus
the final coordinates against the clean positions (denoising), both mean-squared.

Legend: batch (graphs); node, node2 (the two ends of an edge); types; f (node features); xyz;
c (f + xyz, the carry); e, e2 (edge MLP); hn (node MLP); r (readout MLP); layer.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 32
    nodes: int = 29
    types: int = 10
    features: int = 64
    edge: int = 64
    hidden: int = 64
    layers: int = 4
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, nodes=7, types=5, features=6, edge=8, hidden=8, layers=2)


def build(cfg: Config = Config()) -> md.Model:
    F = cfg.features
    batch, node, node2 = md.Dim("batch", cfg.batch), md.Dim("node", cfg.nodes), md.Dim("node2", cfg.nodes)
    types, f, xyz, layer = md.Dim("types", cfg.types), md.Dim("f", F), md.Dim("xyz", 3), md.Dim("layer", cfg.layers)
    e, e2, hn, f2, r = (md.Dim("e", cfg.edge), md.Dim("e2", cfg.edge), md.Dim("hn", cfg.hidden),
                        md.Dim("f2", F), md.Dim("r", cfg.hidden))
    with md.Graph("heldout_egnn") as g:
        atoms = md.input("atoms", [batch, node], dtype=torch.int64)
        pos = md.input("pos", [batch, node, xyz])                        # noisy
        clean = md.input("clean", [batch, node, xyz])
        mask = md.input("mask", [batch, node])                           # 1 for a real node
        energy = md.input("energy", [batch])
        p = {"embed": md.param("embed", [types, f], scale=1.0),
             "wr1": md.param("wr1", [f, r], fan_out=["r"]),
             "wr2": md.param("wr2", [r])}
        L = ["layer"]
        q = {"we_i": md.param("we_i", [layer, f, e], fan_out=L + ["e"]),
             "we_j": md.param("we_j", [layer, f, e], fan_out=L + ["e"]),
             "we_d": md.param("we_d", [layer, e], scale=0.1),
             "be": md.param("be", [layer, e], init="zeros"),
             "we2": md.param("we2", [layer, e, e2], fan_out=L + ["e2"]),
             "wx": md.param("wx", [layer, e2], scale=0.1),
             "wh_h": md.param("wh_h", [layer, f, hn], fan_out=L + ["hn"]),
             "wh_m": md.param("wh_m", [layer, e2, hn], fan_out=L + ["hn"]),
             "bh": md.param("bh", [layer, hn], init="zeros"),
             "wh_o": md.param("wh_o", [layer, hn, f2], fan_out=L + ["f2"])}

        not_self = md.where(md.equal(md.arange(node), md.arange(node2)), 0.0, 1.0)   # [node, node2]
        edges = mask * md.rename(mask, node="node2") * not_self          # [batch, node, node2]

        def egnn_layer(carry: md.Tensor, w: dict) -> md.Tensor:           # carry [batch, node, c: F + 3]
            h = md.rename(md.slice_(carry, "c", 0, F), c="f")
            x = md.rename(md.slice_(carry, "c", F, F + 3), c="xyz")
            diff = x - md.rename(x, node="node2")                         # [batch, node, xyz, node2]
            d2 = md.reduce_sum(diff * diff, "xyz")                        # [batch, node, node2]
            pre = (md.einsum("batch node f, f e -> batch node e", h, w["we_i"])
                   + md.einsum("batch node2 f, f e -> batch node2 e", md.rename(h, node="node2"), w["we_j"])
                   + d2 * w["we_d"] + w["be"])
            m = md.silu(md.einsum("batch node node2 e, e e2 -> batch node node2 e2", md.silu(pre), w["we2"]))
            m = m * edges                                                 # no self or padded edges
            phi = md.einsum("batch node node2 e2, e2 -> batch node node2", m, w["wx"])
            x = x + md.reduce_sum(diff * phi, "node2") * (1.0 / (cfg.nodes - 1))
            agg = md.reduce_sum(m, "node2") * (1.0 / (cfg.nodes - 1))      # [batch, node, e2], a mean
            u = md.silu(md.einsum("batch node f, f hn -> batch node hn", h, w["wh_h"])
                        + md.einsum("batch node e2, e2 hn -> batch node hn", agg, w["wh_m"]) + w["bh"])
            h = h + md.rename(md.einsum("batch node hn, hn f2 -> batch node f2", u, w["wh_o"]), f2="f")
            return md.concat([md.rename(h * mask, f="c"), md.rename(x, xyz="c")], "c")

        h0 = md.gather(p["embed"], atoms, "types") * mask                 # [batch, node, f]
        carry = md.concat([md.rename(h0, f="c"), md.rename(pos, xyz="c")], "c")
        carry = md.repeat(egnn_layer, carry, q, "layer", remat=cfg.remat)
        h = md.rename(md.slice_(carry, "c", 0, F), c="f")
        x = md.rename(md.slice_(carry, "c", F, F + 3), c="xyz")
        per_node = md.einsum("batch node r, r -> batch node",
                             md.silu(md.einsum("batch node f, f r -> batch node r", h, p["wr1"])), p["wr2"])
        pred = md.reduce_sum(per_node * mask, "node")                    # [batch]
        err = (x - clean) * mask
        loss = md.reduce_mean((pred - energy) ** 2) + md.reduce_mean(md.reduce_sum(err * err, "xyz"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        n = torch.randint(cfg.nodes - 2, cfg.nodes + 1, (cfg.batch,), generator=gen)
        mask = (torch.arange(cfg.nodes)[None, :] < n[:, None]).float()
        atoms = torch.randint(0, cfg.types, (cfg.batch, cfg.nodes), generator=gen)
        clean = torch.randn(cfg.batch, cfg.nodes, 3, generator=gen) * mask[..., None]
        pos = clean + 0.1 * torch.randn(cfg.batch, cfg.nodes, 3, generator=gen) * mask[..., None]
        # an energy from pair distances, so it is rotation-invariant as the model is
        d = torch.cdist(clean, clean)
        pair = mask[:, :, None] * mask[:, None, :] * (1 - torch.eye(cfg.nodes))
        energy = (torch.exp(-d) * pair).sum((1, 2)) / 2
        return {"atoms": atoms, "pos": pos, "clean": clean, "mask": mask, "energy": energy}

    return md.Model(g, loss, {**p, **q}, feeds, cfg)
