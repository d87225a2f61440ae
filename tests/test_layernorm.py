"""The fused layer norm with its affine (meshdsl/ops/layernorm.py): one op forward, one
backward that returns the input gradient and both parameter gradients, against torch
autograd (dense) and against the dense program on simulated meshes that split the batch,
the sequence, the normalised dim or the params.

Tolerances are rtol = atol = 1e-5 in fp32, as tests/test_nn_fused.py: the same kind of
fused kernels on both sides, sums in a different order.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import meshdsl as md

TOL = dict(rtol=1e-5, atol=1e-5)
B, S, D = md.Dim("batch", 4), md.Dim("seq", 6), md.Dim("d_model", 8)


def _build(scale: bool, bias: bool, dim: str = "d_model"):
    """loss = sum(w * layer_norm(x * 1.5, dim, scale, bias)) (x read twice: its gradient sums)."""
    dims = {"batch": B, "seq": S, "d_model": D}
    x = md.param("x", [B, S, D])
    w = md.input("w", [D, B, S])   # another dim order: the cotangent comes transposed
    s = md.param("scale", [dims[dim]], init="ones") if scale else None
    b = md.param("bias", [dims[dim]], init="zeros") if bias else None
    y = md.layer_norm(x * 1.5, dim, s, b) + x
    loss = md.reduce_sum(w * y)
    wrt = {"x": x, **({"scale": s} if scale else {}), **({"bias": b} if bias else {})}
    return y, loss, wrt


def _feeds():
    return {"w": torch.randn(8, 4, 6, generator=torch.Generator().manual_seed(3))}


def _params(scale, bias):
    g = torch.Generator().manual_seed(7)
    p = {"x": torch.randn(4, 6, 8, generator=g) * 2 + 0.5}
    if scale:
        p["scale"] = torch.randn(8, generator=g)
    if bias:
        p["bias"] = torch.randn(8, generator=g)
    return p


@pytest.mark.parametrize("scale, bias", [(True, True), (True, False), (False, True)])
def test_fused_layer_norm_matches_torch_autograd(scale, bias):
    with md.Graph():
        y, loss, wrt = _build(scale, bias)
        assert y.node.inputs[0].node.op.name == "layer_norm"
        grads = md.grad(loss, wrt)
        params, feeds = _params(scale, bias), _feeds()
        got = md.run_dense({"y": y, **{f"d{k}": g for k, g in grads.items()}}, feeds, params)
    t = {k: v.clone().requires_grad_() for k, v in params.items()}
    ty = F.layer_norm(t["x"] * 1.5, (8,), t.get("scale"), t.get("bias"), 1e-5) + t["x"]
    (ty * feeds["w"].permute(1, 2, 0)).sum().backward()
    torch.testing.assert_close(got["y"], ty.detach(), **TOL)
    for k in wrt:
        torch.testing.assert_close(got[f"d{k}"], t[k].grad, **TOL, msg=lambda m: f"d{k}: {m}")


def test_the_affine_is_in_the_one_op_and_its_gradient_in_one_backward():
    """No mul/add for the affine forward; no reduce_sum/mul for its gradients backward."""
    with md.Graph():
        x = md.param("x", [B, S, D])
        s, b = md.param("scale", [D]), md.param("bias", [D])
        y = md.layer_norm(x, "d_model", s, b)
        assert y.node.op.name == "layer_norm" and len(y.node.inputs) == 3
        grads = md.grad(md.reduce_sum(y * y), [x, s, b])
        # each gradient is named by an identity (stop_gradient) over the one backward node
        (made,) = {g.node.inputs[0].node for g in grads}
        assert made.op.name == "layer_norm_backward" and len(made.outputs) == 3
    with md.Graph():   # a scale over two dims keeps the composite
        x = md.param("x", [B, S, D])
        y = md.layer_norm(x, "d_model", md.param("scale", [S, D]))
        assert y.node.op.name == "mul"


@pytest.mark.parametrize("mesh, layout", [("", ""), ("model:2", "d_model:model"), ("data:2", "batch:data")])
def test_the_backward_reads_the_forward_statistics(mesh, layout):
    """The forward's mean and rstd (one per row) feed the backward, which recomputes nothing:
    one layer_norm step in the plan, or where the normalised dim is split, one combine of the
    composite (each part's moments gathered, so the statistics are the whole rows'; nothing of x gathered)."""
    with md.Graph():
        x = md.param("x", [B, S, D])
        s, b = md.param("scale", [D]), md.param("bias", [D])
        y = md.layer_norm(x, "d_model", s, b)
        ln = y.node
        loss = md.reduce_sum(y * y)
        grads = md.grad(loss, [x, s, b])
        (bwd,) = {g.node.inputs[0].node for g in grads}
        assert all(a is b for a, b in zip(bwd.inputs[2:4], ln.outputs[1:], strict=True))
        assert [t.shape.names for t in ln.outputs[1:]] == [("batch", "seq")] * 2
        params = _params(True, True)
        got = md.run_dense({"mean": ln.outputs[1], "rstd": ln.outputs[2]}, {}, params)
        if mesh:
            outs = {"loss": loss, "dx": grads[0], "ds": grads[1], "db": grads[2]}
            plan = md.compile(outs, mesh, layout)
            ops = [st.op for st in plan.steps if st.kind == "local"]
            split = "d_model" in layout
            assert ops.count("layer_norm") == (0 if split else 1) and ops.count("combine_moments") == int(split), ops
            # nothing of the activation gathered: split, only each rank's two moments a row are
            gathers = [st for st in plan.steps if st.kind.endswith("allgather")]
            assert [(st.op, st.bytes) for st in gathers] == ([("combine_moments", 4 * 6 * 2 * 4)] if split else []), gathers
            want, run = md.run_dense(outs, {}, params), md.run_simulated(plan, {}, params)
            for k in want:
                # the row sums added in two halves (or the batch's rows on two ranks): fp32 rounding
                torch.testing.assert_close(run[k], want[k], **TOL, msg=lambda m, k=k: f"{k}: {m}")
    x0 = params["x"]
    torch.testing.assert_close(got["mean"], x0.mean(-1), **TOL)
    torch.testing.assert_close(got["rstd"], (x0.var(-1, unbiased=False) + 1e-5).rsqrt(), **TOL)


def test_bf16_activations_match_torch_autograd_in_bf16():
    """A bf16 x (the saved statistics kept in fp32 in the graph, handed to the CPU kernel in
    bf16, as its forward computes them): the gradients of torch's own bf16 layer norm.
    Tolerance 1e-2: bf16 has 8 significant bits (ulp 2^-8 relative), and the two sides round
    the input gradient's sums in different orders."""
    with md.Graph():
        x = md.param("x", [B, S, D])
        s, b = md.param("scale", [D]), md.param("bias", [D])
        y = md.layer_norm(md.cast(x, torch.bfloat16), "d_model", md.cast(s, torch.bfloat16),
                          md.cast(b, torch.bfloat16))
        assert y.node.op.name == "layer_norm" and y.node.outputs[1].dtype == torch.float32
        loss = md.reduce_sum(md.cast(y, torch.float32) * md.cast(y, torch.float32))
        grads = md.grad(loss, {"x": x, "scale": s, "bias": b})
        params = _params(True, True)
        got = md.run_dense({f"d{k}": g for k, g in grads.items()}, {}, params)
    t = {k: v.clone().requires_grad_() for k, v in params.items()}
    ty = F.layer_norm(t["x"].bfloat16(), (8,), t["scale"].bfloat16(), t["bias"].bfloat16(), 1e-5).float()
    (ty * ty).sum().backward()
    for k in ("x", "scale", "bias"):
        torch.testing.assert_close(got[f"d{k}"], t[k].grad, rtol=1e-2, atol=1e-2, msg=lambda m: f"d{k}: {m}")


