"""Pipelined plans run on the simulated mesh give the dense program's loss and every gradient.

Covered: GPipe, 1F1B and ZB-H1, m in {1, 2, 4, 8} micro-batches, p in {2, 4} stages; the
stage axis next to data, tensor and both (3-D parallelism from one layout string);
a tied embedding (its gradient summed across the first and last stage); a stack of
MLP blocks; the default-size transformer; five SGD steps against five dense steps;
and the recorded timelines (peak activations: m for GPipe, p - rank for 1F1B, p for ZB-H1).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import meshdsl as md
from conftest import assert_matches_scaled
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.lowering.schedule_gen import peak_theory
from meshdsl.lowering.timeline import bubble_from_timeline
from meshdsl.train.step import TrainStep, training_outputs
from models.transformer import Config, build

# As tests/test_models.py: the pipelined program sums micro-batches and shards in
# another order than the dense one, so outputs differ by fp32 rounding only, a few
# ulps of each output's largest magnitude; 1e-5 of it keeps a margin, while a wrong
# micro-batch, a dropped stage or a doubled partial sum is off by O(1).
REL = 1e-5
CFG = dataclasses.replace(Config.tiny(), layers=4, batch=8)
_BUILT: dict = {}


def _reference(cfg=CFG):
    if cfg not in _BUILT:
        m = build(cfg)
        outs = training_outputs(m.loss, m.params, 0.1, with_grads=True)
        feeds = m.feeds(0)
        _BUILT[cfg] = (m, outs, feeds, md.run_dense(outs, feeds))
    return _BUILT[cfg]


def _assert_matches(got, want, what):
    assert_matches_scaled(got, want, what, REL)


def _run(outs, feeds, mesh, layout, m, schedule):
    plan = md.compile(outs, mesh, layout, microbatches=m, schedule=schedule)
    ex = md.Executor(plan, SimulatedComm(plan.mesh))
    return ex.full_outputs(ex.run(feeds)), ex, plan


@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zbh1"])
@pytest.mark.parametrize("p", [2, 4])
def test_transformer_matches_dense(p, schedule, m):
    _, outs, feeds, want = _reference()
    got, ex, _ = _run(outs, feeds, f"stage:{p}", "layer:stage", m, schedule)
    _assert_matches(got, want, f"p={p} {schedule} m={m}")
    stats = bubble_from_timeline(ex.last_timeline)
    assert len(stats.ranks) == p
    for r, rs in enumerate(stats.ranks):
        # Activations held at once, from the measured timeline: what the schedule promises.
        assert rs.peak_activations == peak_theory(schedule, p, m, r)
        assert 0 <= rs.idle_fraction < 1


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
def test_zbh1_runs_its_ws_where_the_schedule_places_them(p, m):
    _, outs, feeds, _ = _reference()
    _, ex, plan = _run(outs, feeds, f"stage:{p}", "layer:stage", m, "zbh1")
    sched = next(s for s in plan.steps if s.kind == "pipeline").args["program"].schedule
    for rank, recorded in enumerate(ex.last_timeline):
        want = [(a.kind, a.microbatch) for a in sched.actions[rank] if a.kind in ("F", "B", "W")]
        if rank == 0:   # a W right after its own B is that B's tail: not split off
            want = [k for k in want if k[0] != "W"]
        assert [(a.kind, a.microbatch) for a, _, _ in recorded if a.kind in ("F", "B", "W")] == want


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("mesh,layout", [
    ("stage:2; data:2", "layer:stage; batch:data"),
    ("stage:2; model:2", "layer:stage; heads:model; d_ff:model"),
    ("stage:2; data:2; model:2", "layer:stage; batch:data; heads:model; d_ff:model"),
    ("stage:2; data:2", "layer:stage; batch:data; params.d_model:data"),
])
def test_stage_axis_with_other_parallelism(mesh, layout, schedule):
    _, outs, feeds, want = _reference()
    got, _, _ = _run(outs, feeds, mesh, layout, 2, schedule)
    _assert_matches(got, want, f"{mesh} / {layout} {schedule}")


@pytest.mark.parametrize("p,m,schedule", [(2, 2, "gpipe"), (2, 4, "1f1b"), (4, 2, "1f1b"), (4, 4, "zbh1")])
def test_tied_embedding(p, m, schedule):
    _, outs, feeds, want = _reference(dataclasses.replace(CFG, tied=True))
    got, _, _ = _run(outs, feeds, f"stage:{p}", "layer:stage", m, schedule)
    _assert_matches(got, want, f"tied p={p} m={m} {schedule}")


def test_default_size_transformer():
    _, outs, feeds, want = _reference(Config())
    got, _, _ = _run(outs, feeds, "stage:2", "layer:stage", 2, "1f1b")
    _assert_matches(got, want, "default size")


def test_loss_only_runs_forward_actions():
    m, _, feeds, want = _reference()
    got, _, _ = _run({"loss": m.loss}, feeds, "stage:2", "layer:stage", 4, "1f1b")
    _assert_matches(got, {"loss": want["loss"]}, "loss only")


def test_microbatches_without_a_pipeline_accumulate_gradients():
    _, outs, feeds, want = _reference()
    got, _, _ = _run(outs, feeds, "data:2", "batch:data", 2, "gpipe")
    _assert_matches(got, want, "data:2 m=2")


def _mlp_stack():
    """A stack of residual MLP blocks over 'layer' (the MLP model with a layer dim)."""
    b, d, f, l = md.Dim("batch", 8), md.Dim("d_model", 4), md.Dim("d_ff", 8), md.Dim("layer", 4)
    with md.Graph("mlp_stack"):
        x = md.input("x", [b, d])
        y = md.input("y", [b, d])
        ps = {"w1": md.param("w1", [l, d, f]), "w2": md.param("w2", [l, f, d])}

        def block(h, p):
            u = md.relu(md.einsum("batch d_model, d_model d_ff -> batch d_ff", h, p["w1"]))
            return h + md.einsum("batch d_ff, d_ff d_model -> batch d_model", u, p["w2"])

        out = md.repeat(block, x, ps, "layer")
        loss = md.reduce_mean((out - y) * (out - y))
        grads = md.grad(loss, ps)
    gen = torch.Generator().manual_seed(3)
    feeds = {"x": torch.randn(8, 4, generator=gen), "y": torch.randn(8, 4, generator=gen)}
    return {"loss": loss, **{f"grad/{k}": g for k, g in grads.items()}}, feeds


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_mlp_stack(schedule):
    outs, feeds = _mlp_stack()
    want = md.run_dense(outs, feeds)
    got, _, _ = _run(outs, feeds, "stage:4; data:2", "layer:stage; batch:data", 2, schedule)
    _assert_matches(got, want, f"mlp stack {schedule}")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zbh1"])
def test_five_sgd_steps_match_dense(schedule):
    model = build(CFG)
    feeds = model.feeds(1)
    outs = training_outputs(model.loss, model.params, 0.1)
    params = md.run_dense(dict(model.params))  # the deterministic init (seed 0), as TrainStep uses
    dense_losses = []
    for _ in range(5):
        r = md.run_dense(outs, feeds, params)
        dense_losses.append(float(r["loss"]))
        params = {k: r[f"new/{k}"] for k in model.params}
    step = TrainStep(model.loss, model.params, "stage:2; data:2", "layer:stage; batch:data",
                     SimulatedComm(md.Mesh.parse("stage:2; data:2")), lr=0.1, microbatches=2, schedule=schedule)
    losses = [step(feeds)[0] for _ in range(5)]
    assert dense_losses[-1] < dense_losses[0]  # it trains
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(dense_losses), rtol=REL, atol=REL)
    full = step.full_params()
    _assert_matches(full, params, f"params after 5 steps ({schedule})")


def test_dropout_masks_follow_the_global_layer():
    """Each stage salts its kernels by the global layer index, so dropout drops what the dense program drops."""
    _, outs, feeds, want = _reference(dataclasses.replace(CFG, dropout=0.1, norm="rms", tied=True))
    got, _, _ = _run(outs, feeds, "stage:4", "layer:stage", 2, "1f1b")
    _assert_matches(got, want, "dropout")


def test_step_stats_count_the_pipeline_s_kernels_and_transfers():
    model = build(CFG)
    step = TrainStep(model.loss, model.params, "stage:2", "layer:stage", SimulatedComm(md.Mesh.parse("stage:2")),
                     microbatches=2, schedule="1f1b")
    _, stats = step(model.feeds(0), timed=True)
    assert stats.compute > 0 and stats.comm > 0
    assert stats.by_kind["send"] > 0 and stats.by_kind["recv"] > 0
    assert stats.compute + stats.comm <= stats.total


@pytest.mark.parametrize("mesh, layout, others", [("stage:2", "layer:stage", ()),
                                                  ("stage:2; data:2", "layer:stage; batch:data", ("data",))])
def test_microbatch_sums_accumulate_locally(mesh, layout, others):
    """Gradients and the loss are summed over the micro-batches on each stage as they finish,
    in place; what reaches the communicator is one allreduce per value over the other axes
    (none without data parallelism), never one over the micro-batch axis."""
    _, outs, feeds, want = _reference()
    plan = md.compile(outs, mesh, layout, microbatches=4, schedule="1f1b")
    comm = SimulatedComm(plan.mesh)
    ex = md.Executor(plan, comm)
    res = ex.run(feeds)
    reduced = [axes for kind, axes, _ in comm.log if kind == "allreduce"]
    assert all(axes == others for axes in reduced), reduced
    assert bool(reduced) == bool(others)
    _assert_matches(ex.full_outputs(res), want, f"{mesh} m=4")


def test_the_final_segment_may_overwrite_every_params_update():
    """Under donation (one real rank per process) each SGD update of the final segment is its
    param's last reader, so the pipeline lets it write in place; nothing else is donated."""
    from meshdsl.runtime.pipeline import _final_donations
    model = build(CFG)
    plan = md.compile(training_outputs(model.loss, model.params, 0.1), "stage:2", "layer:stage", microbatches=2,
                      schedule="1f1b")
    ex = md.Executor(plan, SimulatedComm(plan.mesh))
    step = next(s for s in plan.steps if s.kind == "pipeline")
    final = step.subplans[3].steps
    got = {final[j].outs[0] for j in _final_donations(ex.plan, step)}
    updates = {s.outs[0] for s in final if s.kind == "local" and s.args.get("inplace") is not None}
    assert got == updates and len(updates) == len(model.params)
    assert not ex.donates   # the simulated mesh holds both stages: it never overwrites


