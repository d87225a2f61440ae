"""The fused RMS norm with its scale (meshdsl/ops/rmsnorm.py): one op forward that saves each
row's rstd, one backward that reads it and returns the input and scale gradients, against
torch autograd (dense) and against the dense program on simulated meshes that split the
batch, the sequence, the normalised dim or the scale.

Tolerances are rtol = atol = 1e-5 in fp32, as tests/test_layernorm.py: fused kernels on
both sides, the sums in a different order (our backward's row sums are matrix-vector
products), so the results agree to a few ulps of values of order 1.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import meshdsl as md
from meshdsl.ops.rmsnorm import _backward, _forward
from meshdsl.train.model import load_model

TOL = dict(rtol=1e-5, atol=1e-5)
B, S, D = md.Dim("batch", 4), md.Dim("seq", 6), md.Dim("d_model", 8)
SIZES = {"batch": 4, "seq": 6, "d_model": 8}


def _build(scale: bool, dim: str = "d_model"):
    """loss = sum(w * (rms_norm(x * 1.5, dim, scale) + x)) (x read twice: its gradient sums)."""
    x = md.param("x", [B, S, D])
    w = md.input("w", [D, B, S])   # another dim order: the cotangent comes transposed
    s = md.param("scale", [{"batch": B, "seq": S, "d_model": D}[dim]], init="ones") if scale else None
    y = md.rms_norm(x * 1.5, dim, s) + x
    return y, md.reduce_sum(w * y), {"x": x, **({"scale": s} if scale else {})}


def _feeds():
    return {"w": torch.randn(8, 4, 6, generator=torch.Generator().manual_seed(3))}


def _params(scale: bool, dim: str = "d_model"):
    g = torch.Generator().manual_seed(7)
    p = {"x": torch.randn(4, 6, 8, generator=g) * 2 + 0.5}
    if scale:
        p["scale"] = torch.randn(SIZES[dim], generator=g)
    return p


@pytest.mark.parametrize("scale, dim", [(True, "d_model"), (False, "d_model"), (True, "seq")])
def test_fused_rms_norm_matches_torch_autograd(scale, dim):
    with md.Graph():
        y, loss, wrt = _build(scale, dim)
        assert y.node.inputs[0].node.op.name == "rms_norm"
        grads = md.grad(loss, wrt)
        params, feeds = _params(scale, dim), _feeds()
        got = md.run_dense({"y": y, **{f"d{k}": g for k, g in grads.items()}}, feeds, params)
    t = {k: v.clone().requires_grad_() for k, v in params.items()}
    pos = list(SIZES).index(dim)
    ty = F.rms_norm((t["x"] * 1.5).movedim(pos, -1), (SIZES[dim],), t.get("scale"), 1e-6).movedim(-1, pos) + t["x"]
    (ty * feeds["w"].permute(1, 2, 0)).sum().backward()
    torch.testing.assert_close(got["y"], ty.detach(), **TOL)
    for k in wrt:
        torch.testing.assert_close(got[f"d{k}"], t[k].grad, **TOL, msg=lambda m: f"d{k}: {m}")


def test_the_scale_is_in_the_one_op_and_its_gradient_in_one_backward():
    """No mul for the scale forward; no reduce_sum/mul for its gradient backward; a scale
    over more dims than the normalised one keeps the elementwise product."""
    with md.Graph():
        x, s = md.param("x", [B, S, D]), md.param("scale", [D])
        y = md.rms_norm(x, "d_model", s)
        assert y.node.op.name == "rms_norm" and len(y.node.inputs) == 2
        grads = md.grad(md.reduce_sum(y * y), [x, s])
        (made,) = {g.node.inputs[0].node for g in grads}
        assert made.op.name == "rms_norm_backward" and len(made.outputs) == 2
    with md.Graph():
        x = md.param("x", [B, S, D])
        y = md.rms_norm(x, "d_model", md.param("scale", [S, D]))
        assert y.node.op.name == "mul" and y.node.inputs[0].node.op.name == "rms_norm"


@pytest.mark.parametrize("mesh, layout", [("", ""), ("model:2", "d_model:model")])
def test_the_backward_reads_the_forward_rstd(mesh, layout):
    """The forward's rstd (one per row) feeds the backward, which recomputes nothing: one
    rms_norm step in the plan, or where the normalised dim is split, one rsqrt of the composite
    (the mean of squares allreduced, so the rstd is the whole rows'; nothing gathered)."""
    with md.Graph():
        x, s = md.param("x", [B, S, D]), md.param("scale", [D])
        y = md.rms_norm(x, "d_model", s, eps=1e-5)
        fwd = y.node
        loss = md.reduce_sum(y * y)
        grads = md.grad(loss, [x, s])
        (bwd,) = {g.node.inputs[0].node for g in grads}
        assert bwd.inputs[2] is fwd.outputs[1] and fwd.outputs[1].shape.names == ("batch", "seq")
        params = _params(True)
        got = md.run_dense({"rstd": fwd.outputs[1]}, {}, params)
        if mesh:
            outs = {"loss": loss, "dx": grads[0], "ds": grads[1]}
            plan = md.compile(outs, mesh, layout)
            ops = [st.op for st in plan.steps if st.kind == "local"]
            assert ops.count("rms_norm") == 0 and ops.count("rsqrt") == 1, ops
            assert "allgather" not in plan.totals(), plan.totals()
            want, split = md.run_dense(outs, {}, params), md.run_simulated(plan, {}, params)
            for k in want:
                # the row sums of squares added in two halves: fp32 rounding
                torch.testing.assert_close(split[k], want[k], **TOL, msg=lambda m, k=k: f"{k}: {m}")
    x0 = params["x"]
    torch.testing.assert_close(got["rstd"], (x0.square().mean(-1) + 1e-5).rsqrt(), **TOL)


def test_bf16_activations_keep_fp32_statistics_and_match_torch_autograd():
    """A bf16 x: the saved rstd is fp32 in the graph, the backward computes in fp32 and
    rounds dx and d_scale once.  Tolerance 1e-2: bf16 has 8 significant bits (ulp 2^-8
    relative), and torch's bf16 autograd rounds its intermediate products too."""
    with md.Graph():
        x, s = md.param("x", [B, S, D]), md.param("scale", [D])
        y = md.rms_norm(md.cast(x, torch.bfloat16), "d_model", md.cast(s, torch.bfloat16))
        assert y.node.op.name == "rms_norm" and y.node.outputs[1].dtype == torch.float32
        loss = md.reduce_sum(md.cast(y, torch.float32) * md.cast(y, torch.float32))
        grads = md.grad(loss, {"x": x, "scale": s})
        params = _params(True)
        got = md.run_dense({f"d{k}": g for k, g in grads.items()}, {}, params)
    t = {k: v.clone().requires_grad_() for k, v in params.items()}
    ty = F.rms_norm(t["x"].bfloat16(), (8,), t["scale"].bfloat16(), 1e-6).float()
    (ty * ty).sum().backward()
    for k in ("x", "scale"):
        torch.testing.assert_close(got[f"d{k}"], t[k].grad, rtol=1e-2, atol=1e-2, msg=lambda m: f"d{k}: {m}")


def test_the_non_cpu_backward_calls_torchs_kernel_with_its_conventions():
    """Off the CPU the backward is ``_fused_rms_norm_backward``; its meta kernel checks the
    arguments it is handed (the rstd as [rows, 1] in fp32 for a bf16 x) and the results'
    shapes and dtypes, with the normalised dim last and in the middle."""
    for pos in (2, 1):
        shape = [4, 6, 8]
        n = shape[pos]
        x = torch.empty(shape, device="meta", dtype=torch.bfloat16)
        rstd = torch.empty([s for i, s in enumerate(shape) if i != pos], device="meta")
        dx, ds = _backward(pos, x, x, rstd, torch.empty(n, device="meta", dtype=torch.bfloat16))
        assert dx.shape == x.shape and dx.dtype == torch.bfloat16 and ds.shape == (n,) and ds.dtype == torch.bfloat16
        assert _backward(pos, x, x, rstd).shape == x.shape


def test_the_kernels_agree_with_the_formula_in_float64():
    """_forward / _backward (the CPU formula) against autograd through F.rms_norm in float64,
    the dim in the middle; tolerance 1e-10: float64 sums in another order."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 4, dtype=torch.float64, generator=g).requires_grad_()
    w = torch.randn(5, dtype=torch.float64, generator=g).requires_grad_()
    cot = torch.randn(3, 5, 4, dtype=torch.float64, generator=g)
    y, rstd = _forward(1, 1e-6, x.detach(), w.detach())
    dx, dw = _backward(1, cot, x.detach(), rstd, w.detach())
    ty = F.rms_norm(x.movedim(1, -1), (5,), w, 1e-6).movedim(-1, 1)
    ty.backward(cot)
    for got, want in ((y, ty.detach()), (dx, x.grad), (dw, w.grad)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


LAYOUTS = [("data:2", "batch:data"), ("data:2", "seq:data"), ("model:2", "d_model:model"),
           ("data:2", "batch:data; scale.d_model:data"), ("data:2; model:2", "batch:data; seq:model"),
           ("data:3", "seq:data"),
           ("data:3", "batch:data"),       # batch 4 over 3: parts 2, 1, 1 (an uneven split)
           ("model:3", "d_model:model")]   # d_model 8 over 3: uneven, and gathered for the norm


@pytest.mark.parametrize("mesh, layout", LAYOUTS)
def test_layouts_give_the_dense_numbers(mesh, layout):
    with md.Graph():
        y, loss, wrt = _build(True)
        grads = md.grad(loss, wrt)
        outs = {"y": y, "loss": loss, **{f"d{k}": g for k, g in grads.items()}}
        feeds, params = _feeds(), _params(True)
        want = md.run_dense(outs, feeds, params)
        got = md.run_simulated(md.compile(outs, mesh, layout), feeds, params)
    for k in outs:
        torch.testing.assert_close(got[k], want[k], **TOL, msg=lambda m: f"{mesh} / {layout}, {k}: {m}")


def test_a_split_batch_leaves_the_scale_gradient_partial_and_reduced_once():
    """batch:data: the backward's scale gradient comes out partial over 'data' and is reduced
    once where it is read; its input gradient is split, not partial."""
    with md.Graph():
        x, s = md.param("x", [B, S, D]), md.param("scale", [D])
        loss = md.reduce_sum(md.rms_norm(x, "d_model", s) ** 2)
        (ds,) = md.grad(loss, [s])
        plan = md.compile({"loss": loss, "ds": ds}, "data:2", "batch:data")
    bwd = next(st for st in plan.steps if st.kind == "local" and st.op == "rms_norm_backward")
    dx_sh, ds_sh = (plan.values[v].sharding for v in bwd.outs)
    assert not dx_sh.partial and dx_sh.split == {"batch": ("data",)}
    assert ds_sh.partial == ("data",)
    coll = [st for st in plan.steps if st.is_collective]
    assert [(st.kind, st.axes) for st in coll] == [("allreduce", ("data",)), ("allreduce", ("data",))]
    assert coll[1].ins == bwd.outs[1:]


def test_llama_remat_recomputes_the_norm_or_saves_it_by_name():
    """Inside llama's layer loop: ``selective`` recomputes both norms (their rstd with them) in
    the backward block, ``save:...,rms_norm`` names the op and recomputes neither; the gradients
    are bitwise those of ``none`` (the same kernels on the same values)."""
    model = load_model("llama", tiny=True)
    feeds = model.feeds(0)
    got, recomputed = {}, {}
    for policy in ("none", "selective", "save:einsum,attention,rms_norm"):
        grads = md.grad(model.loss, model.params, remat=policy)
        plan = md.compile({"loss": model.loss, **{f"grad/{k}": g for k, g in grads.items()}},
                          "data:2", "batch:data")
        bwd = next(s for s in plan.steps if s.kind == "repeat" and s.args["backward"])
        recomputed[policy] = [s.op for s in bwd.subplans[0].steps if s.phase == "recompute"]
        got[policy] = md.run_simulated(plan, feeds)
    assert recomputed["none"] == [] and recomputed["selective"].count("rms_norm") == 2
    assert "rms_norm" not in recomputed["save:einsum,attention,rms_norm"]
    for policy in ("selective", "save:einsum,attention,rms_norm"):
        for k, v in got["none"].items():
            assert torch.equal(got[policy][k], v), f"{policy} {k}"
