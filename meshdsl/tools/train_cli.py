"""``meshdsl train``: train a model on real text and show that it learned.

With no arguments it trains ``models/transformer.py`` (sized by
:data:`~.train_run.TRAIN_DEFAULTS`) on the default corpus with AdamW, warmup, cosine
decay and clipping (:data:`~.train_run.RECIPES`), with a mesh and layout picked
for this machine (:func:`auto_mesh`).  Everything is validated in this process
first (flags, ``--config``, mesh, model, layout, data, the checkpoint to resume
from); then the job runs in this process (one device) or on N processes
(:func:`meshdsl.processes.launcher.launch`, torchrun-aware).  Rank 0 shows a progress
bar and, at the end, a summary; outputs go to ``--out``.
"""
from __future__ import annotations

import argparse
import dataclasses
import os

from ..core.examples import examples_of
from ..processes.launcher import in_torchrun
from ..layout.mesh import Mesh
from ..lowering.compiler import compile as compile_plan
from ..train.checkpoint import read_metadata
from ..train.data import TokenData
from ..train.feeder import BatchFeeder, TokenFeeder, model_vocab
from ..train.init_weights import check_weights, graph_params, read_weights
from ..train.lr_schedule import SCHEDULES
from ..train.resume import resume_from, resume_spec
from ..train.run_outputs import check_new_out, check_out_dir
from ..train.step import training_outputs
from ..train.trainer import RUN_THREADS, TrainSpec, rank_job, run_rank, torch_threads
from .cli_common import EXIT_CODES, compile_arg, make_console, remat_arg, seed_arg, strict_splits_arg
from .dist_cli import (bucket_arg, check_job_memory, device_arg, dist_args, is_rank0, launch_job, local_device,
                       preflight_processes)
from .optim_args import READERS, add_optimizer_args, check_readers
from .preflight import UsageError, float_in, int_in, plan_bytes
from .search_cli import resolve_auto_layout
from .stage_args import stage_layers_arg, with_stage_layers
from .train_run import (DEFAULT_STEPS, RECIPES, TRAIN_DEFAULTS, asked_spec, check_schedule, config_overrides,
                        describe_optimizer, spelling, step_outputs, train_model)


#: FLOPs of one step above which the auto mesh goes data parallel.  Measured on a 2-core machine
#: (docs/benchmarks.md, "Training runs"): a 2-process gloo allreduce of a step's gradients costs 10-20 ms; the
#: default model (0.8 GFLOP per step, ~35 ms on one core) trained 300 steps in 11-15 s as one
#: one-thread process and in 19-26 s as 2 data-parallel processes.  At 5 GFLOP a step is ~200 ms
#: of compute, so halving it pays for the allreduce many times over.
DP_MIN_FLOPS = 5e9


def auto_mesh(batch: int, flops: float, cores: int | None = None, examples: str = "batch") -> tuple[str, str, str]:
    """``(mesh, layout, why)`` for this machine, for a model whose step costs ``flops`` and whose
    examples' dim ``examples`` (``batch``, or the user's name for it) holds ``batch`` rows.

    A small model trains fastest as one process with one torch thread: its step is
    shorter than the gradient allreduce data parallelism would add.  From
    :data:`DP_MIN_FLOPS` per step on, it goes data parallel over the cores (one
    process per core, the largest power of two up to 8 that divides the batch).
    """
    cores = cores or os.cpu_count() or 1
    n = 1
    while n * 2 <= min(cores, 8) and batch % (n * 2) == 0:
        n *= 2
    if n == 1 or flops < DP_MIN_FLOPS:
        why = (f"{flops / 1e9:.2g} GFLOP per step is below {DP_MIN_FLOPS / 1e9:g}: one process with one "
               f"torch thread beats data parallelism, whose gradient allreduce costs more than the compute "
               f"it saves" if n > 1 else f"{cores} CPU core(s) or a batch of {batch}: one process, one thread")
        return "data:1", "", why
    return (f"data:{n}", f"{examples}:data",
            f"{cores} CPU cores and {flops / 1e9:.2g} GFLOP per step: data parallel, one process per core "
            f"(each computes its own rows; one gradient allreduce per step)")


