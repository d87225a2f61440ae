"""The lowering table: op name -> the rule that lowers its nodes into plan steps.

Ops declare what they compute (:mod:`meshdsl.ops`); the lowering decides how a
node becomes steps.  Most ops take :func:`~.generic.lower_generic`, which shards
the op's compute spec; ops that need communication or steps of their own
(shift, repeat, leaves) register a rule here with :func:`lowering`.  The
package ``meshdsl.lowering`` imports every module that registers one, so the
table is full whenever :func:`~.compiler.compile` can be called.
"""
from __future__ import annotations

from typing import Callable

from .generic import lower_generic

#: op name -> ``rule(lw, node)``; ops not listed use :func:`lower_generic`.
LOWERINGS: dict[str, Callable] = {}


def lowering(*op_names: str):
    """Decorator: register ``rule(lw, node)`` as the lowering of the ops named."""
    def deco(fn):
        for name in op_names:
            LOWERINGS[name] = fn
        return fn
    return deco


def rule_for(op_name: str) -> Callable:
    """The lowering rule of op ``op_name``."""
    return LOWERINGS.get(op_name, lower_generic)


@lowering("param")
def _lower_param(lw, node) -> None:
    lw.bind_leaf(node, "param")


@lowering("input")
def _lower_input(lw, node) -> None:
    lw.bind_leaf(node, "input")


@lowering("placeholder")
def _lower_placeholder(lw, node) -> None:
    # A block's inputs are bound by the op that lowers the block; one left unbound
    # (read by the block but not fed) becomes an input of the sub-plan.
    if id(node.outputs[0]) not in lw.env:
        lw.bind_leaf(node, "input")
