"""The multi-process side of the command line: ``meshdsl run`` and ``check --nproc``.

Both start N local gloo processes (or NCCL ones with CUDA) through
:func:`meshdsl.exec.launch.launch`, or join a torchrun job when the torchrun
environment is set, so ``torchrun --nproc-per-node N -m meshdsl run ...``
works unchanged across machines.
"""
from __future__ import annotations

import os
import statistics

from ..exec.launch import in_torchrun, launch
from ..train.jobs import check_job, train_job
from ..train.step import COMM_KINDS


def dist_args(p) -> None:
    """Options shared by every multi-process subcommand."""
    p.add_argument("--nproc", type=int, default=None,
                   help="number of local processes (default: the mesh size); ignored under torchrun")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="torch.distributed backend; auto = nccl when CUDA is available, else gloo")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds before a collective gives up (default 60)")
    p.add_argument("--job-timeout", type=float, default=900.0,
                   help="seconds the whole local job may take before it is killed (default 900)")
    p.add_argument("--verbose", action="store_true",
                   help="log every collective (kind, axes, group, bytes, time) per rank to stderr")


def _launch(args, fn, fn_args):
    if args.verbose:
        os.environ["MESHDSL_VERBOSE"] = "1"
    return launch(fn, args.mesh, nproc=args.nproc, args=fn_args, backend=args.backend,
                  timeout=args.job_timeout, collective_timeout=args.timeout)


def is_rank0() -> bool:
    """True in the process that should print: the launcher, or rank 0 under torchrun."""
    return not in_torchrun() or int(os.environ.get("RANK", "0")) == 0


def check_distributed(args, want: dict, report) -> int:
    """``check --nproc``: loss and gradients on processes, compared with ``want`` (dense)."""
    results = _launch(args, check_job, (args.model, args.tiny, args.mesh, args.layout, args.seed))
    got = results[0]
    if got is None:  # a torchrun rank other than 0
        return 0
    where = f"{len(results) if not in_torchrun() else os.environ.get('WORLD_SIZE')} processes, " \
            f"mesh '{args.mesh}', layout '{args.layout}'"
    return report(want, got, args.tol, where)


def add_run(sub) -> None:
    p = sub.add_parser("run", help="train MODEL for S SGD steps on N processes (torch.distributed)",
                       description="Spawn N local processes (or join a torchrun job), run S forward+"
                                   "backward+SGD steps of MODEL on synthetic data, and print the loss, "
                                   "the step time, and where the time went.")
    from .cli import _model_args
    _model_args(p)
    dist_args(p)
    p.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of data and init")
    p.set_defaults(run=cmd_run)


def cmd_run(args) -> int:
    results = _launch(args, train_job, (args.model, args.tiny, args.mesh, args.layout, args.steps,
                                        args.lr, args.seed, args.warmup))
    if not is_rank0():
        return 0
    from rich.console import Console
    from rich.table import Table

    steps = results[0]
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
    return 0
