"""A graph attention network (GAT) over fed adjacency matrices, written from the README and docs/
alone (a held-out model).

A batch of graphs, each its own fed adjacency ``adj [batch, node, key_node]`` (0/1, self loops
included) and node features ``[batch, node, feat]``. Each layer of the ``md.repeat`` stack
projects the nodes per head, scores every edge additively (``LeakyReLU(a_dst . h_i + a_src .
h_j)``, LeakyReLU as ``md.maximum(x, 0.2 x)``), masks the non-edges with ``md.where`` and takes
a softmax over ``key_node`` (each node attends over its neighbours), sums the neighbours'
projected states, merges the heads back into ``d_model`` by an einsum, applies ELU (written
``where(x > 0, x, exp(x) - 1)``) and a residual with LayerNorm. Node classification: a
cross-entropy per node, only on the labelled nodes of a fed 0/1 mask, divided by their count
over the whole batch (a count made from the inputs only).
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    nodes: int = 32
    feat: int = 16
    d_model: int = 32
    heads: int = 4
    d_head: int = 8
    layers: int = 2
    batch: int = 4
    classes: int = 6
    edge_p: float = 0.2
    label_p: float = 0.5

    @classmethod
    def tiny(cls) -> "Config":
        return cls(nodes=8, feat=5, d_model=8, heads=2, d_head=4, layers=2, batch=4, classes=3)


def build(cfg: Config = Config()) -> md.Model:
    batch, node, key_node = md.Dim("batch", cfg.batch), md.Dim("node", cfg.nodes), md.Dim("key_node", cfg.nodes)
    feat, d_model, heads, d_head = md.Dim("feat", cfg.feat), md.Dim("d_model", cfg.d_model), md.Dim("heads", cfg.heads), md.Dim("d_head", cfg.d_head)
    classes, layer = md.Dim("classes", cfg.classes), md.Dim("layer", cfg.layers)
    with md.Graph("heldout_gat") as g:
        x_in = md.input("x", [batch, node, feat])
        adj = md.input("adj", [batch, node, key_node])
        labels = md.input("labels", [batch, node], dtype=torch.int64)
        labelled = md.input("labelled", [batch, node])
        w_in = md.param("w_in", [feat, d_model], fan_out=[d_model])
        blocks = {
            "w": md.param("w", [layer, d_model, heads, d_head], fan_out=["layer", heads, d_head]),
            "a_src": md.param("a_src", [layer, heads, d_head], fan_out=["layer", heads], scale=0.5),
            "a_dst": md.param("a_dst", [layer, heads, d_head], fan_out=["layer", heads], scale=0.5),
            "w_out": md.param("w_out", [layer, heads, d_head, d_model], fan_out=["layer", d_model]),
            "ln": md.param("ln", [layer, d_model], init="ones"),
            "ln_b": md.param("ln_b", [layer, d_model], init="zeros"),
        }
        w_cls = md.param("w_cls", [d_model, classes], fan_out=[classes])
        edge = md.greater(adj, 0.5)

        def block(x: md.Tensor, p: dict) -> md.Tensor:
            h = md.einsum("batch node d_model, d_model heads d_head -> batch node heads d_head", x, p["w"])
            hk = md.rename(h, node="key_node")
            dst = md.einsum("batch node heads d_head, heads d_head -> batch node heads", h, p["a_dst"])
            src = md.einsum("batch key_node heads d_head, heads d_head -> batch key_node heads", hk, p["a_src"])
            e = dst + src                                              # [batch, node, heads, key_node]
            e = md.maximum(e, e * 0.2)
            att = md.softmax(md.where(edge, e, -1e9), "key_node")
            m = md.einsum("batch node heads key_node, batch key_node heads d_head -> batch node heads d_head", att, hk)
            m = md.einsum("batch node heads d_head, heads d_head d_model -> batch node d_model", m, p["w_out"])
            m = md.where(md.greater(m, 0.0), m, md.exp(m) - 1.0)
            return md.layer_norm(x + m, "d_model", p["ln"], p["ln_b"])

        x = md.einsum("batch node feat, feat d_model -> batch node d_model", x_in, w_in)
        x = md.repeat(block, x, blocks, "layer")
        logits = md.einsum("batch node d_model, d_model classes -> batch node classes", x, w_cls)
        ce = md.cross_entropy(logits, labels, "classes")
        loss = md.reduce_sum(ce * labelled) / md.reduce_sum(labelled)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        a = torch.rand(cfg.batch, cfg.nodes, cfg.nodes, generator=gen) < cfg.edge_p
        a = a | a.transpose(1, 2) | torch.eye(cfg.nodes, dtype=torch.bool)
        lab = (torch.rand(cfg.batch, cfg.nodes, generator=gen) < cfg.label_p).float()
        lab[:, 0] = 1.0                                                # at least one labelled node
        return {"x": torch.randn(cfg.batch, cfg.nodes, cfg.feat, generator=gen), "adj": a.float(),
                "labels": torch.randint(0, cfg.classes, (cfg.batch, cfg.nodes), generator=gen),
                "labelled": lab}

    return md.Model(g, loss, {"w_in": w_in, **blocks, "w_cls": w_cls}, feeds, cfg)
