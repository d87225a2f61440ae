"""Plan reports: one row per graph node with its local shapes, FLOPs and collectives.

:func:`plan_report` turns a :class:`~meshdsl.lowering.plan.Plan` into plain
JSON-able data; :func:`print_report` renders that data as rich tables.  The
steps of a step's sub-plans (a ``repeat``'s block) are listed after it, labelled
``<step label>/<op label>`` and counted ``times`` over (the layer count) in every total; a
backward block's steps that recompute its forward (activation checkpointing) have phase
``recompute``.
"""
from __future__ import annotations

from typing import Any

from ..lowering.plan import Plan, Step

LEAVES = ("param", "input")
# Rows the table leaves out (JSON keeps them): scalar constants, and a repeat's
# per-layer inputs, which repeat the stacked params' rows minus the layer dim.
QUIET = ("constant", "placeholder")


def _local_shape(plan: Plan, vid: int) -> dict[str, int]:
    v = plan.values[vid]
    return dict(zip(v.shape.names, v.local_shape(plan.mesh)))


def _group(plan: Plan, held: int) -> list[tuple[int, list[Step]]]:
    """Steps grouped by graph node and how often they run per run of ``plan`` (a process
    holding ``held`` micro-batches, :meth:`~meshdsl.lowering.plan.Plan.walk`), in order of
    first appearance."""
    groups: dict[tuple[int, str, int], list[Step]] = {}
    for s in plan.steps:
        groups.setdefault((s.node, s.label, plan.held_runs(s, held)), []).append(s)
    return [(runs, steps) for (_, _, runs), steps in groups.items()]


def _entries(plan: Plan, prefix: str, times: int, held: int) -> list[dict[str, Any]]:
    out = []
    for runs, steps in _group(plan, held):
        first = next((s for s in steps if not s.is_collective), steps[0])
        shaped = [(vid, s) for s in steps if not s.is_collective for vid in s.outs]
        entry = {
            "op": first.op,
            "label": prefix + first.label,
            "phase": first.phase,
            "times": times * runs,
            "local_shapes": [_local_shape(plan, vid) for vid, _ in shaped],
            "shardings": [str(plan.values[vid].sharding) for vid, _ in shaped],
            "flops": sum(s.flops for s in steps),
            "collectives": [{"kind": s.kind, "axes": list(s.axes), "bytes": s.bytes}
                            for s in steps if s.is_collective],
            "notes": [s.note for s in steps if s.note],
        }
        out.append(entry)
        for s in steps:
            for k, sub in enumerate(s.subplans):
                entry["notes"].append(f"runs the {len(sub.steps)} steps below x{s.runs(k)}")
                out.extend(_entries(sub, f"{prefix}{first.label}/", times * runs * s.runs(k), s.held(k, held)))
    return out


def plan_report(plan: Plan) -> dict[str, Any]:
    """Everything ``meshdsl plan`` prints, as plain data.

    Returns:
      ``{"mesh", "layout", "ops", "totals", "totals_by_axis", "flops", "notes"}``.
      ``ops`` has one entry per graph node: ``op``, ``label``, ``phase``, ``times``
      (how often it runs per step), ``local_shapes`` (dim -> local size of each
      output), ``shardings``, ``flops`` (per run, one rank), ``collectives``
      (``{kind, axes, bytes}`` per run, bytes sent by one rank) and ``notes``.
      ``totals`` maps each collective kind to ``{count, bytes}`` per training
      step, repeats and micro-batches included.  With micro-batches (or a pipeline),
      ``mesh`` and ``layout`` are the user's (without the virtual micro-batch axis),
      ``microbatches`` is m and ``pipeline`` the schedule (see
      :func:`~.pipe_report.schedule_summary`); local shapes are one micro-batch's.
      ``recompute_flops``: the part of ``flops`` that a repeat's backward spends recomputing
      its forward (steps of phase ``recompute``; activation checkpointing, ``--remat``).
    """
    from .pipe_report import num_microbatches, schedule_summary, user_mesh_layout

    mesh, layout = user_mesh_layout(plan)
    return {
        "mesh": str(mesh),
        "layout": str(layout),
        "microbatches": num_microbatches(plan),
        "pipeline": schedule_summary(plan),
        "ops": _entries(plan, "", 1, plan.held_microbatches),
        "totals": {k: dict(v) for k, v in sorted(plan.totals().items())},
        "totals_by_axis": [{"kind": k, "axes": list(axes), **v}
                           for (k, axes), v in sorted(plan.totals_by_axis().items())],
        "flops": plan.flops(),
        # what the backward blocks run again of their forward (remat, and what params alone make)
        "recompute_flops": sum(s.flops * mult for s, mult in plan.walk() if s.phase == "recompute"),
        "notes": list(plan.notes),
    }