def checkpoint_args(p) -> None:
    """The flags of checkpoints, resume and a new run's given weights."""
    p.add_argument("--checkpoint", default=None, metavar="DIR", help="save checkpoints into DIR")
    p.add_argument("--save-every", type=int_in(1, fix="e.g. --save-every 50"), default=None,
                   help="save every K steps (and at the end; needs --checkpoint)")
    p.add_argument("--keep", type=int_in(1, fix="e.g. --keep 3"), default=None,
                   help="keep the newest N checkpoints (default: all)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --checkpoint (on any mesh, layout or process "
                        "count) with the run's saved settings; a flag that differs is applied with a line "
                        "saying so, or refused when the saved state cannot continue under it")
    p.add_argument("--resume-from", default=None, metavar="STEP|PATH",
                   help="resume from this checkpoint rather than the latest: a step of --checkpoint, or a "
                        "checkpoint folder's path (implies --resume)")
    p.add_argument("--verify", choices=("sha256", "size"), default="sha256",
                   help="how a resume checks the checkpoint's files before any rank starts: sha256 (default: "
                        "hash every shard) or size (sizes and headers only, the fast path)")
    p.add_argument("--reset-optimizer", action="store_true",
                   help="with --resume: load the params only and start the optimizer (the flags', or a new "
                        "run's) afresh, e.g. another --optimizer")
    p.add_argument("--init", default=None, metavar="PATH", help="start a new run from these weights: a safetensors "
                   "file of full tensors by param name, frozen params too (`meshdsl export` writes one from a "
                   "checkpoint); others keep meshdsl's init; a resume does not read it")


def add_train(sub) -> None:
    p = sub.add_parser("train", help="train MODEL on text and report train/eval loss (default: the "
                                     "transformer on the standard library's source)",
                       description="Train MODEL (default: transformer) on a text corpus (default: this "
                                   "Python's standard library sources, byte-tokenized), or a model that makes "
                                   "its own batches (Model.batches: generated images, ...) on those, for S steps on a "
                                   "mesh, each rank building its own rows, "
                                   "with eval loss, checkpoints and resume, and write metrics.jsonl, loss.png, "
                                   "samples.txt and config.json to --out.",
                       epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL", nargs="?", default="transformer",
                   help="a shipped model's name or a path to a model .py file (default: transformer)")
    p.add_argument("--mesh", default=None, help='mesh, e.g. "data:2; model:2" (default: picked for this '
                                               'machine, printed with the reason; with --nproc N, data:N)')
    p.add_argument("--layout", default=None, help='layout, e.g. "batch:data; d_ff:model"')
    p.add_argument("--tiny", action="store_true", help="start from the model's Config.tiny()")
    strict_splits_arg(p)
    p.add_argument("--config", default="", metavar="K=V,...",
                   help="override Config fields, e.g. d_model=128,layers=8,seq=128 (over the train "
                        f"defaults: {TRAIN_DEFAULTS['transformer']} for the transformer)")
    p.add_argument("--steps", type=int_in(1, fix="e.g. --steps 100"), default=None,
                   help=f"total steps of the run; a resumed run goes on up to it (default {DEFAULT_STEPS})")
    p.add_argument("--batch", type=int_in(1, fix="e.g. --batch 16"), default=None,
                   help="global batch rows (the Config's 'batch' field)")
    p.add_argument("--lr", type=float_in(0.0, lo_open=True, fix="e.g. --lr 0.5"), default=None,
                   help="learning rate, the schedule's peak (default: " + ", ".join(
                       f"{k} {v['lr']:g}" for k, v in RECIPES.items()) + ")")
    add_optimizer_args(p)
    p.add_argument("--warmup-steps", type=int_in(0, fix="e.g. --warmup-steps 100"), default=None,
                   help="linear warmup over this many steps (default: min(100, a tenth of the schedule: "
                        "--decay-steps, else --steps) with AdamW, else 0)")
    p.add_argument("--lr-schedule", choices=SCHEDULES, default=None,
                   help="after the warmup: constant, or a cosine decay to lr/10 at --decay-steps (default: "
                        "cosine with AdamW or --warmup-steps, else constant)")
    p.add_argument("--decay-steps", type=int_in(1, fix="e.g. --decay-steps 1000"), default=None,
                   help="the step where the cosine reaches lr/10 and stays (default: --steps; a resume "
                        "keeps the saved one)")
    p.add_argument("--accum", type=int_in(1, fix="e.g. --accum 4"), default=None,
                   help="gradient accumulation: cut each batch into k micro-batches (same step result)")
    p.add_argument("--microbatches", type=int_in(1, fix="e.g. --microbatches 4"), default=None,
                   help="micro-batches of a pipelined layout (with --schedule)")
    p.add_argument("--schedule", default=None, help="pipeline schedule (default gpipe)")
    stage_layers_arg(p)
    p.add_argument("--data", default=None, metavar="PATH",
                   help="a UTF-8 text file to train on (default: the standard library's .py sources)")
    checkpoint_args(p)
    p.add_argument("--eval-every", type=int_in(1, fix="e.g. --eval-every 50"), default=None,
                   help="eval loss every K steps (default: steps/10; always at the end)")
    p.add_argument("--eval-batches", type=int_in(1, fix="e.g. --eval-batches 8"), default=None,
                   help="batches each eval averages over (default 4; text: at most what the held-out split holds)")
    seed_arg(p)
    p.add_argument("--threads", type=int_in(1, fix="e.g. --threads 2"), default=None,
                   help=f"torch threads of a run in this process (default {RUN_THREADS}, as each spawned rank)")
    p.add_argument("--out", default=None, metavar="DIR", help="output folder (default runs/<timestamp>/)")
    p.add_argument("--samples", type=int_in(0, 3, fix="e.g. --samples 3"), default=3,
                   help="texts generated into samples.txt at the end (0..3, default 3)")
    bucket_arg(p)
    remat_arg(p)
    compile_arg(p)
    dist_args(p)
    device_arg(p, "auto")
    # Unset unless given, so that a resume can tell a flag from a default (train/resume.py).
    p.set_defaults(run=cmd_train, seed=None, precision=None)


