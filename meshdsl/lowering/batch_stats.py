"""Whole-batch statistics of the inputs: made once per step, before the micro-batches.

A loss often divides by a count made from the inputs over the whole batch: an MLM loss
``reduce_sum(ce * weights) / reduce_sum(weights)``, or a language model's loss over padded
rows divided by the number of real tokens.  Lowered with the micro-batch axis
(:mod:`.pipeline`), that count is each micro-batch's own sum (a local step, partial over
:data:`~.pipeline.MB_AXIS`) and an allreduce over the micro-batch axis joining them.  Read
as it is, it would put the loss, and the whole backward the loss's gradient starts, after
the micro-batches: a pipeline cannot run that (:mod:`.partition` refuses it), and gradient
accumulation would hold every micro-batch's activations at once.

But such a value depends on the inputs only, and the inputs of every micro-batch are fed
when the step starts.  So the steps that make it are no per-micro-batch work: they run once,
in the prologue, on every virtual micro-batch rank of the stages that read the result (each
its own micro-batch's part, then the allreduce joins them, as in the SPMD program), and each
micro-batch's forward and backward then read the whole-batch value as a constant.  Nothing
else changes: what the micro-batch computes from its own part of the batch (the loss's
numerator, its gradient) stays per micro-batch and is summed over the micro-batches
after them, so the step computes exactly what the SPMD program, and the dense one, does.

The steps made once (:func:`whole_batch_stats`):

* the **joins**: allreduces over the micro-batch axis of a value made from inputs only (no
  param, no value made from a param);
* what they sum: the per-micro-batch steps, made from inputs only, that feed a join;
* what follows: forward steps made only of joined values and values the same for every
  micro-batch (``1 / count``, ``maximum(count, 1)``).

A whole-batch value that depends on params (a mean of the logits over the batch) is not one
of them: it needs every micro-batch's forward first, and stays refused under a pipeline.
"""
from __future__ import annotations

from .pipeline import MB_AXIS

_LEAVES = ("param", "input")


def from_inputs_only(steps) -> set[int]:
    """Value ids made from inputs (and constants) only: no param feeds them, however far back."""
    out: set[int] = set()
    for s in steps:
        if s.kind == "input" or (s.kind != "param" and all(v in out for v in s.ins)):
            out.update(s.outs)
    return out


def _is_join(s, pure: set) -> bool:
    """Whether step ``s`` is an allreduce over the micro-batch axis of values made from inputs only."""
    return s.kind == "allreduce" and MB_AXIS in s.axes and s.phase == "forward" and all(v in pure for v in s.ins)


def whole_batch_stats(steps, per_mb) -> set[int]:
    """Positions of the per-micro-batch steps of ``steps`` (``per_mb[i]``: step ``i`` varies per
    micro-batch) that make a whole-batch statistic of the inputs, or a part of one: they run once
    per step, before the micro-batches.  See the module docstring."""
    pure = from_inputs_only(steps)
    producer = {v: i for i, s in enumerate(steps) for v in s.outs}
    joins = {i for i, s in enumerate(steps) if per_mb[i] and _is_join(s, pure)}
    if not joins:
        return set()
    out = set(joins)
    todo = [v for i in joins for v in steps[i].ins]
    while todo:   # what the joins sum: each micro-batch's part
        j = producer.get(todo.pop())
        if j is None or j in out or steps[j].kind in _LEAVES or not per_mb[j]:
            continue
        out.add(j)
        todo += steps[j].ins
    whole = {v for i in joins for v in steps[i].outs}
    for i, s in enumerate(steps):   # what follows: made of whole-batch values and constants only
        if (per_mb[i] and i not in out and s.kind not in _LEAVES and s.phase == "forward" and s.ins
                and any(v in whole for v in s.ins)
                and all(v in whole or (v in pure and not per_mb[producer[v]]) for v in s.ins)):
            out.add(i)
            whole.update(s.outs)
    return out


def made_once(steps, per_mb: list[bool]) -> list[bool]:
    """``per_mb`` with the whole-batch statistics of the inputs (:func:`whole_batch_stats`) made
    once per step instead of once per micro-batch."""
    once = whole_batch_stats(steps, per_mb)
    return [f and i not in once for i, f in enumerate(per_mb)]


def param_behind(steps, producer: dict, v: int) -> str | None:
    """The name of a param value ``v`` is made from (the first one found walking back), or None
    when it is made from inputs only: why a whole-batch value was not made once (for messages)."""
    seen, todo = set(), [v]
    while todo:
        i = producer.get(todo.pop())
        if i is None or i in seen:
            continue
        seen.add(i)
        if steps[i].kind == "param":
            return steps[i].label
        todo += steps[i].ins
    return None
