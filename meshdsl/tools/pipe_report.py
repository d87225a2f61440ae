"""Pipeline figures for the command line: the schedule of a plan, and measured bubbles per stage.

``meshdsl plan`` shows a pipelined plan's schedule as a per-stage table
(:func:`schedule_text`); ``meshdsl run`` turns the actions every rank recorded
(:func:`meshdsl.train.jobs.gather_timelines`) into, per stage, the busy time,
the measured idle (bubble) fraction and the peak number of micro-batch
activations held at once, next to theory (:func:`run_figures`).  Measured and
simulated figures both come from
:func:`meshdsl.lowering.timeline.bubble_from_timeline`.
"""
from __future__ import annotations

import statistics
from typing import Any

from ..lowering.pipeline_program import PipelineProgram
from ..lowering.plan import Plan, Step
from ..lowering.schedule import BUSY, Action
from ..lowering.schedule_gen import user_name
from ..lowering.timeline import bubble_from_timeline, format_table
from ..lowering.users_terms import num_microbatches, user_mesh_layout


def pipeline_step(plan: Plan) -> Step | None:
    """The plan's ``pipeline`` step, or None for a plan without a pipeline."""
    return next((s for s in plan.steps if s.kind == "pipeline"), None)


def pipeline_program(plan: Plan) -> PipelineProgram | None:
    """The program of the plan's pipeline (None without one): what the tables and figures read."""
    step = pipeline_step(plan)
    return None if step is None else step.args["program"]


def schedule_summary(plan: Plan) -> dict[str, Any] | None:
    """The pipeline of ``plan`` as plain data, or None: axis, stages, micro-batches, schedule, theory.

    Returns:
      ``{"axis", "stages", "virtual_stages", "microbatches", "schedule", "bubble_theory",
      "peak_theory", "table"}``: ``stages`` counts the ranks of the stage axis and
      ``virtual_stages`` the stages each runs; ``peak_theory`` lists, per rank, the stage
      activations held at once in theory and ``table`` is the unit-cost schedule table
      (:func:`~.timeline.format_table`).
    """
    prog = pipeline_program(plan)
    if prog is None:
        return None
    sched = prog.schedule
    return {"axis": prog.axis, "stages": prog.num_ranks, "virtual_stages": sched.num_chunks,
            "microbatches": prog.microbatches, "schedule": user_name(sched),
            "bubble_theory": float(prog.theory_bubble), "peak_theory": list(prog.peak_theory),
            "table": format_table(sched, stats=prog.picture)}


def _figures_of_step(rows: list, num_stages: int, program) -> tuple[list[float], list[float], list[int]]:
    """Per rank of the stage axis: busy seconds and idle fraction (mean over its ranks of the
    mesh), peak activations (max)."""
    actions = [[(Action(kind, mb, stage, peer), t0, t1) for kind, mb, stage, peer, t0, t1 in row] for row in rows]
    stats = bubble_from_timeline(actions)
    busy: list[list[float]] = [[] for _ in range(num_stages)]
    idle: list[list[float]] = [[] for _ in range(num_stages)]
    peak = [0] * num_stages
    for row, r in zip(rows, stats.ranks):
        stage = program.rank_of(row[0][2])
        busy[stage].append(float(r.busy))
        idle[stage].append(float(r.idle_fraction))
        peak[stage] = max(peak[stage], r.peak_activations)
    return ([statistics.fmean(b) for b in busy], [statistics.fmean(i) for i in idle], peak)


def bubble_at_costs(program: PipelineProgram, timelines: list) -> list[float]:
    """Per rank, the bubble the schedule itself leaves at the measured action costs.

    Each stage's F, B (and W, where the runtime split a B's weight gradients off after
    its send: the program's :attr:`~meshdsl.lowering.pipeline_program.PipelineProgram.split`)
    take their mean measured time (over every step and rank of the stage) and transfers take
    none; the program's schedule, split the same way, is then simulated.  Against the measured
    bubble this separates idle time the schedule causes with these stages (uneven stages give
    more than (p-1)/(m+p-1)) from what the runtime adds (transfer latency, descheduling).
    """
    spent: dict = {}
    for rows in timelines:
        for row in rows:
            for kind, _, stage, _, t0, t1 in row:
                if kind in BUSY:
                    spent.setdefault((kind, stage), []).append(t1 - t0)
    mean = {k: statistics.fmean(v) for k, v in spent.items()}
    split = any(kind == "W" for kind, _ in spent)
    stats = program.simulate(lambda a: mean.get((a.kind, a.stage), 0.0), defer=split)
    return [float(r.idle_fraction) for r in stats.ranks]


def run_figures(program: PipelineProgram, timelines: list) -> dict[str, Any]:
    """Per-rank figures of a pipelined run from every rank's recorded actions.

    The makespan of a step runs from its first F's start to its last action's end
    over all ranks (the prologue and the final segment, run once per step, are
    outside it; so is a receive's wait before the first F, the previous step's flush:
    see :func:`~meshdsl.lowering.timeline.bubble_from_timeline`); a stage's bubble is the fraction of that makespan it spends outside
    its F, B and W actions: waiting in a receive, sending, or descheduled counts as
    idle, as in (p-1)/(m+p-1).  Figures are medians over the timed steps (peaks: the
    max); ``bubble_at_costs`` is :func:`bubble_at_costs`.

    Args:
      program: the plan's pipeline program (:func:`pipeline_program`).
      timelines: per step, every rank's rows (:func:`meshdsl.train.jobs.gather_timelines`).

    Returns:
      ``{"schedule", "stages", "microbatches", "bubble_measured", "bubble_theory",
      "bubble_at_costs", "peak_activations", "peak_theory", "busy_ms"}``, lists with one
      entry per rank of the stage axis (``stages`` of them).
    """
    p = program.num_ranks
    per_step = [_figures_of_step(rows, p, program) for rows in timelines]
    return {
        "schedule": user_name(program.schedule), "stages": p, "microbatches": program.microbatches,
        "bubble_measured": [statistics.median(s[1][k] for s in per_step) for k in range(p)],
        "bubble_theory": float(program.theory_bubble),
        "bubble_at_costs": bubble_at_costs(program, timelines),
        "peak_activations": [max(s[2][k] for s in per_step) for k in range(p)],
        "peak_theory": list(program.peak_theory),
        "busy_ms": [statistics.median(s[0][k] for s in per_step) * 1e3 for k in range(p)],
    }


def figures_table(fig: dict[str, Any], title: str):
    """The per-stage rich table of :func:`run_figures`."""
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for col in ("stage", "busy ms", "bubble measured", "bubble theory", "peak activations", "theory"):
        t.add_column(col, justify="right")
    for k in range(fig["stages"]):
        t.add_row(str(k), f"{fig['busy_ms'][k]:.2f}", f"{fig['bubble_measured'][k]:.1%}",
                  f"{fig['bubble_theory']:.1%}", str(fig["peak_activations"][k]),
                  str(fig["peak_theory"][k]))
    return t


__all__ = ["pipeline_step", "pipeline_program", "user_mesh_layout", "num_microbatches", "schedule_summary",
           "bubble_at_costs", "run_figures", "figures_table"]