LAYOUTS = [("data:2", "batch:data"), ("data:2", "seq:data"), ("model:2", "d_model:model"),
           ("data:2", "batch:data; scale.d_model:data; bias.d_model:data"), ("data:2; model:2", "batch:data; seq:model")]


@pytest.mark.parametrize("mesh, layout", LAYOUTS)
def test_layouts_give_the_dense_numbers(mesh, layout):
    with md.Graph():
        y, loss, wrt = _build(True, True)
        grads = md.grad(loss, wrt)
        outs = {"y": y, "loss": loss, **{f"d{k}": g for k, g in grads.items()}}
        feeds, params = _feeds(), _params(True, True)
        want = md.run_dense(outs, feeds, params)
        got = md.run_simulated(md.compile(outs, mesh, layout), feeds, params)
    for k in outs:
        torch.testing.assert_close(got[k], want[k], **TOL, msg=lambda m: f"{mesh} / {layout}, {k}: {m}")


def test_a_split_batch_leaves_the_param_gradients_partial_and_reduced_once():
    """batch:data: the backward's scale and bias gradients come out partial over 'data'
    and are reduced once (in one bucket); its input gradient is split, not partial."""
    with md.Graph():
        x = md.param("x", [B, S, D])
        s, b = md.param("scale", [D]), md.param("bias", [D])
        loss = md.reduce_sum(md.layer_norm(x, "d_model", s, b) ** 2)
        ds, db = md.grad(loss, [s, b])
        plan = md.compile({"loss": loss, "ds": ds, "db": db}, "data:2", "batch:data")
    bwd = next(st for st in plan.steps if st.kind == "local" and st.op == "layer_norm_backward")
    dx_sh, ds_sh, db_sh = (plan.values[v].sharding for v in bwd.outs)
    assert not dx_sh.partial and dx_sh.split == {"batch": ("data",)}
    assert ds_sh.partial == ("data",) and db_sh.partial == ("data",)
    coll = [st for st in plan.steps if st.is_collective]
    # the loss's allreduce, and one (bucketed) allreduce of the two gradients as they came out
    assert [(st.kind, st.axes) for st in coll] == [("allreduce", ("data",)), ("bucket_allreduce", ("data",))]
    assert coll[1].ins == bwd.outs[1:]


