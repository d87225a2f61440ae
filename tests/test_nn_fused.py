"""The fused softmax / normalize / rms_norm primitives (and their backward ops)
against torch autograd on the same numbers, dense and on a simulated mesh.

Tolerances are rtol = atol = 1e-5 in fp32: both sides run the same kind of fused
kernels, but the reductions may sum in a different order (e.g. our backward
recomputes mean/rstd, movedim changes the memory layout), so results agree to a
few ulps of values of order 1, not bit for bit.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import meshdsl as md

TOL = dict(rtol=1e-5, atol=1e-5)
B, S, K = md.Dim("batch", 3), md.Dim("seq", 6), md.Dim("feat", 8)
DIMS = {"batch": B, "seq": S, "feat": K}


def _torch_norm(kind, x, pos, eps):
    if kind == "layer":
        m = x.mean(pos, keepdim=True)
        return (x - m) * torch.rsqrt(((x - m) ** 2).mean(pos, keepdim=True) + eps)
    return x * torch.rsqrt((x * x).mean(pos, keepdim=True) + eps)


def _run(kind, dim, affine):
    """Build y = op(x, dim) (+ affine), loss = sum(W * y) with W in another dim order;
    return meshdsl's (y, grads) and torch autograd's on the same numbers."""
    torch.manual_seed(0)
    xv = torch.randn(3, 6, 8) * 2.0 + 0.5
    wv = torch.randn(8, 3, 6)                      # W is [feat, batch, seq]
    sv, bv = torch.randn(DIMS[dim].size), torch.randn(DIMS[dim].size)
    pos = ["batch", "seq", "feat"].index(dim)
    with md.Graph():
        x = md.param("x", [B, S, K])
        w = md.input("w", [K, B, S])
        scale = md.param("scale", [DIMS[dim]]) if affine else None
        bias = md.param("bias", [DIMS[dim]]) if affine else None
        if kind == "softmax":
            y = md.softmax(x, dim)
        elif kind == "layer":
            y = md.layer_norm(x, dim, scale, bias)
        else:
            y = md.rms_norm(x, dim, scale)
        loss = md.reduce_sum(w * y)
        wrt = {"x": x}
        if affine:
            wrt["scale"] = scale
            if kind == "layer":
                wrt["bias"] = bias
        grads = md.grad(loss, wrt)
        params = {"x": xv, "scale": sv, "bias": bv}
        got = md.run_dense({"y": y, **{f"d{k}": g for k, g in grads.items()}}, {"w": wv},
                           {k: v for k, v in params.items() if k in wrt})

    tx = xv.clone().requires_grad_()
    ts, tb = sv.clone().requires_grad_(), bv.clone().requires_grad_()
    view = [1, 1, 1]
    view[pos] = -1
    if kind == "softmax":
        ty = torch.softmax(tx, pos)
    else:
        ty = _torch_norm(kind, tx, pos, 1e-5 if kind == "layer" else 1e-6)
        if affine:
            ty = ty * ts.view(view)
            if kind == "layer":
                ty = ty + tb.view(view)
    (ty * wv.permute(1, 2, 0)).sum().backward()
    want = {"y": ty.detach(), "dx": tx.grad, "dscale": ts.grad, "dbias": tb.grad}
    return got, want


@pytest.mark.parametrize("dim", ["feat", "seq", "batch"])
@pytest.mark.parametrize("kind,affine", [("softmax", False), ("layer", False), ("layer", True),
                                         ("rms", False), ("rms", True)])
def test_fused_matches_torch_autograd(kind, affine, dim):
    got, want = _run(kind, dim, affine)
    for k, v in got.items():
        torch.testing.assert_close(v, want[k], **TOL, msg=lambda m: f"{kind} {k} over {dim}: {m}")


def test_fused_ops_are_single_primitives():
    """softmax / layer_norm / rms_norm build one fused node (plus affine mul/add), whose
    gradient is one fused backward node."""
    with md.Graph():
        x = md.param("x", [B, S, K])
        y = md.softmax(x, "seq")
        assert y.node.op.name == "softmax"
        assert md.layer_norm(x, "feat").node.op.name == "normalize"
        assert md.rms_norm(x, "feat").node.op.name == "rms_norm"
        (dx,) = md.grad(md.reduce_sum(y * y), [x])
        seen, todo = set(), [dx.node]
        while todo:
            n = todo.pop()
            seen.add(n.op.name)
            todo.extend(t.node for t in n.inputs)
        assert "softmax_backward" in seen and "exp" not in seen and "reduce_max" not in seen, seen


def test_simulated_mesh_with_softmax_dim_split():
    """A split softmax / normalised dim is gathered by the compiler: results equal dense."""
    KS, Q = md.Dim("key_seq", 8), md.Dim("query", 4)
    with md.Graph():
        x = md.param("att", [Q, KS])
        s = md.param("ln_s", [KS])
        w = md.input("w", [Q, KS])
        y = md.softmax(x, "key_seq")
        z = md.layer_norm(x * 1.5, "key_seq", s) + md.rms_norm(x, "key_seq")
        loss = md.reduce_sum(w * y) + md.reduce_sum(w * z)
        gx, gs = md.grad(loss, [x, s])
        outs = {"y": y, "z": z, "loss": loss, "gx": gx, "gs": gs}
        feeds = {"w": torch.randn(4, 8, generator=torch.Generator().manual_seed(1))}
        want = md.run_dense(outs, feeds)
        got = md.run_simulated(md.compile(outs, "model:2", "key_seq:model"), feeds)
    for k in outs:
        torch.testing.assert_close(got[k], want[k], **TOL, msg=lambda m: f"{k}: {m}")


def test_cross_entropy_vocab_split_stays_composite():
    """cross_entropy over a vocab dim split on 'model' must not gather the vocab dim."""
    N, V = md.Dim("batch", 4), md.Dim("vocab", 8)
    with md.Graph():
        logits = md.param("logits", [N, V])
        labels = md.input("labels", [N], dtype=torch.int64)
        loss = md.reduce_mean(md.cross_entropy(logits, labels, "vocab"))
        (g,) = md.grad(loss, [logits])
        feeds = {"labels": torch.tensor([0, 3, 7, 5])}
        want = md.run_dense({"loss": loss, "g": g}, feeds)
        got = md.run_simulated(md.compile({"loss": loss, "g": g}, "model:2", "vocab:model"), feeds)
    for k in want:
        torch.testing.assert_close(got[k], want[k], **TOL)
    ref = F.cross_entropy(md.run_dense({"l": logits})["l"], feeds["labels"])
    torch.testing.assert_close(want["loss"], ref, **TOL)
