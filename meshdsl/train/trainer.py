"""The training loop: data, steps, eval, checkpoints and run outputs, on one rank or many.

:func:`fit` is the Python API (``md.fit``); ``meshdsl train`` calls it too.
Each rank runs :func:`run_rank`: it builds the model, the step
(:func:`build_step`), its own rows of each batch (:mod:`.feeder`), restores a
checkpoint when resuming (any mesh, layout or process count: the load
reshards), and loops over the steps, with eval on held-out batches (the loss and the
model's metrics, :mod:`.evaluate`); rank 0 writes ``--out`` (:mod:`.run_outputs`).

The optimizer and everything a checkpoint holds live in two functions only,
:func:`build_step` and :func:`train_state`; the run's settings a checkpoint keeps, and
what a resume may change of them, in :mod:`.resume`.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import MeshDSLError, message
from ..comm.simulated import SimulatedComm
from ..ir.remat import parse_remat
from ..layout.mesh import Mesh
from ..lowering.bucket import DEFAULT_BUCKET_MB
from ..lowering.compiler import ignored_options
from .checkpoint import load_checkpoint, read_metadata, save_checkpoint
from .config import config_dict
from .evaluate import Evaluator, agree_held
from .feeder import make_feeder, reads_text
from .fit_args import check_fit_arguments
from .lr_schedule import run_schedule
from .model import Model, load_model
from .resume import (RUN_KEYS, model_id, resolve_resume, resume_from, resume_spec, run_settings,
                     saved_run, whose_option)
from .run_outputs import check_new_out
from .step import TrainStep

#: Prompts of samples.txt for the default corpus (Python source).
PYTHON_PROMPTS = ("def ", "class ", "import ")


class TrainingError(MeshDSLError):
    """Training cannot go on: the loss became NaN or infinite."""


@dataclass
class TrainSpec:
    """Everything a rank needs to train (picklable, so spawned ranks get it whole).

    ``model`` is a shipped model's name or a path; ``config`` holds Config overrides.
    ``data`` is a text file's path, or None for the default corpus.  ``lr_schedule`` is
    ``"constant"`` or ``"cosine"`` (None: cosine with ``warmup_steps``, else constant);
    a cosine decays to ``lr / 10`` at ``decay_steps`` (None: ``steps``).
    ``reset_optimizer``: a resume loads the params only (:mod:`.resume`).  ``resume_from``:
    resume from this checkpoint (a step of ``checkpoint``, or a path) rather than the latest;
    ``verify``: ``"sha256"`` or ``"size"``, how its files are checked before use
    (:mod:`.checkpoint_verify`; the process that resolves a resume hashes them once, and hands
    the ranks its path with ``"size"``).  ``init``: a new run starts its params (frozen ones too)
    from these full tensors, a safetensors file's or a dict's (:meth:`TrainStep.set_params`);
    a resume does not read it: the checkpoint holds every param.
    """

    model: str = "transformer"
    tiny: bool = False
    config: dict = field(default_factory=dict)
    mesh: str = "data:1"
    layout: str = ""
    steps: int = 100
    lr: float = 0.1
    optimizer: str = "sgd"
    optimizer_args: dict = field(default_factory=dict)
    clip_norm: float | None = None
    warmup_steps: int | None = None
    lr_schedule: str | None = None
    decay_steps: int | None = None
    seed: int = 0
    data: str | None = None
    microbatches: int = 1
    schedule: str = "gpipe"
    stage_layers: tuple | None = None   # the pipelined repeat's layers per stage (None: equal)
    precision: str = "fp32"
    bucket_mb: float = DEFAULT_BUCKET_MB
    remat: str | None = None    # activation checkpointing of every repeat (meshdsl/ir/remat.py); None: its own
    compile: bool | str = False   # torch.compile each rank's local steps (meshdsl/runtime/compiled.py)
    checkpoint: str | None = None
    save_every: int = 0
    keep: int | None = None
    resume: bool = False
    resume_from: int | str | None = None
    verify: str = "sha256"
    reset_optimizer: bool = False
    init: str | dict | None = None   # a new run's weights: a safetensors file or {param name: full tensor}
    eval_every: int = 0
    eval_batches: int = 4
    out: str | None = None
    samples: int = 3
    sample_tokens: int = 200
    progress: bool = False

    def __post_init__(self):
        if self.lr_schedule is None:
            self.lr_schedule = "constant" if self.warmup_steps is None else "cosine"
        self.warmup_steps = self.warmup_steps or 0


@dataclass
class TrainResult:
    """What a run did: per-step metrics, final numbers, and (in-process) the trained step.

    ``final_eval_metrics``: the model's metrics (``Model.metrics``) at the last eval, by name,
    e.g. ``{"accuracy": 0.97}``; each row with an eval has them as ``eval_<name>``.
    """

    rows: list[dict]
    start_step: int
    final_loss: float
    final_eval_loss: float | None
    unigram_entropy: float | None
    tokens_per_s: float | None
    comm_ms_per_step: float
    collectives_per_step: dict
    samples: list[str]
    out: str | None
    eval_data: str = ""
    step: TrainStep | None = None
    model: Model | None = None
    final_eval_metrics: dict = field(default_factory=dict)


# ----------------------------------------------------------------- optimizer and state

def lr_at(spec: TrainSpec, t: int) -> float:
    """The learning rate of 1-based step ``t`` (:func:`.lr_schedule.run_schedule`)."""
    return run_schedule(spec)(t - 1)


def make_optimizer(spec: TrainSpec):
    """``spec``'s optimizer, or None for plain SGD at a constant rate with nothing else asked
    (momentum, decay, clipping, a schedule), which keeps the fused gradient-update kernel."""
    from .optimizers import OPTIMIZERS

    plain = spec.optimizer == "sgd" and not any(spec.optimizer_args.values()) and spec.clip_norm is None \
        and spec.lr_schedule == "constant" and not spec.warmup_steps
    return None if plain else OPTIMIZERS[spec.optimizer](lr=spec.lr, **spec.optimizer_args)


def build_step(model: Model, spec: TrainSpec, comm) -> TrainStep:
    """The compiled training step of ``model`` with ``spec``'s optimizer (:func:`make_optimizer`;
    its learning rate fed each step) on ``comm``'s ranks."""
    opt = make_optimizer(spec)
    return TrainStep(model.loss, model.params, spec.mesh, spec.layout, comm, optimizer=opt,
                     clip_norm=spec.clip_norm, lr=spec.lr, seed=spec.seed, microbatches=spec.microbatches,
                     schedule=spec.schedule, precision=spec.precision,
                     bucket_mb=spec.bucket_mb, remat=spec.remat, compile=spec.compile,
                     stage_layers=spec.stage_layers, updates=model.updates)


