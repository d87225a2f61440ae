"""A trained model back from disk: a run's output folder or a checkpoint, as a model and its params.

:func:`load_trained` takes what ``meshdsl train`` (``md.fit``) left: the run's ``--out`` folder
(its ``config.json`` names the model file, its Config and the ``--checkpoint`` folder), a
checkpoint folder (its latest committed step) or one step folder.  It hashes the step's files
(sha256, as a resume does) before reading any tensor, rebuilds the model from the saved Config,
checks that the checkpoint is that model's, and loads every param (frozen ones too) whole, from a
checkpoint saved on any mesh and layout (the load reshards; safetensors only, never a pickle).
``meshdsl generate`` and ``meshdsl eval`` start here.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import MeshDSLError, message
from ..ir.interpret import DenseProgram
from ..layout.sharding import Sharding
from .checkpoint_format import META_FILE, CheckpointError, committed_steps, step_dirs
from .checkpoint_load import load_checkpoint
from .checkpoint_verify import verify_checkpoint
from .config import config_dict, parse_config
from .model import Model, ModelError, find_model_file, load_model, load_module
from .resume import model_id
from .run_outputs import CONFIG_FILE


class TrainedError(MeshDSLError):
    """A path that holds no trained model: no such path, a run that saved no checkpoint, or a
    checkpoint of a model that cannot be rebuilt."""


@dataclass
class Trained:
    """What :func:`load_trained` returns.

    Attributes:
      model: the model rebuilt from the saved Config (``batch`` replaced when asked).
      params: param name -> full tensor (frozen params too), on the CPU.
      path: the checkpoint step folder the params came from.
      step: its training step.
      seed: the run's seed (its eval batches' seeds for a model on its own data).
      data: the saved data fingerprint of a run on text (``source``, ``seed``, ``sha256``, ...), else None.
    """

    model: Model
    params: dict[str, torch.Tensor]
    path: Path
    step: int
    seed: int
    data: dict | None


def _no_path(path: Path, where: str) -> TrainedError:
    return TrainedError(message(
        f"{where}: {str(path)!r} is a file, not a run or checkpoint folder." if path.is_file() else
        f"{where}: no such run or checkpoint {str(path)!r}.",
        rule="a trained model is read from a run's --out folder (with its config.json), a --checkpoint folder "
             "or one of its step folders",
        fix="pass the folder `meshdsl train --out DIR --checkpoint CKPT` wrote, e.g. runs/<stamp> or CKPT"))


def _run_checkpoint(run_dir: Path, run: dict, where: str) -> Path:
    """The checkpoint folder the run of ``run_dir`` (its config.json ``run``) saved into."""
    ckpt = run.get("checkpoint")
    if not ckpt:
        raise TrainedError(message(
            f"{where}: the run {str(run_dir)!r} saved no checkpoint.",
            inputs=[f"{run_dir / CONFIG_FILE}: checkpoint null"],
            rule="only a run trained with --checkpoint DIR (md.fit: checkpoint=) keeps its weights",
            fix="train again with --checkpoint DIR, then pass DIR or the run's folder"))
    candidates = [Path(ckpt)] if Path(ckpt).is_absolute() else [Path(ckpt), run_dir.parent / ckpt, run_dir / ckpt]
    found = next((c for c in candidates if c.is_dir()), None)
    if found is None:
        raise TrainedError(message(
            f"{where}: the checkpoint folder {ckpt!r} of run {str(run_dir)!r} is not there.",
            inputs=[f"looked in: {', '.join(str(c) for c in candidates)}"],
            rule="config.json names the --checkpoint folder as given to train (relative to where it ran)",
            fix=f"run from the folder train ran in, or pass the checkpoint folder itself: {ckpt}"))
    return found


def _step_dir(path: Path, where: str) -> Path:
    """The committed step folder ``path`` names: itself, or a checkpoint folder's latest."""
    if (path / META_FILE).is_file():
        return path
    steps = committed_steps(path)
    if not steps:
        had = step_dirs(path)
        raise TrainedError(message(
            f"{where}: no committed checkpoint in {str(path)!r}.",
            inputs=[f"step folders without {META_FILE} (interrupted saves): {', '.join(p.name for _, p in had)}"]
            if had else [],
            rule=f"a checkpoint is a step folder with its {META_FILE} (a run's --checkpoint DIR holds them)",
            fix="pass a run's --out folder, its --checkpoint folder, or one of its step-N folders"))
    return steps[-1][1]


