"""repeat: one block applied ``layer`` times with stacked params (a scan).

The block is traced once into a sub-graph of its own (:mod:`.block`), so it can be
lowered and differentiated on its own: here the layers run in sequence; a pipeline
schedule can later run the same sub-plan per stage when ``layer`` is split.

The repeat node's outputs are the last carry, the layer inputs stacked over ``layer``
(each layer's input, which its backward reads), the block's per-layer outputs
stacked over ``layer`` (when it returns ``(carry, {name: tensor})``), and the
activations its backward reads that the remat policy saves (``node.attrs["saved"]``,
extra outputs added when its gradient is first built, :mod:`.repeat_grad`).

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
from .block import Block, LayerStack, run_layers, trace
from .remat import parse_remat
from .repeat_grad import repeat_vjp

__all__ = ["repeat", "Block", "LayerStack", "run_layers"]


def _stack_pos(p: Tensor, layer: str) -> int:
    return p.shape.index(layer)


def num_fixed_outputs(blk: Block) -> int:
    """The repeat node's outputs before the saved activations: carry, layer inputs, per-layer outputs."""
    return 2 + len(blk.y_names)


@register
class Repeat(Op):
    name = "repeat"

    def infer(self, inputs, attrs):
        x, layer, blk = inputs[0], attrs["layer"], attrs["block"]
        return [(x.shape, x.dtype), (Shape([layer] + list(x.shape)), x.dtype),
                *[(Shape([layer] + list(y.shape)), y.dtype) for y in (blk.ys or {}).values()]]

    def compute(self, ctx, attrs, x, *rest):
        blk: Block = attrs["block"]
        saved_t, ys = attrs.get("saved", []), blk.y_names
        saved = [f"saved/{i}" for i in range(len(saved_t))]
        prog = blk.dense({"out": blk.out, **{f"y/{k}": blk.ys[k] for k in ys}, **dict(zip(saved, saved_t))})
        names, pos = list(blk.params), attrs["pos"]
        stacked, closed = rest[:len(names)], dict(zip(blk.closed, rest[len(names):]))

        def layer(l, x):
            feeds = {"carry": x, **{k: p.select(pos[k], l) for k, p in zip(names, stacked)}, **closed}
            r = prog(feeds, salt=ctx.salt + l + 1)
            return r["out"], (x, *[r[f"y/{k}"] for k in ys], *[r[k] for k in saved])

        x, kept = run_layers(attrs["layer"].size, layer, x)
        n_ys = len(ys)
        return (x, LayerStack(k[0] for k in kept), *[torch.stack([k[1 + i] for k in kept], 0) for i in range(n_ys)],
                *[LayerStack(k[1 + n_ys + i] for k in kept) for i in range(len(saved))])

    def subgraphs(self, node):
        blk: Block = node.attrs["block"]
        return ((blk.graph, tuple(blk.params)),)

    def drop_unused_outputs(self, node, used):
        n = num_fixed_outputs(node.attrs["block"])
        if node.attrs.get("saved") and not any(used[n:]):
            return {**node.attrs, "saved": []}, n  # no backward reads them: keep no activations
        return None

    def grad(self, node, douts):
        n = num_fixed_outputs(node.attrs["block"])
        dy, dcarries, dys, dsaved = douts[0], douts[1], douts[2:n], douts[n:]
        if dcarries is not None or any(d is not None for d in dsaved):
            raise ShapeError("repeat: gradients through the saved layer inputs are not supported")
        return repeat_vjp(node, dy, list(dys))


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


_USAGE = "repeat(block, x, {name: stacked param}, 'layer'), block(carry, params) -> new carry"


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
    if isinstance(x, (tuple, list)) and x and all(isinstance(t, Tensor) for t in x):
        raise ShapeError(message(
            f"repeat: the carry x is a {type(x).__name__} of {len(x)} Tensors; a repeat carries one Tensor.",
            rule=_USAGE,
            fix="join them into one along a dim they share after a rename, e.g. md.concat([md.rename(h, f='c'), "
                "md.rename(pos, xyz='c')], 'c'), and cut them apart at the block's start with md.slice_ "
                "(tests/heldout_egnn.py)"))
    if not isinstance(x, Tensor):
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
        with per-layer outputs besides the carry (an auxiliary loss, router statistics);
        ``params`` maps the names given here to per-layer tensors (the stacked params
        without ``dim``).
      x: the initial carry.
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
      The carry after the last layer; with per-layer outputs, ``(carry, {name: stacked})``,
      each stacked tensor having ``dim`` first.  The loss may read them: their gradients
      flow back into each layer.

    Example::

        y = repeat(lambda h, p: h + relu(einsum("b d, d f -> b f", h, p["w"])) ..., x, {"w": w}, layer)
        # a decoder whose layers read the encoder's output enc (cross-attention)
        y = repeat(lambda h, p: h + cross_attention(h, enc, p), tgt, dec_params, "layer")
        # MoE blocks with a load-balancing loss per layer, summed into the loss
        y, per_layer = repeat(lambda h, p: moe_block(h, p), x, blocks, "layer", remat="selective")
        loss = lm_loss(y) + 0.01 * reduce_sum(per_layer["aux"], "layer")

    Raises:
      ShapeError: a stacked param without ``dim``, or the block's result not shaped like ``x``.
      GraphError: the block reads a tensor of a graph that does not enclose it; an unknown
        remat policy.
    """
    _check_arguments(block, x, params, dim)
    name = dim.name if isinstance(dim, Dim) else dim
    if name in x.shape:
        raise ShapeError(message(f"repeat: the carry {x!r} has the layer dim '{name}'.",
                                 rule="repeat loops over the layer dim: the stacked params have it, the carry "
                                      "(what one layer hands the next) does not",
                                 fix=f"pass a carry without '{name}' (slice or reduce it first), or loop over "
                                     "another dim"))
    policy = parse_remat(remat, "repeat(remat=...)")
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
    if not params:   # weights shared by every layer (ALBERT): a stacked layer index the block does not see lets a
        # layout cut the layers as any stack's (a pipeline finds a repeat's layers by its stacked tensors)
        params, user_block = {LAYER_INDEX: arange(layer, torch.float32)}, block

        def block(h, _):
            return user_block(h, {})
    _check_depth(x.graph, layer, params)
    blk = trace(block, x, params, name, "block", graph_of(x))  # x's graph, or the block being traced
    pos = {k: _stack_pos(p, name) for k, p in params.items()}
    attrs = {"block": blk, "layer": layer, "pos": pos, "stacked": dict(params)}
    if remat is not None:
        attrs["remat"] = policy
    outs = apply("repeat", [x, *params.values(), *blk.outer], attrs)
    if blk.ys is None:
        return outs[0]
    return outs[0], {k: outs[2 + i] for i, k in enumerate(blk.y_names)}