def run_step(step: TrainStep, feeds: dict, spec: TrainSpec, t: int):
    """Step ``t`` (1-based): ``(loss, StepStats, lr, grad_norm or None)``."""
    lr = lr_at(spec, t)
    loss, stats = step(feeds, timed=True, lr=lr if step.optimizer is not None else None)
    return loss, stats, lr, step.grad_norm


def train_state(step: TrainStep) -> dict:
    """Everything a checkpoint holds: ``{name: (Value spec, [local tensor per held rank])}``:
    the params, the optimizer state and its step counter (:meth:`TrainStep.state`)."""
    return step.state()


def load_train_state(step: TrainStep, path: Path, model_id: str, params_only: bool = False) -> None:
    """Restore :func:`train_state` from checkpoint ``path``, resharded to this step's mesh and
    layout (``params_only``: the params; the optimizer keeps its fresh state).  Sizes and headers
    are checked again; the hashes were, once, when the resume chose ``path`` (:mod:`.resume`)."""
    state = train_state(step)
    want = {k: spec for k, (spec, _) in state.items() if not params_only or k.startswith("param/")}
    got = load_checkpoint(path, want, step.plan.mesh, step.executor.comm.ranks, model=model_id,
                          strict=not params_only, verify="size")
    step.load_state({**{k: xs for k, (_, xs) in state.items()}, **got})