# ----------------------------------------------------------------------------- rendering

def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def human_count(n: float) -> str:
    for unit in ("", "K", "M", "G", "T"):
        if n < 1000 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "" else f"{n:.1f}{unit}"
        n /= 1000
    raise AssertionError


def axes_text(axes) -> str:
    """Mesh axes as printed: the virtual micro-batch axis (a local sum on each rank) named in words."""
    from ..lowering.pipeline import MB_AXIS

    real = [a for a in axes if a != MB_AXIS]
    if len(real) == len(axes):
        return ",".join(axes)
    return ",".join(real) + " + micro-batches" if real else "micro-batches"


def _shape_text(shape: dict[str, int], sharding: str) -> str:
    dims = " ".join(f"{k}:{v}" for k, v in shape.items()) or "scalar"
    return f"{dims} {sharding}" if sharding != "{}" else dims


def print_report(report: dict[str, Any], console=None, only_comm: bool = False,
                 totals_only: bool = False) -> None:
    """Render a :func:`plan_report` as a per-op table, then the totals table."""
    from rich.console import Console

    console = console or Console()
    if not totals_only:
        console.print(ops_table(report, only_comm))
    console.print(totals_table(report))
    rec = report.get("recompute_flops", 0)
    console.print(f"FLOPs per rank per step: {human_count(report['flops'])}" + (
        f" (recompute {human_count(rec)}, {rec / report['flops']:.0%})" if rec and report["flops"] else ""))
    if "optimizer" in report:
        console.print(f"optimizer: {report['optimizer']}")
    mem = report.get("memory")
    if mem:
        console.print("memory per rank: " + ", ".join(
            f"{label} {human_bytes(mem[k])}" for k, label in
            (("params", "params"), ("grads", "grads"), ("optimizer", "optimizer state"),
             ("activations_peak", "peak activations"), ("saved_per_layer", "saved per layer")) if k in mem))
    for n in report["notes"]:
        console.print(f"note: {n}", style="dim")


def ops_table(report: dict[str, Any], only_comm: bool = False):
    """One row per op: label (x times per step), phase, local shapes, FLOPs, collectives, notes."""
    from rich.table import Table

    m = report.get("microbatches", 1)
    title = f"plan  mesh '{report['mesh']}'  layout '{report['layout']}'"
    if m > 1:
        title += f"  {m} micro-batches (local shapes are one micro-batch's)"
    ops = Table(title=title, title_justify="left", expand=True)
    for col, kw in (("op", {"no_wrap": True}), ("phase", {"no_wrap": True}), ("local shapes", {"ratio": 1}),
                    ("FLOPs", {"justify": "right", "no_wrap": True}), ("collectives", {"no_wrap": True}),
                    ("notes", {"style": "dim", "ratio": 1})):
        ops.add_column(col, **kw)
    for e in report["ops"]:
        if (only_comm or e["op"] in QUIET) and not e["collectives"]:
            continue
        label = e["label"] if e["label"] == e["op"] or e["op"] in LEAVES else f"{e['label']} ({e['op']})"
        if e["times"] > 1:
            label += f" x{e['times']}"
        coll = "\n".join(f"[bold]{c['kind']}[/]({axes_text(c['axes'])}) {human_bytes(c['bytes'])}"
                         for c in e["collectives"])
        shapes = "\n".join(_shape_text(s, sh) for s, sh in zip(e["local_shapes"], e["shardings"]))
        ops.add_row(label, e["phase"], shapes, human_count(e["flops"]) if e["flops"] else "", coll,
                    "\n".join(e["notes"]))
    return ops


def totals_table(report: dict[str, Any]):
    """The per-kind and per-(kind, axes) collective totals of one training step."""
    from rich.table import Table

    t = Table(title="collectives per training step", title_justify="left")
    t.add_column("kind")
    t.add_column("axes")
    t.add_column("count", justify="right")
    t.add_column("bytes per rank", justify="right")
    for kind, v in report["totals"].items():
        t.add_row(f"[bold]{kind}[/]", "all", str(v["count"]), human_bytes(v["bytes"]))
        for r in report["totals_by_axis"]:
            if r["kind"] == kind:
                t.add_row("", axes_text(r["axes"]), str(r["count"]), human_bytes(r["bytes"]))
    if not report["totals"]:
        t.add_row("(none)", "", "0", "0 B")
    return t


__all__ = ["plan_report", "print_report", "ops_table", "totals_table", "human_bytes"]
