"""Reverse-mode autodiff over the graph IR (Mesh-TF style).

Gradients are built from the same named-tensor ops as the forward pass, so the
compiler lowers them with the same rules and their collectives appear in the
plan, tagged with the 'backward' phase.
"""
from __future__ import annotations

import weakref
from contextvars import ContextVar

from ..core.graph import Tensor, topo_nodes
from ..errors import GraphError, message
from ..ops import elementwise as ew
from ..ops.registry import Op, apply
from ..ops.shape_ops import broadcast_to, transpose
from .remat import parse_remat, remat_for_all


#: The nodes that depend on a ``wrt`` tensor of the vjp being built (None outside one).
_LIVE: ContextVar = ContextVar("meshdsl_live_nodes", default=None)

#: The stop_gradient nodes that hold :func:`grad`'s results (constants to a later differentiation).
_GRAD_RESULTS: weakref.WeakSet = weakref.WeakSet()


def wants_grad(t: Tensor) -> bool:
    """Whether the gradient being built flows into ``t``: a floating-point tensor that depends
    on a tensor it is taken with respect to (any floating-point tensor outside a vjp).  A grad
    rule may leave out the gradients nobody reads (a repeat, those of constant tables)."""
    live = _LIVE.get()
    return t.dtype.is_floating_point and (live is None or id(t.node) in live)


def _accumulate(grads: dict, t: Tensor, g: Tensor) -> None:
    if g.shape.names != t.shape.names:
        assert sorted(g.shape.names) == sorted(t.shape.names), f"gradient {g!r} does not match {t!r}"
        g = transpose(g, t.shape.names)
    old = grads.get(id(t))
    grads[id(t)] = g if old is None else old + g


def _around(g) -> list:
    """The graphs that enclose ``g`` (a repeat block's), innermost first."""
    out = []
    while g.outer is not None:
        g = g.outer
        out.append(g)
    return out


def _check_tensors(what: str, role: str, items, graph, floating: bool = False) -> None:
    """Raise a GraphError unless every item is a Tensor of ``graph`` (floating point if asked)."""
    for i, t in enumerate(items):
        if not isinstance(t, Tensor):
            raise GraphError(message(f"{what}: {role} {i} is {t!r} ({type(t).__name__}), not a Tensor.",
                                     rule=f"{role}s are meshdsl Tensors of the differentiated graph",
                                     fix="pass the Tensor objects returned by param(), input() or ops"))
        if t.graph is not graph:
            inside = t.graph.outer is not None and graph in (t.graph.outer, *_around(t.graph.outer))
            raise GraphError(message(f"{what}: {role} {t!r} belongs to another graph than the loss.",
                                     inputs=[f"graph of the loss: '{graph.name}' (#{graph.uid})",
                                             f"graph of {t.name}: '{t.graph.name}' (#{t.graph.uid})"],
                                     bullets=[f"'{t.name}' was made inside the repeat block '{t.graph.name}' (one "
                                              "layer's value, or the block's own)"] if inside else None,
                                     rule="gradients are taken within one graph",
                                     fix="take the gradient with respect to the stacked param passed to md.repeat "
                                         "(its gradient has every layer's)" if inside else
                                         "build the model and take its gradients in one 'with Graph():' block"))
        if floating and not t.dtype.is_floating_point:
            raise GraphError(message(f"{what}: {role} {t!r} is {t.dtype}; only floating-point tensors have gradients.",
                                     rule="grad differentiates with respect to floating-point tensors",
                                     fix="leave integer tensors (ids, labels, masks) out of wrt"))


def vjp(outputs: list[Tensor], cotangents: list[Tensor], wrt: list[Tensor]) -> list[Tensor | None]:
    """Vector-Jacobian product: gradients of ``sum(outputs * cotangents)`` w.r.t. ``wrt``.

    Returns None for a ``wrt`` the outputs do not depend on.

    Raises:
      GraphError: if the lists mix graphs or hold non-Tensors, or a cotangent does not
        have its output's dims, sizes and dtype.
    """
    outputs, cotangents, wrt = list(outputs), list(cotangents), list(wrt)
    if not outputs or len(outputs) != len(cotangents):
        raise GraphError(message(f"vjp: {len(outputs)} output(s) but {len(cotangents)} cotangent(s).",
                                 rule="one cotangent per output, shaped like it",
                                 fix="pass as many cotangents as outputs"))
    _check_tensors("vjp", "output", outputs, getattr(outputs[0], "graph", None))
    graph = outputs[0].graph
    _check_tensors("vjp", "cotangent", cotangents, graph)
    _check_tensors("vjp", "wrt tensor", wrt, graph)
    for t, c in zip(outputs, cotangents):
        if set(c.shape) != set(t.shape) or c.dtype != t.dtype:
            raise GraphError(message(f"vjp: cotangent {c!r} does not match output {t!r}.",
                                     inputs=[f"output: {t.shape} {t.dtype}", f"cotangent: {c.shape} {c.dtype}"],
                                     rule="a cotangent has its output's dims (any order), sizes and dtype",
                                     fix=f"pass a cotangent shaped {t.shape} of dtype {t.dtype}"))
    nodes = topo_nodes(outputs)
    wanted = {id(t.node) for t in wrt}
    live: set[int] = set()  # nodes that depend on some wrt
    for n in nodes:
        if id(n) in wanted or (not n.op.blocks_gradient and any(id(t.node) in live for t in n.inputs)):
            live.add(id(n))
    grads: dict[int, Tensor] = {}
    token = _LIVE.set(live)
    try:
        _backward(nodes, live, grads, outputs, cotangents, graph)
    finally:
        _LIVE.reset(token)
    return [grads.get(id(t)) for t in wrt]


