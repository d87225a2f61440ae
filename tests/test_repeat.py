"""repeat: forward values and gradients vs the same block unrolled in a Python loop
(dense and on simulated meshes), and the backward block does not recompute the forward
(it reads the activations the forward saved)."""
from __future__ import annotations

import pytest
import torch

import meshdsl as md

B, D, FF, L = md.Dim("batch", 4), md.Dim("d_model", 4), md.Dim("d_ff", 8), md.Dim("layer", 3)
PARAMS = {"w1": [D, FF], "w2": [FF, D], "g": [D]}


def _block(h, p):
    n = md.layer_norm(h, "d_model", scale=p["g"])
    u = md.tanh(md.relu(md.einsum("batch d_model, d_model d_ff -> batch d_ff", n, p["w1"])))
    return h + md.einsum("batch d_ff, d_ff d_model -> batch d_model", u * u, p["w2"])


def _loss(y, x):
    return md.reduce_sum(md.tanh(y) * x)


def _repeat_model():
    with md.Graph("rep") as g:
        x = md.input("x", [B, D])
        ps = {k: md.param(k, [L] + dims, scale=1.0) for k, dims in PARAMS.items()}
        y = md.repeat(_block, x, ps, "layer")
        loss = _loss(y, x)
        grads = md.grad(loss, ps)
    return g, {"loss": loss, "y": y, **{f"d/{k}": v for k, v in grads.items()}}


def _unrolled(params: dict, feeds: dict, dtype=torch.float32) -> dict:
    with md.Graph("unrolled"):
        x = md.input("x", [B, D], dtype=dtype)
        per = [{k: md.param(f"{k}_{l}", dims, scale=1.0, dtype=dtype) for k, dims in PARAMS.items()}
               for l in range(L.size)]
        h = x
        for p in per:
            h = _block(h, p)
        loss = _loss(h, x)
        grads = [md.grad(loss, p) for p in per]
    outs = {"loss": loss, "y": h, **{f"d/{k}_{l}": grads[l][k] for l in range(L.size) for k in PARAMS}}
    vals = {f"{k}_{l}": params[k][l].to(dtype) for l in range(L.size) for k in PARAMS}
    r = md.run_dense(outs, {k: v.to(dtype) for k, v in feeds.items()}, vals)
    return {"loss": r["loss"], "y": r["y"],
            **{f"d/{k}": torch.stack([r[f"d/{k}_{l}"] for l in range(L.size)], 0) for k in PARAMS}}


def _feeds():
    return {"x": torch.randn(4, 4, generator=torch.Generator().manual_seed(1))}


def _params():
    gen = torch.Generator().manual_seed(2)
    return {k: torch.randn([L.size] + [d.size for d in dims], generator=gen) for k, dims in PARAMS.items()}


def _close(got, want):
    assert set(want) <= set(got)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")


# The mesh programs sum in another order than the dense one, and this block (params of
# scale 1, layer_norm over 4 elements, gradients up to ~20) amplifies fp32 rounding: the
# dense fp32 program itself is off by up to ~6e-4 from float64.  So the mesh result is held
# to the dense program's own accuracy: against the float64 unrolled oracle, its error is
# at most ACCURACY_FACTOR times the dense fp32 error (or within the suite's usual 1e-5
# relative to the tensor's magnitude).  A wrong reduction or slice is off by O(1).
ACCURACY_FACTOR = 4


def _as_accurate(got, dense, oracle):
    assert set(oracle) <= set(got)
    for k, ref in oracle.items():
        err = (got[k].double() - ref).abs().max().item()
        dense_err = (dense[k].double() - ref).abs().max().item()
        bound = max(ACCURACY_FACTOR * dense_err, 1e-5 * (1 + ref.abs().max().item()))
        assert err <= bound, f"{k}: error {err:.3g} vs float64, dense fp32 error {dense_err:.3g}, bound {bound:.3g}"


def test_repeat_dense_matches_unrolled():
    _, outs = _repeat_model()
    params, feeds = _params(), _feeds()
    _close(md.run_dense(outs, feeds, params), _unrolled(params, feeds))