def _rebuild(name: str | None, saved_model: str | None, config: dict, overrides, tiny: bool,
             batch: int | None, where: str) -> tuple[Model, dict]:
    """(the model of file ``name`` (default: the shipped model the checkpoint names) with the saved
    ``config`` and ``overrides`` over it, the overrides as a dict: a string parsed as ``--config`` is,
    with its errors; a dict as it is, ``load_model`` checking its keys)."""
    name = name or saved_model
    if batch is not None and "batch" in config:
        config = {**config, "batch": batch}
    try:
        file = find_model_file(name)
    except ModelError:
        raise TrainedError(message(
            f"{where}: the checkpoint is of model {saved_model!r}, which is no shipped model"
            + (f" ({name!r} is no model file either)." if name != saved_model else "."),
            rule="a checkpoint records its model's graph name and Config, not the model file",
            fix="pass the model file it was trained from: --model ./my_model.py (Python: model=)")) from None
    cls = load_module(file).Config
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set(config)
    if set(config) - fields:
        raise CheckpointError(message(
            f"{where}: the checkpoint is of model {saved_model!r}, whose Config does not fit {str(file)!r}.",
            inputs=[f"saved Config fields not in {file.name}'s Config: {', '.join(sorted(set(config) - fields))}"],
            rule="a checkpoint loads into the model it was saved from, rebuilt with the saved Config",
            fix=f"pass the model file of {saved_model!r} with --model (Python: model=)"))
    over = parse_config(overrides, cls) if isinstance(overrides, str) else dict(overrides or {})
    if batch is not None and "batch" in over and over["batch"] != batch:
        raise TrainedError(message(
            f"{where}: batch={batch} and config's batch={over['batch']!r} disagree.",
            rule="the model is rebuilt with one batch size; batch= is a short way to give config's batch",
            fix="give the batch size once: batch= or config's batch"))
    return load_model(name, tiny=tiny, **{**config, **over}), over


def _check_overrides(config, where: str) -> None:
    """``load_trained``'s ``config`` is None, a string or a dict of field names.

    Raises:
      TrainedError: it is something else."""
    if not (config is None or isinstance(config, str)
            or (isinstance(config, dict) and all(isinstance(k, str) for k in config))):
        raise TrainedError(message(
            f"{where}: config={config!r} ({type(config).__name__}) is not Config fields.",
            rule="config= gives Config fields over the saved ones: a dict of field name -> value, or "
                 "'field=value,...' as --config",
            fix="pass e.g. config={'mode': 'eval'} or config='mode=eval'"))


def _full_params(model: Model, path: Path, saved_model: str | None) -> dict[str, torch.Tensor]:
    """Every param the model's loss, logits and state updates read, whole, from checkpoint ``path``
    (checked): the frozen params only ``Model.updates`` touch (batch norm's running statistics, an
    EMA target) are the trained state an eval graph or an export reads."""
    outs = {"loss": model.loss, **({"logits": model.logits} if model.logits is not None else {}),
            **model.metrics, **{f"update/{k}": t for k, t in model.updates.items()}}
    params = DenseProgram(outs).params
    want = {f"param/{k}": (t.shape, t.dtype, Sharding.replicated(t.shape)) for k, t in params.items()}
    got = load_checkpoint(path, want, "data:1", model=saved_model, verify="size", strict=False)
    return {k[len("param/"):]: xs[0] for k, xs in got.items()}


