"""A training step as one compiled plan: loss, gradients and optimizer updates.

:class:`TrainStep` compiles ``{loss, new params, new optimizer state}`` for a
mesh and layout, keeps each rank's param and state slices between steps, feeds
the optimizer's hyperparameters (so a learning-rate schedule never recompiles),
and reports where the time went (local compute vs communication) per step.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..collectives import COLLECTIVES
from ..core.graph import Tensor
from ..comm.communicator import Communicator
from ..runtime.executor import Executor
from ..comm.microbatch import for_plan
from ..ir.autodiff import grad
from ..ir.interpret import feeds_dict
from ..ir.precision import mixed_precision
from ..ir.remat import parse_remat
from ..ops.nn import step_salt
from ..ops.precision import check_precision
from ..lowering.bucket import DEFAULT_BUCKET_MB
from ..lowering.compiler import compile as compile_plan
from ..layout.sharding import Sharding
from ..lowering.plan import Value
from ..core.shape import Shape
from ..errors import GraphError, message
from .checkpoint_format import HeldSpec
from .init_weights import check_weights, graph_params, read_weights
from .optim import sgd
from .optimizers import Optimizer, clip_scale, global_norm, hyper
from .param_keys import check_params
from .state_updates import check_held_where_updated, check_updates, with_running, with_updates

#: Stats keys that count as communication: every collective kind, and time blocked on one in flight.
COMM_KINDS = (*COLLECTIVES, "wait")

# (graph uid, id(loss), lr, with_grads) -> (loss, outputs), the most recent 64.
_TRAIN_OUTPUTS: OrderedDict = OrderedDict()
_TRAIN_OUTPUTS_SIZE = 64


def training_outputs(loss: Tensor, params: dict[str, Tensor], lr: float, with_grads: bool = False,
                     remat=None):
    """Graph outputs of one SGD step: ``loss`` and ``new/<param>`` (cached per loss and lr).

    Built once per (loss, lr, remat): a second call returns the same tensors, so the compile
    cache sees the same outputs and the graph does not grow a second update.  ``remat``:
    every repeat's activation-checkpointing policy (:mod:`meshdsl.ir.remat`; None: its own).
    """
    key = (loss.graph.uid, id(loss), lr, with_grads, str(remat))
    hit = _TRAIN_OUTPUTS.get(key)
    if hit is not None and hit[0] is loss:
        _TRAIN_OUTPUTS.move_to_end(key)
        return hit[1]
    grads = grad(loss, params, remat=remat)
    new = sgd(params, grads, lr)
    outs = {"loss": loss, **{f"new/{k}": v for k, v in new.items()}}
    if with_grads:
        outs.update({f"grad/{k}": g for k, g in grads.items()})
    _remember(key, loss, outs)
    return outs


def _remember(key, loss, outs) -> None:
    _TRAIN_OUTPUTS[key] = (loss, outs)
    if len(_TRAIN_OUTPUTS) > _TRAIN_OUTPUTS_SIZE:
        _TRAIN_OUTPUTS.popitem(last=False)


def optimizer_outputs(loss: Tensor, params: dict[str, Tensor], optimizer: Optimizer, clip: bool,
                      remat=None) -> dict:
    """Graph outputs of one optimizer step: ``loss``, ``grad_norm``, ``new/<param>`` and
    ``new/opt/<param>/<slot>`` (cached per loss, optimizer kind and clipping).

    With ``clip`` the gradients are scaled by ``min(1, c / norm)``, ``c`` being the
    scalar input ``opt/clip_norm``.
    """
    key = (loss.graph.uid, id(loss), optimizer.graph_key(), clip, tuple(params), str(remat))
    hit = _TRAIN_OUTPUTS.get(key)
    if hit is not None and hit[0] is loss:
        _TRAIN_OUTPUTS.move_to_end(key)
        return hit[1]
    grads = grad(loss, params, remat=remat)
    g = loss.graph
    with g.in_phase("update"):
        norm = global_norm(grads)
        scale = clip_scale(norm, hyper(g, "clip_norm", norm.dtype)) if clip else ew_one(norm)
    outs = {"loss": loss, "grad_norm": norm, **optimizer.update(params, grads, scale)}
    _remember(key, loss, outs)
    return outs


def step_outputs(loss: Tensor, params: dict[str, Tensor], lr: float, optimizer: Optimizer | None = None,
                 clip: bool = False, remat=None, with_grads: bool = False, updates: dict | None = None) -> dict:
    """The outputs of one training step, as :class:`TrainStep` runs it: the plain SGD step of
    ``lr`` (:func:`training_outputs`) or ``optimizer``'s (:func:`optimizer_outputs`), and the
    ``new/<name>`` of each of ``updates`` (a Model's frozen params set in the step, checked).

    Every place that builds, prices or measures a training step (``TrainStep``, ``Model.train_step``,
    ``meshdsl plan/run/check/train/search``) builds it here, so none leaves a part of it out.
    ``with_grads`` (plain SGD only) also returns ``grad/<param>``."""
    if optimizer is None:
        outs = training_outputs(loss, params, lr, with_grads=with_grads, remat=remat)
    else:
        outs = optimizer_outputs(loss, params, optimizer, clip, remat=remat)
    return with_updates(outs, with_running(loss, params, updates, "the training step"), loss.graph)


def ew_one(like: Tensor) -> Tensor:
    """The scalar 1 (the gradient scale when nothing is clipped)."""
    from ..ops.elementwise import constant
    return constant(1.0, like.dtype, like)


def _check_optimizer(optimizer) -> None:
    """``optimizer`` is None or a meshdsl :class:`Optimizer` instance."""
    if optimizer is None or isinstance(optimizer, Optimizer):
        return
    if isinstance(optimizer, type) and issubclass(optimizer, Optimizer):
        fix = f"make one: optimizer=md.{optimizer.__name__}(lr=...)"
    elif isinstance(optimizer, str):
        known = {"sgd": "SGD", "adamw": "AdamW", "adafactor": "Adafactor"}
        fix = f"pass an instance: optimizer=md.{known.get(optimizer.lower(), 'AdamW')}(lr=...)"
    else:
        fix = "pass md.SGD(lr=...), md.AdamW(lr=...) or md.Adafactor(lr=...)"
    raise GraphError(message(
        f"TrainStep: optimizer is {optimizer!r} ({type(optimizer).__name__}), not a meshdsl optimizer.",
        rule="the optimizer update is part of the compiled step (graph ops on each param's shard), so it is one "
             "of meshdsl's optimizers: md.SGD, md.AdamW, md.Adafactor (torch.optim optimizers do not apply)",
        fix=fix))


@dataclass
class StepStats:
    """Seconds of one step: total, local compute, exposed communication, and per collective kind.

    ``comm`` is the communication the step waited for: time issuing collectives
    (a synchronous one runs whole; an asynchronous one is started) plus time blocked
    on one in flight.  ``in_flight`` sums, over the step's collectives, the time from each
    one's start to its completion (torch.distributed only; 0 on the simulated mesh):
    collectives in flight at the same time each count, so it may exceed the step, and
    whatever of it is not in ``comm`` was hidden behind compute or other collectives.  ``peak_rss`` is the process's resident-set high-water mark
    after the step, in bytes (``getrusage``'s ``ru_maxrss``).
    """

    total: float
    compute: float
    comm: float
    by_kind: dict[str, float] = field(default_factory=dict)
    in_flight: float = 0.0
    peak_rss: int = 0

    @property
    def overhead(self) -> float:
        """Time outside kernels and collectives: the framework's own cost."""
        return max(0.0, self.total - self.compute - self.comm)


class TrainStep:
    """Compile and run training steps of ``loss`` over ``params`` on ``comm``'s ranks.

    Args:
      loss: scalar loss Tensor.
      params: name -> param Tensor.
      mesh, layout: strings (or objects) as for :func:`meshdsl.compile`; ``opt.`` and
        ``grads.`` rules lay out optimizer state and gradients (ZeRO-1: ``"batch:data;
        opt.d_model:data"``).
      comm: SimulatedComm or TorchComm for the same mesh.
      optimizer: an :class:`~meshdsl.train.optimizers.Optimizer` (SGD, AdamW, Adafactor);
        None keeps the plain SGD of ``lr`` (with its fused gradient-update kernel).
      clip_norm: clip the global gradient norm to this (None: no clipping).
      microbatches: cut the batch into this many micro-batches and accumulate their
        gradients (one step still equals one full-batch step).
      schedule: the pipeline schedule when the layout pipelines a repeat (``"layer:stage"``).
      stage_layers: the pipelined repeat's layers per stage, e.g. ``(3, 5)`` (None: equal;
        :func:`meshdsl.balance_stages` balances them by the cost model).
      seed: param init seed (same values for every layout).
      lr: the learning rate of the plain SGD (``optimizer=None``).
      precision: ``"fp32"`` (the default: every op in fp32, exactly the dense program) or
        ``"bf16"``: matmuls in bfloat16 with fp32 params, optimizer state, loss and gradient
        sums; the per-op rules are in :mod:`meshdsl.ops.precision`.
      bucket_mb: reduce gradients in buckets of about this many MB (default 25, as DDP);
        0: one collective per gradient (see :mod:`meshdsl.lowering.bucket`).
      remat: what each repeat's layers save for the backward (activation checkpointing):
        ``"none"``, ``"full"``, ``"selective"`` or ``"save:OP,..."`` (:mod:`meshdsl.ir.remat`);
        None: each repeat's own policy (``md.repeat(..., remat=)``, default none).  The
        numbers are the same whatever it is.
      updates: frozen param name -> a tensor of its dims, computed in the graph from this step's
        params (before the optimizer's update) and frozen params; after each step the frozen
        param takes its value (an EMA target: ``{"k_w": 0.99 * k_w + 0.01 * w}``).  Lowered with
        the step and laid out like the param, so no whole tensor is gathered.
      compile: run each rank's local steps compiled by ``torch.compile`` (True: inductor, or a
        backend name such as ``"aot_eager"``; :mod:`meshdsl.runtime.compiled`); the first step
        compiles, and ``executor.compiling.stats`` says what it cost.

    Raises:
      GraphError: a params key that is not its param's name (the param would stay frozen); a bad
        ``clip_norm``, an unknown ``precision`` or remat policy; an update of a
        name that is no frozen param, or of other dims or dtype.
    """

    def __init__(self, loss: Tensor, params: dict[str, Tensor], mesh, layout, comm: Communicator,
                 optimizer: Optimizer | None = None, clip_norm: float | None = None, microbatches: int = 1,
                 schedule: str = "gpipe", seed: int = 0, lr: float = 0.01, precision: str = "fp32",
                 bucket_mb: float = DEFAULT_BUCKET_MB, remat=None, compile=False, stage_layers=None,
                 updates: dict | None = None):
        if clip_norm is not None and not (isinstance(clip_norm, (int, float)) and 0 < clip_norm < float("inf")):
            raise GraphError(message(f"TrainStep: clip_norm={clip_norm!r} is not a positive finite number.",
                                     rule="the global gradient norm is clipped to a positive bound",
                                     fix="pass e.g. clip_norm=1.0, or None for no clipping"))
        _check_optimizer(optimizer)
        if clip_norm is not None and optimizer is None:
            from .optimizers import SGD
            optimizer = SGD(lr=lr)
        self.optimizer, self.clip_norm = optimizer, clip_norm
        #: "fp32" or "bf16"
        self.precision = check_precision(precision, "TrainStep")
        params = check_params(params, loss.graph, "TrainStep")
        loss = mixed_precision(loss, precision)
        #: the remat policy every repeat is differentiated with (None: each its own)
        self.remat = None if remat is None else parse_remat(remat, "TrainStep(remat=...)")
        updates = check_updates(updates, params, loss.graph, "TrainStep")
        self.outputs = step_outputs(loss, params, lr, optimizer, clip_norm is not None, self.remat, updates=updates)
        self.plan = compile_plan(self.outputs, mesh, layout, microbatches=microbatches, schedule=schedule,
                            bucket_mb=bucket_mb, stage_layers=stage_layers)
        # a plan with the virtual micro-batch axis runs on a communicator of its own mesh
        self.executor = Executor(self.plan, for_plan(comm, self.plan), donate_params=True, compile=compile)
        self.params = self.executor.init_params(seed)
        self.names = list(params)
        #: the graph's params by name, trainable and frozen (an md.param left out of ``params``:
        #: no gradient, no update; it keeps its init or what :meth:`set_params` gave it)
        self.graph_params = graph_params(self.plan)
        #: names of the frozen params
        self.frozen = [k for k in self.graph_params if k not in params]
        #: names of the carried tensors: the params, then the optimizer state
        self.carried = [k for k in self.plan.params if f"new/{k}" in self.plan.outputs]
        if updates:
            check_held_where_updated(self.plan, self.carried, updates, mesh, layout)
        self.step_count = 0
        #: the last step's global gradient norm, before clipping (None with the plain SGD)
        self.grad_norm: float | None = None

    @staticmethod
    def hyper_values(optimizer: Optimizer, clip_norm: float | None, step: int, lr: float | None = None) -> dict:
        """The hyperparameter feeds (``opt/lr``, ...) of 0-based ``step``."""
        feeds = optimizer.feeds(step, lr)
        if clip_norm is not None:
            feeds["opt/clip_norm"] = torch.tensor(float(clip_norm))
        return feeds

    def hyper_feeds(self, lr: float | None = None) -> dict[str, torch.Tensor]:
        """This step's hyperparameter feeds (``opt/lr``, ...), read by the plan."""
        if self.optimizer is None:
            return {}
        feeds = self.hyper_values(self.optimizer, self.clip_norm, self.step_count, lr)
        return {k: v for k, v in feeds.items() if k in self.plan.inputs}

    def __call__(self, feeds: dict, timed: bool = False, lr: float | None = None
                 ) -> tuple[float, StepStats | None]:
        if lr is not None and self.optimizer is None:
            raise GraphError(message("TrainStep: lr= given to a step built without an optimizer.",
                                     rule="a runtime learning rate needs an optimizer that reads it",
                                     fix="build the step with optimizer=md.SGD(lr=...)"))
        stats = {} if timed else None
        flight0 = _in_flight(self.executor.comm) if timed else 0.0
        t0 = time.perf_counter()
        # Each step draws its own dropout masks (the same on every layout and on resume).
        outs = self.executor.run({**feeds_dict("TrainStep", feeds), **self.hyper_feeds(lr)}, self.params, salt=step_salt(self.step_count),
                                 stats=stats)
        for k in self.carried:
            self.params[k] = outs[f"new/{k}"]
        self.step_count += 1
        if "grad_norm" in outs:
            self.grad_norm = _held_scalar(outs["grad_norm"])
        # A pipeline keeps the loss on its last stage: read it where it is.
        loss = _held_scalar(outs["loss"])
        total = time.perf_counter() - t0
        if not timed:
            return loss, None
        comm = sum(v for k, v in stats.items() if k in COMM_KINDS)
        return loss, StepStats(total, stats.get("local", 0.0) + stats.get("split", 0.0), comm, stats,
                               _in_flight(self.executor.comm) - flight0, peak_rss())

    def set_params(self, weights) -> list[str]:
        """Start params from given full tensors: each rank takes its slice for this step's mesh
        and layout (a pipeline stage only the params it holds).

        Trainable params and frozen ones (graph params left out of ``params``, e.g. LoRA's base
        weights) alike.  A param not given keeps what it has: meshdsl's seeded init on a new
        step.  The optimizer state is left as it is (zero on a new step).  A float tensor of
        another float dtype is cast to the param's dtype (as torch's ``load_state_dict``
        copies; a bf16 file into fp32 params is exact); an integer one for a float param is
        refused.  The tensors given are copied, never updated in place.

        Args:
          weights: param name -> full (unsharded) tensor, or the path of a safetensors file of
            them (``meshdsl export`` writes one from a checkpoint).

        Returns:
          The names set.

        Raises:
          WeightsError: naming each bad item: a name that is no param of the graph (with the
            closest one), a tensor of another shape (the param's dims named) or dtype kind.

        Example::

            step = md.TrainStep(model.loss, model.params, "data:2; model:2", "batch:data; heads:model", comm)
            step.set_params("llama.safetensors")   # or {"wq": tensor, ...}
        """
        given = check_weights(self.graph_params, read_weights(weights, "TrainStep.set_params"),
                              "TrainStep.set_params")
        for name, full in given.items():
            value = self.plan.values[self.plan.params[name]]
            self.params[name] = self.executor.local_slices(value, full.to(self.executor.device))
        return list(given)

    def full_params(self, frozen: bool = False) -> dict[str, torch.Tensor]:
        """Every trainable param as a full tensor (gathered over the mesh); ``frozen``: the
        frozen ones too (what :meth:`set_params` takes back).  A snapshot: where the full tensor
        is a rank's own buffer (one rank, or a replicated param), a copy, since the next step
        may update that buffer in place."""
        names = self.names + (self.frozen if frozen else [])
        out = {}
        for k in names:
            full = self.executor.to_full_held(self.plan.params[k], self.params[k])
            live = {x.untyped_storage().data_ptr() for x in self.params[k] if x is not None}
            out[k] = full.clone() if full is not None and full.untyped_storage().data_ptr() in live else full
        return out

    def state(self) -> dict[str, tuple[Value, list]]:
        """Every carried tensor's value spec and local slices (one per held rank).

        Names: ``param/<k>`` for params (frozen ones too: they may have been given, see
        :meth:`set_params`), ``opt/<k>/<slot>`` for optimizer state, and
        ``opt/step`` (a replicated int64 scalar) for the step counter.  A tensor only some ranks
        hold (a pipeline stage's params and their optimizer state) has a
        :class:`~meshdsl.train.checkpoint_format.HeldSpec` and ``None`` on the other ranks.
        """
        out = {}
        for k in dict.fromkeys(self.carried + self.frozen):   # an updated frozen param is both
            name = k if k.startswith("opt/") else f"param/{k}"
            v = self.plan.values[self.plan.params[k]]
            held = self.plan.holders.get(v.id)
            spec = v if held is None else HeldSpec(v.shape, v.dtype, v.sharding, tuple(held))
            out[name] = (spec, list(self.params[k]))
        shape = Shape()
        step = Value(-1, shape, torch.int64, Sharding.replicated(shape))
        out["opt/step"] = (step, [torch.tensor(self.step_count) for _ in self.executor.comm.ranks])
        return out

    def load_state(self, state: dict) -> None:
        """Put back what :meth:`state` returned (local slices for the ranks held).

        Raises:
          GraphError: a carried tensor missing from ``state`` or of the wrong local shape.
        """
        want = self.state()
        missing = sorted(set(want) - set(state))
        if missing:
            raise GraphError(message(f"TrainStep.load_state: {len(missing)} tensor(s) missing.",
                                     bullets=[f"'{k}'" for k in missing[:8]],
                                     rule="a state holds every param, every optimizer-state tensor and 'opt/step'",
                                     fix="pass what TrainStep.state() (or a checkpoint of it) returned"))
        for name, (spec, xs) in want.items():
            got = state[name]
            got = got[1] if isinstance(got, tuple) else got
            if len(got) != len(xs) or any(g is not None and x is not None and tuple(g.shape) != tuple(x.shape)
                                          for g, x in zip(got, xs)):
                raise GraphError(message(f"TrainStep.load_state: '{name}' has the wrong local slices.",
                                         inputs=[f"want: {[None if x is None else tuple(x.shape) for x in xs]}",
                                                 f"got: {[None if g is None else tuple(g.shape) for g in got]}"],
                                         rule="slices are this plan's local slices, one per held rank",
                                         fix="load the checkpoint with this step's mesh and layout"))
        for name in want:
            got = state[name]
            got = list(got[1] if isinstance(got, tuple) else got)
            if name == "opt/step":
                self.step_count = int(next(x for x in got if x is not None))
            else:
                key = name[len("param/"):] if name.startswith("param/") else name
                # a rank that does not hold it (None in state()) keeps None whatever was given
                self.params[key] = [None if x is None or mine is None else x.to(self.executor.device, copy=True)
                                    for x, mine in zip(got, want[name][1])]


def _in_flight(comm) -> float:
    """Seconds ``comm``'s collectives have been in flight so far (its per-kind totals, if it keeps them)."""
    stats = getattr(comm, "stats", None) or getattr(getattr(comm, "real", None), "stats", None) or {}
    return sum(st["seconds"] for st in stats.values())


def peak_rss() -> int:
    """This process's resident-set high-water mark in bytes (Linux reports ``ru_maxrss`` in KiB)."""
    import resource
    import sys
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _held_scalar(xs) -> float:
    held = [x for x in xs if x is not None]
    return float(held[0].item()) if held else float("nan")
