"""RetinaNet-lite (Lin et al. 2017): a tiny conv backbone, an FPN, class and box heads shared over the
levels, a sigmoid focal loss over every anchor and a smooth-L1 box loss on the positive ones.

Dims:
  batch  images     height, width  a level's grid (16, 8, 4, 2: the same names, another size each level)
  rgb    input channels   c1, c2, c3  the backbone's channels   fpn  the pyramid's channels
  kh, kw  conv taps        anchors  anchors per cell   classes  object classes   box  (dx, dy, dw, dh)
  fpn_out  a 3x3 conv's output channels, renamed back to fpn

    image -> conv+pool -> C1 (8) -> conv+pool -> C2 (4) -> conv+pool -> C3 (2)
    P3 = lat3(C3); P2 = lat2(C2) + up(P3); P1 = lat1(C1) + up(P2); P_l = conv3x3_l(P_l)
    per level: cls = head_cls(relu(conv_c(P))), box = head_box(relu(conv_b(P)))  (one set of weights)
    loss = (sum focal(cls, target) + sum_pos smoothL1(box, box_target)) / (1 + num_pos)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import meshdsl as md

TAPS = {"height": "kh", "width": "kw"}
ALPHA, GAMMA, BETA = 0.25, 2.0, 1.0 / 9


@dataclass(frozen=True)
class Config:
    batch: int = 8
    image: int = 32
    c1: int = 16
    c2: int = 24
    c3: int = 32
    fpn: int = 16
    anchors: int = 3
    classes: int = 4

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=4, image=16, c1=4, c2=6, c3=8, fpn=4, anchors=2, classes=3)


def conv3(x, w, c_out):
    """A 3x3 "same" conv whose output channel dim ``c_out`` is named as given."""
    return md.conv(x, w, TAPS, padding="same")


def focal(logits, t):
    """Sigmoid focal loss per anchor and class (torchvision's sigmoid_focal_loss, reduction none)."""
    p = md.sigmoid(logits)
    ce = md.softplus(logits) - logits * t                  # BCE with logits, stable
    p_t = p * t + (1 - p) * (1 - t)
    alpha_t = ALPHA * t + (1 - ALPHA) * (1 - t)
    return alpha_t * (1 - p_t) ** GAMMA * ce


def smooth_l1(d):
    a = abs(d)
    return md.where(md.less(a, BETA), 0.5 * a * a / BETA, a - 0.5 * BETA)


def build(cfg: Config = Config()) -> md.Model:
    d = lambda name, n: md.Dim(name, n)
    batch, rgb = d("batch", cfg.batch), d("rgb", 3)
    kh, kw = d("kh", 3), d("kw", 3)
    c1, c2, c3, fpn, fpn_out = d("c1", cfg.c1), d("c2", cfg.c2), d("c3", cfg.c3), d("fpn", cfg.fpn), d("fpn_out", cfg.fpn)
    anchors, classes, box = d("anchors", cfg.anchors), d("classes", cfg.classes), d("box", 4)
    sizes = [cfg.image // 2, cfg.image // 4, cfg.image // 8]
    with md.Graph("retinanet") as g:
        image = md.input("image", [batch, d("height", cfg.image), d("width", cfg.image), rgb])
        targets = [(md.input(f"cls_t{i}", [batch, d("height", s), d("width", s), anchors, classes]),
                    md.input(f"box_t{i}", [batch, d("height", s), d("width", s), anchors, box]),
                    md.input(f"pos{i}", [batch, d("height", s), d("width", s), anchors]))
                   for i, s in enumerate(sizes)]
        w_b1, w_b2, w_b3 = (md.param(f"w_b{i + 1}", [kh, kw, cin, cout], fan_out=[cout.name])
                            for i, (cin, cout) in enumerate([(rgb, c1), (c1, c2), (c2, c3)]))
        lat = [md.param(f"lat{i + 1}", [c, fpn], fan_out=["fpn"]) for i, c in enumerate([c1, c2, c3])]
        smooth = [md.param(f"smooth{i + 1}", [kh, kw, fpn, fpn_out], fan_out=["fpn_out"]) for i in range(3)]
        w_cls_t = md.param("w_cls_tower", [kh, kw, fpn, fpn_out], fan_out=["fpn_out"])
        w_box_t = md.param("w_box_tower", [kh, kw, fpn, fpn_out], fan_out=["fpn_out"])
        w_cls = md.param("w_cls", [kh, kw, fpn, anchors, classes], fan_out=["anchors", "classes"])
        b_cls = md.param("b_cls", [classes], init=-2.0)          # the paper's prior-probability bias
        w_box = md.param("w_box", [kh, kw, fpn, anchors, box], fan_out=["anchors", "box"])

        pool = lambda x: md.max_pool(x, {"height": 2, "width": 2})
        f1 = pool(md.relu(conv3(image, w_b1, "c1")))
        f2 = pool(md.relu(conv3(f1, w_b2, "c2")))
        f3 = pool(md.relu(conv3(f2, w_b3, "c3")))
        lateral = [md.einsum(f"batch height width {c}, {c} fpn -> batch height width fpn", f, w)
                   for f, c, w in zip([f1, f2, f3], ["c1", "c2", "c3"], lat)]
        p3 = lateral[2]
        p2 = lateral[1] + md.upsample(p3, {"height": 2, "width": 2})
        p1 = lateral[0] + md.upsample(p2, {"height": 2, "width": 2})
        levels = [md.rename(conv3(p, w, "fpn_out"), fpn_out="fpn") for p, w in zip([p1, p2, p3], smooth)]

        cls_sum, box_sum, num_pos = 0.0, 0.0, 1.0
        for p, (cls_t, box_t, pos) in zip(levels, targets):
            cls = md.conv(md.rename(md.relu(conv3(p, w_cls_t, "fpn_out")), fpn_out="fpn"), w_cls, TAPS) + b_cls
            bx = md.conv(md.rename(md.relu(conv3(p, w_box_t, "fpn_out")), fpn_out="fpn"), w_box, TAPS)
            cls_sum = cls_sum + md.reduce_sum(focal(cls, cls_t))
            box_sum = box_sum + md.reduce_sum(md.reduce_sum(smooth_l1(bx - box_t), "box") * pos)
            num_pos = num_pos + md.reduce_sum(pos)
        loss = (cls_sum + box_sum) / num_pos

    def feeds(seed: int = 0) -> dict:
        gen = torch.Generator().manual_seed(seed)
        out = {"image": torch.randn(cfg.batch, cfg.image, cfg.image, 3, generator=gen)}
        for i, s in enumerate(sizes):
            pos = (torch.rand(cfg.batch, s, s, cfg.anchors, generator=gen) < 0.2).float()
            label = torch.randint(0, cfg.classes, (cfg.batch, s, s, cfg.anchors), generator=gen)
            out[f"cls_t{i}"] = torch.nn.functional.one_hot(label, cfg.classes).float() * pos[..., None]
            out[f"box_t{i}"] = torch.randn(cfg.batch, s, s, cfg.anchors, 4, generator=gen) * 0.3
            out[f"pos{i}"] = pos
        return out

    return md.Model(g, loss, g.params(), feeds, cfg)


REF_INPUTS = ("image", "cls_t0", "box_t0", "pos0", "cls_t1", "box_t1", "pos1", "cls_t2", "box_t2", "pos2")


def reference_loss(cfg: Config, p: dict, image, *targets):
    """The same model in plain torch, NCHW: F.conv2d, max_pool2d, nearest F.interpolate,
    binary_cross_entropy_with_logits for the focal loss and F.smooth_l1_loss."""
    F = torch.nn.functional
    conv = lambda x, w: F.conv2d(x, w.flatten(3).permute(3, 2, 0, 1), padding=1)   # [kh, kw, in, out...]
    nhwc = lambda x, *tail: x.permute(0, 2, 3, 1).reshape(*x.shape[:1], *x.shape[2:], *tail)
    x, feats = image.permute(0, 3, 1, 2), []
    for i in range(3):
        x = F.max_pool2d(F.relu(conv(x, p[f"w_b{i + 1}"])), 2)
        feats.append(x)
    lat = [torch.einsum("bchw,cf->bfhw", f, p[f"lat{i + 1}"]) for i, f in enumerate(feats)]
    p3 = lat[2]
    p2 = lat[1] + F.interpolate(p3, scale_factor=2, mode="nearest")
    p1 = lat[0] + F.interpolate(p2, scale_factor=2, mode="nearest")
    cls_sum = box_sum = 0.0
    num_pos = 1.0
    for i, lv in enumerate([p1, p2, p3]):
        lv = conv(lv, p[f"smooth{i + 1}"])
        cls_t, box_t, pos = targets[3 * i: 3 * i + 3]
        cls = nhwc(conv(F.relu(conv(lv, p["w_cls_tower"])), p["w_cls"]), cfg.anchors, cfg.classes) + p["b_cls"]
        bx = nhwc(conv(F.relu(conv(lv, p["w_box_tower"])), p["w_box"]), cfg.anchors, 4)
        prob = torch.sigmoid(cls)
        ce = F.binary_cross_entropy_with_logits(cls, cls_t, reduction="none")
        p_t = prob * cls_t + (1 - prob) * (1 - cls_t)
        cls_sum = cls_sum + ((ALPHA * cls_t + (1 - ALPHA) * (1 - cls_t)) * (1 - p_t) ** GAMMA * ce).sum()
        box_sum = box_sum + (F.smooth_l1_loss(bx, box_t, reduction="none", beta=BETA).sum(-1) * pos).sum()
        num_pos = num_pos + pos.sum()
    return (cls_sum + box_sum) / num_pos
