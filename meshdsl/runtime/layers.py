"""Running a ``repeat`` step: its sub-plan once per layer, forward or backward.

The step is data (:mod:`meshdsl.lowering.repeat` builds it): the block's sub-plan in
``step.subplans``, the layer count in ``step.times``.  The layer loop itself is
:func:`meshdsl.ir.repeat.run_layers`, shared with the dense op; here a carry is one local
tensor per held rank and a layer is one run of the sub-plan's executor, built once per outer
executor: its straight-line program with the feeds as arguments and the outputs as a tuple
(:class:`_Body`; ``Executor.run`` with ``--compile``), fed each stacked param's layer slice
(made once per layer while the stacked tensors stay the same objects: a pipeline stage runs
its layers every micro-batch and step with the same params; a param changed in place shows
through its slices, a new tensor gets new ones).  Before a layer runs, the collectives of the
next layer that read only its params (FSDP's gathers) are started (:mod:`.prefetch`).

A backward loop writes each layer's parameter gradients into preallocated stacked buffers as
the layer finishes: the matmul that makes a gradient writes into its layer slice itself
where it can (:mod:`.deferred`), otherwise the result is copied there (a gradient no matmul
makes, a layer norm's gain, is kept per layer and stacked once after the last layer, unless
it goes into a running sum).  A pipeline that sums micro-batches hands the loop its running
sums (``run.into``): the loop then adds each layer's gradient into them instead; a pipeline
stage that sends a gradient upstream may also have it put those matmuls off until the send
has gone (``run.defer``, :class:`~.deferred.Deferred`).  The gradients its step names
``streamed`` (:func:`meshdsl.lowering.bucket.stream_loop_grads`) are reduced by the
sub-plan's trailing collectives, one per layer (or one bucket): the loop runs the sub-plan
without them and starts them itself right after the layer, so they are in flight while the
layers below are differentiated; the stacked result is handed on as a
:class:`~.comm.Pending` that waits for every layer when a reader (the optimizer update)
first needs it.  A bucket allreduce of such gradients is not packed: its members' stacked
buffers are views into one ``[layers, bucket]`` buffer (:func:`_packed_rows`), the layer's
row is the packed bucket, and the reduction lands in the stacked buffers in place, as DDP's
gradients are views into its buckets.

A block carrying several tensors (the step's ``carries``, k) hands the loop a tuple of k
carries (each one local tensor per held rank): the body's inputs ``carry``, ``carry.1``, ...
and outputs ``out``, ``out.1``, ... (backward ``cotangent.<i>``, ``dcarry.<i>``), nothing
joined; the step's outputs hold each carried tensor's own, in order.

A forward loop stacks the block's per-layer outputs (the step's ``ys``) over the layer dim
as the loss reads them whole; a backward loop feeds each layer its slice of their stacked
gradients.

Tensors the block reads from outside (the step's ``closed`` inputs, after the others) are
fed to every layer as they are; a backward loop adds up the layers' gradients of each
(its outputs after the stacked gradients) in a buffer of its own, or into the pipeline's
running sum when ``run.into`` holds one.
"""
from __future__ import annotations

import operator
import time
from itertools import chain
from typing import NamedTuple

import torch

from ..ir.block import carry_name
from ..ir.repeat import LayerStack, run_layers
from ..lowering.plan import Plan
from ..comm.bucket import bucket_members, start_packed_each
from ..comm.communicator import Pending
from ..ops.registry import run_device, running_on
from .executor import Executor, PerRank, _Run, waiting_getter
from .prefetch import prefetchable, start
from .deferred import install
from .carry_out import CarrySlot
from .program import build, units_of
from .steps import rule_for, step_rule


