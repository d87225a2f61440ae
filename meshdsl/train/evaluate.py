"""Eval during training: the loss and the model's metrics on held-out batches.

:class:`Evaluator` compiles the forward plan of the loss and of the model's
``metrics`` (:class:`~.model.Model`: ``{"accuracy": acc}``, scalars) on the run's
mesh and layout once, without dropout and with batch norms' running statistics (:func:`~meshdsl.ir.eval_mode.eval_mode`, as
torch's ``model.eval()``), and runs it on the training step's current params for each
eval batch; each number is the mean over the batches.  A pipeline holds its outputs
on its last stage only: :func:`agree_held` hands every rank that stage's numbers,
for the training loss as for the eval.
"""
from __future__ import annotations

import math
import statistics

from ..errors import message
from ..ir.eval_mode import eval_mode
from ..runtime.executor import Executor
from ..comm.microbatch import for_plan
from ..lowering.compiler import compile as compile_plan
from .model import ModelError


class Evaluator:
    """``evaluator(feeds_list) -> {"loss": mean, <metric>: mean, ...}`` on ``step``'s current params.

    Args:
      model: the :class:`~.model.Model` (its ``loss`` and ``metrics``).
      step: the run's :class:`~.step.TrainStep` (its params are read at each call).
      spec: the run (its ``mesh``, ``layout``, ``microbatches`` and ``schedule``).
      comm: the communicator of this process's ranks.

    Attributes:
      plan: the forward plan; its inputs' shardings say which slice of an eval batch each rank reads.
    """

    def __init__(self, model, step, spec, comm):
        self.plan = compile_plan(eval_mode({"loss": model.loss, **model.metrics}), spec.mesh, spec.layout,
                                 microbatches=spec.microbatches, schedule=spec.schedule)
        self.executor = Executor(self.plan, for_plan(comm, self.plan))
        self.step, self.comm = step, comm
        # The forward plan may shard a param otherwise than the training step: then it gets its own slices.
        train = step.plan
        self.same = all(self.plan.values[v].sharding == train.values[train.params[k]].sharding
                        for k, v in self.plan.params.items())

    @property
    def names(self) -> list[str]:
        """What a call returns: ``loss``, then each metric."""
        return list(self.plan.outputs)

    def __call__(self, feeds_list) -> dict[str, float] | None:
        """The mean of each output over ``feeds_list`` (None for no batch)."""
        if not feeds_list:
            return None
        params = self.step.params
        if not self.same:
            full = self.step.full_params(frozen=True)
            params = {k: self.executor.local_slices(self.plan.values[self.plan.params[k]], full[k])
                      for k in self.plan.params}
        got: dict[str, list[float]] = {k: [] for k in self.names}
        for feeds in feeds_list:
            outs = self.executor.run(feeds, params)
            for k in self.names:
                held = [x for x in outs[k] if x is not None]
                got[k].append(float(held[0]) if held else float("nan"))
        return agree_held(self.comm, self.plan, {k: statistics.fmean(v) for k, v in got.items()})


def agree_held(comm, plan, values: dict[str, float]) -> dict[str, float]:
    """``values`` (plan output name -> number) as the ranks that hold those outputs see them.

    A pipeline holds its loss on its last stage; the other stages have NaN.  Every rank takes
    the numbers of the first rank whose first value is not NaN (a collective when some output
    is held by some ranks only and this process lacks some ranks; otherwise ``values`` as given).
    """
    held_somewhere = any(plan.outputs[k] in plan.holders for k in values)
    if not held_somewhere or len(getattr(comm, "ranks", ())) == comm.mesh.size:
        return values
    for text in comm.agree(" ".join(repr(float(v)) for v in values.values())):
        nums = [float(x) for x in text.split()]
        if not math.isnan(nums[0]):
            return dict(zip(values, nums))
    return values


def evaluate(model, params: dict, *, batches: int = 4, data=None, seed: int = 0) -> dict[str, float]:
    """The held-out loss and the model's metrics of ``params``, as a training run's eval computes
    them (the same batches; on the dense program, without dropout): the mean over ``batches``
    eval batches (fewer if the held-out split is short).

    Args:
      model: the :class:`~.model.Model` (e.g. ``md.load_trained(path).model``).
      params: param name -> full tensor (``md.load_trained(path).params``).
      batches: how many eval batches (a run evaluates on ``eval_batches``, default 4).
      data: for a model that reads text: a :class:`~.data.TokenData`, a text file's path, or
        None for the default corpus; its held-out split is evaluated.  Ignored for a model on its
        own data, which is evaluated on the seeds no training step uses.
      seed: the run's seed (it splits text into train and held out, and seeds own-data batches).

    Returns:
      ``{"loss": mean, <metric>: mean, ...}``, and ``"batches"``: how many were evaluated.

    Raises:
      ModelError: ``params`` lacks a param the loss or a metric reads (an eval graph's running
        statistics): it is never started from meshdsl's init behind the caller's back.
    """
    from ..ir.interpret import DenseProgram
    from .data import TokenData
    from .feeder import IDS, LABELS, eval_seed, reads_text

    prog = DenseProgram(eval_mode({"loss": model.loss, **model.metrics}))
    _check_params(prog, params)
    if reads_text(model):
        tokens = data if isinstance(data, TokenData) else TokenData.load(data, seed=seed)
        batch, seq = _ids_size(prog, IDS)
        n = min(batches, tokens.num_eval_batches(batch, seq))
        feeds = [dict(zip((IDS, LABELS), xy)) for xy in tokens.eval_batches(batch, seq, num_batches=n)]
    else:
        feeds = [model.feeds(eval_seed(seed, b)) for b in range(batches)]
    got: dict[str, list[float]] = {k: [] for k in ("loss", *model.metrics)}
    for f in feeds:
        outs = prog({k: f[k] for k in prog.inputs}, params)
        for k in got:
            got[k].append(float(outs[k]))
    return {**{k: statistics.fmean(v) if v else float("nan") for k, v in got.items()}, "batches": len(feeds)}


def _check_params(prog, params: dict) -> None:
    """Every param the eval reads is given: the dense program would start a missing one from
    meshdsl's init, and an eval graph reading a frozen param (batch norm's running statistics)
    would then report numbers of weights no run trained."""
    missing = [k for k in prog.params if k not in params]
    if missing:
        raise ModelError(message(
            f"evaluate: the model reads {len(missing)} param(s) that `params` lacks.",
            bullets=[f"'{k}' {prog.params[k].shape}" for k in missing[:8]]
                    + ([f"... and {len(missing) - 8} more"] if len(missing) > 8 else []),
            inputs=[f"given: {len(params)} params"],
            rule="evaluate runs the model on the params it is given, each one the model reads",
            fix="pass every param, frozen ones too (md.load_trained(run).params holds those the run's "
                "loss, metrics and Model.updates read; a separate eval graph reading others needs them "
                "added)"))


def _ids_size(prog, name: str) -> tuple[int, int]:
    """``(batch, seq)`` of the program's input ``name``."""
    return tuple(d.size for d in prog.inputs[name].shape)


__all__ = ["Evaluator", "agree_held", "evaluate"]
