"""repeat: one block applied ``layer`` times with stacked params (a scan).

The block is traced once into a sub-graph of its own (:mod:`.block`), so it can be
lowered and differentiated on its own: here the layers run in sequence; a pipeline
schedule can later run the same sub-plan per stage when ``layer`` is split.

The carry is one tensor or a tuple of them (an LSTM's ``(h, c)``, Evoformer's MSA and pair
tracks), each carried tensor its own input and output of the node, with its own shape and
layout: nothing joins them.  The repeat node's inputs are the carried tensors, the stacked
params and the closed-over tensors; its outputs are the last carry (one per carried
tensor), the layer inputs stacked over ``layer`` (each layer's input, which its backward
reads; again one per carried tensor), the block's per-layer outputs stacked over
``layer`` (when it returns ``(carry, {name: tensor})``), and the activations its backward
reads that the remat policy saves (``node.attrs["saved"]``, extra outputs added when its
gradient is first built, :mod:`.repeat_grad`).

The block may also read tensors of the graph around it (:mod:`.closure`): they are
extra inputs of the repeat node after the stacked params, the same for every layer,
and the gradient of each (those the loss's gradient flows into) is the sum of its
layers' gradients.
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Callable

import torch

from ..core.graph import Graph, Tensor, graph_of, not_a_tensor
from ..core.shape import Dim, Shape
from ..errors import GraphError, ShapeError, clip, message
from ..ops.embed import arange
from ..ops.registry import Op, apply, register
from .block import Block, LayerStack, carry_name, run_layers, trace
from .remat import parse_remat
from .repeat_grad import repeat_vjp

__all__ = ["repeat", "Block", "LayerStack", "run_layers"]


def _stack_pos(p: Tensor, layer: str) -> int:
    return p.shape.index(layer)


def num_fixed_outputs(blk: Block) -> int:
    """The repeat node's outputs before the saved activations: carries, layer inputs, per-layer outputs."""
    return 2 * blk.num_carries + len(blk.y_names)


@register
class Repeat(Op):
    name = "repeat"

    def infer(self, inputs, attrs):
        layer, blk = attrs["layer"], attrs["block"]
        xs = inputs[:blk.num_carries]
        return [*[(x.shape, x.dtype) for x in xs], *[(Shape([layer] + list(x.shape)), x.dtype) for x in xs],
                *[(Shape([layer] + list(y.shape)), y.dtype) for y in (blk.ys or {}).values()]]

    def compute(self, ctx, attrs, *ins):
        blk: Block = attrs["block"]
        saved_t, ys, k = attrs.get("saved", []), blk.y_names, blk.num_carries
        saved = [f"saved/{i}" for i in range(len(saved_t))]
        outs = {carry_name("out", i): y for i, y in enumerate(blk.outs)}
        prog = blk.dense({**outs, **{f"y/{k}": blk.ys[k] for k in ys}, **dict(zip(saved, saved_t))})
        names, pos = list(blk.params), attrs["pos"]
        xs, rest = tuple(ins[:k]), ins[k:]
        stacked, closed = rest[:len(names)], dict(zip(blk.closed, rest[len(names):]))

        def layer(l, xs):
            feeds = {**{carry_name("carry", i): x for i, x in enumerate(xs)},
                     **{k: p.select(pos[k], l) for k, p in zip(names, stacked)}, **closed}
            r = prog(feeds, salt=ctx.salt + l + 1)
            return tuple(r[o] for o in outs), (*xs, *[r[f"y/{k}"] for k in ys], *[r[k] for k in saved])

        xs, kept = run_layers(attrs["layer"].size, layer, xs)
        n_ys = len(ys)
        return (*xs, *[LayerStack(kp[i] for kp in kept) for i in range(k)],
                *[torch.stack([kp[k + i] for kp in kept], 0) for i in range(n_ys)],
                *[LayerStack(kp[k + n_ys + i] for kp in kept) for i in range(len(saved))])

    def subgraphs(self, node):
        blk: Block = node.attrs["block"]
        return ((blk.graph, tuple(blk.params)),)

    def drop_unused_outputs(self, node, used):
        n = num_fixed_outputs(node.attrs["block"])
        if node.attrs.get("saved") and not any(used[n:]):
            return {**node.attrs, "saved": []}, n  # no backward reads them: keep no activations
        return None

    def grad(self, node, douts):
        blk = node.attrs["block"]
        n, k = num_fixed_outputs(blk), blk.num_carries
        dy, dcarries, dys, dsaved = douts[:k], douts[k:2 * k], douts[2 * k:n], douts[n:]
        if any(d is not None for d in dcarries) or any(d is not None for d in dsaved):
            raise ShapeError("repeat: gradients through the saved layer inputs are not supported")
        return repeat_vjp(node, list(dy), list(dys))


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


