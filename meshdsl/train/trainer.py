"""The training loop: data, steps, eval, checkpoints and run outputs, on one rank or many.

:func:`fit` is the Python API (``md.fit``); ``meshdsl train`` calls it too.
Each rank runs :func:`run_rank`: it builds the model, the step
(:func:`build_step`), its own rows of each batch (:mod:`.feeder`), restores a
checkpoint when resuming (any mesh, layout or process count: the load
reshards), and loops over the steps; rank 0 writes ``--out`` (:mod:`.run_outputs`).

The optimizer and everything a checkpoint holds live in two functions only,
:func:`build_step` and :func:`train_state`.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import MeshDSLError, message
from ..exec.executor import Executor
from ..exec.fold import for_plan
from ..exec.simulated import SimulatedComm
from ..layout.mesh import Mesh
from ..lowering.bucket import DEFAULT_BUCKET_MB
from ..lowering.compiler import compile as compile_plan
from .checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, read_metadata, save_checkpoint
from .config import config_dict
from .data import TokenData
from .feeder import IDS, LABELS, CallableFeeder, TokenFeeder
from .model import Model, load_model
from .step import TrainStep

#: Prompts of samples.txt for the default corpus (Python source).
PYTHON_PROMPTS = ("def ", "class ", "import ")


class TrainingError(MeshDSLError):
    """Training cannot go on: the loss became NaN or infinite."""


@dataclass
class TrainSpec:
    """Everything a rank needs to train (picklable, so spawned ranks get it whole).

    ``model`` is a shipped model's name or a path; ``config`` holds Config overrides.
    ``data`` is a text file's path, or None for the default corpus.
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
    seed: int = 0
    data: str | None = None
    microbatches: int = 1
    schedule: str = "gpipe"
    precision: str = "fp32"
    bucket_mb: float = DEFAULT_BUCKET_MB
    checkpoint: str | None = None
    save_every: int = 0
    keep: int | None = None
    resume: bool = False
    eval_every: int = 0
    eval_batches: int = 4
    out: str | None = None
    samples: int = 3
    sample_tokens: int = 200
    progress: bool = False


@dataclass
class TrainResult:
    """What a run did: per-step metrics, final numbers, and (in-process) the trained step."""

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
    step: TrainStep | None = None
    model: Model | None = None


# ----------------------------------------------------------------- optimizer and state

def lr_at(spec: TrainSpec, t: int) -> float:
    """The learning rate of 1-based step ``t``: constant, or with ``warmup_steps`` a linear
    warmup then a cosine decay to a tenth of ``lr`` at the last step."""
    if spec.warmup_steps is None:
        return spec.lr
    from .lr_schedule import cosine_schedule
    return cosine_schedule(spec.lr, spec.warmup_steps, spec.steps, spec.lr / 10)(t - 1)


def build_step(model: Model, spec: TrainSpec, comm) -> TrainStep:
    """The compiled training step of ``model`` with ``spec``'s optimizer on ``comm``'s ranks.

    Plain SGD at a constant rate, with nothing else asked, keeps the fused gradient-update
    kernel; anything else builds ``spec.optimizer`` (its learning rate fed each step).
    """
    from .optimizers import OPTIMIZERS

    plain = spec.optimizer == "sgd" and not spec.optimizer_args and spec.clip_norm is None \
        and spec.warmup_steps is None
    opt = None if plain else OPTIMIZERS[spec.optimizer](lr=spec.lr, **spec.optimizer_args)
    return TrainStep(model.loss, model.params, spec.mesh, spec.layout, comm, optimizer=opt,
                     clip_norm=spec.clip_norm, lr=spec.lr, seed=spec.seed, microbatches=spec.microbatches,
                     schedule=spec.schedule, precision=spec.precision,
                     bucket_mb=spec.bucket_mb)


def run_step(step: TrainStep, feeds: dict, spec: TrainSpec, t: int):
    """Step ``t`` (1-based): ``(loss, StepStats, lr, grad_norm or None)``."""
    lr = lr_at(spec, t)
    loss, stats = step(feeds, timed=True, lr=lr if step.optimizer is not None else None)
    return loss, stats, lr, step.grad_norm


def train_state(step: TrainStep) -> dict:
    """Everything a checkpoint holds: ``{name: (Value spec, [local tensor per held rank])}``:
    the params, the optimizer state and its step counter (:meth:`TrainStep.state`)."""
    return step.state()


