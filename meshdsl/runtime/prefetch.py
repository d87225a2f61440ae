"""Prefetching a repeat's param collectives: layer ``l + 1``'s gathers start before layer ``l`` runs.

Under FSDP (``params.d_model:data``) each layer's sub-plan all-gathers its param
slices before using them.  Started inside the layer's own run, the first gather
is exposed every layer.  The repeat loop (:mod:`.layers`) instead starts, before it
runs a layer, the collectives of the next layer (forward: ``l + 1``; backward:
``l - 1``) that read nothing but that layer's params, and hands them to the
next run, which skips their steps: FSDP's prefetch, one layer ahead, holding at
most two layers' gathered params.  Only collectives the communicator runs
asynchronously (``Communicator.async_kinds``) are prefetched; every rank starts
them at the same point of the loop, so all ranks issue collectives in one order.
A layer's gathers packed into one (:mod:`meshdsl.lowering.coalesce`) start as one.
"""
from __future__ import annotations

import time
from typing import Callable

from ..comm.communicator import Pending
from .steps import packed_starter, starter


def prefetchable(ex) -> tuple[tuple[int, tuple[str, ...], Callable], ...]:
    """``(step index, param names, starter)`` of each asynchronous collective of ``ex``'s plan that
    reads fed inputs directly, one (a gather) or several (a packed gather, :mod:`meshdsl.lowering.coalesce`):
    ``starter(members) -> [Pending]``, a handle per member (computed once per executor)."""
    ctx = ex.ctx
    found = ctx.cache.get(__name__)
    if found is None:
        steps = ctx.plan.steps
        fed = {s.outs[0]: s.args["name"] for s in steps if s.kind == "input"}
        found = tuple((i, tuple(fed[v] for v in s.ins), _starter(ctx, s)) for i, s in enumerate(steps)
                      if s.kind in ctx.comm.async_kinds and s.ins and all(v in fed for v in s.ins))
        ctx.cache[__name__] = found
    return found


def _starter(ctx, s) -> Callable:
    if len(s.ins) > 1:   # (several members: packed, as the executor's bucket rule starts them)
        return packed_starter(ctx, s)
    go = starter(ctx, s)
    return lambda members: [go(members[0])]


def start(ex, feeds: dict, names, stats: dict | None = None) -> dict[int, Pending]:
    """Start the collectives of :func:`prefetchable` whose inputs are all in ``names`` in
    ``feeds``; returns value id -> handle, for ``Executor.run(..., prefetched=...)``."""
    out: dict[int, Pending] = {}
    for i, fed, go in prefetchable(ex):
        if not all(name in names for name in fed):
            continue
        s = ex.plan.steps[i]
        t0 = time.perf_counter()
        out.update(zip(s.outs, go([ex.feed(name, v, feeds[name]) for name, v in zip(fed, s.ins)])))
        if stats is not None:
            stats[s.kind] = stats.get(s.kind, 0.0) + time.perf_counter() - t0
    return out
