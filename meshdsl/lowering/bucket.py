"""Gradient bucketing: reduce several gradients in one collective over one flat buffer.

A data-parallel step reduces every gradient over the data axes.  One
collective per gradient pays a call's latency (and, on gloo, a round of
messages) per tensor, most of them small (norm scales, biases).  As DDP does,
this pass packs the gradient reductions into buckets of about ``bucket_mb``
megabytes each:

* a member is an ``allreduce`` (or ``reduce_scatter``: ZeRO-2, FSDP) of the
  backward phase whose result only the optimizer update reads or that is a
  plan output (a gradient), never an activation's reduction, which the rest
  of the backward waits for;
* members share kind, mesh axes, reduce op and dtype; they are taken in the
  order the backward produces the gradients, and a bucket closes once it
  holds ``bucket_mb``;
* the bucket step stands right after the step that makes its last gradient,
  and the executor starts it as soon as that gradient exists; the executor's issue order
  (:func:`meshdsl.runtime.executor.issue_order`) waits on it only when an update
  reads one of its members.

A layer loop's stacked gradients are not left to one reduction after the loop:
:func:`stream_loop_grads` moves the reduction of each stacked gradient that only a
gradient reduction reads into the backward block's sub-plan, one reduction of
the layer's slice per layer (packed into one bucket per layer), so the loop
(:mod:`meshdsl.runtime.layers`) starts it as soon as that layer's gradient exists,
while the layers below are still differentiated, as DDP's per-layer hooks do.

Collectives over the micro-batch axis (gradient accumulation) stay as they
are.  A pipelined plan is cut into stages before this pass could see it;
:func:`bucket_final` packs its final segment's gradient allreduces (over the
micro-batch axis and others: the pipeline adds the micro-batches up locally,
then reduces the sums over the other axes, one bucket per stage).
"""
from __future__ import annotations

import math
from dataclasses import replace

from ..collectives import parts_of
from ..layout.sharding import Sharding
from .fuse import IDENTITY
from .pipeline import MB_AXIS
from .plan import Plan, Step, Value, step_args

#: DDP's default bucket size.
DEFAULT_BUCKET_MB = 25.0
#: member kind -> bucket kind
BUCKET_KIND = {"allreduce": "bucket_allreduce", "reduce_scatter": "bucket_reduce_scatter"}


def _is_grad_reduction(s: Step, readers: dict, steps: list[Step], outputs: set[int], folded: bool = False,
                       cuts=None) -> bool:
    # backward: plain SGD reduces each gradient as it is made; update: an optimizer with a
    # global norm reduces the scaled gradients (the norm itself is summed from partials).
    # ``folded``: a pipeline's final segment, whose allreduces over the micro-batch axis add
    # the micro-batches up locally first (runtime/pipeline.py), then reduce over the other axes.
    if s.kind not in BUCKET_KIND or s.phase not in ("backward", "update"):
        return False
    if MB_AXIS in s.axes and not (folded and s.kind == "allreduce" and set(s.axes) - {MB_AXIS}):
        return False
    if s.op == "scalar_sum":  # the global gradient norm: every clipped update waits for it
        return False
    if s.args.get("uneven") and (cuts is None or cuts(s) is None):  # parts of unequal length the bucket
        return False                                                   # cannot cut its buffer at
    return _ends_in_update(s.outs[0], readers, steps, outputs)


def _ends_in_update(out: int, readers: dict, steps: list[Step], outputs: set[int]) -> bool:
    """Whether ``out`` is a plan output or only the update reads it, looking through identity
    steps (a pipeline's final segment keeps a gradient output's ``stop_gradient``)."""
    users = readers.get(out, ())
    if out in outputs or users:
        return all(steps[j].phase == "update" or (steps[j].kind == "local" and steps[j].op in IDENTITY
                                                   and len(steps[j].ins) == 1
                                                   and _ends_in_update(steps[j].outs[0], readers, steps, outputs))
                   for j in users)
    return False