def load_train_state(step: TrainStep, path: Path, model_id: str) -> None:
    """Restore :func:`train_state` from checkpoint ``path``, resharded to this step's mesh and layout."""
    want = {k: spec for k, (spec, _) in train_state(step).items()}
    step.load_state(load_checkpoint(path, want, step.plan.mesh, step.executor.comm.ranks, model=model_id))


# ----------------------------------------------------------------- resume checks

def model_id(model: Model) -> str:
    """The id a checkpoint records: the model graph's name."""
    return model.graph.name


def resume_from(spec: TrainSpec, model: Model) -> Path | None:
    """The checkpoint to resume from, after checking it is this model's (None when not resuming).

    Raises:
      CheckpointError: no checkpoint to resume from, or it belongs to another model or Config.
    """
    if not spec.resume:
        return None
    root = spec.checkpoint
    path = latest_checkpoint(root) if root else None
    if path is None:
        raise CheckpointError(message(
            f"--resume: no committed checkpoint in {root!r}." if root else "--resume needs --checkpoint DIR.",
            rule="--resume continues from the latest checkpoint in --checkpoint DIR",
            fix="drop --resume to start afresh, or pass the folder a run saved into with --checkpoint"))
    info = read_metadata(path)
    saved, now = info.meta.get("config"), config_dict(model.config)
    diff = [f"{k}: saved {saved.get(k)!r}, now {v!r}" for k, v in (now or {}).items()
            if saved is not None and saved.get(k) != v]
    if info.model != model_id(model) or diff:
        raise CheckpointError(message(
            f"--resume: checkpoint {str(path)!r} is of another model.",
            inputs=[f"saved model: {info.model!r}, this model: {model_id(model)!r}"], bullets=diff,
            rule="a run resumes from a checkpoint of the same model and Config",
            fix="resume with the model and --config it was saved with, or use another --checkpoint folder"))
    if info.step >= spec.steps:
        raise CheckpointError(message(
            f"--resume: the checkpoint is at step {info.step}, and --steps is {spec.steps}.",
            rule="--steps is the run's total step count: resuming at step N runs steps N+1..S",
            fix=f"pass --steps greater than {info.step}"))
    return path


# ----------------------------------------------------------------- the loop

def _eval_fn(model: Model, step: TrainStep, spec: TrainSpec, comm):
    """A function ``feeds_list -> mean eval loss`` over the step's current params."""
    plan = compile_plan({"loss": model.loss}, spec.mesh, spec.layout, microbatches=spec.microbatches,
                        schedule=spec.schedule)
    ex = Executor(plan, for_plan(comm, plan))
    same = all(plan.values[v].sharding == step.plan.values[step.plan.params[k]].sharding for k, v in plan.params.items())

    def evaluate(feeds_list) -> float | None:
        params = step.params
        if not same:  # the forward plan shards a param otherwise: hand it its own slices
            full = step.full_params()
            params = {k: ex.local_slices(plan.values[plan.params[k]], full[k]) for k in plan.params}
        losses = []
        for feeds in feeds_list:
            held = [x for x in ex.run(feeds, params)["loss"] if x is not None]
            losses.append(float(held[0]) if held else float("nan"))
        return _agree_loss(comm, plan, statistics.fmean(losses)) if losses else None

    return evaluate


def _agree_loss(comm, plan, loss: float) -> float:
    """A pipeline holds the loss on its last stage: every rank takes that one."""
    if plan.outputs["loss"] not in plan.holders or len(getattr(comm, "ranks", ())) == comm.mesh.size:
        return loss
    for text in comm.agree(repr(loss)):
        if text != "nan":
            return float(text)
    return loss


def _progress(spec: TrainSpec, total: int, start: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    p = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[info]}"),
                 TimeElapsedColumn(), transient=False)
    p.start()
    return p, p.add_task("train", total=total, completed=start, info="")


def reads_text(model: Model) -> bool:
    """True when the model reads token ids and next-token labels (``ids`` and ``labels``)."""
    names = {n.name for n in model.graph.nodes if n.op.name == "input"}
    return {IDS, LABELS} <= names