def _backward(nodes, live: set[int], grads: dict, outputs, cotangents, graph) -> None:
    """Fill ``grads`` (id of a tensor -> its gradient) from the outputs' cotangents back."""
    with graph.in_phase("backward"):
        for t, c in zip(outputs, cotangents):
            _accumulate(grads, t, c)
        for n in reversed(nodes):
            if id(n) not in live or not n.inputs:
                continue
            douts = [grads.get(id(o)) for o in n.outputs]
            if all(d is None for d in douts):
                continue
            if not n.op.differentiable:
                if any(t.dtype.is_floating_point and id(t.node) in live for t in n.inputs):
                    Op.grad(n.op, n, douts)  # raises: a gradient would be dropped silently
                continue
            with graph.scope(f"grad_{n.op.name}"):
                gins = n.op.grad(n, douts)
            for inp, g in zip(n.inputs, gins):
                if g is not None and id(inp.node) in live and inp.dtype.is_floating_point:
                    _accumulate(grads, inp, g)


def grad(loss: Tensor, wrt=None, remat=None) -> list[Tensor]:
    """Gradients of scalar ``loss`` w.r.t. ``wrt`` (default: every param it depends on).

    Args:
      loss: a Tensor with no dims.
      wrt: a list of Tensors (usually params), a dict name -> Tensor, or None.
      remat: the activation-checkpointing policy of every repeat the gradient crosses
        (``"none"``, ``"full"``, ``"selective"``, ``"save:OP,..."``; see
        :mod:`meshdsl.ir.remat`); None: each repeat's own (``repeat(..., remat=)``).

    Returns:
      A list of gradient Tensors shaped like ``wrt`` (a dict if ``wrt`` was a dict).
      Each gradient carries its param's layout scopes (and ``grads``), so ``grads.`` and
      ``params.`` rules lay it out.
      The gradients are constants to any later differentiation (as torch's
      ``autograd.grad`` without ``create_graph``); for a gradient of a gradient, build it
      with :func:`vjp`, whose results stay differentiable (an op without a second-order
      rule, such as a fused backward kernel, is then a clear error).

    Raises:
      GraphError: if ``loss`` is not a scalar, ``remat`` is no policy, or ``loss`` reaches a
        ``wrt`` tensor only through an earlier ``grad``'s result (its gradient would be zero).
    """
    policy = None if remat is None else parse_remat(remat, "grad(remat=...)")
    if not isinstance(loss, Tensor):
        raise GraphError(message(f"grad: loss is {loss!r} ({type(loss).__name__}), not a Tensor.",
                                 rule="grad differentiates a scalar Tensor of a graph",
                                 fix="pass the loss Tensor, e.g. reduce_mean(...)"))
    if len(loss.shape) != 0:
        raise GraphError(message(f"grad: loss {loss!r} is not a scalar.",
                                 rule="grad differentiates one number", fix="reduce it first, e.g. reduce_mean(loss)"))
    if not loss.dtype.is_floating_point:
        raise GraphError(message(f"grad: loss {loss!r} is {loss.dtype}, not floating point.",
                                 rule="only a floating-point loss has gradients",
                                 fix="cast it first: meshdsl.cast(loss, torch.float32)"))
    as_dict = isinstance(wrt, dict)
    if wrt is None:
        wrt = [n.outputs[0] for n in topo_nodes([loss])
               if n.op.name == "param" and n.outputs[0].dtype.is_floating_point]
    elif isinstance(wrt, Tensor):
        raise GraphError(message(f"grad: wrt is a single Tensor {wrt!r}.",
                                 rule="wrt is a list or a dict of Tensors",
                                 fix=f"write grad(loss, [{wrt.name}])"))
    items = list(wrt.values()) if as_dict else list(wrt)
    _check_tensors("grad", "wrt tensor", items, loss.graph, floating=True)
    g = loss.graph
    with g.in_phase("backward"):
        seed = ew.constant(1.0, loss.dtype, loss)
        with remat_for_all(policy):
            raw = vjp([loss], [seed], items)
        out = []
        for p, d in zip(items, raw):
            if d is None:
                _refuse_a_cut_gradient(loss, p)
                d = broadcast_to(ew.constant(0.0, p.dtype, p), p.shape)
            d = apply("stop_gradient", [d], name=f"grad/{p.name}")
            _GRAD_RESULTS.add(d.node)
            # A gradient answers to its param's rules, with 'grads.' rules ranked above 'params.'.
            d.scopes = tuple(x for s in p.scopes for x in (("grads", s) if s == "params" else (s,)))
            out.append(d)
    return dict(zip(wrt.keys(), out)) if as_dict else out


def _refuse_a_cut_gradient(loss: Tensor, p: Tensor) -> None:
    """Raise where ``loss`` reads ``p`` only through an earlier :func:`grad`'s result: its
    gradient would be a silent zero (torch's ``autograd.grad`` raises there too), the usual slip
    of a derivative of a derivative (a PINN's u_xx) written with ``grad`` twice."""
    for n in topo_nodes([loss]):
        if n in _GRAD_RESULTS and any(m is p.node for m in topo_nodes([n.inputs[0]])):
            inner = n.outputs[0].name.removeprefix("grad/")
            raise GraphError(message(
                f"grad: the loss '{loss.name}' depends on '{p.name}' only through '{n.outputs[0].name}', the "
                f"result of an earlier md.grad, so the gradient of '{p.name}' would be zero.",
                rule="md.grad's results are constants to a later md.grad (as torch's autograd.grad "
                     "without create_graph=True)",
                fix=f"build '{n.outputs[0].name}' with md.vjp, whose results stay differentiable: "
                    f"(d_{inner},) = md.vjp([y], [ones shaped like y], [{inner}]) for md.grad(reduce_sum(y), [{inner}])"))