def member_cuts(s: Step, values: dict, mesh) -> tuple[int, ...] | None:
    """The lengths reduce-scatter ``s`` cuts its dim at, by the index along its one axis, where
    every group cuts alike and its input's local part is alike on every rank (FSDP of a dim
    over ``data:3``: 8 as 3, 3, 2): then its chunk ``j`` has the same elements in every group
    and a bucket packs it (:func:`_bucket_step`); None otherwise, and for an even step."""
    entries, axes = s.args.get("uneven") or (), s.axes
    if s.kind != "reduce_scatter" or len(axes) != 1 or len(entries) != 1:
        return None
    pos, _, above, *_ = entries[0]
    v = values[s.ins[0]]
    if pos != s.args["dim"] or above or len({tuple(v.local_shape(mesh, r)) for r in range(mesh.size)}) != 1:
        return None
    got = {parts_of(s.args, mesh, g, axes)[pos] for g in mesh.groups(axes)}
    return got.pop() if len(got) == 1 else None


def bucket(steps: list[Step], values: dict, outputs: dict[str, int], bucket_mb: float, mesh=None) -> list[Step]:
    """``steps`` with the gradient reductions merged into buckets of about ``bucket_mb`` MB.

    A reduction that depends on another member's result (a clipped gradient on the
    reduced norm) starts a new bucket, so a bucket never waits on itself.

    Args:
      steps: the lowered (and fused) steps of a plan without a pipeline.
      values: value id -> :class:`~.plan.Value`.
      outputs: output name -> value id.
      bucket_mb: the bucket size in megabytes (2**20 bytes); 0 keeps one collective per gradient.
      mesh: the plan's mesh; with it, reduce-scatters of parts of unequal length join buckets
        too (:func:`member_cuts`).

    Returns:
      The new step list (``steps`` itself when nothing was merged), in an order where
      every step comes after the steps it reads from.
    """
    if bucket_mb <= 0:
        return steps
    steps = stream_loop_grads(steps, values, outputs, bucket_mb, mesh)
    cap = bucket_mb * 2 ** 20
    cuts = None if mesh is None else (lambda s: member_cuts(s, values, mesh))
    readers: dict[int, list[int]] = {}
    for i, s in enumerate(steps):
        for v in s.ins:
            readers.setdefault(v, []).append(i)
    outs = set(outputs.values())
    producer = {v: i for i, s in enumerate(steps) for v in s.outs}
    after: dict[int, int] = {}   # value id -> bit set of the candidate steps it depends on
    needs: dict[int, int] = {}   # candidate -> bit set of the candidates its input depends on
    for i, s in enumerate(steps):
        dep = 0
        for v in s.ins:
            dep |= after.get(v, 0)
        if _is_grad_reduction(s, readers, steps, outs, cuts=cuts):
            needs[i] = dep
            dep |= 1 << i
        for v in s.outs:
            after[v] = dep
    # In the order the backward makes the gradients (by the step that produced each), not
    # the order the reductions were emitted in: a bucket then holds gradients that are ready
    # at about the same time.  A member a reduction depends on was produced before it.
    order = sorted(needs, key=lambda i: (producer.get(steps[i].ins[0], -1), i))
    buckets = _fill(order, steps, values, cap,
                    starts_new=lambda i, members: needs[i] & sum(1 << j for j in members))
    # A bucket goes right after the step that makes its last gradient (readers of its
    # members that stood earlier move after it: _dependency_order).
    at: dict[int, list[list[int]]] = {}
    for members in buckets:
        if len(members) > 1:
            at.setdefault(max(producer.get(steps[j].ins[0], j) for j in members), []).append(members)
    merged = {j for bs in at.values() for members in bs for j in members}
    if not merged:
        return steps
    out: list[Step] = []
    for i, s in enumerate(steps):
        if i not in merged:
            out.append(s)
        for members in at.get(i, ()):
            out.append(_bucket_step(len(out), [steps[j] for j in members], values, mesh))
    return _dependency_order(out)


def _fill(order, steps: list[Step], values: dict, cap: float, extra=lambda i: None,
          starts_new=lambda i, members: False) -> list[list[int]]:
    """The reductions ``order`` (step positions) put into buckets, in that order: one open
    bucket per kind, axes, op, dtype and ``extra(i)``, closed once it holds ``cap`` bytes;
    ``starts_new(i, members)`` closes the open one before ``i`` would join it."""
    open_: dict[tuple, list[int]] = {}
    buckets: list[list[int]] = []
    for i in order:
        s = steps[i]
        key = (s.kind, s.axes, s.args.get("op", "sum"), values[s.ins[0]].dtype, extra(i))
        members = open_.get(key)
        if members is None or starts_new(i, members):
            members = open_[key] = []
            buckets.append(members)
        members.append(i)
        if sum(steps[j].bytes for j in members) >= cap:
            del open_[key]
    return buckets


