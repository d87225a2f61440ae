"""Sums over a pipeline's stage axis: the gradient of an activation every stage's layers read.

A pipelined repeat whose block reads a tensor from outside makes each stage's backward
loop sum its own layers' gradients of it, so the whole gradient is a sum over the
stages: the lowering reduces it right after the loop (:mod:`.repeat`), with one
allreduce over the stage axis and, for a param or a table, the micro-batch axis.
That one runs after the micro-batches on every stage, like the global norm's sums
(:mod:`.partition`'s final segment).  But an activation made per micro-batch before
the pipelined layers (an encoder's output, on stage 0) needs its gradient per
micro-batch, on stage 0, for its own backward: that sum becomes a chain of transfers
down the stages in the backward pass, the way the carry's gradient travels, each
stage adding its part to what the stage after it sent, so stage 0 ends with the sum.
With several stacks on the stage axis the chain runs down the reading stack's stages,
to the stage that made the tensor (an encoder's output: the encoder's last stage).
"""
from __future__ import annotations

import dataclasses

from .plan import Step, Value, step_args


def _add(ctx, attrs, a, b):
    """A stage's own part plus the running sum it received."""
    return a + b


def _same(ctx, attrs, x):
    """The one stage's part: the sum."""
    return x


def chained(steps, ax: str, B: int | None, per_mb, producer) -> dict[int, int]:
    """The stage sums to make by transfers, position -> the tensor whose gradient it sums: an
    allreduce over the stage axis alone of a gradient the pipelined backward ``B`` outputs for a
    tensor made per micro-batch."""
    if B is None:
        return {}
    bstep = steps[B]
    closed = bstep.args.get("closed", ())
    (block,) = bstep.subplans
    with_grad = [k for k in closed if f"d/{k}" in block.outputs]
    # the closed-over tensors' gradients follow the carries' (k for a tuple carry) and the stacked ones
    first = bstep.args.get("carries", 1) + len(bstep.args["names"])
    out = {}
    for i, s in enumerate(steps):
        if s.kind != "allreduce" or s.axes != (ax,) or s.ins[0] not in bstep.outs[first:]:
            continue
        k = with_grad[bstep.outs.index(s.ins[0]) - first]
        c = bstep.ins[len(bstep.ins) - len(closed) + closed.index(k)]
        if c in producer and per_mb[producer[c]]:
            out[i] = c
    return out


def expand(s: Step, values: dict, mesh, ax: str, run: tuple[int, int], tag: int,
           to: int | None = None) -> tuple[list, int]:
    """Stage-sum step ``s`` as transfers and adds: (step, stages) pairs, and the tag used.

    ``run`` is ``(lo, hi)``, the first and last stage running the pipelined layers (stages
    0 and p - 1, or a stack's own run when several stacks share the stage axis).  Each of
    those stages' part is value ``s.ins[0]``; stage ``lo`` ends with the sum in ``s.outs[0]``
    (a stage between holds there the sum of the stages from it on), or stage ``to`` before it,
    where the tensor was made (an encoder's output, made on the encoder's last stage), receives
    it there from stage ``lo``.
    """
    (part,), (total,) = s.ins, s.outs
    lo, hi = run
    if to is not None and to < lo:
        out, tag = expand(s, values, mesh, ax, run, tag)
        bump = max(values) + 1   # the sum as it leaves stage lo
        values[bump] = Value(bump, values[total].shape, values[total].dtype, values[total].sharding)
        out = [(dataclasses.replace(x, outs=tuple(bump if o == total else o for o in x.outs),
                                    ins=tuple(bump if o == total else o for o in x.ins)), st) for x, st in out]
        tag += 1
        what = f"{s.label}: the sum of stages {lo}.. to stage {to}"
        args = {"offset": to - lo, "tag": tag}
        nbytes = values[total].local_bytes(mesh)
        return out + [(Step("send", -1, "send", f"send {what}", s.phase, (bump,), (), (ax,),
                            step_args("send", args), nbytes), frozenset({lo})),
                      (Step("recv", -1, "recv", f"recv {what}", s.phase, (), (total,), (ax,),
                            step_args("recv", args), nbytes), frozenset({to}))], tag
    v = values[total]
    got = max(values) + 1  # the running sum received from the stage after
    values[got] = Value(got, v.shape, v.dtype, v.sharding)
    nbytes = v.local_bytes(mesh)
    tag += 1

    def move(kind, vid, stage, what):
        ins, outs = ((vid,), ()) if kind == "send" else ((), (vid,))
        return (Step(kind, -1, kind, f"{kind} {what}", s.phase, ins, outs, (ax,),
                     step_args(kind, {"offset": -1, "tag": tag}), nbytes), frozenset({stage}))

    compute = {"compute": v.sharding.split, "sizes": {d.name: d.size for d in v.shape}}
    if lo == hi:   # one stage runs the layers: its part is the sum
        return [(Step("local", -1, "copy", f"{s.label}: one stage's sum", s.phase, (part,), (total,), (),
                      step_args("local", {"fn": _same, "attrs": {}, **compute})), frozenset({lo}))], tag
    add = step_args("local", {"fn": _add, "attrs": {}, **compute})
    out = [move("send", part, hi, f"{s.label}: stage {hi}'s part to stage {hi - 1}")]
    for t in reversed(range(lo, hi)):
        out.append(move("recv", got, t, f"{s.label}: the sum of stages {t + 1}.. on stage {t}"))
        out.append((Step("local", -1, "add", f"{s.label}: sum over the stages", s.phase, (part, got), (total,), (),
                         add, flops=v.sharding.local_numel(v.shape, mesh)), frozenset({t})))
        if t > lo:
            out.append(move("send", total, t, f"{s.label}: the sum of stages {t}.. to stage {t - 1}"))
    return out, tag
