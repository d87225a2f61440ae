"""Pipelines from the command line: ``plan``/``check``/``run`` with ``--microbatches`` and
``--schedule``, the schedule table, per-stage bubble and peak figures, and ``run --report``.

The figures code is pinned on the unit-cost simulation, whose bubble is exactly
(p-1)/(m+p-1); the real runs pin what is deterministic (the keys, the peak number
of activations each schedule holds) and bound the rest.
"""
from __future__ import annotations

import json
import multiprocessing
from fractions import Fraction

import pytest
import torch

from conftest import sgd_dense_losses
from meshdsl.lowering.compiler import compile as compile_plan
from meshdsl.lowering.memory import memory_report
from meshdsl.lowering.pipeline_program import PipelineProgram
from meshdsl.lowering.schedule_gen import bubble_theory, make_schedule, peak_theory
from meshdsl.lowering.schedule import theory_cost
from meshdsl.lowering.timeline import simulate, theory_bubble
from meshdsl.tools import cli
from meshdsl.tools.pipe_report import bubble_at_costs, run_figures, schedule_summary, user_mesh_layout
from meshdsl.train.model import load_model
from meshdsl.train.step import training_outputs

PIPE = ["transformer", "--tiny", "--mesh", "stage:2", "--layout", "layer:stage"]  # tiny: 2 layers, batch 4


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def flat(text: str) -> str:
    """``text`` with every run of whitespace made one space: rich wraps long titles at the console width."""
    return " ".join(text.split())


def _rows(stats):
    """A simulated timeline in the form gather_timelines returns."""
    return [[(a.kind, a.microbatch, a.stage, a.peer, t0, t1) for a, t0, t1 in row] for row in stats.timeline]


# ----------------------------------------------------------------------------- figures

@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (3, 8), (4, 4)])
def test_run_figures_of_the_unit_cost_simulation_are_the_theory(schedule, p, m):
    program = PipelineProgram.of_schedule(make_schedule(schedule, p, m))
    stats = simulate(program.schedule)
    fig = run_figures(program, [_rows(stats)] * 3)
    # Unit costs in floats: exact up to the float conversion of a Fraction.
    assert fig["bubble_measured"] == pytest.approx([float(bubble_theory(p, m))] * p, rel=1e-12)
    assert fig["bubble_at_costs"] == pytest.approx([float(bubble_theory(p, m))] * p, rel=1e-12)
    assert fig["bubble_theory"] == pytest.approx(float(bubble_theory(p, m)), rel=1e-12)
    assert fig["peak_activations"] == fig["peak_theory"] == [peak_theory(schedule, p, m, r) for r in range(p)]
    assert fig["busy_ms"] == pytest.approx([2 * m * 1e3] * p)


@pytest.mark.parametrize("p,m", [(2, 8), (3, 4)])
def test_run_figures_of_zbh1_at_the_theory_costs(p, m):
    sched = make_schedule("zbh1", p, m)
    fig = run_figures(PipelineProgram.of_schedule(sched), [_rows(simulate(sched, theory_cost(sched)))] * 3)
    assert fig["bubble_measured"] == pytest.approx([(p - 1) / (3 * m + p - 1)] * p, rel=1e-12)
    assert fig["bubble_at_costs"] == pytest.approx(fig["bubble_measured"], rel=1e-12)
    assert fig["peak_activations"] == [min(p, m)] * p
    assert fig["bubble_theory"] == float(theory_bubble(sched)) == pytest.approx((p - 1) / (3 * m + p - 1))


def _gpipe_2x4_with_stage_1_slowed():
    """GPipe on 2 stages, 4 micro-batches: the unit-cost timeline, the same with every time on
    stage 1 doubled, and the schedule's program."""
    gpipe = _rows(simulate(make_schedule("gpipe", 2, 4)))
    slow = [[(k, mb, s, peer, t0 * (2 if s == 1 else 1), t1 * (2 if s == 1 else 1))
             for k, mb, s, peer, t0, t1 in row] for row in gpipe]
    return gpipe, slow, PipelineProgram.of_schedule(make_schedule("gpipe", 2, 4))


def test_run_figures_takes_the_median_step_and_the_largest_peak():
    # A step twice as slow on stage 1 only: its makespan grows, stage 0 idles more.
    gpipe, slow, program = _gpipe_2x4_with_stage_1_slowed()
    fig = run_figures(program, [gpipe, gpipe, slow])
    assert fig["bubble_measured"] == pytest.approx([0.2, 0.2])  # the median: the two unit-cost steps
    assert fig["peak_activations"] == [4, 4]


