"""Optimizers as graph ops (:mod:`meshdsl.train.optimizers`): each against a plain-torch
reference written here, schedules, exact global-norm clipping, and state round trips.

The model is a two-layer tanh MLP; the reference computes its gradients with torch
autograd and applies the update rule written out below, independently of the kernels.
"""
from __future__ import annotations

import math

import pytest
import torch

import meshdsl as md
from meshdsl.ops.leaf import init_value

B, DIN, DH = 8, 6, 4
# fp32 throughout: the same ops in a different order (sharded sums) differ by a few ulps per step.
TOL = dict(rtol=1e-5, atol=1e-6)


def _model():
    with md.Graph() as g:
        x = md.input("x", [md.Dim("batch", B), md.Dim("d_in", DIN)])
        w1 = md.param("w1", [md.Dim("d_in", DIN), md.Dim("d_h", DH)])
        b1 = md.param("b1", [md.Dim("d_h", DH)], init=0.1)
        w2 = md.param("w2", [md.Dim("d_h", DH)])
        h = md.tanh(md.einsum("batch d_in, d_in d_h -> batch d_h", x, w1) + b1)
        loss = md.reduce_mean(md.einsum("batch d_h, d_h -> batch", h, w2) ** 2)
    return g, loss, {"w1": w1, "b1": b1, "w2": w2}


def _feeds(step):
    return {"x": torch.randn(B, DIN, generator=torch.Generator().manual_seed(step))}


def _torch_loss(p, x):
    h = torch.tanh(x @ p["w1"] + p["b1"])
    return ((h @ p["w2"]) ** 2).mean()


def _torch_grads(p, x):
    q = {k: v.detach().clone().requires_grad_(True) for k, v in p.items()}
    loss = _torch_loss(q, x)
    loss.backward()
    return loss.item(), {k: v.grad for k, v in q.items()}


def _init(params):
    return {k: init_value(t, 0) for k, t in params.items()}


def _clip(grads, c):
    norm = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
    if c is None:
        return grads, norm
    f = min(1.0, c / (norm + 1e-6))
    return {k: g * f for k, g in grads.items()}, norm


def ref_adamw(p, x, st, t, lr, b1, b2, eps, wd, clip=None):
    loss, g = _torch_grads(p, x)
    g, norm = _clip(g, clip)
    for k in p:
        m, v = st.setdefault(k, (torch.zeros_like(p[k]), torch.zeros_like(p[k])))
        m = b1 * m + (1 - b1) * g[k]
        v = b2 * v + (1 - b2) * g[k] ** 2
        mhat, vhat = m / (1 - b1 ** t), v / (1 - b2 ** t)
        p[k] = p[k] * (1 - lr * wd) - lr * mhat / (vhat.sqrt() + eps)
        st[k] = (m, v)
    return loss, norm


def ref_sgd(p, x, st, lr, mom, wd):
    loss, g = _torch_grads(p, x)
    for k in p:
        d = g[k] + wd * p[k]
        if mom:
            d = st[k] * mom + d if k in st else d
            st[k] = d
        p[k] = p[k] - lr * d
    return loss


def ref_adafactor(p, x, st, t, lr, decay, eps, d, wd):
    loss, g = _torch_grads(p, x)
    rho = t ** decay  # 1 - beta2_t
    for k in p:
        g2 = g[k] ** 2 + eps
        if g[k].dim() >= 2:
            r, c = st.get(k, (torch.zeros(g2.shape[0]), torch.zeros(g2.shape[1])))
            r = (1 - rho) * r + rho * g2.mean(1)
            c = (1 - rho) * c + rho * g2.mean(0)
            st[k] = (r, c)
            v = torch.outer(r, c) / r.mean()
        else:
            v = (1 - rho) * st.get(k, torch.zeros_like(g2)) + rho * g2
            st[k] = v
        u = g[k] / v.sqrt()
        u = u / max(1.0, float(u.pow(2).mean().sqrt()) / d)
        p[k] = p[k] * (1 - lr * wd) - lr * u
    return loss


def _step(opt, mesh="data:1", layout="", **kw):
    g, loss, params = _model()
    return md.TrainStep(loss, params, mesh, layout, md.SimulatedComm(md.Mesh.parse(mesh)), optimizer=opt, **kw), params


@pytest.mark.parametrize("mesh,layout", [("data:1", ""), ("data:2", "batch:data"),
                                         ("data:2", "batch:data; opt.d_h:data"),
                                         ("data:2", "batch:data; params.d_h:data")])