# ----------------------------------------------------------------- the loop

def _progress(spec: TrainSpec, total: int, start: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    p = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[info]}"),
                 TimeElapsedColumn(), transient=False)
    p.start()
    return p, p.add_task("train", total=total, completed=start, info="")


def run_rank(comm, spec: TrainSpec, model: Model | None = None, data=None, eval_data=None) -> TrainResult | None:
    """Train on this process's ranks of ``comm``; rank 0 returns the :class:`TrainResult`.

    Args:
      comm: the communicator (SimulatedComm for every rank in one process, or a TorchComm).
      spec: the run.
      model: a built model (else ``spec.model`` is loaded with ``spec.config``).
      data: a :class:`TokenData`, a function ``step -> feeds``, or None (``spec.data`` as text).
      eval_data: with a function ``data``, a list of eval feeds.
    """
    run = _start_run(comm, spec, model, data, eval_data)
    rows = _train_steps(run)
    prompts, texts = _samples(run)
    if not run.lead:
        return None
    res = _result(run, rows, texts, data)
    if run.out:
        _write_outputs(run, rows, res, prompts, texts)
    if isinstance(comm, SimulatedComm):
        res.step, res.model = run.step, run.model
    return res


@dataclass
class _Run:
    """One rank's run as :func:`_start_run` set it up: what each step and the run's end read."""

    spec: TrainSpec          # resolved against the checkpoint it resumes from
    model: Model
    comm: object
    step: TrainStep
    evaluate: Evaluator
    tokens: object           # the TokenData of a run on text, else None
    feeder: object           # this rank's rows of each train and eval batch
    start: int               # the step the run resumes after (0: a new run)
    lead: bool               # this process holds rank 0: it writes, shows progress and returns
    out: Path | None         # the output folder, on the lead process only


def _start_run(comm, spec: TrainSpec, model: Model | None, data, eval_data) -> _Run:
    """Load the model, resolve the resume, build the step and the feeder, restore the checkpoint."""
    if model is None:
        model = load_model(spec.model, tiny=spec.tiny, **spec.config)
    path = resume_from(spec, model)
    if path is not None:   # fit and the CLI resolved the spec; refuse any other that breaks the saved run
        info = read_metadata(path)
        spec = resolve_resume(spec, saved_run(info.meta), None, info.step)[0]
    step = build_step(model, spec, comm)
    if not isinstance(comm, SimulatedComm):
        from .jobs import agree_plan
        agree_plan(comm, step.plan)
    evaluate = Evaluator(model, step, spec, comm)
    tokens, feeder = make_feeder(model, step, spec, data, eval_data, evaluate.plan)
    start = 0
    lead = 0 in step.executor.comm.ranks
    for note in ignored_options(step.plan) if lead else ():   # as `meshdsl plan` notes them
        print(f"note: {whose_option(note, spec, saved_run(info.meta)) if path is not None else note}", flush=True)
    if path is not None:
        start = tokens.check_state(info.meta["data"]) if tokens is not None else info.step
        load_train_state(step, path, model_id(model), params_only=spec.reset_optimizer)
        if spec.init is not None and lead:
            print(f"resume: the weights of init= are not read: checkpoint step {info.step} holds every param "
                  f"(frozen ones too)", flush=True)
    elif spec.init is not None:
        step.set_params(spec.init)
    out = Path(spec.out) if spec.out and lead else None
    return _Run(spec, model, comm, step, evaluate, tokens, feeder, start, lead, out)


