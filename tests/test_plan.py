"""Plans as data (:mod:`meshdsl.lowering.plan`): steps hold sub-plans that figures and
reports walk generically, and a compiled plan cannot be changed."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import meshdsl as md
from meshdsl.tools.report import plan_report

MESH = "data:2; model:2"
L, B, D, F = md.Dim("layer", 3), md.Dim("batch", 8), md.Dim("d_model", 4), md.Dim("d_ff", 8)


def _block(h, p):
    return h + md.einsum("batch d_ff, d_ff d_model -> batch d_model",
                         md.relu(md.einsum("batch d_model, d_model d_ff -> batch d_ff", h, p["w1"])), p["w2"])


def _repeated():
    with md.Graph():
        x = md.input("x", [B, D])
        return md.repeat(_block, x, {"w1": md.param("w1", [L, D, F]), "w2": md.param("w2", [L, F, D])}, "layer")


def _unrolled():
    with md.Graph():
        h = md.input("x", [B, D])
        for l in range(L.size):
            h = _block(h, {"w1": md.param(f"w1_{l}", [D, F]), "w2": md.param(f"w2_{l}", [F, D])})
        return h


@pytest.mark.parametrize("layout, allreduce_bytes", [
    # d_ff split: one allreduce of the [batch, d_model] fp32 output per layer.
    ("d_ff:model", B.size * D.size * 4),
    # batch split too: the allreduce moves half a batch.
    ("batch:data; d_ff:model", B.size // 2 * D.size * 4),
])
def test_figures_walk_the_loop_body(layout, allreduce_bytes):
    """A repeat's plan counts its body once per layer: the same figures as the unrolled model."""
    looped = md.compile({"y": _repeated()}, MESH, layout)
    flat = md.compile({"y": _unrolled()}, MESH, layout)
    (step,) = [s for s in looped.steps if s.subplans]
    assert step.kind == "repeat" and step.times == L.size
    want = {"allreduce": {"count": L.size, "bytes": L.size * allreduce_bytes}}
    assert looped.totals() == flat.totals() == want
    assert looped.flops() == flat.flops() == L.size * step.subplans[0].flops()
    assert [(c.kind, m) for c, m in looped.collectives()] == [("allreduce", L.size)]


@pytest.mark.parametrize("layout", ["d_ff:model", "batch:data; d_ff:model", "batch:data"])
def test_report_rows_add_up_to_the_plan_figures(layout):
    """The report lists the body's rows with their multiplicity; its rows sum to the plan's totals."""
    y = _repeated()
    plan = md.compile({"y": y, **dict(zip(("g1", "g2"), md.grad(md.reduce_sum(y * y), [
        n.outputs[0] for n in y.graph.nodes if n.op.name == "param"])))}, MESH, layout)
    rep = plan_report(plan)
    assert sum(e["flops"] * e["times"] for e in rep["ops"]) == plan.flops() == rep["flops"]
    by_kind: dict = {}
    for e in rep["ops"]:
        for c in e["collectives"]:
            t = by_kind.setdefault(c["kind"], {"count": 0, "bytes": 0})
            t["count"] += e["times"]
            t["bytes"] += e["times"] * c["bytes"]
    assert by_kind == rep["totals"] == plan.totals()
    assert any(e["times"] == L.size and e["label"].startswith("repeat") for e in rep["ops"])


def test_compiled_plans_are_read_only():
    y = _repeated()
    plan = md.compile({"y": y}, MESH, "d_ff:model")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.notes = ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.steps[0].phase = "backward"
    with pytest.raises(AttributeError):
        plan.steps.append(plan.steps[0])
    for mapping in (plan.values, plan.outputs, plan.params, plan.inputs, plan.steps[-1].args):
        with pytest.raises(TypeError):
            mapping["new"] = 0
    (step,) = [s for s in plan.steps if s.subplans]
    with pytest.raises(TypeError):
        step.subplans[0].outputs["out"] = 0
    # The cache hands out the same plan again, unchanged by the attempts above.
    again = md.compile({"y": y}, MESH, "d_ff:model")
    assert again is plan and again.signature() == plan.signature()
    feeds = {"x": torch.randn(8, 4, generator=torch.Generator().manual_seed(0))}
    # Same plan, same seed: identical numbers on a second run.
    assert torch.equal(md.run_simulated(again, feeds)["y"], md.run_simulated(plan, feeds)["y"])


def test_steps_carry_no_code_of_the_executor():
    """A loop step is data: sub-plans and plain args, nothing the executor put there."""
    y = _repeated()
    plan = md.compile({"y": y}, MESH, "d_ff:model")
    (step,) = [s for s in plan.steps if s.subplans]
    before = dict(step.args)
    md.run_simulated(plan, {"x": torch.zeros(8, 4)})
    assert dict(step.args) == before
    assert set(before) == {"names", "pos", "backward", "saved"}
    assert not any(callable(v) for v in before.values())
