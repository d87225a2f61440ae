"""The ``meshdsl`` command line: ``plan`` and ``check`` a model under a mesh and a layout.

Each subcommand is two functions: ``add_<name>(subparsers)`` declares its
arguments and ``cmd_<name>(args) -> exit code`` runs it; :data:`SUBCOMMANDS`
lists the ``add_`` functions.  Multi-process execution (``meshdsl run`` and
``check --nproc N`` on torch.distributed, see :mod:`meshdsl.exec.launch`)
plugs in the same way: add ``add_run``/``cmd_run``, and give ``check`` an
executor other than :func:`run_on_simulated_mesh`.

Exit codes: 0 success, 1 a check found a mismatch, 2 a user error (bad mesh
or layout string, missing model file, ...), printed without a traceback.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys

import torch

from ..errors import MeshDSLError
from ..exec.dense import run_dense
from ..exec.simulated import run_simulated
from ..lowering.compiler import compile as compile_plan
from ..exec.launch import in_torchrun
from .dist_cli import add_run
from .loader import DEFAULT_LR, load_model
from .report import plan_report, print_report

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE = 0, 1, 2

# fp32 outputs of a split program differ from the dense one only by rounding:
# a split contraction adds its partial sums in another order.  That error is
# at most about n * 2**-24 of the output's magnitude for sums of n terms, so
# 1e-4 covers n up to ~1e3 (every model here); a layout bug (a missing or
# doubled reduction, a wrong slice) is off by O(1) of the magnitude.
DEFAULT_TOL = 1e-4


def _console():
    from rich.console import Console

    # Pipes get a wide console rather than rich's 80 columns, so rows stay on one line.
    return Console(width=shutil.get_terminal_size((160, 24)).columns)


def _model_args(p: argparse.ArgumentParser) -> None:
    """Arguments every model subcommand shares: MODEL, --mesh, --layout, --tiny."""
    p.add_argument("model", metavar="MODEL",
                   help="a model name in models/ (e.g. 'transformer') or a path to a model .py file")
    p.add_argument("--mesh", required=True, help='mesh axes and sizes, e.g. "data:2; model:2"')
    p.add_argument("--layout", default="",
                   help='layout rules, e.g. "batch:data; heads:model; params.d_model:data"')
    p.add_argument("--tiny", action="store_true", help="build the model's Config.tiny() (for quick checks)")


# ----------------------------------------------------------------------------- plan

def add_plan(sub) -> None:
    p = sub.add_parser("plan", help="compile one SGD training step and print its per-op plan",
                       description="Compile loss, gradients and SGD updates of MODEL and print, per op, "
                                   "the phase, local shapes, FLOPs and collectives, then the totals.")
    _model_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object with 'ops' and 'totals'")
    p.add_argument("--only-comm", action="store_true", help="list only the ops that communicate")
    p.add_argument("--totals", action="store_true", help="print only the collective totals")
    p.add_argument("--lr", type=float, default=DEFAULT_LR, help="SGD learning rate of the update phase")
    p.set_defaults(run=cmd_plan)


def cmd_plan(args) -> int:
    model = load_model(args.model, tiny=args.tiny)
    plan = compile_plan(model.train_step(args.lr), args.mesh, args.layout)
    report = plan_report(plan)
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report, _console(), only_comm=args.only_comm, totals_only=args.totals)
    return EXIT_OK


# ----------------------------------------------------------------------------- check

def add_check(sub) -> None:
    p = sub.add_parser("check", help="compare loss and gradients on the mesh with the dense program",
                       description="Run loss and gradients of MODEL on the simulated mesh and densely; "
                                   "print the max abs difference per output and fail if any exceeds "
                                   "TOL * max|dense output|.")
    _model_args(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic data and the param init")
    p.add_argument("--tol", type=float, default=DEFAULT_TOL,
                   help=f"tolerance relative to each output's magnitude (default {DEFAULT_TOL}: fp32 "
                        "rounding of re-ordered sums, far below what a wrong layout produces)")
    from .dist_cli import dist_args
    dist_args(p)
    p.set_defaults(run=cmd_check)


def run_on_simulated_mesh(plan, feeds, seed: int) -> dict[str, torch.Tensor]:
    """The executor of ``check``: every rank of the mesh simulated in this process."""
    return run_simulated(plan, feeds, seed=seed)


def cmd_check(args) -> int:
    model = load_model(args.model, tiny=args.tiny)
    outputs = {"loss": model.loss, **{f"grad/{k}": g for k, g in model.grads().items()}}
    plan = compile_plan(outputs, args.mesh, args.layout)
    feeds = model.feeds(args.seed)
    want = run_dense(outputs, feeds, seed=args.seed)
    if args.nproc is not None or in_torchrun():
        from .dist_cli import check_distributed
        return check_distributed(args, want, report_check)
    got = run_on_simulated_mesh(plan, feeds, args.seed)
    return report_check(want, got, args.tol, f"mesh '{plan.mesh}', layout '{plan.layout}'")


def report_check(want: dict, got: dict, tol: float, where: str) -> int:
    """Print the per-output differences; EXIT_OK when every relative difference is within ``tol``.

    The relative difference of an output is its max abs difference divided by
    its largest dense magnitude (an all-zero output must match exactly).
    """
    from rich.table import Table

    t = Table(title=f"check: {where}  (tolerance {tol:g} relative to max|dense|)", title_justify="left")
    for col in ("output", "shape", "max |dense|", "max abs diff", "relative", ""):
        t.add_column(col, justify="left" if col in ("output", "shape") else "right")
    worst, bad = 0.0, []
    for k, ref in want.items():
        diff = (got[k].double() - ref.double()).abs().max().item() if ref.numel() else 0.0
        scale = ref.abs().max().item() if ref.numel() else 0.0
        rel = diff / scale if scale else (0.0 if diff == 0 else float("inf"))
        worst = max(worst, diff)
        if not rel <= tol:
            bad.append(k)
        t.add_row(k, str(tuple(ref.shape)), f"{scale:.3e}", f"{diff:.3e}", f"{rel:.1e}",
                  "ok" if rel <= tol else "[bold red]FAIL[/]")
    console = _console()
    console.print(t)
    if bad:
        console.print(f"[bold red]FAIL[/]: {len(bad)} of {len(want)} outputs over tolerance "
                      f"({', '.join(bad)}); overall max abs diff {worst:.3e}")
        return EXIT_MISMATCH
    console.print(f"[bold green]OK[/]: {len(want)} outputs match the dense program; "
                  f"overall max abs diff {worst:.3e}")
    return EXIT_OK


# ----------------------------------------------------------------------------- main

SUBCOMMANDS = [add_plan, add_check, add_run]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshdsl", description="Compile and check named-tensor models on a device mesh.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``meshdsl`` console script and ``python -m meshdsl``."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except MeshDSLError as e:
        print(f"meshdsl {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
