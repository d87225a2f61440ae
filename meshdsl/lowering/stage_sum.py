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
"""
from __future__ import annotations

from .plan import Step, Value, step_args


def _add(ctx, attrs, a, b):
    """A stage's own part plus the running sum it received."""
    return a + b


def chained(steps, ax: str, B: int | None, per_mb, producer) -> set[int]:
    """Positions of the stage sums to make by transfers: an allreduce over the stage axis
    alone of a gradient the pipelined backward ``B`` outputs for a tensor made per micro-batch."""
    if B is None:
        return set()
    bstep = steps[B]
    closed = bstep.args.get("closed", ())
    (block,) = bstep.subplans
    with_grad = [k for k in closed if f"d/{k}" in block.outputs]
    first = 1 + len(bstep.args["names"])  # the closed-over tensors' gradients follow the stacked ones
    out = set()
    for i, s in enumerate(steps):
        if s.kind != "allreduce" or s.axes != (ax,) or s.ins[0] not in bstep.outs[first:]:
            continue
        k = with_grad[bstep.outs.index(s.ins[0]) - first]
        c = bstep.ins[len(bstep.ins) - len(closed) + closed.index(k)]
        if c in producer and per_mb[producer[c]]:
            out.add(i)
    return out


def expand(s: Step, values: dict, mesh, ax: str, p: int, tag: int) -> tuple[list, int]:
    """Stage-sum step ``s`` as transfers and adds: (step, stages) pairs, and the tag used.

    Each stage's part is value ``s.ins[0]``; stage 0 ends with the sum in ``s.outs[0]``
    (a stage between holds there the sum of the stages from it on).
    """
    (part,), (total,) = s.ins, s.outs
    v = values[total]
    got = max(values) + 1  # the running sum received from the stage after
    values[got] = Value(got, v.shape, v.dtype, v.sharding)
    nbytes = v.local_bytes(mesh)
    tag += 1

    def move(kind, vid, stage, what):
        ins, outs = ((vid,), ()) if kind == "send" else ((), (vid,))
        return (Step(kind, -1, kind, f"{kind} {what}", s.phase, ins, outs, (ax,),
                     step_args(kind, {"offset": -1, "tag": tag}), nbytes), frozenset({stage}))

    add = step_args("local", {"fn": _add, "attrs": {}, "compute": v.sharding.split,
                              "sizes": {d.name: d.size for d in v.shape}})
    out = [move("send", part, p - 1, f"{s.label}: stage {p - 1}'s part to stage {p - 2}")]
    for t in reversed(range(p - 1)):
        out.append(move("recv", got, t, f"{s.label}: the sum of stages {t + 1}.. on stage {t}"))
        out.append((Step("local", -1, "add", f"{s.label}: sum over the stages", s.phase, (part, got), (total,), (),
                         add, flops=v.sharding.local_numel(v.shape, mesh)), frozenset({t})))
        if t > 0:
            out.append(move("send", total, t, f"{s.label}: the sum of stages {t}.. to stage {t - 1}"))
    return out, tag
