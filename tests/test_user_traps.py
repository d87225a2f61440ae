"""Traps and small API gaps held-out users met: a params dict keyed by other names than its
params' (they stayed frozen, silently), ``g.params()``, ``md.constant(number, dims)`` and
``md.logaddexp``.  Legend: batch (b) 4, d 3, heads (h) 2."""
from __future__ import annotations

import pytest
import torch

import meshdsl as md
from meshdsl.ops.precision import rule_for
from meshdsl.train.optimizers import state_param

B, D, H = md.Dim("batch", 4), md.Dim("d", 3), md.Dim("heads", 2)


def _feeds(seed=0):
    return {"x": torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))}


def _graph():
    """Two params, one of them scoped by a level's name (``level0.w``) as a user's loop makes it."""
    with md.Graph("traps") as g:
        x = md.input("x", [B, D])
        w, v = md.param("level0.w", [D], scale=1.0), md.param("v", [D], scale=1.0)
        loss = md.reduce_mean((x * w * v) ** 2)
    return g, loss, x, w, v


def _levels(w, v):
    """The held-out user's loop: one short key per level, so level 1's param replaces level 0's."""
    params = {}
    for p in (w, v):
        params.update({"w": p})
    return params


# (params dict from (x, w, v), texts the error names: the key and what it holds)
BAD_PARAMS = {
    "short_key": (lambda x, w, v: {"w": w, "v": v}, ["'w': holds param 'level0.w'; key it as 'level0.w'"]),
    "swapped": (lambda x, w, v: {"v": w, "level0.w": v},
                ["'v': holds param 'level0.w'", "'level0.w': holds param 'v'"]),
    "same_param_twice": (lambda x, w, v: {"level0.w": w, "v": w}, ["'v': holds param 'level0.w'"]),
    "an_input": (lambda x, w, v: {"x": x, "v": v}, ["'x': Tensor(x", "not by md.param"]),
    "an_activation": (lambda x, w, v: {"wv": w * v}, ["'wv': Tensor(mul", "made by op 'mul'"]),
    "not_a_tensor": (lambda x, w, v: {"v": torch.zeros(3)}, ["'v': a Tensor, not a meshdsl Tensor"]),
}


@pytest.mark.parametrize("case", sorted(BAD_PARAMS))
def test_a_params_item_that_would_not_train_its_param_is_refused(case):
    make, texts = BAD_PARAMS[case]
    g, loss, x, w, v = _graph()
    with pytest.raises(md.ModelError) as info:
        md.Model(g, loss, make(x, w, v), _feeds)
    msg = str(info.value)
    assert "Model:" in msg and "Rule:" in msg and "Fix:" in msg and "p.name: p" in msg, msg
    for t in texts:
        assert t in msg, f"{t!r} not in:\n{msg}"
    # TrainStep takes the same dict (md.fit's steps, a hand-written loop): the same refusal
    with pytest.raises(md.GraphError, match="would not train their param"):
        md.TrainStep(loss, make(x, w, v), "data:1", "", md.SimulatedComm(md.Mesh.parse("data:1")))


def test_a_per_level_key_reused_is_refused_and_a_param_of_another_graph_too():
    g, loss, x, w, v = _graph()
    with pytest.raises(md.ModelError, match="'w': holds param 'v'"):
        md.Model(g, loss, _levels(w, v), _feeds)
    with pytest.raises(md.ModelError, match="belongs to another graph 'traps', not to the model's graph 'another'"):
        md.Model(md.Graph("another"), loss, {"v": v}, _feeds)
    with pytest.raises(md.ModelError, match="params is a list, not a dict"):
        md.Model(g, loss, [w, v], _feeds)


