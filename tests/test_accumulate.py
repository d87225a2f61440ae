"""Gradient accumulation without a pipeline runs one micro-batch at a time
(meshdsl/lowering/accumulate.py, run by meshdsl/runtime/pipeline.py).

Pinned: a micro-batched plan with no pipeline axis is the leaves plus one ``accumulate``
step whose segments hold what they should (the forward pass, the backward, the sums over
the micro-batch axis and the update); its schedule is ``F0 B0 F1 B1 ...``; while it runs,
a process holds the activations of one micro-batch only; the memory report's activation
peak shrinks with the micro-batch count; and, as a property over models, layouts and
micro-batch counts, the loss and every gradient equal the dense program's.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import meshdsl as md
from conftest import assert_matches_scaled
from meshdsl.runtime import pipeline_store
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.lowering.accumulate import segments
from meshdsl.lowering.memory import memory_report
from meshdsl.lowering.pipeline import MB_AXIS
from meshdsl.train.step import training_outputs
from models.transformer import Config, build

# As tests/test_pipeline_exec.py: micro-batch sums add in another order than the dense
# program's, a few ulps of each output's largest magnitude; a lost or doubled micro-batch
# is off by O(1).
REL = 1e-5
GPT = dataclasses.replace(Config.tiny(), layers=2, batch=8)
_BUILT: dict = {}


def _reference(name):
    if name not in _BUILT:
        model = build(GPT) if name == "transformer" else md.load_model("mlp", tiny=True)
        outs = training_outputs(model.loss, model.params, 0.1, with_grads=True)
        feeds = model.feeds(0)
        _BUILT[name] = (outs, feeds, md.run_dense(outs, feeds))
    return _BUILT[name]


def _assert_matches(got, want, what):
    assert_matches_scaled(got, want, what, REL)


def _accumulate_step(plan):
    steps = [s for s in plan.steps if s.kind not in ("param", "input")]
    assert [s.kind for s in steps] == ["accumulate"], "the leaves and one accumulate step"
    return steps[0]


def test_the_plan_is_one_accumulate_step_of_four_segments():
    outs, _, _ = _reference("transformer")
    plan = md.compile(outs, "data:2", "batch:data", microbatches=4)
    step = _accumulate_step(plan)
    prologue, forward, backward, final = step.subplans
    assert step.sub_times == (1, 4, 4, 1) and step.args["num_stages"] == 1 and step.args["axis"] is None
    assert [(a.kind, a.microbatch) for a in step.args["program"].schedule.actions[0]] == \
        [(k, mb) for mb in range(4) for k in ("F", "B")]
    assert all(s.phase == "forward" for s in forward.steps)
    assert {s.kind for s in forward.steps} >= {"repeat"} and {s.op for s in backward.steps} >= {"repeat_grad"}
    # Every sum over the micro-batch axis, and the update after it, runs once, at the end.
    for seg in (prologue, forward, backward):
        assert not any(MB_AXIS in s.axes for s in seg.steps if s.is_collective)
    assert any(s.is_collective and MB_AXIS in s.axes for s in final.steps)
    assert sum(s.op == "sgd_update" for s in final.steps) == len(plan.params)
    # The per-micro-batch segments count m times in the plan's totals (each run holds one micro-batch).
    assert plan.flops() == sum(n * sub.flops(step.held(k, plan.held_microbatches))
                               for k, (n, sub) in enumerate(zip(step.sub_times, step.subplans)))


def test_no_accumulate_step_without_micro_batches_or_with_a_pipeline():
    outs, _, _ = _reference("transformer")
    assert not any(s.kind == "accumulate" for s in md.compile(outs, "data:2", "batch:data").steps)
    piped = md.compile(outs, "stage:2", "layer:stage", microbatches=2)
    assert [s.kind for s in piped.steps if s.kind not in ("param", "input")] == ["pipeline"]


def test_segments_follow_the_data_flow():
    """No segment reads a value a later one makes."""
    outs, _, _ = _reference("transformer")
    plan = md.compile(outs, "data:2; model:2", "batch:data; d_ff:model", microbatches=2, fuse=False)
    step = _accumulate_step(plan)
    order = {v: k for k, sub in enumerate(step.subplans) for s in sub.steps for v in s.outs}
    for k, sub in enumerate(step.subplans):
        for s in sub.steps:
            assert all(order.get(v, -1) <= k for v in s.ins), f"{s.label} reads a later segment"
    assert segments([]) == []


def test_a_process_holds_one_micro_batch_at_a_time(monkeypatch):
    """Every activation the store holds belongs to one micro-batch (the feeds and params, the
    prologue's once-per-step values and what the final segment reads are not activations)."""
    outs, feeds, want = _reference("transformer")
    plan = md.compile(outs, "data:1", "", microbatches=4)
    step = _accumulate_step(plan)
    kept = {v for s in step.subplans[3].steps for v in s.ins} | set(step.outs) | set(step.ins)
    kept |= {v for s in step.subplans[0].steps for v in s.outs}
    alive_most = []

    def spying(real):
        def spy(self, vid, xs):
            real(self, vid, xs)
            alive = {r for v, slot in self.store.items() if v not in kept for r in slot}
            alive_most.append(len(alive))
        return spy
    for env in (pipeline_store.ViewEnv, pipeline_store.OneRankEnv):   # a view of one rank has its own
        monkeypatch.setattr(env, "__setitem__", spying(env.__setitem__))
    ex = md.Executor(plan, SimulatedComm(plan.mesh))
    got = ex.full_outputs(ex.run(feeds))
    _assert_matches(got, want, "data:1 m=4")
    assert alive_most and max(alive_most) == 1, "activations of two micro-batches at once"
    assert [(a.kind, a.microbatch) for a, _, _ in ex.last_timeline[0]] == \
        [(k, mb) for mb in range(4) for k in ("F", "B")]


def test_the_memory_report_counts_one_micro_batch_of_activations():
    outs, _, _ = _reference("transformer")
    peaks = {m: memory_report(md.compile(outs, "data:1", "", microbatches=m))["activations_peak"] for m in (1, 2, 4)}
    assert peaks[4] < peaks[2] < peaks[1]
    assert peaks[4] <= peaks[1] / 2


LAYOUTS = [("data:1", ""), ("data:2", "batch:data"), ("model:2", "d_ff:model"),
           ("data:2; model:2", "batch:data; d_ff:model"), ("data:2", "batch:data; params.d_model:data")]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(["mlp", "transformer"]), mesh_layout=st.sampled_from(LAYOUTS),
       m=st.sampled_from([2, 4]))
def test_accumulation_matches_the_dense_program(name, mesh_layout, m):
    mesh, layout = mesh_layout
    note(f"{name} mesh={mesh!r} layout={layout!r} m={m}")
    outs, feeds, want = _reference(name)
    plan = md.compile(outs, mesh, layout, microbatches=m)
    _accumulate_step(plan)
    ex = md.Executor(plan, SimulatedComm(plan.mesh))
    _assert_matches(ex.full_outputs(ex.run(feeds)), want, f"{name} {mesh} {layout} m={m}")


@pytest.mark.parametrize("m", [2, 4])
def test_sgd_steps_follow_the_dense_curve(m):
    """Three SGD steps with accumulation: the dense program's losses."""
    model = build(GPT)
    feeds = [model.feeds(k) for k in range(3)]
    curves = []
    for micro in (1, m):
        ts = md.TrainStep(model.loss, model.params, "data:2", "batch:data", SimulatedComm(md.Mesh.parse("data:2")),
                          lr=0.1, microbatches=micro)
        curves.append([float(ts(f)[0]) for f in feeds])
    torch.testing.assert_close(torch.tensor(curves[1]), torch.tensor(curves[0]), rtol=REL, atol=0)
