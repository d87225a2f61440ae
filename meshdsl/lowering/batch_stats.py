"""Whole-batch statistics of values fixed when the step starts: made once, before the micro-batches.

A loss often divides by a count made from the inputs over the whole batch: an MLM loss
``reduce_sum(ce * weights) / reduce_sum(weights)``, or a language model's loss over padded
rows divided by the number of real tokens.  DINO centres a frozen teacher's logits by their
mean over the batch.  Lowered with the micro-batch axis (:mod:`.pipeline`), such a value is
each micro-batch's own sum (a local step, partial over :data:`~.pipeline.MB_AXIS`) and an
allreduce over the micro-batch axis joining them.  Read as it is, it would put the loss, and
the whole backward the loss's gradient starts, after the micro-batches: a pipeline cannot run
that (:mod:`.partition` refuses it), and gradient accumulation would hold every micro-batch's
activations at once.

But such a value depends only on what is fixed when the step starts: the inputs of every
micro-batch are fed then, and the params hold their starting values until the update.  So the
steps that make it are no per-micro-batch work: they run once, in the prologue, on every
virtual micro-batch rank of the stages that read the result (each its own micro-batch's part,
then the allreduce joins them, as in the SPMD program), and each micro-batch's forward and
backward then read the whole-batch value as a constant.  Nothing else changes: what the
micro-batch computes from its own part of the batch (the loss's numerator, its gradient)
stays per micro-batch and is summed over the micro-batches after them, so the step computes
exactly what the SPMD program, and the dense one, does.  A gradient through the statistic
(a batch norm of a trained stem before the layers) is a sum over the batch too: it runs
after the micro-batches, allowed where the pipelined backward does not read it.

The steps made once (:func:`whole_batch_stats`):

* the **joins**: allreduces over the micro-batch axis of a forward value made from inputs,
  params and constants (:func:`fixed_in_the_step`), not by a pipelined stack (it runs one
  micro-batch at a time); one made from params too only where a micro-batch reads it (the
  loss's mean, read after the micro-batches only, stays there);
* what they sum: the per-micro-batch steps that feed a join (a frozen teacher's forward);
* what follows: forward steps made only of joined values and values the same for every
  micro-batch (``1 / count``, ``maximum(count, 1)``).

A whole-batch value made by a pipelined stack (a mean of its logits over the batch) is not one
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


def fixed_in_the_step(steps, stacks=frozenset()) -> set[int]:
    """Value ids whose forward value is fixed once the step starts: made from inputs, params and
    constants by forward steps, none of them a pipelined stack's (positions ``stacks``), which runs
    one micro-batch at a time.  The params are the step's starting values (updates come after)."""
    out: set[int] = set()
    for i, s in enumerate(steps):
        if s.kind in _LEAVES or (s.phase == "forward" and i not in stacks and all(v in out for v in s.ins)):
            out.update(s.outs)
    return out


def whole_batch_stats(steps, per_mb, stacks=frozenset()) -> set[int]:
    """Positions of the per-micro-batch steps of ``steps`` (``per_mb[i]``: step ``i`` varies per
    micro-batch) that make a whole-batch statistic of values fixed once the step starts, or a part
    of one: they run once per step, before the micro-batches.  ``stacks``: the positions of the
    pipelined repeats' steps.  See the module docstring."""
    fixed, inputs = fixed_in_the_step(steps, stacks), from_inputs_only(steps)
    producer = {v: i for i, s in enumerate(steps) for v in s.outs}
    joins = {j for j, s in enumerate(steps) if per_mb[j] and _is_join(s, fixed)
             and (all(v in inputs for v in s.ins) or _read_per_microbatch(steps, per_mb, producer, fixed, j))}
    after = _following(steps, per_mb, producer, fixed, joins)
    return joins | after | {i for j in joins for i in _summed(steps, per_mb, producer, j)}


def _read_per_microbatch(steps, per_mb, producer, fixed: set, join: int) -> bool:
    """Whether a per-micro-batch step reads the result of the join (step ``join``) or of what
    follows it.  A join of values made from params too is made once only then (a centre), not where
    only what runs after the micro-batches reads it (the loss's mean): made once, it would hold every
    micro-batch's forward at once."""
    after = _following(steps, per_mb, producer, fixed, {join})
    whole = {v for i in (join, *after) for v in steps[i].outs}
    return any(per_mb[i] and i != join and i not in after and whole & set(s.ins) for i, s in enumerate(steps))


def _summed(steps, per_mb, producer, join: int) -> set[int]:
    """What the join (step ``join``) sums: the per-micro-batch steps behind it, each micro-batch's part."""
    out, todo = set(), list(steps[join].ins)
    while todo:
        j = producer.get(todo.pop())
        if j is None or j in out or steps[j].kind in _LEAVES or not per_mb[j]:
            continue
        out.add(j)
        todo += steps[j].ins
    return out


def _following(steps, per_mb, producer, fixed: set, joins: set) -> set[int]:
    """What follows the joins (steps ``joins``): forward steps made only of their results, of what
    follows them, and of fixed values the same for every micro-batch (``1 / count``)."""
    out, whole = set(), {v for j in joins for v in steps[j].outs}
    for i, s in enumerate(steps):
        if (per_mb[i] and i not in joins and s.kind not in _LEAVES and s.phase == "forward" and s.ins
                and any(v in whole for v in s.ins)
                and all(v in whole or (v in fixed and not per_mb[producer[v]]) for v in s.ins)):
            out.add(i)
            whole.update(s.outs)
    return out


def made_once(steps, per_mb: list[bool], stacks=frozenset()) -> list[bool]:
    """``per_mb`` with the whole-batch statistics (:func:`whole_batch_stats`) made once per step
    instead of once per micro-batch; ``stacks``: the positions of the pipelined repeats' steps."""
    once = whole_batch_stats(steps, per_mb, stacks)
    return [f and i not in once for i, f in enumerate(per_mb)]


def param_behind(steps, producer: dict, v: int) -> str | None:
    """The name of a param value ``v`` is made from (the first one found walking back), or None
    when it is made from inputs only: why a whole-batch value was not made once (for messages)."""
    i = first_behind(steps, producer, v, lambda j: steps[j].kind == "param")
    return None if i is None else steps[i].label


def first_behind(steps, producer: dict, v: int, hit) -> int | None:
    """The position of the first step ``hit(position)`` holds for, walking back from value ``v``
    through the steps that make it, or None."""
    seen, todo = set(), [v]
    while todo:
        i = producer.get(todo.pop())
        if i is None or i in seen:
            continue
        seen.add(i)
        if hit(i):
            return i
        todo += steps[i].ins
    return None
