"""Unequal stages: a pipeline whose stages run given, unequal numbers of layers.

With ``stage_layers=(n_0, .., n_{p-1})`` stage s runs layers ``o_s .. o_s + n_s`` of the
stack (``o_s = n_0 + .. + n_{s-1}``), so the first stage (which also runs what feeds the
layers, the embedding) and the last (the head and the loss) may take fewer layers.

:mod:`.partition` cuts the plan as for equal stages; :func:`split_stages` then turns the
cut into unequal ones, as a pass on the segment lists and the values:

* every value whose layer dim the stage axis splits (the stacked params, their gradients
  and optimizer state, what the layers' forward keeps for the backward) is stored where it
  runs: its sharding cuts the layer dim into the stages' counts (``Sharding.parts``), so rank
  s holds layers ``o_s .. o_s + n_s``.  Checkpoints, init and gathers read the sharding,
  so they stay in the global layer order; no param or gradient moves between stages;
* the pipelined repeat's forward and backward steps become one step per stage, over its
  own layers (same values: each rank's local slice holds its stage's layers).

With several stacks on the stage axis, :func:`split_stacks` does the same for each stack, at
its counts (:attr:`.pipeline.PipeSpec.stacks`); a stack on some of the stages has an empty part
on the others; a stack on one stage keeps its layers whole there, and a sum over the stage axis
that only that stage runs is summed over its other axes, unless what follows reads its layers as
parts summed over the stages (its per-layer outputs, a stacked gradient read other than by its sum
over the micro-batches): it is then stored at its counts as a stack on some stages is.  Chained
stacks (the later one starting from the earlier one's output) also move what runs between them, and
its gradient, between the stages holding their ends: these transfers are kept as cut.  With virtual stages (several stacks
cut on ``p * v`` logical stages) a stack on several of them is stored block-cyclically at its
counts (``Sharding.blocks``, zeros where a virtual stage holds none of it).

Per-layer outputs (``(carry, {name: tensor})``) are stored so too: what the loss makes of them
(a sum or mean over the layers, elementwise ops on them) runs on each stage's own layers, its
local steps at the stages' counts (:mod:`.local_parts`).  What :mod:`.interleave` refuses, this
pass refuses too (other steps run per micro-batch on several stages), but any step may read a
stacked gradient (each stage's step writes its own layers of it, with no chunks to join); a value
made per micro-batch before the layers and read after them (a skip around the stack) moves from the
first stage to the last as with equal stages.
With virtual stages (``interleaved:v``) the counts are per virtual stage (``p * v``, checked by
:func:`check_counts`) and :mod:`.interleave` cuts the chunks at them instead of this pass.
"""
from __future__ import annotations

import dataclasses

import torch

from ..errors import LayoutError, message
from ..ops.registry import run_device
from ..layout.sharding import part_sizes
from .interleave import _unsupported
from .pipeline_program import Segment
from .plan import Step, step_args, step_called


def offsets(counts) -> list[int]:
    """The first layer of each part of ``counts`` layers, and the end."""
    out = [0]
    for n in counts:
        out.append(out[-1] + n)
    return out


def check(cut, lists, counts) -> None:
    """Refuse what this pass cannot cut, with the reason."""
    why = _unsupported(cut, lists, chunked=False)
    if why is not None:
        spec = cut.spec
        raise LayoutError(message(
            f"compile (pipeline over '{spec.axis}', stage layers {','.join(map(str, counts))}): {why}.",
            inputs=[f"mesh: {spec.given[0]}", f"layout: {spec.given[1]}"],
            rule="unequal stages run their layers where they are stored and pass the carry, and what is made "
                 "before the layers for after them, between stages",
            fix="leave out stage_layers (--stage-layers) for equal stages"))


def split_stages(cut, lists: dict, counts) -> dict:
    """The segment lists of an equal cut (``lists``) with stage s running ``counts[s]`` layers;
    the layer-split values of ``cut.values`` are stored so (in place)."""
    check(cut, lists, counts)
    store_where_run(cut.values, cut.spec, counts)
    F = cut.steps[cut.F]
    B = cut.steps[cut.B] if cut.B is not None else None
    out = dict(lists)
    for seg, block in ((Segment.FORWARD, F), (Segment.BACKWARD, B)):
        if block is not None:
            out[seg] = _replace(lists[seg], block, [(dataclasses.replace(block, times=c, label=f"{block.label} (stage {t})"),
                                                     frozenset({t})) for t, c in enumerate(counts)])
    return out


