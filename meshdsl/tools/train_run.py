"""What the flags of ``meshdsl train`` ask for, before a resume resolves it.

:func:`train_model` builds the model (a shipped model at its train size,
:data:`TRAIN_DEFAULTS`; byte-token defaults only for a model that trains on text);
:func:`asked_spec` makes the run the flags give, with a new run's defaults for the
rest (:data:`RECIPES`: AdamW with warmup, cosine decay and clipping for a model that
trains on text or is in :data:`ADAMW_MODELS`), and names the settings given, which a resume keeps
(:mod:`meshdsl.train.resume`); :func:`spelling` writes a setting as its flag.
"""
from __future__ import annotations

import dataclasses
import os
import time

from ..train.config import parse_config
from ..train.feeder import model_vocab
from ..train.generate import vocab_field
from ..train.model import find_model_file, load_model, load_module
from ..train.resume import fmt_setting
from ..train.step import step_outputs as build_step_outputs
from ..train.trainer import TrainSpec, make_optimizer, reads_text
from .optim_args import READERS
from .preflight import UsageError

#: Config defaults of ``meshdsl train`` per shipped model (``--config`` overrides them): a
#: transformer that learns the default corpus's byte statistics within the default steps, and
#: an MoE of the same width (4 experts of d_ff 128) that does too, in about a minute on one core;
#: a llama of the same width (2 key/value heads of 2 query heads, SwiGLU's d_ff 2/3 of 4 * 64 rounded
#: up to 192): eval loss 1.93 against the unigram entropy's 3.13, 71 s on a loaded 2-core machine.
TRAIN_DEFAULTS = {"transformer": "d_model=64,heads=4,d_head=16,d_ff=256,layers=2,seq=32,batch=32",
                  "moe": "d_model=64,heads=4,d_head=16,d_ff=128,layers=2,seq=32,batch=32,experts=4",
                  "llama": "d_model=64,kv_heads=2,group=2,d_head=16,d_ff=192,layers=2,seq=32,batch=32"}
DEFAULT_STEPS = 1200

#: A new run's optimizer settings where no flag sets them.  A model that trains on text gets AdamW
#: with nanoGPT's recipe (a linear warmup over min(100, steps/10) steps, a cosine decay to lr/10,
#: the global gradient norm clipped at 1).  The default run, measured beside SGD at lr 1 (the old
#: default) in the same wall time, ended at an eval loss of 1.94 against 2.32; lr 3e-3, 6e-3, 0.01
#: and 0.02 ended at 2.00, 1.96, 1.94, 1.97 (docs/benchmarks.md, training runs).  Other models get plain SGD.
#: ``--optimizer`` picks the row.  A shipped model in :data:`ADAMW_MODELS` gets AdamW too, text or not.
RECIPES = {"adamw": {"lr": 1e-2, "lr_schedule": "cosine", "warmup_steps": 100, "clip_norm": 1.0},
           "sgd": {"lr": 1.0, "lr_schedule": "constant", "warmup_steps": 0, "clip_norm": None},
           "adafactor": {"lr": 1e-2, "lr_schedule": "constant", "warmup_steps": 0, "clip_norm": None}}
#: Shipped models that train on their own data with AdamW's recipe: the ViT diverges under plain
#: SGD at lr 1 (loss nan at step 18), and reaches eval accuracy 0.92 in the default steps with AdamW.
ADAMW_MODELS = frozenset({"vit"})


def config_overrides(model: str, text: str, base: str = "") -> dict:
    """``--config`` parsed against the model file's Config (``base`` first, ``text`` over it)."""
    cls = load_module(find_model_file(model)).Config
    return {**parse_config(base, cls), **parse_config(text, cls)}


def train_model(args):
    """``(model, Config overrides, trains on text)``: the model with the train defaults of a shipped
    model (:data:`TRAIN_DEFAULTS`), ``--config`` and ``--batch`` over them; a model that trains on
    text (it reads ``ids``/``labels``, or ``--data`` is given) gets ``vocab=256`` (byte tokens)
    unless ``--config`` sets it.  Text defaults never touch another model's Config."""
    overrides = config_overrides(args.model, args.config, "" if args.tiny else TRAIN_DEFAULTS.get(args.model, ""))
    if args.batch is not None:
        overrides["batch"] = args.batch
    model = load_model(args.model, tiny=args.tiny, **overrides)
    text = args.data is not None or reads_text(model)
    vocab = model_vocab(model)
    field = vocab_field(model.config, vocab) if vocab is not None else "vocab"
    known = dataclasses.is_dataclass(model.config) and field in {f.name for f in dataclasses.fields(model.config)}
    if text and known and field not in overrides and vocab != 256:
        overrides[field] = 256
        model = load_model(args.model, tiny=args.tiny, **overrides)
    return model, overrides, text