def _train_steps(run: _Run) -> list[dict]:
    """Steps ``start + 1 .. spec.steps``: one metrics row each, written to metrics.jsonl and
    shown on the progress bar by the lead process."""
    from .run_outputs import MetricsWriter

    spec = run.spec
    writer = MetricsWriter(run.out) if run.out else None
    eval_feeds = run.feeder.eval(spec.eval_batches)
    bar = _progress(spec, spec.steps, run.start) if spec.progress and run.lead else None
    rows = []
    try:
        for t in range(run.start + 1, spec.steps + 1):
            row = _train_step(run, t, eval_feeds)
            rows.append(row)
            if writer:
                writer.write(row)
            if bar:
                bar[0].update(bar[1], completed=t, info=_progress_info(row, run.model))
    finally:
        if bar:
            bar[0].stop()
        if writer:
            writer.close()
    return rows


def _train_step(run: _Run, t: int, eval_feeds) -> dict:
    """Step ``t``, its eval and its checkpoint when due; returns its metrics row."""
    spec, step = run.spec, run.step
    t0 = time.perf_counter()
    loss, stats, lr, gnorm = run_step(step, run.feeder.train(t), spec, t)
    loss = agree_held(run.comm, step.plan, {"loss": loss})["loss"]
    if not math.isfinite(loss):
        raise TrainingError(message(
            f"train: the loss is {loss} at step {t}: training diverged.",
            inputs=[f"optimizer {spec.optimizer}, lr {spec.lr:g}", f"mesh '{spec.mesh}', layout '{spec.layout}'"],
            rule="each step's loss is finite", fix=f"lower the learning rate, e.g. --lr {spec.lr / 4:g}"))
    ms = (time.perf_counter() - t0) * 1e3
    if t == run.start + 1 and step.executor.compiling is not None and run.lead:
        print(f"train: --compile: {step.executor.compiling.stats.summary()} (step {t} took {ms / 1e3:.1f} s)",
              file=sys.stderr, flush=True)
    tps = run.feeder.tokens_per_step / ms * 1e3 if run.feeder.tokens_per_step else None
    row = {"step": t, "loss": loss, "lr": lr, "grad_norm": gnorm, "tokens_per_s": tps, "ms": ms,
           "comm_ms": stats.comm * 1e3}
    if eval_feeds and ((spec.eval_every and t % spec.eval_every == 0) or t == spec.steps):
        row.update({f"eval_{k}": v for k, v in run.evaluate(eval_feeds).items()})
    if spec.checkpoint and ((spec.save_every and t % spec.save_every == 0) or t == spec.steps):
        meta = {"mesh": spec.mesh, "layout": spec.layout, "config": config_dict(run.model.config),
                "data": run.tokens.state(t) if run.tokens is not None else {"step": t}, "run": run_settings(spec)}
        save_checkpoint(spec.checkpoint, t, train_state(step), step.executor.comm, model=model_id(run.model),
                        meta=meta, keep=spec.keep, mesh=str(Mesh.parse(spec.mesh)))
    return row


def _progress_info(row: dict, model: Model) -> str:
    """The progress bar's text after a step: loss, speed, communication and the last eval."""
    tps = row["tokens_per_s"]
    metrics = [f"eval_{k}" for k in model.metrics]
    return f"loss {row['loss']:.4f}" + (f"  {tps:,.0f} tok/s" if tps else "") + \
        f"  comm {row['comm_ms']:.1f} ms" + "".join(f"  {'eval' if k == 'eval_loss' else k[5:]} "
                                                    f"{row[k]:.4f}" for k in ["eval_loss", *metrics] if k in row)


def _samples(run: _Run) -> tuple[list[str], list[str]]:
    """``(prompts, texts)`` of samples.txt: texts generated on the lead process (empty elsewhere).
    Every process takes part in gathering the params."""
    prompts = list(PYTHON_PROMPTS if run.tokens is not None and run.tokens.source == "stdlib" else [""] * 3)
    prompts = prompts[:run.spec.samples]
    texts = []
    from .generate import generate_many, samplable
    # (a model with logits trained on its own data, e.g. a vocab of its own or logits that also
    # read a source sentence, has no text to sample: none, rather than an error after its training)
    if prompts and samplable(run.model):
        full = run.step.full_params(frozen=True)  # a collective: every rank takes part
        if run.lead:
            texts = generate_many(run.model, full, prompts, run.spec.sample_tokens, seed=run.spec.seed)
    return prompts, texts