def test_bubble_at_costs_is_the_schedule_run_with_the_measured_stage_costs():
    # Stage 1's actions take twice as long (times scaled, so this is not a run the schedule
    # allows: stage 1's F0 starts before stage 0's F0 ends).  Replayed with F = B = 1 on
    # stage 0 and 2 on stage 1: stage 0 runs F0-F3 in 0-4, stage 1 F0-F3 in 1-9 and B0-B3 in
    # 9-17, stage 0 each B right after its gradient, B3 in 17-18; busy 8 and 16 of 18.
    _, slow, program = _gpipe_2x4_with_stage_1_slowed()
    assert bubble_at_costs(program, [slow]) == pytest.approx([10 / 18, 2 / 18])
    # Idle time the runtime adds (each stage-1 action waits 1 before it starts) shows in the
    # measured bubble, not in the one at the measured costs.
    late = [[(k, mb, s, peer, t0 + (mb + 1 if s == 1 else 0), t1 + (mb + 1 if s == 1 else 0))
             for k, mb, s, peer, t0, t1 in row] for row in slow]
    fig = run_figures(program, [late])
    assert fig["bubble_at_costs"] == pytest.approx([10 / 18, 2 / 18])
    assert fig["bubble_measured"][1] > 2 / 18


def test_user_mesh_and_layout_leave_out_the_micro_batch_axis():
    model = load_model("transformer", tiny=True)
    for mesh, layout in (("stage:2; data:2", "layer:stage; batch:data"), ("stage:2", "layer:stage")):
        plan = compile_plan(model.train_step(0.1), mesh, layout, microbatches=2)
        assert "_mb" in str(plan.mesh)
        m, lay = user_mesh_layout(plan)
        assert (str(m), str(lay)) == (mesh, layout)


def test_schedule_summary_of_a_plan():
    model = load_model("transformer", tiny=True)
    plan = compile_plan(model.train_step(0.1), "stage:2", "layer:stage", microbatches=4, schedule="1f1b")
    s = schedule_summary(plan)
    assert (s["axis"], s["stages"], s["microbatches"], s["schedule"]) == ("stage", 2, 4, "1f1b")
    assert s["bubble_theory"] == float(Fraction(1, 5)) and s["peak_theory"] == [2, 1]
    assert schedule_summary(compile_plan(model.train_step(0.1), "data:2", "batch:data")) is None


# ----------------------------------------------------------------------------- plan and check

def test_plan_prints_the_schedule_table_and_the_users_mesh(capsys):
    rc, out, err = run(capsys, "plan", *PIPE, "--microbatches", "4", "--schedule", "1f1b")
    assert rc == 0, err
    assert "plan mesh 'stage:2' layout 'layer:stage' 4 micro-batches" in flat(out)
    assert "_mb" not in out.split("┏")[0]  # the table's title
    assert "pipeline over 'stage': 2 stages, 4 micro-batches, schedule 1f1b" in flat(out)
    assert "1f1b: 2 ranks, 4 micro-batches" in out
    assert "rank 0 | F0 F1 .  B0 F2 B1 F3 B2 .  B3" in out
    assert "rank 1 | .  F0 B0 F1 B1 F2 B2 F3 B3 ." in out


def test_plan_of_zbh1_shows_its_ws_and_theory(capsys):
    rc, out, err = run(capsys, "plan", *PIPE, "--microbatches", "4", "--schedule", "zbh1")
    assert rc == 0, err
    assert ("pipeline over 'stage': 2 stages, 4 micro-batches, schedule zbh1; in theory: bubble 7.7%, "
            "activations held per stage [2, 2]") in flat(out)
    assert "rank 0 | F0 F1 .  B0 W0 F2 B1 W1 F3 B2 W2 B3 W3" in out
    assert "rank 1 | .  F0 B0 W0 F1 B1 W1 F2 B2 F3 B3 W2 W3" in out


@pytest.mark.parametrize("m", [1, 2, 4])
def test_plan_json_counts_per_micro_batch_segments_m_times(capsys, m):
    rc, out, _ = run(capsys, "plan", *PIPE, "--json", "--microbatches", str(m))
    assert rc == 0
    r = json.loads(out)
    assert (r["mesh"], r["layout"], r["microbatches"]) == ("stage:2", "layer:stage", m)
    assert r["pipeline"]["schedule"] == "gpipe" and r["pipeline"]["peak_theory"] == [m, m]
    # One carry goes forward and its gradient back per micro-batch.
    assert r["totals"]["send"]["count"] == 2 * m and r["totals"]["recv"]["count"] == 2 * m
    sends = [e for e in r["ops"] if any(c["kind"] == "send" for c in e["collectives"])]
    assert sends and all(e["times"] == m for e in sends)


def test_plan_without_pipeline_has_no_pipeline_key(capsys):
    rc, out, _ = run(capsys, "plan", "mlp", "--tiny", "--json", "--mesh", "data:2", "--layout", "batch:data")
    assert rc == 0
    r = json.loads(out)
    assert r["pipeline"] is None and r["microbatches"] == 1


@pytest.mark.parametrize("schedule,peak", [("gpipe", [2, 2]), ("1f1b", [2, 1])])
def test_check_pipelined_matches_dense_on_the_simulated_mesh(capsys, schedule, peak):
    rc, out, err = run(capsys, "check", "transformer", "--tiny", "--mesh", "stage:2; data:2",
                       "--layout", "layer:stage; batch:data", "--microbatches", "2", "--schedule", schedule)
    assert rc == 0, out + err
    assert (f"mesh 'stage:2; data:2', layout 'layer:stage; batch:data', 2 micro-batches, schedule {schedule}"
            in flat(out))
    assert "OK: " in out
    # The simulated mesh runs the stages one after another: its timings are the order's, said so.
    assert "pipeline on the simulated mesh" in flat(out) and "not of a parallel run" in flat(out)
    assert f"activations held {peak} (theory {peak})" in flat(out)