def test_adamw_matches_reference(mesh, layout):
    opt = md.AdamW(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    step, params = _step(opt, mesh, layout)
    p, st = _init(params), {}
    for i in range(10):
        loss = step(_feeds(i))[0]
        ref = ref_adamw(p, _feeds(i)["x"], st, i + 1, 1e-2, 0.9, 0.95, 1e-8, 0.1)[0]
        assert loss == pytest.approx(ref, rel=1e-5)
    for k, v in step.full_params().items():
        torch.testing.assert_close(v, p[k], **TOL)


def test_adamw_kernel_reads_a_strided_gradient_by_its_strides():
    # a layer loop's gradients can be views into their buckets (runtime/layers.py); torch's fused
    # AdamW kernel reads its tensors as dense memory, so the kernel must not hand it one
    from meshdsl.ops.optim import _adamw
    flat = torch.randn(4, 20)
    g = flat[:, 4:12].view(4, 2, 4)
    hyper = [torch.tensor(x) for x in (0.1, 0.9, 0.99, 1e-8, 0.01, 1.0, 1.0)]
    p = torch.randn(4, 2, 4)
    got = _adamw(p.clone(), g, torch.zeros_like(p), torch.zeros_like(p), hyper)
    want = _adamw(p.clone(), g.contiguous(), torch.zeros_like(p), torch.zeros_like(p), hyper)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("mesh,layout", [("data:1", ""), ("data:2", "batch:data")])  # data:1: in-place kernels
@pytest.mark.parametrize("mom,wd", [(0.0, 0.0), (0.9, 0.01)])
def test_sgd_matches_reference(mom, wd, mesh, layout):
    step, params = _step(md.SGD(lr=0.1, momentum=mom, weight_decay=wd), mesh, layout)
    p, st = _init(params), {}
    for i in range(8):
        step(_feeds(i))
        ref_sgd(p, _feeds(i)["x"], st, 0.1, mom, wd)
    for k, v in step.full_params().items():
        torch.testing.assert_close(v, p[k], **TOL)
    assert ("opt/w1/momentum_buffer" in step.plan.params) == bool(mom)


@pytest.mark.parametrize("mesh,layout", [("data:1", ""), ("data:2; model:2", "batch:data; d_h:model"),
                                         ("data:2", "batch:data; opt.d_in:data; opt.d_h:data")])
def test_adafactor_matches_reference(mesh, layout):
    # the row/column means reduce over whatever axes split the factored moments
    opt = md.Adafactor(lr=1e-2, beta2_decay=-0.8, eps=1e-30, clip_threshold=1.0, weight_decay=0.01)
    step, params = _step(opt, mesh, layout)
    p, st = _init(params), {}
    for i in range(8):
        step(_feeds(i))
        ref_adafactor(p, _feeds(i)["x"], st, i + 1, 1e-2, -0.8, 1e-30, 1.0, 0.01)
    for k, v in step.full_params().items():
        torch.testing.assert_close(v, p[k], **TOL)
    # factored second moments: a row and a column statistic for the matrix, one full one for vectors
    assert {"opt/w1/exp_avg_sq_row", "opt/w1/exp_avg_sq_col", "opt/w2/exp_avg_sq"} <= set(step.plan.params)


def test_cosine_schedule():
    s = md.cosine_schedule(1.0, warmup_steps=4, total_steps=12, min_lr=0.1)
    assert [s(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s(8) == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the decay
    assert s(12) == s(100) == 0.1
    assert all(s(i) >= s(i + 1) for i in range(4, 15))
    with pytest.raises(md.MeshDSLError, match="warmup"):
        md.cosine_schedule(1.0, warmup_steps=5, total_steps=3)


def test_scheduled_lr_is_fed_without_recompiling():
    sched = md.cosine_schedule(2e-2, warmup_steps=2, total_steps=6)
    step, params = _step(md.AdamW(weight_decay=0.0), "data:2", "batch:data")
    plan, p, st = step.plan, _init(params), {}
    for i in range(6):
        step(_feeds(i), lr=sched(i))
        ref_adamw(p, _feeds(i)["x"], st, i + 1, sched(i), 0.9, 0.95, 1e-8, 0.0)
    assert step.plan is plan and "opt/lr" in plan.inputs
    for k, v in step.full_params().items():
        torch.testing.assert_close(v, p[k], **TOL)


@pytest.mark.parametrize("mesh,layout", [("data:1", ""), ("data:2", "batch:data"), ("model:2", "d_h:model"),
                                         ("data:2; model:2", "batch:data; d_h:model"),
                                         ("data:2", "batch:data; grads.d_in:data; opt.d_in:data"),
                                         ("data:2", "batch:data; params.d_in:data")])
def test_clipping_uses_the_exact_global_norm(mesh, layout):
    step, params = _step(md.AdamW(lr=1e-2), mesh, layout, clip_norm=0.05)
    p, st = _init(params), {}
    for i in range(5):
        step(_feeds(i))
        norm = ref_adamw(p, _feeds(i)["x"], st, i + 1, 1e-2, 0.9, 0.95, 1e-8, 0.1, clip=0.05)[1]
        assert step.grad_norm == pytest.approx(norm, rel=1e-5)
        assert norm > 0.05  # the clip is active, so the factor matters
    for k, v in step.full_params().items():
        torch.testing.assert_close(v, p[k], **TOL)
    # the norm's partial sums reduce once per set of axes: at most one scalar allreduce per mesh-axis subset
    scalar = [s for s, _ in step.plan.collectives() if s.kind == "allreduce" and s.bytes == 4
              and s.op == "scalar_sum"]
    assert len(scalar) == len({s.axes for s in scalar}) <= 3
    # a split gradient leaves its sum of squares partial; replicated ones need no reduction at all
    assert bool(scalar) == any(r in layout for r in ("d_h:model", "d_in:data"))


def test_state_round_trip():
    opt = md.AdamW(lr=1e-2)
    a, _ = _step(opt, "data:2", "batch:data; opt.d_h:data")
    for i in range(3):
        a(_feeds(i))
    saved = a.state()
    assert {"param/w1", "opt/w1/exp_avg", "opt/w1/exp_avg_sq", "opt/step"} <= set(saved)
    assert int(saved["opt/step"][1][0]) == 3
    spec, xs = saved["opt/w1/exp_avg"]
    assert spec.sharding.axes_of("d_h") == ("data",) and tuple(xs[0].shape) == (DIN, DH // 2)
    b, _ = _step(opt, "data:2", "batch:data; opt.d_h:data")
    b.load_state(saved)
    for i in range(3, 5):
        assert a(_feeds(i))[0] == b(_feeds(i))[0]
    for k, v in a.full_params().items():
        torch.testing.assert_close(b.full_params()[k], v, rtol=0, atol=0)
    with pytest.raises(md.GraphError, match="missing"):
        b.load_state({k: v for k, v in saved.items() if k != "opt/step"})


def test_state_checkpoint_reshards_between_zero_layouts(tmp_path):
    from meshdsl.train.checkpoint import load_checkpoint, save_checkpoint

    opt = md.AdamW(lr=1e-2)
    a, _ = _step(opt, "data:2", "batch:data; opt.d_h:data")   # ZeRO-1
    for i in range(3):
        a(_feeds(i))
    path = save_checkpoint(tmp_path, 3, a.state(), a.executor.comm)
    b, _ = _step(opt, "data:2", "batch:data; params.d_in:data")  # FSDP: another slicing of params and state
    want = {k: spec for k, (spec, _) in b.state().items()}
    b.load_state(load_checkpoint(path, want, "data:2"))
    assert b.step_count == 3
    for i in range(3, 6):
        # the same numbers, summed in another order: fp32 rounding only (see TOL)
        assert b(_feeds(i))[0] == pytest.approx(a(_feeds(i))[0], rel=1e-5)
    for k, v in a.full_params().items():
        torch.testing.assert_close(b.full_params()[k], v, **TOL)


@pytest.mark.parametrize("make,word", [
    (lambda: md.AdamW(betas=(0.9, 1.0)), "betas"),
    (lambda: md.AdamW(eps=0.0), "eps"),
    (lambda: md.SGD(lr=float("nan")), "lr"),
    (lambda: md.SGD(momentum=-0.5), "momentum"),
    (lambda: md.Adafactor(beta2_decay=0.8), "beta2_decay"),
    (lambda: md.Adafactor(clip_threshold=0.0), "clip_threshold"),
])
def test_bad_hyperparameters_are_clean_errors(make, word):
    with pytest.raises(md.MeshDSLError, match=word):
        make()


def test_bad_clip_norm_is_a_clean_error():
    with pytest.raises(md.GraphError, match="clip_norm"):
        _step(md.AdamW(), clip_norm=-1.0)
