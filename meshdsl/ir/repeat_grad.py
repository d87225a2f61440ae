"""The gradient of a repeat: its backward block, and what the forward saves for it.

The backward block re-traces the forward block and differentiates it with respect to
the carry, the layer's params and the closed-over tensors the loss's gradient flows
into, given the carry's cotangent and those of the per-layer outputs the loss reads.
Of the forward activations its backward part reads, the remat policy
(:mod:`.remat`) picks those the forward saves: they become extra stacked outputs of
the repeat node (``node.attrs["saved"]``, added when a gradient is first built) and
are given values in the backward block; the rest is recomputed there from them and
from the layer's input, which the repeat always keeps.

A repeat nested in the block (an RNN over time in each layer) is differentiated in the re-trace,
so its saved activations are outputs of the re-trace's nested repeat only.  Where the policy
saves them (``none``: every activation), the forward block's nested repeat is made to output
them too (:func:`_mirror_saved`): the forward saves them, stacked over the outer layers, and the
backward runs the nested repeat's gradient on them, not the nested repeat again with its
collectives (an RNN under ``hidden:model``: ``time`` gathers of ``h`` a layer, not ``2 x time``).
Its per-step carries, which its gradient given those activations may not read (the RNN reads the
gathered ``h`` it saved), are then given as zeros, not saved (:func:`_layer_inputs`).
"""
from __future__ import annotations

import torch

from ..core.graph import Tensor, topo_nodes
from ..core.shape import Shape
from ..errors import ShapeError
from ..ops.leaf import placeholder
from ..ops.registry import Op, apply, register
from .block import Block, carry_name, run_layers, trace
from .closure import activations
from .remat import check_names_something, chosen, differentiating, policy_of, saving_outside

#: Ops that sum or take an extreme over dims (:func:`_param_reductions`).
REDUCTIONS = ("reduce_sum", "reduce_max", "reduce_min", "logsumexp")


def _zeros(t: Tensor) -> Tensor:
    from ..ops.elementwise import constant
    from ..ops.shape_ops import broadcast_to
    return broadcast_to(constant(0.0, t.dtype, t), t.shape)


def repeat_vjp(node, dy: list, dys: list) -> list:
    """The gradients of repeat ``node``'s inputs, given the cotangents of its carried tensors
    (``dy``, one each) and of its stacked per-layer outputs (``dys``; None where the loss does
    not read one)."""
    from .autodiff import wants_grad
    blk: Block = node.attrs["block"]
    nc = blk.num_carries
    with_dy = tuple(k for k, d in zip(blk.y_names, dys) if d is not None)
    if all(d is None for d in dy) and not with_dy:
        return [None] * len(node.inputs)
    # a carried tensor the loss does not read (the per-layer outputs only, an LSTM's last c) gets zeros
    dy = [_zeros(node.outputs[i]) if d is None else d for i, d in enumerate(dy)]
    num_stacked = len(blk.params)
    stacked_t, closed_t = node.inputs[nc:nc + num_stacked], node.inputs[nc + num_stacked:]
    # the closed-over and stacked tensors the loss's gradient flows into: the block is
    # differentiated with respect to those only (a constant table, an input, a per-layer count
    # made from the inputs gets no gradient, and its vjp reads no forward value)
    want = tuple(wants_grad(t) for t in closed_t)
    want_stacked = tuple(wants_grad(t) for t in stacked_t)
    policy = policy_of(node)
    key = (want, want_stacked, with_dy, policy.text)
    built = node.attrs.setdefault("grad_blocks", {})
    if key not in built:  # built once per key; later grads reuse it and its saved outputs
        layer = node.attrs["layer"]
        gblk, pairs = grad_block(blk, node.attrs["stacked"], layer.name, node, want, with_dy, policy, want_stacked)
        base = len(node.outputs)
        node.outputs = node.outputs + tuple(
            Tensor(node, base + i, Shape([layer] + list(f.shape)), f.dtype) for i, (_, f) in enumerate(pairs))
        node.attrs["saved"] = node.attrs.get("saved", []) + [f for _, f in pairs]
        read = gblk.extra["read_back"]
        node.attrs["saved_read"] = node.attrs.get("saved_read", []) + [id(t) in read for t, _ in pairs]
        built[key] = (gblk, base, len(node.outputs))
    gblk, lo, hi = built[key]
    given_dys = [d for d in dys if d is not None]
    outs = apply("repeat_grad", [*_layer_inputs(node, gblk), *stacked_t, *dy, *given_dys, *node.outputs[lo:hi],
                                 *closed_t],
                 {"block": gblk, "layer": node.attrs["layer"], "pos": node.attrs["pos"],
                  "stacked": node.attrs["stacked"]})
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    dclosed = iter(outs[nc + num_stacked:])
    return outs[:nc] + [g if w else None for g, w in zip(outs[nc:nc + num_stacked], want_stacked)] + \
        [next(dclosed) if w else None for w in want]


