"""Activation checkpointing (remat): what a repeat's forward saves for its backward.

A repeat's backward block re-traces the forward block and differentiates it
(:mod:`.repeat_grad`); each forward activation its backward part reads is either
saved by the forward (an extra stacked output of the repeat node) or recomputed in
the backward block from what is saved.  A policy picks:

* ``none`` (the default): save every activation the backward reads; nothing is
  recomputed but what depends on params and constants only.
* ``full``: save nothing but each layer's input (always kept): the backward block
  recomputes the layer's forward.
* ``selective``: save the outputs of the costly ops (``einsum``, ``attention``,
  ``conv``) and recompute the cheap ones between them (norms, activations,
  softmax, masks), which read what is saved.
* ``save:OP,OP,...``: the same with the listed ops, e.g. ``save:attention``.

The policy is given per repeat (``md.repeat(..., remat="selective")``), or for every
repeat of a gradient at once (``md.grad(loss, remat="full")``, which ``TrainStep``,
``md.fit`` and ``--remat`` use); the second wins.  Recomputing runs the same kernels on
the same values, with the same dropout salt, so the numbers are those of ``none``.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass

from ..errors import GraphError, did_you_mean, message

#: The ops whose outputs ``selective`` saves: matmul-like and fused attention kernels.
SELECTIVE_OPS = ("einsum", "attention", "conv")
PRESETS = ("none", "full", "selective")
_RULE = ("a remat policy is 'none', 'full', 'selective' or 'save:OP,OP,...' (the ops whose outputs "
         "each layer saves; the others are recomputed in the backward)")


@dataclass(frozen=True)
class Remat:
    """A parsed policy.

    Attributes:
      text: the policy as written (``"selective"``, ``"save:einsum"``).
      save: the op names whose activations are saved; None saves every activation.
    """

    text: str
    save: frozenset | None

    def __str__(self) -> str:
        return self.text


NONE = Remat("none", None)


def parse_remat(policy, where: str = "remat") -> Remat:
    """The :class:`Remat` for ``policy`` (a string, a :class:`Remat`, or None for ``none``).

    Raises:
      GraphError: an unknown word, ``save:`` naming no op, or a name that is no op.
    """
    if policy is None:
        return NONE
    if isinstance(policy, Remat):
        return policy
    if not isinstance(policy, str):
        raise GraphError(message(f"{where}: policy {policy!r} is not a string.", rule=_RULE,
                                 fix="pass e.g. remat='full'"))
    text = policy.strip()
    if text == "none":
        return NONE
    if text == "full":
        return Remat("full", frozenset())
    if text == "selective":
        return Remat("selective", frozenset(SELECTIVE_OPS))
    if not text.startswith("save:"):
        raise GraphError(message(f"{where}: unknown remat policy {policy!r}.{did_you_mean(text, PRESETS)}",
                                 rule=_RULE, fix="use one of none, full, selective, or save:einsum,attention"))
    names = [n.strip() for n in text[len("save:"):].split(",") if n.strip()]
    if not names:
        raise GraphError(message(f"{where}: remat policy {policy!r} names nothing to save.", rule=_RULE,
                                 fix="name the ops to save (save:einsum,attention), or use 'full' to save "
                                     "only each layer's input"))
    from ..ops.registry import OPS
    bad = [n for n in names if n not in OPS]
    if bad:
        raise GraphError(message(f"{where}: remat policy {policy!r} names {len(bad)} op(s) meshdsl does not have.",
                                 bullets=[f"'{n}'{did_you_mean(n, OPS)}" for n in bad], rule=_RULE,
                                 fix=f"name ops such as {', '.join(SELECTIVE_OPS)}"))
    return Remat("save:" + ",".join(names), frozenset(names))


#: The policy of every repeat differentiated now (``grad(..., remat=)``); None: each its own.
_OVERRIDE: ContextVar = ContextVar("meshdsl_remat", default=None)


@contextlib.contextmanager
def remat_for_all(policy):
    """Within the block, every repeat's gradient uses ``policy`` (None: its own)."""
    token = _OVERRIDE.set(None if policy is None else parse_remat(policy))
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


def policy_of(node) -> Remat:
    """The policy the gradient of repeat ``node`` is built with now."""
    return _OVERRIDE.get() or node.attrs.get("remat", NONE)


def check_names_something(policy: Remat, block_nodes, where: str) -> None:
    """Refuse a ``save:`` policy whose ops the block does not use (it would save nothing,
    which ``full`` says plainly)."""
    if policy.save and policy.text not in PRESETS and not any(n.op.name in policy.save for n in block_nodes):
        used = sorted({n.op.name for n in block_nodes} - {"placeholder", "constant"})
        raise GraphError(message(f"{where}: remat policy '{policy}' names nothing this block computes.",
                                 inputs=[f"ops of the block: {', '.join(used)}"], rule=_RULE,
                                 fix="name ops of the block, or use 'full' to save only each layer's input"))


def chosen(reads, forward: set[int], act: set[int], policy: Remat, savable=lambda t: True) -> list:
    """The forward tensors to save, of those the backward reads (``reads``, in order).

    ``forward``: ids of the forward part's nodes; ``act``: ids of those whose outputs depend on
    the carry or on an activation read from outside (the rest is recomputed whatever the
    policy: it costs no activation memory).  A tensor the policy does not save is recomputed
    from its node's inputs, which are then needed in turn; the walk stops at the carry (each
    layer's input is always kept) and at tensors the policy saves.  A tensor that is not
    ``savable`` is recomputed whatever the policy (a nested repeat's saved activations,
    which only the backward's re-trace of the block outputs).
    """
    out, seen = [], set()
    todo = list(reversed(list(reads)))
    while todo:
        t = todo.pop()
        src = t.node
        if id(t) in seen or id(src) not in forward or src.op.name == "placeholder" or id(src) not in act:
            continue
        seen.add(id(t))
        if (policy.save is None or src.op.name in policy.save) and savable(t):
            out.append(t)
        else:
            todo.extend(reversed(src.inputs))
    return out
