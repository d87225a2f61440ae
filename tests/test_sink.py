"""Gradients written by their matmul into the loop's stacked buffer, or added into a pipeline's sum
(runtime/deferred.py, runtime/layers.py, runtime/pipeline_store.Accumulator.into).

A repeat's backward loop used to copy each layer's weight gradients into its stacked
buffer, and a pipeline then added each micro-batch's stacked gradients into a running
sum.  Now the gradient's matmul writes into the layer's slice itself (``mm(out=)``) for
the first micro-batch, and adds into the running sum (``addmm_``) for every later one.
Counted here by spying on ``MatmulForm.matmul_into``; the results are checked against
the dense program with tests/test_pipeline_exec.py's tolerance (the sums are the same
products added in the same micro-batch order, rounded inside the BLAS kernel).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import meshdsl as md
from meshdsl.runtime.executor import Executor
from meshdsl.runtime.layers import _split_tail
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.runtime.deferred import Sink, install
from meshdsl.ops.matmul_form import MatmulForm
from meshdsl.train.step import training_outputs
from models.transformer import Config, build

REL = 1e-5   # as tests/test_pipeline_exec.py
CFG = dataclasses.replace(Config.tiny(), layers=4, batch=8)
MATMUL_GRADS = ("wq", "wk", "wv", "wo", "w_fc", "w_proj")   # per layer, made by an einsum


@pytest.fixture(scope="module")
def reference():
    m = build(CFG)
    outs = training_outputs(m.loss, m.params, 0.1, with_grads=True)
    feeds = m.feeds(0)
    return m, outs, feeds, md.run_dense(outs, feeds)


class _Calls(list):
    later: list

    def __init__(self):
        super().__init__()
        self.later = []


@pytest.fixture
def calls(monkeypatch):
    """Every ``matmul_into`` call: (accumulate, wrote into the buffer); ``calls.later``: per
    call, whether its BLAS call was put off."""
    seen = _Calls()
    real = MatmulForm.matmul_into

    def spy(self, x, y, out, accumulate, later=None, calls=None):
        got = real(self, x, y, out, accumulate, later, calls)
        seen.append((accumulate, got is out))
        seen.later.append(later is not None)
        return got
    monkeypatch.setattr(MatmulForm, "matmul_into", spy)
    return seen


def _matches(got, want):
    for k, ref in want.items():
        torch.testing.assert_close(got[k], ref, rtol=REL, atol=REL * ref.abs().max().item(), msg=k)


def test_each_weight_gradient_is_written_into_its_layer_slice(reference, calls):
    _, outs, feeds, want = reference
    plan = md.compile(outs, "data:1", "")
    ex = Executor(plan, SimulatedComm(plan.mesh))
    _matches(ex.full_outputs(ex.run(feeds)), want)
    assert calls == [(False, True)] * (CFG.layers * len(MATMUL_GRADS))


@pytest.mark.parametrize("mesh, layout, ranks", [("stage:2", "layer:stage", 1),
                                                 ("stage:2; data:2", "layer:stage; batch:data", 2)])
def test_later_micro_batches_add_into_the_running_sum(reference, calls, mesh, layout, ranks):
    """m = 4: the first micro-batch writes each layer's gradient, the other three add into it,
    on every rank of its stage; nothing is copied."""
    _, outs, feeds, want = reference
    m = 4
    plan = md.compile(outs, mesh, layout, microbatches=m, schedule="1f1b")
    ex = Executor(plan, SimulatedComm(plan.mesh))
    _matches(ex.full_outputs(ex.run(feeds)), want)
    per_mb = CFG.layers * len(MATMUL_GRADS) * ranks
    assert sorted(calls) == [(False, True)] * per_mb + [(True, True)] * (m - 1) * per_mb


def test_gpipe_and_a_second_step_start_new_sums(reference, calls):
    """Each step starts its sums afresh (GPipe runs every forward first: the order of B
    actions is what counts)."""
    _, outs, feeds, want = reference
    plan = md.compile(outs, "stage:2", "layer:stage", microbatches=2, schedule="gpipe")
    ex = Executor(plan, SimulatedComm(plan.mesh))
    for _ in range(2):
        _matches(ex.full_outputs(ex.run(feeds)), want)
    per_mb = CFG.layers * len(MATMUL_GRADS)
    assert sorted(calls) == [(False, True)] * 2 * per_mb + [(True, True)] * 2 * per_mb


def test_only_a_matmul_made_gradient_gets_a_sink(reference):
    """The layer norms' gains are sums over rows (no matmul): they keep their copy."""
    _, outs, _, _ = reference
    plan = md.compile(outs, "data:1", "")
    loop = next(s for s in plan.steps if s.kind == "repeat" and s.args["backward"])
    body, _ = _split_tail(loop.subplans[0], ())
    sub = Executor(body, SimulatedComm(plan.mesh))
    sinks = {k: install(sub, body.outputs[f"d/{k}"]) for k in loop.args["names"]}
    assert {k for k, s in sinks.items() if isinstance(s, Sink)} == set(MATMUL_GRADS)
    assert install(sub, body.outputs["dcarry"]) is None   # read by nothing, but not a weight's matmul


