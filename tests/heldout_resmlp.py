"""A residual MLP regressor whose examples are ``examples`` and whose layer stack is ``depth``,
written from the README and docs/ alone (a held-out model: the user's own dim names).

Dims: ``examples`` (rows of the batch), ``features`` (the inputs), ``width`` (the residual
stream), ``expand`` (each block's hidden units), ``targets`` (the outputs), ``depth`` (the
blocks under ``md.repeat``). Each block: RMSNorm, ``width -> expand`` with SiLU, ``expand ->
width``, the residual. The loss is the mean squared error over examples and targets. The
model makes its own data by rows (``batches(seed, rows)``: each data rank builds its own).
"""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    examples: int = 64
    features: int = 32
    width: int = 128
    expand: int = 512
    targets: int = 8
    depth: int = 4

    @classmethod
    def tiny(cls) -> "Config":
        return cls(examples=8, features=6, width=8, expand=16, targets=3, depth=4)


def build(cfg: Config = Config()) -> md.Model:
    E, Fe, W = md.Dim("examples", cfg.examples), md.Dim("features", cfg.features), md.Dim("width", cfg.width)
    X, T, D = md.Dim("expand", cfg.expand), md.Dim("targets", cfg.targets), md.Dim("depth", cfg.depth)
    with md.Graph("resmlp") as g:
        x_in = md.input("x", [E, Fe])
        y = md.input("y", [E, T])
        w_in = md.param("w_in", [Fe, W], fan_out=["width"])
        stack = {
            "norm": md.param("norm", [D, W], init="ones"),
            "up": md.param("up", [D, W, X], fan_out=["depth", "expand"]),
            "down": md.param("down", [D, X, W], fan_out=["depth", "width"], scale=0.5),
        }
        w_out = md.param("w_out", [W, T], fan_out=["targets"])

        def block(h, p):
            a = md.silu(md.einsum("examples width, width expand -> examples expand", md.rms_norm(h, "width", p["norm"]), p["up"]))
            return h + md.einsum("examples expand, expand width -> examples width", a, p["down"])

        h = md.einsum("examples features, features width -> examples width", x_in, w_in)
        h = md.repeat(block, h, stack, "depth")
        pred = md.einsum("examples width, width targets -> examples targets", h, w_out)
        loss = md.reduce_mean((pred - y) ** 2)

    def batches(seed: int, rows: slice | None = None) -> dict[str, torch.Tensor]:
        """Rows ``rows`` of the examples (each row from its own stream: any rank builds its own)."""
        xs = [torch.randn(cfg.features, generator=md.row_generator(seed, r))
              for r in range(cfg.examples)[rows or slice(None)]]
        x = torch.stack(xs) if xs else torch.zeros(0, cfg.features)
        y = torch.tanh(x[:, :1] + 0.5 * x[:, -1:]).expand(-1, cfg.targets).contiguous()
        return {"x": x, "y": y}

    return md.Model(g, loss, {"w_in": w_in, **stack, "w_out": w_out}, batches=batches, config=cfg)
