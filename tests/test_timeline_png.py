"""Pipeline timelines as pictures (tools/timeline_png.py): ``plan``/``run --timeline FILE.png``.

What is drawn is checked through what :func:`draw` returns (bars per kind, transfer lines,
idle fraction per row, span), against the unit-cost simulation whose figures are exact;
the file itself is checked to be a PNG.  Bad ``--timeline`` values exit 2 before any work.
"""
from __future__ import annotations

import pytest

from meshdsl.lowering.pipeline_program import PipelineProgram
from meshdsl.lowering.schedule_gen import bubble_theory, make_schedule
from meshdsl.tools import cli
from meshdsl.tools.timeline_png import draw, median_step, simulated_rows

PNG = b"\x89PNG\r\n\x1a\n"
PIPE = ["transformer", "--tiny", "--mesh", "stage:2", "--layout", "layer:stage"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 4), (3, 2)])
def test_the_unit_cost_schedule_is_drawn_bar_for_bar(tmp_path, schedule, p, m):
    path = tmp_path / "t.png"
    got = draw(simulated_rows(PipelineProgram.of_schedule(make_schedule(schedule, p, m))), str(path), "t", unit="F times", scale=1.0)
    assert path.read_bytes()[:8] == PNG
    assert got["bars"] == {"F": p * m, "B": p * m}
    assert got["span"] == 2 * (m + p - 1)
    assert got["idle"] == pytest.approx([float(bubble_theory(p, m))] * p)
    assert got["ticks"] == 2 * (p - 1) * m * 2   # a send and a receive per hop, activations and gradients


def test_the_step_of_median_length_is_drawn():
    def step(span):
        return [[("F", 0, 0, None, 0.0, span / 2), ("B", 0, 0, None, span / 2, span)]]
    assert median_step([step(3.0), step(1.0), step(2.0)]) == step(2.0)
    assert median_step([step(4.0), step(1.0)]) == step(1.0)   # an even count: the lower middle one


def test_several_ranks_per_stage_are_labelled_by_rank(tmp_path):
    rows = [[("F", 0, 0, None, 0.0, 1.0)], [("F", 0, 0, None, 0.0, 1.0)], [("F", 0, 1, None, 1.0, 2.0)]]
    got = draw(rows, str(tmp_path / "t.png"), "t")
    assert got["bars"] == {"F": 3, "B": 0} and got["idle"] == pytest.approx([0.5, 0.5, 0.5])


def test_plan_draws_the_schedule(capsys, tmp_path):
    path = tmp_path / "plan.png"
    rc = cli.main(["plan", *PIPE, "--microbatches", "4", "--schedule", "1f1b", "--totals", "--timeline", str(path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert f"timeline: {path} (8 F and 8 B bars, span 10 F times)" in out
    assert path.read_bytes()[:8] == PNG


@pytest.mark.parametrize("command", ["plan", "run"])
def test_a_layout_without_a_pipeline_is_refused(capsys, tmp_path, command):
    path = tmp_path / "t.png"
    rc = cli.main([command, "mlp", "--tiny", "--mesh", "data:2", "--layout", "batch:data", "--timeline", str(path)])
    err = capsys.readouterr().err
    assert rc == 2 and not path.exists()
    assert "has no pipeline" in err and "Rule:" in err and "Fix:" in err and "Traceback" not in err


def test_an_unwritable_timeline_is_refused_before_any_work(capsys, tmp_path):
    rc = cli.main(["plan", *PIPE, "--timeline", str(tmp_path / "missing" / "t.png")])
    err = capsys.readouterr().err
    assert rc == 2 and "is in a folder that does not exist" in err and "--timeline timeline.png" in err


def test_draw_timeline_from_python(tmp_path):
    """``md.draw_timeline``: a plan's schedule, or an executor's recorded actions after a step."""
    import meshdsl as md
    from meshdsl.comm.simulated import SimulatedComm
    from meshdsl.train.step import TrainStep
    from models.transformer import Config, build

    model = build(Config.tiny())
    step = TrainStep(model.loss, model.params, "stage:2", "layer:stage", SimulatedComm(md.Mesh.parse("stage:2")),
                     microbatches=2, schedule="1f1b")
    got = md.draw_timeline(step.plan, str(tmp_path / "plan.png"))
    assert got["bars"] == {"F": 4, "B": 4} and got["span"] == 6
    with pytest.raises(md.GraphError, match="no pipeline actions were recorded"):
        md.draw_timeline(step.executor.last_timeline, str(tmp_path / "run.png"))
    step(model.feeds(0))
    got = md.draw_timeline(step.executor.last_timeline, str(tmp_path / "run.png"), "one step")
    # stage 1's two B's send their gradients, then run their weight gradients (W)
    assert got["bars"] == {"F": 4, "B": 4, "W": 2} and (tmp_path / "run.png").read_bytes()[:8] == PNG
    dense = md.compile(model.loss, "data:2", "batch:data")
    with pytest.raises(md.GraphError, match="the plan has no pipeline"):
        md.draw_timeline(dense, str(tmp_path / "none.png"))
