"""meshdsl: write a model once with named dims; a mesh string and a layout string
turn it into data-, tensor-, FSDP-, expert- and sequence-parallel programs.

Public API (everything else lives in subpackages and may change):

* dims and graphs: :class:`Dim`, :class:`Shape`, :class:`Graph`, :class:`Tensor`
* ops: see :mod:`meshdsl.ops` (re-exported here); among them :func:`constant` (a number, or a
  tensor table with named dims that each rank slices), :func:`sin`, :func:`cos`, :func:`arange` (position ids)
* autodiff: :func:`grad`, :func:`vjp`; scan: :func:`repeat`
* layout: :class:`Mesh`, :class:`Layout`; compile: :func:`compile` -> :class:`Plan`
* execution: :func:`run_dense`, :func:`run_simulated`, :class:`Executor`, :class:`PerRank`;
  :func:`check` (a layout's outputs against the dense program's, as ``meshdsl check``);
  communicators :class:`SimulatedComm` (every rank in one process) and
  :class:`TorchComm` (one rank per process); processes: :func:`launch`, :func:`spawn`;
  :func:`tune_malloc` (keep a training step's memory in this process, as meshdsl's own processes do)
* training and model files: :class:`Model` (what a model file's ``build`` returns),
  :func:`load_model`, :class:`TrainStep`, :func:`sgd`; optimizers :class:`SGD`, :class:`AdamW`,
  :class:`Adafactor`, :func:`cosine_schedule`; :func:`memory_report` (bytes per rank of a plan);
  :func:`mixed_precision` (a loss rebuilt for bf16 compute, as ``TrainStep(precision="bf16")`` does)
* the training loop: :func:`fit` ``(model, mesh=..., layout=..., steps=..., data=...)`` -> :class:`TrainResult`, :class:`TokenData` (text batches),
  :func:`row_generator` (one random stream per batch row, for a model's own ``batches``),
  :func:`generate` (text from a trained language model), :func:`load_trained` (a run's or
  checkpoint's model and full params), :func:`evaluate` (its held-out loss); checkpoints :func:`save_checkpoint`,
  :func:`load_checkpoint`, :func:`latest_checkpoint`
* pipelines: :func:`draw_timeline` (a plan's schedule, or a run's recorded actions, as a PNG)
* layout search: :func:`calibrate` (measure this machine, cache the fit), :func:`load_calibration`,
  :func:`predict` (a plan's step time and memory per rank), :func:`search_layouts` (rank meshes and
  layouts for N processes)
"""
import importlib as _importlib

# Public name -> (module, attribute).  Names load on first use (PEP 562), so that
# ``import meshdsl`` is cheap and the command line can start its ranks' forkserver
# before it imports torch; every name below is a plain attribute once touched.
_EXPORTS = {
    **{n: (".core.graph", n) for n in ("Graph", "Tensor")},
    **{n: (".core.shape", n) for n in ("Dim", "Shape")},
    **{n: (".errors", n) for n in ("DistributedError", "GraphError", "LayoutError", "MeshDSLError",
                                    "MeshError", "ParseError", "ShapeError")},
    "run_dense": (".runtime.dense", "run_dense"),
    "TorchComm": (".comm.distributed", "TorchComm"),
    **{n: (".runtime.executor", n) for n in ("Executor", "PerRank")},
    **{n: (".processes.launcher", n) for n in ("launch", "spawn")},
    "tune_malloc": (".processes.malloc", "tune_malloc"),
    "SimulatedComm": (".comm.simulated", "SimulatedComm"),
    "run_simulated": (".runtime.simulated", "run_simulated"),
    **{n: (".runtime.check", n) for n in ("check", "CheckResult")},
    **{n: (".ir.autodiff", n) for n in ("grad", "vjp")},
    "DenseProgram": (".ir.interpret", "DenseProgram"),
    "mixed_precision": (".ir.precision", "mixed_precision"),
    "repeat": (".ir.repeat", "repeat"),
    "conv_transpose": (".ir.conv_transpose", "conv_transpose"),
    "Layout": (".layout.layout", "Layout"),
    "Mesh": (".layout.mesh", "Mesh"),
    "compile": (".lowering.compiler", "compile"),
    "memory_report": (".lowering.memory", "memory_report"),
    "Plan": (".lowering.plan", "Plan"),
    **{n: (".train.model", n) for n in ("Model", "ModelError", "load_model")},
    **{n: (".train.checkpoint", n) for n in ("latest_checkpoint", "load_checkpoint", "save_checkpoint")},
    **{n: (".train.data", n) for n in ("TokenData", "row_generator")},
    "generate": (".train.generate", "generate"),
    "load_trained": (".train.trained", "load_trained"),
    "evaluate": (".train.evaluate", "evaluate"),
    "cosine_schedule": (".train.lr_schedule", "cosine_schedule"),
    "sgd": (".train.optim", "sgd"),
    **{n: (".train.optimizers", n) for n in ("SGD", "Adafactor", "AdamW")},
    "TrainStep": (".train.step", "TrainStep"),
    "draw_timeline": (".tools.timeline_png", "draw_timeline"),
    **{n: (".train.trainer", n) for n in ("TrainResult", "fit")},
    "calibrate": (".search.measure", "calibrate"),
    "load_calibration": (".search.calibrate", "load"),
    "predict": (".search.predict", "predict"),
    "balance_stages": (".search.stage_balance", "balance_stages"),
    "search_layouts": (".search.search", "search"),
}
_ROOMS = ("errors", "core", "ops", "ir", "layout", "collectives", "lowering", "comm", "runtime", "processes",
          "train", "search", "tools")

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "__all__":  # ``from meshdsl import *``: every public name (which loads them all)
        ops = _importlib.import_module(".ops", __name__)
        return sorted(set(_EXPORTS) | set(ops.__all__))
    if name in _EXPORTS:
        module, attr = _EXPORTS[name]
        value = getattr(_importlib.import_module(module, __name__), attr)
    elif name in _ROOMS:
        value = _importlib.import_module(f".{name}", __name__)
    else:
        ops = _importlib.import_module(".ops", __name__)  # every op of the DSL (meshdsl.ops)
        if name not in ops.__all__:
            if name.startswith("_"):  # a protocol probe (__path__, _fields, ...): the plain answer
                raise AttributeError(f"module 'meshdsl' has no attribute {name!r}")
            from .ops.arguments import unknown_name
            raise unknown_name(name, set(_EXPORTS) | set(ops.__all__))
        value = getattr(ops, name)
    globals()[name] = value
    return value


def __dir__():
    ops = _importlib.import_module(".ops", __name__)
    return sorted(set(globals()) | set(_EXPORTS) | set(ops.__all__))
