"""The multi-process side of the command line: ``meshdsl run`` and ``check --nproc``.

Both start N local gloo processes (or NCCL ones with CUDA) through
:func:`meshdsl.processes.launcher.launch`, or join a torchrun job when the torchrun
environment is set, so ``torchrun --nproc-per-node N -m meshdsl run ...``
works unchanged across machines.  Before any process starts, the parent
checks the flags, the mesh, the model and the layout (one compile), the
process count and the backend; a job that would fail does not start.
"""
from __future__ import annotations

import argparse
import os
import statistics

from ..comm.distributed import resolve_backend
from ..processes.launcher import in_torchrun, launch
from ..layout.mesh import Mesh
from ..lowering.bucket import DEFAULT_BUCKET_MB
from ..lowering.compiler import compile as compile_plan, ignored_options
from ..train.jobs import check_job, train_job
from ..train.step import COMM_KINDS
from .cli_common import (EXIT_CODES, compile_arg, compile_setting, load_configured, lr_arg, make_console, model_args,
                         pipe_args, remat_arg, seed_arg)
from .optim_args import optimizer_from_args, train_outputs
from .pipe_report import figures_table, pipeline_program, run_figures, schedule_summary
from .preflight import UsageError, check_memory, check_output_path, check_processes, float_in, int_in
from .search_cli import resolve_auto_layout
from .stage_args import resolve_stage_layers
from .timeline_png import bar_counts, check_timeline, draw, median_step, timeline_arg


def dist_args(p) -> None:
    """Options shared by every multi-process subcommand."""
    p.add_argument("--nproc", type=int_in(1, fix="pass the mesh size, e.g. --nproc 2"), default=None,
                   help="number of local processes (default: the mesh size); ignored under torchrun")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="torch.distributed backend; auto = nccl when CUDA is available, else gloo")
    p.add_argument("--timeout", type=float_in(0.0, lo_open=True, fix="pass seconds, e.g. --timeout 60"),
                   default=60.0, help="seconds before a collective gives up (default 60)")
    p.add_argument("--job-timeout", type=float_in(0.0, lo_open=True,
                                                  fix="pass seconds, e.g. --job-timeout 900"),
                   default=900.0,
                   help="seconds the whole local job may take before it is killed (default 900)")
    p.add_argument("--max-procs", type=int_in(1, fix="pass a process count, e.g. --max-procs 64"),
                   default=None,
                   help="most local processes a job may start (default: 4 per CPU core)")
    p.add_argument("--rdzv-host", default="127.0.0.1", metavar="ADDR",
                   help="address the local rendezvous listens on (default 127.0.0.1, this machine "
                        "only); another address lets any host that reaches it join the job: see "
                        "docs/guide/processes.md")
    p.add_argument("--verbose", action="store_true",
                   help="log every collective (kind, axes, group, bytes, time) per rank to stderr")
    p.add_argument("--no-shm", action="store_true",
                   help="keep collectives and pipeline transfers on gloo's sockets instead of shared "
                        "memory among the ranks of one host (also MESHDSL_SHM=0)")


def device_arg(p, default: str) -> None:
    """``--device`` of a run in this process (the simulated mesh)."""
    p.add_argument("--device", default=default, metavar="DEVICE",
                   help=f"where a run in this process (the simulated mesh, no --nproc) keeps its values: cpu, "
                        f"cuda (every simulated rank on one GPU) or auto (cuda when torch sees a GPU); default "
                        f"{default}. Processes get theirs from --backend (nccl: a GPU each)")


def local_device(args, command: str):
    """The torch.device of ``args.device`` for a run in this process.

    Raises:
      UsageError: a device other than auto/cpu with processes (--nproc or torchrun).
      GraphError: an unknown device, or one this machine lacks (see ``as_device``).
    """
    import torch

    from ..errors import message
    from ..comm.communicator import as_device
    if (args.nproc is not None or in_torchrun()) and args.device not in ("auto", "cpu"):
        raise UsageError(message(f"{command} --device {args.device} with processes: each process's device comes "
                                 "from the backend.", rule="--device places a run in this process (no --nproc)",
                                 fix="drop --device (--backend nccl puts each process on a GPU of its own)"))
    if args.device == "auto":
        return as_device("cuda" if torch.cuda.is_available() else "cpu")
    return as_device(args.device)


