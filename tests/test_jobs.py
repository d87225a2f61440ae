"""Per-rank jobs: plan agreement across ranks, and SGD training on gloo processes."""
from __future__ import annotations

import pytest
import torch

import meshdsl as md
from meshdsl.comm.distributed import TorchComm
from meshdsl.processes.launcher import spawn
from meshdsl.train.model import load_model
from meshdsl.train.jobs import agree_plan, train_job
from meshdsl.train.step import TrainStep


def _mismatched(rank: int):
    m = load_model("mlp", tiny=True)
    layout = "batch:data" if rank == 0 else ""   # rank 1 compiles another plan
    plan = md.compile({"loss": m.loss}, "data:2", layout)
    agree_plan(TorchComm("data:2"), plan)
    return "agreed"


def test_mismatched_plan_is_reported_not_hung():
    with pytest.raises(md.DistributedError) as e:
        spawn(_mismatched, 2, timeout=120)
    text = str(e.value)
    assert "compiled different plans" in text
    assert "ranks [0]" in text and "ranks [1]" in text


def test_training_on_processes_matches_simulated_training():
    losses = spawn(train_job, 2, args=("mlp", True, "model:2", "d_ff:model", 3, 0.1, 0, 1),
                   mesh="model:2", timeout=120)[0]
    m = load_model("mlp", tiny=True)
    sim = TrainStep(m.loss, m.params, "data:1", "", md.SimulatedComm(md.Mesh.parse("data:1")), lr=0.1)
    feeds = m.feeds(0)
    want = [sim(feeds)[0] for _ in range(4)][1:]  # the job's first step is a warm-up
    got = [loss for loss, _, _ in losses]
    # Three SGD steps of fp32 arithmetic in another summation order: agree to 1e-5 relative.
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    assert all(st.total > 0 and st.compute > 0 for _, st, _ in losses)


def test_a_plan_mismatch_is_said_in_the_users_mesh_and_layout():
    """A plan with micro-batches is lowered on the mesh plus a virtual axis: the refusal names the
    mesh and layout the user gave, and the count (lowering/users_terms.py), not the virtual axis."""
    class TwoPlans:   # the ranks' signatures as comm.agree returns them: rank 1 compiled another plan
        def agree(self, sig):
            return [sig, "0123456789abcdef"]

    m = load_model("mlp", tiny=True)
    plan = md.compile({"loss": m.loss}, "data:2", "batch:data", microbatches=2)
    with pytest.raises(md.DistributedError) as e:
        agree_plan(TwoPlans(), plan)
    text = str(e.value)
    assert "_mb" not in text, text
    assert "  mesh: data:2\n  layout: batch:data\n  micro-batches: 2\n" in text, text
    assert "ranks [1]: plan 0123456789abcdef" in text, text