def test_check_pipelined_on_processes(capsys):
    rc, out, err = run(capsys, "check", *PIPE, "--microbatches", "2", "--schedule", "1f1b", "--nproc", "2")
    assert rc == 0, out + err
    assert "2 processes" in out and "2 micro-batches, schedule 1f1b" in flat(out) and "OK: " in out
    assert multiprocessing.active_children() == []


# ----------------------------------------------------------------------------- run

@pytest.mark.parametrize("schedule,peak", [("gpipe", [4, 4]), ("1f1b", [2, 1])])
def test_run_prints_per_stage_figures_and_writes_the_report(capsys, tmp_path, schedule, peak):
    path, png = tmp_path / "run.json", tmp_path / "timeline.png"
    rc, out, err = run(capsys, "run", *PIPE, "--microbatches", "4", "--schedule", schedule, "--steps", "3",
                       "--warmup", "1", "--report", str(path), "--timeline", str(png))
    assert rc == 0, out + err
    assert f"pipeline over 'stage': 2 stages, 4 micro-batches, {schedule}" in flat(out)
    # the measured step drawn: 4 F and 4 B bars per stage, and stage 1's 4 B's weight gradients
    # after their sends (tests/test_timeline_png.py pins the drawing)
    assert f"timeline: {png} (8 F, 8 B and 4 W bars" in out and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "bubble measured" in out and "20.0%" in out  # the theory column: (2-1)/(4+2-1)
    r = json.loads(path.read_text())
    assert (r["schedule"], r["stages"], r["microbatches"]) == (schedule, 2, 4)
    assert r["bubble_theory"] == float(bubble_theory(2, 4)) == 0.2
    # Each rank runs its own list of actions in order: the activations held at once follow
    # from the schedule alone (m for GPipe, p - stage for 1F1B), whatever the timings.
    assert r["peak_activations"] == r["peak_theory"] == peak
    # Whatever the timings, each stage waits for the other at least once (stage 1 for the
    # first F's activations, stage 0 for the first B's gradient) and computes for some time.
    assert len(r["bubble_measured"]) == 2 and all(0 < b < 1 for b in r["bubble_measured"])
    assert len(r["busy_ms"]) == 2 and all(b > 0 for b in r["busy_ms"])
    # Four micro-batches of one, the warmup step first: the dense program's full-batch curve
    # (fp32 sums of the micro-batches in another order: rounding only, as tests/test_run_report.py).
    model = load_model("transformer", tiny=True)
    torch.testing.assert_close(torch.tensor(r["loss"]), torch.tensor(sgd_dense_losses(model, 0.01, 1 + 3)[1:]),
                               rtol=1e-5, atol=0)
    # The plan's bytes per rank are those of the plan the ranks run (plain SGD: no optimizer
    # state, no gradient kept as an output): its params, gradients and activation peak.
    plan = compile_plan(training_outputs(model.loss, model.params, 0.01), "stage:2", "layer:stage", microbatches=4,
                        schedule=schedule)
    want = memory_report(plan)
    assert r["memory_plan"] == want and want["optimizer"] == 0
    assert len(r["step_ms"]) == 3
    # compute, exposed communication and overhead split the executor's time, within the step's
    for s, c, e, o in zip(r["step_ms"], r["compute_ms"], r["comm_ms"], r["overhead_ms"]):
        assert c > 0 and e >= 0 and o >= 0 and c + e + o <= s * (1 + 1e-9), (s, c, e, o)
    assert multiprocessing.active_children() == []


def test_run_report_without_pipeline_has_no_pipeline_keys(capsys, tmp_path):
    path = tmp_path / "run.json"
    rc, out, err = run(capsys, "run", "mlp", "--tiny", "--mesh", "data:2", "--layout", "batch:data",
                       "--steps", "2", "--warmup", "0", "--report", str(path))
    assert rc == 0, out + err
    r = json.loads(path.read_text())
    assert len(r["step_ms"]) == 2 and len(r["compute_ms"]) == 2
    assert not {"schedule", "bubble_measured", "peak_activations"} & set(r)
    assert "bubble" not in out


def test_gather_timelines_puts_every_rank_on_one_clock():
    from meshdsl.comm.simulated import SimulatedComm
    from meshdsl.layout.mesh import Mesh
    from meshdsl.lowering.schedule import Action
    from meshdsl.train.jobs import gather_timelines

    row = ((Action("F", 0, 1), 100.25, 100.5), (Action("send_act", 0, 1, 2), 100.5, 100.5))
    # One process's view: a communicator of one rank (agree returns its own token once).
    comm = SimulatedComm(Mesh.parse("stage:1"))
    got = gather_timelines(comm, [(row,), (row,)], origin=100.0)
    assert got == [[[("F", 0, 1, None, 0.25, 0.5), ("send_act", 0, 1, 2, 0.5, 0.5)]]] * 2