def _result(run: _Run, rows: list[dict], texts: list[str], data) -> TrainResult:
    """The run's :class:`TrainResult` from its rows (the final loss: the mean of the last 10)."""
    metrics = [f"eval_{k}" for k in run.model.metrics]
    tokens = run.tokens
    last = [r["loss"] for r in rows[-10:]]
    evals = [r for r in rows if r.get("eval_loss") is not None]
    times = [r["tokens_per_s"] for r in rows[1:] or rows if r["tokens_per_s"]]
    return TrainResult(rows=rows, start_step=run.start, final_loss=statistics.fmean(last) if last else float("nan"),
                       final_eval_loss=evals[-1]["eval_loss"] if evals else None,
                       final_eval_metrics={k[5:]: evals[-1][k] for k in metrics} if evals else {},
                       unigram_entropy=tokens.unigram_entropy() if tokens is not None else None,
                       tokens_per_s=statistics.median(times) if times else None,
                       comm_ms_per_step=statistics.median(r["comm_ms"] for r in rows) if rows else 0.0,
                       collectives_per_step=run.step.plan.totals(),
                       samples=texts, out=str(run.out) if run.out else None,
                       eval_data="held-out text" if tokens is not None else "the eval_data given" if data else
                       f"the model's own {'batches' if run.model.batches else 'feeds'}, seeds no step uses")


def _write_outputs(run: _Run, rows: list[dict], res: TrainResult, prompts: list[str], texts: list[str]) -> None:
    """loss.png, samples.txt and config.json into the output folder (metrics.jsonl is written per step)."""
    from .run_outputs import plot_loss, write_config, write_samples

    spec, tokens = run.spec, run.tokens
    title = f"{spec.model}: mesh '{spec.mesh}', layout '{spec.layout}'"
    plot_loss(run.out, rows, title, res.unigram_entropy)
    if texts:
        write_samples(run.out, prompts, texts)
    given = f"{len(spec.init)} tensors given" if isinstance(spec.init, dict) else \
        None if spec.init is None else str(spec.init)
    write_config(run.out, {**dataclasses.asdict(dataclasses.replace(spec, init=None)), "init": given,
                           "resolved_config": config_dict(run.model.config),
                           "model_id": model_id(run.model), "data": tokens.fingerprint() if tokens else None})