@settings(max_examples=12, deadline=None)
@given(layout=st.sampled_from(["", "batch:data", "seq:data", "d_model:data", "batch:data; scale.d_model:data"]),
       scale=st.booleans(), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_property_any_layout_matches_the_dense_oracle(layout, scale, bias, seed):
    if not (scale or bias):
        scale = True
    if not scale:
        layout = layout.replace("scale.", "bias.")
    with md.Graph():
        y, loss, wrt = _build(scale, bias)
        grads = md.grad(loss, wrt)
        outs = {"loss": loss, **{f"d{k}": g for k, g in grads.items()}}
        feeds = {"w": torch.randn(8, 4, 6, generator=torch.Generator().manual_seed(seed))}
        params = _params(scale, bias)
        want = md.run_dense(outs, feeds, params)
        got = md.run_simulated(md.compile(outs, "data:2", layout), feeds, params)
    for k in outs:
        torch.testing.assert_close(got[k], want[k], **TOL)


class _Traced(torch.Tensor):
    """A tensor subclass, as a tracer's tensors are (--compile's functional and fake tensors)."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_eager_backward_reads_the_squeezed_statistics_as_a_tracer_reads_them_unsqueezed(dtype):
    """On the CPU the eager backward hands the kernel the forward's statistics as they are (one
    value per row, no unsqueeze); a tracer's tensors get them in the schema's [rows, 1] shape.
    The same kernel on the same values: bitwise equal."""
    from meshdsl.ops.layernorm import _backward, _forward
    g = torch.Generator().manual_seed(3)
    x, dy = torch.randn(3, 4, 6, generator=g, dtype=dtype), torch.randn(3, 4, 6, generator=g, dtype=dtype)
    w, b = torch.randn(6, generator=g, dtype=dtype), torch.randn(6, generator=g, dtype=dtype)
    _, mean, rstd = _forward(2, 1e-5, True, True, x, w, b)
    assert mean.shape == (3, 4)
    eager = _backward(2, True, True, dy, x, mean, rstd, w)
    traced = _backward(2, True, True, *(t.as_subclass(_Traced) for t in (dy, x, mean, rstd, w)))
    for e, t in zip(eager, traced, strict=True):
        torch.testing.assert_close(e, t.as_subclass(torch.Tensor), rtol=0, atol=0)
