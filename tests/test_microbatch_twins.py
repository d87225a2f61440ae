"""Steps that do not vary per micro-batch run once per process (meshdsl/runtime/steps.py: twins),
and an optimizer update overwrites its param and state when the executor may donate them.

With ``microbatches=m`` a process holds m virtual ranks.  A step none of whose values is
split or partial along the micro-batch axis (the optimizer update after the gradients are
folded) computes the same on all of them: it runs on one, and the others read its result.
Every case here compares against the same plan run without micro-batches (or without
donation) on the same numbers.
"""
from __future__ import annotations

import torch

import meshdsl as md
from meshdsl.runtime.executor import Executor
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.lowering.compiler import compile as compile_plan
from meshdsl.ops import optim
from meshdsl.search.calibrate import Calibration
from meshdsl.search.predict import predict
from meshdsl.train.step import optimizer_outputs

ADAMW = md.AdamW(lr=1e-2, weight_decay=0.1)


def _train_plan(mesh, layout, m):
    model = md.load_model("mlp", tiny=True)
    outs = optimizer_outputs(model.loss, model.params, ADAMW, False)
    return model, compile_plan(outs, mesh, layout, microbatches=m)


def _run(plan, model, donate=False, params=None):
    ex = Executor(plan, SimulatedComm(plan.mesh), donate_params=donate)
    params = ex.init_params(0) if params is None else params
    res = ex.run({**model.feeds(0), **ADAMW.feeds(0)}, params)
    return ex, res


def _count_updates(monkeypatch):
    calls = []
    real = optim._adamw

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)
    monkeypatch.setattr(optim, "_adamw", counted)
    return calls


def test_update_runs_once_per_process_under_accumulation(monkeypatch):
    model, plan = _train_plan("data:2", "batch:data", 4)
    updates = sum(1 for s, _ in plan.walk() if s.op == "adamw_update")
    assert updates == len(model.params)
    calls = _count_updates(monkeypatch)
    ex, res = _run(plan, model)
    assert len(calls) == updates * 2, "one update per param and real rank, not per micro-batch rank"
    for name in model.params:
        xs = res[f"new/{name}"]
        assert len(xs) == 8
        assert all(xs[j] is xs[j - j % 4] for j in range(8)), "micro-batch twins read one result"
        assert xs[0] is not xs[4], "the two real ranks keep their own"
    # the same numbers as one micro-batch (the plan without the virtual axis)
    _, plan1 = _train_plan("data:2", "batch:data", 1)
    ex1, res1 = _run(plan1, model)
    got, want = ex.full_outputs(res), ex1.full_outputs(res1)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_steps_that_vary_per_microbatch_still_run_per_microbatch(monkeypatch):
    _, plan = _train_plan("data:2", "batch:data", 4)
    ex = Executor(plan, SimulatedComm(plan.mesh))
    from meshdsl.runtime.steps import representatives
    steps = [s for s, _ in plan.walk()]   # inside the accumulate step (lowering/accumulate.py)
    per_mb = [s for s in steps if s.kind == "local" and s.op == "einsum" and s.phase == "forward"]
    assert per_mb and all(representatives(ex.plan, ex.comm, s) is None for s in per_mb), "a forward einsum reads its micro-batch"
    update = [s for s in steps if s.op == "adamw_update"]
    reps, of = representatives(ex.plan, ex.comm, update[0])
    assert len(reps) == 2 and of == (0, 0, 0, 0, 1, 1, 1, 1)


def test_adamw_overwrites_param_and_state_when_donated():
    model, plan = _train_plan("data:2", "batch:data", 1)
    one = Executor(plan, SimulatedComm(plan.mesh, ranks=(0,)), donate_params=True)
    donated = {plan.steps[i].op for i in one.donated}
    assert donated == {"adamw_update"}
    # Two ranks in one process may share a replicated tensor: never donated there.
    assert not Executor(plan, SimulatedComm(plan.mesh), donate_params=True).donated


def test_donated_update_under_accumulation_gives_the_same_steps():
    """On one process with micro-batches (one real rank's virtual ranks), the update runs
    once and writes into the param and the AdamW moments; two steps equal the
    out-of-place ones exactly."""
    model, plan = _train_plan("data:1", "", 2)
    assert plan.mesh.size == 2  # the virtual micro-batch axis
    exs = [Executor(plan, SimulatedComm(plan.mesh), donate_params=d) for d in (True, False)]
    # The update runs in the accumulate step's final segment, which donates it (runtime/pipeline.py).
    assert [s.kind for s in plan.steps if s.kind not in ("param", "input")] == ["accumulate"]
    assert exs[0].donates and not exs[1].donates
    carried = [k for k in plan.params if f"new/{k}" in plan.outputs]
    params = [exs[1].init_params(0) for _ in exs]
    before = params[0]["w1"][0].clone()
    for step in range(2):
        feeds = {**model.feeds(step), **ADAMW.feeds(step)}
        outs = [ex.run(feeds, p) for ex, p in zip(exs, params)]
        if step == 0:
            assert outs[0]["new/w1"][0].data_ptr() == params[0]["w1"][0].data_ptr(), "written in place"
        for p, o in zip(params, outs):
            for k in carried:
                p[k] = o[f"new/{k}"]
    assert not torch.equal(params[0]["w1"][0], before)
    for k in carried:
        torch.testing.assert_close(params[0][k][0], params[1][k][0], rtol=0, atol=0)


def test_update_after_accumulation_is_priced_once():
    _, plan1 = _train_plan("data:2", "batch:data", 1)
    _, plan4 = _train_plan("data:2", "batch:data", 4)
    cal = Calibration.defaults()

    def update_ms(plan):
        return sum(c for _, op, c, _ in predict(plan, cal).by_op if op == "adamw_update")
    assert update_ms(plan4) == update_ms(plan1) > 0
