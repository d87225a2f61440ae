"""Sharded optimizer state by layout (ZeRO-1/2/3) and accumulation: the same curve whatever the layout.

20 AdamW steps (with global-norm clipping) of the tiny transformer give the dense
program's losses under dense, DP, TP, DP+TP, ZeRO-1, ZeRO-2, FSDP and pipeline layouts,
on the simulated mesh and on gloo processes; the first step's global gradient norm is
the dense norm; ZeRO-2's plan reduce-scatters gradients and all-gathers params, with no
gradient allreduce; the memory report follows ZeRO arithmetic; ``microbatches=4``
without a pipeline equals one step on the 4x batch.
"""
from __future__ import annotations

import dataclasses
import math
import multiprocessing

import pytest
import torch

import meshdsl as md
from conftest import adamw_dense_curve
from meshdsl.processes import launcher as launch
from meshdsl.comm.distributed import TorchComm
from meshdsl.train.jobs import agree_plan
from models.transformer import Config, build

CFG = dataclasses.replace(Config.tiny(), layers=4, batch=8)
STEPS = 20
CLIP = 1.0  # the tiny transformer's first gradient norm is about 2.4, so the clip is active
# As tests/test_pipeline_exec.py: sharded and micro-batched programs sum in another
# order than the dense one (fp32 rounding only).  AdamW's normalised update carries
# those few-ulp differences forward, so after 20 steps the losses agree to ~3e-6
# relative; 1e-5 keeps a margin, while a wrong shard, a doubled or missing partial
# sum, or a bad state slice is off by far more.
REL = 1e-5

LAYOUTS = {
    "dense": ("data:1", ""),
    "dp": ("data:2", "batch:data"),
    "tp": ("model:2", "heads:model; d_ff:model"),
    "dp+tp": ("data:2; model:2", "batch:data; heads:model; d_ff:model"),
    "zero1": ("data:2", "batch:data; opt.d_model:data"),
    "zero2": ("data:2", "batch:data; grads.d_model:data; opt.d_model:data"),
    "fsdp": ("data:2", "batch:data; params.d_model:data"),
    "pipeline": ("stage:2", "layer:stage"),
}
_DENSE: dict = {}


def _opt():
    return md.AdamW(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def dense_curve(model, steps=STEPS, feeds=None):
    """The dense program's losses and gradient norms (cached per model and step count)."""
    key = (id(model), steps)
    if key not in _DENSE:
        _DENSE[key] = adamw_dense_curve(model, _opt(), CLIP, steps, feeds)
    return _DENSE[key]


def _train(model, mesh, layout, comm=None, microbatches=1, steps=STEPS):
    comm = comm or md.SimulatedComm(md.Mesh.parse(mesh))
    step = md.TrainStep(model.loss, model.params, mesh, layout, comm, optimizer=_opt(), clip_norm=CLIP,
                        microbatches=microbatches, schedule="1f1b")
    losses, norms = [], []
    for i in range(steps):
        losses.append(step(model.feeds(i))[0])
        norms.append(step.grad_norm)
    return step, losses, norms


@pytest.fixture(scope="module")
def model():
    return build(CFG)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_adamw_curve_is_the_dense_curve(model, name):
    mesh, layout = LAYOUTS[name]
    want_loss, want_norm = dense_curve(model)
    _, losses, norms = _train(model, mesh, layout, microbatches=2 if name == "pipeline" else 1)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_loss), rtol=REL, atol=0)
    # Exact clipping: the global norm of the first step (same params everywhere) is the dense norm.
    assert norms[0] == pytest.approx(want_norm[0], rel=REL)
    assert want_norm[0] > CLIP


