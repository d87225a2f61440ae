"""20 AdamW steps of the routed MoE transformer: the dense curve under expert parallelism.

The tiny ``models/moe.py`` (see tests/test_moe.py for its legend) trained with AdamW and
global-norm clipping gives the dense program's losses and first gradient norm with the
experts split over ``data`` (the dispatch and combine become alltoalls), with expert and
tensor parallelism together on ``data:2; model:2``, on the simulated mesh and on 2 and 4
gloo processes.  Each step reads its own random batch (``feeds(i)``), so the routing, the
capacity drops and the balance loss change from step to step.
"""
from __future__ import annotations

import math
import multiprocessing

import pytest
import torch

import meshdsl as md
from conftest import adamw_dense_curve
from meshdsl.processes.launcher import spawn

STEPS = 20
CLIP = 0.5  # the tiny MoE's first gradient norm is above it (asserted), so clipping is active
# As tests/test_zero.py: the sharded programs sum in another order than the dense one, and
# AdamW's normalised update carries those few-ulp differences forward; after 20 steps the
# losses agree to a few 1e-6 relative.  A wrong expert slice, a token sent to the wrong
# rank or a doubled partial sum is off by far more.
REL = 1e-5

EP = ("data:2", "batch:data; experts:data")
EP_TP = ("data:2; model:2", "batch:data; experts:data; d_ff:model")
EP4 = ("data:4", "batch:data; experts:data")  # one expert and one sequence per rank
SIMULATED = {"ep": EP, "ep+tp": EP_TP, "ep/4": EP4, "ep on model": ("model:2", "experts:model")}


def _opt():
    return md.AdamW(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _model() -> md.Model:
    return md.load_model("moe", tiny=True)


@pytest.fixture(scope="module")
def dense():
    return adamw_dense_curve(_model(), _opt(), CLIP, STEPS)


def _curve(model, mesh, layout, comm=None, steps=STEPS):
    comm = comm or md.SimulatedComm(md.Mesh.parse(mesh))
    step = md.TrainStep(model.loss, model.params, mesh, layout, comm, optimizer=_opt(), clip_norm=CLIP)
    losses, norms = [], []
    for i in range(steps):
        losses.append(step(model.feeds(i))[0])
        norms.append(step.grad_norm)
    return step, losses, norms


def _check(losses, norms, dense, what: str) -> None:
    want_loss, want_norm = dense
    n = len(losses)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_loss[:n]), rtol=REL, atol=0,
                               msg=lambda m: f"{what}: {m}")
    # Exact clipping: the first step's global norm (same params everywhere) is the dense norm.
    assert norms[0] == pytest.approx(want_norm[0], rel=REL), what


def test_the_dense_curve_learns_and_clips(dense):
    losses, norms = dense
    assert norms[0] > CLIP
    assert min(losses[-5:]) < losses[0]


@pytest.mark.parametrize("name", list(SIMULATED))
def test_expert_parallel_adamw_is_the_dense_curve(dense, name):
    mesh, layout = SIMULATED[name]
    step, losses, norms = _curve(_model(), mesh, layout)
    if "experts:data" in layout:  # the tokens really travel: dispatch and combine are alltoalls
        assert step.plan.totals()["alltoall"]["count"] > 0
    _check(losses, norms, dense, name)


def _gloo_child(comm, mesh, layout, steps):
    _, losses, norms = _curve(_model(), mesh, layout, comm, steps)
    return losses, norms


# EP+TP on 4 processes runs with -m slow: EP stays on 2 gloo processes, EP+TP on the simulated mesh.
@pytest.mark.timeout(300)
@pytest.mark.parametrize("nproc, layout, steps", [(2, EP, STEPS), pytest.param(4, EP_TP, STEPS, marks=pytest.mark.slow)])
def test_expert_parallel_adamw_on_gloo_processes(dense, nproc, layout, steps):
    mesh, rules = layout
    results = spawn(_gloo_child, nproc, args=(mesh, rules, steps), mesh=mesh, timeout=280)
    assert multiprocessing.active_children() == []
    for rank, (losses, norms) in enumerate(results):
        assert not math.isnan(losses[0])
        _check(losses, norms, dense, f"{rules} on {nproc} processes, rank {rank}")