_USAGE = ("repeat(block, x, {name: stacked param}, 'layer'), block(carry, params) -> new carry; x a Tensor or a "
          "tuple of Tensors (block(carry, params) then returns a tuple of as many, each shaped like its own)")


def _check_arguments(block, x, params, dim) -> None:
    """repeat's arguments are of the kinds its signature names (before any is read)."""
    if not callable(block):
        raise GraphError(message(f"repeat: block is {block!r} ({type(block).__name__}), not a function.",
                                 rule=_USAGE, fix="pass a function of (carry, params), e.g. def block(h, p): ..."))
    try:
        inspect.signature(block).bind(x, params)
    except TypeError as e:
        raise GraphError(message(f"repeat: the block cannot be called as block(carry, params): {e}.",
                                 rule=_USAGE,
                                 fix="give the block two parameters, the carry and the dict of this layer's "
                                     "params (ignore the second if it reads none)")) from None
    except ValueError:  # a callable whose signature Python cannot read (a builtin): let the call say
        pass
    if isinstance(x, (tuple, list)):
        _check_tuple_carry(x)
    elif not isinstance(x, Tensor):
        raise not_a_tensor("repeat", "the carry x", x)
    if not isinstance(params, Mapping) or not all(isinstance(k, str) and isinstance(p, Tensor)
                                                  for k, p in params.items()):
        bad = params if not isinstance(params, Mapping) else {
            k: p for k, p in params.items() if not (isinstance(k, str) and isinstance(p, Tensor))}
        raise ShapeError(message(f"repeat: params must be a dict {{name: stacked param}}, got {clip(repr(bad), 80)}.",
                                 rule=_USAGE + "; params[name] in the block is that param's slice for the layer",
                                 fix="pass e.g. {'w': w} with w = md.param('w', [Dim('layer', N), ...])"))
    if not isinstance(dim, (str, Dim)):
        raise ShapeError(message(f"repeat: dim is {dim!r} ({type(dim).__name__}), not a dim name or Dim.",
                                 rule=_USAGE, fix="pass the layer dim's name, e.g. 'layer'"))


def _check_tuple_carry(x) -> None:
    """A tuple carry holds one or more Tensors of one graph."""
    if not x:
        raise ShapeError(message(f"repeat: the carry x is an empty {type(x).__name__}.", rule=_USAGE,
                                 fix="pass the tensor the layers hand on, or a tuple of them, e.g. (h, c)"))
    for i, t in enumerate(x):
        if not isinstance(t, Tensor):
            raise ShapeError(message(
                f"repeat: item {i} of the carry x is {clip(repr(t), 80)} ({type(t).__name__}), not a Tensor.",
                inputs=[f"carry: a {type(x).__name__} of {len(x)} items"], rule=_USAGE,
                fix=f"pass a meshdsl Tensor at position {i} (md.input, md.param or an op's result); a value every "
                    "layer reads unchanged is read from outside the block, not carried"))
    if len({id(t.graph) for t in x}) > 1:
        raise GraphError(message("repeat: the carried tensors belong to different graphs.",
                                 inputs=[f"carry[{i}]: {t!r} of graph '{t.graph.name}'" for i, t in enumerate(x)],
                                 rule="a repeat's carried tensors are tensors of the graph that calls it",
                                 fix="build every carried tensor in the same graph"))


def _layer_of(params: dict, name: str, dim) -> Dim:
    """The layer Dim: every stacked param's ``name`` dim, one size (``dim`` itself with none)."""
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
    return layer


def _check_no_layer_dim(xs: tuple, name: str, tupled: bool) -> None:
    """No carried tensor has the layer dim (the position named for a tuple carry's)."""
    for i, t in enumerate(xs):
        if name in t.shape:
            what = f"item {i} of the carry, {t!r}," if tupled else f"the carry {t!r}"
            raise ShapeError(message(f"repeat: {what} has the layer dim '{name}'.",
                                     rule="repeat loops over the layer dim: the stacked params have it, the carry "
                                          "(what one layer hands the next) does not",
                                     fix=f"pass a carry without '{name}' (slice or reduce it first), or loop over "
                                         "another dim"))


#: the stacked input of a repeat given no stacked params (its layer index, unseen by the block)
LAYER_INDEX = "layer_index"


