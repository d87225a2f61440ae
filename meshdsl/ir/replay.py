"""Rebuilding a graph's nodes under a rule: the transforms that rewrite a model in place of the
user (mixed precision, eval mode) replay the nodes their outputs depend on into the same graph.

Params, inputs and a block's placeholders are reused as they are.  Each other node is applied
again to its rebuilt inputs, unless the rule changes its inputs or gives its outputs; a repeat
is rebuilt with its block replayed under the same rule inside its own sub-graph (its carry cast
back to the carry's dtype where the rule changed it).
"""
from __future__ import annotations

from typing import Callable

from ..core.graph import Tensor, topo_nodes
from ..ops.elementwise import cast
from ..ops.registry import apply
from .repeat import repeat

#: a node and its rebuilt inputs -> (the inputs to apply it to, its outputs or None: applied again)
Rule = Callable[[object, list], tuple[list, tuple | None]]

_LEAVES = frozenset({"param", "input", "placeholder"})


def replay(nodes, env: dict[int, Tensor], rule: Rule) -> None:
    """Rebuild ``nodes`` (in order) under ``rule``; ``env`` maps old tensors to new ones and
    holds the given ones (a block's placeholders) on entry."""
    for n in nodes:
        if all(id(o) in env for o in n.outputs):
            continue
        if n.op.name in _LEAVES:
            env.update((id(o), o) for o in n.outputs)
            continue
        ins, outs = rule(n, [env[id(t)] for t in n.inputs])
        if outs is None and n.op.name == "repeat":
            outs = _replay_repeat(n, ins, rule)
        elif outs is None:
            outs = apply(n.op.name, ins, dict(n.attrs), name=n.name)
            outs = outs if isinstance(outs, tuple) else (outs,)
        for o, new in zip(n.outputs, outs):
            env[id(o)] = new


def block_nodes(blk) -> list:
    """The nodes of a repeat's block that its carry and per-layer outputs depend on."""
    return topo_nodes([*blk.outs, *(blk.ys or {}).values()])


def _replay_repeat(n, ins: list[Tensor], rule: Rule) -> tuple:
    """A repeat whose block is the old block replayed under ``rule`` (each carried tensor of a
    tuple carry cast back to its own dtype where the rule changed it)."""
    blk, stacked, nc = n.attrs["block"], n.attrs["stacked"], n.attrs["block"].num_carries
    closed = ins[nc + len(stacked):]  # what the block reads from outside, replayed: the new block reads them

    def block(carry, params):
        carries = carry if blk.tupled else (carry,)
        env = {**{id(ph): c for ph, c in zip(blk.carries, carries)}, **{id(blk.params[k]): params[k] for k in blk.params},
               **{id(ph): t for ph, t in zip(blk.closed.values(), closed)}}
        replay(block_nodes(blk), env, rule)
        outs = [env[id(o)] for o in blk.outs]
        outs = tuple(o if o.dtype == c.dtype else cast(o, c.dtype) for o, c in zip(outs, carries))  # one dtype
        out = outs if blk.tupled else outs[0]
        return out if blk.ys is None else (out, {k: env[id(y)] for k, y in blk.ys.items()})

    x = repeat(block, tuple(ins[:nc]) if blk.tupled else ins[0], dict(zip(stacked, ins[nc:nc + len(stacked)])),
               n.attrs["layer"], n.attrs.get("remat"))
    x = x if blk.ys is None else x[0]
    return (x[0] if blk.tupled else x).node.outputs
