"""md.batch_norm (meshdsl/ops/batchnorm.py): normalised over several dims, one collective for its
statistics forward and one backward.

Against torch (``F.batch_norm`` in training mode, autograd) on one device, against the dense
program on simulated meshes that split the normalised dims (the batch, a spatial dim, both, an
uneven 3-way split, under a repeat) or the features and params (data + model, FSDP), and plan
counts: one allreduce forward and one backward per norm under ``batch:data``.

Tolerances: rtol = atol = 1e-5 in fp32 (as tests/test_layernorm.py): the same kernels on every
rank, the fp64 statistics' and fp32 backward sums added in another order.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import meshdsl as md

TOL = dict(rtol=1e-5, atol=1e-5)
# legend: b batch, h/w height/width, c channels (the features), L layers
B, H, W, C = md.Dim("batch", 6), md.Dim("height", 4), md.Dim("width", 2), md.Dim("c", 4)
L = md.Dim("layer", 2)
DIMS = ["batch", "height", "width"]
CONVMIXER = str(Path(__file__).parent / "heldout_convmixer.py")


def _params(stacked: bool = False):
    g = torch.Generator().manual_seed(7)
    lead = (2,) if stacked else ()
    return {"x": torch.randn(6, 4, 2, 4, generator=g) * 2 + 3,
            "scale": torch.randn(*lead, 4, generator=g), "bias": torch.randn(*lead, 4, generator=g)}


def _build():
    """loss = sum(w * batch_norm(x * 1.5) + mean + var): x read twice, w another dim order (the
    cotangent comes transposed), the batch mean and variance in the loss too."""
    x = md.param("x", [B, H, W, C])
    s, b = md.param("scale", [C]), md.param("bias", [C])
    w = md.input("w", [C, B, H, W])
    y, mean, var = md.batch_norm(x * 1.5, DIMS, s, b, stats=True)
    y = y + x
    loss = md.reduce_sum(w * y) + md.reduce_sum(mean * var)
    grads = md.grad(loss, {"x": x, "scale": s, "bias": b})
    return {"y": y, "loss": loss, **{f"d{k}": g for k, g in grads.items()}}


def _feeds():
    return {"w": torch.randn(4, 6, 4, 2, generator=torch.Generator().manual_seed(3))}


def test_matches_torch_batch_norm_and_autograd():
    with md.Graph():
        outs = _build()
        got = md.run_dense(outs, _feeds(), _params())
    p = {k: v.clone().requires_grad_() for k, v in _params().items()}
    xs = p["x"] * 1.5
    y = F.batch_norm(xs.permute(0, 3, 1, 2), None, None, p["scale"], p["bias"], training=True,
                     eps=1e-5).permute(0, 2, 3, 1) + p["x"]
    loss = (_feeds()["w"].permute(1, 2, 3, 0) * y).sum() + (xs.mean((0, 1, 2)) * xs.var((0, 1, 2), unbiased=False)).sum()
    want = dict(zip(["dx", "dscale", "dbias"], torch.autograd.grad(loss, [p["x"], p["scale"], p["bias"]])))
    want.update(y=y, loss=loss)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v.detach(), **TOL, msg=lambda m: f"{k}: {m}")


LAYOUTS = [("data:2", "batch:data"), ("data:2", "height:data"), ("data:2; model:2", "batch:data; width:model"),
           ("data:2; model:2", "batch:data; c:model"), ("data:3", "batch:data"), ("data:3", "height:data"),
           ("data:2", "batch:data; scale.c:data; bias.c:data")]


@pytest.mark.parametrize("mesh, layout", LAYOUTS)
def test_layouts_give_the_dense_numbers(mesh, layout):
    with md.Graph():
        outs = _build()
        want = md.run_dense(outs, _feeds(), _params())
        got = md.run_simulated(md.compile(outs, mesh, layout), _feeds(), _params())
    for k in outs:
        torch.testing.assert_close(got[k], want[k], **TOL, msg=lambda m: f"{mesh} / {layout}, {k}: {m}")


def _collectives(plan):
    return [(s.kind, s.axes, s.phase, s.op) for s, _ in plan.collectives()]


def test_one_allreduce_forward_and_one_backward_per_norm():
    """batch:data: the statistics [sum x, sum x^2] are one allreduce, the backward's [sum g,
    sum g * x_hat] another, and the scale's and bias's gradients are rows of it (no bucket)."""
    with md.Graph():
        plan = md.compile(_build(), "data:2", "batch:data")
    assert _collectives(plan) == [("allreduce", ("data",), "forward", "batch_norm"),
                                  ("allreduce", ("data",), "forward", "add"),   # the loss
                                  ("allreduce", ("data",), "backward", "batch_norm_backward")]


def _stack(layout: str, mesh: str):
    """Two layers under md.repeat: h + batch_norm(gelu(h) * 2) with stacked scale and bias."""
    x = md.param("x", [B, H, W, C])
    s, b = md.param("scale", [L, C]), md.param("bias", [L, C])

    def block(h, p):
        return h + md.batch_norm(md.gelu(h) * 2.0, DIMS, p["s"], p["b"])
    y = md.repeat(block, x, {"s": s, "b": b}, L)
    loss = md.reduce_sum(y * y)
    grads = md.grad(loss, {"x": x, "scale": s, "bias": b})
    return {"loss": loss, **{f"d{k}": g for k, g in grads.items()}}


@pytest.mark.parametrize("mesh, layout", [("data:2", "batch:data"), ("data:3", "height:data")])
def test_under_a_repeat(mesh, layout):
    """Each layer sends one allreduce forward and one backward (in the loops' bodies)."""
    with md.Graph():
        outs = _stack(layout, mesh)
        plan = md.compile(outs, mesh, layout)
        want = md.run_dense(outs, {}, _params(stacked=True))
        got = md.run_simulated(plan, {}, _params(stacked=True))
    for k in outs:
        torch.testing.assert_close(got[k], want[k], **TOL, msg=lambda m: f"{mesh} / {layout}, {k}: {m}")
    loops = [st for st in plan.steps if st.kind == "repeat"]
    sent = {st.args["backward"]: [(s.kind, s.op) for s, _ in st.subplans[0].collectives()] for st in loops}
    assert sent == {False: [("allreduce", "batch_norm")], True: [("allreduce", "batch_norm_backward")]}


def _convmixer_allreduces(capsys, form: str) -> int:
    from conftest import run_cli
    code, out, err = run_cli(capsys, ["plan", CONVMIXER, "--tiny", "--config", f"form={form}",
                                      "--mesh", "data:2", "--layout", "batch:data", "--totals"])
    assert code == 0, out + err
    [row] = [ln for ln in out.splitlines() if ln.split("│")[1:3] and ln.split("│")[1].strip() == "allreduce"]
    return int(row.split("│")[3])


def test_convmixer_sends_two_allreduces_per_norm(capsys):
    """ConvMixer's 5 norms (tests/heldout_convmixer.py): as the composite of means each sends its
    mean and variance forward and two sums backward apart (21 with the loss's); as md.batch_norm,
    one each way (11)."""
    assert (_convmixer_allreduces(capsys, "batch"), _convmixer_allreduces(capsys, "bnorm")) == (21, 11)


@pytest.mark.parametrize("dims, kw, match", [
    (["batch", "depth"], {}, r"dim 'depth'"),
    (["batch", "height", "width", "c"], {}, r"leave no feature"),
    ([], {}, r"no dim to normalise over"),
    (DIMS, {"scale": "batch"}, r"scale .* must have the dims .* not normalised over"),
    (DIMS, {"bias": "height"}, r"bias .* must have the dims"),
])
def test_argument_errors(dims, kw, match):
    with md.Graph():
        x = md.input("x", [B, H, W, C])
        ps = {role: md.param(role, [{"batch": B, "height": H}[d]]) for role, d in kw.items()}
        with pytest.raises(md.ShapeError, match=match):
            md.batch_norm(x, dims, **ps)


def test_an_integer_input_is_refused():
    with md.Graph():
        with pytest.raises(md.ShapeError, match="not floating point"):
            md.batch_norm(md.input("i", [B, C], torch.int64), "batch")


def test_a_scale_in_another_dim_order_is_transposed():
    """Features [height, c] (normalised over batch and width) with a scale given as [c, height]."""
    with md.Graph():
        x = md.input("x", [B, H, W, C])
        s = md.input("s", [C, H])
        y = md.batch_norm(x, ["batch", "width"], s)
        xv, sv = _params()["x"], torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
        got = md.run_dense({"y": y}, {"x": xv, "s": sv})["y"]
    mean, var = xv.mean((0, 2), keepdim=True), xv.var((0, 2), unbiased=False, keepdim=True)
    torch.testing.assert_close(got, (xv - mean) * torch.rsqrt(var + 1e-5) * sv.t()[None, :, None, :], **TOL)


def test_convmixer_on_two_real_processes(capsys):
    """``meshdsl check --nproc 2``: the fp64 statistics' allreduce on gloo processes."""
    from conftest import run_cli
    code, out, err = run_cli(capsys, ["check", CONVMIXER, "--tiny", "--config", "form=bnorm",
                                      "--mesh", "data:2", "--layout", "batch:data", "--nproc", "2"])
    assert code == 0 and "OK:" in out, out + err


def test_running_statistics_by_state_updates_and_an_eval_graph():
    """The documented recipe (docs/guide/training.md): frozen params updated in the step from
    ``stats=True``'s batch mean and variance follow torch's running statistics (momentum 0.1,
    unbiased running variance) under batch:data, and an eval graph normalises with them."""
    n, m = 6 * 4, 0.1
    with md.Graph():
        x = md.input("x", [B, H, C])
        a, s, b = md.param("a", [C], init="ones"), md.param("scale", [C], init="ones"), md.param("bias", [C])
        run_mean, run_var = md.param("run_mean", [C], init="zeros"), md.param("run_var", [C], init="ones")
        # tanh: the trained a changes the normalised values' shape, not only their scale
        y, mean, var = md.batch_norm(md.tanh(x * a), ["batch", "height"], s, b, stats=True)
        loss = md.reduce_mean(md.tanh(y) * x)
        updates = {"run_mean": (1 - m) * run_mean + m * mean, "run_var": (1 - m) * run_var + m * var * (n / (n - 1))}
        step = md.TrainStep(loss, {"a": a, "scale": s, "bias": b}, "data:2", "batch:data",
                            md.SimulatedComm(md.Mesh.parse("data:2")), optimizer=md.SGD(lr=0.5), updates=updates)
        y_eval = (md.tanh(x * a) - run_mean) * md.rsqrt(run_var + 1e-5) * s + b
        want_mean, want_var = torch.zeros(4), torch.ones(4)
        for t in range(3):
            xv = torch.randn(6, 4, 4, generator=torch.Generator().manual_seed(t)) * 2 + 1
            h = torch.tanh(xv * step.full_params()["a"])
            F.batch_norm(h.permute(0, 2, 1), want_mean, want_var, training=True, momentum=m)
            step({"x": xv})
        got = step.full_params(frozen=True)
        y_got = md.run_dense({"y": y_eval}, {"x": xv}, got)["y"]
    assert (got["a"] - 1).abs().min() > 1e-3   # the normalised input changed between steps
    torch.testing.assert_close(got["run_mean"], want_mean, **TOL)
    torch.testing.assert_close(got["run_var"], want_var, **TOL)
    want_y = F.batch_norm(torch.tanh(xv * got["a"]).permute(0, 2, 1), want_mean, want_var, got["scale"], got["bias"], training=False)
    torch.testing.assert_close(y_got, want_y.permute(0, 2, 1), **TOL)


def test_a_group_norm_over_several_dims_of_each_example():
    """Over each example's channels-per-group and spatial dims (GroupNorm, its per-channel affine
    after): F.group_norm's numbers dense, and the dense program's with the spatial dim split
    (one allreduce of the [batch, group] sums)."""
    G, K = md.Dim("group", 2), md.Dim("cpg", 2)
    with md.Graph():
        x = md.param("x", [B, G, K, H])
        s, b = md.param("s", [G, K]), md.param("b", [G, K])
        y = md.batch_norm(x, ["cpg", "height"]) * s + b
        loss = md.reduce_sum(y * md.sin(x))
        outs = {"y": y, **{f"d{k}": v for k, v in md.grad(loss, {"x": x, "s": s}).items()}}
        gen = torch.Generator().manual_seed(5)
        params = {"x": torch.randn(6, 2, 2, 4, generator=gen) + 1, "s": torch.randn(2, 2, generator=gen),
                  "b": torch.randn(2, 2, generator=gen)}
        want = md.run_dense(outs, {}, params)
        plan = md.compile(outs, "data:2", "height:data")
        got = md.run_simulated(plan, {}, params)
    ref = F.group_norm(params["x"].reshape(6, 4, 4), 2, params["s"].reshape(4), params["b"].reshape(4), eps=1e-5)
    torch.testing.assert_close(want["y"], ref.reshape(6, 2, 2, 4), **TOL)
    for k in outs:
        torch.testing.assert_close(got[k], want[k], **TOL, msg=lambda m: f"{k}: {m}")
    # the norm's two; the third is the scale's gradient (a sum over the split height)
    assert [(st.kind, st.phase, st.op) for st, _ in plan.collectives()][:2] == [
        ("allreduce", "forward", "batch_norm"), ("allreduce", "backward", "batch_norm_backward")]
    assert len(list(plan.collectives())) == 3