def make_spec(args):
    """Validate everything in this process; returns the run's spec, its first printed lines and its plan."""
    if args.accum and args.microbatches:
        raise _usage("--accum and --microbatches both cut the batch", "pass one of them",
                     rule="each batch is cut into micro-batches once; --accum and --microbatches both set that "
                          "count (--microbatches is the name a pipeline's docs use)")
    if args.save_every and not args.checkpoint:
        raise _usage("--save-every needs --checkpoint DIR", "add --checkpoint DIR")
    if args.reset_optimizer and not (args.resume or args.resume_from):
        raise _usage("--reset-optimizer needs --resume", "add --resume, or drop --reset-optimizer")
    if args.out is not None:
        check_out_dir(args.out)
        check_new_out(args.out, bool(args.resume or args.resume_from))
    model, overrides, text = train_model(args)
    spec, given = asked_spec(args, overrides, text)
    path = resume_from(spec, model, spelling(args))     # the checkpoint, checked to be this model's
    spec, notes = resume_spec(spec, path, given, spelling(args))
    check_readers(spec.optimizer, [k for k in READERS if getattr(args, k) is not None])
    check_schedule(spec)
    spec, why = _pick_mesh(args, spec, model)
    mesh = Mesh.parse(spec.mesh)
    preflight_processes(args, mesh)
    auto_stages = getattr(args, "stage_layers", None) == "auto"
    spec = with_stage_layers(args, spec, step_outputs(model, spec))
    plan = compile_plan(step_outputs(model, spec), mesh, spec.layout, microbatches=spec.microbatches,
                        schedule=spec.schedule, bucket_mb=spec.bucket_mb, strict_splits=args.strict_splits,
                        stage_layers=spec.stage_layers)
    in_process = mesh.size == 1 and not in_torchrun()  # as cmd_train runs it
    check_job_memory(args, plan, "train", local_device(args, "train") if in_process else None)
    data = TokenData.load(spec.data, seed=spec.seed) if spec.data is not None or text else None
    if data is not None and path is not None:     # another text: refused here, before any rank starts
        data.check_state(read_metadata(path).meta["data"])
    if data is not None:
        TokenFeeder(data, plan, [0], model_vocab(model), model.config)
    elif model.batches is not None:     # rank 0's rows of step 1: batches that break the protocol stop here
        BatchFeeder(model.batches, plan, [0], spec.seed).train(1)
    nproc = int(os.environ.get("WORLD_SIZE", mesh.size)) if in_torchrun() else (args.nproc or mesh.size)
    size = ", ".join(f"{k}={v}" for k, v in vars(model.config).items()) if model.config is not None else "-"
    lines = [f"meshdsl train {args.model}: mesh '{spec.mesh}', layout '{spec.layout}' on {nproc} process(es)"
             + ("" if why == "given" else f"  [auto: {why}]"),
             f"  config: {size}",
             (f"  data: {data.source} ({len(data.tokens):,} byte tokens, {len(data.eval_tokens):,} held out); "
              f"unigram entropy {data.unigram_entropy():.3f} nats/token" if data is not None else
              _own_data(model, spec)),
             f"  steps {spec.steps}" + (f" (resuming from {path.name})" if path else "")
             + f", {describe_optimizer(spec)}, out {spec.out}"]
    if model.updates:     # frozen params the step sets (an EMA target): say so, they are not trained
        lines.append(f"  updates: {', '.join(model.updates)} (frozen params, set in the step after each update)")
    if spec.stage_layers is not None:     # what auto picked is otherwise in config.json only
        lines.append(f"  layers per stage: {','.join(map(str, spec.stage_layers))}"
                     + (" (--stage-layers auto: the cost model's balance)" if auto_stages else ""))
    return spec, lines + [f"  {line}" for line in notes], plan


