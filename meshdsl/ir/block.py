"""A repeat's block: ``fn(carry, params)`` traced once into a sub-graph of its own.

The block returns the next carry, or ``(carry, {name: tensor})``: per-layer outputs
besides the carry (an auxiliary loss, router statistics), which the repeat stacks
over the layer dim.  A carry is one Tensor or a tuple of them (an LSTM's ``(h, c)``):
each carried tensor is a placeholder of its own (:func:`carry_name`), with its own
shape, dtype and layout, and the block returns a tuple of as many, shaped alike.
:func:`trace` builds a :class:`Block` (and checks what the function returned);
:func:`run_layers` is the layer loop every repeat runs through, the dense op and the
plan executor alike.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..core.graph import Graph, Tensor
from ..errors import ShapeError, clip, did_you_mean, message
from ..ops.leaf import placeholder
from .closure import Closure
from .interpret import DenseProgram

_RETURNS = "block(carry, params) returns the new carry, or (carry, {name: per-layer tensor})"


def carry_name(base: str, i: int) -> str:
    """The name of carried tensor ``i``'s placeholder or sub-plan value (``base`` its first's:
    ``carry``, ``out``, ``cotangent``, ``dcarry``): the first keeps ``base``, so a repeat of one
    carry reads as it always did."""
    return base if i == 0 else f"{base}.{i}"


@dataclass(eq=False)
class Block:
    """A traced block: ``out = fn(carry, params)`` in its own graph.

    ``ys`` holds the per-layer outputs besides the carry, by name (None: the block
    returns only its carry, and so does the repeat).  ``carries`` and ``outs`` hold
    each carried tensor's placeholder and result (one each unless the carry is a
    tuple, ``tupled``); ``carry`` and ``out`` are the first's.
    """

    fn: Callable
    graph: Graph
    carry: Tensor
    params: dict[str, Tensor]
    out: Tensor
    closed: dict[str, Tensor] = field(default_factory=dict)  # placeholders of the tensors read from outside
    outer: list = field(default_factory=list)  # those tensors (of the graph that calls repeat), in that order
    ys: dict | None = None
    extra: dict = field(default_factory=dict)  # cotangent placeholders, grads, given (for grad blocks)
    hoisted: list = field(default_factory=list)  # loop-invariant nodes built outside (closure.py), in trace order
    carries: list = field(default_factory=list)  # every carried tensor's placeholder (carry first)
    outs: list = field(default_factory=list)     # their results (out first)
    tupled: bool = False   # the carry was given as a tuple (the repeat returns one)
    _dense: dict = field(default_factory=dict)

    def __post_init__(self):
        self.carries = self.carries or [self.carry]
        self.outs = self.outs or [self.out]

    @property
    def y_names(self) -> list[str]:
        return list(self.ys or {})

    @property
    def num_carries(self) -> int:
        return len(self.carries)

    def dense(self, outputs: dict, given: dict | None = None) -> DenseProgram:
        """The block's dense program for ``outputs`` (built once per set of outputs)."""
        key = (tuple((k, id(t)) for k, t in outputs.items()), tuple((k, id(t)) for k, t in (given or {}).items()))
        prog = self._dense.get(key)
        if prog is None:
            prog = self._dense[key] = DenseProgram(outputs, given=given)
        return prog


class _LayerParams(dict):
    """The per-layer params a block sees; asking for one that was not passed is a user error."""

    def __missing__(self, key):
        raise ShapeError(message(
            f"repeat: the block reads param {key!r}, which was not passed to repeat."
            f"{did_you_mean(str(key), list(self))}", inputs=[f"params passed: {sorted(self)}"],
            rule="the block sees exactly the stacked params given to repeat(block, x, params, dim), by name",
            fix=f"add {key!r} to the params dict, or use one of {sorted(self)}"))


class LayerStack(list):
    """Per-layer tensors standing for a value stacked over ``layer`` (layer-major).

    The layer inputs and activations a repeat saves are read back one layer at a
    time by its gradient and by nothing else, so they are kept as a list: stacking
    them would copy every activation once more per step.
    """

    def tensor(self) -> torch.Tensor:
        """The layers stacked into one tensor, layer dim first."""
        return torch.stack(list(self), 0)


