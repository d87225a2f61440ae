"""An FCOS-style dense detection head, written from the README and docs/ alone (a held-out model).

Images ``[batch, height, width, channels]`` go through a stride-2 3x3 conv to ``d_model`` with a
ReLU (the "backbone"), then a head tower under ``md.repeat`` over ``layer``: a 3x3 conv
(``d_model -> d_out``, renamed back), a LayerNorm over the channels (FCOS uses GroupNorm; the
docs offer per-example norms) and a ReLU, residual. Every cell of the feature map predicts an
objectness logit (an einsum to no channel) and its box as the distances to the four sides,
``exp`` of an einsum to ``box`` (4: left, top, right, bottom, positive).

Targets per cell: ``obj`` (1 where the cell lies in an object), ``target_box`` (its 4 distances).
The loss: the objectness BCE with logits over every cell (a mean), plus, over the positive cells
only (masked by ``obj``, normalised by their count over the whole batch, a count of the inputs),
a GIoU loss ``1 - GIoU`` of the predicted and target boxes (intersection from the elementwise
minima of the distances, the enclosing box from the maxima), plus ``l1_weight`` times the L1 of
the log-distances.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    image: int = 32
    channels: int = 3
    d_model: int = 32
    layers: int = 4
    batch: int = 8
    l1_weight: float = 0.5
    box_weight: float = 1.0

    @classmethod
    def tiny(cls) -> "Config":
        return cls(image=12, channels=3, d_model=6, layers=2, batch=4)


def side(box: md.Tensor, i: int) -> md.Tensor:
    """Entry ``i`` of the ``box`` dim (0 left, 1 top, 2 right, 3 bottom), the dim dropped."""
    return md.squeeze(md.slice_(box, "box", i, i + 1), "box")


def build(cfg: Config = Config()) -> md.Model:
    cells = cfg.image // 2
    batch, height, width = md.Dim("batch", cfg.batch), md.Dim("height", cfg.image), md.Dim("width", cfg.image)
    channels, d_model = md.Dim("channels", cfg.channels), md.Dim("d_model", cfg.d_model)
    d_out = md.Dim("d_out", cfg.d_model)
    layer, kh, kw, box = md.Dim("layer", cfg.layers), md.Dim("kh", 3), md.Dim("kw", 3), md.Dim("box", 4)
    row, col = md.Dim("row", cells), md.Dim("col", cells)
    taps = {"row": "kh", "col": "kw"}
    with md.Graph("heldout_fcos") as g:
        images = md.input("images", [batch, height, width, channels])
        obj = md.input("obj", [batch, row, col])
        target_box = md.input("target_box", [batch, row, col, box])
        w_stem = md.param("w_stem", [kh, kw, channels, d_model], fan_out=["d_model"])
        tower = {
            "conv": md.param("conv", [layer, kh, kw, d_model, d_out], fan_out=["layer", "d_out"]),
            "ln": md.param("ln", [layer, d_out], init="ones"),
            "ln_b": md.param("ln_b", [layer, d_out], init="zeros"),
        }
        w_obj = md.param("w_obj", [d_model], scale=0.1)
        b_obj = md.param("b_obj", [], init=-1.0)
        w_box = md.param("w_box", [d_model, box], fan_out=["box"], scale=0.1)
        b_box = md.param("b_box", [box], init=0.5)

        def block(x: md.Tensor, p: dict) -> md.Tensor:
            h = md.conv(x, p["conv"], taps)
            h = md.relu(md.layer_norm(h, "d_out", p["ln"], p["ln_b"]))
            return x + md.rename(h, d_out="d_model")

        x = md.relu(md.conv(images, w_stem, {"height": "kh", "width": "kw"}, padding=(1, 1), stride=2))
        x = md.rename(x, height="row", width="col")
        x = md.repeat(block, x, tower, "layer")
        logit = md.einsum("batch row col d_model, d_model -> batch row col", x, w_obj) + b_obj
        log_dist = md.einsum("batch row col d_model, d_model box -> batch row col box", x, w_box) + b_box
        pred = md.exp(log_dist)

        # objectness: BCE with logits, stable form max(z, 0) - z * y + log(1 + exp(-|z|))
        bce = md.maximum(logit, 0.0) - logit * obj + md.log(1.0 + md.exp(-md.abs(logit)))
        obj_loss = md.reduce_mean(bce)

        # boxes on the positive cells: GIoU from the distances to the four sides
        pl, pt, pr, pb = (side(pred, i) for i in range(4))
        tl, tt, tr, tb = (side(target_box, i) for i in range(4))
        area_p, area_t = (pl + pr) * (pt + pb), (tl + tr) * (tt + tb)
        inter = (md.minimum(pl, tl) + md.minimum(pr, tr)) * (md.minimum(pt, tt) + md.minimum(pb, tb))
        union = area_p + area_t - inter
        enclose = (md.maximum(pl, tl) + md.maximum(pr, tr)) * (md.maximum(pt, tt) + md.maximum(pb, tb))
        giou = inter / union - (enclose - union) / enclose
        l1 = md.reduce_sum(md.abs(log_dist - md.log(target_box)), "box")
        positives = md.maximum(md.reduce_sum(obj), 1.0)                  # over the whole batch
        box_loss = md.reduce_sum(((1.0 - giou) + cfg.l1_weight * l1) * obj) / positives
        loss = obj_loss + cfg.box_weight * box_loss

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        imgs = torch.randn(cfg.batch, cfg.image, cfg.image, cfg.channels, generator=gen)
        o = (torch.rand(cfg.batch, cells, cells, generator=gen) < 0.3).float()
        tb = 0.2 + 2.0 * torch.rand(cfg.batch, cells, cells, 4, generator=gen)
        return {"images": imgs, "obj": o, "target_box": tb}

    return md.Model(g, loss, {"w_stem": w_stem, **tower, "w_obj": w_obj, "b_obj": b_obj, "w_box": w_box,
                              "b_box": b_box}, feeds, cfg,
                    outputs={"objectness": logit, "boxes": pred, "obj_loss": obj_loss, "box_loss": box_loss})
