"""Eval mode as a graph transform: outputs rebuilt with every dropout an identity.

A training step draws dropout masks (:mod:`meshdsl.ops.nn`); an eval measures the model
itself, as torch's ``model.eval()`` does. :func:`without_dropout` replays the nodes the
outputs depend on into the same graph, each ``dropout`` replaced by its input and a
repeat's block replayed the same way inside its own sub-graph; params and inputs are
reused, so the rebuilt outputs read the same params and feeds.
"""
from __future__ import annotations

from ..core.graph import Tensor, topo_nodes
from .replay import block_nodes, replay


def without_dropout(outputs: dict[str, Tensor]) -> dict[str, Tensor]:
    """``outputs`` with every dropout they read (in repeat blocks too) an identity;
    ``outputs`` itself when they read none."""
    nodes = topo_nodes(list(outputs.values()))
    if not any(_drops(n) for n in nodes):
        return outputs
    env: dict[int, Tensor] = {}
    with next(iter(outputs.values())).graph:  # leaves without inputs (constants) go to the same graph
        replay(nodes, env, _identity_dropout)
    return {k: env[id(t)] for k, t in outputs.items()}


def _drops(n) -> bool:
    if n.op.name == "dropout":
        return True
    return n.op.name == "repeat" and any(_drops(m) for m in block_nodes(n.attrs["block"]))


def _identity_dropout(n, ins):
    """:func:`~.replay.replay`'s rule: a dropout is its input."""
    return ins, ((ins[0],) if n.op.name == "dropout" else None)


__all__ = ["without_dropout"]
