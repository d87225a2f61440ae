"""A Point Transformer for per-point segmentation, written from the README and docs/ alone (a held-out model).

Point clouds ``[cloud, point, xyz]`` with input features ``[cloud, point, fin]`` and a label per
point. The ``k`` nearest neighbours of each point: ``md.top_k`` over the negative squared
distances to every other point (``pt2``, the points renamed), computed once from the positions
(no params). Each layer of a ``md.repeat`` over ``layer``: q, k and v by einsums; each point's
neighbours' k and v, and their positions, fetched by the neighbour ids; a relative position
encoding ``delta = MLP(p_i - p_j)``; vector attention ``softmax_nbr(MLP(q_i - k_j + delta))`` (one
weight per neighbour and channel) applied to ``v_j + delta`` and summed over the neighbours; a
linear output and the residual. Fetching neighbours is written two ways: ``form="onehot"`` is the
per-sample gather of the docs, an einsum with ``md.one_hot(ids, pt2)``; ``form="gather"`` is
``md.gather`` from one table of every cloud's points (``(cloud pt2)`` merged by ``md.rearrange``,
ids offset by ``cloud * points``). Head: a linear layer to ``classes``, the per-point cross
entropy.

Legend: c = cloud, p = point, p2 = pt2 (the other points), n = nbr, f = feat, x = xyz.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    clouds: int = 8
    points: int = 256
    fin: int = 6
    feat: int = 64
    k: int = 16
    layers: int = 4
    classes: int = 13
    form: str = "onehot"    # or "gather"
    remat: str = "none"

    @classmethod
    def tiny(cls) -> "Config":
        return cls(clouds=2, points=12, fin=3, feat=4, k=4, layers=2, classes=3)


def build(cfg: Config = Config()) -> md.Model:
    cloud, point, pt2, xyz = md.Dim("cloud", cfg.clouds), md.Dim("point", cfg.points), md.Dim("pt2", cfg.points), md.Dim("xyz", 3)
    fin, feat, f2, layer = md.Dim("fin", cfg.fin), md.Dim("feat", cfg.feat), md.Dim("f2", cfg.feat), md.Dim("layer", cfg.layers)
    classes = md.Dim("classes", cfg.classes)
    with md.Graph("heldout_pointtf") as g:
        pos = md.input("pos", [cloud, point, xyz])
        x_in = md.input("x_in", [cloud, point, fin])
        labels = md.input("labels", [cloud, point], dtype=torch.int64)
        p = {"embed": md.param("embed", [fin, feat], fan_out=["feat"]),
             "head": md.param("head", [feat, classes], fan_out=["classes"])}
        stack = {n: md.param(n, [layer, feat, f2], fan_out=["layer", "f2"])
                 for n in ("wq", "wk", "wv", "wo", "gamma1", "gamma2", "delta2")}
        stack["delta1"] = md.param("delta1", [layer, xyz, f2], fan_out=["layer", "f2"])

        pos2 = md.rename(pos, point="pt2")
        d2 = md.reduce_sum((pos - pos2) ** 2, "xyz")                           # [cloud, point, pt2]
        _, ids = md.top_k(-d2, "pt2", cfg.k, new_dim="nbr")                     # [cloud, point, nbr]
        if cfg.form == "onehot":
            sel = md.one_hot(ids, pt2)                                          # [cloud, point, nbr, pt2]

            def neighbours(t: md.Tensor) -> md.Tensor:                        # t [cloud, point, ch]
                ch = [n for n in t.shape.names if n not in ("cloud", "point")][0]
                t2 = md.rename(t, point="pt2")
                return md.einsum(f"cloud point nbr pt2, cloud pt2 {ch} -> cloud point nbr {ch}", sel, t2)
        else:
            flat_ids = ids + md.arange(cloud) * cfg.points                        # [cloud, point, nbr]

            def neighbours(t: md.Tensor) -> md.Tensor:
                ch = [n for n in t.shape.names if n not in ("cloud", "point")][0]
                table = md.rearrange(md.rename(t, point="pt2"), f"cloud pt2 {ch} -> (cloud pt2) {ch}")
                return md.gather(table, flat_ids, "cloud_pt2")                 # [cloud, point, nbr, ch]
        rel = pos - neighbours(pos)                                             # [cloud, point, nbr, xyz]

        def layer_block(x: md.Tensor, q: dict) -> md.Tensor:
            def lin(t, w, a="feat", b="f2"):
                names = " ".join(n for n in t.shape.names if n != a)
                return md.rename(md.einsum(f"{names} {a}, {a} {b} -> {names} {b}", t, w), {b: "feat"})
            qi, kj, vj = lin(x, q["wq"]), neighbours(lin(x, q["wk"])), neighbours(lin(x, q["wv"]))
            delta = lin(md.relu(lin(rel, q["delta1"], "xyz")), q["delta2"])    # [cloud, point, nbr, feat]
            a = lin(md.relu(lin(qi - kj + delta, q["gamma1"])), q["gamma2"])
            att = md.softmax(a, "nbr")
            y = md.reduce_sum(att * (vj + delta), "nbr")                        # [cloud, point, feat]
            return x + lin(md.relu(y), q["wo"])

        h = md.einsum("cloud point fin, fin feat -> cloud point feat", x_in, p["embed"])
        h = md.repeat(layer_block, h, stack, "layer", remat=cfg.remat)
        logits = md.einsum("cloud point feat, feat classes -> cloud point classes", h, p["head"])
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        pos = torch.rand(cfg.clouds, cfg.points, 3, generator=gen)
        x = torch.cat([pos, torch.randn(cfg.clouds, cfg.points, cfg.fin - 3, generator=gen)], -1)
        labels = (pos[..., 0] * cfg.classes).long().clamp(max=cfg.classes - 1)   # slabs along x
        return {"pos": pos, "x_in": x, "labels": labels}

    return md.Model(g, loss, {**p, **stack}, feeds, cfg)
