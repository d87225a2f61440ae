"""A pipeline places a backward made beside its stacks inside the schedule, per micro-batch.

ELECTRA's generator is no pipelined stack: its forward runs on stage 0 before the discriminator's
layers, and its loss (an MLM cross-entropy over a whole-batch count of the masked positions) needs
no discriminator value, so its backward is anchored by no stack's end and is placed where its
results are read (:func:`meshdsl.lowering.partition.assign_stages`).  Its params' gradients are
read only by their sums over the micro-batches (and the updates, on every stage): placed by that
demand, the whole generator backward ran after the schedule on both stages, per micro-batch, its
saved activations sent to stage 1 each time.  Now what is read only after the micro-batches runs
where the micro-batches read its other results, or on one stage, and a carried param's next value
is made where the param's forward readers run.
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md
from conftest import assert_matches_scaled
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.lowering.pipeline_program import Segment
from meshdsl.train.step import training_outputs

# fp32: the pipelined step sums each gradient over the micro-batches where the dense program sums
# the whole batch at once, a few ulps of each output's largest magnitude; a micro-batch's term
# dropped or counted twice is off by O(1)
REL = 1e-5


def _model():
    """A generator (one matrix outside the stack) with a masked loss over the whole-batch mask
    count, feeding a pipelined stack through stop_gradient (ELECTRA's argmax takes no gradient)."""
    batch, d, layer = md.Dim("batch", 8), md.Dim("d", 4), md.Dim("layer", 4)
    with md.Graph("gen_then_stack") as g:
        x = md.input("x", [batch, d])
        mask = md.input("mask", [batch])
        w_gen = md.param("w_gen", [d, md.Dim("e", 4)], scale=0.5)
        w = md.param("w", [layer, d, md.Dim("e", 4)], scale=0.5)
        h = md.tanh(md.rename(md.einsum("batch d, d e -> batch e", x, w_gen), e="d"))
        gen = md.reduce_sum(md.reduce_sum(h * h, "d") * mask) / md.reduce_sum(mask)
        y = md.repeat(lambda c, p: md.tanh(md.rename(md.einsum("batch d, d e -> batch e", c, p["w"]), e="d")),
                      md.stop_gradient(h), {"w": w}, "layer")
        loss = gen + md.reduce_mean(y * y)

    def feeds(seed: int = 0) -> dict[str, torch.Tensor]:
        gen_ = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(8, 4, generator=gen_), "mask": (torch.rand(8, generator=gen_) < 0.5).float()}
    return md.Model(g, loss, {"w_gen": w_gen, "w": w}, feeds, None)


def _final(plan) -> list:
    """(step, runs per step) of the pipeline's final segment."""
    pipe = next(s for s in plan.steps if s.kind == "pipeline")
    return list(pipe.subplans[list(Segment).index(Segment.FINAL)].walk(plan.held_microbatches))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved:2"])
def test_the_generators_backward_runs_in_the_schedule_and_matches_dense(schedule):
    m = _model()
    final = _final(md.compile(training_outputs(m.loss, m.params, 0.1), "stage:2", "layer:stage",
                              microbatches=2, schedule=schedule))
    # nothing is sent after the schedule (the generator's param is made and updated on stage 0),
    # and what runs there runs once, not per micro-batch
    assert [s.label for s, _ in final if s.kind == "send"] == []
    assert all(runs == 1 for s, runs in final), [(s.label, runs) for s, runs in final if runs > 1]
    outs = training_outputs(m.loss, m.params, 0.1, with_grads=True)
    plan = md.compile(outs, "stage:2", "layer:stage", microbatches=2, schedule=schedule)
    ex = md.Executor(plan, SimulatedComm(plan.mesh))
    feeds = m.feeds(0)
    assert_matches_scaled(ex.full_outputs(ex.run(feeds)), md.run_dense(outs, feeds), schedule, REL)


def test_electra_runs_no_per_micro_batch_work_after_the_schedule():
    model = md.load_model("tests/heldout_electra.py", tiny=True)
    plan = md.compile(training_outputs(model.loss, model.params, 0.1), "stage:2", "layer:stage",
                      microbatches=2, schedule="gpipe")
    final = _final(plan)
    assert [(s.label, runs) for s, runs in final if runs > 1] == []
    assert sum(runs for s, runs in final if s.kind == "send") == 0   # was 35 (17 per micro-batch + wte)


def test_under_adamw_the_generators_backward_stays_in_the_schedule():
    # AdamW's state has no forward reader (its update is made on every stage) and the step reports
    # the gradient norm there: the generator's gradient goes up once, summed, not its backward
    m = _model()
    step = md.TrainStep(m.loss, m.params, "stage:2", "layer:stage", SimulatedComm(md.Mesh.parse("stage:2")),
                        optimizer=md.AdamW(lr=0.05), microbatches=2)
    final = _final(step.plan)
    assert [(s.label, runs) for s, runs in final if runs > 1] == []
    dense = md.TrainStep(m.loss, m.params, "data:1", "", SimulatedComm(md.Mesh.parse("data:1")),
                         optimizer=md.AdamW(lr=0.05))
    for i in range(2):   # the second step reads the first's updated params and state on each stage
        torch.testing.assert_close(step(m.feeds(i))[0], dense(m.feeds(i))[0], rtol=REL, atol=REL)
    for k, want in dense.full_params().items():
        torch.testing.assert_close(step.full_params()[k], want, rtol=REL, atol=REL, msg=lambda msg, k=k: f"{k}: {msg}")