def bucket_final(pairs: list[tuple[Step, frozenset]], values: dict, outputs: dict[str, int],
                 bucket_mb: float, per_microbatch: set[int]) -> list[tuple[Step, frozenset]]:
    """A pipeline's final segment, ``(step, stages)`` pairs, with its gradient allreduces packed
    into buckets of about ``bucket_mb`` MB.

    Members share kind, axes, op, dtype and stages, and reduce a gradient the forward and
    backward actions made (``per_microbatch``: what the pipeline's accumulator adds up over
    the micro-batches; a sum made in this segment, as a tied embedding's, is reduced on its
    own).  A bucket stands where its first member stood, so every reader of a member still
    comes after it.  No other step moves: the segment's transfers keep their order.
    """
    if bucket_mb <= 0:
        return pairs
    steps = [s for s, _ in pairs]
    readers: dict[int, list[int]] = {}
    for i, s in enumerate(steps):
        for v in s.ins:
            readers.setdefault(v, []).append(i)
    outs = set(outputs.values())
    order = [i for i, s in enumerate(steps)
             if _is_grad_reduction(s, readers, steps, outs, folded=True) and s.ins[0] in per_microbatch]
    buckets = _fill(order, steps, values, bucket_mb * 2 ** 20, extra=lambda i: pairs[i][1])
    at = {members[0]: members for members in buckets if len(members) > 1}
    if not at:
        return pairs
    merged = {j for members in at.values() for j in members}
    out = []
    for i, (s, st) in enumerate(pairs):
        if i in at:
            out.append((_bucket_step(len(out), [steps[j] for j in at[i]]), st))
        elif i not in merged:
            out.append((s, st))
    return out


def _dependency_order(steps: list[Step]) -> list[Step]:
    """``steps`` reordered so each comes after its producers, otherwise in the given order.

    A bucket stands right after the step that makes its last gradient; readers of its
    members that stood before it move after it.
    """
    producer = {v: i for i, s in enumerate(steps) for v in s.outs}
    done: set[int] = set()
    order: list[Step] = []

    def visit(i: int) -> None:
        stack = [i]
        while stack:
            j = stack[-1]
            if j in done:
                stack.pop()
                continue
            todo = [producer[v] for v in steps[j].ins if v in producer and producer[v] not in done]
            if todo:
                stack.extend(todo)
                continue
            done.add(j)
            order.append(steps[j])
            stack.pop()

    for i in range(len(steps)):
        visit(i)
    return order


def _bucket_step(pos: int, members: list[Step], values=None, mesh=None) -> Step:
    """One bucket step of ``members``.  A reduce-scatter member cut unevenly (its parts'
    lengths: :func:`member_cuts`) is cut there when packed (``cuts`` arg); the flat buffer's
    parts then hold each member's part ``j`` (``uneven`` arg, where they differ in length)."""
    last = members[-1]
    kind = BUCKET_KIND[last.kind]
    args = {"op": last.args.get("op", "sum")}
    if kind == "bucket_reduce_scatter":
        args["dims"] = tuple(m.args["dim"] for m in members)
        if any(m.args.get("uneven") for m in members):
            args.update(_flat_parts(members, values, mesh))
    names = ", ".join(m.label for m in members)
    return Step(kind, last.node, "bucket", f"grad bucket @{pos}", "backward",
                tuple(m.ins[0] for m in members), tuple(m.outs[0] for m in members), last.axes,
                step_args(kind, args), sum(m.bytes for m in members),
                note=f"{len(members)} gradient {last.kind}s in one buffer: {names}")


