"""A value an output passes on unchanged, laid out as that output.

A training step's update of a frozen param (``md.Model(updates=)``: a batch norm's running mean
``0.9 * rm + 0.1 * mean``, an EMA target ``m * k + (1 - m) * q``) reaches the plan as the output
``new/<k> = stop_gradient(update)``, and only that identity carries the param's scopes
(:func:`~meshdsl.train.state_updates.update_outputs`): the update itself has none, so its own
target is an activation's, whole under FSDP (``params.channels:data``) while the param it writes,
and so ``new/<k>``, is split like its trained siblings. The generic rule then computed the update
split (the param's slice, and a local cut of the whole batch statistics), gathered it to its own
whole target, and ``new/<k>`` read the split value again: one allgather a step per update (WRN: 14)
that nothing read.

Here such a value, read by nothing but identities that make plan outputs, is offered those outputs'
targets instead of its own (:func:`with_output_targets`): nothing reads it at its own layout, and
each rank's slice of it is then its slice of the param's next value, so the update sends nothing
beyond what its inputs already cost. The alternatives weighed:

* laying the frozen param out otherwise: it already follows the FSDP rule as a param, as its
  trained siblings, and the runtime writes ``new/<k>`` into it slice by slice, so that layout is
  the right one (a whole param would cost every rank the memory FSDP saves);
* gathering all of a step's updates in one collective (:mod:`.coalesce` packs only allreduces
  ready after the same steps, and each update waits on its own statistics): still a collective's
  latency a step for values no rank needs whole;
* giving the update tensor the param's scopes: it is the user's tensor, maybe read elsewhere (a
  metric, the loss) where its own layout is the right one; here it changes only where the
  identity is its one reader in this plan.
"""
from __future__ import annotations

from .fuse import IDENTITY


def passed_on(outputs: dict) -> dict[int, list]:
    """``id(tensor) -> [output tensors]``: each tensor that an output of ``outputs`` (name ->
    Tensor) returns unchanged by an identity of the update phase (``new/<k>``'s ``stop_gradient``)
    with scopes of its own (the param's) that the tensor lacks.

    Gradients are named by such identities too (``grad/<param>``, a layer block's outputs), but
    they are left to their own machinery (lazy partial sums, buckets, a block's sums over its
    layers), which a split target met at the first reduction would defeat."""
    out: dict[int, list] = {}
    for t in outputs.values():
        n = t.node
        if n.op.name in IDENTITY and n.phase == "update" and t.scopes and not n.inputs[0].scopes:
            out.setdefault(id(n.inputs[0]), []).append(t)
    return out


def with_output_targets(lw, t, own: list) -> list:
    """``own`` (tensor ``t``'s targets in lowerer ``lw``), or, where every read of ``t`` in this plan
    is by an identity making an output (:func:`passed_on`, ``lw.passed_on``) and those outputs agree
    on their targets, theirs: the layout nothing reads ``t`` at is not priced as its goal."""
    outs = lw.passed_on.get(id(t))
    if not outs or lw.num_uses(t) != len(outs):
        return own
    theirs = [lw.targets(o) for o in outs]
    return theirs[0] if all(x == theirs[0] for x in theirs) else own
