"""Interleaved 1F1B with the zero-bubble split: ``schedule="interleaved-zb:v"`` (lowering/w_placement.py).

The schedule's properties for p in {2, 4}, v in {2, 3}, m in {p, 2p}: a valid, deadlock-free
order with one W after each B; the same transfers, in the same order, as plain interleaved;
never a longer simulated makespan than plain interleaved as the runtime runs it, at the costs
it was placed for (F = B = W = 1, and others given, stages unequal too), and no rank holding
more activations than plain interleaved's busiest.  The lowered plan gives the dense program's
numbers on the simulated mesh with the peaks the schedule says (a gloo case lives in
tests/test_pipeline_dist.py), and ``plan`` prints it.
"""
from __future__ import annotations

from fractions import Fraction

import pytest

import meshdsl as md
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.lowering.schedule import Schedule, split_backward, validate, with_transfers
from meshdsl.lowering.schedule_gen import (ZB_COST, _interleaved_orders, interleaved_zero_bubble_at, make_schedule,
                                           named_schedule, parse_schedule, peak_theory)
from meshdsl.lowering.timeline import bubble_from_timeline, simulate
from meshdsl.lowering.w_placement import put_off, with_ws
from meshdsl.train.step import training_outputs

from conftest import assert_matches_scaled, run_cli

REL = 1e-5  # as tests/test_interleave.py: micro-batch sums in another order, fp32 rounding only
SIZES = [(p, v, k * p) for p in (2, 4) for v in (2, 3) for k in (1, 2)]


def _plain(p: int, m: int, v: int) -> Schedule:
    """Plain interleaved with a W right after each B (after its send): how the runtime runs it."""
    return Schedule("interleaved", p, m, with_transfers(with_ws(_interleaved_orders("interleaved", p, m, v)), p * v), v)


def _transfers(s: Schedule) -> list:
    return [[a for a in row if a.is_send or a.is_recv] for row in s.actions]


def test_the_plain_baseline_is_the_runtime_split():
    """The baseline compared against is the runtime's run of plain interleaved: its split
    schedule, where a stage-0 B (no send) keeps its weight gradients (its W right after it)."""
    for p, v, m in SIZES:
        plain, split = _plain(p, m, v), split_backward(make_schedule("interleaved", p, m, v))
        tail = [[a for prev, a in zip((None,) + row, row) if not (a.kind == "W" and prev is not None
                                                                  and prev.kind == "B" and a.stage == 0)]
                for row in plain.actions]
        assert tail == [list(row) for row in split.actions]


@pytest.mark.parametrize("p,v,m", SIZES)
def test_the_schedule_is_valid_and_never_worse_than_plain_interleaved(p, v, m):
    s = named_schedule(f"interleaved-zb:{v}", p, m)
    validate(s)   # every action on its rank, in a valid order, and no deadlock
    assert (s.name, s.num_chunks, s.num_stages) == ("interleaved-zb", v, p * v)
    assert all({a.stage for a in row} == set(range(r, p * v, p)) for r, row in enumerate(s.actions))
    for row in s.actions:   # one W per B, after it
        b = {(a.microbatch, a.stage): i for i, a in enumerate(row) if a.kind == "B"}
        w = {(a.microbatch, a.stage): i for i, a in enumerate(row) if a.kind == "W"}
        assert b.keys() == w.keys() and all(b[k] < w[k] for k in b)
    plain = _plain(p, m, v)
    assert _transfers(s) == _transfers(plain)   # Ws move, nothing else does
    got, base = simulate(s, ZB_COST), simulate(plain, ZB_COST)
    assert got.makespan <= base.makespan
    assert all(r.busy == 3 * v * m for r in got.ranks)   # the same work
    assert max(r.idle_fraction for r in got.ranks) <= max(r.idle_fraction for r in base.ranks)
    assert max(r.peak_activations for r in got.ranks) == max(r.peak_activations for r in base.ranks)
    assert [r.peak_activations for r in got.ranks] == [peak_theory("interleaved-zb", p, m, r, v) for r in range(p)]


def test_it_shrinks_the_bubble_where_plain_interleaved_leaves_one():
    """p = 2, v = 2, m = 8 (the pipeline bench's case), F = B = W = 1: the last rank runs its last
    four Ws after its last B, so its Bs send their gradients upstream back to back; the bubble
    halves, the busiest rank's peak stays 5 and the last rank's rises from 3 to 4."""
    s, plain = named_schedule("interleaved-zb:2", 2, 8), _plain(2, 8, 2)
    assert [str(a) for a in s.actions[1][-4:]] == ["W6@3", "W7@3", "W6@1", "W7@1"]
    got, base = simulate(s, ZB_COST), simulate(plain, ZB_COST)
    assert (got.makespan, base.makespan) == (49, 50)
    assert max(r.idle_fraction for r in got.ranks) == Fraction(1, 49)
    assert max(r.idle_fraction for r in base.ranks) == Fraction(2, 50)
    assert [r.peak_activations for r in got.ranks] == [5, 4]
    assert [r.peak_activations for r in base.ranks] == [5, 3]


