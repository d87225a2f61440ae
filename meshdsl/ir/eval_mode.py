"""Eval mode as a graph transform: outputs rebuilt as torch's ``model.eval()`` runs a model.

A training step draws dropout masks (:mod:`meshdsl.ops.nn`) and normalises a batch norm by the
batch's statistics; an eval measures the model itself.  :func:`eval_mode` replays the nodes the
outputs depend on into the same graph with each ``dropout`` replaced by its input and each
batch norm that keeps running statistics (``running=(mean, var)``) normalising with them
(its ``mean`` and ``var`` outputs are then the running ones), a repeat's block replayed the same
way inside its own sub-graph; params and inputs are reused, so the rebuilt outputs read the same
params and feeds.  A batch norm without ``running=`` has no statistics but the batch's, and
keeps them.
"""
from __future__ import annotations

from ..core.graph import Tensor, topo_nodes
from ..ops.elementwise import cast, rsqrt
from ..ops.shape_ops import transpose
from .replay import block_nodes, replay


def eval_mode(outputs: dict[str, Tensor]) -> dict[str, Tensor]:
    """``outputs`` with every dropout they read (in repeat blocks too) an identity and every
    batch norm with running statistics normalising with them; ``outputs`` itself when they read
    neither."""
    nodes = topo_nodes(list(outputs.values()))
    if not any(_changes(n) for n in nodes):
        return outputs
    env: dict[int, Tensor] = {}
    with next(iter(outputs.values())).graph:  # leaves without inputs (constants) go to the same graph
        replay(nodes, env, _eval_rule)
    return {k: env[id(t)] for k, t in outputs.items()}


def _changes(n) -> bool:
    if n.op.name == "dropout" or (n.op.name == "batch_norm" and "running" in n.attrs):
        return True
    return n.op.name == "repeat" and any(_changes(m) for m in block_nodes(n.attrs["block"]))


def _eval_rule(n, ins):
    """:func:`~.replay.replay`'s rule: a dropout is its input; a batch norm with running
    statistics normalises with them."""
    if n.op.name == "dropout":
        return ins, (ins[0],)
    if n.op.name == "batch_norm" and "running" in n.attrs:
        return ins, _running_norm(n, ins)
    return ins, None


def _running_norm(n, ins) -> tuple[Tensor, Tensor, Tensor]:
    """``(x - mean) * rsqrt(var + eps) * scale + bias`` with the running ``mean`` and ``var``,
    in the statistics' dtype, and those statistics as the node's other outputs."""
    x, a = ins[0], n.attrs
    acc, order = n.outputs[1].dtype, n.outputs[1].shape.names
    mean_, var_ = (transpose(t if t.dtype == acc else cast(t, acc), order)
                   for t in (x.graph.params[k] for k in a["running"]))
    y = (x if x.dtype == acc else cast(x, acc)) - mean_
    y = y * rsqrt(var_ + a["eps"])
    affine = iter(ins[2:])
    if a["scale"]:
        s = next(affine)
        y = y * (s if s.dtype == acc else cast(s, acc))
    if a["bias"]:
        b = next(affine)
        y = y + (b if b.dtype == acc else cast(b, acc))
    y = y if y.dtype == x.dtype else cast(y, x.dtype)
    return transpose(y, x.shape.names), mean_, var_


__all__ = ["eval_mode"]