@step_rule("repeat")
def _prepare_repeat(ctx, i, step):
    (plan,) = step.subplans
    a = step.args
    names, pos, saved, num_layers = a["names"], a["pos"], a["saved"], step.times
    ys = a.get("ys", ())
    closed = a.get("closed", ())
    nc = a.get("carries", 1)
    held = range(len(ctx.comm.ranks))
    if a["backward"]:
        body, tail = _split_tail(plan, a.get("streamed", ()))
        sub = Executor(body, ctx.comm, compile=ctx.compile)
        tail = [(s, rule_for(s.kind)(sub.ctx, -1, s)) for s in tail]
        grads = step.outs[nc:nc + len(names)]   # the stacked gradients; those of the closed-over tensors follow
        # each held rank's local shape (a split the axes do not divide differs by rank), and the dtype
        shapes = [([ctx.plan.values[v].local_shape(ctx.plan.mesh, r) for r in ctx.comm.ranks], ctx.plan.values[v].dtype)
                  for v in grads]
        sinks = [install(sub, body.outputs[f"d/{k}"]) for k in names]
        closed_sums = _ClosedSums([k for k in closed if f"d/{k}" in plan.outputs], step.outs[nc + len(names):])
        run_fn = _backward_fn(tail, shapes, sinks, grads, closed_sums, _shares_reduce_buffer(ctx.plan, step, grads))
    else:
        sub, run_fn = Executor(plan, ctx.comm, compile=ctx.compile), _forward
    sub.check_feeds = False   # the loop feeds its body the outer plan's own tensors
    carries, couts = [carry_name("carry", i) for i in range(nc)], [carry_name("out", i) for i in range(nc)]
    if a["backward"]:
        ins = (*carries, *[carry_name("cotangent", i) for i in range(nc)], *names, *[f"cotangent/{k}" for k in ys],
               *saved, *closed)
        outs = (*[carry_name("dcarry", i) for i in range(nc)], *[f"d/{k}" for k in names],
                *[f"d/{k}" for k in closed_sums.names])
    else:
        ins, outs = (*carries, *names, *closed), (*couts, *[f"y/{k}" for k in ys], *saved)
    runner = _Body.of(sub, ins, outs)
    # the loop's result, made in a pipeline's send slot where the pipeline asks (.carry_out)
    carry = CarrySlot(sub, sub.plan.outputs["dcarry" if a["backward"] else "out"])
    # A pipeline stage runs layers layer_offset.. of the whole stack: kernels (dropout) salt
    # by the global layer index, as the dense op does.
    first = ctx.layer_offset + 1

    layer_params = _LayerParams(names, pos, held)

    def call(env, get, run):
        ins = list(map(env.__getitem__, step.ins)) if type(env) is dict else None   # (a pipeline's: get)
        if ins is None or any(issubclass(t, Pending) for t in set(map(type, ins))):   # (a result in flight)
            ins = [get(v) for v in step.ins]
        layer_params.fixed = {k: PerRank(x) for k, x in zip(closed, ins[len(ins) - len(closed):])} if closed else {}
        if nc > 1:   # each group of carried tensors as one tuple: the loop hands them on together
            ins = _tupled(ins, nc, len(names), a["backward"])
        outs = run_fn(sub, ins[:len(ins) - len(closed)], names, pos, (saved, ys), num_layers, held, run.stats,
                      run.salt + first, run.into, run.defer, layer_params, runner, carry)
        for vid, x in zip(step.outs, outs):
            env[vid] = x
    call.carry_out = carry.install
    # what the loop hands on is never in flight, but for gradients it reduces layer by layer (_Layers)
    call.settled = not (a["backward"] and tail)
    return call


def _tupled(ins: list, nc: int, num_stacked: int, backward: bool) -> list:
    """A loop step's inputs with its ``nc`` carried tensors as one tuple (backward: their stacked
    layer inputs, and after the stacked params their gradients, each as one tuple)."""
    if not backward:
        return [tuple(ins[:nc]), *ins[nc:]]
    at = nc + num_stacked
    return [tuple(ins[:nc]), *ins[nc:at], tuple(ins[at:at + nc]), *ins[at + nc:]]


def _shares_reduce_buffer(plan: Plan, step, grads) -> bool:
    """Whether backward loop ``step`` of ``plan`` may put its gradient rows in the communicator's
    reduce buffer (:func:`_packed_rows`), whose results last only until the next such request:
    where no output of ``plan`` is one of its stacked gradients ``grads``, and no other loop
    asks before the update has read them: ``step`` is ``plan``'s only backward loop that
    reduces its gradients itself, runs no loop and is in no loop's body."""
    loops = [s for s in plan.steps if s.kind == "repeat" and s.args["backward"] and s.args.get("streamed")]
    return (len(loops) == 1 and loops[0] is step and "dcarry" not in plan.outputs
            and not set(grads) & set(plan.outputs.values())
            and not any(s.kind == "repeat" for s in step.subplans[0].steps))


