"""Activation checkpointing (remat): what a repeat's forward saves for its backward.

A repeat's backward block re-traces the forward block and differentiates it
(:mod:`.repeat_grad`); each forward activation its backward part reads is either
saved by the forward (an extra stacked output of the repeat node) or recomputed in
the backward block from what is saved.  A policy picks:

* ``none`` (the default): save every activation the backward reads; nothing is
  recomputed but what depends on params and constants only.  That holds for a repeat nested
  in the block (an RNN over time in each layer) too: the backward's gradient of it reads its
  own saved activations, which the forward's nested repeat outputs as well
  (:func:`.repeat_grad._mirror_saved`), so the backward does not run it again, nor send its
  collectives again (the per-step gather of ``h`` under ``hidden:model``).  Memory for time:
  the nested repeat's activations are kept for every layer, not made again one layer at a
  time; ``selective`` and ``full`` recompute it.  Its per-step carries are kept only where its
  gradient reads them (an LSTM's ``c``; not an RNN's ``h``, read as the gathered copy it saved:
  :func:`.repeat_grad._layer_inputs`).
* ``full``: save nothing but each layer's input (always kept): the backward block
  recomputes the layer's forward.
* ``selective`` (Megatron's selective recompute): save what the linear layers make, recompute
  the attention core and the cheap ops.  Never recomputed are the ``einsum`` and ``conv`` ops
  (a projection, an MLP's matmuls; any product written as an einsum); the fused
  ``attention`` kernel and the elementwise ops (norms, activations, rotations, softmax,
  masks, dropout) are recomputed in the backward where it reads them.  The outputs of the
  einsums the backward needs are saved, or, where a cheap op makes a value the backward
  reads from them that is no larger (llama's rotated q and k, the residual sum after
  attention), that value instead, which saves as many bytes and recomputes less
  (:func:`chosen`).  Attention's backward reads its q, k and v, which are saved anyway,
  and its output and logsumexp, which one more forward kernel makes again from them: so
  its output is not kept.  For llama that is q, k, v, the residual and the SwiGLU gate and
  up projections: 9 of none's 18 [batch, seq, d_model] per layer besides its input (the
  RMS norms save one rstd per row, not their output: :mod:`meshdsl.ops.rmsnorm`).  An
  attention written out as einsums (a dropout on its probabilities needs that) keeps its
  [seq, key_seq] scores, an einsum's output.  ``save:einsum,attention,conv`` keeps the fused
  kernel's output too.
* ``save:OP,OP,...``: the same with the listed ops as the costly ones, e.g. ``save:attention``.

The policy is chosen before the layout, which decides what communicates.  Under ``selective`` and
``save:``, where the forward moved a value a recomputed op reads (a sum over a split dim reduced,
TokenFormer's L2 norm over split param tokens), the lowering saves the moved value too while such
values are small next to what the policy saves, and the recompute sends nothing the forward sent
(:func:`recomputed`, :func:`meshdsl.lowering.saved_copies.saved_results`).  ``full`` saves only
each layer's input: its recompute sends the layer's collectives again.

The policy is given per repeat (``md.repeat(..., remat="selective")``), or for every
repeat of a gradient at once (``md.grad(loss, remat="full")``, which ``TrainStep``,
``md.fit`` and ``--remat`` use); the second wins.  Recomputing runs the same kernels on
the same values, with the same dropout salt, so the numbers are those of ``none``.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass

from ..core.graph import topo_nodes
from ..errors import GraphError, did_you_mean, message
from .closure import activations

#: The ops ``selective`` never recomputes: the linear layers' matmuls.  The fused attention
#: kernel is not one of them: it is recomputed from the q, k and v its backward reads anyway.
SELECTIVE_OPS = ("einsum", "conv")
PRESETS = ("none", "full", "selective")
_RULE = ("a remat policy is 'none', 'full', 'selective' or 'save:OP,OP,...' (the ops each layer never "
         "recomputes: what its backward needs of them is saved; the others are recomputed in the backward)")


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


#: The policy of the repeat whose block is differentiated now (:func:`saving_outside`); None: none is.
_ENCLOSING: ContextVar = ContextVar("meshdsl_remat_enclosing", default=None)


@contextlib.contextmanager
def differentiating(policy: Remat):
    """Within the block, the repeats built are nested in a block whose gradient uses ``policy``."""
    token = _ENCLOSING.set(policy)
    try:
        yield
    finally:
        _ENCLOSING.reset(token)


def saving_outside() -> bool:
    """Whether a repeat differentiated now is nested in a block whose policy saves the nested
    repeat's outputs its gradient reads (``none``, or a ``save:`` naming ``repeat``), rather than
    recomputing the nested repeat."""
    policy = _ENCLOSING.get()
    return policy is not None and (policy.save is None or "repeat" in policy.save)


def check_names_something(policy: Remat, block_nodes, where: str) -> None:
    """Refuse a ``save:`` policy whose ops the block does not use (it would save nothing,
    which ``full`` says plainly)."""
    if policy.save and policy.text not in PRESETS and not any(n.op.name in policy.save for n in block_nodes):
        used = sorted({n.op.name for n in block_nodes} - {"placeholder", "constant"})
        raise GraphError(message(f"{where}: remat policy '{policy}' names nothing this block computes.",
                                 inputs=[f"ops of the block: {', '.join(used)}"], rule=_RULE,
                                 fix="name ops of the block, or use 'full' to save only each layer's input"))


def chosen(reads, forward: set[int], act: set[int], policy: Remat) -> list:
    """The forward tensors to save so that the backward has what it reads (``reads``).

    ``forward``: ids of the forward part's nodes; ``act``: ids of those whose outputs depend on
    the carry or on an activation read from outside (the rest, and placeholders such as the
    carry, which each layer keeps anyway, cost no activation memory and are recomputed
    whatever the policy).  A tensor is either saved or recomputed in the backward from what
    is saved; the policy says which ops may not be recomputed (``none``: every op; ``full``:
    none; otherwise the ops it saves, einsums and convs for ``selective``).  Of the
    choices that recompute no such op, the one that saves the fewest bytes is taken (a
    minimum cut, :func:`_min_cut`), and of those the one that recomputes least: a cheap op's
    output the backward reads (a rotated q, a residual sum) is saved in place of the einsum
    output it is made from when it is no larger.  A nested repeat's saved activations are
    tensors like any other (the forward's nested repeat outputs them too when saved,
    :func:`.repeat_grad._mirror_saved`).
    """
    def free(t) -> bool:
        return id(t.node) not in forward or t.node.op.name == "placeholder" or id(t.node) not in act

    tensors, todo = {}, [t for t in reads if not free(t)]
    while todo:   # the tensors the reads are made from, back to free ones
        t = todo.pop()
        if id(t) not in tensors:
            tensors[id(t)] = t
            todo.extend(u for u in t.node.inputs if not free(u))
    infinite = 1 + sum(_bytes(t) for t in tensors.values())
    edges: dict = {}
    for key, t in tensors.items():
        edges[("in", key), ("out", key)] = _bytes(t)   # saving t
        if policy.save is None or t.node.op.name in policy.save:
            edges["source", ("in", key)] = infinite    # not recomputed: made by the forward
        for u in t.node.inputs:
            if id(u) in tensors:
                edges[("out", id(u)), ("in", key)] = infinite
    for t in reads:
        if id(t) in tensors:
            edges[("out", id(t)), "sink"] = infinite
    sink_side = _min_cut(edges)
    cut = [t for key, t in tensors.items() if ("in", key) not in sink_side and ("out", key) in sink_side]
    return sorted(cut, key=lambda t: (t.node.id, t.index))


def recomputed(b) -> frozenset[int]:
    """The forward nodes backward block ``b`` (:func:`.repeat_grad.grad_block`) recomputes, by
    ``node.id`` (the forward block's numbering: ``b``'s first nodes re-trace it node for node):
    those its outputs need that the policy did not save and whose values depend on the carry or
    on an activation read from outside (values of params alone are recomputed whatever the
    policy).  The lowering saves the results of the collectives such a node's forward made where
    they are small (:func:`meshdsl.lowering.saved_copies.saved_results`)."""
    n_fwd = b.extra["num_forward"]
    act = {*(id(c.node) for c in b.carries), *(id(t.node) for t in activations(b.closed, b.outer))}
    for n in b.graph.nodes[:n_fwd]:
        if any(id(t.node) in act for t in n.inputs):
            act.add(id(n))
    outs = [*b.extra["dcarries"], *b.extra["dparams"].values(), *b.extra["dclosed"].values()]
    given = {id(t) for t in b.extra.get("given", {}).values()}
    return frozenset(n.id for n in topo_nodes(outs, given)
                     if n.id < n_fwd and id(n) in act and n.op.name != "placeholder")


def _bytes(t) -> int:
    return t.shape.numel * t.dtype.itemsize


def _min_cut(capacity: dict) -> set:
    """The sink's side of the minimum ``source``-``sink`` cut of a graph given as
    ``{(a, b): capacity}``: the vertices that still reach ``sink`` once a maximum flow is
    pushed (Edmonds-Karp), so the cut lies as near the sink as a minimum cut can."""
    residual: dict = {}
    for (a, b), c in capacity.items():
        residual.setdefault(a, {})[b] = residual.get(a, {}).get(b, 0) + c
        residual.setdefault(b, {}).setdefault(a, 0)
    while True:   # shortest augmenting paths until none is left
        parent, frontier = {"source": None}, ["source"]
        while frontier and "sink" not in parent:
            nxt = []
            for a in frontier:
                for b, c in residual.get(a, {}).items():
                    if c > 0 and b not in parent:
                        parent[b] = a
                        nxt.append(b)
            frontier = nxt
        if "sink" not in parent:
            break
        path, b = [], "sink"
        while parent[b] is not None:
            path.append((parent[b], b))
            b = parent[b]
        push = min(residual[a][b] for a, b in path)
        for a, b in path:
            residual[a][b] -= push
            residual[b][a] += push
    reach, todo = {"sink"}, ["sink"]
    while todo:   # walk back from the sink along edges with room left
        b = todo.pop()
        for a in residual.get(b, {}):
            if a not in reach and residual[a][b] > 0:
                reach.add(a)
                todo.append(a)
    return reach
