"""Which dim of a graph indexes its examples (the dim data parallelism splits), read off the graph.

Users name that dim as they like (``batch``, ``B``, ``N``, ``batch_size``, ``examples``). The
name ``batch`` always wins where a tensor has it (micro-batches cut that name, docs/guide/
pipelines.md): naming the examples' dim ``batch`` is how a user states it. Otherwise the
examples' dim is one the fed inputs hold and no param does: a weight never depends on which
examples come, and every input row is an example. Of several such dims (a ``[B, T]`` token
input whose positions no param holds), one that no op runs along (:func:`runs_along`) wins:
the examples are independent of each other, so nothing scans them as a repeat's layers, convolves
or shifts them, sums them up cumulatively, attends across them or orders them in a causal mask;
a sequence's positions are all of that (a time-major ``[T, B]`` input). Then the one held by the
most inputs, then the one leftmost in them (``[B, T]``, ``[N, C, H, W]``: examples first).
"""
from __future__ import annotations

from .shape import Dim
from .graph import topo_nodes

#: The name that is the examples' dim wherever a tensor has it.
BATCH = "batch"


def examples_dim(outputs) -> str | None:
    """The examples' dim of the graph of ``outputs`` (a dict or list of tensors), or None.

    ``"batch"`` where a tensor of the graph has it; else of the dims of size > 1 that ``md.input``
    tensors hold and no ``md.param`` does, one no op runs along (:func:`runs_along`), then the one
    held by the most inputs, then the leftmost in those inputs (then by name). None where every
    input dim is held by a param too (or there is no input).
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
    return examples_in([n.outputs[0].shape for n in nodes if n.op.name == "input"], held, runs_along(nodes))


#: Order comparisons: between two positions' iotas they make a causal mask.
_ORDER = ("less", "less_equal", "greater", "greater_equal")


def runs_along(nodes) -> set[str]:
    """The names of the dims some op of ``nodes`` (and of the repeat blocks they hold) runs along:
    a repeat's layer dim, a conv's spatial dims, an attention's query and key dims, a cumsum's or a
    shift's dim, the two dims of a causal mask (an order comparison of two iotas).  A sequence's
    positions, an image's rows: never the examples' dim, whose entries no op relates."""
    out: set[str] = set()
    todo = list(nodes)
    while todo:
        n = todo.pop()
        a, name = n.attrs, n.op.name
        if name == "repeat":
            out.add(a["layer"].name)
        elif name in ("cumsum", "shift"):
            out.add(a["dim"])
        elif name == "conv":
            out.update(d for d, *_ in a["spatial"])
        elif name == "attention":
            out.update((a["query_dim"], a["key_dim"]))
        elif name in _ORDER and len(n.inputs) == 2 and all(t.node.op.name == "iota" for t in n.inputs):
            out.update(t.shape.names[0] for t in n.inputs)
        todo += [m for v in a.values() if hasattr(getattr(v, "graph", None), "nodes") for m in v.graph.nodes]
    return out


def examples_in(input_shapes, param_dims, along=frozenset()) -> Dim | None:
    """The examples' dim among ``input_shapes`` (the fed inputs' Shapes) given the dim names the
    params hold (``param_dims``) and those an op runs along (``along``, :func:`runs_along`):
    ``batch`` where an input has it, else as :func:`examples_dim` reads it (a plan's inputs and
    params, where the graph is gone)."""
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
    name = min(score, key=lambda d: (d in along, -score[d][0], score[d][1], d))
    return Dim(name, sizes[name])
