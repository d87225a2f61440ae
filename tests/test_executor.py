"""The plan executor (:mod:`meshdsl.runtime.executor`) and its entry points: a feed that no
input reads is an error in every executor, and every step kind has a rule."""
from __future__ import annotations

import pytest
import torch

import meshdsl as md
from meshdsl.collectives import COLLECTIVES
from meshdsl.runtime.executor import Executor
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.runtime.steps import STEP_RULES
from meshdsl.lowering.plan import STEP_KINDS

B, D = md.Dim("batch", 8), md.Dim("d_model", 4)


def _model():
    """y = x * w (w broadcast over batch); loss = sum((y - target)^2)."""
    with md.Graph():
        x, target = md.input("x", [B, D]), md.input("target", [B, D])
        y = x * md.param("w", [D])
        return y, md.reduce_sum((y - target) ** 2)


FEEDS = {"x": torch.ones(8, 4), "target": torch.zeros(8, 4)}


def _assert_extra_feed_error(e, caller):
    text = str(e.value)
    assert f"{caller}: 1 feed(s) match no input" in text
    assert "'targte' is not an input. Did you mean 'target'?" in text
    assert "Rule:" in text and "Fix:" in text


def test_run_dense_rejects_extra_feeds():
    y, loss = _model()
    with pytest.raises(md.GraphError) as e:
        md.run_dense({"loss": loss}, {"x": FEEDS["x"], "target": FEEDS["target"], "targte": FEEDS["target"]})
    _assert_extra_feed_error(e, "run_dense")
    # y reads only x: target is extra there.
    with pytest.raises(md.GraphError, match="'target' is not an input"):
        md.run_dense({"y": y}, FEEDS)
    assert set(md.run_dense({"y": y}, {"x": FEEDS["x"]})) == {"y"}


def test_run_simulated_and_executor_reject_extra_feeds():
    _, loss = _model()
    plan = md.compile({"loss": loss}, "data:2", "batch:data")
    bad = {**FEEDS, "targte": FEEDS["target"]}
    with pytest.raises(md.GraphError) as e:
        md.run_simulated(plan, bad)
    _assert_extra_feed_error(e, "Executor.run")
    ex = Executor(plan, SimulatedComm(plan.mesh))
    with pytest.raises(md.GraphError) as e:
        ex.run(bad)
    _assert_extra_feed_error(e, "Executor.run")
    want = md.run_dense({"loss": loss}, FEEDS)["loss"]
    # fp32 sums of 32 terms in another order.
    torch.testing.assert_close(md.run_simulated(plan, FEEDS)["loss"], want, rtol=1e-6, atol=1e-6)


def test_every_step_kind_has_a_rule():
    assert set(STEP_KINDS) <= set(STEP_RULES)
    assert "repeat" in STEP_RULES  # registered by meshdsl.runtime.layers when meshdsl.exec is imported
    assert not set(COLLECTIVES) & set(STEP_RULES)  # collectives share one rule, driven by the table


def test_a_communicator_without_the_plans_micro_batches_is_refused_in_the_users_mesh():
    """A plan with micro-batches runs on its mesh plus a virtual axis (plan.mesh): a communicator of
    the user's mesh gets a message in that mesh, with the communicator to make instead."""
    _, loss = _model()
    plan = md.compile({"loss": loss}, "data:2", "batch:data", microbatches=2)
    with pytest.raises(md.GraphError) as e:
        Executor(plan, SimulatedComm(md.Mesh.parse("data:2")))
    text = str(e.value)
    assert "_mb" not in text and "the plan runs 2 micro-batches per step" in text, text
    assert "md.SimulatedComm(plan.mesh)" in text, text
    with pytest.raises(md.GraphError) as e:
        Executor(plan, SimulatedComm(md.Mesh.parse("model:4")))
    assert str(e.value).startswith("executor: plan mesh 'data:2' differs from communicator mesh 'model:4'."), e.value


@pytest.mark.parametrize("mesh, layout, kw", [("data:2", "batch:data", {}), ("model:2", "d_ff:model", {}),
                                              ("stage:2", "layer:stage", {"microbatches": 2, "schedule": "1f1b"})])
def test_a_dropped_executor_is_freed_by_reference_counting(mesh, layout, kw):
    """An executor holds no reference cycle (its step context and its generated program refer back
    to it only weakly): dropped, it is freed at once, not left for the cyclic garbage collector,
    whose full collections would walk every executor a process ran since the last one."""
    import gc
    import weakref
    from meshdsl.train.model import load_model
    m = load_model("transformer", tiny=True)
    outs = {"loss": m.loss, **{f"grad/{k}": g for k, g in md.grad(m.loss, m.params).items()}}
    plan = md.compile(outs, mesh, layout, **kw)
    gc.disable()
    try:
        ex = Executor(plan, SimulatedComm(plan.mesh))
        ex.run(m.make_feeds(0))
        ex.run(m.make_feeds(1))
        gone = weakref.ref(ex)
        del ex
        assert gone() is None
    finally:
        gc.enable()
