"""What every ``meshdsl`` subcommand shares: exit codes, the console, and the flags of a model run.

The subcommands' modules (:mod:`.cli`, :mod:`.dist_cli`, :mod:`.train_cli`,
:mod:`.search_cli`, :mod:`.compare`) import these from here, so none of them
imports another subcommand's module for a helper.

Exit codes (also in ``--help``): :data:`EXIT_OK` 0, :data:`EXIT_MISMATCH` 1
(``check`` found a difference, nothing else), :data:`EXIT_USAGE` 2 (a user
error, one clean message, no traceback), :data:`EXIT_INTERNAL` 3 (a bug in
meshdsl: "internal error, please report" and the traceback),
:data:`EXIT_INTERRUPTED` 130 (Ctrl-C; every rank stopped).
"""
from __future__ import annotations

import argparse
import shutil

from ..errors import did_you_mean
from ..lowering.schedule import ScheduleError
from ..lowering.schedule_gen import SCHEDULES, parse_schedule
from ..train.model import load_model
from .optim_args import add_optimizer_args
from .preflight import SEED_MAX, float_in, int_in
from .stage_args import stage_layers_arg
from .train_run import config_overrides

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

EXIT_CODES = """exit codes:
  0    success
  1    `check` found an output over tolerance (only `check` returns 1)
  2    user error: bad flag, mesh, layout, model file, feed, data or checkpoint, also when a rank
       raised it; a rank that died or hung (one message, no traceback)
  3    internal error in meshdsl, also in a rank (printed with its traceback; please report it)
  130  interrupted (Ctrl-C); every rank was stopped"""

#: Schedules a plan can run: one stage per rank of the pipeline axis, or ``interleaved:V`` and
#: ``interleaved-zb:V`` (V stages per rank).
PIPE_SCHEDULES = tuple(f"{n}:V" if g.chunked else n for n, g in SCHEDULES.items())


def schedule_arg(text: str) -> str:
    """``--schedule``: a schedule's name, or ``interleaved:V`` / ``interleaved-zb:V`` (V virtual stages per rank)."""
    try:
        parse_schedule(text)
    except ScheduleError:
        name = text.partition(":")[0]
        why = ("" if name not in SCHEDULES else f", {name} runs V >= 1 virtual stages per rank: write {name}:V"
               if SCHEDULES[name].chunked else f", {name} has no virtual stages")
        close = "" if why else did_you_mean(text, [s.replace(":V", "") for s in PIPE_SCHEDULES])
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r}{why} (choose from "
                                         f"{', '.join(map(repr, PIPE_SCHEDULES))})" + (f".{close}" if close else ""))
    return text


def make_console():
    """A rich console as wide as the terminal (160 columns when printing to a pipe or a file)."""
    from rich.console import Console

    # Pipes get a wide console rather than rich's 80 columns, so rows stay on one line; no ":name:" emoji codes.
    return Console(width=shutil.get_terminal_size((160, 24)).columns, emoji=False)  # "interleaved:V:" is text


def model_args(p: argparse.ArgumentParser) -> None:
    """Arguments every model subcommand shares: MODEL, --mesh, --layout, --tiny, --config."""
    p.add_argument("model", metavar="MODEL",
                   help="the name of a model shipped with meshdsl (e.g. 'transformer'), or a path "
                        "to a model .py file (e.g. ./my_model.py); a bare name never runs a file "
                        "from the current directory")
    p.add_argument("--mesh", required=True, help='mesh axes and sizes, e.g. "data:2; model:2"; "auto" with '
                                                 '--layout auto: the search picks it')
    p.add_argument("--layout", default="",
                   help='layout rules, e.g. "batch:data; heads:model; params.d_model:data"; "auto": the best '
                        'layout `meshdsl search` finds (printed)')
    p.add_argument("--tiny", action="store_true", help="build the model's Config.tiny() (for quick checks)")
    p.add_argument("--config", default="", metavar="K=V,...",
                   help="override fields of the model's Config, e.g. d_model=128,layers=8,seq=128")
    strict_splits_arg(p)


def strict_splits_arg(p) -> None:
    """``--strict-splits``: refuse a dim its mesh axes do not divide instead of splitting it unevenly."""
    p.add_argument("--strict-splits", action="store_true",
                   help="refuse a layout that splits a dim over mesh axes that do not divide it (by default "
                        "it is split unevenly, the first size %% n parts one longer; `plan` notes each)")


