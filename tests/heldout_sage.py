"""GraphSAGE on a fed sampled neighbourhood (held-out round 26b), written from the guides alone.

Legend: N nodes (the last one a padding node of zero features), K fanout (sampled neighbours
per node), F feat (input features), H hidden, C classes.

The neighbour ids ``[nodes, fanout]`` and their validity mask are fed (a sampler's output): the
padded entries point at the padding node. Each of two layers gathers the neighbours' features,
takes their masked mean and their masked max (masked entries at -inf by ``md.where``; a node
with no valid neighbour gets 0), concatenates them with the node's own features, projects, and
L2-normalises the rows. The loss is the node cross-entropy over a fed train mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass
class Config:
    nodes: int = 64
    fanout: int = 8
    feat: int = 16
    hidden: int = 32
    classes: int = 5

    @classmethod
    def tiny(cls) -> "Config":
        return cls(nodes=12, fanout=4, feat=6, hidden=8, classes=3)


def _aggregate(h, nbr, valid, fdim: str):
    """The masked mean and max of each node's neighbours' rows of ``h`` [nodes, fdim]."""
    table = md.rename(h, {"nodes": "src"})
    rows = md.gather(table, nbr, "src")                              # [nodes, fanout, fdim]
    w = md.cast(valid, torch.float32)                                # [nodes, fanout]
    count = md.reduce_sum(w, "fanout")
    mean = md.reduce_sum(rows * w, "fanout") / md.maximum(count, md.constant(1.0))
    top = md.reduce_max(md.where(valid, rows, float("-inf")), "fanout")
    top = md.where(count > 0, top, 0.0)
    return mean, top


def _sage_layer(h, nbr, valid, w, fdim: str, odim: str):
    mean, top = _aggregate(h, nbr, valid, fdim)
    both = md.concat([h, mean, top], fdim)                            # [nodes, 3 * fdim]
    z = md.einsum(f"nodes cat, cat {odim} -> nodes {odim}", md.rename(both, {fdim: "cat"}), w)
    return z


def _l2_normalise(z, dim: str):
    return z * md.rsqrt(md.reduce_sum(z * z, dim) + 1e-6)


def build(cfg: Config) -> md.Model:
    N, K = md.Dim("nodes", cfg.nodes), md.Dim("fanout", cfg.fanout)
    F, H, C = md.Dim("feat", cfg.feat), md.Dim("hidden", cfg.hidden), md.Dim("classes", cfg.classes)
    with md.Graph() as g:
        x = md.input("x", [N, F])
        nbr = md.input("nbr", [N, K], dtype=torch.int64)
        valid = md.input("valid", [N, K], dtype=torch.bool)
        labels = md.input("labels", [N], dtype=torch.int64)
        train = md.input("train", [N], dtype=torch.bool)
        w1 = md.param("w1", [md.Dim("cat", 3 * cfg.feat), H], fan_out=[H])
        w2 = md.param("w2", [md.Dim("cat", 3 * cfg.hidden), C], fan_out=[C])
        h = _l2_normalise(md.relu(_sage_layer(x, nbr, valid, w1, "feat", "hidden")), "hidden")
        logits = _sage_layer(h, nbr, valid, w2, "hidden", "classes")
        keep = md.cast(train, torch.float32)
        loss = md.reduce_sum(md.cross_entropy(logits, labels, "classes") * keep) / md.reduce_sum(keep)

    def make_feeds(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        n, pad = cfg.nodes, cfg.nodes - 1
        labels_ = torch.randint(0, cfg.classes, (n,), generator=gen)
        centres = torch.randn(cfg.classes, cfg.feat, generator=gen)
        x_ = centres[labels_] + 0.5 * torch.randn(n, cfg.feat, generator=gen)
        x_[pad] = 0.0
        nbr_ = torch.randint(0, n - 1, (n, cfg.fanout), generator=gen)
        valid_ = torch.rand(n, cfg.fanout, generator=gen) < 0.7
        valid_[1] = False                        # a node with no sampled neighbour
        valid_[pad] = False
        nbr_ = torch.where(valid_, nbr_, torch.full_like(nbr_, pad))
        train_ = torch.rand(n, generator=gen) < 0.6
        train_[0], train_[pad] = True, False
        return {"x": x_, "nbr": nbr_, "valid": valid_, "labels": labels_, "train": train_}

    return md.Model(g, loss, g.params(), make_feeds, cfg)


REF_INPUTS = ("x", "nbr", "valid", "labels", "train")


def reference_loss(cfg: Config, p: dict, x, nbr, valid, labels, train):
    """The same model in plain torch (a row index for the gather, masked_fill for the max)."""
    def layer(h, w):
        rows = h[nbr]                                            # [nodes, fanout, f]
        m = valid[..., None].to(h.dtype)
        count = m.sum(1)
        mean = (rows * m).sum(1) / count.clamp(min=1.0)
        top = rows.masked_fill(~valid[..., None], float("-inf")).amax(1)
        top = torch.where(count > 0, top, torch.zeros_like(top))
        return torch.cat([h, mean, top], -1) @ w

    h = torch.relu(layer(x, p["w1"]))
    h = h * torch.rsqrt((h * h).sum(-1, keepdim=True) + 1e-6)
    ce = torch.nn.functional.cross_entropy(layer(h, p["w2"]), labels, reduction="none")
    keep = train.to(ce.dtype)
    return (ce * keep).sum() / keep.sum()
