"""Pipeline timelines as pictures: one row per stage rank, one bar per F or B action.

``meshdsl plan ... --timeline FILE.png`` draws the schedule run on model time with
F = B = 1 (the timeline the printed table shows); ``meshdsl run ... --timeline FILE.png``
draws one measured step, every rank's recorded actions on one clock
(:func:`meshdsl.train.jobs.gather_timelines`): the step whose makespan is the median.
F bars are blue, B bars orange and W bars (a B's weight gradients, run after its send) red,
each labelled with its micro-batch; sends and receives
are grey lines under the row (a receive spans the time it waited); white is idle.  Each row ends with its idle fraction of
the makespan, the bubble :func:`meshdsl.lowering.timeline.bubble_from_timeline` reports.
"""
from __future__ import annotations

import statistics

from ..errors import message
from ..lowering.schedule import BUSY, COMPUTE, Action
from ..lowering.timeline import bubble_from_timeline
from .preflight import UsageError, check_output_path

#: action kind -> bar colour
COLOURS = {"F": "tab:blue", "B": "tab:orange", "W": "tab:red"}


def simulated_rows(program) -> list[list[tuple]]:
    """A pipeline program's unit-cost run (its :attr:`~meshdsl.lowering.pipeline_program.PipelineProgram.picture`)
    as rows of ``(kind, microbatch, stage, peer, start, end)``."""
    return [[(a.kind, a.microbatch, a.stage, a.peer, float(t0), float(t1)) for a, t0, t1 in row]
            for row in program.picture.timeline]


def median_step(timelines: list) -> list:
    """Of several steps' rows (each a list of rank rows), the one whose makespan is the median."""
    def span(rows):
        ts = [t for row in rows for *_, t0, t1 in row for t in (t0, t1)]
        return max(ts) - min(ts) if ts else 0.0
    spans = [span(rows) for rows in timelines]
    mid = statistics.median_low(spans)
    return timelines[spans.index(mid)]