def asked_spec(args, overrides: dict, text: bool) -> tuple[TrainSpec, set]:
    """The run the flags ask for, and the names of the settings they give (a resume takes the
    others from the checkpoint); :data:`RECIPES` and a new run's defaults fill the rest."""
    opt_args = {k: getattr(args, k) for k in READERS if getattr(args, k) is not None}
    name = args.optimizer or ("adamw" if "betas" in opt_args else "sgd" if "momentum" in opt_args else
                              "adamw" if text or args.model in ADAMW_MODELS else "sgd")
    recipe, steps = RECIPES[name], args.steps or DEFAULT_STEPS
    # the warmup is a tenth of the schedule's length, not of this run's: a 20-step schedule
    # stopped at 10 (--steps 10 --decay-steps 20) warms up as the uninterrupted --steps 20 run
    length = args.decay_steps if args.decay_steps is not None else steps
    flags = {"optimizer": args.optimizer, "lr": args.lr, "lr_schedule": args.lr_schedule,
             "warmup_steps": args.warmup_steps, "decay_steps": args.decay_steps, "clip_norm": args.clip_norm,
             "precision": args.precision, "microbatches": args.accum or args.microbatches,
             "schedule": args.schedule, "seed": args.seed, "data": args.data, "steps": args.steps,
             "save_every": args.save_every, "keep": args.keep, "eval_every": args.eval_every,
             "eval_batches": args.eval_batches}
    new_run = {**recipe, "optimizer": name, "warmup_steps": min(recipe["warmup_steps"], length // 10),
               "lr_schedule": "cosine" if args.warmup_steps is not None else recipe["lr_schedule"],
               "decay_steps": None, "precision": "fp32", "microbatches": 1, "schedule": "gpipe", "seed": 0,
               "data": None, "steps": steps, "save_every": 0, "keep": None, "eval_every": max(1, steps // 10),
               "eval_batches": TrainSpec.eval_batches}
    given = {k for k, v in flags.items() if v is not None}
    run = {k: flags[k] if k in given else new_run[k] for k in flags}
    run["clip_norm"] = run["clip_norm"] or None     # --clip-norm 0: no clipping
    spec = TrainSpec(model=args.model, tiny=args.tiny, config=overrides, mesh=args.mesh or "data:1",
                     layout=args.layout or "", optimizer_args=opt_args, bucket_mb=args.bucket_mb, remat=args.remat,
                     compile=args.compile_backend if args.compile else False,   # as cli_common.compile_setting
                     checkpoint=args.checkpoint, resume=args.resume, reset_optimizer=args.reset_optimizer,
                     resume_from=args.resume_from, verify=args.verify,
                     out=args.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S")),
                     samples=args.samples, progress=True, **run)
    return spec, given


def spelling(args):
    """How a resume's lines and errors name a setting: as the flag that sets it."""
    def spell(key: str, value) -> str:
        if key in ("reset_optimizer", "resume"):
            return "--" + key.replace("_", "-")
        if key == "config" and isinstance(value, dict):
            return "--config " + ",".join(f"{k}={v}" for k, v in value.items())
        if key == "clip_norm" and value is None:
            return "--clip-norm 0"
        flag = "--microbatches" if key == "microbatches" and args.microbatches else \
            "--accum" if key == "microbatches" else "--" + key.replace("_", "-")
        return f"{flag} {fmt_setting(value)}"
    return spell


def check_schedule(spec) -> None:
    end = spec.decay_steps if spec.decay_steps is not None else spec.steps
    if spec.warmup_steps > end:
        what = "--decay-steps" if spec.decay_steps is not None else "--steps"
        raise UsageError(f"--warmup-steps {spec.warmup_steps} is more than {what} {end}.\n"
                         "Fix: warm up over fewer steps than the schedule has")


def describe_optimizer(spec) -> str:
    """``adamw lr 0.01 (warmup 100, cosine to 0.001 at step 1200, clip 1)``, for the header."""
    end = spec.decay_steps if spec.decay_steps is not None else spec.steps
    parts = ([f"warmup {spec.warmup_steps}"] if spec.warmup_steps else []) + \
        ([f"cosine to {spec.lr / 10:g} at step {end}"] if spec.lr_schedule == "cosine" else []) + \
        [f"{k} {fmt_setting(v)}" for k, v in spec.optimizer_args.items() if k in READERS] + \
        ([f"clip {spec.clip_norm:g}"] if spec.clip_norm else [])
    return f"{spec.optimizer} lr {spec.lr:g}" + (f" ({', '.join(parts)})" if parts else "")


def step_outputs(model, spec) -> dict:
    """The outputs of the training step ``spec`` runs (as :func:`meshdsl.train.trainer.build_step`)."""
    from ..ir.precision import mixed_precision

    opt, loss = make_optimizer(spec), mixed_precision(model.loss, spec.precision)
    return build_step_outputs(loss, model.params, spec.lr, opt, spec.clip_norm is not None, spec.remat,
                              updates=model.updates)


__all__ = ["ADAMW_MODELS", "DEFAULT_STEPS", "RECIPES", "TRAIN_DEFAULTS", "asked_spec", "check_schedule",
           "config_overrides", "describe_optimizer", "spelling", "step_outputs", "train_model"]