def run_layers(num_layers: int, layer: Callable, carry, backward: bool = False):
    """The layer loop of every repeat: ``layer(l, carry) -> (carry, kept)`` for each layer.

    Layers run in order, or in reverse for a backward pass.  The dense op and the
    plan executor both run their layers through here; they differ only in what a
    carry is (a tensor, or one local tensor per rank) and in how one layer runs.

    Args:
      num_layers: the layer count.
      layer: runs layer ``l`` on ``carry``; returns the next carry and what to keep of it.
      carry: the carry into the first layer run.
      backward: run layers ``num_layers - 1`` down to 0.

    Returns:
      The last carry, and the kept values in layer order (``kept[l]`` from layer ``l``).
    """
    kept: list = [None] * num_layers
    for l in (reversed(range(num_layers)) if backward else range(num_layers)):
        carry, kept[l] = layer(l, carry)
    return carry, kept


def trace(fn, x, stacked: dict[str, Tensor], layer: str, name: str, outer: Graph,
          hoisted: list | None = None) -> Block:
    """Trace ``fn`` on carry placeholders shaped like ``x`` (a Tensor, or a tuple of them) and
    per-layer params.

    Ops that read only tensors from outside the block are built in ``outer`` (loop-invariant:
    :meth:`.closure.Closure.hoist`); a re-trace of a block passes the first trace's ``hoisted``
    nodes, which it reuses in the same order.

    Raises:
      ShapeError: the block returned something else than a carry shaped like ``x`` (a tuple of
        as many tensors, each shaped like its own, for a tuple carry), optionally with a dict of
        per-layer tensors of the block.
    """
    tupled = isinstance(x, tuple)
    xs = list(x) if tupled else [x]
    g = Graph(f"{outer.name}/{name}")
    g.outer = outer
    g.capture = closure = Closure(g, hoisted)
    try:
        with g:
            cs = [placeholder(carry_name("carry", i), t.shape, t.dtype) for i, t in enumerate(xs)]
            ps = _LayerParams({k: placeholder(k, p.shape.without([layer]), p.dtype, p.scopes)
                               for k, p in stacked.items()})
            got = _read_back(fn(tuple(cs) if tupled else cs[0], ps), closure)
        if not closure.replayed_all():
            raise ShapeError("repeat: the block traced differently twice (it hoisted fewer loop-invariant ops); "
                             "blocks must be deterministic functions of (carry, params)")
    finally:
        closure.open = False
    results, ys = _split_return(got, g, layer, len(xs) if tupled else None)
    outs = [_checked_carry(g, t, y, i if tupled else None) for i, (t, y) in enumerate(zip(xs, results))]
    return Block(fn, g, cs[0], ps, outs[0], closure.inner, closure.outer, ys, hoisted=closure.hoisted,
                 carries=cs, outs=outs, tupled=tupled)


def _checked_carry(g: Graph, x: Tensor, y: Tensor, at: int | None) -> Tensor:
    """The block's result ``y`` for carry ``x`` (element ``at`` of a tuple carry, None for a
    plain one), its dims put in ``x``'s order; raises where its dims, sizes or dtype differ."""
    what = "carry" if at is None else f"carry[{at}]"
    if sorted(y.shape.names) != sorted(x.shape.names) or set(y.shape) != set(x.shape):
        raise ShapeError(message(f"repeat: the block maps {what} {x.shape} to {y.shape}.",
                                 rule="the carry keeps its dims and sizes from layer to layer" +
                                      ("" if at is None else ", each carried tensor its own"),
                                 fix="make the block return a tensor shaped like its input" +
                                     ("" if at is None else f" at position {at} of its tuple")))
    if y.dtype != x.dtype:
        raise ShapeError(message(f"repeat: the block maps {what} {x!r} to {y!r}: its dtype changes.",
                                 rule="the carry keeps its dtype from layer to layer (the next layer reads it)",
                                 fix=f"cast the block's result back: md.cast(y, {x.dtype}), or cast the carry "
                                     "before the repeat"))
    if y.shape.names != x.shape.names:
        from ..ops.shape_ops import transpose
        with g:
            y = transpose(y, x.shape.names)
    return y


