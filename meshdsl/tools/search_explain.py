"""``meshdsl search --explain``: why the winner wins, and why each dim was or was not split.

The winner's and the runner-up's predicted step times are printed as terms that add up
to them (:meth:`~meshdsl.search.predict.Prediction.terms`: compute on the critical path,
exposed communication, the pipeline bubble, stages waiting for a core).  Then, per axis
role, the search's verdict on every dim (:class:`~meshdsl.search.dims.Verdict`: kept as a
seed or by its estimated cost, pruned by cost with its figure, not divisible, in conflict)
and, for a kept one, where it ended: in the winner, the best candidate that splits it, or
why none was ranked.  On the pipe axis, each schedule priced (gpipe, 1f1b, zbh1,
interleaved:2, interleaved-zb:2) with its best candidate: its step, its bubble (the schedule
simulated at the stages' predicted costs) and its peak activations per rank (from the plan).
"""
from __future__ import annotations

from ..search.predict import Prediction, by_op_table
from ..search.search import SearchResult
from ..search.space import ROLES, Candidate


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _bytes(n: float) -> str:
    return _mb(n) if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def terms_text(p: Prediction) -> str:
    """``"a ms compute + b ms exposed communication + ..."``: the terms of ``p.step_s``, which
    they add up to (a pipeline's core wait only where there is one)."""
    parts = [(name, s) for name, s in p.terms() if s > 0 or name != "stages waiting for a core"]
    return " + ".join(f"{s * 1e3:.2f} ms {name}" for name, s in parts)


def _detail(p: Prediction) -> str:
    """What the terms leave out: all communication (some hidden), and a pipeline's kernels on every stage."""
    piped = p.compute_s > p.path_compute_s + 1e-12   # kernels off the critical path: other stages'
    stages = f"; the kernels of all stages sum to {p.compute_s * 1e3:.2f} ms" if piped else ""
    return f"communication {p.comm_s * 1e3:.2f} ms in all, {_mb(p.comm_bytes)} sent per step{stages}"


def explain(result: SearchResult) -> list[str]:
    """The ``--explain`` lines of ``result`` (which has at least one ranked candidate)."""
    ranked = result.ranked
    win = ranked[0]
    w = win.prediction
    lines = [f"winner {win.candidate.family} on '{win.candidate.mesh}': {w.step_s * 1e3:.2f} ms = "
             f"{terms_text(w)}; {_detail(w)}"]
    top = by_op_table(w, 3)
    lines.append("  its costliest ops: " + ", ".join(f"{l} [{k}] ({(c + m) * 1e3:.2f} ms)" for l, k, c, m in top))
    if len(ranked) > 1:
        run = ranked[1]
        r = run.prediction
        worst = max(((name, b - a) for (name, a), (_, b) in zip(w.terms(), r.terms())), key=lambda d: d[1])
        lines.append(f"runner-up {run.candidate.family} on '{run.candidate.mesh}' ('{run.candidate.layout}'): "
                     f"{r.step_s * 1e3:.2f} ms = {terms_text(r)}; it pays most for {worst[0]} "
                     f"(+{worst[1] * 1e3:.2f} ms) and sends {_mb(r.comm_bytes)} per step")
    if result.splits is not None:
        lines += dim_lines(result)
    return lines


def _axes(c: Candidate) -> dict[str, int]:
    return {role: int(size) for role, size in (a.split(":") for a in c.mesh.split("; "))}


def _on(layout: str, axis: str) -> frozenset:
    return frozenset(r for r in filter(None, layout.split("; ")) if r.endswith(f":{axis}"))


def dim_lines(result: SearchResult) -> list[str]:
    """Per role (on the axis size of the best candidate that has the role), each dim's verdict."""
    lines = ["dims (estimates: the dim alone over the axis, kernels plus collectives):"]
    for role in ROLES:
        at = next(((i, r) for i, r in enumerate(result.ranked) if _axes(r.candidate).get(role, 1) > 1), None)
        if at is None:
            continue
        i, best = at
        size = _axes(best.candidate)[role]
        lines.append(f"  {role} axis of {size} (as in #{i + 1} '{best.candidate.mesh}'):")
        for v in result.splits.verdicts(role, size):
            where = _where(result, role, size, _on(v.rules, role)) if v.kept else ""
            lines.append(f"    {v.split:<18} {v.why}{where}")
        if role == "pipe":
            lines += schedule_lines(result)
    return lines


def schedule_lines(result: SearchResult) -> list[str]:
    """Each pipeline schedule the search ranked, with its best candidate: step, bubble, peak activations."""
    best: dict[str, tuple[int, object]] = {}
    for i, r in enumerate(result.ranked):
        if r.candidate.staged:
            best.setdefault(r.candidate.schedule, (i, r))
    if not best:
        return []
    lines = ["    schedules (the best candidate of each: step, bubble simulated at its stages' costs, peak "
             "activations per rank):"]
    for name, (i, r) in sorted(best.items(), key=lambda kv: kv[1][0]):
        p, c = r.prediction, r.candidate
        lines.append(f"      {name:<18} #{i + 1} '{c.mesh}' '{c.layout}' m={c.microbatches}: {p.step_s * 1e3:.2f} ms, "
                     f"bubble {p.bubble_s * 1e3:.2f} ms, activations {_bytes(p.memory['activations_peak'])}")
    return lines


def _where(result: SearchResult, role: str, size: int, rules: frozenset) -> str:
    """Where a kept option ended: the best ranked candidate with exactly these rules on the axis."""
    def has(c: Candidate) -> bool:
        return _axes(c).get(role) == size and _on(c.layout, role) == rules

    win = result.ranked[0]
    for i, r in enumerate(result.ranked):
        if has(r.candidate):
            if i == 0:
                return "; in the winner"
            return (f"; best with it: #{i + 1} '{r.candidate.mesh}' '{r.candidate.layout}' "
                    f"{r.prediction.step_s * 1e3:.2f} ms (+{(r.prediction.step_s - win.prediction.step_s) * 1e3:.2f})")
    bad = next((why for c, why in result.invalid if has(c)), None)
    if bad is not None:
        return f"; its candidates are invalid ({bad})"
    if any(has(r.candidate) for r in result.infeasible):
        return "; its candidates are over the memory limit"
    if result.strategy == "beam":
        return "; not priced (the beam kept other meshes)"
    return "; no candidate with it was priced"
