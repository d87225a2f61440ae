"""Gradient accumulation without a pipeline: a process runs its micro-batches one at a time.

A plan compiled with ``microbatches=m`` and no pipeline axis is lowered on the mesh
plus the virtual micro-batch axis (:mod:`.pipeline`), so its local shapes are one
micro-batch's.  Run step by step as it is, a process would hold its ``m`` micro-batch
ranks side by side: every kernel on all of them in turn, every activation ``m`` times
over, and no memory saved by accumulating.  Here the steps are cut into the four
segments of a pipeline step with one stage (:mod:`.partition`), an ``accumulate`` step:

* **prologue** (once): steps that read no input (param re-layouts), and the whole-batch
  statistics of the inputs (a loss's token count, :mod:`.batch_stats`);
* **forward** (per micro-batch): the forward pass up to the loss;
* **backward** (per micro-batch): from the loss's gradient on, everything that still
  varies per micro-batch (a step in the backward or update phase, or one reading such a
  step's result);
* **final** (once): the sums over the micro-batch axis (the gradients, the loss mean) and
  all that reads them (their allreduces over the other axes, clipping, the update).

The schedule is one stage's 1F1B, ``F0 B0 F1 B1 ...``: a micro-batch's activations are
dropped once its backward is done, and its gradients are added in place into one running
sum per gradient (the pipeline runtime's accumulator, :mod:`meshdsl.runtime.pipeline`).  What
does not vary per micro-batch (FSDP's gathered params) is made once, in the prologue, and
held for the whole step: one gather per step, not one per micro-batch.  The executor, the
cost model and the memory report read the step as they read a pipeline.
"""
from __future__ import annotations

from .batch_stats import made_once
from .bucket import bucket_final
from .partition import FIELDS, pipeline_step, varies_per_microbatch
from .pipeline import BATCH, MB_AXIS
from .pipeline_program import Segment
from .plan import Step, register_step_kind
from .schedule_gen import make_schedule

register_step_kind("accumulate", FIELDS)   # the pipeline step's fields: axis None, one stage

ONE = frozenset({0})


def segments(steps, values=None, examples: str = BATCH) -> list[Segment | None]:
    """Per step: its :class:`~.pipeline_program.Segment`, None for params and inputs; with
    ``values``, a param the micro-batches cut (per-example codes) is read per micro-batch, as an
    input is (:func:`~.partition.varies_per_microbatch`)."""
    producer = {v: i for i, s in enumerate(steps) for v in s.outs}
    per_mb = made_once(steps, varies_per_microbatch(steps, values, examples))   # a whole-batch count: once
    out: list[Segment | None] = []
    for i, s in enumerate(steps):
        came_from = {out[producer[v]] for v in s.ins if v in producer}
        if s.kind in ("param", "input"):
            out.append(None)
        elif not per_mb[i]:
            out.append(Segment.PROLOGUE)
        elif (s.is_collective and MB_AXIS in s.axes) or Segment.FINAL in came_from:
            out.append(Segment.FINAL)
        elif s.phase != "forward" or Segment.BACKWARD in came_from:
            out.append(Segment.BACKWARD)
        else:
            out.append(Segment.FORWARD)
    return out


def accumulate(steps, values, outputs: dict[str, int], spec, bucket_mb: float = 0.0) -> list[Step]:
    """``steps`` (lowered with the micro-batch axis, no pipeline) as the leaves plus one
    ``accumulate`` step; the final segment's gradient allreduces are bucketed as a pipeline's."""
    m = spec.num_microbatches
    seg = segments(steps, values, spec.examples)
    lists = {k: [(s, ONE) for s, g in zip(steps, seg) if g == k] for k in Segment}
    in_actions = {v for k in (Segment.FORWARD, Segment.BACKWARD) for s, _ in lists[k] for v in s.outs}
    lists[Segment.FINAL] = bucket_final(lists[Segment.FINAL], values, outputs, bucket_mb, in_actions)
    leaves = [s for s, g in zip(steps, seg) if g is None]
    made = {v for s, g in zip(steps, seg) if g is not None for v in s.outs}
    step = pipeline_step("accumulate", f"accumulate ({m} micro-batches)", lists, spec, make_schedule("1f1b", 1, m),
                         [v for s in leaves for v in s.outs], sorted(set(outputs.values()) & made), values)
    return leaves + [step]
