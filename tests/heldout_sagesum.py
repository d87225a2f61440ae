"""Held-out model (round 26c): a GIN / GraphSAGE-mean graph classifier written from the docs alone.

Fed edge lists (``src``, ``dst``): each message is the source node's features (``md.gather``),
summed at the target (``md.scatter_add``). Layer 1 is GIN, ``MLP((1 + eps) h + sum of
messages)`` with a 2-layer MLP; layer 2 is GraphSAGE-mean, ``relu(h W_self + mean W_nbr)``,
the mean dividing by the in-degree (``scatter_add`` of ones, 0 where a node has none). A sum
readout over each node's fed graph id, a linear head and the cross-entropy per graph.

Legend: ``nodes``, ``edges``, ``graphs``; ``feat`` input features, ``hidden`` node features
(each matmul's ``h_out`` renamed back), ``classes`` the head's outputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    nodes: int = 48
    edges: int = 160
    graphs: int = 6
    feat: int = 8
    hidden: int = 32
    classes: int = 3
    gin_eps: float = 0.1

    @classmethod
    def tiny(cls) -> "Config":
        return cls(nodes=12, edges=30, graphs=3, feat=4, hidden=8)


def _linear(h, name, d_out):
    out = md.Dim("h_out", d_out)
    w = md.param(name, [h.shape["hidden"], out], fan_out=[out])
    return md.rename(md.einsum("nodes hidden, hidden h_out -> nodes h_out", h, w), h_out="hidden")


def build(cfg: Config) -> md.Model:
    nodes, edges = md.Dim("nodes", cfg.nodes), md.Dim("edges", cfg.edges)
    graphs, classes = md.Dim("graphs", cfg.graphs), md.Dim("classes", cfg.classes)
    hidden = md.Dim("hidden", cfg.hidden)
    with md.Graph() as g:
        x = md.input("x", [nodes, md.Dim("feat", cfg.feat)])
        src = md.input("src", [edges], dtype=torch.int64)
        dst = md.input("dst", [edges], dtype=torch.int64)
        graph_id = md.input("graph_id", [nodes], dtype=torch.int64)
        labels = md.input("labels", [graphs], dtype=torch.int64)
        w_in = md.param("w_in", [x.shape["feat"], hidden], fan_out=[hidden])
        h = md.einsum("nodes feat, feat hidden -> nodes hidden", x, w_in)
        # GIN: a sum of messages, then a 2-layer MLP
        agg = md.scatter_add(md.gather(h, src, "nodes"), dst, nodes)
        h = _linear(md.relu(_linear((1 + cfg.gin_eps) * h + agg, "gin_1", cfg.hidden)), "gin_2", cfg.hidden)
        h = md.relu(h)
        # GraphSAGE-mean: the messages' sum over the in-degree (0 for a node without one)
        deg = md.scatter_add(md.constant(1.0, [edges]), dst, nodes)
        agg = md.scatter_add(md.gather(h, src, "nodes"), dst, nodes)
        mean = md.where(md.greater(deg, 0), agg / md.maximum(deg, md.constant(1.0, [nodes])), 0.0)
        h = md.relu(_linear(h, "sage_self", cfg.hidden) + _linear(mean, "sage_nbr", cfg.hidden))
        pooled = md.scatter_add(h, graph_id, graphs)
        head = md.param("head", [hidden, classes], fan_out=[classes])
        logits = md.einsum("graphs hidden, hidden classes -> graphs classes", pooled, head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))

    def make_feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        graph_id = torch.arange(cfg.nodes) * cfg.graphs // cfg.nodes      # contiguous graphs
        starts = torch.searchsorted(graph_id, torch.arange(cfg.graphs))
        sizes = torch.bincount(graph_id, minlength=cfg.graphs)
        which = torch.randint(0, cfg.graphs, (cfg.edges,), generator=gen)
        src = starts[which] + (torch.rand(cfg.edges, generator=gen) * sizes[which]).long()
        dst = starts[which] + (torch.rand(cfg.edges, generator=gen) * (sizes[which] - 1)).long()  # the last node of each graph has no in-edge
        return {"x": torch.randn(cfg.nodes, cfg.feat, generator=gen), "src": src, "dst": dst,
                "graph_id": graph_id, "labels": torch.randint(0, cfg.classes, (cfg.graphs,), generator=gen)}

    return md.Model(g, loss, g.params(), make_feeds, cfg)


def torch_reference(cfg: Config, weights: dict, feeds: dict) -> torch.Tensor:
    """The same model in plain torch (float64, ``index_add``), from ``weights`` by name."""
    w = {k: v.double() for k, v in weights.items()}
    src, dst = feeds["src"], feeds["dst"]

    def scatter(rows, ids, n):
        return torch.zeros(n, *rows.shape[1:], dtype=rows.dtype).index_add(0, ids, rows)

    h = feeds["x"].double() @ w["w_in"]
    h = (1 + cfg.gin_eps) * h + scatter(h[src], dst, cfg.nodes)
    h = torch.relu(torch.relu(h @ w["gin_1"]) @ w["gin_2"])
    deg = scatter(torch.ones(cfg.edges, dtype=h.dtype), dst, cfg.nodes)
    mean = scatter(h[src], dst, cfg.nodes) / deg.clamp(min=1)[:, None]
    h = torch.relu(h @ w["sage_self"] + mean @ w["sage_nbr"])
    logits = scatter(h, feeds["graph_id"], cfg.graphs) @ w["head"]
    return torch.nn.functional.cross_entropy(logits, feeds["labels"])