def _layer_inputs(node, gblk: Block) -> list[Tensor]:
    """The stacked layer inputs (one per carried tensor) repeat ``node``'s gradient ``gblk`` is
    given: the node's own, but zeros for one the gradient does not read (:func:`_carries_read`)
    where ``node`` is nested in a block whose gradient saves the nested repeat's outputs
    (:func:`.remat.saving_outside`: ``none``).

    An RNN inside a layer stack reads, backward, its saved gathered ``h``, not its per-step
    carries: given them, the outer forward saved them for every layer though nothing read them
    (320 of 1344 B a layer in the ``hidden:model`` repro).  Zeros are no activation (a constant,
    made in the backward, never saved).  Where the outer policy recomputes the nested repeat,
    its carries are made again with it anyway, and zeros would only add a value of their size."""
    nc = node.attrs["block"].num_carries
    layer_ins = list(node.outputs[nc:2 * nc])
    if not saving_outside():
        return layer_ins
    return [t if read else _zeros(t) for t, read in zip(layer_ins, _carries_read(gblk), strict=True)]


def _carries_read(b: Block) -> tuple[bool, ...]:
    """Per carried tensor of backward block ``b`` (:func:`grad_block`), whether its gradient reads
    the layer's input (the carry placeholder) given what the forward saves: an RNN's whose
    backward reads the saved gathered ``h`` (``none``) reads none of its per-step carries."""
    outs = [*b.extra["dcarries"], *b.extra["dparams"].values(), *b.extra["dclosed"].values()]
    need = {id(n) for n in topo_nodes(outs, {id(t) for t in b.extra["given"].values()})}
    return tuple(id(c.node) in need for c in b.carries)


def _param_reductions(fwd, reads, act: set[int], n_fwd: int) -> tuple[list[Tensor], set[int]]:
    """The reductions of the layer's params (no carry in them: BitNet's ``mean|w|``, and the ops
    after one that make no larger value, the ``+ eps``) that the values the backward reads and
    recomputes are made from, and the ids of every such node.  They are saved, values smaller than
    what they reduce, and the recompute reads them: recomputed over a split dim each was an
    allreduce per layer in the backward (4 B each, one per quantised weight)."""
    chain: set[int] = set()
    for n in fwd:
        if id(n) not in act and (n.op.name in REDUCTIONS or any(
                id(t.node) in chain and n.outputs[0].shape.numel <= t.shape.numel for t in n.inputs)):
            chain.add(id(n))
    found, seen, todo = [], set(), [t for t in reads if id(t.node) not in act]
    while todo:
        t = todo.pop()
        if id(t) in seen or t.node.id >= n_fwd:
            continue
        seen.add(id(t))
        if id(t.node) in chain:
            found.append(t)
        else:
            todo.extend(t.node.inputs)
    return found, chain


def _saved(b: Block, n_fwd: int, blk: Block, policy) -> list[tuple[Tensor, Tensor]]:
    """The forward activations the backward part of grad block ``b`` is given, by ``policy``;
    sets ``b.extra["read_back"]``, the ids of the tensors of ``b`` the backward part reads
    itself (the others given are read only by the forward nodes it recomputes).

    Returns (tensor of ``b``, the same tensor of the forward block ``blk``) pairs: the
    first ``n_fwd`` nodes of ``b`` re-trace ``blk`` node for node.  Placeholders are fed
    anyway; values that do not depend on the carry or on a closed-over activation
    (constants, functions of the layer's params or of tables) are cheap to recompute
    and are not saved, except the reductions of params they are made from
    (:func:`_param_reductions`).
    """
    outs = [*b.extra["dcarries"], *b.extra["dparams"].values(), *b.extra["dclosed"].values()]
    fwd = b.graph.nodes[:n_fwd]
    # nodes whose outputs depend on the carry or on a closed-over activation
    act: set[int] = {*(id(c.node) for c in b.carries), *(id(t.node) for t in activations(b.closed, b.outer))}
    for n in fwd:
        if any(id(t.node) in act for t in n.inputs):
            act.add(id(n))
    reads = [t for n in topo_nodes(outs) if n.id >= n_fwd for t in n.inputs if t.node.id < n_fwd]
    b.extra["read_back"] = {id(t) for t in reads}
    reduced, chain = _param_reductions(fwd, reads, act, n_fwd)
    reads, act = reads + reduced, act | chain
    return [(t, _twin(t, blk)) for t in chosen(reads, {id(n) for n in fwd}, act, policy)]