def make_feeder(model: Model, step: TrainStep, spec: TrainSpec, data=None, eval_data=None):
    """``(TokenData or None, feeder)`` for the run.

    ``data`` None: the text of ``spec.data`` (default corpus) for a model that reads
    ``ids``/``labels``; any other model (given no text file) trains on its own
    ``make_feeds``, one seed per step, and evaluates on a seed no step uses.
    """
    if data is None and spec.data is None and not reads_text(model):
        fn = _OwnFeeds(model, spec.seed)
        return None, CallableFeeder(fn, [model.feeds(fn.eval_seed)])
    tokens = data if isinstance(data, TokenData) else None
    if data is None:
        tokens = TokenData.load(spec.data, seed=spec.seed)
    if tokens is not None:
        vocab = getattr(model.config, "vocab", None)
        return tokens, TokenFeeder(tokens, step.plan, step.executor.comm.ranks, vocab)
    return None, CallableFeeder(data, eval_data)


class _OwnFeeds:
    """A model's own synthetic batches, ``make_feeds(seed + step)``; eval on a seed steps never reach."""

    def __init__(self, model: Model, seed: int):
        self.model, self.seed, self.eval_seed = model, seed, 2**62 + seed

    def __call__(self, step: int) -> dict:
        return self.model.feeds(self.seed + step)


def run_rank(comm, spec: TrainSpec, model: Model | None = None, data=None, eval_data=None) -> TrainResult | None:
    """Train on this process's ranks of ``comm``; rank 0 returns the :class:`TrainResult`.

    Args:
      comm: the communicator (SimulatedComm for every rank in one process, or a TorchComm).
      spec: the run.
      model: a built model (else ``spec.model`` is loaded with ``spec.config``).
      data: a :class:`TokenData`, a function ``step -> feeds``, or None (``spec.data`` as text).
      eval_data: with a function ``data``, a list of eval feeds.
    """
    from .run_outputs import MetricsWriter, plot_loss, write_config, write_samples

    if model is None:
        model = load_model(spec.model, tiny=spec.tiny, **spec.config)
    step = build_step(model, spec, comm)
    if not isinstance(comm, SimulatedComm):
        from .jobs import agree_plan
        agree_plan(comm, step.plan)
    tokens, feeder = make_feeder(model, step, spec, data, eval_data)
    start = 0
    path = resume_from(spec, model)
    if path is not None:
        info = read_metadata(path)
        start = tokens.check_state(info.meta["data"]) if tokens is not None else info.step
        load_train_state(step, path, model_id(model))
    lead = 0 in step.executor.comm.ranks
    out = Path(spec.out) if spec.out and lead else None
    writer = MetricsWriter(out) if out else None
    evaluate = _eval_fn(model, step, spec, comm)
    eval_feeds = feeder.eval(spec.eval_batches)
    bar = _progress(spec, spec.steps, start) if spec.progress and lead else None
    rows = []
    try:
        for t in range(start + 1, spec.steps + 1):
            t0 = time.perf_counter()
            loss, stats, lr, gnorm = run_step(step, feeder.train(t), spec, t)
            loss = _agree_loss(comm, step.plan, loss)
            if not math.isfinite(loss):
                raise TrainingError(message(
                    f"train: the loss is {loss} at step {t}: training diverged.",
                    inputs=[f"optimizer {spec.optimizer}, lr {spec.lr:g}", f"mesh '{spec.mesh}', layout '{spec.layout}'"],
                    rule="each step's loss is finite", fix=f"lower the learning rate, e.g. --lr {spec.lr / 4:g}"))
            ms = (time.perf_counter() - t0) * 1e3
            tps = feeder.tokens_per_step / ms * 1e3 if feeder.tokens_per_step else None
            row = {"step": t, "loss": loss, "lr": lr, "grad_norm": gnorm, "tokens_per_s": tps, "ms": ms,
                   "comm_ms": stats.comm * 1e3}
            if eval_feeds and ((spec.eval_every and t % spec.eval_every == 0) or t == spec.steps):
                row["eval_loss"] = evaluate(eval_feeds)
            if spec.checkpoint and ((spec.save_every and t % spec.save_every == 0) or t == spec.steps):
                meta = {"mesh": spec.mesh, "layout": spec.layout, "config": config_dict(model.config),
                        "data": tokens.state(t) if tokens is not None else {"step": t}, "lr": spec.lr,
                        "optimizer": spec.optimizer, "optimizer_args": spec.optimizer_args}
                save_checkpoint(spec.checkpoint, t, train_state(step), step.executor.comm, model=model_id(model),
                                meta=meta, keep=spec.keep)
            rows.append(row)
            if writer:
                writer.write(row)
            if bar:
                info = f"loss {loss:.4f}" + (f"  {tps:,.0f} tok/s" if tps else "") + \
                    f"  comm {stats.comm * 1e3:.1f} ms" + (f"  eval {row['eval_loss']:.4f}"
                                                           if row.get("eval_loss") is not None else "")
                bar[0].update(bar[1], completed=t, info=info)
    finally:
        if bar:
            bar[0].stop()
        if writer:
            writer.close()
    prompts = list(PYTHON_PROMPTS if tokens is not None and tokens.source == "stdlib" else [""] * 3)
    prompts = prompts[:spec.samples]
    texts = []
    if prompts and model.logits is not None:
        full = step.full_params()  # a collective: every rank takes part
        if lead:
            from .generate import generate_many
            texts = generate_many(model, full, prompts, spec.sample_tokens, seed=spec.seed)
    if not lead:
        return None
    last = [r["loss"] for r in rows[-10:]]
    evals = [r["eval_loss"] for r in rows if r.get("eval_loss") is not None]
    times = [r["tokens_per_s"] for r in rows[1:] or rows if r["tokens_per_s"]]
    res = TrainResult(rows=rows, start_step=start, final_loss=statistics.fmean(last) if last else float("nan"),
                      final_eval_loss=evals[-1] if evals else None,
                      unigram_entropy=tokens.unigram_entropy() if tokens is not None else None,
                      tokens_per_s=statistics.median(times) if times else None,
                      comm_ms_per_step=statistics.median(r["comm_ms"] for r in rows) if rows else 0.0,
                      collectives_per_step=step.plan.totals(),
                      samples=texts, out=str(out) if out else None)
    if out:
        title = f"{spec.model}: mesh '{spec.mesh}', layout '{spec.layout}'"
        plot_loss(out, rows, title, res.unigram_entropy)
        if texts:
            write_samples(out, prompts, texts)
        write_config(out, {**dataclasses.asdict(spec), "resolved_config": config_dict(model.config),
                           "model_id": model_id(model), "data": tokens.fingerprint() if tokens else None})
    if isinstance(comm, SimulatedComm):
        res.step, res.model = step, model
    return res