def store_where_run(values: dict, spec, counts, layer: str | None = None) -> None:
    """Every value of ``values`` whose layer dim (``layer``, the pipelined repeat's by default)
    the stage axis alone splits, with that dim cut into ``counts`` (stage s holds its own
    layers); unchanged where the layout's even cut already is ``counts``."""
    mesh, axis, layer = spec.mesh, spec.axis, layer or spec.layer
    counts = tuple(counts)
    for vid, v in list(values.items()):
        sh = v.sharding
        if sh.axes_of(layer) != (axis,):
            continue
        size = v.shape.get(layer).size
        if part_sizes(size, mesh, mesh.group(0, (axis,)), (axis,)) == counts:
            continue
        values[vid] = dataclasses.replace(v, sharding=sh.with_parts(layer, counts))


def _store_cyclic(values: dict, spec, counts, layer: str) -> None:
    """Every value of ``values`` whose layer dim ``layer`` the stage axis alone splits, split
    block-cyclically at ``counts`` (one per virtual stage; rank r holds stages r, r + p, ..)."""
    v = len(counts) // spec.mesh.sizes[spec.axis]
    for vid, val in list(values.items()):
        if val.sharding.axes_of(layer) == (spec.axis,):
            values[vid] = dataclasses.replace(val, sharding=val.sharding.with_cyclic(layer, v, tuple(counts)))


def split_stacks(cut, lists: dict) -> dict:
    """The segment lists of a cut with several pipelined stacks (``spec.stacks``), each stack's
    forward and backward step one step per stage of its run, over that stage's layers of it; the
    stacks' layer-split values are stored so (in place): at the stages' counts for a stack on
    several stages (a part of length 0 on the stages outside its run, where :mod:`.partition`
    holds its params, gradients and updates empty, so gathers and checkpoints run over the whole
    stage axis), whole for a stack on one (held there only)."""
    spec = cut.spec
    why = _unsupported(cut, lists, chunked=cut.num_stages > spec.mesh.sizes[spec.axis])   # virtual stages
    if why is not None:
        raise LayoutError(message(
            f"compile (pipeline over '{spec.axis}', {len(cut.stacks)} stacks): {why}.",
            inputs=[f"mesh: {spec.given[0]}", f"layout: {spec.given[1]}"], bullets=stack_lines(spec),
            rule="stacks sharing a stage axis run their layers where they are stored and pass only their "
                 "carry, and what their blocks read from outside, between stages",
            fix="pipeline one stack only (leave the other's layer dim whole)"))
    out = dict(lists)
    for (_, layer, counts), st in zip(spec.stacks, cut.stacks):
        if st.lo == st.hi and not st.on_some(cut.num_stages):   # its layers whole there, held there only
            _store_whole(cut.values, spec.axis, layer)
        elif len(counts) > spec.mesh.sizes[spec.axis]:   # virtual stages: each rank's blocks, in stage order
            _store_cyclic(cut.values, spec, counts, layer)
        else:
            store_where_run(cut.values, spec, counts, layer)
        for seg, pos in ((Segment.FORWARD, st.F), (Segment.BACKWARD, st.B)):
            if pos is not None:
                block = cut.steps[pos]
                out[seg] = _replace(out[seg], block, [
                    (dataclasses.replace(block, times=c, label=f"{block.label} (stage {t})"), frozenset({t}))
                    for t, c in enumerate(counts) if c])
    return {seg: _one_stage_sums(pairs, spec, cut.values) for seg, pairs in out.items()}


def _one_stage_sums(pairs: list, spec, values) -> list:
    """``pairs`` with each sum over the stage axis that one stage alone runs (a gradient of what a
    stack on one stage reads from outside, such as a shared param) summed over the other axes only:
    the other stages run none of that stack's layers, so have no part of it."""
    out, p = [], spec.mesh.sizes[spec.axis]
    for s, st in pairs:
        ranks = {t % p for t in st}   # (virtual stages: stage t on rank t % p)
        if s.is_collective and s.kind not in ("send", "recv") and spec.axis in s.axes and len(ranks) < p:
            if s.kind != "allreduce" or len(ranks) > 1:
                raise LayoutError(message(
                    f"compile (pipeline over '{spec.axis}', {len(spec.stacks)} stacks): {s.kind} over "
                    f"{s.axes} for {step_called(s)} runs on stages {sorted(st)} only.",
                    inputs=[f"mesh: {spec.given[0]}", f"layout: {spec.given[1]}"], bullets=stack_lines(spec),
                    rule="a collective over the stage axis runs on every stage",
                    fix="pipeline one stack only (leave the other's layer dim whole)"))
            axes = tuple(a for a in s.axes if a != spec.axis)
            if axes:
                s = dataclasses.replace(s, axes=axes)
            else:
                v = values[s.outs[0]]
                s = Step("local", s.node, "copy", f"{s.label} (one stage's)", s.phase, s.ins, s.outs, (),
                         step_args("local", {"fn": _same, "attrs": {}, "compute": v.sharding.split,
                                             "sizes": {d.name: d.size for d in v.shape}}))
        out.append((s, st))
    return out


