"""Mesh axes of size 1 split nothing (:meth:`meshdsl.layout.layout.Layout.targets`): a plan
on them has no collective, no re-layout and no copy, and is step for step the plan of the
same program on no mesh at all, so it runs at the dense program's speed."""
from __future__ import annotations

import json

import pytest

import meshdsl as md
from meshdsl.layout.mesh import Mesh
from meshdsl.tools import cli

# Per model, layouts naming the axis A: each rule would split something on a larger axis.
LAYOUTS = {
    "mlp": ["batch:A", "d_ff:A", "params.d_model:A", "batch:A; params.d_model:A", "batch:A; d_ff:A"],
    "transformer": ["batch:A", "heads:A; d_ff:A", "layer:A", "batch:A; params.d_model:A", "vocab:A",
                    "seq:A", "batch:A; heads:A; d_ff:A; vocab:A"],
    "moe": ["batch:A; experts:A", "experts:A", "d_ff:A; heads:A", "batch:A; params.d_model:A"],
}
CASES = [(m, axis, lay.replace("A", axis)) for m, lays in LAYOUTS.items()
         for axis in ("data", "model", "stage") for lay in lays]


def _steps(plan) -> list:
    """Everything a plan runs, sub-plans included, without the mesh it was compiled for."""
    out = [(s.kind, s.op, s.label, s.phase, s.ins, s.outs, s.axes, s.bytes, s.flops, s.times, s.sub_times,
            tuple(_steps(p) for p in s.subplans)) for s in plan.steps]
    out.append(tuple((v.id, v.shape, v.dtype, v.sharding) for v in plan.values.values()))
    return out


@pytest.fixture(scope="module")
def train_steps():
    built = {name: md.load_model(name, tiny=True) for name in LAYOUTS}
    return {name: (m.train_step(0.1), md.compile(m.train_step(0.1), Mesh(()))) for name, m in built.items()}


@pytest.mark.parametrize("model, axis, layout", CASES)
def test_a_size_one_axis_is_the_dense_plan(train_steps, model, axis, layout):
    outs, dense = train_steps[model]
    plan = md.compile(outs, f"{axis}:1", layout)
    assert plan.totals() == {}
    assert not any(s.kind == "split" for s in plan.steps)
    assert _steps(plan) == _steps(dense)


@pytest.mark.parametrize("model, layout", [
    ("mlp", "batch:data; d_ff:model; params.d_model:model"),
    ("transformer", "batch:data; heads:model; d_ff:model; vocab:model; layer:model"),
    ("moe", "batch:data; experts:data; d_ff:model"),
])
def test_a_size_one_axis_beside_a_real_one_changes_nothing(train_steps, model, layout):
    outs, _ = train_steps[model]
    with_one = md.compile(outs, "data:2; model:1", layout)
    without = md.compile(outs, "data:2", "; ".join(r for r in layout.split("; ") if "model" not in r))
    assert with_one.totals() == without.totals() != {}
    assert _steps(with_one) == _steps(without)


@pytest.mark.parametrize("model, mesh, layout", [
    ("transformer", "data:1", "batch:data; params.d_model:data"),
    ("moe", "stage:1", "batch:stage; experts:stage"),
])
def test_meshdsl_plan_shows_no_collective(capsys, model, mesh, layout):
    assert cli.main(["plan", model, "--tiny", "--json", "--mesh", mesh, "--layout", layout]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["totals"] == {}
    assert all(not op["collectives"] for op in report["ops"])


def test_a_size_one_axis_is_ignored_when_two_dims_want_it(train_steps):
    """``batch`` and ``d_model`` both want ``data`` in the input ``x`` (an error on ``data:2``);
    of size 1 the axis splits neither, so there is no conflict, no note and nothing moves."""
    outs, _ = train_steps["mlp"]
    plan = md.compile(outs, "data:1", "batch:data; d_model:data")
    assert plan.totals() == {} and not plan.notes
