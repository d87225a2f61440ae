"""Plans that the simulated mesh runs but real processes would not: each collective's parts as a
real rank holds them (meshdsl/comm/real_parts.py checks them before every simulated collective).

A stack on some of the stages (``layer:stage; mtp:stage``: the trunk on stage 0, the prediction
depths on stage 1) stores its stacked values at given lengths ``[0, 2]`` after lowering; the
final segment's gather of a stacked gradient (the gradient of the depth-shifted embeddings,
concatenated over ``mtp`` before the stack) was lowered for the even cut. The simulated mesh
joined the parts anyway; gloo took each rank's own length, so stage 0 gathered nothing and
``meshdsl check ... --nproc 2`` crashed in a slice of it (lowering/collective_parts.py).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import heldout_outputs
from meshdsl.comm.real_parts import parts_problem

MTP = str(Path(__file__).parent / "heldout_mtp.py")


def test_a_gather_of_a_stack_on_one_stage_carries_its_stored_parts_and_matches_dense():
    model = md.load_model(MTP, tiny=True, shift="shift")
    outputs, feeds = heldout_outputs(model), model.feeds(0)
    plan = md.compile(outputs, "stage:2", "layer:stage; mtp:stage", microbatches=2, schedule="1f1b")
    ex = md.Executor(plan, md.SimulatedComm(plan.mesh))
    got = ex.full_outputs(ex.run(feeds, ex.init_params(0)))
    want = md.run_dense(outputs, feeds)
    top = max(float(w.abs().max()) for k, w in want.items() if k.startswith("grad/"))
    for k, w in want.items():
        # as conftest.assert_heldout_case_matches_dense: fp32 sums in another order (micro-batches,
        # stages) are ~n * 2**-24 of the magnitudes summed; a wrong part is off by O(1)
        scale = top if k.startswith("grad/") else float(w.abs().max())
        torch.testing.assert_close(got[k], w, rtol=0, atol=1e-4 * scale, msg=lambda m, k=k: f"{k}: {m}")


def test_the_simulated_mesh_refuses_parts_a_real_rank_would_move_wrongly():
    """What gloo needs of a collective: parts of one shape, or the lengths the step gives."""
    assert parts_problem("allgather", [(2, 3), (2, 3)], {}, {"dim": 0}) is None
    assert parts_problem("allgather", [(0, 3), (2, 3)], {0: (0, 2)}, {"dim": 0}) is None
    assert "no lengths" in parts_problem("allgather", [(0, 3), (2, 3)], {}, {"dim": 0})
    assert "the step gives" in parts_problem("allgather", [(1, 3), (1, 3)], {0: (0, 2)}, {"dim": 0})
    assert parts_problem("reduce_scatter", [(10, 2)] * 4, {}, {"dim": 0}) is None   # torch.chunk: 3, 3, 3, 1
    assert "makes 3" in parts_problem("reduce_scatter", [(3, 2)] * 4, {}, {"dim": 0})
    assert "cut at" in parts_problem("alltoall", [(4, 2), (4, 2)], {0: (1, 2)}, {"split_dim": 0})


def test_a_simulated_gather_of_unequal_parts_is_an_error_naming_real_processes():
    """A gather whose members hold parts the step does not give fails on the simulated mesh too."""
    comm = md.SimulatedComm("x:2")
    with pytest.raises(md.MeshDSLError, match="real processes would run this plan's collective otherwise"):
        comm.collective("allgather", [torch.zeros(1, 3), torch.zeros(2, 3)], ("x",), {"dim": 0})
