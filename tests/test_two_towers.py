"""Two towers on one stage axis: two ``md.repeat`` stacks that do not feed each other, joined after both.

tests/towers_tiny.py: an image tower over ``img_layer`` and a text tower over ``layer``, joined by
an image-text matching loss or by a sum of their features; ``layer:stage; img_layer:stage`` pipelines
both.  The stages cut the joined list of layers (the image tower's, then the text tower's); the join
runs per micro-batch on the stage holding the text tower's last layer, with what is made of the image
tower's output (its head); that output goes up to it with the forward, and its gradient comes back
down to the image tower's last stage for its backward (lowering/partition.py ``_tower_lifts``).  Once
refused ("two towers joined only after both have no stage order").  Every output matches the dense
program: gpipe/1f1b/zbh1 and interleaved:2, ``stage:2``, ``stage:2; data:2`` and ``stage:3``, m = 2
and 4, the towers' boundary inside a stage and between stages, AdamW steps, and one case on two gloo
processes.  (CLIP's contrastive loss, whole-batch so one micro-batch: tests/test_heldout_round4.py.)
"""
from __future__ import annotations

import pathlib

import pytest

import meshdsl as md
from meshdsl.processes import launcher as launch

from conftest import (assert_heldout_case_matches_dense, assert_ranks_match_dense, assert_steps_track_dense,
                      heldout_outputs, held_outputs_on_this_rank, pipeline_steps_by_segment)

HERE = pathlib.Path(__file__).parent
TOWERS = str(HERE / "towers_tiny.py")
BOTH = "layer:stage; img_layer:stage"
# fp32 with O(1) values: the stages and micro-batches add the same terms in another order (n * 2**-24
# of the magnitudes), far below the 1e-4 of assert_heldout_case_matches_dense; a lost transfer or a
# join on the wrong stage is off by O(1).  (For gloo: the same sums, 1e-5 of each output's scale.)
REL = 1e-5


@pytest.mark.parametrize("join", ["match", "sum"])
@pytest.mark.parametrize("mesh, layout", [("stage:2", BOTH), ("stage:2; data:2", BOTH + "; batch:data")])
@pytest.mark.parametrize("schedule, m", [("1f1b", 2), ("1f1b", 4), ("interleaved:2", 2), ("interleaved:2", 4)])
def test_two_towers_pipelined_together_match_dense(join, mesh, layout, schedule, m):
    """2 + 2 layers: one tower per stage under 1f1b, one layer per virtual stage under interleaved:2."""
    assert_heldout_case_matches_dense((TOWERS, {"join": join}, mesh, layout, {"microbatches": m, "schedule": schedule}))


@pytest.mark.parametrize("mesh, kw", [
    ("stage:2", {"schedule": "gpipe", "stage_layers": (1, 3)}),          # the towers meet inside stage 1
    ("stage:2", {"schedule": "zbh1", "stage_layers": (3, 1), "microbatches": 4}),   # the text tower starts on 0
    ("stage:3", {"schedule": "1f1b", "stage_layers": (1, 2, 1)}),        # each tower on two of three stages
    ("stage:2", {"schedule": "interleaved:2", "stage_layers": (2, 1, 2, 1)}),   # 3 + 3 layers, unequal chunks
], ids=str)
def test_any_cut_of_the_towers_layers_matches_dense(mesh, kw):
    over = {"img_layers": 3, "layers": 3} if kw["schedule"].startswith("interleaved") else {}
    assert_heldout_case_matches_dense((TOWERS, over, mesh, BOTH, {"microbatches": 2, **kw}))


def _stages(plan, vid):
    return {plan.mesh.coords(r)["stage"] for r in plan.holders[vid]}


def test_the_join_runs_per_micro_batch_where_the_second_tower_ends():
    model = md.load_model(TOWERS, tiny=True)
    plan = md.compile(heldout_outputs(model), "stage:2", BOTH, microbatches=2, schedule="1f1b")
    seg = pipeline_steps_by_segment(plan)
    # the logistic loss and its gradient run in the forward actions of stage 1 (per micro-batch), not
    # after the micro-batches on both stages
    assert {st for s, st in seg[1] if s.op in ("log", "div")} == {(1,)}
    # no carry crosses the stages (the towers pass none); per micro-batch one value goes up, the image
    # tower's output, and one comes down, its gradient, sent in stage 1's forward and received in
    # stage 0's backward: the image tower's head (projection, norm) and its gradients run on stage 1
    moves = [(k, s.kind, st, s.args["tag"] > 1) for k in (1, 2) for s, st in seg[k] if s.kind in ("send", "recv")]
    assert moves == [(1, "send", (0,), True), (1, "recv", (1,), True), (1, "send", (1,), True),
                     (2, "recv", (0,), True)], moves
    assert _stages(plan, plan.params["proj_img"]) == {1}


@pytest.mark.parametrize("kw", [{"microbatches": 2, "schedule": "1f1b"},
                                {"microbatches": 4, "schedule": "interleaved:2"},
                                {"microbatches": 1, "stage_layers": (1, 3)}], ids=str)
def test_adamw_steps_on_two_towers_give_the_dense_params(kw, one_torch_thread):
    """The params a tower's head reads are updated where the head runs, so the next step reads them."""
    from meshdsl.comm.simulated import SimulatedComm
    model = md.load_model(TOWERS, tiny=True)

    def step(mesh, layout, **kw):
        mesh = md.Mesh.parse(mesh) if mesh else md.Mesh(())
        return md.TrainStep(model.loss, model.params, mesh, layout, SimulatedComm(mesh), optimizer=md.AdamW(lr=0.01),
                            **kw)
    pipe, dense = step("stage:2", BOTH, **kw), step("", None)
    assert_steps_track_dense(pipe, dense, model, REL, f"AdamW, {kw}")


def _on_two_processes(comm):
    import torch
    torch.set_num_threads(1)
    model = md.load_model(TOWERS, tiny=True, join="sum")
    plan = md.compile(heldout_outputs(model), "stage:2", BOTH, microbatches=2, schedule="1f1b")
    return held_outputs_on_this_rank(comm, plan, model.feeds(0))


@pytest.mark.timeout(200)
def test_two_towers_on_two_gloo_processes():
    model = md.load_model(TOWERS, tiny=True, join="sum")
    want = md.run_dense(heldout_outputs(model), model.feeds(0))
    results = launch.spawn(_on_two_processes, 2, mesh="stage:2", timeout=180)
    assert_ranks_match_dense(results, want, REL)