def _uneven(f, b, w, last: int, heavier):
    """F, B and W costs with the last stage ``heavier`` times the others (the head and the loss)."""
    return lambda a: {"F": f, "B": b, "W": w}.get(a.kind, 0) * (heavier if a.stage == last else 1)


# Two tables run with -m slow: (5, 6, 4, 3/2) keeps a last stage heavier by a fraction, and the
# first two tables integer costs.
@pytest.mark.parametrize("f,b,w,heavier", [(1, 1, 1, 1), (2, 3, 2, 1), (5, 6, 4, Fraction(3, 2)),
                                           pytest.param(4, 5, 3, Fraction(5, 4), marks=pytest.mark.slow),
                                           pytest.param(1, 2, 1, 2, marks=pytest.mark.slow)])
def test_placed_at_given_costs_it_is_never_worse_at_those_costs(f, b, w, heavier):
    for p, v, m in SIZES:
        cost = _uneven(f, b, w, p * v - 1, heavier)
        s = interleaved_zero_bubble_at(p, m, v, cost)
        plain = _plain(p, m, v)
        got, base = simulate(s, cost), simulate(plain, cost)
        assert got.makespan <= base.makespan, (p, v, m)
        assert max(r.peak_activations for r in got.ranks) <= max(r.peak_activations for r in base.ranks)


def test_put_off_moves_a_ranks_last_ws_after_its_last_b():
    order = with_ws([[("F", 0, 1), ("F", 1, 1), ("B", 0, 1), ("F", 2, 1), ("B", 1, 1), ("B", 2, 1)]])[0]
    assert put_off(order, 0) == order
    assert put_off(order, 2) == [("F", 0, 1), ("F", 1, 1), ("B", 0, 1), ("W", 0, 1), ("F", 2, 1), ("B", 1, 1),
                                 ("B", 2, 1), ("W", 1, 1), ("W", 2, 1)]


def test_names_and_refusals():
    assert parse_schedule("interleaved-zb:3") == ("interleaved-zb", 3)
    for bad, words in (("interleaved-zb", "name its virtual stages"), ("interleaved-zb:0", "name its virtual stages")):
        with pytest.raises(md.MeshDSLError, match=words):
            parse_schedule(bad)
    with pytest.raises(md.MeshDSLError, match="'interleaved-zb:2' with 2 rank.* and 3 micro-batch"):
        named_schedule("interleaved-zb:2", 2, 3)
    with pytest.raises(md.MeshDSLError, match="num_chunks = 0"):
        interleaved_zero_bubble_at(2, 4, 0)


@pytest.mark.parametrize("layers,mesh,layout,m,v", [
    (4, "stage:2", "layer:stage", 4, 2),
    (6, "stage:2", "layer:stage", 2, 3),
    (8, "stage:4", "layer:stage", 4, 2),
    (4, "stage:2; data:2", "layer:stage; batch:data", 4, 2),
])
def test_interleaved_zb_matches_dense_on_the_simulated_mesh(layers, mesh, layout, m, v):
    model = md.load_model("transformer", tiny=True, layers=layers, batch=8 * (2 if "data" in mesh else 1))
    outs = training_outputs(model.loss, model.params, 0.1, with_grads=True)
    plan = md.compile(outs, mesh, layout, microbatches=m, schedule=f"interleaved-zb:{v}")
    ex = md.Executor(plan, SimulatedComm(plan.mesh))
    assert_matches_scaled(ex.full_outputs(ex.run(model.feeds(0))), md.run_dense(outs, model.feeds(0)), mesh, REL)
    # Measured like the other schedules: per rank, the activations held at once are the schedule's.
    p = md.Mesh.parse(mesh).sizes["stage"]
    stats = bubble_from_timeline(ex.last_timeline)
    assert [r.peak_activations for r in stats.ranks] == [peak_theory("interleaved-zb", p, m, r, v) for r in range(p)]


def test_plan_prints_the_schedule_and_a_bad_name_exits_2(capsys):
    pipe = ["transformer", "--tiny", "--config", "layers=4", "--mesh", "stage:2", "--layout", "layer:stage",
            "--microbatches", "4"]
    rc, out, err = run_cli(capsys, ["plan", *pipe, "--schedule", "interleaved-zb:2"])
    assert rc == 0, err
    assert "schedule interleaved-zb:2; in theory: bubble 4.0%, activations held per stage [5, 4]" in out
    assert "rank 1 | .    F0@1" in out and "W2@3 W3@3 W2@1 W3@1" in out
    rc, out, err = run_cli(capsys, ["plan", *pipe, "--schedule", "interleaved-zb"])
    assert rc == 2 and "write interleaved-zb:V" in err