def _zero_part(ctx, attrs):
    """Zeros of this rank's local shape (its slice of each split dim), with no ``empty`` dim."""
    shape = tuple(0 if name == attrs["empty"] else ctx.size(name, full) for name, full in attrs["dims"])
    return torch.zeros(shape, dtype=attrs["dtype"], device=run_device())


def zeros_step(v: int, values: dict, phase: str, empty: str | None = None) -> Step:
    """A step making value ``v`` zero on each rank that runs it, at its local shape (a stage's
    part of a sum over the stages where it holds none of the stack that makes it); with an
    ``empty`` dim, with none of that dim (a stack's layers on a stage outside its run)."""
    val = values[v]
    return Step("local", -1, "zeros", f"no part of {v} on this stage", phase, (), (v,), (),
                step_args("local", {"fn": _zero_part,
                                    "attrs": {"dims": tuple((d.name, d.size) for d in val.shape), "empty": empty,
                                              "dtype": val.dtype},
                                    "compute": val.sharding.split, "sizes": {d.name: d.size for d in val.shape}}))


def _same(ctx, attrs, x):
    """A sum over one stage: its own part."""
    return x


def _store_whole(values: dict, axis: str, layer: str) -> None:
    """Every value of ``values`` whose layer dim the stage axis alone splits, with that dim whole."""
    for vid, v in list(values.items()):
        sh = v.sharding
        if sh.axes_of(layer) == (axis,):
            dims = tuple((n, () if n == layer else a) for n, a in sh.dims)
            values[vid] = dataclasses.replace(v, sharding=dataclasses.replace(
                sh, dims=dims, parts=tuple((n, q) for n, q in sh.parts if n != layer)))


def stack_lines(spec) -> list[str]:
    """Per stack of several on the stage axis, the layers each stage holds (plan notes, messages)."""
    out, p = [], spec.mesh.sizes[spec.axis]
    for _, layer, counts in spec.stacks:
        first = offsets(counts)
        rank = (lambda t: f" (rank {t % p})") if len(counts) > p else (lambda t: "")   # virtual stages
        out.append(f"stack '{layer}' on '{spec.axis}': " + ", ".join(
            (f"stage {t} layers {first[t]}..{first[t] + c - 1}" if c > 1 else f"stage {t} layer {first[t]}") + rank(t)
            for t, c in enumerate(counts) if c))
    return out


def _replace(pairs: list, block, per_stage: list) -> list:
    """A segment with the pipelined step replaced by its per-stage steps."""
    out = []
    for s, st in pairs:
        out += per_stage if s is block else [(s, st)]
    return out


def check_counts(counts, layers: int, p: int, mesh, layout, v: int = 1) -> tuple[int, ...]:
    """``counts`` as a tuple, or a LayoutError saying what is wrong with it; with ``v`` virtual
    stages per rank (interleaved), one count per virtual stage, ``p * v`` in all."""
    counts = tuple(counts)
    bad, n = [], p * v
    if len(counts) != n:
        bad.append(f"{len(counts)} entries for {p} stages" if v == 1 else
                   f"{len(counts)} entries for {n} virtual stages ({p} ranks x {v} per rank)")
    if any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in counts):
        bad.append(f"entries {[c for c in counts if not isinstance(c, int) or isinstance(c, bool) or c < 1]} "
                   "are not positive integers")
    elif sum(counts) != layers:
        bad.append(f"they sum to {sum(counts)}, not the {layers} layers")
    if bad:
        what = f"{p} stages" if v == 1 else f"{n} virtual stages"
        rule = "one positive layer count per stage, summing to the pipelined repeat's layers"
        if v > 1:
            rule += (f"; with {v} virtual stages per rank one per virtual stage, in layer order (virtual stage s "
                     f"is chunk s // {p} of rank s % {p}: rank 0 runs stages {', '.join(map(str, range(0, n, p)))})")
        raise LayoutError(message(
            f"compile: stage_layers={','.join(map(str, counts))} does not split {layers} layers over {what}.",
            inputs=[f"mesh: {mesh}", f"layout: {layout}"], bullets=bad, rule=rule,
            fix=f"give {n} counts summing to {layers}, e.g. {','.join(map(str, _even(layers, n)))}"
                if layers >= n else f"use fewer stages than the {layers} layers"))
    return counts


def _even(layers: int, p: int) -> list[int]:
    return [layers // p + (i < layers % p) for i in range(p)]