def _read_back(got, closure: Closure):
    """What the block returned, a loop-invariant result it made (hoisted outside) read back in as a
    closed-over tensor: the carry and the per-layer outputs are the block's own."""
    made = {id(o) for n in closure.hoisted for o in n.outputs}

    def own(t):
        return closure(t) if isinstance(t, Tensor) and id(t) in made else t

    def carry(c):
        return tuple(map(own, c)) if isinstance(c, (tuple, list)) else own(c)

    if isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], dict):
        return carry(got[0]), {k: own(t) for k, t in got[1].items()}
    return carry(got)


def _returned(got) -> str:
    """What is wrong with a block's return value ``got``."""
    several = " (to carry several tensors, pass the carry as a tuple: repeat(block, (h, c), ...))" \
        if isinstance(got, tuple) and got and all(isinstance(t, Tensor) for t in got) else ""
    if isinstance(got, tuple) and len(got) == 2:
        return f"a pair whose second item is a {type(got[1]).__name__}, not a dict of per-layer outputs{several}"
    if isinstance(got, tuple):
        return f"a tuple of {len(got)} items, not a carry or (carry, {{name: tensor}}){several}"
    if isinstance(got, Tensor):
        return "a Tensor made outside the block (the carry must be computed by the block)"
    return "not a Tensor built from its inputs"


def _split_return(got, g: Graph, layer: str, num: int | None) -> tuple[list[Tensor], dict | None]:
    """The carried results (a list: one, or ``num`` for a tuple carry of ``num`` tensors) and the
    per-layer outputs (None if the block returned a carry alone)."""
    ys = None
    if isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], dict):
        got, ys = got
    if num is not None:
        got = _carried(got, g, num)
    elif not isinstance(got, Tensor) or got.graph is not g:
        raise ShapeError(message(f"repeat: the block returned {clip(repr(got), 160)}, {_returned(got)}.",
                                 rule=_RETURNS, fix="return a Tensor computed from the carry, or (carry, "
                                                    "{'name': per-layer tensor}) with a dict"))
    else:
        got = [got]
    for k, t in (ys or {}).items():
        if not isinstance(k, str) or not k or "/" in k or not isinstance(t, Tensor) or t.graph is not g:
            why = " (a tensor made outside the block: not this layer's own)" if isinstance(t, Tensor) \
                and t.graph is not g else ""
            raise ShapeError(message(f"repeat: the block's per-layer output {k!r} is {t!r}{why}.",
                                     rule=_RETURNS + "; names are non-empty strings without '/', values "
                                                     "Tensors the block computed",
                                     fix="return (carry, {'aux': tensor_of_this_layer})"))
        if layer in t.shape.names:
            raise ShapeError(message(f"repeat: the block's per-layer output '{k}' {t.shape} has a '{layer}' dim.",
                                     rule="the repeat stacks each per-layer output over a new leading layer dim",
                                     fix="return the tensor of this layer alone"))
    return got, (dict(ys) if ys is not None else None)


def _carried(got, g: Graph, num: int) -> list[Tensor]:
    """A tuple carry's results as the block returned them, checked: as many Tensors of the block."""
    rule = (f"{_RETURNS}; a carry given as a tuple of {num} tensors comes back as a tuple of {num}, each "
            "shaped like its own")
    if not isinstance(got, (tuple, list)) or len(got) != num:
        what = f"a {type(got).__name__} of {len(got)} items" if isinstance(got, (tuple, list)) else \
            f"{clip(repr(got), 120)} ({type(got).__name__})"
        raise ShapeError(message(f"repeat: the carry is a tuple of {num} tensors, but the block returned {what}.",
                                 rule=rule, fix=f"return a tuple of {num} tensors, one per carried tensor, in the "
                                               "order the block got them"))
    for i, t in enumerate(got):
        if not isinstance(t, Tensor) or t.graph is not g:
            raise ShapeError(message(f"repeat: item {i} of the block's returned carry is {clip(repr(t), 120)}, "
                                     f"{_returned(t)}.", rule=rule,
                                     fix=f"return at position {i} a Tensor the block computed from the carry"))
    return list(got)
