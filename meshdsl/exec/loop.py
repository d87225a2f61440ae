"""Running a ``repeat`` step: its sub-plan once per layer, forward or backward.

The step is data (:mod:`meshdsl.lowering.repeat` builds it): the block's
sub-plan in ``step.subplans``, the layer count in ``step.times``.  The layer
loop itself is :func:`meshdsl.ir.repeat.run_layers`, shared with the dense op;
here a carry is one local tensor per held rank and a layer is one run of the
sub-plan's executor, built once per outer executor.  Before a layer runs, the
collectives of the next layer that read only its params (FSDP's gathers) are
started (:mod:`.prefetch`).
"""
from __future__ import annotations

import torch

from ..ir.repeat import LayerStack, run_layers
from .executor import Executor, PerRank
from .prefetch import prefetchable, start
from .steps import step_rule


@step_rule("repeat")
def _prepare_repeat(ex, i, step):
    (plan,) = step.subplans
    sub = Executor(plan, ex.comm)
    a = step.args
    names, pos, saved, num_layers = a["names"], a["pos"], a["saved"], step.times
    held = range(len(ex.comm.ranks))
    run_fn = _backward if a["backward"] else _forward
    # A pipeline stage runs layers layer_offset.. of the whole stack: kernels (dropout) salt
    # by the global layer index, as the dense op does.
    first = getattr(ex, "layer_offset", 0) + 1

    def call(env, get, run):
        outs = run_fn(sub, [get(v) for v in step.ins], names, pos, saved, num_layers, held, run.stats, first)
        for vid, x in zip(step.outs, outs):
            env[vid] = x
    return call


def _layer_params(stacked, names, pos, held, l):
    return {k: PerRank([p[j].select(pos[k], l) for j in held]) for k, p in zip(names, stacked)}


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


def _forward(sub, ins, names, pos, saved, num_layers, held, stats, first):
    x, *stacked = ins
    ahead = _Ahead(sub, names, num_layers, stats)

    def params_of(l):
        return _layer_params(stacked, names, pos, held, l)

    def layer(l, x):
        params = params_of(l)
        pre = ahead(l, l + 1, params, params_of)
        r = sub.run({"carry": PerRank(x), **params}, {}, salt=first + l, stats=stats, prefetched=pre)
        return r["out"], (x, *[r[k] for k in saved])

    x, kept = run_layers(num_layers, layer, x)
    # Per held rank, each kept value (layer inputs, then saved activations) as a LayerStack.
    return [x, *[[LayerStack(k[n][j] for k in kept) for j in held] for n in range(1 + len(saved))]]


def _backward(sub, ins, names, pos, saved, num_layers, held, stats, first):
    carries, *rest = ins
    stacked, dy, saved_in = rest[:len(names)], rest[len(names)], rest[len(names) + 1:]
    ahead = _Ahead(sub, names, num_layers, stats)

    def params_of(l):
        return _layer_params(stacked, names, pos, held, l)

    def layer(l, dy):
        params = params_of(l)
        pre = ahead(l, l - 1, params, params_of)
        feeds = {"carry": PerRank([carries[j][l] for j in held]), "cotangent": PerRank(dy), **params,
                 **{k: PerRank([s[j][l] for j in held]) for k, s in zip(saved, saved_in)}}
        r = sub.run(feeds, {}, salt=first + l, stats=stats, prefetched=pre)
        return r["dcarry"], tuple(r[f"d/{k}"] for k in names)

    dy, kept = run_layers(num_layers, layer, dy, backward=True)
    return [dy] + [[torch.stack([k[n][j] for k in kept], pos[name]) for j in held] for n, name in enumerate(names)]