def bucket_arg(p) -> None:
    """``--bucket-mb``: the size of the gradient buckets (see :mod:`meshdsl.lowering.bucket`)."""
    p.add_argument("--bucket-mb", type=float_in(0.0, fix="pass a size in MB, e.g. --bucket-mb 25, or 0 for none"),
                   default=DEFAULT_BUCKET_MB,
                   help=f"reduce gradients in buffers of about this many MB, one collective per bucket "
                        f"(default {DEFAULT_BUCKET_MB:g}, as DDP; 0: one collective per gradient)")


def preflight_processes(args, mesh: Mesh) -> None:
    """Refuse a bad process count or backend before the model is even loaded (cheap checks first)."""
    if in_torchrun():
        resolve_backend(args.backend, int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or None)
    else:
        nproc = mesh.size if args.nproc is None else args.nproc
        resolve_backend(args.backend, nproc)
        check_processes(mesh, nproc, args.max_procs)


def check_job_memory(args, plan, command: str, device=None) -> None:
    """Refuse a job whose predicted memory does not fit here (:func:`~.preflight.check_memory`),
    before anything is allocated: its ranks in this process on ``device`` (the simulated mesh),
    or on processes, each on a GPU of its own (nccl) or all sharing this machine's RAM."""
    if device is not None:
        check_memory(plan, command, gpu=device.type == "cuda", ranks_here=Mesh.parse(args.mesh).size)
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if in_torchrun() else (args.nproc or Mesh.parse(args.mesh).size)
    gpu = resolve_backend(args.backend, local) == "nccl"
    check_memory(plan, command, gpu=gpu, ranks_here=1 if gpu else local)


def launch_job(args, fn, fn_args):
    """Run ``fn(comm, *fn_args)`` on the job's processes (``--nproc``, or torchrun's) with the
    flags' backend, timeouts and rendezvous; returns each rank's result (see ``launch``)."""
    if args.verbose:
        os.environ["MESHDSL_VERBOSE"] = "1"
    if args.no_shm:
        os.environ["MESHDSL_SHM"] = "0"
    mesh = Mesh.parse(args.mesh)
    args.num_procs = int(os.environ["WORLD_SIZE"]) if in_torchrun() else (args.nproc or mesh.size)
    return launch(fn, mesh, nproc=args.nproc, args=fn_args, backend=args.backend,
                  timeout=args.job_timeout, collective_timeout=args.timeout,
                  rdzv_host=args.rdzv_host)


def is_rank0() -> bool:
    """True in the process that should print: the launcher, or rank 0 under torchrun."""
    return not in_torchrun() or int(os.environ.get("RANK", "0")) == 0


def say_ignored_options(plan) -> None:
    """Print the plan's notes on options given that change nothing (a ``--schedule`` of a layout
    that pipelines nothing), one line each, as ``meshdsl plan`` lists them (rank 0 only)."""
    if is_rank0():
        for note in ignored_options(plan):
            print(f"note: {note}", flush=True)


def check_distributed(args, want: dict, report) -> int:
    """``check --nproc``: loss and gradients on processes, compared with ``want`` (dense)."""
    opt, clip = optimizer_from_args(args)
    results = launch_job(args, check_job, (args.model, args.tiny, args.mesh, args.layout, args.seed,
                                        args.microbatches, args.schedule, opt, clip,
                                        getattr(args, "config_overrides", None), args.bucket_mb,
                                        compile_setting(args), args.remat, args.stage_layers))
    got = results[0]
    if got is None:  # a torchrun rank other than 0
        return 0
    where = f"{len(results) if not in_torchrun() else os.environ.get('WORLD_SIZE')} processes, " \
            f"mesh '{args.mesh}', layout '{args.layout}'"
    if args.microbatches > 1:
        where += f", {args.microbatches} micro-batches, schedule {args.schedule}"
    if args.remat is not None:
        where += f", remat {args.remat} (dense: none)"
    return report(want, got, args.tol, where)