@pytest.mark.parametrize("mesh, layout", [
    ("data:2", "batch:data"),
    ("model:2", "d_ff:model"),
    ("data:2", "params.d_model:data"),
    ("data:2; model:2", "batch:data; d_ff:model; params.d_model:data"),
    ("model:4", "d_model:model"),
])
def test_repeat_mesh_matches_unrolled(mesh, layout):
    _, outs = _repeat_model()
    params, feeds = _params(), _feeds()
    got = md.run_simulated(md.compile(outs, mesh, layout), feeds, params)
    _as_accurate(got, _unrolled(params, feeds), _unrolled(params, feeds, torch.float64))


def test_repeat_grad_twice_reuses_saved_outputs():
    """A second grad of the same repeat reuses the saved activations (no new outputs)."""
    with md.Graph("twice"):
        x = md.input("x", [B, D])
        ps = {k: md.param(k, [L] + dims, scale=1.0) for k, dims in PARAMS.items()}
        y = md.repeat(_block, x, ps, "layer")
        (rep,) = [n for n in y.graph.nodes if n.op.name == "repeat"]
        g1 = md.grad(_loss(y, x), ps)
        n_out = len(rep.outputs)
        g2 = md.grad(md.reduce_sum(y * y), ps)
    assert len(rep.outputs) == n_out > 2
    params, feeds = _params(), _feeds()
    outs = {"a": g1["w1"], "b": g2["w2"]}
    want = md.run_dense(outs, feeds, params)
    _close(md.run_simulated(md.compile(outs, "x:2", "batch:x; d_ff:x"), feeds, params), want)


def _grad_block(g):
    (rg,) = [n for n in g.nodes if n.op.name == "repeat_grad"]
    return rg.attrs["block"], len(rg.attrs["block"].graph.nodes) - len(
        [n for n in g.nodes if n.op.name == "repeat"][0].attrs["block"].graph.nodes)


@pytest.mark.parametrize("mesh, layout", [("data:2", "batch:data"), ("model:2", "d_ff:model")])
def test_repeat_grad_does_not_recompute_forward(mesh, layout):
    g, outs = _repeat_model()
    (fwd,) = [n for n in g.nodes if n.op.name == "repeat"]
    n_fwd = len(fwd.attrs["block"].graph.nodes)
    gblk = [n for n in g.nodes if n.op.name == "repeat_grad"][0].attrs["block"]
    plan = md.compile(outs, mesh, layout)
    (f_step,) = [s for s in plan.steps if s.kind == "repeat" and not s.args["backward"]]
    (b_step,) = [s for s in plan.steps if s.kind == "repeat" and s.args["backward"]]
    sub = b_step.subplans[0]
    fwd_ops = {gblk.graph.nodes[s.node].op.name for s in sub.steps if s.kind == "local" and s.node < n_fwd}
    # Only cheap leaves of the forward part (scalar constants) may run again in the backward block.
    assert fwd_ops <= {"constant"}, fwd_ops
    assert not any(s.op == "einsum" and s.node < n_fwd for s in sub.steps)
    # Backward FLOPs: the vjp of the block (~2x its forward), not forward + vjp (~3x).
    assert sub.flops() < 2.5 * f_step.subplans[0].flops()
    # Dense: the backward program leaves the forward part out too.
    prog = gblk.dense({"dcarry": gblk.extra["dcarry"], **{f"d/{k}": v for k, v in gblk.extra["dparams"].items()}},
                      gblk.extra["given"])
    assert {n.op.name for n in prog.nodes if n.id < n_fwd} <= {"constant", "placeholder"}


def test_forward_only_plan_saves_nothing():
    """A plan without the backward does not compute or stack the saved activations."""
    _, outs = _repeat_model()
    plan = md.compile({"y": outs["y"]}, "model:2", "d_ff:model")
    (step,) = [s for s in plan.steps if s.kind == "repeat"]
    assert list(step.subplans[0].outputs) == ["out"]
    assert len(step.outs) == 2


def test_dense_forward_only_keeps_no_activations():
    g, outs = _repeat_model()
    prog = md.DenseProgram({"y": outs["y"]})
    (code,) = [c for c in prog.code if c[0].__self__.name == "repeat"]
    assert code[1]["saved"] == [] and len(code[3]) == 2
    params, feeds = _params(), _feeds()
    torch.testing.assert_close(prog(feeds, params)["y"], _unrolled(params, feeds)["y"])
