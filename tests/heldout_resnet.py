"""A ResNet with batch norm, written from the README and docs/ alone (a held-out model).

Images ``[batch, height, width, channels]`` go through a 3x3 stem conv (``md.conv``, channels to
``d_model``), batch norm and a ReLU; a stack of basic residual blocks under ``md.repeat`` over
``layer`` (3x3 conv ``d_model -> d_mid``, BN, ReLU, 3x3 conv ``d_mid -> d_model``, BN, the
residual add, ReLU); a strided 3x3 conv (stride 2) to ``d2`` with BN and ReLU; global mean pooling
over the positions and a linear head (cross-entropy over ``classes``).

Batch norm is train-mode: the docs offer no running statistics, so each BN normalises by the
mean and the (biased) variance of its input over ``batch``, ``height`` and ``width`` per channel,
then scales and shifts by ``gamma``/``beta``. These are whole-batch statistics made from params,
which the docs say do not pipeline under micro-batches (each micro-batch's backward would need the
forward of them all); ``bn_stats=False`` normalises each example over its own positions only
(instance norm) so that the stack pipelines.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    image: int = 32
    channels: int = 3
    d_model: int = 32
    d_mid: int = 32
    d2: int = 64
    layers: int = 4
    batch: int = 16
    classes: int = 10
    eps: float = 1e-5
    bn_stats: bool = True       # batch statistics (train-mode BN); False: per example (instance norm)

    @classmethod
    def tiny(cls) -> "Config":
        return cls(image=8, channels=3, d_model=6, d_mid=4, d2=8, layers=2, batch=6, classes=5)


def build(cfg: Config = Config()) -> md.Model:
    batch, height, width = md.Dim("batch", cfg.batch), md.Dim("height", cfg.image), md.Dim("width", cfg.image)
    channels, d_model = md.Dim("channels", cfg.channels), md.Dim("d_model", cfg.d_model)
    d_mid = md.Dim("d_mid", cfg.d_mid)
    d2, classes, layer = md.Dim("d2", cfg.d2), md.Dim("classes", cfg.classes), md.Dim("layer", cfg.layers)
    kh, kw = md.Dim("kh", 3), md.Dim("kw", 3)
    taps = {"height": "kh", "width": "kw"}
    stat_dims = ["batch", "height", "width"] if cfg.bn_stats else ["height", "width"]

    def batch_norm(x: md.Tensor, gamma: md.Tensor, beta: md.Tensor) -> md.Tensor:
        mean = md.reduce_mean(x, stat_dims)
        centred = x - mean
        var = md.reduce_mean(centred * centred, stat_dims)
        return centred * md.rsqrt(var + cfg.eps) * gamma + beta

    with md.Graph("heldout_resnet") as g:
        images = md.input("images", [batch, height, width, channels])
        labels = md.input("labels", [batch], dtype=torch.int64)
        w_stem = md.param("w_stem", [kh, kw, channels, d_model], fan_out=[d_model.name])
        stem_g, stem_b = md.param("stem_g", [d_model], init="ones"), md.param("stem_b", [d_model], init="zeros")
        blocks = {
            "conv1": md.param("conv1", [layer, kh, kw, d_model, d_mid], fan_out=["layer", "d_mid"]),
            "bn1_g": md.param("bn1_g", [layer, d_mid], init="ones"),
            "bn1_b": md.param("bn1_b", [layer, d_mid], init="zeros"),
            "conv2": md.param("conv2", [layer, kh, kw, d_mid, d_model], fan_out=["layer", "d_model"]),
            "bn2_g": md.param("bn2_g", [layer, d_model], init=0.5),
            "bn2_b": md.param("bn2_b", [layer, d_model], init="zeros"),
        }
        w_down = md.param("w_down", [kh, kw, d_model, d2], fan_out=[d2.name])
        down_g, down_b = md.param("down_g", [d2], init="ones"), md.param("down_b", [d2], init="zeros")
        w_head = md.param("w_head", [d2, classes], fan_out=[classes.name])
        b_head = md.param("b_head", [classes], init="zeros")

        def block(x: md.Tensor, p: dict) -> md.Tensor:
            h = md.relu(batch_norm(md.conv(x, p["conv1"], taps), p["bn1_g"], p["bn1_b"]))
            h = batch_norm(md.conv(h, p["conv2"], taps), p["bn2_g"], p["bn2_b"])
            return md.relu(x + h)

        stem = md.relu(batch_norm(md.conv(images, w_stem, taps), stem_g, stem_b))
        x = md.repeat(block, stem, blocks, "layer")
        x = md.relu(batch_norm(md.conv(x, w_down, taps, padding=(1, 1), stride=2), down_g, down_b))
        pooled = md.reduce_mean(x, ["height", "width"])
        logits = md.einsum("batch d2, d2 classes -> batch classes", pooled, w_head) + b_head
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "classes"))

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return {"images": torch.randn(cfg.batch, cfg.image, cfg.image, cfg.channels, generator=gen),
                "labels": torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)}

    params = {"w_stem": w_stem, "stem_g": stem_g, "stem_b": stem_b, **blocks, "w_down": w_down,
              "down_g": down_g, "down_b": down_b, "w_head": w_head, "b_head": b_head}
    return md.Model(g, loss, params, feeds, cfg, outputs={"logits": logits, "stem": stem})