def draw(rows: list, path: str, title: str, unit: str = "ms", scale: float = 1e3) -> dict:
    """Draw ``rows`` (one list of ``(kind, microbatch, stage, peer, start, end)`` per rank) to ``path``.

    Args:
      title: the figure's title.
      unit: the time axis's unit; ``scale`` turns the rows' times into it (seconds to ms).

    Returns:
      ``{"bars": {"F": n, "B": n} (and "W": n where the rows have any), "ticks": n,
      "idle": [fraction per row], "span": makespan in unit}``.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    acts = [[(Action(k, mb, st, peer), t0, t1) for k, mb, st, peer, t0, t1 in row] for row in rows]
    stats = bubble_from_timeline(acts)
    # the clock starts at the first F, as the makespan does (an earlier wait is cut there)
    origin = min((t0 for row in rows for k, *_, t0, _ in row if k in COMPUTE),
                 default=min((t0 for row in rows for *_, t0, _ in row), default=0.0))
    fig, ax = plt.subplots(figsize=(10, 1.4 + 0.7 * len(rows)), dpi=100)
    bars = {k: 0 for k in COLOURS if k != "W" or any(r[0] == "W" for row in rows for r in row)}
    ticks = 0
    labels = []
    for y, row in enumerate(rows):
        for kind, mb, _, _, t0, t1 in row:
            t0 = max(t0, origin)
            x, w = (t0 - origin) * scale, max(t1 - t0, 0.0) * scale
            if kind in BUSY:
                ax.broken_barh([(x, w)], (y - 0.35, 0.7), facecolors=COLOURS[kind], edgecolor="white", lw=0.5)
                ax.text(x + w / 2, y, str(mb), ha="center", va="center", fontsize=7, color="white", clip_on=True)
                bars[kind] += 1
            else:
                ax.plot([x, x + w], [y + 0.42, y + 0.42], color="grey", lw=2, solid_capstyle="butt")
                ticks += 1
        labels.append(row[0][2] if row else y)
    if len(set(labels)) < len(labels):  # several ranks per stage (data or tensor parallel inside it)
        labels = [f"rank {y}, stage {st}" for y, st in enumerate(labels)]
    else:
        labels = [f"stage {st}" for st in labels]
    span = float(stats.makespan) * scale
    for y, r in enumerate(stats.ranks):
        ax.text(span * 1.01, y, f"idle {float(r.idle_fraction):.1%}", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), labels)
    ax.set_ylim(len(rows) - 0.5, -0.6)
    ax.set_xlim(0, span * 1.12 if span else 1)
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title, fontsize=9)
    names = {"F": "F (forward)", "B": "B (backward)", "W": "W (weight gradients, split off a B)"}
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[k]) for k in bars]
    ax.legend(handles + [plt.Line2D([0], [0], color="grey", lw=2)],
              [names[k] for k in bars] + ["send / recv (a receive spans its wait)"],
              loc="upper center", bbox_to_anchor=(0.5, -0.5 / len(rows) - 0.12), fontsize=7, ncol=len(bars) + 1,
              frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return {"bars": bars, "ticks": ticks, "idle": [float(r.idle_fraction) for r in stats.ranks], "span": span}


def bar_counts(bars: dict) -> str:
    """``draw``'s bar counts in words: ``"8 F, 8 B and 4 W bars"``."""
    parts = [f"{n} {k}" for k, n in bars.items()]
    return (", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else "".join(parts)) + " bars"


def draw_timeline(source, path: str, title: str = "") -> dict:
    """Draw a pipeline timeline to the PNG file ``path`` (the Python side of ``--timeline``).

    Args:
      source: a pipelined :class:`~meshdsl.lowering.plan.Plan` (its schedule, F = B = 1, in
        units of one F), an executor's ``last_timeline`` (per stage, ``(action, start, end)``
        in seconds, drawn in ms), or one step of :func:`meshdsl.train.jobs.gather_timelines`.
      title: the figure's title.

    Returns:
      What was drawn: see :func:`draw`.

    Raises:
      GraphError: a plan without a pipeline, or no recorded actions (nothing ran yet).
    """
    from ..errors import GraphError
    from ..lowering.plan import Plan

    if isinstance(source, Plan):
        step = next((s for s in source.steps if s.kind == "pipeline"), None)
        if step is None:
            raise GraphError(message("draw_timeline: the plan has no pipeline.",
                                     rule="a timeline shows a pipeline's F and B actions per stage; "
                                          "'layer:<axis>' in the layout makes one",
                                     fix="compile with a pipelined layout, e.g. mesh 'stage:2', layout 'layer:stage'"))
        return draw(simulated_rows(step.args["program"]), path, title, unit="F times", scale=1.0)
    rows = [[(a.kind, a.microbatch, a.stage, a.peer, *rest) if isinstance(a, Action) else (a, *rest)
             for a, *rest in row] for row in (source or ())]
    if not any(rows):
        raise GraphError(message("draw_timeline: no pipeline actions were recorded.",
                                 rule="an executor records its pipeline's actions when it runs a pipelined plan",
                                 fix="run a step first (Executor.run or TrainStep), then pass executor.last_timeline"))
    return draw(rows, path, title)


# ----------------------------------------------------------------------------- command line

def timeline_arg(p) -> None:
    """``--timeline FILE.png``: draw the pipeline's timeline (plan: simulated; run: measured)."""
    p.add_argument("--timeline", metavar="FILE.png", default=None,
                   help="draw the pipeline's timeline to FILE.png: one row per stage, F and B bars per "
                        "micro-batch, idle in white (plan: the schedule with F = B = 1, and W = 1 where it places Ws; run: the measured "
                        "step of median length)")


def check_timeline(args, summary) -> None:
    """Refuse ``--timeline`` before any work: an unwritable file, or a plan with no pipeline."""
    if args.timeline is None:
        return
    check_output_path("--timeline", args.timeline, "a PNG file", "timeline.png")
    if summary is None:
        raise UsageError(message(
            f"--timeline {args.timeline}: layout '{args.layout}' on mesh '{args.mesh}' has no pipeline.",
            rule="a timeline shows a pipeline's F and B actions per stage; 'layer:<axis>' in --layout makes one",
            fix="pipeline the layers, e.g. --mesh \"stage:2\" --layout \"layer:stage\" --microbatches 4, "
                "or drop --timeline"))
