"""Model files and how the tools find them.

A model file is plain Python, nanoGPT-style, that exposes two names:

* ``Config``: a dataclass of sizes, with a ``tiny()`` classmethod giving a
  config small enough for tests;
* ``build(cfg) -> Model``: builds the graph and returns a :class:`Model`.

:func:`load_model` accepts a path to such a file or the name of one in the
repository's ``models/`` folder (``transformer`` -> ``models/transformer.py``).
"""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..core.graph import Graph, Tensor
from ..errors import MeshDSLError, did_you_mean, message
from ..train.step import training_outputs

DEFAULT_LR = 0.1


class ModelError(MeshDSLError):
    """A model file cannot be found, imported or does not follow the protocol."""


@dataclass(eq=False)
class Model:
    """A built model: what the tools need to compile, run and check it.

    Attributes:
      graph: the graph the model was built in.
      loss: the scalar training loss.
      params: param name -> param Tensor (the trainable state).
      make_feeds: ``seed -> {input name: torch.Tensor}``, synthetic data of the
        right shapes and dtypes.
      config: the Config the model was built from.
    """

    graph: Graph
    loss: Tensor
    params: dict[str, Tensor]
    make_feeds: Callable[[int], dict[str, torch.Tensor]]
    config: Any = None

    def feeds(self, seed: int = 0) -> dict[str, torch.Tensor]:
        """Synthetic inputs, deterministic in ``seed``."""
        return self.make_feeds(seed)

    def train_step(self, lr: float = DEFAULT_LR) -> dict[str, Tensor]:
        """Outputs of one SGD step: ``loss``, ``grad/NAME`` and ``new/NAME`` for every param.

        Built once per ``lr`` (see :func:`meshdsl.train.step.training_outputs`).
        """
        return training_outputs(self.loss, self.params, lr, with_grads=True)

    def grads(self) -> dict[str, Tensor]:
        """Gradient of the loss w.r.t. every param, by param name."""
        outs = self.train_step()
        return {k: outs[f"grad/{k}"] for k in self.params}


def models_dirs() -> list[Path]:
    """Where model names are looked up: ``./models``, then ``models/`` beside the package."""
    pkg_parent = Path(__file__).resolve().parents[2]
    out = []
    for d in (Path.cwd() / "models", pkg_parent / "models"):
        if d not in out:
            out.append(d)
    return out


def find_model_file(name_or_path: str) -> Path:
    """Resolve a model path or name to a file.

    Raises:
      ModelError: no such file, with the models that do exist.
    """
    p = Path(name_or_path)
    if p.suffix == ".py" or p.parent != Path("."):
        if p.is_file():
            return p.resolve()
        raise ModelError(message(f"model file '{name_or_path}' does not exist.",
                                 rule="MODEL is a path to a .py file or the name of a file in models/",
                                 fix="check the path"))
    known: list[str] = []
    for d in models_dirs():
        f = d / f"{p.name}.py"
        if f.is_file():
            return f.resolve()
        if d.is_dir():
            known += [x.stem for x in d.glob("*.py") if not x.stem.startswith("_") and x.stem not in known]
    raise ModelError(message(
        f"no model named '{name_or_path}'.{did_you_mean(p.name, known)}",
        inputs=[f"searched: {', '.join(str(d) for d in models_dirs())}",
                f"models found: {', '.join(sorted(known)) or '(none)'}"],
        rule="MODEL is a path to a .py file or the name of a file in models/",
        fix="pass one of the names above or a path such as ./my_model.py"))


def load_module(path: Path):
    """Import the model file at ``path`` as a fresh module."""
    name = f"meshdsl_model_{path.stem}_{abs(hash(str(path))) & 0xFFFFFF:06x}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelError(f"cannot import model file '{path}'.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    for attr in ("Config", "build"):
        if not hasattr(module, attr):
            del sys.modules[name]
            raise ModelError(message(f"model file '{path}' has no '{attr}'.",
                                     rule="a model file defines a Config dataclass and build(cfg) -> Model",
                                     fix=f"add '{attr}' (see models/mlp.py for the smallest example)"))
    return module


def load_model(name_or_path: str, tiny: bool = False, **overrides) -> Model:
    """Find, import and build a model.

    Args:
      name_or_path: ``"transformer"`` or ``"path/to/model.py"``.
      tiny: build ``Config.tiny()`` instead of the default ``Config()``.
      overrides: Config fields to change, e.g. ``layers=2``.

    Returns:
      The built :class:`Model`.
    """
    module = load_module(find_model_file(name_or_path))
    cfg = module.Config.tiny() if tiny else module.Config()
    if overrides:
        import dataclasses
        cfg = dataclasses.replace(cfg, **overrides)
    model = module.build(cfg)
    if not isinstance(model, Model):
        raise ModelError(message(f"build() of '{name_or_path}' returned {type(model).__name__}, not a Model.",
                                 rule="build(cfg) returns meshdsl.tools.loader.Model",
                                 fix="return Model(graph, loss, params, make_feeds, cfg)"))
    return model


__all__ = ["Model", "ModelError", "load_model", "load_module", "find_model_file", "models_dirs"]
