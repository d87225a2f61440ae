"""A pipeline's final segment sums a value over the micro-batches before it moves
(:mod:`meshdsl.lowering.microbatch_sums`): a tied embedding's two gradient terms, each still
partial over the micro-batches on its own stage, cross the stage axis once each (not once per
micro-batch), and under FSDP their sum is reduce-scattered over ``data`` once; the step still
gives the dense program's loss, gradients and updated params under every schedule.  The cost
model charges what still runs per micro-batch there once for each (``pipeline_time``).
"""
from __future__ import annotations

import collections
import dataclasses

import pytest

import meshdsl as md
from conftest import assert_matches_scaled
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.lowering.pipeline_program import Segment
from meshdsl.search.calibrate import Calibration
from meshdsl.search.predict import predict, step_seconds
from meshdsl.train.step import training_outputs
from models.transformer import Config, build

# As tests/test_pipeline_exec.py: summing a gradient's micro-batches before it moves changes only
# the order of fp32 additions, a few ulps of each output's largest magnitude; 1e-5 of it keeps a
# margin, while a term counted once per micro-batch too often (or dropped) is off by O(1).
REL = 1e-5
CFG = dataclasses.replace(Config.tiny(), layers=4, batch=8, tied=True)
FSDP = ("stage:2; data:2", "layer:stage; batch:data; params.d_model:data")
_BUILT: dict = {}


def _tied():
    """The tied transformer's training outputs, feeds and dense outputs (built once)."""
    if not _BUILT:
        m = build(CFG)
        outs = training_outputs(m.loss, m.params, 0.1, with_grads=True)
        _BUILT["tied"] = (outs, m.feeds(0), md.run_dense(outs, m.feeds(0)))
    return _BUILT["tied"]


def _final_runs(plan, kind: str) -> list[tuple[int, int]]:
    """(runs per step, bytes) of each ``kind`` step of the pipeline's final segment."""
    pipe = next(s for s in plan.steps if s.kind == "pipeline")
    final = pipe.subplans[list(Segment).index(Segment.FINAL)]
    return [(mult, s.bytes) for s, mult in final.walk(plan.held_microbatches) if s.kind == kind]


def test_the_tied_gradients_terms_cross_the_stages_once_each():
    outs, _, _ = _tied()
    plan = md.compile(outs, "stage:2", "layer:stage", microbatches=4, schedule="1f1b")
    wte = CFG.vocab * CFG.d_model * 4   # fp32 bytes of the embedding's gradient
    # the head's term down to stage 0, the lookup's up to stage 1: once each, not once per micro-batch
    assert _final_runs(plan, "send") == [(1, wte), (1, wte)]
    assert _final_runs(plan, "recv") == [(1, wte), (1, wte)]


def test_under_fsdp_the_tied_gradient_is_reduce_scattered_once():
    outs, _, _ = _tied()
    plan = md.compile(outs, *FSDP, microbatches=2, schedule="1f1b")
    assert [mult for mult, _ in _final_runs(plan, "reduce_scatter")] == [1]
    assert [mult for mult, _ in _final_runs(plan, "send")] == [1, 1]


@pytest.mark.parametrize("mesh,layout,m,schedule", [
    ("stage:2", "layer:stage", 4, "1f1b"),
    ("stage:2", "layer:stage", 4, "gpipe"),
    ("stage:2", "layer:stage", 4, "interleaved:2"),
    ("stage:2", "layer:stage", 4, "zbh1"),
    (*FSDP, 2, "1f1b"),
])
def test_the_step_matches_the_dense_program(mesh, layout, m, schedule):
    outs, feeds, want = _tied()
    plan = md.compile(outs, mesh, layout, microbatches=m, schedule=schedule)
    ex = md.Executor(plan, SimulatedComm(plan.mesh))
    assert_matches_scaled(ex.full_outputs(ex.run(feeds)), want, f"{mesh} / {layout} m={m} {schedule}", REL)


def test_the_cost_model_prices_a_final_step_once_per_micro_batch_it_runs_for():
    # on virtual stages the cross-attention cache's encoder backward runs after the micro-batches, per
    # micro-batch (its saved activations split over them): the cost model charges each such step m times,
    # as the runtime runs it
    model = md.load_model("tests/heldout_xcache.py", tiny=True, layers=4)
    plan = md.compile(training_outputs(model.loss, model.params, 0.1), "stage:2", "layer:stage",
                      microbatches=2, schedule="interleaved:2")
    final = next(s for s in plan.steps if s.kind == "pipeline").subplans[list(Segment).index(Segment.FINAL)]
    cal = Calibration.defaults()
    rows: dict = {}
    for label, op, t, _ in predict(plan, cal).by_op:
        rows[(label, op)] = rows.get((label, op), 0.0) + t
    labels = collections.Counter(s.label for s, _ in plan.walk())
    # (labels of one step alone, in the final segment's top level: their rows are that step's)
    mine = [s for s in final.steps if s.kind == "local" and s.flops and labels[s.label] == 1]
    assert any(final.held_runs(s) == 2 for s in mine)
    for s in mine:
        assert rows[(s.label, s.op)] == pytest.approx(step_seconds(s, final, cal, serial=final.held_runs(s)))
