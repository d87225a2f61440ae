"""Multi-task learning with homoscedastic uncertainty weighting (Kendall, Gal and Cipolla 2018),
written from the README and docs/ alone (a held-out model).

Dims: ``batch``, ``d_in``, ``d_model``, ``d_ff``, ``layer``, ``classes``, ``tasks`` (2). A shared
encoder (an input projection, then pre-norm residual MLP blocks under ``md.repeat`` over
``layer``) feeds a classification head (cross entropy over ``classes``) and a regression head
(squared error). Each task's loss is weighted by a learned log-variance ``s = log_vars[task]``:
``exp(-s_cls) * CE + s_cls + 0.5 * exp(-s_reg) * MSE + 0.5 * s_reg``, so the balance between
the tasks is trained with the rest.
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 32
    d_in: int = 16
    d_model: int = 64
    d_ff: int = 256
    layers: int = 2
    classes: int = 10

    @classmethod
    def tiny(cls) -> "Config":
        return cls(batch=8, d_in=5, d_model=8, d_ff=12, layers=4, classes=3)


def _block(h, p):
    m = md.gelu(md.einsum("batch d_model, d_model d_ff -> batch d_ff", md.layer_norm(h, "d_model", p["ln"]), p["w1"]))
    return h + md.einsum("batch d_ff, d_ff d_model -> batch d_model", m, p["w2"])


def build(cfg: Config = Config()) -> md.Model:
    batch, d_in, d_model = md.Dim("batch", cfg.batch), md.Dim("d_in", cfg.d_in), md.Dim("d_model", cfg.d_model)
    d_ff, layer, classes = md.Dim("d_ff", cfg.d_ff), md.Dim("layer", cfg.layers), md.Dim("classes", cfg.classes)
    tasks = md.Dim("tasks", 2)
    with md.Graph("heldout_multitask") as g:
        x = md.input("x", [batch, d_in])
        label = md.input("label", [batch], dtype=torch.int64)
        target = md.input("target", [batch])
        w_in = md.param("w_in", [d_in, d_model], fan_out=["d_model"])
        blocks = {"ln": md.param("ln", [layer, d_model], init="ones"),
                  "w1": md.param("w1", [layer, d_model, d_ff], fan_out=["layer", "d_ff"]),
                  "w2": md.param("w2", [layer, d_ff, d_model], fan_out=["layer", "d_model"])}
        lnf = md.param("lnf", [d_model], init="ones")
        w_cls = md.param("w_cls", [d_model, classes], fan_out=["classes"])
        w_reg = md.param("w_reg", [d_model])
        log_vars = md.param("log_vars", [tasks], init="zeros")

        h = md.repeat(_block, md.einsum("batch d_in, d_in d_model -> batch d_model", x, w_in), blocks, "layer")
        h = md.layer_norm(h, "d_model", lnf)
        logits = md.einsum("batch d_model, d_model classes -> batch classes", h, w_cls)
        pred = md.einsum("batch d_model, d_model -> batch", h, w_reg)
        ce = md.reduce_mean(md.cross_entropy(logits, label, "classes"))
        mse = md.reduce_mean((pred - target) ** 2)
        s_cls, s_reg = (md.squeeze(md.slice_(log_vars, "tasks", i, i + 1), "tasks") for i in (0, 1))
        loss = md.exp(-s_cls) * ce + s_cls + 0.5 * md.exp(-s_reg) * mse + 0.5 * s_reg
        accuracy = md.reduce_mean(md.cast(md.greater_equal(
            md.reduce_sum(logits * md.one_hot(label, classes), "classes"), md.reduce_max(logits, "classes")),
            torch.float32))
    params = {"w_in": w_in, "lnf": lnf, "w_cls": w_cls, "w_reg": w_reg, "log_vars": log_vars, **blocks}

    def batches(seed: int, rows: slice | None = None) -> dict[str, torch.Tensor]:
        """Class = the argmax of a fixed projection of x; target = a noisy smooth function of x."""
        idx = range(cfg.batch)[rows or slice(None)]
        proj = torch.randn(cfg.d_in, cfg.classes, generator=torch.Generator().manual_seed(99))
        xs = [torch.randn(cfg.d_in, generator=md.row_generator(seed, r)) for r in idx]
        x = torch.stack(xs) if xs else torch.zeros(0, cfg.d_in)
        noise = torch.stack([torch.randn((), generator=md.row_generator(seed + 7, r)) for r in idx]) if xs \
            else torch.zeros(0)
        return {"x": x, "label": (x @ proj).argmax(-1), "target": torch.sin(x[:, 0]) + x[:, 1] ** 2 + 0.3 * noise}

    return md.Model(g, loss, params, batches=batches, config=cfg, metrics={"accuracy": accuracy, "mse": mse},
                    outputs={"ce": ce, "mse": mse})
