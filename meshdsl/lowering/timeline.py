"""Pipeline timelines: simulate a schedule on model time, or measure a recorded one.

:func:`simulate` runs a :class:`~.schedule.Schedule` with per-action costs;
the runtime records wall-clock ``(action, start, end)`` intervals.  Both go
through :func:`bubble_from_timeline`, so simulated and measured bubbles,
busy times and peak activations are computed by the same code.  Like the
schedule module, this knows nothing about torch: the layout search prices a
pipeline from it.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Sequence

from .schedule import (BUSY, COMPUTE, Action, Number, Schedule, _match, _walk, has_placed_w, theory_cost, unit_cost,
                       validate)

def costs(forward: Number = 1, backward: Number = 1, transfer: Number = 0, w: Number = 0) -> Callable[[Action], Number]:
    """A cost function with the given F, B, per-transfer and W (split-off weight gradient)
    times, e.g. ``costs(1, 2)``."""
    return lambda a: {"F": forward, "B": backward, "W": w}.get(a.kind, transfer)


@dataclass(frozen=True)
class RankStats:
    """One rank's figures: compute time, idle fraction of the makespan, peak activations held."""

    busy: Number
    idle_fraction: Number
    peak_activations: int


@dataclass(frozen=True)
class PipelineStats:
    """Figures of one run, simulated or measured: the makespan (first start to last end, over all
    ranks), per-rank figures, and per rank the ``(action, start, end)`` intervals."""

    makespan: Number
    ranks: tuple[RankStats, ...]
    timeline: tuple[tuple[tuple[Action, Number, Number], ...], ...]


def _ratio(a: Number, b: Number) -> Number:
    """a / b, exact when both are rational."""
    if b == 0:
        return 0
    return Fraction(a) / Fraction(b) if isinstance(a, (int, Fraction)) and isinstance(b, (int, Fraction)) else a / b


def bubble_from_timeline(timeline: Sequence[Sequence[tuple[Action, Number, Number]]]) -> PipelineStats:
    """Busy time, idle fraction and peak activations per rank from recorded ``(action, start, end)``.

    The runtime records wall-clock intervals and :func:`simulate` simulated ones;
    both go through here, so measured and simulated figures mean the same.  An
    activation is held from the start of its F to the end of its B, or of its W
    where one is recorded (the weight gradients read the layer inputs).

    The makespan runs from the first F or B to the last action's end, as in
    (p-1)/(m+p-1), where the first stage's first F starts the clock.  In a training
    loop a later stage finishes a step before the first one (which still runs the
    last backward) and posts its first receive early: that wait is the previous
    step's flush, already inside that step's makespan, so it is not counted twice.

    Example:
        >>> f, b = Action("F", 0, 0), Action("B", 0, 0)
        >>> bubble_from_timeline([[(f, 10, 11), (b, 12, 14)]]).ranks[0]
        RankStats(busy=3, idle_fraction=Fraction(1, 4), peak_activations=1)
    """
    spans = [(t0, t1) for row in timeline for _, t0, t1 in row]
    starts = [t0 for row in timeline for a, t0, _ in row if a.kind in COMPUTE] or [t0 for t0, _ in spans]
    t_first = min(starts, default=0)
    makespan = max((t1 for _, t1 in spans), default=0) - t_first
    ranks = []
    for row in timeline:
        busy: Number = 0
        held: set[tuple[int, int]] = set()
        peak = 0
        has_w = {(a.stage, a.microbatch) for a, _, _ in row if a.kind == "W"}
        for a, t0, t1 in sorted(row, key=lambda e: (e[1], e[2])):
            if a.kind in BUSY:
                busy += t1 - t0
            key = (a.stage, a.microbatch)
            if a.kind == "F":
                held.add(key)
                peak = max(peak, len(held))
            elif a.kind == ("W" if key in has_w else "B"):
                held.discard(key)
        ranks.append(RankStats(busy, _ratio(makespan - busy, makespan), peak))
    return PipelineStats(makespan, tuple(ranks), tuple(tuple(row) for row in timeline))


