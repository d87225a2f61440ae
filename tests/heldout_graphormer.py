"""A graph transformer on a padded batch of graphs, written from the README and docs/ alone by a
user in their own dim names (a held-out model).

Each ``graph`` has up to ``node`` nodes (``present [graph, node]`` is 0 on padding), node
features ``[graph, node, feat]``, an adjacency ``adj [graph, node, node2]`` (0/1, self loops
on every node, padding included, so no row is all masked) and edge features
``[graph, node, node2, efeat]``. Each layer of the ``md.repeat`` over ``depth`` is a pre-norm
transformer block whose attention scores (``head`` x ``hd``) are biased per head by a linear
map of the edge features and masked by the adjacency (``md.where``, -1e9 off the edges),
softmax over ``node2``; then a relu MLP over ``hidden``. The readout is the mean over each
graph's real nodes (a sum of ``present``-weighted states over a count of them), then a
linear map and a cross-entropy over ``cls``.

Legend: g = graph, n = node, m = node2, e = efeat, w = width, a = head, c = hd, u = hidden.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    graphs: int = 8
    nodes: int = 24
    feat: int = 16
    efeat: int = 8
    width: int = 64
    heads: int = 4
    hd: int = 16
    hidden: int = 128
    depth: int = 4
    classes: int = 5
    remat: str = "none"    # md.repeat's remat: none, full, selective

    @classmethod
    def tiny(cls) -> "Config":
        return cls(graphs=4, nodes=6, feat=3, efeat=2, width=8, heads=2, hd=4, hidden=12, depth=2, classes=3)


def build(cfg: Config = Config()) -> md.Model:
    graph, node, node2 = md.Dim("graph", cfg.graphs), md.Dim("node", cfg.nodes), md.Dim("node2", cfg.nodes)
    feat, efeat, width = md.Dim("feat", cfg.feat), md.Dim("efeat", cfg.efeat), md.Dim("width", cfg.width)
    head, hd, hidden = md.Dim("head", cfg.heads), md.Dim("hd", cfg.hd), md.Dim("hidden", cfg.hidden)
    depth, cls = md.Dim("depth", cfg.depth), md.Dim("cls", cfg.classes)
    with md.Graph("heldout_graphormer") as g:
        x_in = md.input("x", [graph, node, feat])
        adj = md.input("adj", [graph, node, node2])
        edges = md.input("edges", [graph, node, node2, efeat])
        present = md.input("present", [graph, node])
        label = md.input("label", [graph], dtype=torch.int64)
        w_in = md.param("w_in", [feat, width], fan_out=[width])
        layers = {
            "ln1": md.param("ln1", [depth, width], init="ones"),
            "ln2": md.param("ln2", [depth, width], init="ones"),
            "wq": md.param("wq", [depth, width, head, hd], fan_out=["depth", head, hd]),
            "wk": md.param("wk", [depth, width, head, hd], fan_out=["depth", head, hd]),
            "wv": md.param("wv", [depth, width, head, hd], fan_out=["depth", head, hd]),
            "wo": md.param("wo", [depth, head, hd, width], fan_out=["depth", width]),
            "we": md.param("we", [depth, efeat, head], fan_out=["depth", head]),
            "w1": md.param("w1", [depth, width, hidden], fan_out=["depth", hidden]),
            "w2": md.param("w2", [depth, hidden, width], fan_out=["depth", width]),
        }
        w_cls = md.param("w_cls", [width, cls], fan_out=[cls])
        linked = md.greater(adj, 0.5)

        def block(h: md.Tensor, p: dict) -> md.Tensor:
            y = md.layer_norm(h, "width", p["ln1"])
            q = md.einsum("graph node width, width head hd -> graph node head hd", y, p["wq"])
            k = md.einsum("graph node2 width, width head hd -> graph node2 head hd", md.rename(y, node="node2"), p["wk"])
            v = md.einsum("graph node2 width, width head hd -> graph node2 head hd", md.rename(y, node="node2"), p["wv"])
            s = md.einsum("graph node head hd, graph node2 head hd -> graph head node node2", q, k) * cfg.hd ** -0.5
            s = s + md.einsum("graph node node2 efeat, efeat head -> graph head node node2", edges, p["we"])
            a = md.softmax(md.where(linked, s, -1e9), "node2")
            o = md.einsum("graph head node node2, graph node2 head hd -> graph node head hd", a, v)
            h = h + md.einsum("graph node head hd, head hd width -> graph node width", o, p["wo"])
            y = md.relu(md.einsum("graph node width, width hidden -> graph node hidden",
                                  md.layer_norm(h, "width", p["ln2"]), p["w1"]))
            return h + md.einsum("graph node hidden, hidden width -> graph node width", y, p["w2"])

        h = md.einsum("graph node feat, feat width -> graph node width", x_in, w_in)
        h = md.repeat(block, h, layers, "depth", remat=cfg.remat)
        pooled = md.reduce_sum(h * present, "node") / md.reduce_sum(present, "node")
        logits = md.einsum("graph width, width cls -> graph cls", pooled, w_cls)
        loss = md.reduce_mean(md.cross_entropy(logits, label, "cls"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        n_real = torch.randint(2, cfg.nodes + 1, (cfg.graphs, 1), generator=gen)
        present_t = (torch.arange(cfg.nodes) < n_real).float()
        both = present_t[:, :, None] * present_t[:, None, :]
        adj_t = (torch.rand(cfg.graphs, cfg.nodes, cfg.nodes, generator=gen) < 0.4).float() * both
        adj_t = torch.maximum(torch.maximum(adj_t, adj_t.transpose(1, 2)), torch.eye(cfg.nodes))
        return {"x": torch.randn(cfg.graphs, cfg.nodes, cfg.feat, generator=gen) * present_t[..., None],
                "adj": adj_t,
                "edges": torch.randn(cfg.graphs, cfg.nodes, cfg.nodes, cfg.efeat, generator=gen) * adj_t[..., None],
                "present": present_t,
                "label": torch.randint(0, cfg.classes, (cfg.graphs,), generator=gen)}

    return md.Model(g, loss, {"w_in": w_in, **layers, "w_cls": w_cls}, feeds, cfg)
