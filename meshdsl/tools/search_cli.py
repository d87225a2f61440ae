"""``meshdsl calibrate``, ``meshdsl search``, ``plan --predict`` and ``--layout auto``.

``calibrate`` measures this machine (:mod:`meshdsl.search.calibrate`) and
caches the fit; ``search`` ranks the layouts of a model on N processes by the
cost model (:mod:`meshdsl.search.search`), optionally re-ranks the top K by
measured step time on real processes and plots predicted against measured;
``--layout auto`` in ``run``, ``check`` and ``train`` runs the search and uses
its winner (:func:`resolve_auto_layout`).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics

from ..errors import message
from ..search.calibrate import Calibration, cache_path, load, summary_lines
from ..search.measure import calibrate
from ..search.sweep import num_collective_samples, num_kernel_samples
from ..search.predict import by_op_table, predict
from ..search.search import Ranked, SearchResult, few_full_collections, search
from ..search.space import ROLES, idle_axes
from .cli_common import EXIT_CODES, load_configured, lr_arg, make_console
from .optim_args import optimizer_from_args, train_outputs
from .preflight import UsageError, float_in, int_in
from .search_explain import explain, terms_text

GB = 1e9


def _bar(console):
    """A progress bar that vanishes when done; none when the output is not a terminal (a pipe or
    a file gets the results only, not the bar's leftover line)."""
    from rich.progress import Progress
    return Progress(console=console, transient=True, disable=not console.is_terminal)


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


# ----------------------------------------------------------------------------- calibrate

def add_calibrate(sub) -> None:
    p = sub.add_parser("calibrate", help="measure this machine's collectives and kernels for the cost model",
                       description="Time every collective kind over groups of 2 .. N real processes and a "
                                   "sweep of message sizes, and matmul/elementwise kernels over a sweep of "
                                   "shapes; fit latency and bandwidth per kind and group size, kernel rates "
                                   "and the runtime's own cost per step; cache them for `meshdsl search` and "
                                   "`plan --predict`.",
                       epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int_in(2, 16, fix="pass 2, 4 or 8"), default=2,
                   help="processes of the collective sweep; a power of two also measures the smaller "
                        "groups (default 2)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="backend to measure (default gloo)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (a few seconds)")
    p.add_argument("--timeout", type=float_in(0.0, lo_open=True, fix="e.g. --timeout 120"), default=120.0,
                   help="seconds the collective sweep may take (default 120)")
    p.set_defaults(run=cmd_calibrate)


def cmd_calibrate(args) -> int:
    from ..comm.distributed import resolve_backend

    resolve_backend(args.backend, args.nproc)
    console = make_console()
    total = num_kernel_samples(args.quick) + num_collective_samples(args.nproc, args.quick)
    with _bar(console) as bar:
        task = bar.add_task(f"calibrating ({args.nproc} processes, {args.backend})", total=total)
        cal = calibrate(args.nproc, args.backend, args.quick, lambda k: bar.advance(task, k), args.timeout)
    print_calibration(cal, console)
    console.print(f"saved to {cache_path(cal.backend, cal.host)}", highlight=False, soft_wrap=True)
    return 0


def print_calibration(cal: Calibration, console) -> None:
    from rich.table import Table

    t = Table(title=f"calibration of {cal.host} ({cal.backend}, {cal.cores} cores)", title_justify="left")
    for col in ("processes", "collective", "group", "latency us", "bus bandwidth GB/s"):
        t.add_column(col, justify="left" if col == "collective" else "right")
    jobs = {j: summary_lines(kinds) for j, kinds in sorted(cal.samples.items())} or {0: cal.collectives}
    for job, lines in jobs.items():
        for kind, table in lines.items():
            for n, line in sorted(table.items()):
                t.add_row(str(job or ""), "send/recv" if kind == "send" else kind, str(n),
                          f"{line.fixed_s * 1e6:.0f}", f"{line.rate / 1e9:.2f}")
    console.print(t)
    after = "; ".join(f"+{x * 1e6:.0f} us ({job} processes, groups of {n})"
                      for job, t in sorted(cal.after_compute_s.items()) for n, x in sorted(t.items()))
    console.print("latency: the smallest message's time (a collective is priced between the measured sizes)"
                  + (f"; reached from compute, not from a barrier, a collective costs {after}" if after else ""),
                  highlight=False, soft_wrap=True)
    console.print(f"matmul/bmm: {cal.matmul.rate / 1e9:.1f} GFLOP/s, {cal.matmul.fixed_s * 1e6:.1f} us per kernel; "
                  f"elementwise/reduction: {cal.elementwise.rate / 1e9:.2f} GB/s, "
                  f"{cal.elementwise.fixed_s * 1e6:.1f} us per kernel (one thread); executor: "
                  f"{cal.dispatch_s * 1e6:.1f} us per step ({cal.pipeline_dispatch_s * 1e6:.1f} in a pipeline's "
                  f"actions)", highlight=False, soft_wrap=True)


# ----------------------------------------------------------------------------- search

def add_search(sub) -> None:
    p = sub.add_parser("search", help="rank meshes and layouts of MODEL on N processes by predicted step time",
                       description="Enumerate the meshes for N processes and the layouts over them (data, "
                                   "tensor, FSDP, ZeRO, expert and pipeline parallelism over any dim of the "
                                   "model: the costly splits are pruned by a cheap estimate first), drop those "
                                   "that do not compile or do not fit --memory-limit, and rank the rest by the "
                                   "step time the calibrated cost model predicts (`meshdsl calibrate`).",
                       epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL", help="a shipped model's name (e.g. 'transformer') or a model .py file")
    p.add_argument("--tiny", action="store_true", help="build the model's Config.tiny()")
    p.add_argument("--config", default="", metavar="K=V,...", help="override Config fields, e.g. layers=24")
    p.add_argument("--nproc", type=int_in(1, 4096, fix="pass a process count, e.g. --nproc 4"), required=True,
                   help="processes (mesh devices) to plan for")
    p.add_argument("--memory-limit", type=float_in(0.0, lo_open=True, fix="e.g. --memory-limit 2"), default=None,
                   metavar="GB", help="most memory per rank a layout may need, in GB (10^9 bytes)")
    p.add_argument("--top", type=int_in(1, fix="e.g. --top 5"), default=None,
                   help="rows to show, and with --measure the layouts to run (default 10; --json: every "
                        "ranked candidate)")
    p.add_argument("--measure", action="store_true",
                   help="run the top K on real processes for a few steps each and re-rank by measured time")
    p.add_argument("--steps", type=int_in(1, fix="e.g. --steps 3"), default=3,
                   help="timed steps per layout with --measure (default 3, after two warmup steps)")
    p.add_argument("--plot", default="search-scatter.png", metavar="FILE.png",
                   help="with --measure: where to write the predicted-vs-measured scatter plot (default "
                        "search-scatter.png)")
    p.add_argument("--split-dims", type=_dim_list, default=(), metavar="DIM,...",
                   help="dims the search always considers splitting, whatever their estimated cost (it "
                        "considers every dim of the model and prunes the costly ones), alone and two "
                        "together on the model axis, e.g. kv_heads,d_ff")
    p.add_argument("--no-split", type=_dim_list, default=(), metavar="DIM,...",
                   help="dims the search never splits, on any axis and in any scope (params., opt., grads.)")
    p.add_argument("--explain", action="store_true",
                   help="say why the winner wins over the runner-up (the terms of its predicted time) and "
                        "why each dim was or was not split (kept, pruned by cost with its estimate, "
                        "split unevenly with its waste, not divisible, in conflict)")
    p.add_argument("--json", action="store_true", help="print the ranked candidates as a JSON list")
    p.add_argument("--strict-splits", action="store_true",
                   help="propose no uneven split (a dim over mesh axes that do not divide it; by default "
                        "the search considers them, priced by their largest part)")
    lr_arg(p, 0.01)
    p.set_defaults(run=cmd_search)


def _dim_list(text: str) -> tuple[str, ...]:
    """``--split-dims`` / ``--no-split``: comma-separated dim names (checked against the model's
    dims by the search)."""
    return tuple(d.strip() for d in text.split(",") if d.strip())


def run_search(args, nproc: int, model=None) -> tuple[SearchResult, object]:
    """Load the model of ``args`` and search ``nproc`` processes; refuse a search with no result."""
    model = model or load_configured(args)
    outputs, _ = train_outputs(model, args)
    limit = None if getattr(args, "memory_limit", None) is None else args.memory_limit * GB
    result = search(model, outputs, nproc, load(), limit, split_dims=getattr(args, "split_dims", ()),
                    no_split=getattr(args, "no_split", ()), strict_splits=getattr(args, "strict_splits", False))
    if not result.ranked:
        smallest = min((r.prediction.memory_bytes for r in result.infeasible), default=None)
        raise UsageError(message(
            f"search {args.model} on {nproc} processes: no layout is valid and fits.",
            inputs=[f"candidates: {result.num_candidates}", f"invalid: {len(result.invalid)}",
                    f"over the memory limit: {len(result.infeasible)}"],
            bullets=[f"the smallest needs {smallest / GB:.3f} GB per rank, over --memory-limit "
                     f"{args.memory_limit:g}"] if smallest is not None else [],
            rule="a layout must compile for the mesh and fit the memory limit on every rank",
            fix="raise --memory-limit, use more processes, or shrink the model with --config"))
    return result, model


def cmd_search(args) -> int:
    with few_full_collections():   # the model, its plans and the table: many objects, no cycle to hurry for
        return _search_command(args)


def _search_command(args) -> int:
    """``meshdsl search``'s work."""
    if args.measure:
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK) or os.path.isdir(args.plot):
            raise UsageError(message(f"--plot {args.plot}: cannot write the scatter plot there.",
                                     inputs=[f"folder: {folder}"],
                                     rule="--plot names a PNG file in an existing, writable folder",
                                     fix="pass e.g. --plot search-scatter.png"))
    result, _ = run_search(args, args.nproc)
    rows = result.ranked
    top = args.top or (len(rows) if args.json and not args.measure else 10)
    measured = measure(args, rows[:top]) if args.measure else None
    if measured is not None:
        rows = sorted(rows[:top], key=lambda r: measured[id(r)])
        scatter(rows, measured, args.plot)
    if args.json:
        out = []
        for r in rows[:top]:
            d = r.to_json()
            if measured is not None:
                d["measured_ms"] = measured[id(r)] * 1e3
            out.append(d)
        print(json.dumps(out))
        return 0
    console = make_console()
    print_ranking(result, rows[:top], measured, console)
    if args.explain and len(result.ranked) > 0:
        for line in explain(result):
            console.print(line, highlight=False, soft_wrap=True, markup=False)
    if measured is not None:
        console.print(f"predicted vs measured: {args.plot}", highlight=False)
    return 0


def _figures(cal: Calibration) -> str:
    """Whose figures the cost model prices with: this host's measured ones, or the defaults
    (``meshdsl calibrate`` measures them)."""
    if cal.source == "defaults":
        return f"default figures ({cal.host} uncalibrated)"
    return f"{cal.source} figures of {cal.host}"


def print_ranking(result: SearchResult, rows: list[Ranked], measured, console) -> None:
    from rich.table import Table

    cal = load()
    t = Table(title=f"{result.num_candidates} candidates ({result.strategy} search, {result.num_evaluated} "
                    f"compiled, {len(result.by_cost)} pruned by cost, {len(result.invalid)} invalid, "
                    f"{len(result.infeasible)} over the memory limit) "
                    f"in {result.seconds:.1f} s; cost model: {_figures(cal)}",
              title_justify="left")
    for col in ("#", "mesh", "layout", "pipeline", "predicted ms", "memory/rank", "comm/step") + \
               (("measured ms",) if measured is not None else ()):
        t.add_column(col, justify="left" if col in ("mesh", "layout", "pipeline") else "right")
    for i, r in enumerate(rows):
        c, p = r.candidate, r.prediction
        idle = idle_axes(c)
        note = " (in effect replicated)" if result.replicates(r) else \
            f" (replicated over {', '.join(idle)})" if idle else ""
        t.add_row(str(i + 1), c.mesh, (c.layout + note) if c.layout else "(replicated)",
                  _pipeline_cell(c),
                  f"{p.step_s * 1e3:.2f}", _mb(p.memory_bytes), _mb(p.comm_bytes),
                  *((f"{measured[id(r)] * 1e3:.2f}",) if measured is not None else ()))
    console.print(t)
    best = rows[0].candidate
    flags = (f" --microbatches {best.microbatches}" if best.microbatches > 1 else "") + \
        (f" --schedule {best.schedule}" if best.staged else "")
    note = " (in effect replicated: every rank runs the whole model)" if result.replicates(rows[0]) else ""
    console.print(f"best: --mesh '{best.mesh}' --layout '{best.layout}'{flags}{note}", highlight=False, soft_wrap=True)


def _pipeline_cell(c) -> str:
    """The table's pipeline column: micro-batches and schedule, or a gradient accumulation."""
    if c.staged:
        return f"m={c.microbatches} {c.schedule}"
    return f"accum {c.microbatches}" if c.microbatches > 1 else ""


def measure(args, rows: list[Ranked]) -> dict[int, float]:
    """Median measured step seconds of each row, ``steps`` timed steps on real processes each
    (after two warmup steps); a step takes as long as its slowest rank."""
    from ..processes.launcher import launch
    from ..train.jobs import train_job

    opt, clip = optimizer_from_args(args)
    out = {}
    with _bar(make_console()) as bar:
        task = bar.add_task("measuring", total=len(rows))
        for r in rows:
            c = r.candidate
            res = launch(train_job, c.mesh, args=(args.model, args.tiny, c.mesh, c.layout, args.steps, args.lr, 0, 2,
                                                  c.microbatches, c.schedule, opt, clip, args.config_overrides),
                         backend="gloo", timeout=600)
            out[id(r)] = statistics.median(max(ws) for ws in zip(*[[w for _, _, w in rank] for rank in res]))
            bar.advance(task)
    return out


def scatter(rows: list[Ranked], measured: dict, path: str) -> None:
    """Write the predicted-vs-measured scatter plot of ``rows`` to ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r.prediction.step_s * 1e3 for r in rows]
    ys = [measured[id(r)] * 1e3 for r in rows]
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.scatter(xs, ys)
    for r, x, y in zip(rows, xs, ys):
        ax.annotate(r.candidate.family, (x, y), fontsize=7)
    hi = max(xs + ys) * 1.1
    ax.plot([0, hi], [0, hi], "k--", linewidth=0.5)
    ax.set_xlabel("predicted step ms")
    ax.set_ylabel("measured step ms")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------- plan --predict, --layout auto

def print_prediction(plan, console, top: int = 15) -> None:
    """``plan --predict``: the predicted time per op (costliest first) and in total."""
    from rich.table import Table

    cal = load()
    p = predict(plan, cal)
    t = Table(title=f"predicted per step ({_figures(cal)}); costliest {top} ops",
              title_justify="left")
    for col in ("op", "kind", "compute ms", "comm ms"):
        t.add_column(col, justify="left" if col in ("op", "kind") else "right")
    for label, op, comp, comm in by_op_table(p, top):
        t.add_row(label, op, f"{comp * 1e3:.3f}", f"{comm * 1e3:.3f}")
    console.print(t)
    console.print(f"predicted step {p.step_s * 1e3:.2f} ms = {terms_text(p)}; communication "
                  f"{p.comm_s * 1e3:.2f} ms in all; memory per rank {_mb(p.memory_bytes)}; sends "
                  f"{_mb(p.comm_bytes)} per step", highlight=False, soft_wrap=True)


def auto_layout(args, default_nproc: int | None = None, model=None) -> None:
    """``--layout auto``: search, then set ``args.mesh``, ``args.layout`` (and the pipeline flags).

    With ``--mesh auto`` the search covers every mesh of ``--nproc`` (default: the CPU cores)
    processes; with a given mesh, the layouts over that mesh.
    """
    from ..layout.mesh import Mesh

    if args.layout != "auto":
        if args.mesh == "auto":
            raise UsageError(message("--mesh auto needs --layout auto.", rule="the search picks mesh and layout "
                                     "together", fix="add --layout auto, or give a mesh such as --mesh data:2"))
        return
    given = None if args.mesh in (None, "auto") else Mesh.parse(args.mesh)
    nproc = given.size if given is not None else (getattr(args, "nproc", None) or default_nproc or os.cpu_count())
    result, _ = run_search(args, nproc, model)
    # the user's axis names (the README's 'stage:2; data:2') stand for the search's roles
    onto = [(r, None if given is None else _axes_onto(Mesh.parse(r.candidate.mesh), given)) for r in result.ranked]
    rows = [(r, m) for r, m in onto if given is None or m is not None]
    if not rows:
        raise UsageError(message(f"--layout auto: no layout found for mesh '{given}'.",
                                 inputs=[f"meshes searched: {sorted({r.candidate.mesh for r in result.ranked})}"],
                                 rule="the search names its axes pipe, data and model; an axis of another name "
                                      "takes a role whose size it has (a name of a role keeps that role)",
                                 fix="use --mesh auto, or one of the meshes searched"))
    (row, axes), best = rows[0], rows[0][0].candidate
    args.mesh, args.layout = best.mesh, best.layout
    if axes:
        args.mesh = str(given)
        args.layout = re.sub(r":(\w+)", lambda m: ":" + axes.get(m.group(1), m.group(1)), best.layout)
    if hasattr(args, "microbatches") and best.pipelined:
        args.microbatches, args.schedule = best.microbatches, best.schedule
    print(f"--layout auto: mesh '{args.mesh}', layout '{args.layout}'"
          + (f", {best.microbatches} micro-batches, {best.schedule}" if best.pipelined else "")
          + f" (predicted {row.prediction.step_s * 1e3:.2f} ms per step, best of {len(result.ranked)})",
          flush=True)


def _axes_onto(searched, given) -> dict[str, str] | None:
    """The search's mesh ``searched`` (axes pipe, data, model) as the user's mesh ``given``: a map
    from each searched axis to a given one of its size (an axis named like a role keeps that role:
    ``stage:2; data:2`` is ``pipe:2; data:2``), or None where none fits."""
    if len(searched.axes) != len(given.axes):
        return None
    for order in itertools.permutations(given.axes):
        pairs = list(zip(searched.axes, order))
        if all(size == gsize and (gname == name or gname not in ROLES) for (name, size), (gname, gsize) in pairs):
            return {name: gname for (name, _), (gname, _) in pairs}
    return None


def resolve_auto_layout(args, default_nproc: int | None = None, model=None) -> None:
    """``--layout auto`` (and ``--mesh auto``): replace them by the search's best layout (printed)."""
    if getattr(args, "layout", None) == "auto" or getattr(args, "mesh", None) == "auto":
        auto_layout(args, default_nproc, model)
