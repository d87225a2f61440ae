"""Reverse-mode autodiff over the graph IR (Mesh-TF style).

Gradients are built from the same named-tensor ops as the forward pass, so the
compiler lowers them with the same rules and their collectives appear in the
plan, tagged with the 'backward' phase.
"""
from __future__ import annotations

from ..core.graph import Tensor, topo_nodes
from ..errors import GraphError, message
from ..ops import elementwise as ew
from ..ops.registry import apply
from ..ops.shape_ops import broadcast_to, transpose


def _accumulate(grads: dict, t: Tensor, g: Tensor) -> None:
    if g.shape.names != t.shape.names:
        if sorted(g.shape.names) != sorted(t.shape.names):
            raise AssertionError(f"gradient {g!r} does not match {t!r}")
        g = transpose(g, t.shape.names)
    old = grads.get(id(t))
    grads[id(t)] = g if old is None else old + g


def vjp(outputs: list[Tensor], cotangents: list[Tensor], wrt: list[Tensor]) -> list[Tensor | None]:
    """Vector-Jacobian product: gradients of ``sum(outputs * cotangents)`` w.r.t. ``wrt``.

    Returns None for a ``wrt`` the outputs do not depend on.
    """
    graph = outputs[0].graph
    nodes = topo_nodes(outputs)
    wanted = {id(t.node) for t in wrt}
    live: set[int] = set()  # nodes that depend on some wrt
    for n in nodes:
        if id(n) in wanted or any(id(t.node) in live for t in n.inputs):
            live.add(id(n))
    grads: dict[int, Tensor] = {}
    with graph.in_phase("backward"):
        for t, c in zip(outputs, cotangents):
            _accumulate(grads, t, c)
        for n in reversed(nodes):
            if id(n) not in live or not n.inputs or not n.op.differentiable:
                continue
            douts = [grads.get(id(o)) for o in n.outputs]
            if all(d is None for d in douts):
                continue
            with graph.scope(f"grad_{n.op.name}"):
                gins = n.op.grad(n, douts)
            for inp, g in zip(n.inputs, gins):
                if g is not None and id(inp.node) in live and inp.dtype.is_floating_point:
                    _accumulate(grads, inp, g)
    return [grads.get(id(t)) for t in wrt]


def grad(loss: Tensor, wrt=None) -> list[Tensor]:
    """Gradients of scalar ``loss`` w.r.t. ``wrt`` (default: every param it depends on).

    Args:
      loss: a Tensor with no dims.
      wrt: a list of Tensors (usually params), a dict name -> Tensor, or None.

    Returns:
      A list of gradient Tensors shaped like ``wrt`` (a dict if ``wrt`` was a dict).
      Each gradient carries its param's layout scopes, so ``params.`` rules lay it out.

    Raises:
      GraphError: if ``loss`` is not a scalar.
    """
    if len(loss.shape) != 0:
        raise GraphError(message(f"grad: loss {loss!r} is not a scalar.",
                                 rule="grad differentiates one number", fix="reduce it first, e.g. reduce_mean(loss)"))
    as_dict = isinstance(wrt, dict)
    if wrt is None:
        wrt = [n.outputs[0] for n in topo_nodes([loss]) if n.op.name == "param"]
    items = list(wrt.values()) if as_dict else list(wrt)
    g = loss.graph
    with g.in_phase("backward"):
        seed = ew.constant(1.0, loss.dtype, loss)
        raw = vjp([loss], [seed], items)
        out = []
        for p, d in zip(items, raw):
            if d is None:
                d = broadcast_to(ew.constant(0.0, p.dtype, p), p.shape)
            d = apply("stop_gradient", [d], name=f"grad/{p.name}")
            d.scopes = p.scopes
            out.append(d)
    return dict(zip(wrt.keys(), out)) if as_dict else out
