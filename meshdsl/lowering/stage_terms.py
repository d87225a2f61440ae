"""A pipeline's sum of scalar terms made on different stages: each stage adds its own, then one allreduce.

After the micro-batches, a global gradient norm adds one square sum per gradient (``scalar_sum``,
:mod:`.global_sum`), and every stage reads the norm (the clip scale every update reads).  Each
square sum is made on the stage holding its gradient, so adding them all on every stage would send
each term to every other stage: one ``send``/``recv`` pair per term and stage.  The sum is linear,
so instead each stage adds the terms made on it (zero where none are) into its part of a sum over
the stage axis, and one allreduce over that axis gives every stage the whole sum, as the norm's
terms of the pipelined stacks' own gradients (each stage's layers) are added already.

:func:`terms_by_stage` picks the sums to take so, :func:`per_stage_steps` writes their steps.
"""
from __future__ import annotations

import dataclasses

from .plan import Step, Value, step_args
from .stage_layers import zeros_step


def terms_by_stage(s: Step, stages: frozenset, held: dict, values: dict, axis: str) -> dict | None:
    """The terms of step ``s``, run on ``stages`` after the micro-batches, by the stage holding them
    (``{stage: [value ids]}``; ``held``: value -> its stages), when ``s`` is a ``scalar_sum`` of terms
    each whole over the stage axis ``axis`` and held on one of ``stages`` at least, not all on every
    one of them (else None: they need not move, or must)."""
    if (s.kind != "local" or s.op != "scalar_sum" or len(stages) < 2
            or any(axis in values[v].sharding.used_axes for v in (*s.ins, *s.outs))):
        return None
    where = [held.get(v, stages) & stages for v in s.ins]
    if not all(where) or all(h == stages for h in where):
        return None
    by_stage: dict[int, list[int]] = {}
    for v, h in zip(s.ins, where):
        by_stage.setdefault(min(h), []).append(v)
    return by_stage


def per_stage_steps(s: Step, by_stage: dict, stages, values: dict, axis: str, mesh) -> list:
    """``(step, stages)`` pairs making ``s``'s result (a ``scalar_sum``) from its terms ``by_stage``:
    on each of ``stages`` (every stage of ``axis``: the allreduce spans them all, those that do not
    read the result too) the sum of its own terms (zero where it has none), a part of a sum over
    ``axis`` (a new value of ``values``), then the allreduce of the parts over ``axis``."""
    v = values[s.outs[0]]
    part = max(values) + 1
    values[part] = Value(part, v.shape, v.dtype, v.sharding.with_partial((*v.sharding.partial, axis)))
    out = []
    for t in sorted(stages):
        terms = by_stage.get(t)
        own = (dataclasses.replace(s, ins=tuple(terms), outs=(part,), flops=len(terms),
                                   note=f"{s.note}; the terms made on this stage".lstrip("; "))
               if terms else zeros_step(part, values, s.phase))
        out.append((own, frozenset({t})))
    total = Step("allreduce", s.node, s.op, s.label, s.phase, (part,), s.outs, (axis,),
                 step_args("allreduce", {"op": "sum"}), values[part].local_bytes(mesh),
                 note="each stage's own terms, added over the stages")
    return out + [(total, frozenset(stages))]
