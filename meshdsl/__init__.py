"""meshdsl: write a model once with named dims; a mesh string and a layout string
turn it into data-, tensor-, FSDP-, expert- and sequence-parallel programs.

Public API (everything else lives in subpackages and may change):

* dims and graphs: :class:`Dim`, :class:`Shape`, :class:`Graph`, :class:`Tensor`
* ops: see :mod:`meshdsl.ops` (re-exported here)
* autodiff: :func:`grad`, :func:`vjp`; scan: :func:`repeat`
* layout: :class:`Mesh`, :class:`Layout`; compile: :func:`compile` -> :class:`Plan`
* execution: :func:`run_dense`, :func:`run_simulated`, :class:`Executor`, :class:`PerRank`;
  communicators :class:`SimulatedComm` (every rank in one process) and
  :class:`TorchComm` (one rank per process); processes: :func:`launch`, :func:`spawn`
* training and model files: :class:`Model` (what a model file's ``build`` returns),
  :func:`load_model`, :class:`TrainStep`, :func:`sgd`; optimizers :class:`SGD`, :class:`AdamW`,
  :class:`Adafactor`, :func:`cosine_schedule`; :func:`memory_report` (bytes per rank of a plan);
  :func:`mixed_precision` (a loss rebuilt for bf16 compute, as ``TrainStep(precision="bf16")`` does)
* the training loop: :func:`fit` ``(model, mesh=..., layout=..., steps=..., data=...)`` -> :class:`TrainResult`, :class:`TokenData` (text batches),
  :func:`generate` (text from a trained language model); checkpoints :func:`save_checkpoint`,
  :func:`load_checkpoint`, :func:`latest_checkpoint`
* pipelines: :func:`draw_timeline` (a plan's schedule, or a run's recorded actions, as a PNG)
* layout search: :func:`calibrate` (measure this machine, cache the fit), :func:`load_calibration`,
  :func:`predict` (a plan's step time and memory per rank), :func:`search_layouts` (rank meshes and
  layouts for N processes)
"""
from .core.graph import Graph, Tensor
from .core.shape import Dim, Shape
from .errors import (DistributedError, GraphError, LayoutError, MeshDSLError, MeshError, ParseError,
                     ShapeError)
from .exec.dense import run_dense
from .exec.distributed import TorchComm
from .exec.executor import Executor, PerRank
from .exec.launch import launch, spawn
from .exec.simulated import SimulatedComm, run_simulated
from .ir.autodiff import grad, vjp
from .ir.interpret import DenseProgram
from .ir.precision import mixed_precision
from .ir.repeat import repeat
from .layout.layout import Layout
from .layout.mesh import Mesh
from .lowering.compiler import compile
from .lowering.memory import memory_report
from .lowering.plan import Plan
from .ops import *  # noqa: F401,F403
from .train.model import Model, ModelError, load_model
from .train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .train.data import TokenData
from .train.generate import generate
from .train.lr_schedule import cosine_schedule
from .train.optim import sgd
from .train.optimizers import SGD, Adafactor, AdamW
from .train.step import TrainStep
from .tools.timeline_png import draw_timeline
from .train.trainer import TrainResult, fit
from .search.calibrate import calibrate, load as load_calibration
from .search.predict import predict
from .search.search import search as search_layouts

__version__ = "0.1.0"