def fit(model, *, mesh: str = "data:1", layout: str = "", steps: int | None = None, data=None, eval_data=None,
        nproc: int | None = None, device=None, threads: int | None = None, backend: str = "auto",
        timeout: float | None = None, job_timeout: float | None = None, **options) -> TrainResult:
    """Train ``model`` and return a :class:`TrainResult`.

    Args:
      model: a :class:`Model` (trained in this process, every rank of ``mesh`` simulated),
        or a shipped model's name / a model file's path (trained on ``nproc`` processes
        when ``nproc > 1``).
      mesh, layout: e.g. ``"data:2"`` and ``"batch:data"``.
      steps: the run's total step count (default 100; a resumed run continues up to it).
      data: None, a text file's path, a :class:`TokenData`, or a function
        ``step -> {input name: full tensor}`` (the user's own batches).  None: a model with
        ``batches`` trains on them (each rank builds its own rows; eval on seeds no step
        reads, with the model's ``metrics``), one that reads ``ids``/``labels`` on the
        default corpus, any other on its ``make_feeds`` (:mod:`.feeder`).
      eval_data: with a function ``data``, a list of eval feeds.
      nproc: processes for a model given by name or path.
      device: where a run in this process keeps its values (default the CPU; ``"cuda"``).
      threads: torch threads of a run in this process (default 1, as each spawned rank and
        ``meshdsl train`` have; the count before is restored at the end).
      backend, timeout, job_timeout: a run on ``nproc`` processes' torch.distributed backend
        (``"auto"``: nccl with CUDA, else gloo), the seconds a collective may take (default 60)
        and the seconds the whole job may take (default 300, :func:`meshdsl.launch`'s), as the
        CLI's ``--backend``, ``--timeout`` and ``--job-timeout``.
      options: any other :class:`TrainSpec` field: ``lr``, ``seed``, ``checkpoint``,
        ``save_every``, ``keep``, ``resume``, ``eval_every``, ``out``, ``config``, ``tiny``,
        ``init`` (a new run's starting weights: a safetensors path or ``{name: full tensor}``,
        frozen params too; :meth:`TrainStep.set_params`), ...
        With ``resume=True`` every run setting not given (``steps`` included) is the
        checkpoint's, and a given one that differs is applied with a printed line or
        refused (:mod:`.resume`; ``reset_optimizer=True`` starts the optimizer afresh).
        ``resume_from=STEP`` or a checkpoint's path resumes from that one; ``verify="size"``
        skips hashing the checkpoint's files (checked before any rank starts).

    Raises:
      ResumeError: a resume asks for a setting the saved run cannot continue under.

    Example::

        result = md.fit(build(Config()), mesh="data:2", layout="batch:data", steps=50,
                          data=lambda step: my_batch(step), lr=0.05, checkpoint="ckpt", save_every=10)
    """
    spawn = {"backend": backend, "timeout": timeout, "job_timeout": job_timeout}
    check_fit_arguments(TrainSpec, model, steps, data, options, eval_data, mesh, layout, nproc, spawn)
    own = isinstance(model, Model)
    if isinstance(data, (str, Path)):
        options["data"], data = str(data), None
    given = {k for k in RUN_KEYS if k in options} | ({"steps"} if steps is not None else set())
    spec = TrainSpec(model="model" if own else str(model), mesh=str(mesh), layout=layout,
                     steps=100 if steps is None else steps, **options)
    # The model first (a bad file or override: one message, here), so that a checkpoint of another
    # model is refused before any line on how its settings would resume.
    built = model if own else load_model(spec.model, tiny=spec.tiny, **spec.config)
    spec, lines = resume_spec(spec, resume_from(spec, built), given)
    if spec.out:
        check_new_out(spec.out, spec.resume or spec.resume_from is not None, "out")
    lr_at(spec, 1)    # a bad schedule fails here, not in a rank
    parse_remat(spec.remat, "fit(remat=...)")    # and so does a bad remat policy
    in_process = own or (nproc or 1) == 1
    if in_process:
        n = RUN_THREADS if threads is None else threads
        lines.append(f"md.fit: {n} torch thread(s) in this process " + (
            f"(threads={threads})" if threads is not None else "(as each spawned rank; threads=N sets another)"))
    for line in lines:
        print(line, flush=True)
    if not in_process:
        from ..processes.launcher import launch
        given = {k: v for k, v in (("timeout", job_timeout), ("collective_timeout", timeout)) if v is not None}
        return launch(rank_job, spec.mesh, nproc=nproc, args=(spec, data, eval_data), backend=backend, **given)[0]
    with torch_threads(n):
        return run_rank(SimulatedComm(Mesh.parse(spec.mesh), device=device), spec, built, data, eval_data)


#: Torch threads of a run in this process: one, as each spawned rank has (processes/launcher.py)
#: and ``meshdsl train`` sets.  Measured under load (issue 36): md.fit's median step with
#: torch's default threads ranged 24-574 ms over three runs, against 23 ms with one.
RUN_THREADS = 1


@contextmanager
def torch_threads(n: int):
    """Run the block with ``n`` torch threads, then restore the count before."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def rank_job(comm, spec: TrainSpec, data=None, eval_data=None):
    """One spawned rank's job: :func:`run_rank` with the model loaded from ``spec`` in the rank."""
    return run_rank(comm, spec, None, data, eval_data)


__all__ = ["RUN_THREADS", "TrainingError", "TrainResult", "TrainSpec", "build_step", "fit", "load_train_state", "lr_at",
           "make_feeder", "make_optimizer", "model_id", "rank_job", "reads_text", "resume_from", "run_rank", "run_step",
           "torch_threads", "train_state"]
