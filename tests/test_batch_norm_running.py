"""md.batch_norm(..., running=(mean, var)): running statistics kept by the op, as
torch.nn.BatchNorm2d keeps them (meshdsl/ops/batchnorm.py, train/state_updates.py
``running_updates``, ir/eval_mode.py).

Against torch (``F.batch_norm`` with running buffers, training then eval) on one device, against
the dense program under layouts that split the normalised dims or the features; and the errors.
Tolerances: rtol 1e-6, atol 1e-7 for the statistics (fp64 sums, one fp32 update per step) and
the eval loss (the same elementwise formula as torch's).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import meshdsl as md

B, H, C, K = md.Dim("batch", 6), md.Dim("height", 4), md.Dim("c", 3), md.Dim("k", 2)
TOL = dict(rtol=1e-6, atol=1e-7)


def _x() -> torch.Tensor:
    return torch.randn(6, 4, 3, generator=torch.Generator().manual_seed(5)) * 2 + 1


def _model(momentum: float = 0.1) -> md.Model:
    """A batch norm over (batch, height) with running statistics, a projection, a squared loss;
    the same feeds every step, so the batch statistics are those of ``_x()`` each step."""
    with md.Graph("bnrun") as g:
        x, t = md.input("x", [B, H, C]), md.input("t", [B, H, K])
        s, b = md.param("s", [C], init="ones"), md.param("b", [C], init="zeros")
        rm, rv = md.param("rm", [C], init="zeros"), md.param("rv", [C], init="ones")
        w = md.param("w", [C, K])
        y = md.batch_norm(x, ["batch", "height"], s, b, running=(rm, rv), momentum=momentum)
        loss = md.reduce_mean(md.square(md.einsum("batch height c, c k -> batch height k", y, w) - t))
    feeds = {"x": _x(), "t": torch.randn(6, 4, 2, generator=torch.Generator().manual_seed(6))}
    return md.Model(g, loss, {"s": s, "b": b, "w": w}, make_feeds=lambda seed: feeds)


def _torch_running(steps: int, momentum: float = 0.1):
    rm, rv = torch.zeros(3), torch.ones(3)
    for _ in range(steps):
        F.batch_norm(_x().permute(0, 2, 1), rm, rv, training=True, momentum=momentum)
    return rm, rv


@pytest.mark.parametrize("mesh, layout", [("data:1", ""), ("data:2", "batch:data"), ("data:3", "height:data"),
                                          ("data:2; model:3", "batch:data; c:model"),
                                          ("data:2", "batch:data; params.c:data")])
def test_the_step_keeps_torchs_running_statistics(mesh, layout):
    """After 3 steps the frozen params are torch's running buffers (momentum 0.1, the variance
    unbiased), whatever the layout: the statistics are the whole batch's."""
    r = md.fit(_model(), mesh=mesh, layout=layout, steps=3, lr=0.1, samples=0)
    got = r.step.full_params(frozen=True)
    rm, rv = _torch_running(3)
    torch.testing.assert_close(got["rm"], rm, **TOL)
    torch.testing.assert_close(got["rv"], rv, **TOL)


def test_eval_normalises_with_the_running_statistics():
    """md.evaluate (the run's evals, meshdsl eval) normalises with the running statistics, as
    torch's eval mode does; the training loss still uses the batch's."""
    model = _model(momentum=0.3)
    r = md.fit(model, mesh="data:1", steps=2, lr=0.1, samples=0)
    p = r.step.full_params(frozen=True)
    feeds = model.feeds(0)
    y = F.batch_norm(feeds["x"].permute(0, 2, 1), p["rm"], p["rv"], p["s"], p["b"], training=False).permute(0, 2, 1)
    want = ((y @ p["w"] - feeds["t"]) ** 2).mean()
    got = md.evaluate(model, p, batches=1)["loss"]
    assert got == pytest.approx(float(want), rel=1e-6)
    y_train = F.batch_norm(feeds["x"].permute(0, 2, 1), None, None, p["s"], p["b"], training=True).permute(0, 2, 1)
    train = md.run_dense({"l": model.loss}, feeds, p)["l"]
    torch.testing.assert_close(train, ((y_train @ p["w"] - feeds["t"]) ** 2).mean(), rtol=1e-5, atol=0)
    assert abs(float(train) - got) > 1e-3


def test_bad_running_arguments_are_clear_errors():
    with md.Graph():
        x = md.input("x", [B, H, C])
        rm, rv = md.param("rm", [C], init="zeros"), md.param("rv", [C], init="ones")
        with pytest.raises(md.ShapeError, match=r"momentum=0 is not a number in \(0, 1\]"):
            md.batch_norm(x, ["batch", "height"], running=(rm, rv), momentum=0)
        with pytest.raises(md.ShapeError, match="not a \\(mean, var\\) pair of params"):
            md.batch_norm(x, ["batch", "height"], running=rm)
        wrong = md.param("wrong", [H], init="zeros")
        with pytest.raises(md.ShapeError, match="must be a float param of x's features"):
            md.batch_norm(x, ["batch", "height"], running=(wrong, rv))
        with pytest.raises(md.ShapeError, match="is not a param of the graph"):
            md.batch_norm(x, ["batch", "height"], running=(rm * 1.0, rv))
    with md.Graph():
        L = md.Dim("layer", 2)
        x = md.input("x", [B, H, C])
        stacked = {"rm": md.param("rm", [L, C], init="zeros"), "rv": md.param("rv", [L, C], init="ones")}

        def block(h, p):
            return md.batch_norm(h, ["batch", "height"], running=(p["rm"], p["rv"]))
        with pytest.raises(md.ShapeError, match="inside md.repeat") as e:
            md.repeat(block, x, stacked, "layer")
        assert "stats=True" in str(e.value)


def test_running_statistics_are_frozen_and_set_once():
    """A running statistic in the Model's params (trained) or given an update of its own is a
    ModelError naming it; the implied updates are in Model.updates (what load_trained loads)."""
    m = _model()
    assert set(m.updates) == {"rm", "rv"}
    with md.Graph("bad") as g:
        x = md.input("x", [B, H, C])
        rm, rv = md.param("rm", [C], init="zeros"), md.param("rv", [C], init="ones")
        loss = md.reduce_mean(md.batch_norm(x, ["batch", "height"], running=(rm, rv)) * x)
    feeds = lambda seed: {"x": _x()}                          # noqa: E731
    with pytest.raises(md.ModelError, match="'rm': batch_norm\\(running=...\\) keeps it; it is in params"):
        md.Model(g, loss, {"rm": rm}, make_feeds=feeds)
    with pytest.raises(md.ModelError, match="'rv': batch_norm\\(running=...\\) keeps it; updates= gives it"):
        md.Model(g, loss, {}, make_feeds=feeds, updates={"rv": rv * 0.5})
