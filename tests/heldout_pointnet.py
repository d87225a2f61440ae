"""PointNet classification of point clouds, written from the README and docs/ alone (a held-out model).

Clouds ``points [batch, points, xyz]`` (3 coordinates). An input transform net (T-net): a shared
per-point MLP (``xyz -> t_h1 -> t_h2``, ReLU: an einsum over the point's features, the same
weights for every point), a max pool over ``points``, a linear layer to a 3x3 matrix
``[batch, xyz, xyz_out]`` plus the identity (a constant); the points are multiplied by their
cloud's matrix. Then a shared per-point MLP to ``d_model``, a stack of residual per-point MLP
blocks under ``md.repeat`` over ``layer`` (LayerNorm, ``d_model -> d_ff -> d_model``, ReLU), a max
pool over the points (the global feature, invariant to their order), and a classifier head
(``d_model -> d_head -> classes``). The loss is the cross-entropy plus PointNet's
regulariser on the transform, ``reg * ||T T^T - I||^2`` averaged over the clouds.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    points: int = 256
    d_model: int = 64
    d_ff: int = 128
    t_h1: int = 32
    t_h2: int = 64
    d_head: int = 32
    layers: int = 2
    batch: int = 8
    classes: int = 8
    reg: float = 0.001

    @classmethod
    def tiny(cls) -> "Config":
        return cls(points=10, d_model=8, d_ff=12, t_h1=6, t_h2=8, d_head=6, layers=2, batch=4, classes=4, reg=0.1)


def build(cfg: Config = Config()) -> md.Model:
    batch, points = md.Dim("batch", cfg.batch), md.Dim("points", cfg.points)
    xyz, xyz_out = md.Dim("xyz", 3), md.Dim("xyz_out", 3)
    t_h1, t_h2 = md.Dim("t_h1", cfg.t_h1), md.Dim("t_h2", cfg.t_h2)
    d_model, d_ff, d_head = md.Dim("d_model", cfg.d_model), md.Dim("d_ff", cfg.d_ff), md.Dim("d_head", cfg.d_head)
    classes, layer = md.Dim("classes", cfg.classes), md.Dim("layer", cfg.layers)
    with md.Graph("heldout_pointnet") as g:
        cloud = md.input("points", [batch, points, xyz])
        labels = md.input("labels", [batch], dtype=torch.int64)
        eye = md.constant(torch.eye(3), [xyz, xyz_out], name="eye")
        p = {
            "t_w1": md.param("t_w1", [xyz, t_h1], fan_out=["t_h1"]),
            "t_b1": md.param("t_b1", [t_h1], init="zeros"),
            "t_w2": md.param("t_w2", [t_h1, t_h2], fan_out=["t_h2"]),
            "t_w3": md.param("t_w3", [t_h2, xyz, xyz_out], fan_out=["xyz", "xyz_out"], scale=0.01),
            "w_in": md.param("w_in", [xyz, d_model], fan_out=["d_model"]),
            "b_in": md.param("b_in", [d_model], init="zeros"),
        }
        blocks = {
            "ln": md.param("ln", [layer, d_model], init="ones"),
            "ln_b": md.param("ln_b", [layer, d_model], init="zeros"),
            "w_up": md.param("w_up", [layer, d_model, d_ff], fan_out=["layer", "d_ff"]),
            "b_up": md.param("b_up", [layer, d_ff], init="zeros"),
            "w_down": md.param("w_down", [layer, d_ff, d_model], fan_out=["layer", "d_model"]),
        }
        head = {
            "w_h": md.param("w_h", [d_model, d_head], fan_out=["d_head"]),
            "b_h": md.param("b_h", [d_head], init="zeros"),
            "w_cls": md.param("w_cls", [d_head, classes], fan_out=["classes"]),
        }

        # the T-net: a 3x3 transform per cloud, near the identity
        t = md.relu(md.einsum("batch points xyz, xyz t_h1 -> batch points t_h1", cloud, p["t_w1"]) + p["t_b1"])
        t = md.relu(md.einsum("batch points t_h1, t_h1 t_h2 -> batch points t_h2", t, p["t_w2"]))
        g_t = md.reduce_max(t, "points")
        trans = md.einsum("batch t_h2, t_h2 xyz xyz_out -> batch xyz xyz_out", g_t, p["t_w3"]) + eye
        moved = md.rename(md.einsum("batch points xyz, batch xyz xyz_out -> batch points xyz_out", cloud, trans),
                          xyz_out="xyz")

        def block(h: md.Tensor, q: dict) -> md.Tensor:
            a = md.layer_norm(h, "d_model", q["ln"], q["ln_b"])
            a = md.relu(md.einsum("batch points d_model, d_model d_ff -> batch points d_ff", a, q["w_up"]) + q["b_up"])
            return h + md.einsum("batch points d_ff, d_ff d_model -> batch points d_model", a, q["w_down"])

        h = md.relu(md.einsum("batch points xyz, xyz d_model -> batch points d_model", moved, p["w_in"]) + p["b_in"])
        h = md.repeat(block, h, blocks, "layer")
        glob = md.reduce_max(h, "points")
        z = md.relu(md.einsum("batch d_model, d_model d_head -> batch d_head", glob, head["w_h"]) + head["b_h"])
        logits = md.einsum("batch d_head, d_head classes -> batch classes", z, head["w_cls"])
        ce = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))
        gram = md.einsum("batch xyz xyz_out, batch xyz2 xyz_out -> batch xyz xyz2", trans,
                         md.rename(trans, xyz="xyz2"))
        off = gram - md.rename(eye, xyz_out="xyz2")
        loss = ce + cfg.reg * md.reduce_mean(md.reduce_sum(off * off, ["xyz", "xyz2"]))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        labels = torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)
        # each class a different stretch of a random cloud, so the labels are learnable
        stretch = 1.0 + torch.nn.functional.one_hot(labels % 3, 3).float() * (labels // 3 + 1).float()[:, None]
        pts = torch.randn(cfg.batch, cfg.points, 3, generator=gen) * stretch[:, None, :]
        return {"points": pts, "labels": labels}

    return md.Model(g, loss, {**p, **blocks, **head}, feeds, cfg, outputs={"logits": logits, "transform": trans})