def _own_data(model, spec) -> str:
    """The header line of a run on the model's own data."""
    evals = f"eval: {spec.eval_batches} batches of seeds no step uses" + \
        (f", with {', '.join(model.metrics)}" if model.metrics else "")
    if model.batches is not None:
        return f"  data: the model's own batches (seed + step; each rank builds its rows); {evals}"
    return f"  data: the model's own feeds (make_feeds(seed + step)); {evals}"


def _pick_mesh(args, spec, model) -> tuple[TrainSpec, str]:
    """``(spec on its mesh and layout, why)``: given, searched (``--layout auto``) or :func:`auto_mesh`."""
    why = "given"
    if args.layout == "auto":
        search = argparse.Namespace(**{**vars(args), "lr": spec.lr, "optimizer": spec.optimizer,
                                       "precision": spec.precision, "clip_norm": spec.clip_norm,
                                       **{k: spec.optimizer_args.get(k) if spec.optimizer in READERS[k] else None
                                          for k in READERS}})
        resolve_auto_layout(search, default_nproc=None, model=model)
        args.mesh, args.layout, why = search.mesh, search.layout, "searched"
        if search.microbatches != args.microbatches:
            spec = dataclasses.replace(spec, microbatches=search.microbatches, schedule=search.schedule)
    args.auto = args.mesh is None
    examples = examples_of([model.loss]) if args.auto else None   # 'batch', or the user's name for it
    dp = f"{examples.name if examples is not None else 'batch'}:data"
    if args.auto and (args.nproc or 1) > 1 and not in_torchrun():
        # the process count is given: data parallel over it, as under torchrun
        args.mesh, layout = f"data:{args.nproc}", dp
        args.layout = layout if args.layout is None else args.layout
        return dataclasses.replace(spec, mesh=args.mesh, layout=args.layout), \
            f"--nproc {args.nproc} without --mesh: data parallel over the {args.nproc} processes"
    if args.auto:
        nproc = int(os.environ["WORLD_SIZE"]) if in_torchrun() else None
        # Under torchrun the process count is given: go data parallel over it.
        flops = DP_MIN_FLOPS if in_torchrun() else \
            compile_plan(training_outputs(model.loss, model.params, spec.lr), "data:1", "").flops()
        args.mesh, layout, why = auto_mesh(examples.size if examples is not None else 1, flops, nproc,
                                           examples.name if examples is not None else "batch")
        if in_torchrun():
            why = f"torchrun started {nproc} processes: data parallel over them"
        args.layout = layout if args.layout is None else args.layout
    args.layout = args.layout or ""
    return dataclasses.replace(spec, mesh=args.mesh, layout=args.layout), why


def _usage(what: str, fix: str, rule: str | None = None):
    return UsageError(f"{what}." + (f"\nRule: {rule}" if rule else "") + f"\nFix: {fix}")


