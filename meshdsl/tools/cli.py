"""The ``meshdsl`` command line: ``plan``, ``check``, ``run`` and ``train`` a model under a mesh and a layout;
``generate`` from and ``eval`` a trained run (:mod:`.trained_cli`).

Each subcommand is two functions: ``add_<name>(subparsers)`` declares its
arguments and ``cmd_<name>(args) -> exit code`` runs it; :data:`SUBCOMMANDS`
lists the ``add_`` functions.  ``run`` and ``check --nproc N`` execute on
torch.distributed processes (see :mod:`meshdsl.tools.dist_cli`).

Every command validates first, in this process: flag ranges (argparse types),
then mesh, model, layout (one compile), process count, backend and memory.
Only a valid job starts processes.

Exit codes (also in ``--help``): :data:`EXIT_OK` 0, :data:`EXIT_MISMATCH` 1
(``check`` found a difference, nothing else), :data:`EXIT_USAGE` 2 (a user
error, one clean message, no traceback), :data:`EXIT_INTERNAL` 3 (a bug in
meshdsl: "internal error, please report" and the traceback),
:data:`EXIT_INTERRUPTED` 130 (Ctrl-C; every rank stopped).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import traceback

import torch

from ..errors import MeshDSLError, did_you_mean, message
from ..runtime.dense import run_dense
from ..runtime.executor import Executor
from ..processes.failures import RankInternalError
from ..processes.launcher import in_torchrun
from ..processes.malloc import tune_malloc
from ..comm.simulated import SimulatedComm
from ..layout.mesh import Mesh
from ..lowering.compiler import compile as compile_plan
from ..lowering.memory import memory_report
from ..lowering.interleave import stored_layers
from ..lowering.schedule import has_placed_w
from ..train.model import DEFAULT_LR
from ..train.step import training_outputs
from .dist_cli import (add_run, bucket_arg, check_job_memory, device_arg, dist_args, is_rank0, local_device,
                       say_ignored_options)
from .optim_args import describe, optimizer_from_args, train_outputs
from .preflight import UsageError, check_simulated_memory, float_in, memory_warning
from .pipe_report import pipeline_program, run_figures, schedule_summary, user_mesh_layout
from .compare import report_check
from .report import plan_report, print_report
from .search_cli import add_calibrate, add_search, print_prediction, resolve_auto_layout
from .timeline_png import bar_counts, check_timeline, draw, simulated_rows, timeline_arg
from .train_cli import add_train
from .export_cli import add_export
from .trained_cli import add_eval, add_generate
from .stage_args import resolve_stage_layers, stage_lines
from .cli_common import (EXIT_CODES, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_MISMATCH, EXIT_OK, EXIT_USAGE,  # noqa: F401
                         load_configured, lr_arg, make_console, model_args, pipe_args, remat_arg, seed_arg,
                         compile_arg, compile_setting)

# fp32 outputs of a split program differ from the dense one only by rounding:
# a split contraction adds its partial sums in another order.  That error is
# at most about n * 2**-24 of the magnitudes summed, for sums of n terms, so
# 1e-4 covers n up to ~1e3 (every model here); a layout bug (a missing or
# doubled reduction, a wrong slice) is off by O(1) of the magnitude.
DEFAULT_TOL = 1e-4


class Parser(argparse.ArgumentParser):
    """argparse with the house's error line: ``prog: error: what; fix`` and exit 2, no usage dump."""

    def error(self, message: str):
        if in_torchrun() and not is_rank0():  # every rank parses the same argv: rank 0 says it
            _wait_for_rank0(EXIT_USAGE)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


# ----------------------------------------------------------------------------- plan

def add_plan(sub) -> None:
    p = sub.add_parser("plan", help="compile one training step and print its per-op plan",
                       description="Compile loss, gradients and optimizer updates of MODEL and print, per "
                                   "op, the phase, local shapes, FLOPs and collectives, then the totals "
                                   "and the memory per rank (params, grads, optimizer state, peak "
                                   "activations).",
                       epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_args(p)
    form = p.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help="print one JSON object with 'ops' and 'totals' "
                                                          "(the whole report; not with --totals/--only-comm)")
    form.add_argument("--totals", action="store_true", help="print only the collective totals")
    p.add_argument("--only-comm", action="store_true", help="list only the ops that communicate")
    p.add_argument("--predict", action="store_true", help="also print the predicted time per op and per step "
                                                          "(from `meshdsl calibrate`)")
    lr_arg(p, DEFAULT_LR)
    pipe_args(p)
    remat_arg(p)
    timeline_arg(p)
    bucket_arg(p)
    compile_arg(p)
    p.set_defaults(run=cmd_plan)


