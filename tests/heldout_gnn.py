"""A message-passing GNN over a fixed edge list, written from the README and docs/ alone (a held-out model).

A batch of graphs with one shared topology (a ring plus chords, a constant edge list). Each
layer of the ``md.repeat`` stack gathers the source nodes' states along ``nodes``
(``md.gather`` with the ``[edges]`` source ids), makes a message from the source and the
destination state (gathered the same way) and an edge feature, and sums the messages into
their destination nodes: the docs list no scatter op, so the sum is an einsum with the
``md.one_hot`` of the destination ids (``[edges, nodes]``), mean-normalised by in-degree. A
GRU-free residual update with LayerNorm; a mean over nodes and a cross-entropy over graph
classes.

Legend: b = batch, n = nodes, e = edges, d = d_model, f = d_ff.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    nodes: int = 32
    d_in: int = 8
    d_edge: int = 4
    d_model: int = 64
    d_ff: int = 128
    layers: int = 3
    classes: int = 4
    batch: int = 8

    @classmethod
    def tiny(cls) -> "Config":
        return cls(nodes=6, d_in=3, d_edge=2, d_model=8, d_ff=16, layers=2, classes=3, batch=4)


def edge_list(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A ring both ways plus chords i -> i + 2: (sources, destinations)."""
    i = torch.arange(n)
    src = torch.cat([i, (i + 1) % n, i])
    dst = torch.cat([(i + 1) % n, i, (i + 2) % n])
    return src, dst


def build(cfg: Config = Config()) -> md.Model:
    src_t, dst_t = edge_list(cfg.nodes)
    batch, nodes, edges = md.Dim("batch", cfg.batch), md.Dim("nodes", cfg.nodes), md.Dim("edges", len(src_t))
    d_model, d_ff, layer = md.Dim("d_model", cfg.d_model), md.Dim("d_ff", cfg.d_ff), md.Dim("layer", cfg.layers)
    d_edge, classes = md.Dim("d_edge", cfg.d_edge), md.Dim("classes", cfg.classes)
    with md.Graph("heldout_gnn") as g:
        x_in = md.input("x", [batch, nodes, md.Dim("d_in", cfg.d_in)])
        e_in = md.input("edge_attr", [batch, edges, d_edge])
        labels = md.input("labels", [batch], dtype=torch.int64)
        w_in = md.param("w_in", [md.Dim("d_in", cfg.d_in), d_model], fan_out=[d_model])
        stack = {
            "w_src": md.param("w_src", [layer, d_model, d_ff], fan_out=["layer", d_ff]),
            "w_dst": md.param("w_dst", [layer, d_model, d_ff], fan_out=["layer", d_ff]),
            "w_edge": md.param("w_edge", [layer, d_edge, d_ff], fan_out=["layer", d_ff]),
            "w_msg": md.param("w_msg", [layer, d_ff, d_model], fan_out=["layer", d_model]),
            "ln": md.param("ln", [layer, d_model], init="ones"),
        }
        w_out = md.param("w_out", [d_model, classes], fan_out=[classes])

        src, dst = md.constant(src_t, [edges]), md.constant(dst_t, [edges])
        scatter = md.one_hot(dst, nodes)                                    # [edges, nodes]
        in_degree = md.reduce_sum(scatter, "edges")                         # [nodes]
        scatter = scatter / in_degree

        def block(h: md.Tensor, p: dict) -> md.Tensor:
            hs, hd = md.gather(h, src, "nodes"), md.gather(h, dst, "nodes")     # [batch, edges, d_model]
            m = (md.einsum("batch edges d_model, d_model d_ff -> batch edges d_ff", hs, p["w_src"])
                 + md.einsum("batch edges d_model, d_model d_ff -> batch edges d_ff", hd, p["w_dst"])
                 + md.einsum("batch edges d_edge, d_edge d_ff -> batch edges d_ff", e_in, p["w_edge"]))
            m = md.einsum("batch edges d_ff, d_ff d_model -> batch edges d_model", md.relu(m), p["w_msg"])
            agg = md.einsum("batch edges d_model, edges nodes -> batch nodes d_model", m, scatter)
            return md.layer_norm(h + agg, "d_model", p["ln"])

        h = md.einsum("batch nodes d_in, d_in d_model -> batch nodes d_model", x_in, w_in)
        h = md.repeat(block, h, stack, "layer")
        logits = md.einsum("batch d_model, d_model classes -> batch classes", md.reduce_mean(h, "nodes"), w_out)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(cfg.batch, cfg.nodes, cfg.d_in, generator=gen),
                "edge_attr": torch.randn(cfg.batch, len(src_t), cfg.d_edge, generator=gen),
                "labels": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    return md.Model(g, loss, {"w_in": w_in, **stack, "w_out": w_out}, feeds, cfg)
