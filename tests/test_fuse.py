"""Plan fusion (lowering/fuse.py): a local weight gradient and its SGD update become
one addmm, identity kernels disappear, and nothing else changes: the same collectives,
and the same numbers as the unfused plan on every layout (fp32, rtol/atol 1e-5)."""
from __future__ import annotations

import pytest
import torch

import meshdsl as md
from meshdsl.runtime.executor import Executor
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.layout.mesh import Mesh
from meshdsl.train.model import load_model
from meshdsl.train.step import TrainStep, training_outputs

LAYOUTS = [
    ("data:1", ""),
    ("data:2", "batch:data"),
    ("model:2", "d_ff:model"),
    ("data:2", "params.d_model:data"),
    ("data:2; model:2", "batch:data; d_ff:model"),
    ("model:4", "d_model:model"),
]


@pytest.fixture(scope="module")
def mlp():
    return load_model("models/mlp.py", tiny=True)


def _ops(plan):
    """Ops of the local kernels."""
    return [s.op for s in plan.steps if s.kind == "local"]


@pytest.mark.parametrize("mesh, layout", LAYOUTS)
def test_fused_plan_matches_unfused(mlp, mesh, layout):
    outs = training_outputs(mlp.loss, mlp.params, 0.1)
    fused, plain = md.compile(outs, mesh, layout), md.compile(outs, mesh, layout, fuse=False)
    assert "stop_gradient" not in _ops(fused) and "stop_gradient" in _ops(plain)
    assert [(s.kind, s.axes, s.bytes) for s in fused.steps if s.is_collective] == \
           [(s.kind, s.axes, s.bytes) for s in plain.steps if s.is_collective]
    feeds = mlp.feeds(0)
    got, want = md.run_simulated(fused, feeds), md.run_simulated(plain, feeds)
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")


def test_local_weight_gradients_fuse(mlp):
    """Megatron's split weights have local gradients: both updates are one addmm each."""
    plan = md.compile(training_outputs(mlp.loss, mlp.params, 0.1), "model:2", "d_ff:model")
    fused = [s for s in plan.steps if s.op == "einsum+sgd_update"]
    assert sorted(s.label for s in fused) == ["new/w1", "new/w2"]
    assert not any(s.op in ("einsum", "sgd_update") and s.phase == "update" for s in plan.steps)
    n_einsum = sum(s.op == "einsum" for s in plan.steps)
    assert n_einsum == 3  # 2 forward + the activation gradient; the weight gradients are fused


def test_reduced_gradient_does_not_fuse(mlp):
    """A gradient that a collective reduces (FSDP here) keeps its own einsum and update."""
    plan = md.compile(training_outputs(mlp.loss, mlp.params, 0.1), "data:2", "params.d_model:data")
    assert "einsum+sgd_update" not in _ops(plan) and _ops(plan).count("sgd_update") == 2


def test_gradient_output_does_not_fuse(mlp):
    """When the gradients are outputs too, the update reads them: nothing to fuse."""
    plan = md.compile(mlp.train_step(0.1), "model:2", "d_ff:model")
    assert "einsum+sgd_update" not in _ops(plan)
    assert {f"grad/{k}" for k in mlp.params} <= set(plan.outputs)


@pytest.mark.parametrize("model", ["models/mlp.py", "models/transformer.py"])
def test_donated_update_writes_in_place(model):
    """With one held rank the fused update overwrites the param buffer, and trains as
    the unfused, undonated plan does; the transformer's stacked params too (the repeat
    loops have read their layers' slices by the time the update runs)."""
    mlp = load_model(model, tiny=True)
    ts = TrainStep(mlp.loss, mlp.params, "data:1", "", SimulatedComm(Mesh.parse("data:1")), lr=0.1)
    ptrs = {k: v[0].data_ptr() for k, v in ts.params.items()}
    feeds = mlp.feeds(0)
    plain = md.compile(training_outputs(mlp.loss, mlp.params, 0.1), "data:1", "", fuse=False)
    ex = Executor(plain, SimulatedComm(Mesh.parse("data:1")))
    params = ex.init_params(0)
    for _ in range(3):
        loss, _ = ts(feeds)
        outs = ex.run(feeds, params)
        params = {k: outs[f"new/{k}"] for k in params}
        assert loss == pytest.approx(float(outs["loss"][0]), rel=1e-6)
    assert {k: v[0].data_ptr() for k, v in ts.params.items()} == ptrs
    for k in params:
        torch.testing.assert_close(ts.params[k][0], params[k][0], rtol=1e-5, atol=1e-5)
