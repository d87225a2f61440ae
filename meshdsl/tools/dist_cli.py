"""The multi-process side of the command line: ``meshdsl run`` and ``check --nproc``.

Both start N local gloo processes (or NCCL ones with CUDA) through
:func:`meshdsl.exec.launch.launch`, or join a torchrun job when the torchrun
environment is set, so ``torchrun --nproc-per-node N -m meshdsl run ...``
works unchanged across machines.  Before any process starts, the parent
checks the flags, the mesh, the model and the layout (one compile), the
process count and the backend; a job that would fail does not start.
"""
from __future__ import annotations

import argparse
import os
import statistics

from ..exec.distributed import resolve_backend
from ..exec.launch import in_torchrun, launch
from ..layout.mesh import Mesh
from ..train.jobs import check_job, train_job
from ..train.step import COMM_KINDS
from .preflight import check_processes, float_in, int_in


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
                        "README, 'Running on real processes'")
    p.add_argument("--verbose", action="store_true",
                   help="log every collective (kind, axes, group, bytes, time) per rank to stderr")


def preflight_processes(args, mesh: Mesh) -> None:
    """Refuse a bad process count or backend before the model is even loaded (cheap checks first)."""
    resolve_backend(args.backend)
    if not in_torchrun():
        nproc = mesh.size if args.nproc is None else args.nproc
        check_processes(mesh, nproc, args.max_procs)


def _launch(args, fn, fn_args):
    if args.verbose:
        os.environ["MESHDSL_VERBOSE"] = "1"
    mesh = Mesh.parse(args.mesh)
    args.num_procs = int(os.environ["WORLD_SIZE"]) if in_torchrun() else (args.nproc or mesh.size)
    return launch(fn, mesh, nproc=args.nproc, args=fn_args, backend=args.backend,
                  timeout=args.job_timeout, collective_timeout=args.timeout,
                  rdzv_host=args.rdzv_host)


def is_rank0() -> bool:
    """True in the process that should print: the launcher, or rank 0 under torchrun."""
    return not in_torchrun() or int(os.environ.get("RANK", "0")) == 0


def check_distributed(args, want: dict, report) -> int:
    """``check --nproc``: loss and gradients on processes, compared with ``want`` (dense)."""
    from .optim_args import optimizer_from_args

    opt, clip = optimizer_from_args(args)
    results = _launch(args, check_job, (args.model, args.tiny, args.mesh, args.layout, args.seed, 1, "gpipe",
                                        opt, clip))
    got = results[0]
    if got is None:  # a torchrun rank other than 0
        return 0
    where = f"{len(results) if not in_torchrun() else os.environ.get('WORLD_SIZE')} processes, " \
            f"mesh '{args.mesh}', layout '{args.layout}'"
    return report(want, got, args.tol, where)


def add_run(sub) -> None:
    from .cli import EXIT_CODES, _model_args, lr_arg, seed_arg

    p = sub.add_parser("run", help="train MODEL for S steps on N processes (torch.distributed)",
                       description="Spawn N local processes (or join a torchrun job), run S forward+"
                                   "backward+optimizer steps of MODEL on synthetic data (plain SGD, or "
                                   "--optimizer), and print the loss, "
                                   "the step time, and where the time went.",
                       epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_args(p)
    dist_args(p)
    p.add_argument("--steps", type=int_in(1, fix="pass at least one step, e.g. --steps 10"), default=10,
                   help="timed steps (default 10)")
    p.add_argument("--warmup", type=int_in(0, fix="pass 0 or more, e.g. --warmup 2"), default=2,
                   help="untimed steps first (default 2)")
    lr_arg(p, 0.01)
    seed_arg(p)
    p.set_defaults(run=cmd_run)


def cmd_run(args) -> int:
    from ..lowering.compiler import compile as compile_plan
    from ..train.model import load_model

    mesh = Mesh.parse(args.mesh)
    preflight_processes(args, mesh)
    from .optim_args import optimizer_from_args, train_outputs

    model = load_model(args.model, tiny=args.tiny)
    opt, clip = optimizer_from_args(args)
    compile_plan(train_outputs(model, args)[0], mesh, args.layout)  # layout errors surface here, once
    args.preflight_done = True
    results = _launch(args, train_job, (args.model, args.tiny, args.mesh, args.layout, args.steps,
                                        args.lr, args.seed, args.warmup, 1, "gpipe", opt, clip,
                                        args.precision))
    if not is_rank0():
        return 0
    _print_steps(args, results[0])
    return 0


def _print_steps(args, steps) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    t = Table(title=f"meshdsl run {args.model}: mesh '{args.mesh}', layout '{args.layout}'",
              title_justify="left")
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
    console.print(f"median step {med * 1e3:.2f} ms; compute {comp * 1e3:.2f} ms; "
                  f"communication per step: " + (", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in kinds.items())
                                                 or "none") + f"; framework overhead {over:.1%} of a step")