def load_configured(args):
    """Load ``args.model`` with ``--tiny`` and ``--config`` (parsed into ``args.config_overrides``)."""
    args.config_overrides = config_overrides(args.model, args.config or "")
    return load_model(args.model, tiny=args.tiny, **args.config_overrides)


def lr_arg(p, default: float, precision: bool = True) -> None:
    """``--lr`` (default ``default``) and the optimizer flags (:mod:`.optim_args`; ``precision``:
    ``--precision`` among them)."""
    p.add_argument("--lr", type=float_in(fix="pass a finite learning rate, e.g. --lr 0.1"),
                   default=default, help=f"learning rate (default {default:g})")
    add_optimizer_args(p, precision)


def pipe_args(p) -> None:
    """``--microbatches`` and ``--schedule``: how a pipelined layout (``layer:<axis>``) runs."""
    p.add_argument("--microbatches", type=int_in(1, fix="pass a micro-batch count, e.g. --microbatches 4"),
                   default=1, help="cut the batch into M micro-batches and accumulate their gradients; "
                                   "a pipeline ('layer:<axis>' in --layout) runs them through its stages "
                                   "(default 1)")
    p.add_argument("--schedule", type=schedule_arg, default="gpipe", metavar="{" + ",".join(PIPE_SCHEDULES) + "}",
                   help="pipeline schedule: gpipe (every forward, then every backward), 1f1b (same "
                        "bubble, at most p activations held per stage) or zbh1 (1f1b with each "
                        "backward's weight gradients delayed into the bubble, at most p held) or "
                        "interleaved:V (1f1b over V chunks of layers per rank: rank r runs chunks r, r+p, ...; "
                        "bubble (p-1)/(V m+p-1)) or interleaved-zb:V (interleaved:V split as zbh1: a rank runs "
                        "its last weight gradients after its last backward where simulation says the step gets "
                        "shorter; no rank holds more than interleaved's rank 0) (default gpipe)")
    stage_layers_arg(p)


def _remat_policy(text: str) -> str:
    from ..errors import MeshDSLError
    from ..ir.remat import parse_remat
    try:
        return parse_remat(text, "--remat").text
    except MeshDSLError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--remat: ")) from None


def remat_arg(p, more: str = "") -> None:
    """``--remat``: what each layer of a repeat saves for its backward (:mod:`meshdsl.ir.remat`);
    ``more`` ends its help (what the command does with it)."""
    p.add_argument("--remat", type=_remat_policy, default=None, metavar="POLICY",
                   help="activation checkpointing of every repeat: none (save what the backward reads), full "
                        "(save each layer's input, recompute the layer in the backward), selective (save "
                        "einsum outputs, recompute attention and the cheap ops) or save:OP,OP (default: "
                        "the model's own, none)" + more)


#: ``--compile-backend`` choices: meshdsl.runtime.compiled.BACKENDS (named here: building the parser loads no torch)
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


def compile_arg(p) -> None:
    """``--compile`` (and ``--compile-backend``): each rank's local steps compiled, as one traced graph
    in one process (:mod:`meshdsl.runtime.whole`) or as segments (:mod:`meshdsl.runtime.compiled`)."""
    p.add_argument("--compile", action="store_true",
                   help="compile each rank's local steps: in one process the whole step as one graph, "
                        "otherwise segments between collectives (a loop's body once for all its layers); "
                        "the first step compiles and its time is printed; what the compiler rejects runs "
                        "eagerly, with a notice")
    p.add_argument("--compile-backend", choices=COMPILE_BACKENDS, default="inductor",
                   help="with --compile: the torch.compile backend (default inductor; aot_eager traces "
                        "without generating code, for debugging)")


def compile_setting(args):
    """What ``Executor(compile=...)`` gets from the flags: False, or the backend's name."""
    return args.compile_backend if getattr(args, "compile", False) else False


def seed_arg(p) -> None:
    """``--seed`` of the synthetic data and the param init."""
    p.add_argument("--seed", type=int_in(0, SEED_MAX, fix="pass a seed such as --seed 0"), default=0,
                   help="seed of the synthetic data and the param init (0 .. 2**63-1)")
