"""Gradients written by their matmul straight into a buffer, or added into it.

A repeat's backward loop puts each layer's parameter gradients into one stacked
buffer per gradient (:mod:`.layers`), and a pipeline sums each micro-batch's stacked
gradients into a running sum (:class:`~.pipeline_store.Accumulator`).  Done with
copies, every gradient costs its matmul, then a copy into the buffer, then an add
into the sum: two more passes over memory per weight, per layer, per micro-batch.

When the step that makes a gradient is a matmul-form einsum and nothing else in the
block reads its result, it writes into the buffer's layer slice itself:
``mm(a, b, out=slice)``, or ``slice.addmm_(a, b)`` to add into a running sum (the
add happens inside the matmul).  :func:`install` wraps that step's call once; the
loop points :attr:`Sink.dst` at this layer's slices before the block runs.

Nothing in the block reads such a gradient, so its matmul may also run later: a
pipeline stage that sends an input gradient upstream puts its weight-gradient
matmuls off until that send has gone (:class:`Deferred`), so the previous stage
can start its backward while this one finishes the weight gradients (the split
of zero-bubble pipeline schedules).  The loop points :attr:`Sink.later` at the
list they go to.

A matmul outside any loop whose product a pipeline (or gradient accumulation) only sums
over the micro-batches (the MLP's weight gradients) gets the same treatment from the
pipeline runtime: the first micro-batch's product becomes the running sum and every later
one adds into it (:func:`product_sums`, :func:`adding_into_sum`).
"""
from __future__ import annotations

from ..lowering.fuse import IDENTITY
from ..ops.registry import OPS
from .steps import representatives


class Sink:
    """Where one gradient goes while a loop runs its block: ``dst`` (one tensor per held
    rank, or None: the step returns a fresh result), whether to add into it, and ``later``:
    None (the matmul runs now) or the list of a :class:`Deferred` it is appended to."""

    __slots__ = ("dst", "accumulate", "later")

    def __init__(self):
        self.dst: list | None = None
        self.accumulate = False
        self.later: list | None = None


class Deferred:
    """Weight-gradient matmuls a B action puts off until after its send.

    ``values``: the stacked gradients (value ids) whose matmuls may wait: only the
    pipeline's final segment reads them.  ``work``: the ready BLAS calls, in the order
    the loop made them; :meth:`run` runs and forgets them.
    """

    __slots__ = ("values", "work")

    def __init__(self, values):
        self.values = frozenset(values)
        self.work: list = []

    def run(self) -> None:
        work, self.work = self.work, []
        for call in work:
            call()


def matmul_producer(plan, vid: int) -> int | None:
    """The position of the step of ``plan`` whose matmul may write value ``vid`` into a buffer.

    None unless that step is a two-operand einsum in matmul form whose product comes
    out in the output's order, in the plain kernel (not a mixed-precision one), and
    ``vid`` is read by no step of the plan (only the plan's output names it).  Identity
    kernels in between (``stop_gradient``, the gradient's name) are seen through: they
    hand on the tensor itself.
    """
    steps = plan.steps
    producer = {v: i for i, s in enumerate(steps) for v in s.outs}
    readers: dict = {}
    for s in steps:
        for v in s.ins:
            readers[v] = readers.get(v, 0) + 1
    if readers.get(vid) or vid not in producer:
        return None
    i = producer[vid]
    while steps[i].kind == "local" and steps[i].op in IDENTITY:  # a gradient's name tag: see through it
        (v,) = steps[i].ins
        if readers[v] != 1 or v not in producer:
            return None
        vid, i = v, producer[v]
    s = steps[i]
    form = s.args.get("attrs", {}).get("form") if s.kind == "local" else None
    if (form is None or not form.in_order or s.op != "einsum" or len(s.ins) != 2 or len(s.outs) != 1
            or s.args["fn"] != OPS["einsum"].compute):
        return None
    return i


def install(ex, vid: int) -> Sink | None:
    """Make the step of ``ex`` that produces value ``vid`` write into a :class:`Sink`.

    Returns None (the step is left as it is) unless :func:`matmul_producer` finds the
    step and it runs once per held rank, not donated.
    """
    i = matmul_producer(ex.plan, vid)
    if (i is None or i in ex.donated or ex.compiling is not None  # a compiled segment makes it
            or representatives(ex.plan, ex.comm, ex.plan.steps[i]) is not None):
        return None
    s = ex.plan.steps[i]
    form, vid = s.args["attrs"]["form"], s.outs[0]
    sink, plain, (a, b) = Sink(), ex.calls[i], s.ins

    def call(env, get, run):
        dst = sink.dst
        if dst is None:
            return plain(env, get, run)
        acc, later = sink.accumulate, sink.later
        env[vid] = [form.matmul(x, y) if d is None else form.matmul_into(x, y, d, acc, later)
                    for x, y, d in zip(get(a), get(b), dst)]

    # each held rank's generated calls for its operands' local shapes (the plan fixes them)
    plan = ex.plan
    shaped = [form.calls_for(plan.values[a].local_shape(plan.mesh, r), plan.values[b].local_shape(plan.mesh, r))
              for r in ex.comm.ranks]

    def per_rank(j: int, x, y):
        """Held rank ``j``'s product, as ``call`` makes it: the straight-line program calls this
        inline, on its locals (:mod:`.program`)."""
        dst = sink.dst
        if dst is None:
            return shaped[j][0](x, y)
        return form.matmul_into(x, y, dst[j], sink.accumulate, sink.later, shaped[j])
    call.per_rank = per_rank
    ex.calls[i] = call
    return sink


def product_sums(plan, read) -> dict[int, int]:
    """Value id -> position, for each matmul step of ``plan`` (a pipeline's backward segment)
    whose product nothing but the final segment reads (no value of ``read``): a micro-batch's
    share of a sum over the micro-batches (a weight gradient outside the repeat), which the
    pipeline's accumulator may keep as the running sum for later micro-batches to add into."""
    return {s.outs[0]: j for j, s in enumerate(plan.steps)
            if s.kind == "local" and len(s.outs) == 1 and s.outs[0] not in read
            and matmul_producer(plan, s.outs[0]) == j}


def adding_into_sum(call, s):
    """``call`` of matmul step ``s`` (one of :func:`product_sums`), adding its product into the
    running sum that ``run.into`` holds for it, in one BLAS call (no product to allocate and add)."""
    form, (a, b), (vid,) = s.args["attrs"]["form"], s.ins, s.outs

    def go(env, get, run):
        into = run.into.get(vid) if run.into else None
        if into is None:
            return call(env, get, run)
        env[vid] = [form.matmul_into(x, y, d, True) for x, y, d in zip(get(a), get(b), into)]
    return go
