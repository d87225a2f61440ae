"""Held-out PointNet++-lite (round 19a), written from the guides: two set-abstraction layers, each
with fixed strided centroids (every `stride`-th point: no farthest-point sampling), a ball query as
a mask over the pairwise squared distances (md.where: neighbours outside the radius get -1e9 before
the max), a shared MLP over [relative xyz, point features] with BN over (batch, centers, points),
max pooling over the neighbours; then a global max, a linear head and cross-entropy.

Legend: xyz_bpk [batch, points, coord]; f_bpc [batch, points, feat]; h_bcpn [batch, centers, points, hidden].
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 8
    points: int = 64
    feat: int = 4
    hidden1: int = 16
    hidden2: int = 32
    stride1: int = 4
    stride2: int = 4
    radius1: float = 0.6
    radius2: float = 1.0
    classes: int = 5

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, points=12, feat=3, hidden1=5, hidden2=6, stride1=2, stride2=2, classes=3)


def _centers(x, stride):
    """Every `stride`-th row along `points`, as dim `centers`."""
    x = md.rearrange(x, "... (centers stride) -> ... centers stride", stride=stride)
    return md.squeeze(md.slice_(x, "stride", 0, 1), "stride")


def set_abstraction(xyz, feats, name, hidden, stride, radius):
    """(center xyz [batch, centers, coord], pooled [batch, centers, hidden])."""
    c_xyz = _centers(md.transpose(xyz, ["batch", "coord", "points"]), stride)      # [batch, coord, centers]
    rel = xyz - c_xyz                                                              # [batch, points, coord, centers]
    d2 = md.reduce_sum(rel * rel, "coord")                                         # [batch, points, centers]
    near = md.less(d2, radius * radius)
    f_in = feats.shape["feat"]
    H = md.Dim("hidden", hidden)
    w_xyz = md.param(f"{name}_wxyz", [md.Dim("coord", 3), H], fan_out=["hidden"])
    w_f = md.param(f"{name}_wf", [f_in, H], fan_out=["hidden"])
    h = md.einsum("... coord, coord hidden -> ... hidden", rel, w_xyz) \
        + md.einsum("... feat, feat hidden -> ... hidden", feats, w_f)              # [batch, points, centers, hidden]
    g, b = md.param(f"{name}_g", [H], scale=0.0), md.param(f"{name}_b", [H], scale=0.0)
    h = md.relu(md.batch_norm(h, ["batch", "centers", "points"], g + 1.0, b))
    h = md.reduce_max(md.where(near, h, -1e9), "points")                            # [batch, centers, hidden]
    return md.transpose(c_xyz, ["batch", "centers", "coord"]), h


def build(cfg: Config = Config()) -> md.Model:
    B, N, K = md.Dim("batch", cfg.batch), md.Dim("points", cfg.points), md.Dim("coord", 3)
    Fd = md.Dim("feat", cfg.feat)
    with md.Graph("pointnet2") as g:
        xyz = md.input("xyz", [B, N, K])
        feats = md.input("feats", [B, N, Fd])
        labels = md.input("labels", [B], dtype=torch.int64)
        c1, h1 = set_abstraction(xyz, feats, "sa1", cfg.hidden1, cfg.stride1, cfg.radius1)
        # the centres become the next layer's points, their pooled features its point features
        xyz2 = md.rename(c1, centers="points")
        f2 = md.rename(h1, centers="points", hidden="feat")
        _, h2 = set_abstraction(xyz2, f2, "sa2", cfg.hidden2, cfg.stride2, cfg.radius2)
        pooled = md.reduce_max(h2, "centers")
        head = md.param("head", [h2.shape["hidden"], md.Dim("classes", cfg.classes)], fan_out=["classes"])
        logits = md.einsum("... hidden, hidden classes -> ... classes", pooled, head)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))

    def feeds(seed: int = 0) -> dict:
        gen = torch.Generator().manual_seed(seed)
        labels = torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)
        xyz = torch.rand(cfg.batch, cfg.points, 3, generator=gen) * (1.0 + labels.float()[:, None, None] * 0.3)
        return {"xyz": xyz, "feats": torch.randn(cfg.batch, cfg.points, cfg.feat, generator=gen), "labels": labels}

    return md.Model(g, loss, g.params(), feeds, cfg)
