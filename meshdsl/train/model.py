"""The model protocol and how model files are found, imported and built.

A model file is plain Python, nanoGPT-style, that exposes two names:

* ``Config``: a dataclass of sizes, with a ``tiny()`` classmethod giving a
  config small enough for tests;
* ``build(cfg) -> Model``: builds the graph and returns a :class:`Model`, which makes its
  inputs whole (``make_feeds(seed)``) or by rows (``batches(seed, rows)``: each rank builds its own).

:func:`load_model` accepts a *path* to such a file (``./my_model.py``,
``path/to/model.py``) or the *name* of a model shipped with meshdsl
(``transformer``).  A bare name never looks in the current directory: running
``meshdsl plan mlp`` in a folder that has its own ``models/mlp.py`` must not
execute that file.  Problems with a user's file (missing, a directory, a
syntax error, an exception while importing or building it) are
:class:`ModelError`\\ s that name the file and the line.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..core.graph import Graph, Tensor
from ..errors import MeshDSLError, did_you_mean, message
from .param_keys import check_params
from .state_updates import check_updates, with_running
from .step import step_outputs

DEFAULT_LR = 0.1
_USER_FRAMES = 3  # frames of the user's file shown for an exception raised inside it


class ModelError(MeshDSLError):
    """A model file cannot be found, imported or built, or does not follow the protocol."""


@dataclass(eq=False)
class Model:
    """A built model: what the tools need to compile, run, check and train it.

    Attributes:
      graph: the graph the model was built in.
      loss: the scalar training loss.
      params: param name -> param Tensor (the trainable state), each keyed by its own name
        (``md.param(NAME, ...)``): ``g.params()`` for every param of graph ``g``, or
        ``{p.name: p for p in [w1, w2]}``; a param left out is frozen.
      make_feeds: ``seed -> {input name: torch.Tensor}``, whole inputs of the right shapes
        and dtypes, deterministic in ``seed``.  Give it or ``batches``.
      config: the Config the model was built from.
      outputs: other tensors the model exposes by name, outside the loss (``models/moe.py``:
        its balance loss and dropped-token counts); compile them with the loss to read them.
      logits: optional next-token logits ``[batch, seq, vocab]`` (dims named ``vocab`` last
        among them), for a language model; :func:`meshdsl.generate` samples text from it.
        ``None`` (the default) for a model that is not one.
      batches: the model's own data, built by rows (instead of ``make_feeds``):
        ``batches(seed, rows) -> {input name: torch.Tensor}``, where ``rows`` is
        ``slice(start, stop)`` of the ``batch`` dim, or None for every row.  Each input with
        a ``batch`` dim comes back with those rows only, any other input whole.  It must be a
        pure function: rows ``a:b`` of ``batches(s, rows)`` are rows ``a:b`` of
        ``batches(s, None)``, in any process (:func:`meshdsl.train.data.row_generator` gives
        each row its own random stream).  Training (``md.fit``, ``meshdsl train``) then asks
        each rank for its own rows of the layout's split of ``batch``: step ``t`` of a run
        with seed ``s`` reads seed ``s + t``, eval batch ``b`` seed ``2**62 + s + b``, which
        no step reaches (:mod:`meshdsl.train.feeder`).  ``feeds(seed)`` is ``batches(seed, None)``.
      metrics: scalar tensors the eval reports beside the loss, by name (``{"accuracy": acc}``):
        each is computed on every eval batch, averaged over them, and written as
        ``eval_<name>`` in the run's rows and its summary.
      updates: non-gradient state updates, part of the compiled step: frozen param name (an
        ``md.param`` left out of ``params``) -> a tensor of its dims computed from this step's
        params (before the optimizer's update) and frozen params; after each step the param
        takes its value.  An EMA target network (MoCo, BYOL, DINO):
        ``updates={"k_w": m * k_w + (1 - m) * q_w}``.  Training saves and resumes them, and
        eval and export read them like any param.

    Raises:
      ModelError: a params key that is not its param's name, or a value that is no param of
        ``graph`` (the param would stay frozen, silently); neither ``make_feeds`` nor ``batches`` is given, or both; a metric is not
        a scalar tensor or is named ``loss``; an update whose key is no frozen param (a name
        of no param, or a trained one) or whose tensor has other dims or dtype than the param.

    Example::

        def batches(seed, rows=None):
            idx = range(cfg.batch)[rows or slice(None)]
            gens = [md.row_generator(seed, r) for r in idx]     # row r's numbers depend on (seed, r) only
            return {"x": torch.stack([torch.randn(cfg.d, generator=g) for g in gens]), ...}

        return md.Model(g, loss, params, batches=batches, config=cfg, metrics={"accuracy": acc})
    """

    graph: Graph
    loss: Tensor
    params: dict[str, Tensor]
    make_feeds: Callable[[int], dict[str, torch.Tensor]] | None = None
    config: Any = None
    outputs: dict[str, Tensor] = field(default_factory=dict)
    logits: Tensor | None = None
    batches: Callable[[int, "slice | None"], dict[str, torch.Tensor]] | None = None
    metrics: dict[str, Tensor] = field(default_factory=dict)
    updates: dict[str, Tensor] = field(default_factory=dict)

    def __post_init__(self):
        if (self.make_feeds is None) == (self.batches is None):
            both = self.make_feeds is not None
            raise ModelError(message(
                f"Model: {'both make_feeds and batches are' if both else 'neither make_feeds nor batches is'} given.",
                rule="a model makes its inputs one way: make_feeds(seed) (whole inputs) or batches(seed, rows) "
                     "(the rows of the batch dim asked for, so each rank builds only its own)",
                fix="keep batches and drop make_feeds (feeds(seed) is batches(seed, None))" if both else
                    "pass make_feeds=lambda seed: {...} or batches=lambda seed, rows: {...}"))
        bad = [f"{k}: {t!r}" if isinstance(t, Tensor) else f"{k}: a {type(t).__name__}, not a Tensor"
               for k, t in self.metrics.items() if not isinstance(t, Tensor) or len(t.shape) or k == "loss"]
        if bad:
            raise ModelError(message("Model: metrics must be scalar tensors, not named 'loss'.",
                                     bullets=bad, rule="a metric is one number per eval batch, like the loss",
                                     fix="reduce it to a scalar, e.g. md.reduce_mean(correct), and name it "
                                         "e.g. 'accuracy'"))
        self.params = check_params(self.params, self.graph, "Model", ModelError)
        updates = with_running(self.loss, self.params, self.updates, "Model", ModelError)
        self.updates = check_updates(updates, self.params, self.graph, "Model", ModelError)

    def feeds(self, seed: int = 0) -> dict[str, torch.Tensor]:
        """Whole inputs, deterministic in ``seed``: ``make_feeds(seed)`` or ``batches(seed, None)``."""
        return self.make_feeds(seed) if self.make_feeds is not None else self.batches(seed, None)

    def train_step(self, lr: float = DEFAULT_LR) -> dict[str, Tensor]:
        """Outputs of one SGD step: ``loss``, ``grad/NAME`` and ``new/NAME`` for every param, and
        ``new/NAME`` of each frozen param in ``updates`` (the step ``md.fit`` trains).

        Built once per ``lr`` (see :func:`meshdsl.train.step.step_outputs`).
        """
        return step_outputs(self.loss, self.params, lr, with_grads=True, updates=self.updates)

    def grads(self) -> dict[str, Tensor]:
        """Gradient of the loss w.r.t. every param, by param name."""
        outs = self.train_step()
        return {k: outs[f"grad/{k}"] for k in self.params}


def shipped_models_dir() -> Path:
    """The folder of the models shipped with meshdsl (the ``meshdsl.models`` package).

    An installed meshdsl has them as ``meshdsl.models``; a source checkout run
    with ``PYTHONPATH`` has them in the repository's top-level ``models/``.
    """
    try:
        spec = importlib.util.find_spec("meshdsl.models")
    except ModuleNotFoundError:
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(__file__).resolve().parents[2] / "models"


def shipped_models() -> list[str]:
    """Names of the shipped models, e.g. ``['mlp', 'moe', 'transformer']``."""
    d = shipped_models_dir()
    return sorted(x.stem for x in d.glob("*.py") if not x.stem.startswith("_")) if d.is_dir() else []


_RULE = ("MODEL is the name of a shipped model (looked up in meshdsl's own models only) or a path "
         "to a .py file (./my_model.py); a file runs only when given as a path")


def find_model_file(name_or_path: str) -> Path:
    """Resolve a model path or a shipped model's name to a file.

    Args:
      name_or_path: ``"transformer"`` (shipped) or ``"./models/mlp.py"`` (a file).

    Raises:
      ModelError: no such file or shipped model, or the path is a directory.
    """
    p = Path(name_or_path)
    known = shipped_models()
    if p.is_dir() and name_or_path not in known:
        py = sorted(x.name for x in p.glob("*.py") if not x.name.startswith("_"))[:6]
        raise ModelError(message(
            f"model path '{name_or_path}' is a directory, not a model file.",
            inputs=[f"python files in it: {', '.join(py) or '(none)'}"], rule=_RULE,
            fix=f"pass one file, e.g. {p / py[0] if py else 'path/to/model.py'}"))
    if p.suffix == ".py" or "/" in name_or_path or name_or_path.startswith("."):
        if p.is_file():
            return p.resolve()
        raise ModelError(message(f"model file '{name_or_path}' does not exist.", rule=_RULE,
                                 fix="check the path"))
    f = shipped_models_dir() / f"{name_or_path}.py"
    if name_or_path in known and f.is_file():
        return f.resolve()
    hint = ""
    if Path(f"{name_or_path}.py").is_file() or Path("models", f"{name_or_path}.py").is_file():
        local = f"./{name_or_path}.py" if Path(f"{name_or_path}.py").is_file() else \
            f"./models/{name_or_path}.py"
        hint = f"; to run your own file, pass its path: {local}"
    raise ModelError(message(
        f"no model named '{name_or_path}'.{did_you_mean(name_or_path, known)}",
        inputs=[f"shipped models: {', '.join(known) or '(none)'}"], rule=_RULE,
        fix=f"pass one of the names above or a path such as ./my_model.py{hint}"))


def _user_frames(exc: BaseException, path: Path) -> str:
    """The last few traceback frames that lie in ``path`` (the user's file), formatted."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename) == path]
    return "".join(traceback.format_list(frames[-_USER_FRAMES:])).rstrip()


def _raised_in(path: Path, exc: BaseException, during: str) -> ModelError:
    frames = _user_frames(exc, path)
    where = f"model file '{path}' raised {type(exc).__name__} while {during}: {exc}"
    return ModelError(message(where, inputs=frames.splitlines() if frames else None,
                              fix="fix the model file at the line shown"))


def load_module(path: Path):
    """Import the model file at ``path`` as a fresh module.

    Raises:
      ModelError: the file has a syntax error, raises while importing, or lacks
        ``Config`` or ``build``.
    """
    path = Path(path).resolve()
    name = f"meshdsl_model_{path.stem}_{abs(hash(str(path))) & 0xFFFFFF:06x}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelError(message(f"cannot import model file '{path}'.", rule=_RULE,
                                 fix="give a .py file"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        del sys.modules[name]
        line = (e.text or "").rstrip("\n")
        col = max(0, (e.offset or 1) - 1)
        raise ModelError(message(
            f"model file '{e.filename or path}', line {e.lineno}: {type(e).__name__}: {e.msg}",
            source=line if line else None, span=col if line else None,
            fix="fix the syntax at the line shown")) from None
    except MeshDSLError:
        del sys.modules[name]
        raise
    except Exception as e:  # noqa: BLE001 - any error in the user's file is the user's to fix
        del sys.modules[name]
        raise _raised_in(path, e, "being imported") from None
    for attr in ("Config", "build"):
        if not hasattr(module, attr):
            del sys.modules[name]
            raise ModelError(message(f"model file '{path}' has no '{attr}'.",
                                     rule="a model file defines a Config dataclass and build(cfg) -> Model",
                                     fix=f"add '{attr}' (see models/mlp.py for the smallest example)"))
    return module


def _check_overrides(module, path, overrides: dict) -> None:
    """An override that is no field of the file's Config is the caller's mistake, not the file's."""
    config = getattr(module, "Config", None)
    if not overrides or config is None or not dataclasses.is_dataclass(config):
        return      # a file without a dataclass Config fails in building, where it is reported
    fields = [f.name for f in dataclasses.fields(config)]
    unknown = [k for k in overrides if k not in fields]
    if unknown:
        raise ModelError(message(
            f"load_model: {config.__name__} of '{path}' has no field '{unknown[0]}'.{did_you_mean(unknown[0], fields)}",
            inputs=[f"overrides: {', '.join(f'{k}={v!r}' for k, v in overrides.items())}",
                    f"fields: {', '.join(fields)}"],
            rule="overrides (md.load_model(..., k=v), md.fit(config={k: v}), --config k=v) name fields of the "
                 "model's Config",
            fix="use one of the fields listed above"))


def load_model(name_or_path: str, tiny: bool = False, **overrides) -> Model:
    """Find, import and build a model.

    Args:
      name_or_path: ``"transformer"`` (shipped) or ``"path/to/model.py"``.
      tiny: build ``Config.tiny()`` instead of the default ``Config()``.
      overrides: Config fields to change, e.g. ``layers=2``.

    Returns:
      The built :class:`Model`.

    Raises:
      ModelError: see :func:`find_model_file` and :func:`load_module`; also when
        building raises or returns something other than a :class:`Model`.
    """
    path = find_model_file(name_or_path)
    module = load_module(path)
    _check_overrides(module, path, overrides)
    try:
        cfg = module.Config.tiny() if tiny else module.Config()
        if overrides:
            cfg = dataclasses.replace(cfg, **overrides)
        model = module.build(cfg)
    except MeshDSLError as e:
        # Already a user error with its own message: say which line of the file caused it.
        frames = _user_frames(e, path)
        where = f"while building model file '{path}':\n" + (f"{frames}\n" if frames else "")
        raise type(e)(where + str(e)) from None
    except Exception as e:  # noqa: BLE001 - see load_module
        raise _raised_in(path, e, "building the model") from None
    if not isinstance(model, Model):
        raise ModelError(message(f"build() of '{name_or_path}' returned {type(model).__name__}, not a Model.",
                                 rule="build(cfg) returns meshdsl.Model",
                                 fix="return md.Model(graph, loss, params, make_feeds, cfg)"))
    return model


__all__ = ["DEFAULT_LR", "Model", "ModelError", "find_model_file", "load_model", "load_module",
           "shipped_models", "shipped_models_dir"]