def _per_example_codes():
    """DeepSDF-style: the first carry is a learned param per example (it holds 'batch'), no input."""
    b, s, d, l = md.Dim("batch", 4), md.Dim("seq", 3), md.Dim("d_model", 2), md.Dim("layer", 2)
    with md.Graph("codes"):
        codes = md.param("codes", [b, s, d], scale=1.0)
        ps = {"w": md.param("w", [l, d], scale=1.0)}
        out = md.repeat(lambda h, p: md.tanh(h * p["w"]) + h, codes, ps, "layer")
        loss = md.reduce_sum(out * out)
        grads = md.grad(loss, {"codes": codes, **ps})
    return {"loss": loss, **{f"grad/{k}": g for k, g in grads.items()}}


@pytest.mark.parametrize("mesh,layout,schedule", [("stage:2", "layer:stage", "1f1b"),
                                                  ("stage:2", "layer:stage", "zbh1"),
                                                  ("data:2", "batch:data", "gpipe")])
def test_a_param_holding_the_examples_dim_is_cut_per_microbatch(mesh, layout, schedule):
    """Each micro-batch reads its own rows of the per-example param and gets their gradient; what
    reads the pipelined repeat's output runs per micro-batch too (it once ran before the schedule,
    reading a carry no action had written yet), and accumulation runs the forward one micro-batch
    at a time (not every step once, before the micro-batches).  Each rank's part is compared: the
    per-example gradient stays cut over the micro-batches, which real ranks hold without gathering."""
    outs = _per_example_codes()
    want = md.run_dense(outs, {})
    plan = md.compile(outs, mesh, layout, microbatches=2, schedule=schedule)
    forward = next(s for s in plan.steps if s.kind in ("pipeline", "accumulate")).subplans[1].steps
    assert any(s.kind in ("repeat", "local") and s.node is not None for s in forward)
    ex = md.Executor(plan, SimulatedComm(plan.mesh))
    got = ex.run({}, ex.init_params(0))
    for k, full in want.items():
        for r, (g, w) in enumerate(zip(got[k], ex.local_slices(plan.values[plan.outputs[k]], full))):
            if w is not None:   # fp32 sums in another order only (see REL above)
                torch.testing.assert_close(g, w, rtol=REL, atol=REL * float(full.abs().max()),
                                           msg=lambda m, k=k, r=r: f"{k} on rank {r}: {m}")