class _LayerParams:
    """Layer ``l``'s slice of each stacked param, as the body's feeds, with the feeds every
    layer reads (``fixed``: the tensors the block reads from outside, set per run).

    The slices of one layer are made once and reused while the stacked tensors are the
    same objects: a pipeline stage runs its layers once per micro-batch, with the same
    params.  An update in place keeps them right (they are views); a new stacked tensor
    makes new ones.  The cache holds the stacked tensors, so their ids stay theirs.  A new
    tensor object over the same memory, in the same geometry, keeps them too (an interleaved
    chunk's layers of a stacked param: a view of it made afresh each step, read by one loop
    per micro-batch): the slices are views of those very bytes, and the memory cannot be
    another tensor's while the cache holds the old one.
    """

    def __init__(self, names, pos, held):
        self.names, self.pos, self.held, self.made = names, pos, held, {}
        self.fixed: dict = {}

    def __call__(self, stacked, l: int) -> dict:
        params = self._made(stacked, l)[1]
        return {**params, **self.fixed} if self.fixed else params

    def slices(self, stacked, l: int) -> tuple:
        """Layer ``l``'s slices as a :class:`_Body`'s arguments: one list per stacked param, in
        ``names`` order."""
        return self._made(stacked, l)[2]

    def _made(self, stacked, l: int) -> tuple:
        key = [p[j] for p in stacked for j in self.held]
        hit = self.made.get(l)
        if hit is not None:
            if all(map(operator.is_, hit[0], key)):
                return hit
            if all(map(_same_view, hit[0], key)):
                hit[0][:] = key   # (held from now on: the same memory, and a later call may pass these)
                return hit
        params = self._slice(stacked, l)
        hit = self.made[l] = (key, params, tuple(params.values()))
        return hit

    def _slice(self, stacked, l: int) -> dict:
        """Layer ``l``'s slice of each stacked param (views), per held rank."""
        return {k: PerRank([p[j].select(self.pos[k], l) for j in self.held]) for k, p in zip(self.names, stacked)}


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` read the same memory the same way (a slice of one is a slice of the other)."""
    if a is b or a is None or b is None:
        return a is b
    return (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride() and a.device == b.device)


class _Body:
    """A loop's body run as its executor's straight-line program (:mod:`.program`) with the feeds as
    arguments and the outputs as a tuple, in the orders ``ins`` and ``outs``: no feed or output dict
    per layer.  Eager executors only (``--compile`` runs the body through ``Executor.run``), and only
    where ``ins`` holds every input the body reads and it reads no param (:meth:`of` says None)."""

    def __init__(self, sub: Executor, ins: tuple, outs: tuple):
        self.sub, self.ins, self.outs = sub, ins, outs
        self.programs = [None, None]   # untimed and timed, built at the first run (a loop may
        # have replaced some of the body's calls by then: .deferred)

    @classmethod
    def of(cls, sub: Executor, ins: tuple, outs: tuple) -> "_Body | None":
        plan = sub.plan
        if (sub.compiling is not None or not set(plan.inputs) <= set(ins) or not set(outs) <= set(plan.outputs)
                or any(s.kind == "param" for s in plan.steps)):
            return None
        return cls(sub, ins, outs)

    def __call__(self, salt: int, stats: dict | None, prefetched: dict | None, *args) -> tuple:
        """Run one layer: ``args`` per ``ins`` (one list of held ranks' tensors each); returns the
        ``outs``, one list each.  ``prefetched`` as for ``Executor.run``."""
        program = self.programs[stats is not None]
        if program is None:
            program = self.programs[stats is not None] = build(self.sub, units_of(self.sub), stats is not None,
                                                               self.ins, self.outs)
        env = dict(prefetched) if prefetched else {}
        get = waiting_getter(env, stats)
        run = _Run(None, None, salt, stats)
        device = self.sub.device
        if run_device() is device:   # inside its plan's run, as a loop's body is
            return program(env, get, run, *args)
        with running_on(device):
            return program(env, get, run, *args)


class _Ahead:
    """One loop's prefetch: the collectives started for the layer that runs next."""

    def __init__(self, sub, names, num_layers, stats):
        self.sub, self.names, self.num_layers, self.stats = sub, frozenset(names), num_layers, stats
        self.on = bool(prefetchable(sub))
        self.next: tuple[int, dict] | None = None

    def __call__(self, l: int, nxt: int, params: dict, params_of) -> dict | None:
        """Handles for layer ``l`` (started now if no earlier call did); starts layer ``nxt``'s."""
        if not self.on:
            return None
        if self.next is not None and self.next[0] == l:
            now = self.next[1]
        else:
            now = start(self.sub, params, self.names, self.stats)
        self.next = (nxt, start(self.sub, params_of(nxt), self.names, self.stats)) \
            if 0 <= nxt < self.num_layers else None
        return now


def _forward(sub, ins, names, pos, kept_names, num_layers, held, stats, first, into, defer, layer_params, runner,
             carry):
    x, *stacked = ins
    saved, ys = kept_names
    ahead = _Ahead(sub, names, num_layers, stats)

    def params_of(l):
        return layer_params(stacked, l)

    nc = len(x) if type(x) is tuple else 1   # (several carried tensors: a tuple of per-rank lists)

    def layer(l, x):
        pre = ahead(l, l + 1, params_of(l), params_of) if ahead.on else None
        if runner is not None:
            if nc > 1:
                r = runner(first + l, stats, pre, *x, *layer_params.slices(stacked, l), *layer_params.fixed.values())
                return tuple(r[:nc]), (*x, *r[nc:])
            r = runner(first + l, stats, pre, x, *layer_params.slices(stacked, l), *layer_params.fixed.values())
            return r[0], (x, *r[1:])
        if nc > 1:
            r = sub.run({**{carry_name("carry", i): PerRank(c) for i, c in enumerate(x)}, **params_of(l)}, {},
                        salt=first + l, stats=stats, prefetched=pre)
            return (tuple(r[carry_name("out", i)] for i in range(nc)),
                    (*x, *[r[f"y/{k}"] for k in ys], *[r[k] for k in saved]))
        r = sub.run({"carry": PerRank(x), **params_of(l)}, {}, salt=first + l, stats=stats, prefetched=pre)
        return r["out"], (x, *[r[f"y/{k}"] for k in ys], *[r[k] for k in saved])

    x, kept = run_layers(num_layers, carry.layer_fn(layer, num_layers - 1), x)
    # Per held rank: the layer inputs, the per-layer outputs stacked over the layer dim (the
    # loss reads them whole), the saved activations as LayerStacks (read back layer by layer).
    n_ys = len(ys)
    cols = list(zip(*kept)) or [()] * (nc + n_ys + len(saved))   # per kept value, its per-rank lists by layer
    inputs, ys_cols, saved_cols = cols[:nc], cols[nc:nc + n_ys], cols[nc + n_ys:]
    xs = list(x) if nc > 1 else [x]
    if len(held) == 1:   # (every process's case: each layer's one-tensor lists chained, no loop per rank)
        return [*xs, *[[LayerStack(chain.from_iterable(col))] for col in inputs],
                *[[torch.stack(list(chain.from_iterable(col)), 0)] for col in ys_cols],
                *[[LayerStack(chain.from_iterable(col))] for col in saved_cols]]
    return [*xs, *[[LayerStack([c[j] for c in col]) for j in held] for col in inputs],
            *[[torch.stack([c[j] for c in col], 0) for j in held] for col in ys_cols],
            *[[LayerStack([c[j] for c in col]) for j in held] for col in saved_cols]]


def _split_tail(plan: Plan, streamed) -> tuple[Plan, list]:
    """``plan`` without the collectives that reduce the ``streamed`` gradients, and those steps.

    The trimmed plan outputs each such gradient unreduced (the collective's input).
    """
    want = {plan.outputs[f"d/{n}"] for n in streamed}
    tail = [i for i, s in enumerate(plan.steps) if s.is_collective and want & set(s.outs)]
    if not tail:
        return plan, []
    src = {o: v for i in tail for v, o in zip(plan.steps[i].ins, plan.steps[i].outs)}
    outputs = {k: src.get(v, v) for k, v in plan.outputs.items()}
    assert set(src) <= set(plan.outputs.values()), "a streamed reduction's result is read inside the block"
    steps = [s for i, s in enumerate(plan.steps) if i not in set(tail)]
    body = Plan(plan.mesh, plan.layout, steps, plan.values, outputs, plan.params, plan.inputs, plan.notes,
                plan.holders)
    return body, [plan.steps[i] for i in tail]


class _Layers(Pending):
    """Stacked gradients reduced layer by layer: waits each layer's collective, fills the buffer."""

    __slots__ = ("pending", "bufs", "pos")

    def __init__(self, pending: list, bufs: list, pos: int):
        self.pending, self.bufs, self.pos = pending, bufs, pos

    def wait(self):
        for l in reversed(range(len(self.pending))):   # in the order the layers started them
            x = self.pending[l]
            for buf, g in zip(self.bufs, x.wait() if isinstance(x, Pending) else x):
                dst = buf.select(self.pos, l)
                if g.data_ptr() != dst.data_ptr() or g.stride() != dst.stride():  # not reduced in place
                    dst.copy_(g)
        self.pending = None
        return self.bufs


class _ClosedSums:
    """A backward loop's sums over the layers of the gradients of the tensors the block reads
    from outside: sub-plan outputs ``d/<name>`` for ``names``, step outputs ``outs``."""

    def __init__(self, names, outs):
        self.names, self.outs = names, outs

    def start(self, into: dict, held) -> list:
        """One sum per gradient: the pipeline's running sums (``into``) where it holds them
        (added into), else None per held rank (the first layer's gradient is copied)."""
        return [list(into[v]) if v in into else [None for _ in held] for v in self.outs]

    def add(self, sums: list, grads) -> None:
        """Add one layer's gradients (per name of ``names``, each held rank's) into ``sums``."""
        for acc, each in zip(sums, grads):
            for j, g in enumerate(each):
                if acc[j] is None:
                    acc[j] = g.clone()  # the sub-plan may hand on a tensor it still uses (the cotangent)
                else:
                    acc[j].add_(g)


def _backward_fn(tail: list, shapes: list, sinks: list, outs: tuple, closed: _ClosedSums, shared: bool):
    """The backward loop for a sub-plan whose ``tail`` collectives the loop starts itself.

    ``shapes``: the (local shape per held rank, dtype) of each stacked gradient the step outputs (value
    ids ``outs``); ``sinks``: per gradient, its producer's :class:`~.sink.Sink` or None.
    A call's ``into`` maps some of ``outs`` to running sums (one tensor per held rank):
    those gradients are added into them, which the call then returns.  With ``defer`` (a
    :class:`~.deferred.Deferred`), the matmuls of the gradients it names are put off into it:
    the returned buffers hold those gradients once it has run.  ``closed``: the gradients of
    tensors read from outside the block, summed over the layers after the stacked ones.
    ``shared``: a bucket's gradient rows may go in the communicator's reduce buffer (:func:`_packed_rows`).
    """
    static: list = []   # what depends on the body's plan only: worked out at the first call
    layouts: dict = {}  # (the gradients summed into ``into``, those deferred) -> their _GradLayout

    def backward(sub, ins, names, pos, kept_names, num_layers, held, stats, first, into, defer, layer_params, runner,
                 carry):
        if not static:
            outv = [sub.plan.outputs[f"d/{k}"] for k in names]
            late = {n for n in range(len(names)) if _reduced_out(tail, outv[n]) is not None}
            # per gradient, whether its buffers may be allocated like the carry's gradient (its dtype
            # and device): ``new_empty`` has no dtype or device to parse, every call
            dy = ins[1 + len(names)]
            dy = dy[0] if type(dy) is tuple else dy   # (several carried tensors: the first's, for its device)
            like = [all(dtype is x.dtype for x in dy) for _, dtype in shapes]
            static.extend((outv, late, _packed_members(tail, outv), like))
        outv, late, packed, like = static
        into = into or {}
        key = (frozenset(v for v in outs if v in into) if into else frozenset(),
               None if defer is None else defer.values)
        layout = layouts.get(key)
        if layout is None:
            layout = layouts[key] = _GradLayout.of(outs, sinks, late, packed, num_layers, *key)
        loop = _BackwardLoop((tail, shapes, outs, closed, outv, late, layout, like, shared), sub, ins, names, pos,
                             kept_names, num_layers, held, stats, first, into, defer, layer_params, runner)
        dy, _ = run_layers(num_layers, carry.layer_fn(loop.layer, 0), loop.dy, backward=True)
        return loop.results(dy)
    return backward


class _GradLayout(NamedTuple):
    """Where a backward loop puts each stacked gradient ``n``, for one pattern of running sums
    and deferred matmuls (worked out once per pattern, not per step).

    ``adds``: added into the pipeline's running sum; ``later``: its matmuls go to the
    :class:`~.deferred.Deferred`; ``stack``: each layer's kept and stacked after the last (no
    matmul writes it into its layer slice, no running sum); ``views``: written into its
    buffer's layer slices; ``fresh``: the gradients whose buffers are allocated per call;
    ``sinking``: ``(sink, n)`` of the matmuls that write into the layer slice themselves."""

    adds: tuple
    later: tuple
    stack: tuple
    views: tuple
    fresh: tuple
    sinking: tuple

    @classmethod
    def of(cls, outs, sinks, late, packed, num_layers, summed, deferred) -> "_GradLayout":
        num = range(len(outs))
        adds = tuple(n not in late and outs[n] in summed for n in num)
        later = tuple(deferred is not None and outs[n] in deferred and n not in late for n in num)
        direct = [n not in late or n in packed for n in num]   # the layer's grad goes to bufs
        stack = tuple(num_layers > 0 and direct[n] and sinks[n] is None and not adds[n] and n not in packed
                      for n in num)
        return cls(adds, later, stack, tuple(direct[n] and not stack[n] for n in num),
                   tuple(n for n in num if n not in packed and not adds[n] and not stack[n]),
                   tuple((sink, n) for n, sink in enumerate(sinks) if sink is not None and direct[n]))


def _packed_members(tail, outv) -> frozenset:
    """The gradients (positions in ``outv``) that :func:`_packed_rows` lays out as buckets."""
    where = {v: n for n, v in enumerate(outv)}
    return frozenset(where[v] for s, _ in tail if s.kind == "bucket_allreduce" and all(v in where for v in s.ins)
                     for v in s.ins)


class _BackwardLoop:
    """One call of a backward loop: the buffers its layers write into, and the layer function."""

    def __init__(self, fixed, sub, ins, names, pos, kept_names, num_layers, held, stats, first, into, defer,
                 layer_params, runner):
        tail, shapes, outs, closed, self.outv, late, layout, like, shared = fixed
        self.tail, self.closed, self.late = tail, closed, late
        self.sub, self.names, self.pos, self.held, self.stats, self.first = sub, names, pos, held, stats, first
        self.layer_params, self.runner = layer_params, runner
        carries, *rest = ins
        self.saved, self.ys = kept_names
        n_names = len(names)
        self.carries, self.stacked, self.dy = carries, rest[:n_names], rest[n_names]
        # several carried tensors: ``carries`` and ``dy`` are tuples, one per carried tensor, and the
        # buffers follow the first's per-rank gradients
        self.nc = len(self.dy) if type(self.dy) is tuple else 1
        dy_ranks = self.dy[0] if self.nc > 1 else self.dy
        self.dys = rest[n_names + 1:n_names + 1 + len(self.ys)]
        self.saved_in = rest[n_names + 1 + len(self.ys):]
        self.per_layer = self.dys + self.saved_in   # what each layer reads its slice of, after its params
        self.ahead = _Ahead(sub, names, num_layers, stats)
        self.pending = {n: [None] * num_layers for n in late}
        self.closed_sums = closed.start(into, held)
        self.adds = layout.adds
        work = defer.work if defer is not None else None
        self.later = [work if f else None for f in layout.later]
        self.packed, self.reduced, self.rows = _packed_rows(sub, tail, self.outv, shapes, [pos[k] for k in names],
                                                            num_layers, dy_ranks, shared) if tail else ({}, {}, {})
        self.kept = {n: [None] * num_layers for n, f in enumerate(layout.stack) if f}
        bufs: list = [None] * n_names
        for n in layout.fresh:
            each, dtype = shapes[n]
            bufs[n] = [x.new_empty(shape) for shape, x in zip(each, dy_ranks)] if like[n] else \
                [torch.empty(shape, dtype=dtype, device=x.device) for shape, x in zip(each, dy_ranks)]
        for n in self.packed:
            bufs[n] = self.packed[n]
        for n, f in enumerate(layout.adds):
            if f and n not in self.packed:
                bufs[n] = into[outs[n]]
        self.bufs = bufs
        # each stacked gradient's layer slices, per held rank: one unbind per buffer and step
        self.views = [[buf.unbind(pos[k]) for buf in bufs[n]] if f else None
                      for n, (k, f) in enumerate(zip(names, layout.views))]
        self.sinking = layout.sinking

    def _params_of(self, l):
        return self.layer_params(self.stacked, l)

    def _body(self, l, dy, dsts):
        """Layer ``l``'s backward: (carry gradient, its stacked params' gradients, the closed ones')."""
        pre = self.ahead(l, l - 1, self._params_of(l), self._params_of) if self.ahead.on else None
        for sink, n in self.sinking:
            sink.dst, sink.accumulate, sink.later = dsts[n], self.adds[n], self.later[n]
        try:
            if self.nc > 1:
                return self._body_tupled(l, dy, pre)
            if self.runner is not None:
                if len(self.held) == 1:   # (every process's case: no loop over held ranks per value)
                    carry, per_layer = [self.carries[0][l]], [[x[0][l]] for x in self.per_layer]
                else:
                    carry, per_layer = [x[l] for x in self.carries], [[x[l] for x in d] for d in self.per_layer]
                r = self.runner(self.first + l, self.stats, pre, carry, dy, *self.layer_params.slices(self.stacked, l),
                                *per_layer, *self.layer_params.fixed.values())
                n = len(self.names)
                return r[0], r[1:1 + n], r[1 + n:]
            held = self.held
            feeds = {"carry": PerRank([self.carries[j][l] for j in held]), "cotangent": PerRank(dy),
                     **self._params_of(l),
                     **{f"cotangent/{k}": PerRank([d[j][l] for j in held]) for k, d in zip(self.ys, self.dys)},
                     **{k: PerRank([s[j][l] for j in held]) for k, s in zip(self.saved, self.saved_in)}}
            r = self.sub.run(feeds, {}, salt=self.first + l, stats=self.stats, prefetched=pre)
            return r["dcarry"], [r[f"d/{k}"] for k in self.names], [r[f"d/{k}"] for k in self.closed.names]
        finally:
            for sink, _ in self.sinking:
                sink.dst = sink.later = None

    def _body_tupled(self, l, dy: tuple, pre):
        """:meth:`_body` of a block carrying several tensors: ``dy`` and the result's carry
        gradient are tuples, one per carried tensor."""
        held, nc, n = self.held, self.nc, len(self.names)
        carry = [[x[j][l] for j in held] for x in self.carries]
        if self.runner is not None:
            per_layer = [[x[j][l] for j in held] for x in self.per_layer]
            r = self.runner(self.first + l, self.stats, pre, *carry, *dy, *self.layer_params.slices(self.stacked, l),
                            *per_layer, *self.layer_params.fixed.values())
            return tuple(r[:nc]), r[nc:nc + n], r[nc + n:]
        feeds = {**{carry_name("carry", i): PerRank(c) for i, c in enumerate(carry)},
                 **{carry_name("cotangent", i): PerRank(d) for i, d in enumerate(dy)}, **self._params_of(l),
                 **{f"cotangent/{k}": PerRank([d[j][l] for j in held]) for k, d in zip(self.ys, self.dys)},
                 **{k: PerRank([s[j][l] for j in held]) for k, s in zip(self.saved, self.saved_in)}}
        r = self.sub.run(feeds, {}, salt=self.first + l, stats=self.stats, prefetched=pre)
        return (tuple(r[carry_name("dcarry", i)] for i in range(nc)), [r[f"d/{k}"] for k in self.names],
                [r[f"d/{k}"] for k in self.closed.names])

    def layer(self, l, dy):
        if len(self.held) == 1:
            dsts = [None if v is None else [v[0][l]] for v in self.views]
        else:
            dsts = [None if v is None else [x[l] for x in v] for v in self.views]
        dcarry, grads, closed_grads = self._body(l, dy, dsts)
        for n, dst_n in enumerate(dsts):
            if dst_n is not None:
                for dst, g in zip(dst_n, grads[n]):
                    if g is not dst:  # its matmul could not write there itself
                        dst.add_(g) if self.adds[n] else dst.copy_(g)
        for n, each in self.kept.items():
            each[l] = grads[n]
        if closed_grads:
            self.closed.add(self.closed_sums, closed_grads)
        if self.tail:
            self._start_tail(l, grads)
        return dcarry, ()

    def _start_tail(self, l, grads):
        """Start the trailing collectives that reduce layer ``l``'s gradients."""
        env = dict(zip(self.outv, grads))
        for t, (s, call) in enumerate(self.tail):
            t0 = time.perf_counter()
            if t in self.rows:
                rows, how = self.rows[t]
                env.update(zip(s.outs, start_packed_each(self.sub.comm, s, [f[l] for f in rows], how)))
            else:
                call(env, env.__getitem__, None)
            if self.stats is not None:
                self.stats[s.kind] = self.stats.get(s.kind, 0.0) + time.perf_counter() - t0
        for n in self.late:
            self.pending[n][l] = env[_reduced_out(self.tail, self.outv[n])]

    def results(self, dy):
        """The loop's outputs: the carry gradient, the stacked gradients, the closed-over ones."""
        pos, names, bufs = self.pos, self.names, self.bufs
        for n, each in self.kept.items():
            bufs[n] = [torch.stack([g[j] for g in each], pos[names[n]]) for j in self.held]
        return [*(dy if self.nc > 1 else [dy])] + [_Layers(self.pending[n], self.reduced.get(n, bufs[n]), pos[k]) if n in self.late else bufs[n]
                       for n, k in enumerate(names)] + self.closed_sums


def _packed_rows(sub, tail, outv, shapes, pos, num_layers, xs, shared: bool):
    """The stacked gradients that ``tail``'s bucket allreduces reduce, laid out as their buckets.

    For each bucket allreduce whose members are all loop gradients (``outv``): one
    ``[num_layers, bucket elements]`` buffer per held rank (like ``xs``), row ``l`` being
    layer ``l``'s bucket, packed in member order; each member's stacked gradient (``shapes``:
    local shapes and dtype, layer dim at ``pos``) is a view into it.  With ``shared`` and one
    held rank, the buffer is the communicator's reduce buffer where it has one (a process's
    region of its group's shared segment), which the layers' reductions read with nothing
    copied in and reduce into its result rows (the segment's result area): the reduced
    stacked gradients are views into those.

    Returns:
      ``({gradient index: [view per held rank]}, {gradient index: [reduced view per held rank]},
      {tail index: (buffers, [(numels, shapes) per held rank])})``; the reduced views are the
      first's where the reduction is in place.
    """
    where = {v: n for n, v in enumerate(outv)}
    packed, reduced, rows = {}, {}, {}
    for t, (s, _) in enumerate(tail):
        if s.kind != "bucket_allreduce" or not all(v in where for v in s.ins):
            continue
        members = [where[v] for v in s.ins]
        layouts = [bucket_members(sub.plan, s, r) for r in sub.comm.ranks]   # (numels, shapes) per held rank
        dtype = shapes[members[0]][1]
        flats, outs = zip(*[_rows_buffer(sub.comm, s.axes, num_layers, sum(numels), dtype, x.device,
                                         shared and len(xs) == 1) for (numels, _), x in zip(layouts, xs)])
        for i, n in enumerate(members):
            packed[n] = _member_views(flats, layouts, i, num_layers, pos[n])
            reduced[n] = packed[n] if outs[0] is flats[0] else _member_views(outs, layouts, i, num_layers, pos[n])
        rows[t] = (list(flats), layouts)
    return packed, reduced, rows


def _member_views(flats, layouts, i: int, num_layers: int, pos: int) -> list:
    """Bucket member ``i``'s stacked gradient in each held rank's ``[num_layers, bucket]`` buffer."""
    return [f[:, sum(numels[:i]):sum(numels[:i + 1])].view(num_layers, *layer_shapes[i]).movedim(0, pos)
            for f, (numels, layer_shapes) in zip(flats, layouts)]


def _rows_buffer(comm, axes, num_layers: int, numel: int, dtype, device, shared: bool):
    """``(buffer, result)``, ``[num_layers, numel]`` each, whose rows ``axes``' bucket allreduces
    reduce, one per layer: with ``shared``, ``comm``'s reduce buffer and its result rows where it
    has them, else one fresh buffer as both (reduced in place)."""
    got = comm.reduce_buffer(axes, num_layers * numel, dtype, num_layers) if shared else None
    if got is None:
        buf = torch.empty(num_layers, numel, dtype=dtype, device=device)
        return buf, buf
    return tuple(x.view(num_layers, numel) for x in got)


def _reduced_out(tail: list, v: int) -> int | None:
    """The value a ``tail`` collective makes from ``v`` (None if none reduces it)."""
    for s, _ in tail:
        if v in s.ins:
            return s.outs[s.ins.index(v)]
    return None
