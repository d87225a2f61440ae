"""A layer loop's carry written straight where it is sent: the last layer's add into a slot.

A pipeline stage sends what its layer loop ends with (the forward's carry, the backward's carry
gradient) to the next stage, through a shared-memory slot (:class:`~meshdsl.comm.shm_pipe.PipeLink`).
The loop's body makes that value with an ``add`` (the residual ``x + block(x)``; in the backward,
the two paths' gradients of the layer's input), seen through identity kernels after it
(``stop_gradient``).  :func:`install_out` makes that add write into a given destination
(``torch.add(x, y, out=dst)``: the same kernel, so the same bits) when one is set, for the
layer that asks: the pipeline hands its send's next slot (:meth:`PipeLink.reserve`), and the
send then finds its value already there and only publishes it.  A body whose carry no such add
makes (another op last, an operand to align, a value read again in the body or returned twice)
is left as it is: its send copies.
"""
from __future__ import annotations

import torch

from ..lowering.fuse import IDENTITY
from ..ops.inplace import direct_add
from ..ops.registry import OPS
from .steps import local_kernel, representatives


class CarryOut:
    """Where the add that makes a loop body's carry writes: ``dst`` (one tensor per held rank), set
    for the layer that makes the loop's result, else None (the add's own kernel).  ``want``: the
    destination a pipeline asks the loop's next run to write its result into (None: none)."""

    __slots__ = ("dst", "want")

    def __init__(self):
        self.dst = self.want = None


def carry_producer(plan, vid: int) -> int | None:
    """The position of the ``add`` step of ``plan`` that makes output ``vid`` (seen through identity
    kernels that hand on its tensor), or None: an add of two operands already in the sum's dims,
    dtype and local shape, whose result (and each value between it and ``vid``) nothing but the
    next identity reads, and no other output of ``plan`` names."""
    steps = plan.steps
    producer = {v: i for i, s in enumerate(steps) for v in s.outs}
    readers: dict = {}
    for s in steps:
        for v in s.ins:
            readers[v] = readers.get(v, 0) + 1
    if readers.get(vid) or vid not in producer or list(plan.outputs.values()).count(vid) != 1:
        return None
    i = producer[vid]
    while steps[i].kind == "local" and steps[i].op in IDENTITY and len(steps[i].ins) == 1:
        (v,) = steps[i].ins
        if readers[v] != 1 or v not in producer or v in plan.outputs.values():
            return None
        i = producer[v]
    s = steps[i]
    if s.kind != "local" or s.op != "add" or len(s.ins) != 2 or len(s.outs) != 1:
        return None
    if s.args["attrs"].get("align") != ((None, None), (None, None)):
        return None
    out = plan.values[s.outs[0]]
    if any(plan.values[v].dtype != out.dtype for v in s.ins):
        return None
    return i


def install_out(ex, vid: int) -> CarryOut | None:
    """Make the add of executor ``ex``'s plan that makes output ``vid`` (:func:`carry_producer`)
    write into a :class:`CarryOut`'s ``dst`` while one is set; None (nothing changed) where no such
    add makes it, or its step runs on representatives, is compiled or was replaced already."""
    i = carry_producer(ex.plan, vid)
    if (i is None or i in ex.donated or ex.compiling is not None or ex.calls[i] is not ex.rules[i]
            or representatives(ex.plan, ex.comm, ex.plan.steps[i]) is not None):
        return None
    plan, s = ex.plan, ex.plan.steps[i]
    shapes = [tuple(plan.values[v].local_shape(plan.mesh, r) for v in (*s.ins, *s.outs)) for r in ex.comm.ranks]
    if any(len(set(each)) != 1 for each in shapes):   # (operands broadcast: the plain kernel only)
        return None
    k = local_kernel(ex.ctx, i, s)
    carry, plain, (a, b), (out,) = CarryOut(), ex.calls[i], s.ins, s.outs
    # each held rank's kernel as the straight-line program would call it (.program's local units)
    direct = [direct_add(k.fn, k.attrs) if k.fn is not OPS["add"].compute else
              OPS["add"].direct_for(k.attrs, each[:2], each[2:]) for each in shapes]
    kernels = [d or (lambda x, y, c=c: k.fn(c, k.attrs, x, y)) for d, c in zip(direct, k.ctxs)]

    def call(env, get, run):
        dst = carry.dst
        if dst is None:
            return plain(env, get, run)
        env[out] = [torch.add(x, y, out=d) for x, y, d in zip(get(a), get(b), dst)]

    def per_rank(j: int, x, y):
        """Held rank ``j``'s sum, as ``call`` makes it, called inline by the straight-line program."""
        dst = carry.dst
        if dst is None:
            return kernels[j](x, y)
        return torch.add(x, y, out=dst[j])
    call.per_rank = per_rank
    ex.calls[i] = call
    return carry


class CarrySlot:
    """A loop step's :class:`CarryOut`, installed in its body's executor ``ex`` when a pipeline
    first asks (:meth:`install`, before the body's program is built) for output ``vid``."""

    def __init__(self, ex, vid: int):
        self.ex, self.vid, self.out, self.asked = ex, vid, None, False

    def install(self) -> CarryOut | None:
        if not self.asked:
            self.asked = True
            self.out = install_out(self.ex, self.vid)
        return self.out

    def layer_fn(self, layer, last: int):
        """``layer(l, carry)`` of a loop run, writing layer ``last``'s result where the pipeline
        asked for this run (the wish is used up), or ``layer`` itself when it asked nothing."""
        carry = self.out
        want = None if carry is None else carry.want
        if want is None:
            return layer
        carry.want = None

        def into(l, x):
            carry.dst = want if l == last else None
            try:
                return layer(l, x)
            finally:
                carry.dst = None
        return into