def _flat_parts(members: list[Step], values: dict, mesh) -> dict:
    """The ``cuts`` (each member's part lengths, ``()`` for an even one) and, where the flat
    buffer's parts differ in length, the ``uneven`` arg of a reduce-scatter bucket of ``members``."""
    each = [member_cuts(m, values, mesh) if m.args.get("uneven") else () for m in members]
    n = mesh.axis_size(members[0].axes)
    flat = [0] * n
    for m, c in zip(members, each):
        local, dim = values[m.ins[0]].local_shape(mesh, 0), m.args["dim"]   # alike on every rank
        per_index = math.prod(local) // local[dim] if local[dim] else 0
        for j in range(n):
            flat[j] += per_index * (c[j] if c else local[dim] // n)
    out = {"cuts": tuple(each)}
    if len(set(flat)) > 1:
        out["uneven"] = ((0, sum(flat), (), tuple(flat)),)
    return out


def stream_loop_grads(steps: list[Step], values: dict, outputs: dict[str, int], bucket_mb: float,
                      mesh=None) -> list[Step]:
    """``steps`` with stacked gradients reduced layer by layer inside the backward layer loop.

    A gradient the block's sub-plan reduces itself (FSDP's reduce-scatter) is streamed as
    it is.  A backward ``repeat`` step's stacked gradient whose one reader is a gradient
    reduction (an ``allreduce``, or a ``reduce_scatter`` along a dim other than
    ``layer``) loses that reduction: the block's sub-plan reduces the layer's slice
    instead (the same collective over the same axes, so the same sums), its
    reductions packed into buckets of ``bucket_mb`` (:func:`bucket`), and the repeat
    step outputs the reduced stacked value (its name in the step's ``streamed`` arg).
    """
    readers: dict[int, list[int]] = {}
    for i, s in enumerate(steps):
        for v in s.ins:
            readers.setdefault(v, []).append(i)
    outs = set(outputs.values())
    dropped: set[int] = set()
    new: dict[int, Step] = {}
    for i, r in enumerate(steps):
        if r.kind != "repeat" or not r.args["backward"] or len(r.subplans) != 1:
            continue
        sub, names, pos = r.subplans[0], r.args["names"], r.args["pos"]
        sub_steps, sub_values, sub_outputs = list(sub.steps), dict(sub.values), dict(sub.outputs)
        next_id = max([*values, *sub_values]) + 1
        r_outs, streamed, members = list(r.outs), [], {}
        nc = r.args.get("carries", 1)   # the stacked gradients follow the carried tensors' gradients
        sub_readers: dict[int, list[int]] = {}
        for j, t in enumerate(sub_steps):
            for v in t.ins:
                sub_readers.setdefault(v, []).append(j)
        made = {v: t for t in sub_steps for v in t.outs}
        for n, name in enumerate(names):
            # reduced in the block already (FSDP's reduce-scatter into the param's shards): only
            # the loop's waiting for it at the end of each layer goes
            t = made.get(sub_outputs[f"d/{name}"])
            cuts = None if mesh is None else (lambda s: member_cuts(s, sub_values, mesh))
            if t is not None and _is_grad_reduction(t, sub_readers, sub_steps, set(sub_outputs.values()), cuts=cuts):
                members[t.outs[0]] = t.outs[0]
                streamed.append(name)
                continue
            g = r.outs[nc + n]
            users = readers.get(g, ())
            if len(users) != 1 or g in outs:
                continue
            s = steps[users[0]]
            if s.ins != (g,) or not _is_grad_reduction(s, readers, steps, outs) or s.args.get("dim") == pos[name]:
                continue
            part = sub_values[sub_outputs[f"d/{name}"]]
            stacked = values[s.outs[0]]
            layer = stacked.shape[pos[name]].name
            reduced = Value(next_id, part.shape, part.dtype,
                            Sharding(tuple((d, a) for d, a in stacked.sharding.dims if d != layer),
                                     stacked.sharding.partial))
            sub_values[next_id] = reduced
            args = dict(s.args)
            if "dim" in args:
                args["dim"] -= args["dim"] > pos[name]
            sub_steps.append(replace(s, phase="backward", ins=(part.id,),
                                     outs=(next_id,), args=step_args(s.kind, args),
                                     bytes=part.local_bytes(sub.mesh),
                                     note=f"{s.kind} of one layer's slice of {name}'s gradient, started in the "
                                          f"layer loop as soon as the layer's backward made it"))
            sub_outputs[f"d/{name}"] = members[next_id] = next_id
            next_id += 1
            r_outs[nc + n] = s.outs[0]
            streamed.append(name)
            dropped.add(users[0])
        if streamed:
            sub_steps = bucket(sub_steps, sub_values, {str(v): v for v in members}, bucket_mb, mesh)
            body = Plan(sub.mesh, sub.layout, sub_steps, sub_values, sub_outputs, sub.params, sub.inputs,
                        sub.notes, sub.holders)
            new[i] = replace(r, outs=tuple(r_outs), subplans=(body,),
                             args=step_args("repeat", {**r.args, "streamed": tuple(streamed)}))
    if not new:
        return steps
    return [new.get(i, s) for i, s in enumerate(steps) if i not in dropped]