def test_g_params_lists_the_graphs_params_and_every_one_trains():
    """``g.params()``: a new dict by name, without the optimizer state a step adds; a Model built
    from it trains each param: one SGD step on 2 simulated ranks equals ``p - lr * grad``."""
    g, loss, x, w, v = _graph()
    params = g.params()
    assert params == {"level0.w": w, "v": v} and params is not g.params
    model = md.Model(g, loss, params, _feeds)
    state_param(v, "exp_avg")        # what a TrainStep with AdamW adds to the graph
    assert "opt/v/exp_avg" in g.params and g.params() == {"level0.w": w, "v": v}
    mesh = md.Mesh.parse("data:2")
    sgd = md.TrainStep(model.loss, model.params, mesh, "batch:data", md.SimulatedComm(mesh), lr=0.5)
    start = sgd.full_params()
    grads = md.run_dense(model.grads(), _feeds(), params=start)
    sgd(_feeds())
    after = sgd.full_params()
    for k in ("level0.w", "v"):
        assert not torch.equal(after[k], start[k]), k
        # fp32: the same kernels summed in another order over 2 ranks, a few ulps of |p| ~ 1
        torch.testing.assert_close(after[k], start[k] - 0.5 * grads[k], rtol=1e-6, atol=1e-6)


def test_a_number_filled_over_dims_is_a_constant_sliced_by_the_layout():
    with md.Graph():
        w = md.param("w", [B, H], scale=1.0)
        zero, three, one = md.constant(0.5, [B, H]), md.constant(3, [B], dtype=torch.int64), md.constant(1, [H])
        y = w * zero + md.cast(three, torch.float32) * one
        outs = {"y": y, **md.grad(md.reduce_sum(y * y), {"w": w})}
    assert (zero.shape.names, zero.dtype, three.dtype, one.dtype) == (("batch", "heads"), torch.float32,
                                                                     torch.int64, torch.float32)
    dense = md.run_dense(outs)
    params = md.run_dense({"w": w})
    # exact: 0.5 * w + 3 is one rounding either way
    torch.testing.assert_close(dense["y"], params["w"] * 0.5 + 3.0, rtol=0, atol=0)
    assert md.check(outs, "data:2; model:2", "batch:data; heads:model", {}).ok
    with md.Graph(), pytest.raises(md.ShapeError, match="'batch' is no Dim") as info:
        md.constant(0.0, ["batch"])
    assert "x.shape['batch']" in str(info.value)


def test_logaddexp_is_stable_with_torchs_gradient():
    """Operands of a few hundred overflow exp in fp32; the op's value and gradient are float64
    torch's within fp32 rounding of their size."""
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(4, 3, generator=gen) * 200, torch.randn(3, generator=gen) * 200
    with md.Graph():
        xa, xb = md.input("a", [B, D]), md.input("b", [D])
        y = md.logaddexp(xa, xb)
        outs = {"y": y, "tie": md.logaddexp(xb, xb), **md.grad(md.reduce_sum(y * y), {"a": xa, "b": xb})}
        with pytest.raises(md.ShapeError, match="logaddexp is defined on floating-point tensors"):
            md.logaddexp(md.cast(xa, torch.int64), 1)
    got = md.run_dense(outs, {"a": a, "b": b})
    ta, tb = a.double().requires_grad_(), b.double().requires_grad_()
    ref = torch.logaddexp(ta, tb)
    (ref * ref).sum().backward()
    assert torch.isfinite(got["y"]).all() and (a.exp().isinf().any() or b.exp().isinf().any())
    # fp32 rounding of values up to ~500 (eps 1.2e-7 relative); gradients up to ~2 * 500 * 4
    torch.testing.assert_close(got["y"].double(), ref, rtol=2e-7, atol=1e-5)
    torch.testing.assert_close(got["tie"].double(), tb.detach() + torch.log(torch.tensor(2.0)).double(),
                               rtol=2e-7, atol=1e-5)
    torch.testing.assert_close(got["a"].double(), ta.grad, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(got["b"].double(), tb.grad, rtol=1e-6, atol=1e-4)
    assert rule_for("logaddexp", "y") == "follow"
