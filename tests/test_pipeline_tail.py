"""What a pipeline runs after its micro-batches runs once, where its inputs are
(:mod:`meshdsl.lowering.microbatch_sums`, :mod:`meshdsl.lowering.partition`):

* a loss term made per micro-batch on the last stage, added after the schedule to a term made once
  from every stage's per-layer outputs (api.md's ``aux_demo``), is summed over the micro-batches
  before it moves: one send, not one per micro-batch;
* under AdamW with a clipped global norm, ELECTRA (a generator beside the pipelined stack) gives the
  dense program's numbers;
* a cross-attention cache made from an unpipelined encoder's output (``layer:stage`` alone): the
  gradient of that output is summed down the decoder's stages per micro-batch, and the encoder's
  backward runs in stage 0's B actions, not once per micro-batch on every stage after the schedule.

Each plan still gives the dense program's numbers.
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md
from conftest import assert_matches_scaled, assert_steps_track_dense
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.lowering.pipeline_program import Segment

B, D, L = md.Dim("batch", 8), md.Dim("d_model", 4), md.Dim("layer", 4)
# fp32 sums in another order (the micro-batches summed before the add, x m after x 1/m): a few ulps of
# each output's largest magnitude; a term counted m times or dropped is off by O(1)
REL = 1e-5


def _aux_demo():
    """docs/guide/api.md's aux_demo: a residual stack whose layers each add a penalty to the loss."""
    with md.Graph():
        x = md.input("x", [B, D])
        w = md.param("w", [L, D, md.Dim("d_out", 4)], fan_out=["d_out"])

        def block(h, p):
            y = md.rename(md.einsum("batch d_model, d_model d_out -> batch d_out", h, p["w"]), {"d_out": "d_model"})
            return h + md.tanh(y), {"aux": md.reduce_mean(y ** 2)}

        h, per_layer = md.repeat(block, x, {"w": w}, "layer", remat="full")
        loss = md.reduce_mean(h ** 2) + 0.1 * md.reduce_sum(per_layer["aux"], "layer")
        outs = {"loss": loss, "aux": per_layer["aux"], **md.grad(loss, {"w": w})}
    return outs, {"x": torch.randn(8, 4, generator=torch.Generator().manual_seed(0))}


def _final(plan):
    pipe = next(s for s in plan.steps if s.kind == "pipeline")
    return pipe.subplans[list(Segment).index(Segment.FINAL)]


@pytest.mark.parametrize("m,schedule", [(4, "1f1b"), (2, "interleaved:2")])
def test_a_per_microbatch_loss_term_added_to_a_stage_sum_moves_once(m, schedule):
    outs, feeds = _aux_demo()
    plan = md.compile(outs, "stage:2", "layer:stage", microbatches=m, schedule=schedule)
    final = _final(plan)
    # the loss's mean of h**2 (last stage, one term per micro-batch) goes down to stage 0 once, summed
    assert [final.held_runs(s) for s in final.steps if s.kind == "send"] == [1]
    # and the loss's sum over the stages and micro-batches is a sum over the stages alone
    assert not any(s.kind == "allreduce" and s.axes == ("stage", "_mb") for s in final.steps)
    assert_matches_scaled(md.run_simulated(plan, feeds), md.run_dense(outs, feeds), f"m={m} {schedule}", REL)


def _adamw(model, mesh: str, layout, **kw):
    """An AdamW TrainStep of ``model`` (clipped at 1) on ``mesh`` (None: one rank, the dense oracle)."""
    m = md.Mesh.parse(mesh) if mesh else md.Mesh(())
    return md.TrainStep(model.loss, model.params, m, layout, SimulatedComm(m), optimizer=md.AdamW(lr=0.01),
                        clip_norm=1.0, **kw)


def test_electra_adamw_with_a_clipped_norm_tracks_the_dense_program():
    """ELECTRA's generator beside the pipelined stack, under AdamW with a clipped global norm.  The
    clip scale, made after the schedule and held alike on both stages, anchors no update: the
    generator's params and their AdamW moments are updated and stored on stage 0 alone, where they
    are read, and only each stage's own norm terms meet, in one allreduce, so nothing is sent after
    the schedule (was 14 gradients and norm parts, 13.9 KB, with the updates on both stages)."""
    model = md.load_model("tests/heldout_electra.py", tiny=True)
    pipe = _adamw(model, "stage:2", "layer:stage", microbatches=2, schedule="1f1b")
    plan = pipe.plan
    assert [s.label for s in _final(plan).steps if s.kind == "send"] == []
    gen = [k for k in plan.outputs if k.startswith(("new/g_", "new/opt/g_"))]
    assert len(gen) == 3 * 10   # the generator's 10 params, each with its two moments
    assert {k: {plan.mesh.coords(r)["stage"] for r in plan.holders[plan.outputs[k]]} for k in gen} == {
        k: {0} for k in gen}
    assert_steps_track_dense(pipe, _adamw(model, None, None), model, REL, "electra, AdamW")


@pytest.mark.parametrize("over, mesh, schedule", [({}, "stage:2", "gpipe"), ({"layers": 3}, "stage:3", "1f1b")],
                         ids=str)
def test_a_cross_attention_cache_under_one_stack_runs_the_encoders_backward_in_the_actions(over, mesh, schedule):
    model = md.load_model("tests/heldout_xcache.py", tiny=True, **over)
    pipe = _adamw(model, mesh, "layer:stage", microbatches=2, schedule=schedule)
    final = _final(pipe.plan)
    # the decoder's stages sum the encoder output's gradient down to stage 0 per micro-batch, where the
    # encoder's backward runs in the B actions: no compute after the schedule runs once per micro-batch,
    # and what crosses the stages there is the tied embedding's two summed terms alone (its gradient's)
    assert not [s for s in final.steps if s.flops and final.held_runs(s) > 1]
    sends = [s.label.split(" to ")[0] for s in final.steps if s.kind == "send"]
    # (the updates run where their params are: the clip scale anchors none of them, see the ELECTRA test)
    assert sends == ["send grad_einsum/einsum_1", "send grad_gather/scatter_add", "send grad_gather/scatter_add_1"]
    assert_steps_track_dense(pipe, _adamw(model, None, None), model, REL, f"xcache on {mesh}, AdamW")