def _twin(t: Tensor, blk: Block) -> Tensor:
    """The tensor of forward block ``blk`` that ``t`` (a tensor of a re-trace of it) re-traces: the
    same node id, the same output; a nested repeat's saved activation (made by the re-trace's
    gradient of the nested repeat) the forward's nested repeat is made to output too
    (:func:`_mirror_saved`), so it is saved, not recomputed."""
    f = blk.graph.nodes[t.node.id]
    if f.op is not t.node.op:
        raise ShapeError(f"repeat: the block traced differently twice ({f!r} vs {t.node!r}); "
                         "blocks must be deterministic functions of (carry, params)")
    if f.op.name == "repeat" and t.index >= len(t.node.outputs) - len(t.node.attrs.get("saved", [])):
        at = _mirror_saved(t.node, f)[t.index]   # (before reading f.outputs: it grows)
        return f.outputs[at]
    return f.outputs[t.index]


def _mirror_saved(src, dst) -> dict[int, int]:
    """Make repeat node ``dst`` output the activations its twin ``src`` saves for its gradient
    (``attrs["saved"]``, each the same tensor of ``dst``'s own block, :func:`_twin`; one it
    outputs already is not added again); returns each saved output index of ``src`` -> the
    index of ``dst``'s output that is the same value.

    ``src`` is a nested repeat of a backward block's re-trace, ``dst`` the forward block's: the
    outer forward then saves the nested repeat's activations as its own, so the outer backward
    runs the nested repeat's gradient on them and need not run the nested repeat again (with its
    collectives: an RNN's per-step gather of ``h`` under ``hidden:model``)."""
    src_saved, dst_saved = src.attrs.get("saved", []), list(dst.attrs.get("saved", []))
    dst_read = list(dst.attrs.get("saved_read", []))
    src_base, dst_base = len(src.outputs) - len(src_saved), len(dst.outputs) - len(dst_saved)
    index, outs = {}, list(dst.outputs)
    for i, (f, read) in enumerate(zip(src_saved, src.attrs["saved_read"], strict=True)):
        g = _twin(f, dst.attrs["block"])
        k = next((k for k, h in enumerate(dst_saved) if h is g), None)
        if k is None:
            k = len(dst_saved)
            dst_saved.append(g)
            dst_read.append(read)
            outs.append(Tensor(dst, dst_base + k, src.outputs[src_base + i].shape, g.dtype))
        elif read:
            dst_read[k] = True
        index[src_base + i] = dst_base + k
    dst.outputs = tuple(outs)
    dst.attrs["saved"], dst.attrs["saved_read"] = dst_saved, dst_read
    return index


def grad_block(blk: Block, stacked: dict[str, Tensor], layer: str, node, want: tuple[bool, ...],
               with_dy: tuple[str, ...], policy, want_stacked: tuple[bool, ...] | None = None):
    """The backward block, and the (grad-block tensor, forward-block tensor) pairs it is given.

    ``want``: per closed-over tensor, whether the backward block outputs its gradient
    (``extra["dclosed"]``, by placeholder name); ``with_dy``: the per-layer outputs whose
    cotangents it reads (placeholders ``cotangent/<name>``, ``extra["dys"]``);
    ``want_stacked``: per stacked tensor, whether it is differentiated (None: all): the others'
    gradients are zeros, so the backward reads nothing of the forward for them.
    """
    from .autodiff import vjp

    b = trace(blk.fn, tuple(blk.carries) if blk.tupled else blk.carry, stacked, layer, "block_grad", node.graph,
              blk.hoisted)
    n_fwd = len(b.graph.nodes)
    if n_fwd != len(blk.graph.nodes) or [id(t) for t in b.outer] != [id(t) for t in blk.outer]:
        raise ShapeError(f"repeat: the block traced differently twice ({len(blk.graph.nodes)} vs {n_fwd} nodes, "
                         f"reading {[t.name for t in blk.outer]} vs {[t.name for t in b.outer]} from outside); "
                         "blocks must be deterministic functions of (carry, params)")
    check_names_something(policy, blk.graph.nodes, f"repeat '{node.name}'")
    closed = [k for k, w in zip(b.closed, want) if w]
    nc = b.num_carries
    with b.graph:
        dy = [placeholder(carry_name("cotangent", i), o.shape, o.dtype) for i, o in enumerate(b.outs)]
        dys = {k: placeholder(f"cotangent/{k}", b.ys[k].shape, b.ys[k].dtype) for k in with_dy}
        wanted = [True] * nc + list(want_stacked or [True] * len(b.params)) + [True] * len(closed)
        wrt = list(b.carries) + list(b.params.values()) + [b.closed[k] for k in closed]
        with differentiating(policy):   # (a nested repeat's gradient asks: _layer_inputs)
            grads = iter(vjp([*b.outs, *(b.ys[k] for k in with_dy)], [*dy, *dys.values()],
                             [t for t, w in zip(wrt, wanted) if w]))
        fixed = []
        for t, g in zip(wrt, (next(grads) if w else None for w in wanted)):
            if g is None:
                g = _zeros(t)
            g = apply("stop_gradient", [g], name=f"grad/{t.name}")
            g.scopes = t.scopes
            fixed.append(g)
    n = nc + len(b.params)
    b.extra = {"cotangent": dy[0], "cotangents": dy, "dys": dys, "dcarry": fixed[0], "dcarries": fixed[:nc],
               "dparams": dict(zip(b.params, fixed[nc:n])), "dclosed": dict(zip(closed, fixed[n:])),
               "num_forward": n_fwd, "remat": policy}
    pairs = _saved(b, n_fwd, blk, policy)
    b.extra["given"] = {f"saved/{i}": t for i, (t, _) in enumerate(pairs)}
    return b, pairs