def test_zero2_collectives_are_pinned(model):
    # one collective per gradient (bucket_mb=0): tests/test_bucket.py pins the bucketed plan
    step = md.TrainStep(model.loss, model.params, *LAYOUTS["zero2"], md.SimulatedComm(md.Mesh.parse("data:2")),
                        optimizer=_opt(), bucket_mb=0)
    totals = step.plan.totals_by_axis()
    scatter = [s for s, _ in step.plan.collectives() if s.kind == "reduce_scatter"]
    gather = [s for s, _ in step.plan.collectives() if s.kind == "allgather" and s.phase == "update"]
    d_model_params = [k for k, t in model.params.items() if "d_model" in t.shape]
    # every gradient with a d_model dim arrives by reduce_scatter over data ...
    assert {s.axes for s in scatter} == {("data",)} and len(scatter) == len(d_model_params)
    # ... and its updated param is all-gathered back to the (replicated) params layout
    assert {s.axes for s in gather} == {("data",)} and len(gather) == len(d_model_params)
    # the only allreduces left are scalars (the loss, the global norm); no gradient allreduce over data
    reduces = [s for s, _ in step.plan.collectives() if s.kind == "allreduce"]
    assert all(s.bytes == 4 for s in reduces) and totals[("allreduce", ("data",))]["count"] == len(reduces) <= 2


def test_zero1_updates_a_slice_without_reduce_scatter(model):
    step = md.TrainStep(model.loss, model.params, *LAYOUTS["zero1"], md.SimulatedComm(md.Mesh.parse("data:2")),
                        optimizer=_opt())
    kinds = step.plan.totals()
    # grads stay replicated (allreduce); the update runs on a local split and the new params are all-gathered
    assert "reduce_scatter" not in kinds and kinds["allgather"]["count"] > 0
    spec, xs = step.state()["opt/wq/exp_avg"]
    assert spec.sharding.axes_of("d_model") == ("data",) and xs[0].shape[1] == CFG.d_model // 2


def test_scope_names_are_checked(model):
    with pytest.raises(md.LayoutError, match="Did you mean 'opt'"):
        md.TrainStep(model.loss, model.params, "data:2", "batch:data; optim.d_model:data",
                     md.SimulatedComm(md.Mesh.parse("data:2")), optimizer=_opt())


def test_param_rule_beats_opt_rule(model):
    # the most specific rule wins: a rule naming the param lays out its state too, above 'opt.'
    mesh = "data:2; model:2"
    step = md.TrainStep(model.loss, model.params, mesh, "batch:data; opt.d_model:data; wq.d_model:model",
                        md.SimulatedComm(md.Mesh.parse(mesh)), optimizer=_opt())
    state = step.state()
    assert state["opt/wq/exp_avg"][0].sharding.axes_of("d_model") == ("model",)
    assert state["param/wq"][0].sharding.axes_of("d_model") == ("model",)
    assert state["opt/wk/exp_avg"][0].sharding.axes_of("d_model") == ("data",)
    assert state["param/wk"][0].sharding.axes_of("d_model") == ()
    assert state["opt/lnf/exp_avg"][0].sharding.axes_of("d_model") == ("data",)


def _bytes(model, pred):
    return sum(math.prod(t.shape.sizes) * 4 for t in model.params.values() if pred(t))


@pytest.mark.parametrize("name", ["dense", "zero1", "zero2", "fsdp"])
def test_memory_report_is_zero_arithmetic(model, name):
    mesh, layout = LAYOUTS[name] if name != "dense" else ("data:2", "batch:data")
    step = md.TrainStep(model.loss, model.params, mesh, layout, md.SimulatedComm(md.Mesh.parse(mesh)),
                        optimizer=_opt())
    rep = md.memory_report(step.plan)
    full = _bytes(model, lambda t: True)
    split = _bytes(model, lambda t: "d_model" in t.shape)  # the part a d_model rule shards
    sharded = full - split + split // 2  # 1/N of the sharded part on N=2 data ranks
    want = {"dense": (full, full, 2 * full), "zero1": (full, full, 2 * sharded),
            "zero2": (full, sharded, 2 * sharded), "fsdp": (sharded, sharded, 2 * sharded)}[name]
    assert (rep["params"], rep["grads"], rep["optimizer"]) == want
    assert rep["activations_peak"] > 0


