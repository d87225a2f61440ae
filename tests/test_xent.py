"""The fused cross-entropy (ops/xent.py) and its lowering (lowering/xent.py).

A hypothesis property draws the logits' dims and where the class dim sits, and checks
the per-example loss and the logits' gradient against torch's ``F.cross_entropy`` and
autograd (fp32, rtol/atol 1e-5: the same sums in another order).  The plan tests pin
the lowering: one fused step forward and one backward where the class dim is whole,
the composite (no fused step, no gather of the logits, its backward in the backward
phase) where a layout splits it; both give the dense program's numbers.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import meshdsl as md

TOL = dict(rtol=1e-5, atol=1e-5)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=3), st.integers(2, 9), st.data())
def test_loss_and_gradient_match_torch(other_sizes, classes, data):
    pos = data.draw(st.integers(0, len(other_sizes)), label="class dim position")
    names = [f"d{i}" for i in range(len(other_sizes))]
    dims = [md.Dim(n, s) for n, s in zip(names, other_sizes)]
    logit_dims = dims[:pos] + [md.Dim("cls", classes)] + dims[pos:]
    gen = torch.Generator().manual_seed(len(other_sizes) * 100 + classes * 10 + pos)
    xv = torch.randn([d.size for d in logit_dims], generator=gen) * 3
    yv = torch.randint(0, classes, other_sizes, generator=gen)
    with md.Graph():
        x = md.param("x", logit_dims)
        y = md.input("y", dims, dtype=torch.int64)
        per = md.cross_entropy(x, y, "cls")
        loss = md.reduce_sum(per * 0.5)
        (gx,) = md.grad(loss, [x])
        got = md.run_dense({"per": per, "gx": gx}, {"y": yv}, params={"x": xv})
    xt = xv.clone().requires_grad_()
    want = F.cross_entropy(xt.movedim(pos, -1).reshape(-1, classes), yv.reshape(-1), reduction="none")
    (want * 0.5).sum().backward()
    torch.testing.assert_close(got["per"], want.detach().view(other_sizes), **TOL)
    torch.testing.assert_close(got["gx"], xt.grad, **TOL)


@pytest.fixture(scope="module")
def tiny():
    return md.load_model("transformer", tiny=True)


def _ops(plan):
    return [s.op for s in plan.steps if s.kind == "local"]


def _check(tiny, mesh, layout):
    outs = {"loss": tiny.loss, **{f"grad/{k}": g for k, g in tiny.grads().items()}}
    plan = md.compile(outs, mesh, layout)
    want = md.run_dense(outs, tiny.feeds(0))
    got = md.run_simulated(plan, tiny.feeds(0))
    for k, ref in want.items():
        torch.testing.assert_close(got[k], ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item(), msg=k)
    return plan


@pytest.mark.parametrize("mesh, layout", [("data:2", "batch:data"), ("model:2", "heads:model; d_ff:model")])
def test_a_whole_class_dim_runs_one_fused_step_each_way(tiny, mesh, layout):
    ops = _ops(_check(tiny, mesh, layout))
    assert ops.count("cross_entropy") == 1 and ops.count("cross_entropy_backward") == 1
    assert "one_hot" not in ops and "exp" not in ops


def test_a_split_class_dim_runs_the_composite_without_gathering_the_logits(tiny):
    plan = _check(tiny, "model:2", "heads:model; d_ff:model; vocab:model")
    assert not {"cross_entropy", "cross_entropy_backward"} & set(_ops(plan))
    xent = [s for s in plan.steps if s.label.startswith(("cross_entropy/", "cross_entropy_backward/"))]
    assert {s.phase for s in xent if s.label.startswith("cross_entropy_backward/")} == {"backward"}
    assert {s.kind for s in xent} <= {"local", "allreduce"}    # max and sums reduced, never gathered
    logits = [s for s in plan.steps if s.kind == "allgather"   # the embedding table's gather is not this
              and any({"vocab", "seq"} <= set(plan.values[v].shape.names) for v in s.ins)]
    assert logits == []


@pytest.mark.parametrize("mesh, layout", [("", ""), ("x:2", "vocab:x"), ("x:2", "batch:x")])
def test_a_label_outside_the_class_dim_is_a_clear_error_on_every_layout(mesh, layout):
    """An ignore_index of -100 fed straight in: the dense kernel would raise torch's own error and a
    split class dim's composite would silently give the logsumexp alone (a loss that depends on
    the layout); every layout raises the same GraphError, naming the range and the masking fix."""
    b, v = md.Dim("batch", 4), md.Dim("vocab", 6)
    with md.Graph():
        x = md.param("x", [b, v], scale=1.0)
        lab = md.input("lab", [b], dtype=torch.int64)
        ce = md.cross_entropy(x, lab, "vocab")
    bad = {"lab": torch.tensor([1, -100, 5, 3])}
    run = (lambda f: md.run_dense({"ce": ce}, f)) if not mesh else \
        (lambda f: md.run_simulated(md.compile({"ce": ce}, mesh, layout), f))
    with pytest.raises(md.GraphError, match=r"(?s)cross_entropy: labels range over \[-100, \d\], outside dim "
                                            r"'vocab' of size 6.*Fix: to leave out positions labelled.*ignore_index=-100"):
        run(bad)
    good = {"lab": torch.tensor([1, 0, 5, 3])}
    torch.testing.assert_close(run(good)["ce"], md.run_dense({"ce": ce}, good)["ce"], rtol=1e-6, atol=1e-6)


def test_a_split_class_dims_composite_shares_the_users_own_logsumexp():
    """PPO's ``logits - logsumexp(logits)`` beside ``cross_entropy(logits, action)`` under a
    split class dim: the composite's logsumexp is the user's (same max, same sum), so the max and
    the sum are allreduced once each forward (3 with the entropy's sum, was 5), and the numbers
    are the dense program's (fp32 on 8-class rows: 1e-6)."""
    b, a = md.Dim("batch", 4), md.Dim("act", 8)
    with md.Graph():
        x = md.param("x", [b, a], scale=1.0)
        lab = md.input("lab", [b], dtype=torch.int64)
        logp_all = x - md.logsumexp(x, "act")
        entropy = -md.reduce_sum(md.exp(logp_all) * logp_all, "act")
        loss = md.reduce_sum(md.cross_entropy(x, lab, "act") - 0.1 * entropy)
        outs = {"loss": loss, **md.grad(loss, {"x": x})}
    plan = md.compile(outs, "model:2", "act:model")
    feeds = {"lab": torch.tensor([1, 0, 7, 3])}
    want, got = md.run_dense(outs, feeds), md.run_simulated(plan, feeds)
    for k, ref in want.items():
        torch.testing.assert_close(got[k], ref, rtol=1e-6, atol=1e-6, msg=k)
    fwd = [s for s in plan.steps if s.is_collective and s.phase == "forward"]
    assert [s.kind for s in fwd].count("allreduce") == 3, [s.label for s in fwd]


@pytest.mark.parametrize("smoothing, ignore", [(0.1, None), (0.0, -100), (0.2, -100)])
def test_label_smoothing_and_ignore_index_are_torchs(smoothing, ignore):
    """torch's options: the smoothed target's loss, ignored labels at 0 with no gradient; the
    same numbers with the class dim split (vocab:model, uneven over 3) and the batch split."""
    B, S, V = 2, 5, 7
    gen = torch.Generator().manual_seed(3)
    xv, yv = torch.randn(B, S, V, generator=gen), torch.randint(0, V, (B, S), generator=gen)
    if ignore is not None:
        yv[0, 2] = yv[1, 4] = ignore
    with md.Graph():
        x = md.input("x", [md.Dim("batch", B), md.Dim("seq", S), md.Dim("vocab", V)])
        y = md.input("y", [md.Dim("batch", B), md.Dim("seq", S)], dtype=torch.int64)
        per = md.cross_entropy(x, y, "vocab", label_smoothing=smoothing, ignore_index=ignore)
        (gx,) = md.grad(md.reduce_sum(per * 0.5), [x])
        outs, feeds = {"per": per, "gx": gx}, {"x": xv, "y": yv}
        got = md.run_dense(outs, feeds)
        splits = {lay: md.run_simulated(md.compile(outs, mesh, lay), feeds)
                  for mesh, lay in (("model:3", "vocab:model"), ("data:2", "batch:data"))}
    xt = xv.clone().requires_grad_()
    want = F.cross_entropy(xt.reshape(-1, V), yv.reshape(-1), reduction="none", label_smoothing=smoothing,
                           ignore_index=-100 if ignore is None else ignore).reshape(B, S)
    (gt,) = torch.autograd.grad((want * 0.5).sum(), [xt])
    torch.testing.assert_close(got["per"], want.detach(), **TOL)
    torch.testing.assert_close(got["gx"], gt, **TOL)
    if ignore is not None:
        assert got["per"][0, 2] == 0 and not got["gx"][0, 2].any()
    for lay, r in splits.items():
        for k in outs:
            torch.testing.assert_close(r[k], got[k], **TOL, msg=lambda m, k=k, lay=lay: f"{lay} {k}: {m}")


def test_bad_options_name_the_rule():
    with md.Graph():
        x = md.input("x", [md.Dim("batch", 2), md.Dim("vocab", 3)])
        y = md.input("y", [md.Dim("batch", 2)], dtype=torch.int64)
        with pytest.raises(md.ShapeError, match=r"label_smoothing=1.5 is not a number in \[0, 1\]"):
            md.cross_entropy(x, y, "vocab", label_smoothing=1.5)
        with pytest.raises(md.ShapeError, match=r"ignore_index=-1.0 is not an int"):
            md.cross_entropy(x, y, "vocab", ignore_index=-1.0)


def test_gelu_tanh_is_torchs_approximation():
    xv = torch.randn(4, 5, generator=torch.Generator().manual_seed(4)) * 3
    with md.Graph():
        x = md.input("x", [md.Dim("a", 4), md.Dim("b", 5)])
        y = md.gelu(x, approximate="tanh")
        (gx,) = md.grad(md.reduce_sum(y * y), [x])
        got = md.run_dense({"y": y, "gx": gx}, {"x": xv})
        with pytest.raises(md.ShapeError, match=r"approximate='erf' is not 'none' or 'tanh'"):
            md.gelu(x, approximate="erf")
    xt = xv.clone().requires_grad_()
    want = F.gelu(xt, approximate="tanh")
    (gt,) = torch.autograd.grad((want * want).sum(), [xt])
    torch.testing.assert_close(got["y"], want.detach(), rtol=0, atol=0)   # torch's own kernel
    torch.testing.assert_close(got["gx"], gt, **TOL)
