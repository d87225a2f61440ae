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
"""
from __future__ import annotations

import time

from ..comm.communicator import Pending
from .steps import starter


def prefetchable(ex) -> tuple[tuple[int, str], ...]:
    """``(step index, param name, starter)`` of each asynchronous collective of ``ex``'s plan that
    reads one fed input directly (computed once per executor)."""
    ctx = ex.ctx
    found = ctx.cache.get(__name__)
    if found is None:
        steps = ctx.plan.steps
        fed = {s.outs[0]: s.args["name"] for s in steps if s.kind == "input"}
        found = tuple((i, fed[s.ins[0]], starter(ctx, s)) for i, s in enumerate(steps)
                      if s.kind in ctx.comm.async_kinds and len(s.ins) == 1 and s.ins[0] in fed)
        ctx.cache[__name__] = found
    return found


def start(ex, feeds: dict, names, stats: dict | None = None) -> dict[int, Pending]:
    """Start the collectives of :func:`prefetchable` whose input is one of ``names`` in
    ``feeds``; returns value id -> handle, for ``Executor.run(..., prefetched=...)``."""
    out: dict[int, Pending] = {}
    for i, name, go in prefetchable(ex):
        if name not in names:
            continue
        s = ex.plan.steps[i]
        t0 = time.perf_counter()
        out[s.outs[0]] = go(ex.feed(name, s.ins[0], feeds[name]))
        if stats is not None:
            stats[s.kind] = stats.get(s.kind, 0.0) + time.perf_counter() - t0
    return out
