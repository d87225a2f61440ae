"""Peephole fusion of adjacent local kernels in a lowered plan.

A rule fuses a local producer into its only reader when both run on the same
local slices: the pair becomes one step at the reader's place, so the
producer's result is never materialised.  Rules are a table keyed by
(producer op, reader op).  Identity kernels (``stop_gradient``, which names
a gradient) are dropped first, so they do not stand between a pair.

* ``einsum -> sgd_update``: a weight gradient that no collective touches (it
  is local: Megatron's split weights, or data parallelism that gathered the
  activations instead) feeds one ``addmm_``/``baddbmm_`` that updates the
  param: ``p - lr * (a @ b)`` without a gradient buffer or a second pass.
"""
from __future__ import annotations

from dataclasses import replace

from ..ops.matmul_form import ADD_MATMUL
from .plan import Step


def _einsum_sgd(prod: Step, use: Step) -> Step | None:
    form = prod.args["attrs"].get("form")
    if form is None or not form.in_order or use.ins[1] != prod.outs[0] or use.ins[0] in prod.ins:
        return None
    attrs = {"form": form, "alpha": -use.args["attrs"]["lr"]}
    return Step("local", use.node, "einsum+sgd_update", use.label, use.phase, (use.ins[0], *prod.ins), use.outs,
                args={**use.args, "fn": ADD_MATMUL.compute, "inplace": ADD_MATMUL.compute_inplace,
                      "attrs": attrs},
                flops=prod.flops + use.flops, note=f"fused with the gradient einsum '{prod.label}'")


RULES = {("einsum", "sgd_update"): _einsum_sgd}
#: local kernels that return their input unchanged (the gradient's name tag, for one)
IDENTITY = frozenset({"stop_gradient"})


def forward_identities(steps: list[Step], values: dict, outputs: dict[str, int]) -> list[Step]:
    """``steps`` without identity kernels: their readers read the input instead."""
    kept = set(outputs.values())
    alias: dict[int, int] = {}
    out = []
    for s in steps:
        if any(v in alias for v in s.ins):  # a new step: the lowerer's own steps stay as they are
            s = replace(s, ins=tuple(alias.get(v, v) for v in s.ins))
        if (s.kind == "local" and s.op in IDENTITY and len(s.ins) == 1 and s.outs[0] not in kept
                and values[s.ins[0]].sharding == values[s.outs[0]].sharding):
            alias[s.outs[0]] = s.ins[0]
            continue
        out.append(s)
    return out


def fuse(steps: list[Step], values: dict, outputs: dict[str, int]) -> list[Step]:
    """``steps`` without identity kernels and with every fusable (producer, only
    reader) pair of local steps merged."""
    steps = forward_identities(steps, values, outputs)
    readers: dict[int, list[int]] = {}
    for i, s in enumerate(steps):
        for v in s.ins:
            readers.setdefault(v, []).append(i)
    kept = set(outputs.values())
    producer = {v: i for i, s in enumerate(steps) for v in s.outs}
    out = list(steps)
    dropped = set()
    for i, use in enumerate(steps):
        if use.kind != "local":
            continue
        for v in use.ins:
            j = producer.get(v)
            if j is None or j in dropped:
                continue
            prod = steps[j]
            rule = RULES.get((prod.op, use.op))
            if (rule is None or prod.kind != "local" or len(prod.outs) != 1 or v in kept
                    or readers[v] != [i]):
                continue
            fused = rule(prod, use)
            if fused is not None:
                out[i] = fused
                dropped.add(j)
                break
    return [s for j, s in enumerate(out) if j not in dropped]
