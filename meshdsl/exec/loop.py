"""Running a ``repeat`` step: its sub-plan once per layer, forward or backward.

The step is data (:mod:`meshdsl.lowering.repeat` builds it): the block's
sub-plan in ``step.subplans``, the layer count in ``step.times``.  The layer
loop itself is :func:`meshdsl.ir.repeat.run_layers`, shared with the dense op;
here a carry is one local tensor per held rank and a layer is one run of the
sub-plan's executor, built once per outer executor.
"""
from __future__ import annotations

import torch

from ..ir.repeat import LayerStack, run_layers
from .executor import Executor, PerRank
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


def _forward(sub, ins, names, pos, saved, num_layers, held, stats, first):
    x, *stacked = ins

    def layer(l, x):
        r = sub.run({"carry": PerRank(x), **_layer_params(stacked, names, pos, held, l)}, {},
                    salt=first + l, stats=stats)
        return r["out"], (x, *[r[k] for k in saved])

    x, kept = run_layers(num_layers, layer, x)
    # Per held rank, each kept value (layer inputs, then saved activations) as a LayerStack.
    return [x, *[[LayerStack(k[n][j] for k in kept) for j in held] for n in range(1 + len(saved))]]


def _backward(sub, ins, names, pos, saved, num_layers, held, stats, first):
    carries, *rest = ins
    stacked, dy, saved_in = rest[:len(names)], rest[len(names)], rest[len(names) + 1:]

    def layer(l, dy):
        feeds = {"carry": PerRank([carries[j][l] for j in held]), "cotangent": PerRank(dy),
                 **_layer_params(stacked, names, pos, held, l),
                 **{k: PerRank([s[j][l] for j in held]) for k, s in zip(saved, saved_in)}}
        r = sub.run(feeds, {}, salt=first + l, stats=stats)
        return r["dcarry"], tuple(r[f"d/{k}"] for k in names)

    dy, kept = run_layers(num_layers, layer, dy, backward=True)
    return [dy] + [[torch.stack([k[n][j] for k in kept], pos[name]) for j in held] for n, name in enumerate(names)]