@pytest.mark.parametrize("schedule, m", [("1f1b", 4), ("gpipe", 4), ("1f1b", 1)])
def test_a_stage_that_sends_a_gradient_runs_its_weight_gradients_after_the_send(reference, calls, schedule, m):
    """Stage 1 sends each B's input gradient upstream: its loop's weight-gradient matmuls
    are put off into a W action right after that send; stage 0 sends nothing and keeps
    them in its B.  The results are the dense program's, and bitwise those of the run that
    defers nothing (the same products, added in the same order).  With one micro-batch
    nothing is summed, and the W still follows the send."""
    _, outs, feeds, want = reference
    plan = md.compile(outs, "stage:2", "layer:stage", microbatches=m, schedule=schedule)
    ex = Executor(plan, SimulatedComm(plan.mesh))
    got = ex.full_outputs(ex.run(feeds))
    _matches(got, want)
    per_mb = CFG.layers // 2 * len(MATMUL_GRADS)
    assert sorted(calls.later) == [False] * m * per_mb + [True] * m * per_mb
    rows = {row[0][0].stage: [a.label(with_stage=False) for a, *_ in row] for row in ex.last_timeline}
    for mb in range(m):
        at = rows[1].index(f"sB{mb}>0")
        after = [x for x in rows[1][at + 1:] if x[0] in "FBW"]
        assert after[0] == f"W{mb}", rows[1]      # the next compute after the send
        assert rows[1].index(f"B{mb}") < at
    assert not any(x.startswith("W") for x in rows[0])

    calls.clear()
    calls.later.clear()
    try:
        Executor.defer_weight_grads = False
        plain = Executor(plan, SimulatedComm(plan.mesh))
    finally:
        Executor.defer_weight_grads = True
    again = plain.full_outputs(plain.run(feeds))
    assert not any(calls.later)
    assert not any(a.kind == "W" for row in plain.last_timeline for a, *_ in row)
    for k in want:
        assert torch.equal(got[k], again[k]), k


@pytest.mark.parametrize("mesh, layout", [("data:1", ""), ("model:2", "d_ff:model")])
def test_a_matmul_outside_the_repeat_adds_later_micro_batches_into_its_sum(calls, mesh, layout):
    """The MLP's two weight gradients are einsums outside any loop: under accumulation the
    first micro-batch's product becomes the running sum, and the three later ones add into it
    (runtime/deferred.py product_sums), on every rank."""
    model = md.load_model("mlp", tiny=True)
    outs = training_outputs(model.loss, model.params, 0.1, with_grads=True)
    feeds = model.feeds(0)
    want = md.run_dense(outs, feeds)
    m = 4
    plan = md.compile(outs, mesh, layout, microbatches=m)
    ex = Executor(plan, SimulatedComm(plan.mesh))
    _matches(ex.full_outputs(ex.run(feeds)), want)
    ranks = plan.mesh.size // m
    assert calls == [(True, True)] * (m - 1) * len(model.params) * ranks
