"""A pipeline stage drops a micro-batch's values inside its F or B action, right after
their last reader (the program's ``drops``: meshdsl/lowering/pipeline_program.py; run by
meshdsl/runtime/pipeline.py).

Pinned: a dropped value is made by that segment on that stage and read only by that
segment's compute steps there (never by a send, the other segment, the final segment
or the plan's outputs), it goes after its last reader, the drops really run in every
compute action, and the pipelined step still matches the dense program.
"""
from __future__ import annotations

import dataclasses

import torch

import meshdsl as md
from meshdsl.lowering.pipeline_program import Segment
from meshdsl.runtime import pipeline
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.train.step import training_outputs
from models.transformer import Config, build

CFG = dataclasses.replace(Config.tiny(), layers=2, batch=8)


def _plan(m=4):
    model = build(CFG)
    outs = training_outputs(model.loss, model.params, 0.1, with_grads=True)
    feeds = model.feeds(0)
    return md.compile(outs, "stage:2", "layer:stage", microbatches=m, schedule="1f1b"), outs, feeds


def test_drops_are_values_only_their_action_reads():
    plan, _, _ = _plan()
    step = next(s for s in plan.steps if s.kind == "pipeline")
    program = step.args["program"]
    segments = [(p.steps, st) for p, st in zip(step.subplans, program.stages)]
    kept = {v for s in step.subplans[3].steps for v in s.ins} | set(step.outs)
    assert kept <= program.kept
    total = 0
    for seg in (Segment.FORWARD, Segment.BACKWARD):
        for stage in (0, 1):
            for j, values in program.drops(seg, stage).items():
                for v in values:
                    total += 1
                    assert v not in kept and v not in plan.outputs.values()
                    assert any(v in s.outs for s, st in zip(*segments[seg]) if stage in st)
                    readers = [(k, i, s, st) for k, (steps, stages) in enumerate(segments)
                               for i, (s, st) in enumerate(zip(steps, stages)) if v in s.ins]
                    assert all(k == seg and s.kind not in ("send", "recv") and stage in st
                               for k, i, s, st in readers)
                    assert j == max(i for _, i, _, _ in readers)
    assert total > 0, "the loss's forward on the last stage has values only it reads"


def test_drops_run_and_the_step_matches_dense(monkeypatch):
    calls = []
    real = pipeline._dropper

    def spy(store, ranks, values):
        drop = real(store, ranks, values)

        def run(r):
            drop(r)
            calls.append(all(r_ not in store.get(v, {}) for v in values for r_ in ranks))
        return run
    monkeypatch.setattr(pipeline, "_dropper", spy)
    plan, outs, feeds = _plan()
    ex = md.Executor(plan, SimulatedComm(plan.mesh))
    got = ex.full_outputs(ex.run(feeds))
    assert calls and all(calls)
    assert len(calls) >= 4  # at least once per micro-batch on the last stage
    want = md.run_dense(outs, feeds)
    for k, ref in want.items():
        # as tests/test_pipeline_exec.py: micro-batch sums in another order, fp32 rounding
        # only (a few ulps of the largest magnitude); a dropped live value is off by O(1)
        scale = ref.abs().max().item()
        torch.testing.assert_close(got[k], ref, rtol=1e-5, atol=1e-5 * scale)


def test_finished_activations_are_freed_before_the_next_compute(monkeypatch):
    """What a micro-batch leaves on a stage when it finishes there leaves the store at once (as
    test_accumulate.py pins); the runtime lets go of it (the memory given back, unless a live
    value shares it) before the next F, B or W at the latest, after the transfers between
    (a receive that would wait frees it sooner: test_shm_pipe.py's ``ready``)."""
    held, finishing = [], []
    real = pipeline._Runner._action

    def spy(self, k, sa):
        rank, act, calls, finished, compute = real(self, k, sa)
        if finished is not None:
            finishing.append(act)
        if compute:
            calls = [lambda run: held.append(len(self.garbage)), *calls]
        return rank, act, calls, finished, compute
    monkeypatch.setattr(pipeline._Runner, "_action", spy)
    plan, _, feeds = _plan()
    ex = md.Executor(plan, SimulatedComm(plan.mesh))
    ex.run(feeds)
    assert len(finishing) == 2 * 4   # each micro-batch once per stage
    assert held and not any(held), "a finished micro-batch's values still held at a compute action"
