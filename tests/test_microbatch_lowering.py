"""Micro-batched plans move micro-batches only by summing them, so real processes can run them.

With ``microbatches=m`` the compiler lowers on the mesh plus the virtual axis ``_mb``;
on torch.distributed a process holds all ``m`` of its micro-batches and can fold them
by sums only (``comm/microbatch.py``).  These tests pin that, over the layout search's whole
space (every model in models/, 2 and 4 processes), a micro-batched plan has no
collective over ``_mb`` other than an allreduce, that micro-batching never makes a
layout fail to compile, that the compiler refuses such a move outright, and that a
layout which used to gather micro-batches (data parallel MLP with accumulation) now
runs on 2 gloo processes and matches the dense program.
"""
from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch

import meshdsl as md
from meshdsl.errors import LayoutError, MeshDSLError
from meshdsl.comm.distributed import TorchComm
from meshdsl.processes.launcher import spawn
from meshdsl.layout.sharding import Sharding
from meshdsl.lowering.compiler import Lowerer, compile as compile_plan
from meshdsl.lowering.pipeline import MB_AXIS
from meshdsl.lowering.relayout import plan_moves, relayout_cost
from meshdsl.search.space import candidates
from meshdsl.train.jobs import check_job

MODELS = sorted(p.stem for p in (Path(__file__).parent.parent / "models").glob("*.py") if p.stem != "__init__")

# The candidates of the search space that compile neither with micro-batches nor without: the
# space builds its strings from the model's dims and leaves whether they compile to the search,
# which drops these.  Keyed by (model, processes): the first line of the compiler's error -> why.
# Empty today: the space offers a pipeline only over a dim a repeat scans over (moe unrolls its
# layers), and drops a candidate that puts one dim on two axes (moe's experts:data with
# experts:model) before compiling.
REFUSED_EITHER_WAY: dict = {}


def _mb_moves(plan) -> list[str]:
    """The collectives of ``plan`` (sub-plans included) over ``_mb`` that are not sums (an
    allreduce, or a bucket of them: a pipeline's final gradient reductions)."""
    return [f"{s.kind} over {s.axes} ({s.label})" for s, _ in plan.collectives()
            if MB_AXIS in s.axes and s.kind not in ("allreduce", "bucket_allreduce")]


# The largest 4-process spaces (transformer 8 s, moe, vit) run with -m slow: every model keeps its
# 2-process space, and llama and mlp their 4-process one (two-axis meshes)
_SLOW_SPACES = {("transformer", 4), ("moe", 4), ("vit", 4)}


@pytest.mark.parametrize("name, nproc", [pytest.param(n, p, marks=pytest.mark.slow) if (n, p) in _SLOW_SPACES
                                         else (n, p) for n in MODELS for p in (2, 4)])
def test_micro_batched_plans_of_the_search_space_only_sum_micro_batches(name, nproc):
    model = md.load_model(name, tiny=True)
    outs = model.train_step(0.01)
    compiled, refused = 0, set()
    for c in candidates(model, nproc):
        m = max(c.microbatches, 2)
        try:
            plan = compile_plan(outs, c.mesh, c.layout, microbatches=m, schedule=c.schedule)
        except MeshDSLError as e:
            try:
                compile_plan(outs, c.mesh, c.layout, microbatches=1, schedule=c.schedule)
            except MeshDSLError as without:  # says nothing about micro-batches, if it is a known refusal
                first = str(without).splitlines()[0]
                assert first in REFUSED_EITHER_WAY.get((name, nproc), {}), (c, str(without))
                refused.add(first)
                continue
            # Only a batch the micro-batches do not divide may stop it, never a move over them.
            assert isinstance(e, LayoutError) and "is not divisible by" in str(e).splitlines()[0], (c, str(e))
            continue
        assert _mb_moves(plan) == [], (c, m)
        compiled += 1
    assert compiled >= 10, compiled  # the space's micro-batched plans were really looked at
    assert refused == set(REFUSED_EITHER_WAY.get((name, nproc), {}))  # the list says what happens today


def test_the_compiler_refuses_to_gather_micro_batches():
    mesh = md.Mesh((("data", 2), (MB_AXIS, 2)))
    shape = md.Shape([md.Dim("batch", 8), md.Dim("d_model", 4)])
    split = Sharding.of(shape, {"batch": (MB_AXIS, "data")})
    summed = Sharding.of(shape, {}, (MB_AXIS,))
    whole = Sharding.replicated(shape)
    # Gathering micro-batches is not expensive but unavailable; summing them is priced as usual.
    assert [m.kind for m in plan_moves(shape, split, whole, mesh)] == ["allgather"]
    assert relayout_cost(shape, split, whole, mesh) == float("inf")
    assert 0 < relayout_cost(shape, summed, whole, mesh) < float("inf")
    lw = Lowerer(mesh, md.Layout.parse("batch:data"))
    with pytest.raises(LayoutError, match="cannot be micro-batched") as e:
        lw.relayout(lw.new_value(shape, torch.float32, split), whole, None, "test")
    assert "allgather over ('_mb', 'data')" in str(e.value) or "allgather over ('data', '_mb')" in str(e.value)
    lw.relayout(lw.new_value(shape, torch.float32, summed), whole, None, "test")
    assert [(s.kind, s.axes) for s in lw.steps] == [("allreduce", (MB_AXIS,))]


def test_moe_expert_batch_stays_split_by_micro_batches():
    # MoE renames batch to expert_batch, whose layout rule (none) would gather it: the
    # compiler keeps it split over the micro-batches instead, and the plan matches dense.
    model = md.load_model("moe", tiny=True)
    outs = {"loss": model.loss, **{f"grad/{k}": g for k, g in model.grads().items()}}
    plan = compile_plan(outs, "data:2", "batch:data; experts:data", microbatches=2)
    assert _mb_moves(plan) == []
    want = md.run_dense(outs, model.feeds(0))
    got = md.run_simulated(plan, model.feeds(0))
    for k, v in want.items():
        # fp32 sums in another order (micro-batch partial sums, then the data axis): rounding only.
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)


# Data-parallel MLP with gradient accumulation: its weight gradients used to gather the
# activations over data and the micro-batches, which real processes cannot run.
GLOO_CASES = [("data:2", "batch:data", 2), ("model:2", "d_ff:model", 2)]


def _gloo_cases(rank: int):
    torch.set_num_threads(1)
    return [check_job(TorchComm(mesh), "mlp", True, mesh, layout, microbatches=m) for mesh, layout, m in GLOO_CASES]


@pytest.mark.timeout(200)
def test_micro_batched_mlp_runs_on_two_gloo_processes_and_matches_dense():
    for mesh, layout, m in GLOO_CASES:
        model = md.load_model("mlp", tiny=True)
        outs = {"loss": model.loss, **{f"grad/{k}": g for k, g in model.grads().items()}}
        assert _mb_moves(compile_plan(outs, mesh, layout, microbatches=m)) == []
    results = spawn(_gloo_cases, 2, timeout=180)[0]
    assert multiprocessing.active_children() == []
    model = md.load_model("mlp", tiny=True)
    want = md.run_dense({"loss": model.loss, **{f"grad/{k}": g for k, g in model.grads().items()}},
                        model.feeds(0))
    for (mesh, layout, m), got in zip(GLOO_CASES, results):
        assert set(got) == set(want), (mesh, layout)
        for k, v in want.items():
            # fp32 sums in another order (per micro-batch, then over ranks): rounding only.
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=f"{mesh} / {layout} m={m}: {k}")
