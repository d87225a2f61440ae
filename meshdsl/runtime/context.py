"""What a step rule may read and write while it prepares its step: :class:`StepContext`.

A rule (:mod:`.steps`) is ``prepare(ctx, i, step) -> call``.  The executor makes one
context for its plan; a pipeline makes one per stage view and segment step, with the
layer offset of the stage's first layer.  Nothing else of the executor is visible to a rule.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..comm.communicator import Communicator
from ..errors import GraphError, message
from ..lowering.plan import Plan


class PerRank(list):
    """Feeds or params given as local slices, one per rank the communicator holds."""


def _no_feeds(name, vid, value):
    raise GraphError(message(f"run: input '{name}' is read inside a pipeline segment.",
                             rule="a pipeline segment reads its inputs through the prologue",
                             fix="report this plan: inputs are read before the pipeline"))


@dataclass(eq=False)
class StepContext:
    """The plan being prepared and what its rules share.

    Attributes:
      plan: the plan whose steps are prepared.
      comm: the communicator (or a view of it) the steps run on.
      feed: ``feed(name, vid, value) -> per-rank slices``, checked against the plan.
      donated: step indices whose in-place kernel may overwrite its operands (params).
      add_into: step index -> in-place add kernel (:func:`.steps.inplace_adds`).
      layer_offset: the global index of the first layer a repeat of this plan runs
        (a pipeline stage runs layers ``layer_offset..``); kernels salt by it.
      defer_weight_grads: a pipeline's B puts its weight-gradient matmuls off into a W.
      donates: whether updates may overwrite params (a pipeline's final segment asks).
      timeline: written by a pipeline step: per held stage, ``(action, start, end)`` of its last run.
      compile: how the executor compiles its local steps (:class:`.compiled.CompileSettings`; None: eager).
    """

    plan: Plan
    comm: Communicator
    feed: Callable = _no_feeds
    donated: frozenset = frozenset()
    add_into: dict = field(default_factory=dict)
    layer_offset: int = 0
    defer_weight_grads: bool = True
    donates: bool = False
    timeline: tuple | None = None
    compile: object = None   # the executor's CompileSettings (.compiled), handed to its loops' bodies
    cache: dict = field(default_factory=dict)   # rule-private memos keyed by the rule's module
