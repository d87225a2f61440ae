"""The pipeline as one program (lowering/pipeline_program.py): built in lowering, read by all.

The ``pipeline`` step carries a :class:`PipelineProgram`: its segments are the step's own
sub-plans, its per-rank action lists have the backward already split into B and W where the
runtime puts weight gradients off, and the readers (memory report, schedule table, timeline
picture) take the schedule's simulations from it: each is made once per program.
"""
from __future__ import annotations

import dataclasses
import sys

import pytest

import meshdsl as md
from meshdsl.lowering.memory import memory_report
from meshdsl.lowering.partition import with_schedule
from meshdsl.lowering.pipeline_program import PipelineProgram, Segment
from meshdsl.tools.pipe_report import pipeline_program, schedule_summary
from meshdsl.tools.timeline_png import simulated_rows
from meshdsl.train.step import training_outputs

from models.transformer import Config, build


@pytest.fixture(scope="module")
def plan():
    model = build(dataclasses.replace(Config.tiny(), layers=2, batch=8))
    outs = training_outputs(model.loss, model.params, 0.1, with_grads=True)
    return md.compile(outs, "stage:2", "layer:stage", microbatches=2, schedule="1f1b")


def test_the_pipeline_step_carries_its_program(plan):
    step = next(s for s in plan.steps if s.kind == "pipeline")
    prog = step.args["program"]
    assert isinstance(prog, PipelineProgram) and pipeline_program(plan) is prog
    assert all(a is b for a, b in zip(prog.segments, step.subplans))
    assert [len(st) for st in prog.stages] == [len(sub.steps) for sub in step.subplans]
    assert (prog.axis, prog.num_ranks, prog.num_stages, prog.microbatches) == ("stage", 2, 2, 2)
    carry = [t for t in prog.transfers if t.carry]
    assert {(t.segment, t.kind, t.offset, t.tag) for t in carry} == {
        (Segment.FORWARD, "recv", 1, 0), (Segment.FORWARD, "send", 1, 0),
        (Segment.BACKWARD, "recv", -1, 1), (Segment.BACKWARD, "send", -1, 1)}
    assert prog.carry_offsets == (-1, 1)


def _labels(row):
    return [a.action.label(with_stage=False) for a in row]


def test_each_ranks_actions_have_the_backward_split_where_weight_gradients_wait(plan):
    prog = pipeline_program(plan)
    first, last = prog.actions(defer=True)
    # Stage 1 sends its input gradient upstream: its loop's weight gradients wait for a W after
    # the send; stage 0 sends none, so keeps them in its B.
    assert _labels(last) == ["rF0<0", "F0", "B0", "sB0>0", "W0", "rF1<0", "F1", "B1", "sB1>0", "W1"]
    assert _labels(first) == ["F0", "sF0>1", "F1", "sF1>1", "rB0<1", "B0", "rB1<1", "B1"]
    assert [a.defers for a in last] == [False, False, True, False, True] * 2
    assert not any(a.defers for a in first)
    # A micro-batch is done on a stage at its last action there: its activations go, its sums are taken.
    assert [a.finishes is not None for a in last] == [False] * 4 + [True] + [False] * 4 + [True]
    assert [a.finishes is not None for a in first] == [False] * 5 + [True, False, True]
    assert last[4].accumulates and set(last[4].accumulates) <= set(prog.folded)
    # F runs its segment's compute steps on the stage, the carry's transfers run in their own actions.
    f0, recv = last[1], last[0]
    fwd = prog.segments[Segment.FORWARD].steps
    assert f0.steps and not any(prog.is_carry(fwd[j]) for j in f0.steps)
    assert [fwd[j].kind for j in recv.steps] == ["recv"] and prog.is_carry(fwd[recv.steps[0]])
    assert all(j in f0.steps for j, _ in f0.frees)
    assert fwd[recv.steps[0]].outs[0] in f0.reads   # the received carry is what the F reads
    # Without putting weight gradients off, the schedule runs as generated.
    assert _labels(prog.actions(defer=False)[1]) == ["rF0<0", "F0", "B0", "sB0>0", "rF1<0", "F1", "B1", "sB1>0"]


def test_the_readers_simulate_the_schedule_once(plan, monkeypatch):
    prog = dataclasses.replace(pipeline_program(plan))   # a fresh program: nothing simulated yet
    step = next(s for s in plan.steps if s.kind == "pipeline")
    fresh = dataclasses.replace(plan, steps=tuple(dataclasses.replace(s, args={**s.args, "program": prog})
                                                  if s is step else s for s in plan.steps))
    calls = []
    from meshdsl.lowering import timeline
    real = timeline.simulate

    def counting(*a, **k):
        calls.append(a[0].name)
        return real(*a, **k)
    for mod in [m for name, m in sys.modules.items() if name.startswith("meshdsl.")]:
        if getattr(mod, "simulate", None) is real:
            monkeypatch.setattr(mod, "simulate", counting)
    for _ in range(2):
        memory_report(fresh)
        schedule_summary(fresh)
        simulated_rows(prog)
    # the unit-cost timeline (memory), the picture's (table and drawing), the theory's (bubble)
    assert len(calls) == 3


def test_with_schedule_swaps_only_the_schedule(plan):
    swapped = with_schedule(plan, "zbh1")
    a, b = pipeline_program(plan), pipeline_program(swapped)
    assert b.schedule.name == "zbh1" and a.schedule.name == "1f1b"
    assert b.segments is a.segments and b.stages is a.stages
    assert _labels(b.actions()[1]) != _labels(a.actions()[1])
    assert swapped.signature() != plan.signature() and with_schedule(swapped, "1f1b").signature() == plan.signature()
