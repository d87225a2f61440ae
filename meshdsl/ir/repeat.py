"""repeat: one block applied ``layer`` times with stacked params (a scan).

The block is traced once into a sub-graph of its own, so it can be lowered and
differentiated on its own: here the layers run in sequence; a pipeline
schedule can later run the same sub-plan per stage when ``layer`` is split.
The forward also saves, stacked over ``layer``, the block activations its
backward reads (``node.attrs["saved"]``, extra outputs of the repeat node added
when its gradient is first built), so the backward block does not recompute the
forward: those tensors are given values in it.

The block may also read tensors of the graph around it (:mod:`.closure`): they are
extra inputs of the repeat node after the stacked params, the same for every layer,
and the gradient of each (those the loss's gradient flows into) is the sum of its
layers' gradients.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..core.graph import Graph, Tensor, graph_of, topo_nodes
from ..core.shape import Dim, Shape
from ..errors import ShapeError, did_you_mean, message
from ..ops.leaf import placeholder
from ..ops.registry import Op, apply, register
from .closure import Closure, activations
from .interpret import DenseProgram


@dataclass(eq=False)
class Block:
    """A traced block: ``out = fn(carry, params)`` in its own graph."""

    fn: Callable
    graph: Graph
    carry: Tensor
    params: dict[str, Tensor]
    out: Tensor
    closed: dict[str, Tensor] = field(default_factory=dict)  # placeholders of the tensors read from outside
    outer: list = field(default_factory=list)  # those tensors (of the graph that calls repeat), in that order
    extra: dict = field(default_factory=dict)  # cotangent placeholder, grads, given (for grad blocks)
    _dense: dict = field(default_factory=dict)

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


def _trace(fn, x: Tensor, stacked: dict[str, Tensor], layer: str, name: str, outer: Graph) -> Block:
    g = Graph(f"{outer.name}/{name}")
    g.outer = outer
    g.capture = closure = Closure(g)
    try:
        with g:
            c = placeholder("carry", x.shape, x.dtype)
            ps = _LayerParams({k: placeholder(k, p.shape.without([layer]), p.dtype, p.scopes)
                               for k, p in stacked.items()})
            y = fn(c, ps)
    finally:
        closure.open = False
    if not isinstance(y, Tensor) or y.graph is not g:
        raise ShapeError(message(f"repeat: the block returned {y!r}, not a Tensor built from its inputs.",
                                 rule="block(carry, params) returns the new carry",
                                 fix="return a Tensor computed from the carry"))
    if sorted(y.shape.names) != sorted(x.shape.names) or set(y.shape) != set(x.shape):
        raise ShapeError(message(f"repeat: the block maps carry {x.shape} to {y.shape}.",
                                 rule="the carry keeps its dims and sizes from layer to layer",
                                 fix="make the block return a tensor shaped like its input"))
    if y.shape.names != x.shape.names:
        from ..ops.shape_ops import transpose
        with g:
            y = transpose(y, x.shape.names)
    return Block(fn, g, c, ps, y, closure.inner, closure.outer)


def _stack_pos(p: Tensor, layer: str) -> int:
    return p.shape.index(layer)


@register
class Repeat(Op):
    name = "repeat"

    def infer(self, inputs, attrs):
        x = inputs[0]
        return [(x.shape, x.dtype), (Shape([attrs["layer"]] + list(x.shape)), x.dtype)]

    def compute(self, ctx, attrs, x, *rest):
        blk: Block = attrs["block"]
        saved_t = attrs.get("saved", [])
        saved = [f"saved/{i}" for i in range(len(saved_t))]
        prog = blk.dense({"out": blk.out, **dict(zip(saved, saved_t))})
        names, pos = list(blk.params), attrs["pos"]
        stacked, closed = rest[:len(names)], dict(zip(blk.closed, rest[len(names):]))

        def layer(l, x):
            feeds = {"carry": x, **{k: p.select(pos[k], l) for k, p in zip(names, stacked)}, **closed}
            r = prog(feeds, salt=ctx.salt + l + 1)
            return r["out"], (x, *[r[k] for k in saved])

        x, kept = run_layers(attrs["layer"].size, layer, x)
        return (x, *[LayerStack(k[i] for k in kept) for i in range(1 + len(saved))])

    def subgraphs(self, node):
        blk: Block = node.attrs["block"]
        return ((blk.graph, tuple(blk.params)),)

    def drop_unused_outputs(self, node, used):
        if node.attrs.get("saved") and not any(used[2:]):
            return {**node.attrs, "saved": []}, 2  # no backward reads them: keep no activations
        return None

    def grad(self, node, douts):
        dy, dcarries, *dsaved = douts
        if dcarries is not None or any(d is not None for d in dsaved):
            raise ShapeError("repeat: gradients through the saved layer inputs are not supported")
        if dy is None:
            return [None] * len(node.inputs)
        from .autodiff import wants_grad
        blk: Block = node.attrs["block"]
        num_stacked = len(blk.params)
        stacked_t, closed_t = node.inputs[1:1 + num_stacked], node.inputs[1 + num_stacked:]
        # the closed-over tensors the loss's gradient flows into: the block is differentiated
        # with respect to those only (a constant table or an input gets no gradient)
        want = tuple(wants_grad(t) for t in closed_t)
        built = node.attrs.setdefault("grad_blocks", {})
        if want not in built:  # built once per set; later grads reuse it and its saved outputs
            layer = node.attrs["layer"]
            gblk, pairs = _grad_block(blk, node.attrs["stacked"], layer.name, node.graph, want)
            base = len(node.outputs)
            node.outputs = node.outputs + tuple(
                Tensor(node, base + i, Shape([layer] + list(f.shape)), f.dtype) for i, (_, f) in enumerate(pairs))
            node.attrs["saved"] = node.attrs.get("saved", []) + [f for _, f in pairs]
            built[want] = (gblk, base, len(node.outputs))
        gblk, lo, hi = built[want]
        outs = apply("repeat_grad", [node.outputs[1], *stacked_t, dy, *node.outputs[lo:hi], *closed_t],
                     {"block": gblk, "layer": node.attrs["layer"], "pos": node.attrs["pos"],
                      "stacked": node.attrs["stacked"]})
        outs = list(outs) if isinstance(outs, tuple) else [outs]
        dclosed = iter(outs[1 + num_stacked:])
        return outs[:1 + num_stacked] + [next(dclosed) if w else None for w in want]


def _saved(b: Block, n_fwd: int, blk: Block) -> list[tuple[Tensor, Tensor]]:
    """The forward activations the backward part of grad block ``b`` reads.

    Returns (tensor of ``b``, the same tensor of the forward block ``blk``) pairs: the
    first ``n_fwd`` nodes of ``b`` re-trace ``blk`` node for node.  Placeholders are fed
    anyway; values that do not depend on the carry or on a closed-over activation
    (constants, functions of the layer's params or of tables) are cheap to recompute
    and are not saved.
    """
    outs = [b.extra["dcarry"], *b.extra["dparams"].values(), *b.extra["dclosed"].values()]
    fwd = b.graph.nodes[:n_fwd]
    # nodes whose outputs depend on the carry or on a closed-over activation
    act: set[int] = {id(b.carry.node), *(id(t.node) for t in activations(b.closed, b.outer))}
    for n in fwd:
        if any(id(t.node) in act for t in n.inputs):
            act.add(id(n))
    pairs, seen = [], set()
    for n in topo_nodes(outs):
        if n.id < n_fwd:
            continue
        for t in n.inputs:
            src = t.node
            if src.id >= n_fwd or id(t) in seen or src.op.name == "placeholder" or id(src) not in act:
                continue
            seen.add(id(t))
            f = blk.graph.nodes[src.id]
            if f.op is not src.op or len(f.outputs) != len(src.outputs):
                raise ShapeError(f"repeat: the block traced differently twice ({f!r} vs {src!r}); "
                                 "blocks must be deterministic functions of (carry, params)")
            pairs.append((t, f.outputs[t.index]))
    return pairs


def _grad_block(blk: Block, stacked: dict[str, Tensor], layer: str, outer: Graph, want: tuple[bool, ...]):
    """The backward block, and the (grad-block tensor, forward-block tensor) pairs it is given.

    ``want``: per closed-over tensor, whether the backward block outputs its gradient
    (``extra["dclosed"]``, by placeholder name).
    """
    from .autodiff import vjp
    from ..ops.shape_ops import broadcast_to
    from ..ops.elementwise import constant

    b = _trace(blk.fn, blk.carry, stacked, layer, "block_grad", outer)
    n_fwd = len(b.graph.nodes)
    if n_fwd != len(blk.graph.nodes) or [id(t) for t in b.outer] != [id(t) for t in blk.outer]:
        raise ShapeError(f"repeat: the block traced differently twice ({len(blk.graph.nodes)} vs {n_fwd} nodes, "
                         f"reading {[t.name for t in blk.outer]} vs {[t.name for t in b.outer]} from outside); "
                         "blocks must be deterministic functions of (carry, params)")
    closed = [k for k, w in zip(b.closed, want) if w]
    with b.graph:
        dy = placeholder("cotangent", b.out.shape, b.out.dtype)
        wrt = [b.carry] + list(b.params.values()) + [b.closed[k] for k in closed]
        grads = vjp([b.out], [dy], wrt)
        fixed = []
        for t, g in zip(wrt, grads):
            if g is None:
                g = broadcast_to(constant(0.0, t.dtype, t), t.shape)
            g = apply("stop_gradient", [g], name=f"grad/{t.name}")
            g.scopes = t.scopes
            fixed.append(g)
    n = 1 + len(b.params)
    b.extra = {"cotangent": dy, "dcarry": fixed[0], "dparams": dict(zip(b.params, fixed[1:n])),
               "dclosed": dict(zip(closed, fixed[n:]))}
    pairs = _saved(b, n_fwd, blk)
    b.extra["given"] = {f"saved/{i}": t for i, (t, _) in enumerate(pairs)}
    return b, pairs


@register
class RepeatGrad(Op):
    name = "repeat_grad"

    # inputs: saved layer inputs, stacked params, carry gradient, saved activations (block.extra["given"]),
    # closed-over tensors (block.closed); outputs: carry gradient, stacked gradients, and the gradient
    # of each closed-over tensor in block.extra["dclosed"], summed over the layers

    def infer(self, inputs, attrs):
        carries, *rest = inputs
        stacked, dy = rest[:len(attrs["stacked"])], rest[len(attrs["stacked"])]
        blk: Block = attrs["block"]
        closed = dict(zip(blk.closed, rest[len(rest) - len(blk.closed):]))
        return [(dy.shape, dy.dtype)] + [(p.shape, p.dtype) for p in stacked] + \
            [(closed[k].shape, closed[k].dtype) for k in blk.extra["dclosed"]]

    def compute(self, ctx, attrs, carries, *rest):
        n = len(attrs["stacked"])
        blk: Block = attrs["block"]
        given = blk.extra.get("given", {})
        stacked, dy, saved = rest[:n], rest[n], rest[n + 1:n + 1 + len(given)]
        closed = dict(zip(blk.closed, rest[n + 1 + len(given):]))
        outs = {"dcarry": blk.extra["dcarry"], **{f"d/{k}": g for k, g in blk.extra["dparams"].items()},
                **{f"d/{k}": g for k, g in blk.extra["dclosed"].items()}}
        prog = blk.dense(outs, given)
        names, pos = list(blk.params), attrs["pos"]
        # each layer's gradients go straight into their slice of the stacked result (no stack at the end)
        grads = [torch.empty_like(p) for p in stacked]
        sums = {k: torch.zeros_like(closed[k]) for k in blk.extra["dclosed"]}  # a closed-over tensor's: all layers'

        def layer(l, dy):
            feeds = {"carry": carries[l], "cotangent": dy,
                     **{k: p.select(pos[k], l) for k, p in zip(names, stacked)},
                     **{k: s[l] for k, s in zip(given, saved)}, **closed}
            r = prog(feeds, salt=ctx.salt + l + 1)
            for k, g in zip(names, grads):
                g.select(pos[k], l).copy_(r[f"d/{k}"])
            for k, g in sums.items():
                g.add_(r[f"d/{k}"])
            return r["dcarry"], None

        dy, _ = run_layers(attrs["layer"].size, layer, dy, backward=True)
        return (dy, *grads, *sums.values())

    def subgraphs(self, node):
        blk: Block = node.attrs["block"]
        return ((blk.graph, tuple(blk.params)),)


def _check_depth(graph: Graph, layer: Dim, params: dict) -> None:
    """Refuse a stack whose layer dim has the name of an earlier stack's but another size."""
    for n in graph.nodes:
        other = n.attrs["layer"] if n.op.name == "repeat" else layer
        if other.name == layer.name and other.size != layer.size:
            raise ShapeError(message(
                f"repeat: this stack has {layer!r}, but stack '{n.name}' of graph '{graph.name}' has {other!r}.",
                inputs=[f"stack '{n.name}': params {[t.name for t in n.attrs['stacked'].values()]}, "
                        f"{other.size} layers", f"this stack: params {[t.name for t in params.values()]}, "
                                                f"{layer.size} layers"],
                rule="a dim name means one size (as in every op's operands): a layout splits dims by name, "
                     f"so '{layer.name}:<axis>' would pipeline both stacks",
                fix=f"name the stacks' dims apart, e.g. Dim('enc_{layer.name}', {other.size}) and "
                    f"Dim('dec_{layer.name}', {layer.size})"))


def repeat(block: Callable, x: Tensor, params: dict[str, Tensor], dim) -> Tensor:
    """Apply ``block`` once per entry of ``dim`` with that entry's slice of each stacked param.

    The block may also read any tensor of the graph that calls ``repeat`` (an input, a
    constant, a param not stacked along ``dim``, an activation computed before the stack,
    such as an encoder's output): every layer reads it unchanged, and its gradient is the
    sum of the layers' gradients.

    Args:
      block: ``block(carry, params) -> new carry``; ``params`` maps the names given
        here to per-layer tensors (the stacked params without ``dim``).
      x: the initial carry.
      params: name -> stacked param, each with dim ``dim``.
      dim: the layer Dim (or its name).

    Returns:
      The carry after the last layer.

    Example::

        y = repeat(lambda h, p: h + relu(einsum("b d, d f -> b f", h, p["w"])) ..., x, {"w": w}, layer)
        # a decoder whose layers read the encoder's output enc (cross-attention)
        y = repeat(lambda h, p: h + cross_attention(h, enc, p), tgt, dec_params, "layer")

    Raises:
      ShapeError: a stacked param without ``dim``, or the block's result not shaped like ``x``.
      GraphError: the block reads a tensor of a graph that does not enclose it.
    """
    name = dim.name if isinstance(dim, Dim) else dim
    for k, p in params.items():
        if name not in p.shape:
            raise ShapeError(message(f"repeat: stacked param '{k}' {p.shape} has no '{name}' dim.",
                                     rule="every stacked param has the layer dim",
                                     fix=f"add Dim('{name}', N) to its shape"))
    sizes = {p.shape.get(name).size for p in params.values()}
    layer = next(iter(params.values())).shape.get(name) if params else (dim if isinstance(dim, Dim) else None)
    if layer is None or len(sizes) > 1:
        raise ShapeError(message(f"repeat: the stacked params disagree on (or lack) the size of '{name}': {sizes}.",
                                 rule="one layer count for all stacked params", fix="give them the same layer Dim"))
    _check_depth(x.graph, layer, params)
    blk = _trace(block, x, params, name, "block", graph_of(x))  # x's graph, or the block being traced
    pos = {k: _stack_pos(p, name) for k, p in params.items()}
    outs = apply("repeat", [x, *params.values(), *blk.outer],
                 {"block": blk, "layer": layer, "pos": pos, "stacked": dict(params)})
    return outs[0]
