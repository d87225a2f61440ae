"""Balanced stages: the pipeline's layers per stage that even out the stages' predicted cost.

The first stage also runs what feeds the layers (the embedding) and the last what follows
them (the head and the loss), so equal layer counts make unequal stages and the schedule
waits on the slowest.  :func:`balance_stages` prices the even split with the cost model
(:func:`~.predict.predict`: each stage's F, B and W seconds per micro-batch, and the part
its layers take), then gives the layers one at a time to the stage that stays cheapest
with one more: the split with the smallest predicted maximum stage cost, as every layer of
a repeat costs the same.  ``compile(..., stage_layers=counts)`` runs it.

Example::

    counts = md.balance_stages(outs, "stage:2", "layer:stage", microbatches=8, schedule="1f1b")
    plan = md.compile(outs, "stage:2", "layer:stage", microbatches=8, schedule="1f1b", stage_layers=counts)
"""
from __future__ import annotations

from ..core.graph import topo_nodes
from ..errors import LayoutError, message
from ..layout.layout import Layout
from ..layout.mesh import Mesh
from ..lowering.compiler import compile as compile_plan
from .calibrate import Calibration, load
from .predict import StageCost, predict


def balance_stages(outputs, mesh, layout, microbatches: int = 1, schedule: str = "gpipe",
                   cal: Calibration | None = None, **compile_kw) -> tuple[int, ...]:
    """The layers per stage that minimise the predicted cost of the slowest stage.

    Args:
      outputs, mesh, layout, microbatches, schedule, compile_kw: as for
        :func:`~meshdsl.lowering.compiler.compile` (without ``stage_layers``).
      cal: the calibration pricing the steps (default: this host's, :func:`~.calibrate.load`).

    Returns:
      One layer count per stage, summing to the pipelined repeat's layers, e.g. ``(3, 5)``.

    Raises:
      LayoutError: the layout pipelines no repeat (no ``layer:<axis>`` rule on a mesh axis
        of size > 1), or runs virtual stages (``interleaved:v``).
      What :func:`~meshdsl.lowering.compiler.compile` raises.
    """
    first = _equal_split(outputs, mesh, layout)
    plan = first and compile_plan(outputs, mesh, layout, microbatches=microbatches, schedule=schedule,
                                  stage_layers=first, **compile_kw)
    stages = predict(plan, cal or load()).stages if plan else ()
    if not stages or len(stages) != plan_stage_count(plan):
        raise LayoutError(message(
            "balance_stages: the layout pipelines no repeat over one chunk of layers per rank.",
            inputs=[f"mesh: {mesh}", f"layout: {layout}", f"schedule: {schedule}"],
            rule="stages are balanced on a pipeline ('layer:<axis>' over an axis of size > 1) "
                 "with one stage per rank",
            fix="split the layer dim over a stage axis, e.g. --layout 'layer:stage', with --schedule "
                "gpipe, 1f1b or zbh1"))
    return split_by_cost(stages)


def _equal_split(outputs, mesh, layout) -> tuple[int, ...] | None:
    """Layers per stage as equal as they come (the first ones one more, as the layout stores
    them), or None when the layout pipelines no repeat."""
    ts = outputs.values() if isinstance(outputs, dict) else outputs if isinstance(outputs, (list, tuple)) \
        else [outputs]
    mesh, layout = Mesh.parse(mesh), Layout.parse(layout)
    for n in topo_nodes(list(ts)):
        rule = layout.rule_for(n.attrs["layer"].name, ()) if n.op.name == "repeat" else None
        if rule is not None and rule.axis_names and mesh.axis_size(rule.axis_names) > 1:
            layers, p = n.attrs["layer"].size, mesh.axis_size(rule.axis_names)
            return tuple(layers // p + (i < layers % p) for i in range(p))
    return None


def plan_stage_count(plan) -> int:
    """The stage count of ``plan``'s pipeline (0 without one)."""
    return next((s.args["num_stages"] for s in plan.steps if s.kind == "pipeline"), 0)


def split_by_cost(stages: list[StageCost]) -> tuple[int, ...]:
    """Layers per stage minimising the largest ``other_s + layers * per_layer``: each stage
    keeps what it holds besides its layers, and a layer costs the measured average."""
    total = sum(c.layers for c in stages)
    per_layer = sum(c.layers_s for c in stages) / total
    counts = [1] * len(stages)
    for _ in range(total - len(stages)):
        # the stage that stays cheapest with one more layer (the first of equals)
        s = min(range(len(stages)), key=lambda i: (stages[i].other_s + (counts[i] + 1) * per_layer, i))
        counts[s] += 1
    return tuple(counts)


def parse_stage_layers(text: str):
    """``--stage-layers``: ``auto``, or counts such as ``3,5``; returns ``"auto"`` or a tuple.

    Raises:
      ValueError: neither (the CLI's argument type turns it into a usage error, exit 2).
    """
    if text.strip() == "auto":
        return "auto"
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"'{text}' is neither 'auto' nor layer counts such as 3,5") from None
    if any(c < 1 for c in counts):
        raise ValueError(f"'{text}': each stage runs at least one layer")
    return counts