def add_run(sub) -> None:
    p = sub.add_parser("run", help="train MODEL for S steps on N processes (torch.distributed)",
                       description="Spawn N local processes (or join a torchrun job), run S forward+"
                                   "backward+optimizer steps of MODEL on synthetic data (plain SGD, or "
                                   "--optimizer), and print the loss, "
                                   "the step time, and where the time went.",
                       epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_args(p)
    dist_args(p)
    p.add_argument("--steps", type=int_in(1, fix="pass at least one step, e.g. --steps 10"), default=10,
                   help="timed steps (default 10)")
    p.add_argument("--warmup", type=int_in(0, fix="pass 0 or more, e.g. --warmup 2"), default=2,
                   help="untimed steps first (default 2)")
    lr_arg(p, 0.01)
    seed_arg(p)
    pipe_args(p)
    remat_arg(p)
    bucket_arg(p)
    compile_arg(p)
    p.add_argument("--report", metavar="FILE.json", default=None,
                   help="also write the figures to FILE.json: step_ms and per step the compute / comm / "
                        "overhead split; with a pipeline, the per-stage bubble and peak activations")
    timeline_arg(p)
    p.set_defaults(run=cmd_run)


def cmd_run(args) -> int:
    resolve_auto_layout(args)
    mesh = Mesh.parse(args.mesh)
    preflight_processes(args, mesh)
    if args.report is not None:
        check_report_path(args.report)
    model = load_configured(args)
    opt, clip = optimizer_from_args(args)
    # Layout, micro-batch and schedule errors surface here, once, before any process starts.
    outputs = train_outputs(model, args, with_grads=False)[0]
    plan = compile_plan(outputs, mesh, args.layout, microbatches=args.microbatches,
                        schedule=args.schedule, bucket_mb=args.bucket_mb, strict_splits=args.strict_splits,
                        stage_layers=resolve_stage_layers(args, outputs))
    check_job_memory(args, plan, "run")
    say_ignored_options(plan)
    summary = schedule_summary(plan)
    check_timeline(args, summary)
    args.preflight_done = True
    results = launch_job(args, train_job, (args.model, args.tiny, args.mesh, args.layout, args.steps,
                                        args.lr, args.seed, args.warmup, args.microbatches, args.schedule,
                                        opt, clip, args.config_overrides, True, args.precision,
                                        args.bucket_mb, args.remat, compile_setting(args), args.stage_layers))
    if not is_rank0():
        return 0
    steps, timelines = results[0]
    _print_steps(args, steps, [r[0] for r in results if r is not None])
    figures = run_figures(pipeline_program(plan), timelines) if summary is not None and timelines else None
    if figures is not None:
        console = make_console()
        console.print(figures_table(figures, f"pipeline over '{summary['axis']}': {figures['stages']} stages, "
                                             f"{figures['microbatches']} micro-batches, {figures['schedule']}"))
        console.print("per stage, medians over the timed steps: busy = time in F, B and W actions (W: a B's "
                      "weight gradients, run after it sends its input gradient); bubble = idle fraction of the "
                      "span from the step's first F to its last action, over all ranks; "
                      "theory: bubble (p-1)/(m+p-1) with F = 1 and B = 2 (zbh1: F = B = W = 1, less; interleaved:V: "
                      "(p-1)/(Vm+p-1); interleaved-zb:V: its schedule at F = B = W = 1), activations held m (gpipe), "
                      "p - stage (1f1b) or p (zbh1)",
                      highlight=False, soft_wrap=True)
    if args.timeline is not None and timelines:
        got = draw(median_step(timelines), args.timeline,
                   f"{args.model}: {summary['schedule']}, {summary['stages']} stages, {summary['microbatches']} "
                   f"micro-batches, mesh '{args.mesh}' (measured: the step of median length)")
        print(f"timeline: {args.timeline} ({bar_counts(got['bars'])}, span {got['span']:.1f} ms)")
    if args.report is not None:
        write_report(args, [r[0] for r in results if r is not None], figures, plan)
    return 0


def check_report_path(path: str) -> None:
    """Refuse a ``--report`` file that cannot be written, before any process starts."""
    check_output_path("--report", path, "a JSON file", "run.json")


def write_report(args, per_rank: list, figures, plan) -> None:
    """Write ``--report``: the run's figures as one JSON object (pipeline keys only when pipelined).

    Top-level per-step lists are rank 0's: ``step_ms``, ``compute_ms``, ``comm_ms`` (exposed
    communication: issuing collectives plus time blocked on one in flight; also under
    ``exposed_comm_ms``), ``overhead_ms`` and ``comm_in_flight_ms`` (the sum over collectives
    of the time each was in flight, hidden or not; overlapping ones each count).  ``ranks`` has the same per rank with ``peak_rss_mib``
    (each step's resident-set high-water mark, measured), and ``memory_plan`` the plan's
    own bytes per rank (params, grads, optimizer state, peak activations).
    """
    import json

    from ..lowering.memory import memory_report

    def split(steps):
        return {"step_ms": [wall * 1e3 for _, _, wall in steps],
                "compute_ms": [st.compute * 1e3 for _, st, _ in steps],
                "comm_ms": [st.comm * 1e3 for _, st, _ in steps],
                "exposed_comm_ms": [st.comm * 1e3 for _, st, _ in steps],
                "comm_in_flight_ms": [st.in_flight * 1e3 for _, st, _ in steps],
                "overhead_ms": [st.overhead * 1e3 for _, st, _ in steps]}

    steps = per_rank[0]
    out = {"model": args.model, "mesh": args.mesh, "layout": args.layout, "microbatches": args.microbatches,
           "bucket_mb": args.bucket_mb, "loss": [loss for loss, _, _ in steps], **split(steps),
           "ranks": [{"rank": r, **split(st), "peak_rss_mib": [s.peak_rss / 2 ** 20 for _, s, _ in st]}
                     for r, st in enumerate(per_rank)],
           "memory_plan": memory_report(plan),
           "memory_source": "peak_rss_mib: getrusage ru_maxrss of each rank's process after each step "
                            "(the whole process: interpreter, torch, buffers); memory_plan: bytes per rank "
                            "read off the plan"}
    if figures is not None:
        out.update(figures)
    with open(args.report, "w") as f:
        json.dump(out, f, indent=1)


def _print_steps(args, steps, per_rank: list) -> None:
    from rich.table import Table

    console = make_console()
    pipe = f", {args.microbatches} micro-batches, {args.schedule}" if args.microbatches > 1 else ""
    console.print(f"meshdsl run {args.model}: mesh '{args.mesh}', layout '{args.layout}'{pipe}", highlight=False,
                  soft_wrap=True)
    t = Table()
    for col in ("step", "loss", "step ms", "compute ms", "comm ms", "overhead ms"):
        t.add_column(col, justify="right")
    for i, (loss, st, wall) in enumerate(steps):
        t.add_row(str(i), f"{loss:.6f}", f"{wall * 1e3:.2f}", f"{st.compute * 1e3:.2f}",
                  f"{st.comm * 1e3:.2f}", f"{st.overhead * 1e3:.2f}")
    console.print(t)
    med = statistics.median(w for _, _, w in steps)
    kinds: dict[str, float] = {}
    for _, st, _ in steps:
        for k, v in st.by_kind.items():
            if k in COMM_KINDS:
                kinds[k] = kinds.get(k, 0.0) + v / len(steps)
    comp = statistics.median(st.compute for _, st, _ in steps)
    over = statistics.median(st.overhead / st.total for _, st, _ in steps if st.total)
    flight = statistics.median(st.in_flight for _, st, _ in steps)
    exposed = statistics.median(st.comm for _, st, _ in steps)
    rss = " ".join(f"{max(s.peak_rss for _, s, _ in st) / 2 ** 20:.0f}" for st in per_rank)
    console.print(f"median step {med * 1e3:.2f} ms; compute {comp * 1e3:.2f} ms; "
                  f"exposed communication per step: " + (", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in kinds.items())
                                                         or "none") +
                  f" ({exposed * 1e3:.2f} ms of {flight * 1e3:.2f} ms in flight); framework overhead "
                  f"{over:.1%} of a step; peak RSS per rank (MiB): {rss}", highlight=False, soft_wrap=True)