def simulate(s: Schedule, cost: Callable[[Action], Number] = unit_cost, latency: Number = 0) -> PipelineStats:
    """Validate ``s``, then run it on simulated time.

    Each rank runs its list in order; a receive ends no earlier than its send's
    end plus ``latency``.  With integer or Fraction costs every figure is exact.

    Example:
        >>> from meshdsl.lowering.schedule_gen import make_schedule
        >>> simulate(make_schedule("gpipe", 4, 4)).ranks[3].idle_fraction
        Fraction(3, 7)
    """
    validate(s)
    where = {a: (r, i) for r, row in enumerate(s.actions) for i, a in enumerate(row)}
    return bubble_from_timeline(_walk(s, _match(s, where), cost, latency)[0])


def picture_cost(s: Schedule) -> Callable[[Action], Number]:
    """The unit costs a schedule is shown with: F = B = 1, and W = 1 where the schedule places
    its Ws (free otherwise: the runtime's split of a B is not the schedule's)."""
    return theory_cost(s) if has_placed_w(s) else unit_cost


def theory_bubble(s: Schedule) -> Fraction:
    """The largest idle fraction over ranks of ``s`` at the theory's costs
    (:func:`~.schedule.theory_cost`: F = 1, a backward 2, split B = W = 1 where the schedule
    places its Ws): (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(vm+p-1) for interleaved, less for ZB-H1.

    Example:
        >>> from meshdsl.lowering.schedule_gen import make_schedule
        >>> theory_bubble(make_schedule("1f1b", 2, 8)), theory_bubble(make_schedule("zbh1", 2, 8))
        (Fraction(1, 9), Fraction(1, 25))
    """
    return max(Fraction(r.idle_fraction) for r in simulate(s, theory_cost(s)).ranks)


# ----------------------------------------------------------------------------- printing

def format_table(s: Schedule, transfers: bool = False, stats: PipelineStats | None = None) -> str:
    """A per-rank table.

    By default one column per time step of the unit-cost simulation, so the
    bubble shows as ``.`` (F = B = 1; a schedule that places its Ws: F = B = W = 1); with
    ``transfers=True`` the full action lists, in order.  ``stats``: that simulation, when the
    caller has it (a pipeline program's :attr:`~.pipeline_program.PipelineProgram.picture`).

    Example:
        >>> from meshdsl.lowering.schedule_gen import make_schedule
        >>> print(format_table(make_schedule("1f1b", 2, 3)))
        1f1b: 2 ranks, 3 micro-batches; one column per time step with F = B = 1; '.' is idle; bubble 1/4
        rank 0 | F0 F1 .  B0 F2 B1 .  B2
        rank 1 | .  F0 B0 F1 B1 F2 B2 .
    """
    short = lambda a: a.label(with_stage=s.num_chunks > 1)  # noqa: E731
    if transfers:
        rows = [[short(a) for a in row] for row in s.actions]
        head = "actions in run order (sF3>1: send micro-batch 3's activations to stage 1; rB3<2: receive its gradient)"
    else:
        w = has_placed_w(s)
        stats = stats if stats is not None else simulate(s, picture_cost(s))
        rows = [["."] * int(stats.makespan) for _ in s.actions]
        for r, row in enumerate(stats.timeline):
            for a, t0, _ in row:
                if a.kind in (BUSY if w else COMPUTE):
                    rows[r][int(t0)] = short(a)
        bubble = max(r.idle_fraction for r in stats.ranks)
        head = f"one column per time step with F = B{' = W' if w else ''} = 1; '.' is idle; bubble {bubble}"
    width = max((len(c) for row in rows for c in row), default=1)
    lines = [f"{s.name}: {s.num_ranks} ranks, {s.num_microbatches} micro-batches"
             + (f", {s.num_chunks} stages per rank" if s.num_chunks > 1 else "") + f"; {head}"]
    lines += [f"rank {r} | " + " ".join(c.ljust(width) for c in row).rstrip() for r, row in enumerate(rows)]
    return "\n".join(lines)