def _params_under_overrides(model: Model, path: Path, saved_model: str | None, over: dict,
                            where: str) -> dict[str, torch.Tensor]:
    """:func:`_full_params`; where Config overrides ``over`` rebuilt the model, a checkpoint that no
    longer fits (a field that shapes params: d_model, layers) is laid at the overrides' door."""
    try:
        return _full_params(model, path, saved_model)
    except CheckpointError as e:
        if not over:
            raise
        raise CheckpointError(message(
            f"{where}: config {over!r} changes the model's params, so checkpoint {str(path)!r} no longer fits.",
            bullets=[line.strip()[2:] for line in str(e).splitlines() if line.strip().startswith("* ")],
            rule="config= (--config) may change only fields that keep every param's name, shape and dtype "
                 "(mode=eval, dropout, batch), as the params are the checkpoint's",
            fix=f"drop {', '.join(sorted(over))} from config= (--config), or train a model with it")) from None


def trained_step_dir(path, where: str = "load_trained") -> Path:
    """The committed step folder ``path`` names: a run's ``--out`` folder (the latest step of the
    ``--checkpoint`` folder its config.json names), a checkpoint folder (its latest) or a step folder.

    Raises:
      TrainedError: no such folder, a run that saved no checkpoint, no committed step there.
    """
    path = Path(path)
    if not path.is_dir():
        raise _no_path(path, where)
    run = json.loads((path / CONFIG_FILE).read_text()) if (path / CONFIG_FILE).is_file() else None
    return _step_dir(_run_checkpoint(path, run, where) if run is not None else path, where)


def load_trained(path, *, model: str | None = None, batch: int | None = None,
                 config: dict | str | None = None, where: str = "load_trained") -> Trained:
    """The model and full params a training run saved (see the module docstring).

    Args:
      path: a run's ``--out`` folder, a ``--checkpoint`` folder (its latest step) or a step folder.
      model: the model file (default: the run's, or the shipped model the checkpoint names).
      batch: rebuild the model with this ``batch`` (e.g. 1 to sample one prompt; the params do not
        depend on it); None keeps the saved one.
      config: Config fields over the saved ones (a dict, or ``"k=v,..."`` as ``--config``), e.g.
        ``{"mode": "eval"}``: the model file's eval graph of the same params (batch norm's running
        statistics); its params must be the checkpoint's.
      where: how errors name the caller.

    Raises:
      TrainedError: no such path, a run without a checkpoint, a model that cannot be rebuilt.
      CheckpointError: a damaged checkpoint, or one of another model (names, shapes, dtypes).
    """
    _check_overrides(config, where)
    path, overrides = Path(path), config
    ckpt = trained_step_dir(path, where)
    run = json.loads((path / CONFIG_FILE).read_text()) if (path / CONFIG_FILE).is_file() else None
    info = verify_checkpoint(ckpt, "sha256")   # every shard file hashed before any tensor is read
    config = info.meta.get("config") or {}
    name = model or (run["model"] if run is not None and run.get("model") != "model" else None)
    built, over = _rebuild(name, info.model, config, overrides, bool(run and run.get("tiny")), batch, where)
    if info.model is not None and info.model != model_id(built):
        raise CheckpointError(message(
            f"{where}: checkpoint {str(ckpt)!r} is of model {info.model!r}, not of {model_id(built)!r}.",
            rule="a checkpoint loads into the model it was saved from",
            fix=f"pass the model file of {info.model!r} with --model (Python: model=)"))
    diff = {k: v for k, v in (config_dict(built.config) or {}).items()
            if k in config and config[k] != v and k != "batch" and k not in over}
    if diff:
        raise CheckpointError(message(
            f"{where}: the model rebuilt from {str(ckpt)!r} has another Config than the saved one.",
            bullets=[f"{k}: saved {config[k]!r}, rebuilt {v!r}" for k, v in diff.items()],
            fix="pass the model file the run was trained with (--model)"))
    params = _params_under_overrides(built, ckpt, info.model, over, where)
    run_settings = info.meta.get("run") or {}
    data = info.meta.get("data") if "source" in (info.meta.get("data") or {}) else None
    return Trained(built, params, info.path, info.step, int(run_settings.get("seed", 0)), data)


__all__ = ["Trained", "TrainedError", "load_trained", "trained_step_dir"]