def test_pipeline_memory_is_per_stage(model):
    step = md.TrainStep(model.loss, model.params, "stage:2", "layer:stage", md.SimulatedComm(md.Mesh.parse("stage:2")),
                        optimizer=_opt())
    rep = md.memory_report(step.plan, per_rank=True)
    full = _bytes(model, lambda t: True)
    stacked = _bytes(model, lambda t: "layer" in t.shape)
    # each stage holds half of the stacked layers; the other params live on the stages that read them
    assert all(r["params"] < full for r in rep["ranks"])
    assert sum(r["params"] for r in rep["ranks"]) >= stacked


def test_accumulation_equals_the_big_batch_step():
    big = build(dataclasses.replace(CFG, batch=8))

    def feeds(i):  # the same 8 sequences for both: the big batch, cut in 4 by microbatches=4
        return big.feeds(i)

    want, want_norm = dense_curve(big, steps=4, feeds=feeds)
    for mesh, layout in [("data:1", ""), ("data:2", "batch:data; grads.d_model:data; opt.d_model:data")]:
        step = md.TrainStep(big.loss, big.params, mesh, layout, md.SimulatedComm(md.Mesh.parse(mesh)),
                            optimizer=_opt(), clip_norm=CLIP, microbatches=4)
        assert step.plan.mesh.sizes["_mb"] == 4
        got = [step(feeds(i))[0] for i in range(4)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=REL, atol=0)
        assert step.grad_norm == pytest.approx(want_norm[3], rel=1e-4)  # after 3 steps: see REL

# --- gloo processes -----------------------------------------------------------------------------

GLOO = {
    2: ["zero2", "fsdp", "pipeline"],
    4: ["dp+tp", "zero2/4", "fsdp/4", "pipeline+dp"],
}
# Layouts for 4 processes: the data axis over all of them, or a pipeline beside it.
EXTRA = {"zero2/4": ("data:4", "batch:data; grads.d_model:data; opt.d_model:data"),
         "fsdp/4": ("data:4", "batch:data; params.d_model:data"),
         "pipeline+dp": ("stage:2; data:2", "layer:stage; batch:data")}


def _gloo_cases(rank, names):
    torch.set_num_threads(1)
    model = build(CFG)
    out = []
    for name in names:
        mesh, layout = EXTRA.get(name) or LAYOUTS[name]
        comm = TorchComm(mesh)
        step, losses, norms = _train(model, mesh, layout, comm, microbatches=2 if "pipeline" in name else 1)
        agree_plan(comm, step.plan)
        out.append((losses, norms))
    return out


# The 4-process case runs with -m slow: ZeRO-2, FSDP and the pipeline stay on 2 gloo processes, and
# every layout of LAYOUTS (dp+tp included) is checked on the simulated mesh above.
@pytest.mark.timeout(300)
@pytest.mark.parametrize("nproc", [pytest.param(n, marks=pytest.mark.slow) if n == 4 else n for n in sorted(GLOO)])
def test_gloo_curves_are_the_dense_curve(model, nproc):
    names = GLOO[nproc]
    results = launch.spawn(_gloo_cases, nproc, args=(names,), timeout=280)
    assert multiprocessing.active_children() == []
    want_loss, want_norm = dense_curve(model)
    for c, name in enumerate(names):
        held = [results[r][c] for r in range(nproc) if not math.isnan(results[r][c][0][0])]
        assert held, name  # some rank holds the loss (a pipeline's last stage)
        for losses, norms in held:
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_loss), rtol=REL, atol=0,
                                       msg=lambda m, name=name: f"{name} on {nproc} processes: {m}")
            assert norms[0] == pytest.approx(want_norm[0], rel=REL)