def cmd_plan(args) -> int:
    if args.json and args.only_comm:
        raise MeshDSLError("--json and --only-comm conflict: the JSON report always lists every op.\n"
                           "Fix: drop --only-comm (filter the 'ops' whose 'collectives' are non-empty)")
    resolve_auto_layout(args)
    Mesh.parse(args.mesh)
    model = load_configured(args)
    outputs, _ = train_outputs(model, args)   # with the frozen params the step sets (an EMA target)
    plan = compile_plan(outputs, args.mesh, args.layout, microbatches=args.microbatches, schedule=args.schedule,
                        bucket_mb=args.bucket_mb, strict_splits=args.strict_splits,
                        stage_layers=resolve_stage_layers(args, outputs))
    pipe = schedule_summary(plan)
    check_timeline(args, pipe)
    report = plan_report(plan)
    report["optimizer"] = describe(*optimizer_from_args(args))
    report["memory"] = memory_report(plan)
    if args.compile:
        report["compile"] = compile_summary(plan, compile_setting(args))
    gpu = torch.cuda.is_available()  # as `run` would go: nccl, a GPU per rank; else every rank in this RAM
    warning = memory_warning(plan, gpu, 1 if gpu else Mesh.parse(args.mesh).size)
    if warning is not None:
        print(f"meshdsl plan: {warning}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(report))
        return EXIT_OK
    console = make_console()
    print_report(report, console, only_comm=args.only_comm, totals_only=args.totals)
    if pipe is not None:
        console.print(f"pipeline over '{pipe['axis']}': {pipe['stages']} stages, {pipe['microbatches']} "
                      f"micro-batches, schedule {pipe['schedule']}; in theory: bubble "
                      f"{pipe['bubble_theory']:.1%}, activations held per stage {pipe['peak_theory']}",
                      highlight=False, soft_wrap=True)
        console.print(pipe["table"], highlight=False, markup=False)
        stored = stored_layers(plan)   # an interleaved pipeline's chunks, each on the rank that runs it
        if stored is not None:
            console.print(stored, highlight=False, markup=False, soft_wrap=True)
        for line in (stage_lines(plan) if args.stage_layers is not None else ()):
            console.print(line, highlight=False, soft_wrap=True)
    if args.timeline is not None:
        program = pipeline_program(plan)
        got = draw(simulated_rows(program), args.timeline,
                   f"{args.model}: {pipe['schedule']}, {pipe['stages']} stages, {pipe['microbatches']} micro-batches "
                   f"(F = B{' = W' if has_placed_w(program.schedule) else ''} = 1, transfers free)",
                   unit="F times", scale=1.0)
        console.print(f"timeline: {args.timeline} ({bar_counts(got['bars'])}, span {got['span']:g} "
                      f"F times)", highlight=False, soft_wrap=True)
    if args.predict:
        print_prediction(plan, console)
    if args.compile:
        c = report["compile"]
        console.print(f"--compile: each rank runs {c['segments']} compiled segment(s) holding {c['compiled_steps']} of "
                      f"its {c['local_steps']} local kernels (a loop's body once, for all its layers); collectives, "
                      f"loops and pipeline actions between them run as they are"
                      + (f"; left eager: {', '.join(c['eager_ops'])}" if c["eager_ops"] else ""),
                      highlight=False, soft_wrap=True)
    return EXIT_OK


def compile_summary(plan, backend: str) -> dict:
    """``plan --compile``: what compiling makes of ``plan`` (:func:`meshdsl.runtime.compiled.plan_summary`)."""
    from ..runtime.compiled import plan_summary
    return plan_summary(Executor(plan, SimulatedComm(plan.mesh), compile=backend))


# ----------------------------------------------------------------------------- check

def add_check(sub) -> None:
    p = sub.add_parser("check", help="compare loss and gradients on the mesh with the dense program",
                       description="Run loss and gradients of MODEL on the simulated mesh (or on N "
                                   "processes with --nproc) and densely; print the max abs difference "
                                   "per output and fail (exit 1) if any exceeds its allowance (see "
                                   "--tol).",
                       epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_args(p)
    seed_arg(p)
    p.add_argument("--tol", type=float_in(0.0, fix="pass a small tolerance such as --tol 1e-4"),
                   default=DEFAULT_TOL,
                   help=f"tolerance relative to each output's magnitude, or to the largest "
                        f"gradient's for a gradient (default {DEFAULT_TOL}: fp32 rounding of "
                        f"re-ordered sums, far below what a wrong layout produces)")
    lr_arg(p, DEFAULT_LR, precision=False)   # check compares with the fp32 dense program: fp32 only
    pipe_args(p)
    remat_arg(p, "; the dense program it is checked against saves every activation (none)")
    bucket_arg(p)
    dist_args(p)
    device_arg(p, "cpu")
    compile_arg(p)
    p.set_defaults(run=cmd_check)


def check_outputs(model, args, remat) -> tuple[dict, dict]:
    """What ``check`` compares, every repeat checkpointed by ``remat`` (None: its own policy):
    loss and gradients, or one optimizer step (``--optimizer``); and the hyperparameter feeds."""
    if optimizer_from_args(args)[0] is None:
        outs = training_outputs(model.loss, model.params, DEFAULT_LR, with_grads=True, remat=remat)
        return {"loss": model.loss, **{f"grad/{k}": outs[f"grad/{k}"] for k in model.params}}, {}
    return train_outputs(model, argparse.Namespace(**{**vars(args), "remat": remat}))


def dense_gradients(model, args) -> dict:
    """The dense program's ``grad/NAME`` of every param: under ``--optimizer`` check compares
    updated params, and where a gradient is rounding noise an update is not compared
    (:func:`~.compare.report_check`)."""
    outs = training_outputs(model.loss, model.params, DEFAULT_LR, with_grads=True)
    return run_dense({f"grad/{k}": outs[f"grad/{k}"] for k in model.params}, model.feeds(args.seed), seed=args.seed)


def run_on_simulated_mesh(plan, feeds, seed: int, device=None, compile=False) -> tuple[dict[str, torch.Tensor], dict | None]:
    """The executor of ``check``: every rank of the mesh simulated in this process, its
    values on ``device`` (default the CPU), its local steps compiled with ``compile``
    (``--compile``: a backend's name; the time it took is printed).

    Returns:
      The full outputs, and for a pipelined plan its per-stage figures
      (:func:`~.pipe_report.run_figures`; None without a pipeline).  The simulated
      mesh runs every stage in this process, one action at a time, in the unit-cost
      simulation's order: those timings are that order's, not a parallel run's, so
      its bubble says how the actions interleave, not how fast a real pipeline is
      (``meshdsl run`` measures that).
    """
    summary = schedule_summary(plan)
    ex = Executor(plan, SimulatedComm(plan.mesh, device=device), compile=compile)
    out = ex.full_outputs(ex.run(feeds, ex.init_params(seed)))
    if ex.compiling is not None:
        print(f"check: --compile: {ex.compiling.stats.summary()}", file=sys.stderr, flush=True)
    if summary is None:
        return out, None
    rows = [[(a.kind, a.microbatch, a.stage, a.peer, t0, t1) for a, t0, t1 in row] for row in ex.last_timeline]
    return out, run_figures(pipeline_program(plan), [rows])


def cmd_check(args) -> int:
    if args.precision != "fp32":
        raise UsageError(message(f"check --precision {args.precision}: check compares with the fp32 dense "
                                 "program.",
                                 rule="check pins exact equivalence, which holds in fp32 only",
                                 fix="drop --precision (use it with plan and run)"))
    distributed = args.nproc is not None or in_torchrun()
    device = local_device(args, "check")   # the dense program it is checked against runs on the CPU
    resolve_auto_layout(args)
    mesh = Mesh.parse(args.mesh)
    if distributed:
        from .dist_cli import preflight_processes
        preflight_processes(args, mesh)
    model = load_configured(args)
    outputs, hyper = check_outputs(model, args, args.remat)
    # With --remat the oracle is the program that saves every activation: remat changes no number.
    dense = outputs if args.remat is None else check_outputs(model, args, "none")[0]
    plan = compile_plan(outputs, mesh, args.layout, microbatches=args.microbatches, schedule=args.schedule,
                        bucket_mb=args.bucket_mb, strict_splits=args.strict_splits,
                        stage_layers=resolve_stage_layers(args, outputs))
    if not distributed:
        check_simulated_memory(plan)
    check_job_memory(args, plan, "check", None if distributed else device)
    say_ignored_options(plan)
    args.preflight_done = True
    feeds = {**model.feeds(args.seed), **hyper}
    want = run_dense(dense, feeds, seed=args.seed)
    grads = None if any(k.startswith("grad/") for k in want) else dense_gradients(model, args)
    compare = functools.partial(report_check, grads=grads, coupled=args.optimizer == "adafactor")
    if distributed:
        from .dist_cli import check_distributed
        return check_distributed(args, want, compare)
    got, figures = run_on_simulated_mesh(plan, feeds, args.seed, device, compile_setting(args))
    user_mesh, user_layout = user_mesh_layout(plan)
    where = f"mesh '{user_mesh}', layout '{user_layout}'" + _pipe_words(args, plan) + remat_words(args)
    if device.type != "cpu":
        where += f", simulated on {device}"
    code = compare(want, got, args.tol, where)
    if figures is not None:
        make_console().print(
            "pipeline on the simulated mesh (every stage in this process, in the unit-cost simulation's order: "
            "timings of that order, not of a parallel run; `meshdsl run` measures one): bubble per stage "
            + ", ".join(f"{b:.0%}" for b in figures["bubble_measured"])
            + f" (theory for a parallel run {figures['bubble_theory']:.0%}); activations held "
            + f"{figures['peak_activations']} (theory {figures['peak_theory']})", highlight=False, soft_wrap=True)
    return code


def remat_words(args) -> str:
    """``, remat full (dense: none)`` when ``--remat`` was given; empty otherwise."""
    return f", remat {args.remat} (dense: none)" if args.remat is not None else ""


def _pipe_words(args, plan) -> str:
    """``, 4 micro-batches, schedule 1f1b`` for a pipelined or micro-batched run; empty otherwise."""
    words = f", {args.microbatches} micro-batches" if args.microbatches > 1 else ""
    return words + (f", schedule {args.schedule}" if schedule_summary(plan) is not None else "")


# ----------------------------------------------------------------------------- main

SUBCOMMANDS = [add_plan, add_check, add_run, add_train, add_export, add_generate, add_eval, add_calibrate,
               add_search]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="meshdsl", description="Compile and check named-tensor models on a device mesh.",
                    epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    parser.commands = sub.choices   # name -> the command's parser (for _unrecognized)
    return parser


def _unrecognized(parser, args, extra: list[str]) -> None:
    """An argument no flag of the command takes: the command's own error line (``meshdsl plan:
    error: ...``, its ``--help``), with the closest flag for a misspelt one."""
    command = parser.commands.get(getattr(args, "command", None), parser)
    names = [o[2:] for a in command._actions for o in a.option_strings if o.startswith("--")]
    typo = next((x.split("=")[0][2:] for x in extra if x.startswith("--")), None)
    hint = did_you_mean(typo, names).replace(" '", " '--") if typo else ""   # by name: '--mesh' is no '--measure'
    command.error(f"unrecognized arguments: {' '.join(extra)}.{hint}")


def _say(args, text: str) -> None:
    """Print to stderr; under torchrun, errors found before the job joined print on rank 0 only."""
    if in_torchrun() and not getattr(args, "preflight_done", False) and not is_rank0():
        return
    if in_torchrun() and getattr(args, "preflight_done", False):
        text = f"[rank {os.environ.get('RANK')}] {text}"
    print(text, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``meshdsl`` console script and ``python -m meshdsl``.

    Returns the exit code (see the module docstring).  Under torchrun the
    process ends here: it leaves the process group and calls ``os._exit`` with
    the code, so no C++ destructor runs beside a live gloo thread.
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        _unrecognized(parser, args, extra)
    try:
        tune_malloc()  # this process is meshdsl's: keep its steps' memory (processes/malloc.py)
        code = args.run(args)
    except RankInternalError as e:  # a rank's bug: its traceback is in the message
        _say(args, f"meshdsl {args.command}: internal error, please report it with the command line and this "
                   f"traceback:\n{e}")
        code = EXIT_INTERNAL
    except MeshDSLError as e:
        _say(args, f"meshdsl {args.command}: error: {e}")
        code = EXIT_USAGE
    except BrokenPipeError:  # the reader went away (``meshdsl plan --json | head``): nothing left to say
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not fail again
        code = 0
    except KeyboardInterrupt:
        n = getattr(args, "num_procs", None)
        _say(args, f"meshdsl {args.command}: interrupted" +
             (f"; all {n} ranks stopped" if n else ""))
        code = EXIT_INTERRUPTED
    except Exception:  # noqa: BLE001 - anything else is a bug of ours, shown in full
        _say(args, f"meshdsl {args.command}: internal error, please report it with the command "
                   f"line and this traceback:\n{traceback.format_exc()}")
        code = EXIT_INTERNAL
    if in_torchrun():
        _end_torchrun_rank(args, code)
    return code


# Under torchrun the agent stops every rank as soon as one exits.  A rank other than 0
# that found a user error before the ranks met waits this long (rank 0 finds the same
# error and prints it), so the agent's stop cannot cut rank 0 off before it printed.
RANK0_GRACE_S = 5.0


def _wait_for_rank0(code: int) -> None:
    """Give rank 0 :data:`RANK0_GRACE_S` to print, then exit with ``code`` (also on SIGTERM)."""
    import signal
    import time

    signal.signal(signal.SIGTERM, lambda *_: os._exit(code))  # the agent's stop: still ``code``
    time.sleep(RANK0_GRACE_S)
    os._exit(code)


def _end_torchrun_rank(args, code: int) -> None:
    import torch.distributed as dist

    if code == EXIT_USAGE and not is_rank0() and not getattr(args, "preflight_done", False):
        _wait_for_rank0(code)
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized():
        dist.destroy_process_group()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
