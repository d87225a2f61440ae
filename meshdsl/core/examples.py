"""Which dim of a graph indexes its examples (the dim data parallelism splits), read off the graph.

Users name that dim as they like (``batch``, ``B``, ``N``, ``batch_size``, ``examples``). The
name ``batch`` always wins where a tensor has it (micro-batches cut that name, docs/guide/
pipelines.md); otherwise the examples' dim is the one the fed inputs hold and no param does:
a weight never depends on which examples come, and every input row is an example. Of several
such dims (a ``[B, T]`` token input whose positions no param holds), the one held by the most
inputs wins, then the one leftmost in them (``[B, T]``, ``[N, C, H, W]``: examples first).
"""
from __future__ import annotations

from .shape import Dim
from .graph import topo_nodes

#: The name that is the examples' dim wherever a tensor has it.
BATCH = "batch"


def examples_dim(outputs) -> str | None:
    """The examples' dim of the graph of ``outputs`` (a dict or list of tensors), or None.

    ``"batch"`` where a tensor of the graph has it; else the dim of size > 1 held by the most
    ``md.input`` tensors and by no ``md.param``, the leftmost in those inputs on a tie (then
    by name). None where every input dim is held by a param too (or there is no input).
    """
    found = examples_of(outputs)
    return found.name if found is not None else None


def examples_of(outputs) -> Dim | None:
    """The examples' dim of :func:`examples_dim`, with its size."""
    outs = list(outputs.values()) if isinstance(outputs, dict) else list(outputs)
    return _examples(topo_nodes(outs))


def examples_dim_of(nodes) -> str | None:
    """:func:`examples_dim` of a graph's ``nodes`` (topological order)."""
    found = _examples(nodes)
    return found.name if found is not None else None


def _examples(nodes) -> Dim | None:
    batch = next((d for n in nodes for t in (*n.inputs, *n.outputs) for d in t.shape if d.name == BATCH), None)
    if batch is not None:
        return batch
    held = {d for n in nodes if n.op.name == "param" for d in n.outputs[0].shape.names}
    return examples_in([n.outputs[0].shape for n in nodes if n.op.name == "input"], held)


def examples_in(input_shapes, param_dims) -> Dim | None:
    """The examples' dim among ``input_shapes`` (the fed inputs' Shapes) given the dim names the
    params hold (``param_dims``): ``batch`` where an input has it, else as :func:`examples_dim`
    reads it (a plan's inputs and params, where the graph is gone)."""
    score: dict[str, tuple[int, int]] = {}
    sizes: dict[str, int] = {}
    for shape in input_shapes:
        for pos, d in enumerate(shape):
            if d.name == BATCH:
                return d
            if d.size > 1 and d.name not in param_dims:
                count, first = score.get(d.name, (0, pos))
                score[d.name], sizes[d.name] = (count + 1, min(first, pos)), d.size
    if not score:
        return None
    name = min(score, key=lambda d: (-score[d][0], score[d][1], d))
    return Dim(name, sizes[name])
