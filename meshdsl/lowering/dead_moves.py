"""Collectives whose results nothing reads, dropped from a lowering's steps.

The generic rule (:mod:`.generic`) brings an op's output to its layout target as it lowers the op,
before its readers are lowered; a reader that then computes on the copy the op made (a sigmoid of
an FSDP weight computed split over ``d_model``, gathered to its whole target, then multiplied by
values split so: :meth:`.Lowerer.relayout` hands the reader the split copy it was made from) leaves
the gather with no reader.  So, once a graph is lowered, each collective whose every result is
neither read by a later step nor an output of its (sub-)plan is dropped, last first, so a chain
of moves nothing reads goes as a whole.

It runs on the lowerer's steps before fusion, a pipeline's partition, gradient accumulation and
buckets: the top level is then one straight list, and each sub-plan (a layer loop's block, with
its own values) is whole, its carries, per-layer outputs and saved activations among its outputs,
so every read of a value is a step's input or an output of the plan holding it.
"""
from __future__ import annotations

from dataclasses import replace

from .plan import Plan, Step


def live_steps(steps, outputs) -> list[Step]:
    """``steps`` without the collectives none of whose results a later step reads or ``outputs``
    (value ids) holds; the sub-plans of the steps kept are pruned the same way."""
    read = set(outputs)
    kept: list[Step] = []
    for s in reversed(steps):
        if s.is_collective and s.outs and read.isdisjoint(s.outs):
            continue
        if s.subplans:
            subs = tuple(_pruned(sub) for sub in s.subplans)
            if any(a is not b for a, b in zip(subs, s.subplans)):
                s = replace(s, subplans=subs)
        read.update(s.ins)
        kept.append(s)
    kept.reverse()
    return kept


def _pruned(plan: Plan) -> Plan:
    """Sub-plan ``plan`` with its dead collectives dropped (itself when it has none)."""
    steps = live_steps(plan.steps, plan.outputs.values())
    if len(steps) == len(plan.steps) and all(a is b for a, b in zip(steps, plan.steps)):
        return plan
    return replace(plan, steps=steps)