def repeat(block: Callable, x: Tensor, params: dict[str, Tensor], dim, remat=None):
    """Apply ``block`` once per entry of ``dim`` with that entry's slice of each stacked param.

    The block may also read any tensor of the graph that calls ``repeat`` (an input, a
    constant, a param not stacked along ``dim``, an activation computed before the stack,
    such as an encoder's output): every layer reads it unchanged, and its gradient is the
    sum of the layers' gradients.

    Args:
      block: ``block(carry, params) -> new carry``, or ``-> (new carry, {name: tensor})``
        with per-layer outputs besides the carry (an auxiliary loss, router statistics); for
        a tuple carry ``x`` the new carry is a tuple of as many tensors, each shaped like its own;
        ``params`` maps the names given here to per-layer tensors (the stacked params
        without ``dim``).
      x: the initial carry: a Tensor, or a tuple of Tensors (an LSTM's ``(h, c)``; MSA and pair
        tracks of different shapes), each carried with its own shape and its own layout (no concat:
        ``hidden:model`` splits ``h`` and ``c`` each, and nothing moves between them).
      params: name -> stacked param, each with dim ``dim``; ``{}`` when every layer reads the
        same weights from outside (ALBERT's shared layer): the layers still split and pipeline
        over ``dim`` (``"layer:stage"``), each stage summing its layers' gradients of them.
      dim: the layer Dim (or its name).
      remat: what each layer saves for its backward (:mod:`meshdsl.ir.remat`): ``"none"``
        (default: every activation its backward reads), ``"full"`` (only its input; the
        backward recomputes the layer), ``"selective"`` (the outputs of the einsums; the
        fused attention kernel and the cheap ops are recomputed) or ``"save:OP,..."``.
        ``md.grad(..., remat=)`` (``--remat``) overrides it.

    Returns:
      The carry after the last layer (a tuple for a tuple ``x``); with per-layer outputs,
      ``(carry, {name: stacked})``,
      each stacked tensor having ``dim`` first.  The loss may read them: their gradients
      flow back into each layer.

    Example::

        y = repeat(lambda h, p: h + relu(einsum("b d, d f -> b f", h, p["w"])) ..., x, {"w": w}, layer)
        # a decoder whose layers read the encoder's output enc (cross-attention)
        y = repeat(lambda h, p: h + cross_attention(h, enc, p), tgt, dec_params, "layer")
        # an LSTM over time: two carried tensors, each split like its own dims ("hidden:model")
        h, c = repeat(lambda hc, p: lstm_cell(*hc, p), (h0, c0), {"x": xs}, "time")
        # MoE blocks with a load-balancing loss per layer, summed into the loss
        y, per_layer = repeat(lambda h, p: moe_block(h, p), x, blocks, "layer", remat="selective")
        loss = lm_loss(y) + 0.01 * reduce_sum(per_layer["aux"], "layer")

    Raises:
      ShapeError: a stacked param without ``dim``, a carried tensor with it or not a Tensor, or the
        block's result not shaped like ``x`` (a tuple of another length; the position is named).
      GraphError: the block reads a tensor of a graph that does not enclose it; an unknown
        remat policy.
    """
    _check_arguments(block, x, params, dim)
    name = dim.name if isinstance(dim, Dim) else dim
    tupled = isinstance(x, (tuple, list))
    xs = tuple(x) if tupled else (x,)
    _check_no_layer_dim(xs, name, tupled)
    policy = parse_remat(remat, "repeat(remat=...)")
    layer = _layer_of(params, name, dim)
    if not params:   # weights shared by every layer (ALBERT): a stacked layer index the block does not see lets a
        # layout cut the layers as any stack's (a pipeline finds a repeat's layers by its stacked tensors)
        params, user_block = {LAYER_INDEX: arange(layer, torch.float32)}, block

        def block(h, _):
            return user_block(h, {})
    _check_depth(xs[0].graph, layer, params)
    blk = trace(block, xs if tupled else x, params, name, "block", graph_of(xs[0]))  # x's graph, or the block traced
    pos = {k: _stack_pos(p, name) for k, p in params.items()}
    attrs = {"block": blk, "layer": layer, "pos": pos, "stacked": dict(params)}
    if remat is not None:
        attrs["remat"] = policy
    outs = apply("repeat", [*xs, *params.values(), *blk.outer], attrs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    k = len(xs)
    carry = tuple(outs[:k]) if tupled else outs[0]
    if blk.ys is None:
        return carry
    return carry, {y: outs[2 * k + i] for i, y in enumerate(blk.y_names)}