def split_inputs(blk: Block, num_stacked: int, ins) -> tuple:
    """A repeat_grad's inputs by role: ``(carries, stacked, dy, dys, saved, closed)``; ``carries``
    (each carried tensor's stacked layer inputs) and ``dy`` (each one's cotangent) are lists of
    one per carried tensor."""
    nc, n_dys, n_saved = blk.num_carries, len(blk.extra["dys"]), len(blk.extra.get("given", {}))
    at = nc + num_stacked
    dys = ins[at + nc:at + nc + n_dys]
    saved = ins[at + nc + n_dys:at + nc + n_dys + n_saved]
    closed = ins[at + nc + n_dys + n_saved:]
    assert len(closed) == len(blk.closed), "repeat_grad: inputs do not match its block"
    return list(ins[:nc]), ins[nc:at], list(ins[at:at + nc]), dys, saved, closed


@register
class RepeatGrad(Op):
    name = "repeat_grad"

    # inputs: saved layer inputs (one stack per carried tensor), stacked params, carry gradients (one
    # per carried tensor), the per-layer outputs' stacked gradients (block.extra["dys"]), saved
    # activations (block.extra["given"]), closed-over tensors (block.closed); outputs: carry
    # gradients, stacked gradients, and the gradient of each closed-over tensor in
    # block.extra["dclosed"], summed over the layers

    def infer(self, inputs, attrs):
        blk: Block = attrs["block"]
        _, stacked, dy, _, _, closed = split_inputs(blk, len(attrs["stacked"]), inputs)
        closed = dict(zip(blk.closed, closed))
        return [(d.shape, d.dtype) for d in dy] + [(p.shape, p.dtype) for p in stacked] + \
            [(closed[k].shape, closed[k].dtype) for k in blk.extra["dclosed"]]

    def compute(self, ctx, attrs, *ins):
        blk: Block = attrs["block"]
        carries, stacked, dy, dys, saved, closed = split_inputs(blk, len(attrs["stacked"]), ins)
        given = blk.extra.get("given", {})
        closed = dict(zip(blk.closed, closed))
        dcarries = [carry_name("dcarry", i) for i in range(len(dy))]
        outs = {**dict(zip(dcarries, blk.extra["dcarries"])), **{f"d/{k}": g for k, g in blk.extra["dparams"].items()},
                **{f"d/{k}": g for k, g in blk.extra["dclosed"].items()}}
        prog = blk.dense(outs, given)
        names, pos = list(blk.params), attrs["pos"]
        # each layer's gradients go straight into their slice of the stacked result (no stack at the end)
        grads = [torch.empty_like(p) for p in stacked]
        sums = {k: torch.zeros_like(closed[k]) for k in blk.extra["dclosed"]}  # a closed-over tensor's: all layers'

        def layer(l, dy):
            feeds = {**{carry_name("carry", i): c[l] for i, c in enumerate(carries)},
                     **{carry_name("cotangent", i): d for i, d in enumerate(dy)},
                     **{k: p.select(pos[k], l) for k, p in zip(names, stacked)},
                     **{ph.node.name: d[l] for ph, d in zip(blk.extra["dys"].values(), dys)},
                     **{k: s[l] for k, s in zip(given, saved)}, **closed}
            r = prog(feeds, salt=ctx.salt + l + 1)
            for k, g in zip(names, grads):
                g.select(pos[k], l).copy_(r[f"d/{k}"])
            for k, g in sums.items():
                g.add_(r[f"d/{k}"])
            return tuple(r[k] for k in dcarries), None

        dy, _ = run_layers(attrs["layer"].size, layer, tuple(dy), backward=True)
        return (*dy, *grads, *sums.values())

    def subgraphs(self, node):
        blk: Block = node.attrs["block"]
        return ((blk.graph, tuple(blk.params)),)