def fit(model, *, mesh: str = "data:1", layout: str = "", steps: int = 100, data=None, eval_data=None,
          nproc: int | None = None, device=None, **options) -> TrainResult:
    """Train ``model`` and return a :class:`TrainResult`.

    Args:
      model: a :class:`Model` (trained in this process, every rank of ``mesh`` simulated),
        or a shipped model's name / a model file's path (trained on ``nproc`` processes
        when ``nproc > 1``).
      mesh, layout: e.g. ``"data:2"`` and ``"batch:data"``.
      steps: the total step count (a resumed run continues up to it).
      data: None (the default corpus), a text file's path, a :class:`TokenData`, or a
        function ``step -> {input name: full tensor}`` (the user's own batches).
      eval_data: with a function ``data``, a list of eval feeds.
      nproc: processes for a model given by name or path.
      device: where a run in this process keeps its values (default the CPU; ``"cuda"``).
      options: any other :class:`TrainSpec` field: ``lr``, ``seed``, ``checkpoint``,
        ``save_every``, ``keep``, ``resume``, ``eval_every``, ``out``, ``config``, ``tiny``, ...

    Example::

        result = md.fit(build(Config()), mesh="data:2", layout="batch:data", steps=50,
                          data=lambda step: my_batch(step), lr=0.05, checkpoint="ckpt", save_every=10)
    """
    given = isinstance(model, Model)
    if isinstance(data, (str, Path)):
        options["data"], data = str(data), None
    spec = TrainSpec(model="model" if given else str(model), mesh=str(mesh), layout=layout, steps=steps, **options)
    if given or (nproc or 1) == 1:
        return run_rank(SimulatedComm(Mesh.parse(spec.mesh), device=device), spec, model if given else None, data, eval_data)
    from ..exec.launch import launch
    results = launch(_rank_job, spec.mesh, nproc=nproc, args=(spec, data, eval_data))
    return results[0]


def _rank_job(comm, spec: TrainSpec, data=None, eval_data=None):
    return run_rank(comm, spec, None, data, eval_data)


__all__ = ["TrainingError", "TrainResult", "TrainSpec", "build_step", "load_train_state", "model_id", "resume_from", "run_rank",
           "lr_at", "make_feeder", "reads_text", "run_step", "fit", "train_state"]
