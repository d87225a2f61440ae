"""repeat: one block applied ``layer`` times with stacked params (a scan).

The block is traced once into a sub-graph of its own, so it can be lowered and
differentiated on its own: here the layers run in sequence; a pipeline
schedule can later run the same sub-plan per stage when ``layer`` is split.
The forward also saves, stacked over ``layer``, the block activations its
backward reads (``node.attrs["saved"]``, extra outputs of the repeat node added
when its gradient is first built), so the backward block does not recompute the
forward: those tensors are given values in it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..core.graph import Graph, Tensor, topo_nodes
from ..core.shape import Dim, Shape
from ..errors import ShapeError, did_you_mean, message
from ..ops.leaf import placeholder
from ..ops.registry import Op, apply, register
from .interpret import DenseProgram


@dataclass(eq=False)
class Block:
    """A traced block: ``out = fn(carry, params)`` in its own graph."""

    fn: Callable
    graph: Graph
    carry: Tensor
    params: dict[str, Tensor]
    out: Tensor
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


def _trace(fn, x: Tensor, stacked: dict[str, Tensor], layer: str, name: str) -> Block:
    g = Graph(f"{x.graph.name}/{name}")
    with g:
        c = placeholder("carry", x.shape, x.dtype)
        ps = _LayerParams({k: placeholder(k, p.shape.without([layer]), p.dtype, p.scopes)
                           for k, p in stacked.items()})
        y = fn(c, ps)
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
    return Block(fn, g, c, ps, y)


def _stack_pos(p: Tensor, layer: str) -> int:
    return p.shape.index(layer)


@register
class Repeat(Op):
    name = "repeat"

    def infer(self, inputs, attrs):
        x = inputs[0]
        return [(x.shape, x.dtype), (Shape([attrs["layer"]] + list(x.shape)), x.dtype)]

    def compute(self, ctx, attrs, x, *stacked):
        blk: Block = attrs["block"]
        saved_t = attrs.get("saved", [])
        saved = [f"saved/{i}" for i in range(len(saved_t))]
        prog = blk.dense({"out": blk.out, **dict(zip(saved, saved_t))})
        names, pos = list(blk.params), attrs["pos"]

        def layer(l, x):
            feeds = {"carry": x, **{k: p.select(pos[k], l) for k, p in zip(names, stacked)}}
            r = prog(feeds, salt=l + 1)
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
        gblk = node.attrs.get("grad_block")
        if gblk is None:  # built once; later grads of the same node reuse it and its saved outputs
            blk: Block = node.attrs["block"]
            layer = node.attrs["layer"]
            gblk, pairs = _grad_block(blk, node.attrs["stacked"], layer.name)
            base = len(node.outputs)
            node.outputs = node.outputs + tuple(
                Tensor(node, base + i, Shape([layer] + list(f.shape)), f.dtype) for i, (_, f) in enumerate(pairs))
            node.attrs["saved"] = [f for _, f in pairs]
            node.attrs["grad_block"] = gblk
        outs = apply("repeat_grad", [node.outputs[1], *node.inputs[1:], dy, *node.outputs[2:]],
                     {"block": gblk, "layer": node.attrs["layer"], "pos": node.attrs["pos"],
                      "stacked": node.attrs["stacked"]})
        return list(outs)


def _saved(b: Block, n_fwd: int, blk: Block) -> list[tuple[Tensor, Tensor]]:
    """The forward activations the backward part of grad block ``b`` reads.

    Returns (tensor of ``b``, the same tensor of the forward block ``blk``) pairs: the
    first ``n_fwd`` nodes of ``b`` re-trace ``blk`` node for node.  Placeholders are fed
    anyway; values that do not depend on the carry (constants, functions of the
    layer's params) are cheap to recompute and are not saved.
    """
    outs = [b.extra["dcarry"], *b.extra["dparams"].values()]
    fwd = b.graph.nodes[:n_fwd]
    act: set[int] = {id(b.carry.node)}  # nodes whose outputs depend on the carry
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


def _grad_block(blk: Block, stacked: dict[str, Tensor], layer: str):
    """The backward block, and the (grad-block tensor, forward-block tensor) pairs it is given."""
    from .autodiff import vjp
    from ..ops.shape_ops import broadcast_to
    from ..ops.elementwise import constant

    b = _trace(blk.fn, blk.carry, stacked, layer, "block_grad")
    n_fwd = len(b.graph.nodes)
    if n_fwd != len(blk.graph.nodes):
        raise ShapeError(f"repeat: the block traced differently twice ({len(blk.graph.nodes)} vs {n_fwd} nodes); "
                         "blocks must be deterministic functions of (carry, params)")
    with b.graph:
        dy = placeholder("cotangent", b.out.shape, b.out.dtype)
        wrt = [b.carry] + list(b.params.values())
        grads = vjp([b.out], [dy], wrt)
        fixed = []
        for t, g in zip(wrt, grads):
            if g is None:
                g = broadcast_to(constant(0.0, t.dtype, t), t.shape)
            g = apply("stop_gradient", [g], name=f"grad/{t.name}")
            g.scopes = t.scopes
            fixed.append(g)
    b.extra = {"cotangent": dy, "dcarry": fixed[0], "dparams": dict(zip(b.params, fixed[1:]))}
    pairs = _saved(b, n_fwd, blk)
    b.extra["given"] = {f"saved/{i}": t for i, (t, _) in enumerate(pairs)}
    return b, pairs


@register
class RepeatGrad(Op):
    name = "repeat_grad"

    # inputs: saved layer inputs, stacked params, carry gradient, saved activations (block.extra["given"])

    def infer(self, inputs, attrs):
        carries, *rest = inputs
        stacked, dy = rest[:len(attrs["stacked"])], rest[len(attrs["stacked"])]
        return [(dy.shape, dy.dtype)] + [(p.shape, p.dtype) for p in stacked]

    def compute(self, ctx, attrs, carries, *rest):
        n = len(attrs["stacked"])
        stacked, dy, saved = rest[:n], rest[n], rest[n + 1:]
        blk: Block = attrs["block"]
        outs = {"dcarry": blk.extra["dcarry"], **{f"d/{k}": g for k, g in blk.extra["dparams"].items()}}
        given = blk.extra.get("given", {})
        prog = blk.dense(outs, given)
        names, pos = list(blk.params), attrs["pos"]
        # each layer's gradients go straight into their slice of the stacked result (no stack at the end)
        grads = [torch.empty_like(p) for p in stacked]

        def layer(l, dy):
            feeds = {"carry": carries[l], "cotangent": dy,
                     **{k: p.select(pos[k], l) for k, p in zip(names, stacked)},
                     **{k: s[l] for k, s in zip(given, saved)}}
            r = prog(feeds, salt=l + 1)
            for k, g in zip(names, grads):
                g.select(pos[k], l).copy_(r[f"d/{k}"])
            return r["dcarry"], None

        dy, _ = run_layers(attrs["layer"].size, layer, dy, backward=True)
        return (dy, *grads)

    def subgraphs(self, node):
        blk: Block = node.attrs["block"]
        return ((blk.graph, tuple(blk.params)),)


def repeat(block: Callable, x: Tensor, params: dict[str, Tensor], dim) -> Tensor:
    """Apply ``block`` once per entry of ``dim`` with that entry's slice of each stacked param.

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
    blk = _trace(block, x, params, name, "block")
    pos = {k: _stack_pos(p, name) for k, p in params.items()}
    outs = apply("repeat", [x, *params.values()], {"block": blk, "layer": layer, "pos": pos, "stacked": dict(params)})
    return outs[0]