def with_init(args, spec: TrainSpec, plan) -> tuple[TrainSpec, list[str]]:
    """``spec`` with ``--init``'s file, checked against the plan's params before any rank starts,
    and its header line; a resume does not read it (the checkpoint holds every param)."""
    if args.init is None:
        return spec, []
    params = graph_params(plan)
    if spec.resume or spec.resume_from is not None:
        return spec, [f"  init: {args.init} is not read: a resume loads every param from the checkpoint"]
    given = check_weights(params, read_weights(args.init, "--init"), "--init")
    rest = len(params) - len(given)
    return dataclasses.replace(spec, init=args.init), [
        f"  init: {args.init} ({len(given)} of {len(params)} params" +
        (f"; the other {rest} start from meshdsl's init)" if rest else ")")]


def cmd_train(args) -> int:
    spec, lines, plan = make_spec(args)
    spec, more = with_init(args, spec, plan)
    lines += more
    in_process = Mesh.parse(spec.mesh).size == 1 and not in_torchrun()
    device = local_device(args, "train")
    if in_process and device.type != "cpu":
        import torch
        lines.append(f"  device: {device} ({torch.cuda.get_device_name(device)})")
    args.preflight_done = True
    console = make_console()
    if is_rank0():
        for line in lines:
            console.print(line, highlight=False, markup=False)
    if in_process:
        import torch

        from ..comm.simulated import SimulatedComm
        with torch_threads(args.threads or RUN_THREADS):   # as each spawned rank (see auto_mesh)
            result = run_rank(SimulatedComm(Mesh.parse(spec.mesh), device=device), spec)
    else:
        result = launch_job(args, rank_job, (spec,))[0]
    if result is not None and is_rank0():
        print_summary(console, spec, result, plan_bytes(plan))
    return 0


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def print_summary(console, spec: TrainSpec, r, memory_per_rank: int) -> None:
    """The end-of-run table: losses against the unigram baseline, speed, collectives, memory."""
    from rich.table import Table

    t = Table(title=f"meshdsl train: steps {r.start_step + 1}-{spec.steps}", title_justify="left", show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    unit = " nats/token" if r.unigram_entropy is not None else ""   # a loss on text is per token
    t.add_row(f"final train loss (mean of the last {min(10, len(r.rows))} steps)", f"{r.final_loss:.4f}{unit}")
    if r.final_eval_loss is not None:
        t.add_row(f"final eval loss ({r.eval_data})", f"{r.final_eval_loss:.4f}{unit}")
    for k, v in r.final_eval_metrics.items():
        t.add_row(f"final eval {k}", f"{v:.4f}")
    if r.unigram_entropy is not None:
        t.add_row("unigram (byte-frequency) entropy of the corpus", f"{r.unigram_entropy:.4f} nats/token")
        if r.final_eval_loss is not None:
            gap = r.unigram_entropy - r.final_eval_loss
            t.add_row("eval loss below the unigram entropy by", f"{gap:.4f} nats/token"
                      + (" (learned more than byte frequencies)" if gap > 0 else " (NOT below)"))
    if r.tokens_per_s:
        t.add_row("throughput (median step)", f"{r.tokens_per_s:,.0f} tokens/s")
    colls = ", ".join(f"{k} x{v['count']} ({_bytes(v['bytes'])})" for k, v in r.collectives_per_step.items())
    t.add_row("collectives per step", colls or "none")
    t.add_row("time in collectives per step (median)", f"{r.comm_ms_per_step:.2f} ms")
    t.add_row("memory per rank (plan values, upper bound)", _bytes(memory_per_rank))
    if r.out:
        files = "metrics.jsonl, loss.png" + (", samples.txt" if r.samples else "") + ", config.json"
        t.add_row("outputs", f"{r.out}/{{{files}}}")
    if spec.checkpoint:
        t.add_row("checkpoints", spec.checkpoint)
    console.print(t)
    if r.samples:
        console.print(f"sample: {r.samples[0][:160]!r}", highlight=False)


__all__ = ["TRAIN_DEFAULTS", "add_train", "auto_mesh", "cmd_train", "config_overrides",
           "make_spec", "print_summary", "DP_MIN_FLOPS"]
