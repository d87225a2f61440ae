"""Local steps over dims cut at given lengths: each rank's slice as its values store it.

A local step's kernel learns its rank's slice of each dim it splits (``LocalCtx`` offsets and
sizes: a broadcast's local shape, an iota's first index) from the step's ``compute`` split and
the dims' global ``sizes``, cut as :func:`~meshdsl.layout.sharding.chunk` cuts.  A pass that
stores a dim at given part lengths after the steps were lowered (unequal pipeline stages,
:mod:`.stage_layers`, :mod:`.interleave`: ``Sharding.parts``) changes what each rank holds, so
the steps reading or making such values carry the lengths too (the local step's ``parts`` arg,
``{dim: lengths by the index along its one axis}``).  With it, what a loss makes of a pipelined
repeat's per-layer outputs (a broadcast of a sum's gradient over the layers, say) runs on each
stage's own, unequal number of layers.  A block-cyclic dim (virtual stages) has one length per
rank, the sum of its blocks, but no single first index: its kernels read only the length.
"""
from __future__ import annotations

import dataclasses

from .plan import Step, step_args


def with_given_parts(lists: dict, values: dict) -> dict:
    """The segment lists ``lists`` (segment -> ``(step, stages)`` pairs) with every local step
    over a dim that one of its values stores at given lengths carrying those lengths."""
    return {seg: [(_with_parts(s, values), st) for s, st in pairs] for seg, pairs in lists.items()}


def _with_parts(s: Step, values: dict) -> Step:
    if s.kind != "local":
        return s
    compute, parts = s.args["compute"], {}
    for v in (*s.ins, *s.outs):
        sh = values[v].sharding
        for dim, lengths in sh.parts:
            if compute.get(dim) == sh.axes_of(dim):
                parts[dim] = lengths
    if not parts or s.args.get("parts") == parts:
        return s
    return dataclasses.replace(s, args=step_args("local", {**s.args, "parts": parts}))
