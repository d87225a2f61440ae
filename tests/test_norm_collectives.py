"""Norms over a split dim (meshdsl/lowering/norms.py, meshdsl/ops/moments.py): the collectives they
send and the numbers they give.

A layer norm over ``d:model`` sent two dependent allreduces forward (the row means, then the
centred variances).  Now each rank's part gives its count, mean and centred M2, and Chan's
parallel-variance formula joins them after ONE collective: an allgather of the parts' two moments
a row on up to four ranks, else one allreduce of two fp64 sums a row, or (where the cost model
finds bytes outweigh latency) the two passes as before.  The backward sends one allreduce (its
two row sums packed); an RMS norm one each way.

Tolerances: fp32 1e-5 as tests/test_layernorm.py (the same sums in another order); bf16 1e-2 as
its bf16 case (8 significant bits); the large-offset case's is worked out where it is used.
Legend: ``x_bd`` = [batch, d].
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import meshdsl as md
from meshdsl.lowering.cost import CostModel
from meshdsl.ops.moments import row_moments

TOL = dict(rtol=1e-5, atol=1e-5)
B, D = md.Dim("batch", 8), md.Dim("d", 16)
NORMS = ("layer_norm", "rms_norm", "normalize")


def _graph(kind: str = "layer_norm", dtype=torch.float32) -> dict:
    """loss = sum(y * y * x) of the norm ``kind`` of x (cast to ``dtype``), and its gradients."""
    x_bd = md.param("x", [B, D], scale=1.0)
    s_d = md.param("s", [D], init="ones")
    xc = x_bd if dtype == torch.float32 else md.cast(x_bd, dtype)
    sc = s_d if dtype == torch.float32 else md.cast(s_d, dtype)
    if kind == "rms_norm":
        y = md.rms_norm(xc, "d", sc)
    else:
        y = md.layer_norm(xc, "d", sc if kind == "layer_norm" else None)
    y = y if dtype == torch.float32 else md.cast(y, torch.float32)
    loss = md.reduce_sum(y * y * x_bd)
    wrt = {"x": x_bd, **({"s": s_d} if kind != "normalize" else {})}
    return {"y": y, "loss": loss, **{f"d{k}": g for k, g in md.grad(loss, wrt).items()}}


def _params() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(8, 16, generator=g) * 2 + 0.5, "s": 1 + 0.2 * torch.randn(16, generator=g)}


def _sent(plan) -> list[tuple[str, str]]:
    """(kind, phase) of each collective the norms send (their composite's steps are labelled by them)."""
    return [(st.kind, st.phase) for st, _ in plan.walk() if st.is_collective
            and st.label.split("/")[0].removesuffix("_backward") in NORMS]


def _assert_dense(plan, outs, params, tol) -> None:
    want, got = md.run_dense(outs, {}, params), md.run_simulated(plan, {}, params)
    for k in outs:
        torch.testing.assert_close(got[k], want[k], **tol, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("mesh, forward", [("model:2", "allgather"),    # even parts
                                           ("model:3", "allgather"),    # 16 over 3: parts 6, 5, 5
                                           ("model:8", "allreduce")])   # the gather's bytes grow with ranks
def test_a_layer_norm_over_a_split_dim_sends_one_collective_each_way(mesh, forward):
    with md.Graph():
        outs = _graph()
        plan = md.compile(outs, mesh, "d:model")
        assert _sent(plan) == [(forward, "forward"), ("allreduce", "backward")]
        _assert_dense(plan, outs, _params(), TOL)


def test_bf16_over_an_uneven_split_gives_the_dense_numbers():
    with md.Graph():
        outs = _graph(dtype=torch.bfloat16)
        plan = md.compile(outs, "model:3", "d:model")
        assert _sent(plan) == [("allgather", "forward"), ("allreduce", "backward")]
        _assert_dense(plan, outs, _params(), dict(rtol=1e-2, atol=1e-2))


def test_an_rms_norm_sends_one_allreduce_each_way_and_normalize_recomputes_with_one():
    """``normalize`` (no affine) saves no statistics: its backward makes them again (one gather)
    before its own packed allreduce."""
    for kind, sent in (("rms_norm", [("allreduce", "forward"), ("allreduce", "backward")]),
                       ("normalize", [("allgather", "forward"), ("allgather", "backward"),
                                      ("allreduce", "backward")])):
        with md.Graph():
            outs = _graph(kind)
            plan = md.compile(outs, "model:3", "d:model")
            assert _sent(plan) == sent, kind
            _assert_dense(plan, outs, _params(), TOL)


@pytest.mark.parametrize("mesh, cost, dtype, form", [
    ("model:4", CostModel(), torch.float32, "part_moments"),      # a tie: 3 * 8 B a row either way
    ("model:8", CostModel(), torch.float32, "sum_moments"),
    ("model:8", CostModel(), torch.float64, "part_moments"),      # fp64 sums would cancel at fp64's precision
    ("model:8", CostModel(latency_s=0.0), torch.float32, None),   # bytes alone: two allreduces of 4 B a row
])
def test_the_form_is_the_cost_models_choice(mesh, cost, dtype, form):
    with md.Graph():
        x_bd = md.param("x", [B, D], dtype=dtype)
        loss = md.reduce_sum(md.layer_norm(x_bd, "d") ** 2)
        plan = md.compile({"loss": loss}, mesh, "d:model", cost=cost)
    ops = {st.op for st in plan.steps if st.kind == "local"} & {"part_moments", "sum_moments"}
    assert ops == ({form} if form else set()), ops
    assert len(_sent(plan)) == (1 if form else 2)


@pytest.mark.parametrize("mesh, cost", [("model:3", CostModel()), ("model:8", CostModel()),
                                        ("model:8", CostModel(latency_s=0.0))],
                         ids=["gathered parts", "fp64 sums", "two passes"])
def test_a_large_mean_offset_keeps_the_variance(mesh, cost):
    """x = 1000 + 0.1 * noise, where fp32's E[x^2] - E[x]^2 loses the variance whole (it comes out
    negative): each form gives torch's float64 layer norm of the same values.  Tolerance 2.5e-3:
    fp32's spacing at 1000 is 6.1e-5, so the row mean is rounded by about that, which is
    6.1e-4 of y at a std of 0.1; four such spacings.  torch's own fp32 kernel keeps to it too."""
    x = 1000 + 0.1 * torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    tol = dict(rtol=0, atol=2.5e-3)
    want = F.layer_norm(x.double(), (16,)).float()
    torch.testing.assert_close(F.layer_norm(x, (16,)), want, **tol)
    naive = (x - x.mean(-1, keepdim=True)) * ((x * x).mean(-1, keepdim=True) - x.mean(-1, keepdim=True) ** 2
                                              + 1e-5).rsqrt()
    assert not torch.allclose(naive, want, **tol)   # (NaN where the variance came out negative)
    with md.Graph():
        x_bd = md.input("x", [B, D])
        y = md.layer_norm(x_bd, "d")
        plan = md.compile({"y": y}, mesh, "d:model", cost=cost)
        torch.testing.assert_close(md.run_simulated(plan, {"x": x})["y"], want, **tol)


def test_the_parts_moments_joined_are_the_whole_rows():
    """The ops alone, densely: uneven parts (6, 5, 5) and fp64 sums give torch's mean and rstd of
    the whole rows (fp32: the parts' sums in another order)."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(2)) * 3 + 2
    var, mean = torch.var_mean(x, -1, correction=0)
    with md.Graph():
        x_bd = md.input("x", [B, D])
        parts, sums = row_moments(x_bd, "d", 1e-5, (6, 5, 5)), row_moments(x_bd, "d", 1e-5, None)
        got = md.run_dense({"pm": parts[0], "pr": parts[1], "sm": sums[0], "sr": sums[1]}, {"x": x})
    for form in "ps":
        torch.testing.assert_close(got[f"{form}m"], mean, **TOL)
        torch.testing.assert_close(got[f"{form}r"], (var + 1e-5).rsqrt(), **TOL)


def _on_ranks(comm):
    """Child side: the layer norm's plan over 16 split 3 ways, run on this process's rank."""
    from conftest import held_outputs_on_this_rank
    with md.Graph():
        outs = _graph()
        return held_outputs_on_this_rank(comm, md.compile(outs, "model:3", "d:model"), {})


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_gathered_moments_on_three_gloo_processes():
    from meshdsl.layout.mesh import Mesh
    from meshdsl.processes import launcher as launch
    from conftest import assert_ranks_match_dense
    results = launch.spawn(_on_ranks, 3, mesh=Mesh.parse("model:3"), timeout=150)
    with md.Graph():
        want = md.run_dense(_graph(), {})   # the params' own initial values, as each rank makes them
    assert_ranks_match_dense(results, want, rel=1e-5)
