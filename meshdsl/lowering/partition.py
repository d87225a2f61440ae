"""Partition a lowered plan into a pipeline: which stage runs each step, and when.

The plan is first lowered as a whole (on the mesh with the micro-batch axis, see
:mod:`.pipeline`); here its steps are cut into the four segments of one ``pipeline``
step (:class:`~.pipeline_program.Segment`), and each step gets the set of stages that
run it:

* **prologue** (once, before the schedule): steps that depend on no input, e.g.
  param re-layouts, and the whole-batch statistics of the inputs and of the params outside
  the pipelined stacks (a loss's token count, a frozen teacher's centre, :mod:`.batch_stats`).
  They run on the stages that read their results.
* **forward** (per micro-batch, in the schedule's ``F`` actions): what feeds the
  pipelined repeat (stage 0), the repeat's local layers (every stage, the carry
  received from the stage before and sent to the next), and what follows it up to
  the loss and its gradient down to the repeat's cotangent (the last stage).
* **backward** (per micro-batch, in ``B`` actions): the repeat's backward layers
  (the carry gradient travelling back) and what reads its input gradient (stage 0).
* **final** (once, after the schedule): collectives over the micro-batch axis
  (gradient accumulation, the loss mean) and all that follows: updates, and steps
  that combine values of several stages (a tied embedding's two gradients).

Stages come from data flow: the repeat's output carry lives on the last stage and
its input gradient on stage 0, and every step reading such values runs where they
are; steps reading neither run where their results are read (a backward step where the
micro-batches' own steps read them: one only their sums after the schedule read, a generator's
param gradient beside the stacks, runs per micro-batch on one stage, not on every stage after
them; a param's update where the param is read, and its optimizer state with it).  After the
micro-batches a step runs only where all it reads is when its result is no bigger than what would
move (a gradient's square sum: the scalar moves, not the gradient, :func:`_where_inputs_are`), and a
global norm's terms made on several stages are added on each, then over the stages (:mod:`.stage_terms`).
A value a step needs on another stage travels by one ``send``/``recv`` pair over the stage axis
(the carry and its gradient every micro-batch; others, such as the tied
embedding's gradient, once in the final segment, summed over the micro-batches first where
what reads it is linear in it, :mod:`.microbatch_sums`), so nothing is gathered or
reduced over the stage axis and a param is stored only on the stages that read it.  A tuple carry
(``md.repeat(block, (h, c), ...)``) crosses each boundary as one transfer per carried tensor, each
with tags of its own (:func:`~.pipeline_program.carry_tags`), and each tensor's gradient back so;
each is received into a value of its own (:func:`_own_carry`, :func:`_distinct_carry_grads`).

What the pipelined layers read from outside their repeat (:mod:`meshdsl.ir.closure`)
reaches every stage: an input is fed to each stage that reads it, a value made once
(from params and tables) is made on each, and a value made per micro-batch before the
layers (an encoder's output) is made on the first stage that reads it and sent on with
the carry, unless it is made from the inputs alone (crops cut into patches): then each stage
that reads it makes it from its feeds.  Its gradient, each stage's sum over its own layers,
travels back down the stages to stage 0 with the carry's gradient (:mod:`.stage_sum`); a
param's is summed over the stages after the micro-batches, as the global norm's sums are.  When the
head after the layers reads it too (a pointer over an encoder's output), the head's term comes down
from the last stage to meet that sum on stage 0, so the encoder's backward runs there per
micro-batch, as its forward did (:func:`_meet`), not on every stage after the micro-batches.

Several stacks on the stage axis (an encoder-decoder with ``layer:stage; enc_layer:stage``):
each stack runs on its own run of stages (the stages cut the stacks' layers one after another,
:func:`.pipeline.stack_counts`), its output carry on its last stage and its input gradient on
its first, and its carry passes only between its own stages, so one carry crosses each stage
boundary.  What one stack makes per micro-batch and a later one reads (the encoder's output)
goes up like any value read on a later stage, and its gradient's stage sum comes back down to
the stage that made it.  A stack on some of the stages stores its layers at its counts, with an
empty part on the others, where its params, per-layer outputs and summed gradients are held
empty (:func:`_everywhere`), so what follows them runs on every stage as for a stack on all.
:func:`.stage_layers.split_stacks` then gives each stage its loops.  Chained stacks (the later one's
first carry made from the earlier one's output, through steps outside any block: a pooling, ELECTRA's
argmax) run those steps and their gradients on the earlier stack's last stage (:func:`_meet`):
the later stack's first carry goes up from there to its first stage, and its input gradient comes
back down to meet the earlier stack's own (:func:`_moves_into`).  Two towers (stacks that do not feed
each other, joined after both: an image and a text tower and a loss over both) join per micro-batch on
the later tower's last stage, where what is made of the earlier tower's output runs too: that output
goes up once per micro-batch and its gradient comes back down to the earlier tower's last stage
(:func:`_tower_lifts`).  A later stack's stacked input made from an earlier one's output (every
decoder layer's cross-attention keys and values, by one einsum with a stacked param) is made by each
stage of the later stack's run, its own layers' part (:func:`_stacked_inputs`), and its gradient, each
stage's part from its own layers of the stacked gradient, is summed down those stages per micro-batch
to the earlier stack's last stage, where its backward reads it (:func:`_stacked_input_sums`); partial over
other axes too (the cache split by heads), it is summed over those after, on that stage
(:func:`_stage_sums_first`).  One stack alone whose stacked input is made from an unpipelined
encoder's output (``layer:stage``) sums that output's gradient down its stages to stage 0 so too,
where the encoder's backward then runs per micro-batch (:func:`_one_stacks_input_sums`).  With virtual
stages (``interleaved:v``) the stacks are cut so on ``p * v`` logical stages and
:func:`.stacks_on_ranks.on_ranks` puts them on the ranks (stage s on rank s % p).

The passes, in order: :func:`assign_stages`, :func:`update_where_held`, :func:`assign_segments`,
:func:`insert_transfers`; then :func:`_pipeline_step` makes the step and its
:class:`~.pipeline_program.PipelineProgram`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..collectives import COLLECTIVES
from ..errors import LayoutError, message
from .bucket import bucket_final
from .batch_stats import first_behind, from_inputs_only, made_once, param_behind
from .pipeline import BATCH, MB_AXIS
from .interleave import interleave
from .collective_parts import with_given_lengths, with_stored_bytes
from .local_parts import with_given_parts
from .microbatch_sums import sum_microbatches_first
from .stage_layers import split_stacks, split_stages, zeros_step
from .stage_terms import per_stage_steps, terms_by_stage
from .stacks_on_ranks import on_ranks
from .pipeline_program import PipelineProgram, Segment, carry_tags, num_carries, transfer_step
from .stage_sum import chained as chained_stage_sums, expand as expand_stage_sum
from .plan import Plan, Step, Value, step_args, step_called, register_step_kind, sum_begun_by
from .schedule_gen import named_schedule, parse_schedule, user_name

# axis: the stage axis; num_stages: its size p; microbatches; mb_axis: the virtual micro-batch axis
# (None for m = 1); program: the lowering.pipeline_program.PipelineProgram the runtime runs.
FIELDS = ("axis", "num_stages", "microbatches", "mb_axis", "program")
register_step_kind("pipeline", FIELDS)



def _error(what, spec, bullets, rule, fix):
    return LayoutError(message(f"compile (pipeline over '{spec.axis}'): {what}", bullets=bullets,
                               inputs=[f"mesh: {spec.given[0]}", f"layout: {spec.given[1]}",
                                       f"micro-batches: {spec.num_microbatches}"], rule=rule, fix=fix))


def varies_per_microbatch(steps, values=None, examples: str = BATCH, stacks=frozenset()) -> list[bool]:
    """Per step: whether it depends on the batch (an input, or a value made from one), so runs
    once per micro-batch; the others run once.  With ``values``, an input without the examples'
    dim ``examples`` (the micro-batches' dim: a table, a hyperparameter) is the same for every
    micro-batch, and a param the micro-batches cut (it holds the examples' dim: per-example latent
    codes, DeepSDF's) is read a micro-batch's rows at a time, as an input is.  The pipelined
    repeats' steps (positions ``stacks``) run per micro-batch, in the F and B actions, whatever
    they read: what reads their results does too, else it would run before the actions wrote it."""
    mb_vals: set[int] = set()
    out = []
    for i, s in enumerate(steps):
        batch_input = s.kind == "input" and (values is None or examples in values[s.outs[0]].shape.names)
        cut_param = s.kind == "param" and values is not None and MB_AXIS in values[s.outs[0]].sharding.used_axes
        out.append(batch_input or cut_param or i in stacks or any(v in mb_vals for v in s.ins))
        if out[-1]:
            mb_vals.update(s.outs)
    return out


def _same(ctx, attrs, x):
    return x


def _own_carry(steps, values, pipelined) -> list:
    """``steps`` with the pipelined repeat's first carry a value of its own, when the value it
    reads is read by other steps too (or is an input): later stages receive their carry into
    that value, which must not overwrite the input a step after the layers reads (the loss's
    ``x``).  The new value is the old one's tensor, handed on by a step on stage 0.  Each tensor
    of a tuple carry so (each is received into its own value)."""
    at = next((i for i, s in enumerate(steps) if pipelined(s) and not s.args["backward"]), None)
    if at is None:
        return steps
    for c in range(num_carries(steps[at])):
        steps = _own_carry_of(steps, values, at, c)
        at += steps[at].kind == "local"
    return steps


def _own_carry_of(steps, values, at: int, c: int) -> list:
    """:func:`_own_carry` for carried tensor ``c`` of the forward step at ``at``; one the tuple
    carries twice (``(x, x)``) gets its own value too, as each is received into its own."""
    v0 = steps[at].ins[c]
    if not any(v0 in s.ins for i, s in enumerate(steps) if i != at) and \
            not any(v0 in s.outs for s in steps if s.kind in ("param", "input")) and v0 not in steps[at].ins[:c]:
        return steps
    label = f"{steps[at].label}: its first carry" + (f"'s tensor {c}" if c else "")
    return _with_own_input(steps, values, at, c, label)


def _with_own_input(steps, values, at: int, j: int, label: str) -> list:
    """``steps`` with input ``j`` of step ``at`` a new value, copied from the old one by a step
    just before it."""
    v0, f = steps[at].ins[j], steps[at]
    own = max(values) + 1
    values[own] = Value(own, values[v0].shape, values[v0].dtype, values[v0].sharding)
    copy = Step("local", f.node, "carry", label, f.phase, (v0,), (own,), (),
                step_args("local", {"fn": _same, "attrs": {}, "compute": values[v0].sharding.split,
                                    "sizes": {d.name: d.size for d in values[v0].shape}}))
    ins = list(f.ins)
    ins[j] = own
    return [*steps[:at], copy, dataclasses.replace(f, ins=tuple(ins)), *steps[at + 1:]]


def _distinct_carry_grads(steps, values, pipelined) -> list:
    """``steps`` with each gradient of a tuple carry the pipelined backward reads a value of its
    own where it reads one twice (``a + b`` after the stack: the add's gradient is the same tensor
    for both): the stages before the last receive each into its own value."""
    at = next((i for i, s in enumerate(steps) if pipelined(s) and s.args["backward"]), None)
    if at is None:
        return steps
    nc = num_carries(steps[at])
    first = nc + len(steps[at].args["names"])
    for c in range(1, nc):
        if steps[at].ins[first + c] in steps[at].ins[first:first + c]:
            steps = _with_own_input(steps, values, at, first + c, f"{steps[at].label}: its carry gradient {c}")
            at += 1
    return steps


def _may_move(seg_from: Segment, seg_to: Segment, src: int, dst: int) -> bool:
    """Whether a value made in segment ``seg_from`` on stage ``src`` can reach a reader in
    ``seg_to`` on stage ``dst``: after the micro-batches, or with the carry (forward, to a
    later stage; backward, to an earlier one), or from a forward to a backward."""
    F, B = Segment.FORWARD, Segment.BACKWARD
    return (seg_to == Segment.FINAL or (seg_from, seg_to) == (F, B)
            or (seg_from == seg_to == F and src < dst) or (seg_from == seg_to == B and src > dst))


@dataclass(frozen=True)
class _Stack:
    """One pipelined repeat: the positions of its forward and backward steps, that of the carry
    gradient among the backward's inputs (the first one's of a tuple carry), its layers on each stage
    (() for one stack over every stage), the first and last stage running them, whether it is stored
    in parts even on one stage (:func:`_read_as_parts`), and the tensors it carries (``nc``: its first
    ``nc`` inputs and outputs, forward; its ``nc`` carry gradients from ``dy_pos`` on and its first
    ``nc`` outputs, backward)."""

    F: int
    B: int | None
    dy_pos: int
    counts: tuple
    lo: int
    hi: int
    parts: bool = False
    nc: int = 1

    @property
    def stages(self) -> frozenset:
        return frozenset(range(self.lo, self.hi + 1))

    def on_some(self, p: int) -> bool:
        """Whether it runs on some of the ``p`` stages but not on all, stored at its counts with an
        empty part on the stages outside its run: on several, or on one when ``parts`` (else it
        keeps its layers whole there)."""
        return (self.lo < self.hi or self.parts) and self.hi - self.lo + 1 < p


@dataclass
class _Cut:
    """One partition in the making: the lowered steps and what the passes find out about them.

    ``F`` and ``B`` are the positions of the pipelined repeat's forward and backward steps;
    ``dy_pos`` the position of the carry gradient among ``B``'s inputs.  :func:`assign_stages`
    fills ``stages`` (per step, the stages running it), ``held`` (value -> stages holding it)
    and ``demand`` (value -> stages reading it); :func:`assign_segments` fills ``segment``.
    ``stacks`` holds every pipelined repeat (:class:`_Stack`, in graph order; ``F``, ``B`` and
    ``dy_pos`` are the last one's), ``stack_at`` the stack of each of their steps' positions,
    ``sum_of`` that of each stage sum's and the tensor whose gradient it sums, ``sum_to`` (filled by
    :func:`assign_stages`) the stage each stage sum ends on."""

    steps: list
    values: dict
    outputs: dict
    spec: object
    F: int
    B: int | None
    dy_pos: int
    producer: dict
    leaf: list
    per_mb: list
    sums: set          # positions of the stage sums made by transfers (:mod:`.stage_sum`)
    stages: list = field(default_factory=list)
    held: dict = field(default_factory=dict)
    demand: dict = field(default_factory=dict)
    spread: set = field(default_factory=set)
    segment: list = field(default_factory=list)
    stacks: list = field(default_factory=list)
    stack_at: dict = field(default_factory=dict)
    sum_of: dict = field(default_factory=dict)
    sum_to: dict = field(default_factory=dict)
    chains: list = field(default_factory=list)   # (earlier, later) stacks, the later starting from the earlier
    # steps each stage runs per micro-batch on its own layers of a stacked input made before a stack (a
    # cross-attention cache): its forward (position -> the stack), the backward before its stage sum
    input_parts: dict = field(default_factory=dict)
    input_grad_parts: set = field(default_factory=set)
    # sums of scalar terms made on several stages, each stage adding its own (position -> its terms by
    # stage, :mod:`.stage_terms`)
    stage_terms: dict = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return self.spec.num_stages

    @property
    def every_stage(self) -> frozenset:
        return frozenset(range(self.spec.num_stages))

    def is_carry_in(self, i: int, j: int) -> bool:
        """Whether input ``j`` of step ``i`` is the carry (or its gradient) the stages pass on."""
        st = self.stack_at.get(i)
        return st is not None and ((i == st.F and j < st.nc) or (i == st.B and 0 <= j - st.dy_pos < st.nc))


def _cut(steps, values, outputs, spec) -> _Cut:
    """The pipelined repeats' steps found (per stack one forward, at most one backward) and the
    facts every pass reads: producers, leaves, what varies per micro-batch, the chained stage sums."""
    ax, p = spec.axis, spec.num_stages
    layers = [(layer, counts) for _, layer, counts in spec.stacks] or [(spec.layer, ())]

    def over(layer):
        return lambda s: (s.kind == "repeat" and len(s.ins) > num_carries(s)
                          and values[s.ins[num_carries(s)]].sharding.axes_of(layer) == (ax,))
    for layer, _ in layers:
        steps = _own_carry(steps, values, over(layer))
        steps = _distinct_carry_grads(steps, values, over(layer))
    steps = _stage_sums_first(steps, values, ax, [over(layer) for layer, _ in layers])
    producer = {v: i for i, s in enumerate(steps) for v in s.outs}
    stacks = []
    for layer, counts in layers:
        fwd = [i for i, s in enumerate(steps) if over(layer)(s) and not s.args["backward"]]
        bwd = [i for i, s in enumerate(steps) if over(layer)(s) and s.args["backward"]]
        assert len(fwd) == 1, "a pipelined repeat lowers to one forward step"
        if len(bwd) > 1:
            raise _error("the pipelined repeat is differentiated more than once.", spec, [],
                         "a pipeline runs one forward and one backward per micro-batch", "take one gradient")
        run = [t for t, c in enumerate(counts) if c] or [0, p - 1]   # the stages running its layers
        b, nc = (bwd[0] if bwd else None), num_carries(steps[fwd[0]])
        stacks.append(_Stack(fwd[0], b, nc + len(steps[fwd[0]].args["names"]), tuple(counts), run[0], run[-1],
                             _read_as_parts(steps, fwd[0], b), nc))
    in_stacks = frozenset(i for st in stacks for i in (st.F, st.B) if i is not None)
    # a whole-batch count of the inputs, or statistic of a frozen tower: once
    per_mb = made_once(steps, varies_per_microbatch(steps, values, spec.examples, in_stacks), in_stacks)
    sums = {i: (st, c) for st in stacks for i, c in chained_stage_sums(steps, ax, st.B, per_mb, producer).items()}
    inputs, grad_sums, grad_parts = ({}, *_one_stacks_input_sums(steps, values, ax, stacks[0], producer, per_mb,
                                                                  spec.schedule.num_chunks)
                                     ) if not spec.stacks else (
        _stacked_inputs(steps, values, spec, stacks, producer, per_mb),
        *_stacked_input_sums(steps, values, ax, stacks, producer, per_mb))
    sums.update(grad_sums)
    last = stacks[-1]
    return _Cut(steps, values, outputs, spec, last.F, last.B, last.dy_pos, producer,
                [s.kind in ("param", "input") for s in steps], per_mb, set(sums), stacks=stacks,
                stack_at={i: st for st in stacks for i in (st.F, st.B) if i is not None}, sum_of=sums,
                chains=_chains(steps, producer, stacks), input_parts=inputs, input_grad_parts=grad_parts)


def _stacked_inputs(steps, values, spec, stacks, producer, per_mb) -> dict[int, _Stack]:
    """The steps making, per micro-batch, a stacked input of a stack (a tensor with its layer dim, split
    over the stages with it, made before it from another stack's output: a cross-attention cache),
    each with that stack: each stage of its run makes its own layers' part (from values sent up to it),
    as it holds its own layers of the params they read; one stage making them all would hold only its
    own part.  A collective within a stage is one of them (the allreduce over ``model`` of the cache's
    einsum contracting ``d_model:model``): else it, and what it sums, ran on the first stage, which
    sent on its own part of the layers (none of the decoder's)."""
    out = {}
    for st, (_, layer, _) in zip(stacks, spec.stacks):
        F = steps[st.F]
        todo = list(F.ins[st.nc:st.nc + len(F.args["names"])])
        while todo:
            j = producer.get(todo.pop())
            if j is None or j in out or not per_mb[j] or steps[j].kind in ("param", "input") or (
                    steps[j].is_collective and {spec.axis, MB_AXIS} & set(steps[j].axes)):
                continue
            if all(values[v].sharding.axes_of(layer) == (spec.axis,) for v in steps[j].outs):
                out[j] = st
                todo += steps[j].ins
    return out


def _stacked_input_sums(steps, values, ax: str, stacks, producer, per_mb) -> tuple[dict, set]:
    """The stage sums (position -> (stack, tensor)) of the gradient of a stack's output carry made from
    another stack's stacked gradients (a cross-attention cache's einsum's backward, each stage over its
    own layers: a part of a sum over the stages), which the earlier stack's backward reads per
    micro-batch; and the positions of the steps each stage runs per micro-batch on its own layers of
    those gradients: what makes the parts, and what makes stacked param gradients of them (the cache's
    weights'), so that nothing after the micro-batches reads a per-micro-batch value of the stages.
    Each sum runs down the later stack's stages to the earlier one's last stage, in the backward, as
    :mod:`.stage_sum` does."""
    dys = {steps[st.B].ins[st.dy_pos + c]: st for st in stacks if st.B is not None for c in range(st.nc)}
    # or the stage sum a sum over other axes then reads (:func:`_stage_sums_first`)
    dys.update({s.ins[0]: dys[s.outs[0]] for s in steps if s.kind == "allreduce" and s.outs[0] in dys
                and ax not in s.axes and MB_AXIS not in s.axes})
    sums, parts = {}, set()
    for i, s in enumerate(steps):
        reader = dys.get(s.outs[0]) if s.kind == "allreduce" and s.axes == (ax,) else None
        if reader is None:
            continue
        for st in stacks:
            if st is reader or st.B is None:
                continue
            F, B = steps[st.F], steps[st.B]
            grads = set(B.outs[st.nc:st.nc + len(F.args["names"])])
            behind = _steps_behind(steps, producer, s.ins[0], grads, ax)
            if behind:
                sums[i] = (st, steps[reader.F].outs[0])
                parts |= behind | _stacked_grads_of(steps, values, ax, per_mb, grads | {v for j in behind
                                                                                            for v in steps[j].outs})
    return sums, parts


def _one_stacks_input_sums(steps, values, ax: str, st: _Stack, producer, per_mb, chunks: int) -> tuple[dict, set]:
    """:func:`_stacked_input_sums` for one pipelined stack whose stacked input is made from a value of
    an unpipelined part before it (a cross-attention cache from an encoder's output, ``layer:stage``
    alone): the gradient of that value, each stage's part from its own layers of the stacked gradient
    summed over the stages, which the encoder's backward reads per micro-batch, is summed down the
    stages to stage 0, where the encoder ran, in the backward (not on every stage after the
    micro-batches, the encoder's backward with it).  A sum only what runs after the micro-batches
    reads (a stacked param's gradient also read outside the stack) stays one allreduce there.  Not on
    virtual stages (``chunks`` > 1), where :mod:`.interleave` reads each stacked gradient after the
    micro-batches only: there the sum stays after them, as before."""
    if st.B is None or chunks > 1:
        return {}, set()
    grads = set(steps[st.B].outs[st.nc:st.nc + len(steps[st.F].args["names"])])
    read_per_mb = {v for j, s in enumerate(steps) if per_mb[j] and not (s.is_collective and MB_AXIS in s.axes)
                   for v in s.ins}
    sums, parts = {}, set()
    for i, s in enumerate(steps):
        if not (s.kind == "allreduce" and s.axes == (ax,) and per_mb[i] and s.outs[0] in read_per_mb):
            continue
        behind = _steps_behind(steps, producer, s.ins[0], grads, ax)
        if behind:
            sums[i] = (st, None)
            parts |= behind | _stacked_grads_of(steps, values, ax, per_mb, grads | {v for j in behind
                                                                                        for v in steps[j].outs})
    return sums, parts


def _stage_sums_first(steps, values, ax: str, pipelined) -> list:
    """``steps`` with each allreduce over the stage axis and other axes of a stack's output gradient
    made from another stack's stacked gradients split in two: the sum over the stage axis, then one over
    the others (``heads:model`` splits the cache's einsum too, so its gradient is partial over both).
    The first is the stage sum :func:`_stacked_input_sums` runs down the stages per micro-batch; the
    second runs on the stage where it ends, per micro-batch, as a collective of the layers' own would."""
    dys, grads = {}, {}   # a backward's output gradient -> its stack; a stack -> its stacked gradients
    for k, over in enumerate(pipelined):
        fwd = [s for s in steps if over(s) and not s.args["backward"]]
        for b in (s for s in steps if over(s) and s.args["backward"]):
            n, nc = len(fwd[0].args["names"]), num_carries(b)
            dys.update((v, k) for v in b.ins[nc + n:2 * nc + n])
            grads[k] = set(b.outs[nc:nc + n])
    producer = {v: i for i, s in enumerate(steps) for v in s.outs}
    out = []
    for s in steps:
        k = dys.get(s.outs[0]) if s.kind == "allreduce" and len(s.outs) == 1 else None
        if k is None or ax not in s.axes or len(s.axes) < 2 or MB_AXIS in s.axes or not any(
                _steps_behind(steps, producer, s.ins[0], g, ax) for j, g in grads.items() if j != k):
            out.append(s)
            continue
        rest = tuple(a for a in s.axes if a != ax)
        v = values[s.outs[0]]
        mid = max(values) + 1   # the stage sum, still partial over the other axes
        values[mid] = Value(mid, v.shape, v.dtype, v.sharding.with_partial((*v.sharding.partial, *rest)))
        out += [dataclasses.replace(s, axes=(ax,), outs=(mid,)),
                dataclasses.replace(s, axes=rest, ins=(mid,), label=f"{s.label}: over {rest}")]
    return out


def _stacked_grads_of(steps, values, ax: str, per_mb, made: set) -> set[int]:
    """The positions of the local per-micro-batch steps reading values of ``made`` whose results are split
    over the stages (each stage's own layers: a stacked param's gradient, before its micro-batch sum)."""
    return {j for j, s in enumerate(steps) if s.kind == "local" and per_mb[j] and made & set(s.ins) and all(
        any(ax in axes for axes in values[v].sharding.split.values()) for v in s.outs)}


def _steps_behind(steps, producer, v: int, grads: set, ax: str) -> set[int]:
    """The positions of the local steps between ``grads`` and value ``v``, when ``v`` is made from
    ``grads`` alone, or by products of them with other values (an einsum with a param): then each stage's
    part, from its own layers of ``grads`` (none on a stage outside the stack's run), is its term of
    the sum over the stages.  Empty otherwise: a whole value added to such a part (a skip's gradient)
    is added on every stage, a 1/p of it each, which the stack's stages alone do not sum.  A collective
    within a stage (not over ``ax`` or the micro-batches: a sum over ``model`` of a gradient partial
    there, ``d_model:model``) is linear and moves no part between stages: one of those steps too."""
    seen: dict[int, bool] = {}

    def made(u) -> bool:
        j = producer.get(u)
        if u in grads or j is None or j in seen:
            return u in grads or seen.get(j, False)
        s = steps[j]
        seen[j] = False
        if s.kind == "local":
            mine = [made(x) for x in s.ins]
            seen[j] = any(mine) and (all(mine) or s.op in ("einsum", "mul"))
        elif s.is_collective and s.kind not in ("send", "recv") and not {ax, MB_AXIS} & set(s.axes):
            seen[j] = all(made(x) for x in s.ins)
        return seen[j]
    return {j for j, ok in seen.items() if ok} if made(v) else set()


def _read_as_parts(steps, F: int, B: int | None) -> bool:
    """Whether what follows the stack (forward step ``F``, backward ``B``) reads its layers as parts
    split over the stages, even when one stage runs them all: the loss's terms of its per-layer
    outputs, or a step other than the micro-batches' sum reading a stacked gradient (a broadcast
    copy's sum over the layers).  The lowering built both as a sum over the stages, which a stack
    stored whole on one stage would not run."""
    if steps[F].args.get("ys"):
        return True
    n, nc = len(steps[F].args["names"]), num_carries(steps[F])
    grads = set(steps[B].outs[nc:nc + n]) if B is not None else set()
    return any(grads & set(s.ins) and (s.kind != "allreduce" or len(s.ins) > 1) for s in steps)


def _chains(steps, producer, stacks) -> list[tuple[_Stack, _Stack]]:
    """The (earlier, later) pairs of stacks where the later one's first carry, or a tensor its blocks
    read whole from outside (a decoder's cross-attention reading the encoder's output), is made from
    the earlier one's output carry, through any steps outside a block (ELECTRA's argmax between its
    generator and its discriminator, a pooling, a projection)."""
    made = {v: st for st in stacks for v in steps[st.F].outs[:st.nc]}
    out = []
    for st in stacks:
        F = steps[st.F]
        # its first carry, and what its blocks read whole from outside (not its stacked inputs: a
        # cross-attention cache made with its layer dim is summed down its stages, not chained)
        todo, seen = [*F.ins[:st.nc], *F.ins[st.nc + len(F.args["names"]):]], set()
        while todo:
            v = todo.pop()
            if v in seen:
                continue
            seen.add(v)
            if v in made and made[v] is not st and (made[v], st) not in out:
                out.append((made[v], st))
            if v in producer:
                todo.extend(steps[producer[v]].ins)
    return out


def _meet(cut: _Cut, i: int, anchored: list, in_b: set, after_mb: set) -> frozenset | None:
    """Where step ``i``, run per micro-batch and reading values anchored on several single stages,
    runs when they all lie on a chained pair's stages (from the earlier stack's last stage to the
    later one's last): a forward step on the latest of them (values go up with the carry: the losses
    of both stacks added), a backward one (``in_b``: it reads a backward's results) on the earliest
    (values come down with its gradient: the later stack's input gradient meets the earlier one's
    saved output on the earlier one's last stage, where the steps between the stacks ran).  A
    backward step whose values lie on one stack's stages runs on the earliest too: an encoder's
    output read by the stack's blocks and by the head after it gets its gradient's stage sum on the
    stack's first stage, where the encoder ran, and the head's term from the last stage's forward;
    they meet there, so the encoder's backward runs there per micro-batch, on its saved activations,
    not on every stage after the micro-batches.  None: not such a step, one after the micro-batches
    (``after_mb``: a gradient norm's parts, summed over the stages there), or one adding parts of a
    sum over the micro-batches (a tied embedding's two gradients: added once, after them)."""
    if i in after_mb or any(len(h) != 1 for h in anchored):
        return None
    if any(MB_AXIS in cut.values[v].sharding.partial for v in cut.steps[i].ins):
        return None
    at = {min(h) for h in anchored}
    if len(at) < 2:
        return None
    lo, hi = min(at), max(at)
    if any(a.hi <= lo and hi <= b.hi for a, b in cut.chains):
        return frozenset({lo if i in in_b else hi})
    # (one stack on virtual stages too: the head's term, sent down by the last chunk's forward, is
    # received by stage 0's backward, :func:`.interleave._out_of_order`)
    if i in in_b and any(st.lo <= lo and hi <= st.hi for st in cut.stacks):
        return frozenset({lo})
    return None


def _tower_lifts(cut: _Cut) -> dict[int, int]:
    """Two towers (stacks that do not feed each other: an image and a text tower) joined after both,
    per micro-batch: each earlier tower's output carry -> the last stage of the latest tower it is
    joined with.  What is made of that output runs there (:func:`assign_stages`), the output sent up
    once per micro-batch, so the join, the head between tower and join and their gradients (the
    params they read too) are on one stage, and the gradient of the output comes back down to the
    tower's backward.  A join of parts of a sum over the micro-batches (two losses added) is none."""
    steps, values = cut.steps, cut.values
    made = [_made_from(steps, steps[st.F].outs[0]) for st in cut.stacks]
    lifts: dict[int, int] = {}
    for k, a in enumerate(cut.stacks):
        for b, from_b in zip(cut.stacks[k + 1:], made[k + 1:]):
            if made[k] & set(steps[b.F].ins):   # b starts from a's output or reads it: not towers
                continue
            if any(cut.per_mb[i] and s.phase == "forward" and made[k] & set(s.ins) and from_b & set(s.ins)
                   and not any(MB_AXIS in values[v].sharding.partial for v in s.ins) for i, s in enumerate(steps)):
                out = steps[a.F].outs[0]
                lifts[out] = max(lifts.get(out, a.hi), b.hi)
    return lifts


def _made_from(steps, v: int) -> set[int]:
    """``v`` and the values the steps make from it, directly or not."""
    live = {v}
    for s in steps:
        if live & set(s.ins):
            live.update(s.outs)
    return live


def _after_microbatches(cut: _Cut) -> set[int]:
    """The positions of the collectives over the micro-batch axis and of the steps reading their
    results, directly or not: they run once, after the micro-batches (a whole-batch statistic of
    the inputs, made once before them, is not one: :func:`.batch_stats.made_once`)."""
    out, live = set(), set()
    for i, s in enumerate(cut.steps):
        if (s.is_collective and MB_AXIS in s.axes and cut.per_mb[i]) or live & set(s.ins):
            out.add(i)
            live.update(s.outs)
    return out


def _everywhere(cut: _Cut, st: _Stack, i: int) -> list[tuple[int, str | None]]:
    """What the forward or backward step ``i`` of ``st`` (a stack on some of the stages) makes
    that later steps read on every stage, each with the dim that is empty outside its run.  The
    forward's per-layer outputs (their layer dim): what the loss makes of them, a sum over the
    layers partial over the stages, then runs on every stage, each adding its own layers' part, as
    without the cut.  The backward's stacked params' gradients (their layer dim), and the
    gradients of what its block reads from outside that are summed over the stages after the
    micro-batches (a shared param's; None: zero there), not down the stages (:mod:`.stage_sum`)."""
    F, layer = cut.steps[st.F], cut.spec.stacks[cut.stacks.index(st)][1]
    n, nc = len(F.args["names"]), st.nc
    if i == st.F:
        return [(v, layer) for v in F.outs[2 * nc:2 * nc + len(F.args.get("ys", ()))]]
    outs, chained = cut.steps[st.B].outs, {c for _, c in cut.sum_of.values()}
    return [(v, layer) for v in outs[nc:nc + n]] + [
        (v, None) for v in outs[nc + n:] if v not in chained and cut.spec.axis in cut.values[v].sharding.partial]


def assign_stages(cut: _Cut) -> None:
    """Pass 1: the stages of every step.  Values anchored by the repeat's ends (its output carry
    on the last stage, its input gradient on stage 0) flow forward to their readers
    (:func:`_anchor`), but for a value made after the micro-batches and held alike on several stages
    (:func:`_held_alike`: a clip scale anchors no update); the rest is placed by demand, where its
    results are read (:func:`_by_demand`).
    The outputs are read on every stage, but a carried param's next value (``new/<name>``) only
    where the param is: read on every stage, a param only stage 0 reads (ELECTRA's generator's,
    beside the stacks) would be updated and stored on every stage, its gradient sent up after the
    micro-batches.  So the demand runs again with that value read where the first placement put
    the param's forward readers (:func:`_params_read_at`); :func:`update_where_held` widens the
    update wherever the param is read after all."""
    anchored = _anchor(cut)
    held, spread = dict(cut.held), set(cut.spread)
    seed = {v: cut.every_stage for v in cut.outputs.values()}
    cut.stages = _by_demand(cut, list(anchored), seed)
    where = _params_read_at(cut)
    if any(seed[v] != at for v, at in where.items()):
        seed.update(where)
        cut.held, cut.spread, cut.demand = held, spread, {}
        cut.stages = _by_demand(cut, list(anchored), seed)
    _where_inputs_are(cut)


def _where_inputs_are(cut: _Cut) -> None:
    """Run a step after the micro-batches only on the stages holding all it reads, when it runs on
    more and makes no more bytes than it reads from there: its result moves, not its inputs (a
    gradient's square norm, one scalar, sent to the stages that add the norm's terms, not the
    gradient; a step making an output stays where the outputs are read).  In graph order, so a chain
    of such steps (the gradient's sum over the micro-batches, its square, their sum) moves back.  A
    global norm's sum of such terms, made on several stages, runs on every stage, each adding its own
    (:mod:`.stage_terms`; not on virtual stages, whose values move their own way)."""
    ax, after_mb, made = cut.spec.axis, _after_microbatches(cut), set(cut.outputs.values())
    one_chunk = cut.num_stages == cut.spec.mesh.sizes[ax] and cut.spec.schedule.num_chunks == 1
    for i, s in enumerate(cut.steps):
        terms = terms_by_stage(s, cut.stages[i], cut.held, cut.values, ax) if one_chunk and i in after_mb else None
        if terms is not None:
            cut.stage_terms[i], cut.stages[i] = terms, cut.every_stage
            cut.held.update((v, cut.every_stage) for v in s.outs)
            continue
        if (i not in after_mb or cut.leaf[i] or i in cut.stack_at or i in cut.sums or i in cut.spread
                or i in cut.input_parts or (s.is_collective and ax in s.axes) or made & set(s.outs)
                or any(ax in cut.values[v].sharding.used_axes for v in (*s.ins, *s.outs))):
            continue
        at = frozenset(cut.stages[i]).intersection(*(cut.held.get(v, cut.every_stage) for v in s.ins))
        moved = [v for v in s.ins if not cut.stages[i] <= cut.held.get(v, cut.every_stage)]
        if at and at < cut.stages[i] and sum(_bytes(cut, v) for v in s.outs) <= sum(_bytes(cut, v) for v in moved):
            cut.stages[i] = at
            cut.held.update((v, at) for v in s.outs)


def _bytes(cut: _Cut, v: int) -> int:
    return cut.values[v].local_bytes(cut.spec.mesh)


def _params_read_at(cut: _Cut) -> dict[int, frozenset]:
    """Each carried param's next value (the ``new/<name>`` output) -> the stages running the forward
    steps that read the param.  One no forward step reads whose next value feeds another param's (an
    optimizer's state: AdamW's moments, made by the param's own update, or read by it) -> no stage: it
    is made and stored where that update runs, not on every stage (which would send the param's
    gradient to all of them after the micro-batches).  Any other (a running statistic's): every stage."""
    at: dict[int, frozenset] = {}
    for j, r in enumerate(cut.steps):
        if not cut.leaf[j] and r.phase == "forward":
            for v in r.ins:
                at[v] = at.get(v, frozenset()) | cut.stages[j]
    read = {v for s in cut.steps for v in s.ins}
    made = set(cut.outputs.values())
    out = {}
    for i, s in enumerate(cut.steps):
        new = cut.outputs.get(f"new/{s.args['name']}") if cut.leaf[i] and s.kind == "param" else None
        if new is None:
            continue
        feeds = new in read or any(u != new and u in made for u in cut.steps[cut.producer[new]].outs)
        out[new] = at.get(s.outs[0], frozenset() if feeds else cut.every_stage)
    return out


def _anchor(cut: _Cut) -> list:
    """The stages of the steps anchored by the stacks' ends, and of those reading their results
    (None for the others); fills ``cut.held`` with where their results are."""
    ALL, steps = cut.every_stage, cut.steps
    held, stages = cut.held, [None] * len(steps)
    in_b = _downstream(cut, [v for st in cut.stacks if st.B is not None for v in steps[st.B].outs])
    after_mb = _after_microbatches(cut)
    lifts = _tower_lifts(cut) if len(cut.stacks) > 1 else {}
    # (not on virtual stages: a stage's values there lie on another's ranks too, as in _where_inputs_are)
    one_chunk = cut.num_stages == cut.spec.mesh.sizes[cut.spec.axis] and cut.spec.schedule.num_chunks == 1
    differ = _held_differently(cut) if one_chunk else set(cut.values)
    for i, s in enumerate(steps):
        st = cut.stack_at.get(i)
        if st is not None:   # a stack's output carry on its last stage, its input gradient on its first
            stages[i] = st.stages
            held.update((v, st.stages) for v in s.outs[st.nc:])
            held.update((v, frozenset({st.hi}) if i == st.F else frozenset({st.lo})) for v in s.outs[:st.nc])
            if st.on_some(cut.num_stages):
                # its per-layer outputs and its gradients summed after the micro-batches are held on
                # every stage, empty or zero outside its run (made there by insert_transfers), so what
                # sums them and updates the params runs on every stage, the results (updated params,
                # optimizer state) held there as the params are (_holders)
                held.update((v, ALL) for v, _ in _everywhere(cut, st, i))
        elif i in cut.sums:   # ends where the tensor was made: the stack's first stage, or one before it
            st, c = cut.sum_of[i]
            made = held.get(c, frozenset())
            cut.sum_to[i] = min(made) if len(made) == 1 and min(made) < st.lo else st.lo
            stages[i] = frozenset({cut.sum_to[i]})
            held.update((v, stages[i]) for v in s.outs)
        elif i in cut.input_parts:   # each stage of the stack's run makes its own layers' part
            stages[i] = cut.input_parts[i].stages
            cut.spread.add(i)
            held.update((v, stages[i]) for v in s.outs)
        elif not cut.leaf[i]:
            anchored = [frozenset({lifts[v]}) if v in lifts else held[v] for v in s.ins
                        if v in held and not _held_alike(cut, v, i, after_mb, differ)]
            if anchored:
                stages[i] = _meet(cut, i, anchored, in_b, after_mb) or frozenset().union(*anchored)
                if one_chunk and i in after_mb and _whole_into_stage_parts(cut, i):
                    stages[i] = ALL
                held.update((v, stages[i]) for v in s.outs)
                if i in cut.input_grad_parts:   # each stage's own layers' part of a stage sum
                    cut.spread.add(i)
    return stages


def _held_alike(cut: _Cut, v: int, r: int, after_mb: set, differ: set) -> bool:
    """Whether ``v``, read by step ``r``, is made after the micro-batches and held alike on several
    stages (a global norm's clip scale every update reads): then it anchors no reader, which runs
    where its other inputs are (a generator's update where its param is), ``v`` sent there if need
    be.  Alike: ``v`` is not in ``differ`` (:func:`_held_differently`).  Not for a reader making a
    value split or partial over the stage axis: each stage makes its own part of that, so where it
    runs is no choice (:func:`_whole_into_stage_parts`)."""
    ax = cut.spec.axis
    return (cut.producer.get(v) in after_mb and len(cut.held.get(v, ())) > 1 and v not in differ
            and not any(ax in cut.values[u].sharding.used_axes for u in cut.steps[r].outs))


def _held_differently(cut: _Cut) -> set[int]:
    """The values whose copies may differ from stage to stage: split or partial over the stage axis
    (each stage's layers, a stack's zero or empty parts outside its run, a part of a sum over the
    stages); a stack's other results but its carry (each stage's layers' part of a gradient summed
    down the stages: whole by its layout, a part by its meaning); each stage's part of a stacked input
    (:attr:`_Cut.input_parts`) or of its gradient; and what is made from any of them, but by a
    collective over the stage axis (every stage gets the same) or a stage sum (one stage holds it)."""
    ax, values, out = cut.spec.axis, cut.values, set()
    for i, s in enumerate(cut.steps):
        st = cut.stack_at.get(i)
        if st is not None:
            out.update(s.outs[st.nc:])
        elif i in cut.input_parts or i in cut.input_grad_parts:
            out.update(s.outs)
        elif not (i in cut.sums or (s.is_collective and ax in s.axes and not COLLECTIVES[s.kind].point_to_point)):
            if out & set(s.ins):
                out.update(s.outs)
        out.update(v for v in s.outs if ax in values[v].sharding.used_axes)
    return out


def _whole_into_stage_parts(cut: _Cut, i: int) -> bool:
    """Whether step ``i`` makes a part of a sum over the stage axis from an input whole over it
    (``norm2 + reduce_sum(g * g)``, the first term whole, the second each stage's part).  A jointly
    linear op adds ``1/p`` of the whole term on each of the ``p`` stages (:mod:`.generic`), so every
    stage runs it, each where it holds no part adding its share to zeros (:func:`_moves_into`); run
    on some stages only, the others' shares would be lost.  Only with several stacks: one stack
    over every stage holds its parts on every stage anyway."""
    s, ax, values = cut.steps[i], cut.spec.axis, cut.values
    return (bool(cut.spec.stacks) and s.kind == "local" and any(ax in values[v].sharding.partial for v in s.outs)
            and any(ax not in values[v].sharding.used_axes for v in s.ins))


def _by_demand(cut: _Cut, stages: list, seed: dict) -> list:
    """``stages`` with the steps not anchored placed where their results are read, the values in
    ``seed`` read on the stages it gives; fills ``cut.demand`` and ``cut.held``."""
    ALL, steps, held, demand = cut.every_stage, cut.steps, cut.held, cut.demand
    pure, after_mb, early = from_inputs_only(steps), _after_microbatches(cut), {}
    demand.update(seed)
    for i in reversed(range(len(steps))):
        s = steps[i]
        if stages[i] is None:
            want = frozenset().union(*(demand.get(v, frozenset()) for v in s.outs))
            if _read_in_the_actions(cut, i, after_mb) and want:
                # read after the micro-batches only (a generator's param gradient, by its sum over
                # them): made where the micro-batches read its other results, or on one stage
                # (sent once after them, summed first), not on every stage after the schedule
                want = frozenset().union(*(early.get(v, frozenset()) for v in s.outs)) or frozenset({min(want)})
            if cut.per_mb[i] and not cut.leaf[i] and s.phase == "forward" and len(want) > 1:
                if any(cut.spec.axis in cut.values[v].sharding.used_axes for v in s.outs):
                    cut.spread.add(i)   # each stage runs it on its own part (split over the stages)
                elif (not (s.is_collective and {cut.spec.axis, MB_AXIS} & set(s.axes))
                      and all(v in pure for v in s.outs)):
                    # made from the inputs only (fed to every stage): each stage that reads it makes it,
                    # rather than receive it (DINO's crops cut into patches, read by both towers); a
                    # collective within a stage too (a halo of a sequence-split input, None on the
                    # edge ranks, could not be sent on)
                    cut.spread.add(i)
                else:
                    # made once per micro-batch, on the first stage that reads it (an encoder's output read
                    # by every pipelined layer: stage 0), and sent on to the later ones with the carry
                    want = frozenset({min(want)})
            if _joins_stages_once(cut, i):
                want = ALL
            stages[i] = want or frozenset({0})
            held.update((v, stages[i]) for v in s.outs)
        st = cut.stack_at.get(i)
        for j, v in enumerate(s.ins):
            want = (({st.lo} if i == st.F else {st.hi}) if cut.is_carry_in(i, j)
                    else stages[i]) if st is not None else stages[i]
            demand[v] = demand.get(v, frozenset()) | want
            if i not in after_mb:
                early[v] = early.get(v, frozenset()) | want
    return stages


def _read_in_the_actions(cut: _Cut, i: int, after_mb: set) -> bool:
    """Whether step ``i``, placed by demand, is a backward (or update) step run per micro-batch, not
    after the micro-batches, on values whole over the stage axis (not each stage's own part): where
    only the sums after the micro-batches read its results, one stage runs it (:func:`_by_demand`)."""
    s, ax = cut.steps[i], cut.spec.axis
    return (cut.per_mb[i] and not cut.leaf[i] and i not in after_mb and s.phase != "forward"
            and not any(ax in cut.values[v].sharding.used_axes for v in s.outs))


def update_where_held(cut: _Cut) -> None:
    """Pass 1b: a carried param's next value (the ``new/<name>`` output a training step feeds back
    as ``<name>``) held on every stage that holds the param.  A param read on several stages (MoCo's
    query weights read through ``stop_gradient`` by the key encoder on the last stage) has its
    gradient on one of them only, so :func:`assign_stages` puts its update there; the next step
    would then find no value on the others.  The update's own steps run on each stage holding the
    param instead (its gradient sent there once, after the micro-batches), and the optimizer state
    they read is held there too, so its next value is made there as well (repeated until nothing
    more is widened).  Resending the updated param every step would move as much, and the update's
    own collectives (a clipped norm's) are shared by the stages anyway."""
    steps = cut.steps
    params = {s.args["name"]: s.outs[0] for i, s in enumerate(steps) if cut.leaf[i] and s.kind == "param"}
    may = _after_microbatches(cut)
    widened = True
    while widened:
        widened = False
        for name, p in params.items():
            new = cut.outputs.get(f"new/{name}")
            want = cut.held.get(p, frozenset())
            if new is not None and not want <= cut.held.get(new, want):
                widened |= _widen(cut, new, want, may)


def _widen(cut: _Cut, v: int, want: frozenset, may: set) -> bool:
    """Run the steps making ``v`` (back to its gradient's sums) on the stages ``want`` too, a param
    they read held there (a ZeRO update's gathers within each stage too).  A collective over the
    stage or micro-batch axis, a stage sum, a value partial over the stage axis, and a step neither
    of the update nor after the micro-batches (the gradient's own steps) stay where they are: their
    results are sent there.  Returns whether ``v`` was widened."""
    i, ax = cut.producer.get(v), cut.spec.axis
    s = None if i is None else cut.steps[i]
    if (s is None or cut.leaf[i] or i in cut.stack_at or i in cut.sums or i in cut.input_parts
            or (s.is_collective and {ax, MB_AXIS} & set(s.axes)) or (s.phase != "update" and i not in may)
            or any(ax in cut.values[u].sharding.partial for u in s.outs)):
        return False
    cut.stages[i] = cut.stages[i] | want
    cut.held.update((u, cut.held.get(u, frozenset()) | want) for u in s.outs)
    for u in s.ins:
        if not want <= cut.held.get(u, want):
            j = cut.producer.get(u)
            if j is not None and cut.leaf[j]:
                cut.held[u] = cut.held[u] | want   # a param (optimizer state) the update reads
            else:
                _widen(cut, u, want, may)
    return True


def _joins_stages_once(cut: _Cut, i: int) -> bool:
    """Whether step ``i`` is a collective over the stage axis made once, before the micro-batches
    (a pipelined stack's param read outside the stack: ``reduce_sum(w, "layer")``, or gathered for
    a second stack, MoCo's key encoder reading its query encoder's stacked weights).  Its parts
    lie on every stage, so every stage runs it (and, by demand, what makes its parts), not only
    the stages that read its result: a collective over the stage axis on one stage's ranks
    cannot run."""
    s = cut.steps[i]
    return (not cut.per_mb[i] and s.is_collective and not COLLECTIVES[s.kind].point_to_point
            and cut.spec.axis in s.axes)


def _stack_stages(cut: _Cut, layer: str) -> frozenset | None:
    """The stages holding layers of the pipelined stack that scans ``layer`` (None: no such stack)."""
    if cut.spec.stacks:
        return next((frozenset(k for k, c in enumerate(counts) if c)
                     for _, name, counts in cut.spec.stacks if name == layer), None)
    return cut.every_stage if layer == cut.spec.layer else None


#: the fix for a loss term that reduces a pipelined stack's params outside the stack (an L2 penalty
#: written as ``reduce_sum(w * w)`` of the stacked ``w``): each stage holds its own layers of ``w``
_OUTSIDE_FIX = ("make the term in the block, per layer, and sum those: return (carry, {'l2': "
                "md.reduce_sum(p['w'] * p['w'])}) from the block and add md.reduce_sum(per_layer['l2']) to the loss "
                "(per-layer outputs pipeline), or use the optimizer's weight decay")


def _check_stage_collectives(cut: _Cut) -> None:
    """Refuse, after :func:`assign_stages`, what would run over the stage axis on some stages only:
    a forward collective over it (and not the micro-batches) left on some of the stages, such as a
    sum over a dim that a pipelined repeat scans, made before it as its first carry; and a value
    split over it with a stack's layers that a step outside the stacks cuts from a whole value on
    some of that stack's stages (the gradient of a pipelined stack's param read by a second,
    unpipelined stack, made whole on the last stage: that stage keeps its own layers' rows, the
    others' were lost).  The backward's sums of gradients over the stages run where they are held."""
    ax = cut.spec.axis
    for i, s in enumerate(cut.steps):
        if (s.is_collective and not COLLECTIVES[s.kind].point_to_point and s.phase == "forward"
                and ax in s.axes and i not in cut.sums and cut.stages[i] != cut.every_stage):
            raise _error(f"{step_called(s)}: {s.kind} over the pipeline axis '{ax}' on stage(s) "
                         f"{sorted(cut.stages[i])} only", cut.spec,
                         [*_step_bullets(cut, s, s), *cut.spec.scan_hint[:1]],
                         "a pipeline axis splits the stacks' layers; what is made outside them per micro-batch "
                         f"is whole over '{ax}' (a collective over it on some stages cannot run)",
                         _stage_axis_fix(cut, s))
        name = _layers_cut_on_some_stages(cut, i)
        if name is not None:
            raise _error(f"{step_called(s)} cuts the layers' parts of '{name}' from a whole value on stage(s) "
                         f"{sorted(cut.stages[i])} only", cut.spec, [f"{s.label}: {s.note or s.kind}"],
                         f"a value split over '{ax}' with a pipelined stack's layers is made on each stage "
                         "holding them, its own part; made whole on some stages it would keep only theirs",
                         "read a pipelined stack's params outside it through md.stop_gradient (no "
                         "gradient comes back), or keep that stack out of the pipeline")


def _check_exchanges_in_actions(cut: _Cut) -> None:
    """Refuse, after :func:`assign_segments`, a step outside the stacks that runs in the stages' F or
    B actions (each stage its own part, per micro-batch) and would exchange over the stage axis
    there, where only the pipeline's transfers and stage sums can: itself a point-to-point
    collective (a flip's permute or a halo of the scanned dim, made before a top-level recurrence
    over it), or one in its sub-plans (an unpipelined repeat whose block gathers that dim)."""
    ax = cut.spec.axis
    for i, s in enumerate(cut.steps):
        if cut.segment[i] not in (Segment.FORWARD, Segment.BACKWARD) or i in cut.stack_at or i in cut.sums:
            continue
        inner = (s if s.is_collective and ax in s.axes and COLLECTIVES[s.kind].point_to_point else
                 next((t for sp in s.subplans for t, _ in sp.walk() if t.is_collective and ax in t.axes), None))
        if inner is not None:
            raise _error(f"{step_called(s)} runs in the stages' actions and sends {inner.kind} over the pipeline "
                         f"axis '{ax}'", cut.spec, [*_step_bullets(cut, s, inner), *cut.spec.scan_hint[:1]],
                         "a pipeline axis splits the stacks' layers; what each stage makes of its own part per "
                         f"micro-batch exchanges nothing over '{ax}' but the pipeline's transfers and stage sums",
                         _stage_axis_fix(cut, inner))


def _step_bullets(cut: _Cut, s: Step, inner: Step) -> list[str]:
    """What step ``s`` (or ``inner``, a collective of its sub-plans) does over the stage axis, and,
    for a sum, the op that began it (through the ops that pass the partial sum on), each named as
    the user wrote it."""
    out = [f"{step_called(inner)}: {inner.note or inner.kind}"]
    if inner is s and s.ins and cut.spec.axis in cut.values[s.ins[0]].sharding.partial:
        made = sum_begun_by(cut.steps, cut.values, s.ins[0], cut.spec.axis)
        if made is not None:
            out.append(f"the sum over '{cut.spec.axis}' is begun by {step_called(made)}")
    return out


def _stage_axis_fix(cut: _Cut, s: Step) -> str:
    """The fix for collective ``s``, outside the stacks, over the pipeline axis, in forms the mesh
    can take: the scan hint's (a recurrence over a dim of the inputs, nested in a one-step block); a
    sum over the stacks' layers made per layer in the block; else each dim the layout puts on the
    stage axis kept whole (or put on another axis of the mesh, where it has one), or the stack run
    whole (its rule dropped: a 'layer' rule needs a repeat over 'layer' at the top, so nesting the
    stack in a one-step block is no fix here)."""
    spec, ax = cut.spec, cut.spec.axis
    if spec.scan_hint:
        return spec.scan_hint[1]
    held = [cut.values[v].sharding for v in s.ins if v in cut.values]
    if MB_AXIS in s.axes or any(ax in sh.partial for sh in held):
        return _OUTSIDE_FIX
    mesh, layout = spec.given
    free = [a for a in mesh.names if mesh.sizes[a] > 1 and a != ax]
    layers = {spec.layer, *(name for _, name, _ in spec.stacks)}
    ways = []
    for dim in dict.fromkeys(d for sh in held for d, axes in sh.dims if ax in axes):
        r = layout.rule_for(dim, ())
        if r is not None and dim not in layers:
            ways.append(f"keep '{dim}' whole: drop '{r}'" + (f" (or write '{dim}:{free[0]}')" if free else ""))
    r = layout.rule_for(spec.layer, ())
    if r is not None:
        ways.append(f"run the stack over '{spec.layer}' unpipelined: drop '{r}'")
    return "; or ".join(ways) or "read the stacks' outputs in a form each stage makes on its own layers"


def _layers_cut_on_some_stages(cut: _Cut, i: int) -> str | None:
    """The layer dim of a pipelined stack that local step ``i``, outside the stacks, splits over the
    stage axis from inputs whole over it, on fewer stages than hold that stack's layers (else None)."""
    ax, s = cut.spec.axis, cut.steps[i]
    if (cut.leaf[i] or i in cut.stack_at or i in cut.spread or i in cut.input_parts or i in cut.sums
            or s.is_collective or any(ax in cut.values[u].sharding.used_axes for u in s.ins)):
        return None
    for v in s.outs:
        for name, axes in cut.values[v].sharding.dims:
            held = _stack_stages(cut, name) if ax in axes else None
            if held is not None and not held <= cut.stages[i]:
                return name
    return None


def assign_segments(cut: _Cut) -> None:
    """Pass 2: the segment of every step (None for params and inputs).  A collective over the
    micro-batch axis, a step run on several stages (but its own part on each) and all that reads
    their results run once, after the micro-batches; of the rest, what varies per micro-batch
    runs in the F (before the pipelined backward) or the B actions, and what does not, once before."""
    steps = cut.steps
    cut.spread |= _own_parts(cut)
    final: set[int] = set()
    for i, s in enumerate(steps):
        if cut.leaf[i] or i in cut.stack_at or not cut.per_mb[i]:
            continue
        if ((s.is_collective and MB_AXIS in s.axes) or (len(cut.stages[i]) > 1 and i not in cut.spread)
                or any(cut.producer.get(v) in final for v in s.ins)):
            final.add(i)
    _check_what_feeds_the_layers(cut, final)
    after_b: set[int] = {v for st in cut.stacks if st.B is not None for v in steps[st.B].outs}
    in_b = set()
    for i, s in enumerate(steps):
        if any(v in after_b for v in s.ins):
            after_b.update(s.outs)
            in_b.add(i)
    order = {i: Segment.FORWARD if i == st.F else Segment.BACKWARD for i, st in cut.stack_at.items()}
    cut.segment = [None if cut.leaf[i] else Segment.FINAL if i in final else order[i] if i in order
                   else Segment.PROLOGUE if not cut.per_mb[i]
                   else Segment.BACKWARD if i in in_b else Segment.FORWARD for i in range(len(steps))]


def _own_parts(cut: _Cut) -> set[int]:
    """The steps every stage runs per micro-batch on its own part of values split over the stage
    axis with the layers: what a loss makes of the pipelined repeat's per-layer outputs layer by
    layer (``reduce_sum(f(y))`` for an elementwise ``f``, a norm over another dim), and the
    cotangent of those outputs the backward reads (with, from a fused norm's backward, its scale's
    gradient summed over the layers: :func:`_per_layer_outputs`).  They run in the stage's F actions, as the SPMD program runs them on each
    rank's part, not after the micro-batches; a step that reads a value other stages lack, moves
    values over the stage or micro-batch axis, does not descend from the per-layer outputs, or
    reads what the pipelined backward made (the stacked gradients, the update), is not one of them."""
    ax, every = cut.spec.axis, cut.every_stage
    ys = [v for st in cut.stacks
          for v in cut.steps[st.F].outs[2 * st.nc:2 * st.nc + len(cut.steps[st.F].args.get("ys", ()))]]
    if not ys:
        return set()
    from_ys = _downstream(cut, ys)   # (several stacks: each one's per-layer outputs, and every backward's results)
    from_b = _downstream(cut, [v for st in cut.stacks if st.B is not None for v in cut.steps[st.B].outs])
    out = set()
    for i, s in enumerate(cut.steps):
        if (i not in from_ys or i in from_b or cut.leaf[i] or not cut.per_mb[i] or i in cut.stack_at
                or cut.stages[i] != every
                or (s.is_collective and {ax, MB_AXIS} & set(s.axes))):
            continue
        if _per_layer_outputs(cut, s.outs) and all(cut.held.get(v, every) == every for v in s.ins):
            out.add(i)
    return out | _cotangent_factors(cut, out, from_ys | from_b)


def _cotangent_factors(cut: _Cut, own: set, skip: set) -> set[int]:
    """The steps that make, without the per-layer outputs, a factor of what the ``own`` part steps
    read, read by them alone: ``g * t`` for a per-layer input ``t`` in the backward of ``t *
    log_sigmoid(y)`` (a stop token's BCE against per-frame targets), each stage's own layers of it
    per micro-batch as the steps reading it are (after the micro-batches, it would hold the
    pipelined backward's cotangent up to the last one)."""
    every, ax = cut.every_stage, cut.spec.axis
    readers: dict[int, set[int]] = {}
    for i, s in enumerate(cut.steps):
        for v in s.ins:
            readers.setdefault(v, set()).add(i)
    found: set[int] = set()
    for i in reversed(range(len(cut.steps))):   # readers come after their producers
        s = cut.steps[i]
        if (i in own or i in skip or cut.leaf[i] or not cut.per_mb[i] or i in cut.stack_at
                or cut.stages[i] != every or (s.is_collective and {ax, MB_AXIS} & set(s.axes))):
            continue
        if (_per_layer_outputs(cut, s.outs) and all(cut.held.get(v, every) == every for v in s.ins)
                and all(readers.get(v) and readers[v] <= own | found for v in s.outs)):
            found.add(i)
    return found


def _per_layer_outputs(cut: _Cut, outs) -> bool:
    """Whether ``outs`` (one step's) are each stage's own part: every one split over the stage axis
    with the layers, or, beside one that is, summed over the layers (a fused norm's backward with
    the scale's gradient, ``g * x̂`` summed over the layers and rows): each stage's term of a sum
    over the stages, partial over the stage axis as a param's gradient is, and summed with the
    other stages' after the micro-batches, as the unfused ``layer_norm(y) * g``'s separate sum is."""
    ax = cut.spec.axis
    split = [any(ax in axes for axes in cut.values[v].sharding.split.values()) for v in outs]
    return any(split) and all(s or ax in cut.values[v].sharding.partial for v, s in zip(outs, split))


def _downstream(cut: _Cut, values) -> set[int]:
    """The positions of the steps that read ``values``, directly or through other steps."""
    seen, live = set(), set(values)
    for i, s in enumerate(cut.steps):
        if any(v in live for v in s.ins):
            seen.add(i)
            live.update(s.outs)
    return seen


def _whole_batch_cause(steps, producer, final, i):
    """The collective over the micro-batch axis that put step ``i`` in the final segment, or
    None when the step is there for another reason (it runs on several stages)."""
    while not (steps[i].is_collective and MB_AXIS in steps[i].axes):
        i = next((producer[v] for v in steps[i].ins if producer.get(v) in final), None)
        if i is None:
            return None
    return steps[i]


def _check_what_feeds_the_layers(cut: _Cut, final: set) -> None:
    """Refuse a pipelined repeat that reads a value made after the micro-batches."""
    steps, producer, spec = cut.steps, cut.producer, cut.spec
    for blk in sorted(cut.stack_at, key=lambda i: i == cut.stack_at[i].B):   # forwards first
        for v in steps[blk].ins:
            if producer.get(v) not in final:
                continue
            c = _whole_batch_cause(steps, producer, final, producer[v])
            if c is None:
                _check_per_layer_outputs(cut, producer[v])
                _check_stacked_input_grads(cut, final, producer[v], blk)
                _check_towers_meet(cut, _final_behind(cut, final, producer[v]))
                u = steps[producer[v]]
                raise _error(f"{step_called(u)} is read by the pipelined repeat, but runs after the "
                             "micro-batches.", spec, [f"{step_called(u)} runs on stages {sorted(cut.stages[producer[v]])}"],
                             "what feeds the pipelined layers runs one micro-batch at a time, on one stage",
                             "compute it from the batch before the stack, or from params and tables only")
            src = steps[producer[c.ins[0]]] if c.ins[0] in producer else c
            joins, frozen_fix = _why_not_made_once(cut, c)
            if blk == cut.stack_at[blk].F:
                raise _error(f"{step_called(src)} reduces over the whole batch, and {step_called(c)} reads "
                             "the result before the pipelined repeat.", spec, joins,
                             "what feeds or follows the pipelined layers runs one micro-batch at a time; a "
                             f"whole-batch statistic {_FIXED} is made once, before them",
                             frozen_fix or "make the statistic from the inputs only, keep ops that reduce over "
                             "the batch after the loss, or use microbatches=1")
            raise _error(f"{step_called(src)} reduces over the whole batch, and {step_called(c)} after the "
                         "pipelined repeat reads the result: the gradient the pipelined backward starts "
                         "from depends on it.", spec,
                         [*joins, f"{step_called(steps[producer[v]])} is read by the "
                                  "pipelined backward, which runs one micro-batch at a time"],
                         "the loss's gradient at each micro-batch may depend on its own micro-batch, on "
                         "values the same for every micro-batch, and on whole-batch statistics "
                         f"{_FIXED} (a count of masked tokens: made once, before the micro-batches)",
                         frozen_fix or "divide by a whole-batch value made from the inputs only (or fed as an "
                         "input without the batch dim, md.input('count', [])), normalise per micro-batch, "
                         "or use microbatches=1")


_FIXED = "of the inputs and of params outside the pipelined stacks"


def _why_not_made_once(cut: _Cut, c) -> tuple[list[str], str | None]:
    """Bullets saying why the join ``c`` (a collective over the micro-batch axis) was not made once
    before the micro-batches (:mod:`.batch_stats`), and a fix where one works: a pipelined stack
    nothing is differentiated through (a frozen teacher) makes what it sums."""
    steps, producer = cut.steps, cut.producer
    over = ", ".join("micro-batches" if a == MB_AXIS else a for a in c.axes)
    out = [f"{c.kind} over {over} for {step_called(c)} joins the micro-batches"]
    k = first_behind(steps, producer, c.ins[0], lambda j: j in cut.stack_at)
    if k is not None:
        st = cut.stack_at[k]
        layer = cut.spec.stacks[cut.stacks.index(st)][1] if cut.spec.stacks else cut.spec.layer
        p = param_behind(steps, producer, c.ins[0])
        out.append("what it sums is made" + (f" from param '{p}'" if p else "") + f" through the pipelined repeat "
                   f"over '{layer}', which runs one micro-batch at a time, so it needs every micro-batch's forward")
        if st.B is None and len(cut.stacks) > 1:   # no gradient through it: unpipelined, it is made once
            rest = "; ".join(str(r) for r in cut.spec.given[1].rules if r.key != (None, layer))
            return out, (f"leave '{layer}' out of the layout ('{rest}'): not pipelined, a stack nothing is "
                         "differentiated through runs once, before the micro-batches, and the statistic with it")
        return out, None
    if c.phase != "forward":
        out.append("it sums a gradient over the batch, known only after every micro-batch's backward")
        return out, None
    p = param_behind(steps, producer, c.ins[0])
    out += [f"what it sums is made from param '{p}', so it needs every micro-batch's forward"] if p else []
    return out, None


def _final_behind(cut: _Cut, final: set, i: int) -> set[int]:
    """Step ``i`` and the steps of ``final`` it reads, directly or through other steps of ``final``."""
    out, todo = set(), [i]
    while todo:
        j = todo.pop()
        if j in out or j not in final:
            continue
        out.add(j)
        todo += [cut.producer[v] for v in cut.steps[j].ins if v in cut.producer]
    return out


def _check_stacked_input_grads(cut: _Cut, final: set, i: int, blk: int) -> None:
    """Refuse, saying why, a value a stack's backward (step ``blk``) reads that is made after the
    micro-batches (by step ``i``) from another stack's stacked gradient of an input made before it
    (a cross-attention cache: every decoder layer's keys and values from the encoder's output).
    Each stage's part of such a gradient is summed down the stages per micro-batch when it is made from
    the stacked gradient alone (:func:`_stacked_input_sums`); here it also adds other terms (the output
    read after the later stack too, or its first carry made from it), a share of each on every stage."""
    behind = _final_behind(cut, final, i)
    for k, st in enumerate(cut.stacks):
        if st.B is None or cut.stack_at[blk] is st:
            continue
        F, B = cut.steps[st.F], cut.steps[st.B]
        grads = dict(zip(B.outs[st.nc:st.nc + len(F.args["names"])], F.args["names"]))
        read = sorted({grads[v] for j in behind for v in cut.steps[j].ins if v in grads})
        if not read:
            continue
        layer, u = cut.spec.stacks[k][1], cut.steps[i]
        other = cut.spec.stacks[cut.stacks.index(cut.stack_at[blk])][1]
        raise _error(f"the backward of stack '{other}' reads its output's gradient ({u.kind} '{u.label}'), made "
                     f"after the micro-batches from the stacked gradient of {read} of stack '{layer}' and other "
                     "terms.", cut.spec,
                     [f"'{x}' is made before stack '{layer}' with its layer dim (a cross-attention cache)"
                      for x in read] + [f"the output of stack '{other}' is also read otherwise (after stack "
                                        f"'{layer}', or by its first carry): its gradient adds those terms"],
                     "what a pipelined backward reads is made one micro-batch at a time, on one stage; the "
                     "gradient of a tensor made with a later stack's layer dim is summed down that stack's "
                     "stages per micro-batch only when made from the stacked gradient alone (times params)",
                     f"read the output of '{other}' only through the tensor made with '{layer}' (the cache), "
                     f"pipeline one stack only (leave '{other}' out of the layout), or make the tensor in the "
                     f"block of '{layer}' (each layer its own keys and values from what it reads)")


def _check_towers_meet(cut: _Cut, final: set) -> None:
    """Refuse, saying why, a step joining two pipelined stacks' outputs that runs after the
    micro-batches (on both stacks' last stages: it also reads a value held on several stages or made
    after the micro-batches) when the pipelined backward reads its result.  Two towers joined per
    micro-batch run (:func:`_tower_lifts`)."""
    layers = [layer for _, layer, _ in getattr(cut.spec, "stacks", ())]
    ends = {st.hi: layers[k] if k < len(layers) else cut.steps[st.F].label for k, st in enumerate(cut.stacks)}
    for i in sorted(final):
        s = cut.steps[i]
        held = [cut.held.get(v) for v in s.ins]
        meet = sorted({min(h) for h in held if h is not None and len(h) == 1 and min(h) in ends})
        if len(meet) < 2:
            continue
        raise _error(f"{step_called(s)} reads the outputs of {len(meet)} pipelined stacks, each made on "
                     "its own last stage.", cut.spec,
                     [f"stack '{ends[e]}' ends on stage {e}" for e in meet]
                     + [f"'{s.op}' would run on stages {meet}, after the micro-batches"],
                     "stacks sharing a stage axis join their outputs one micro-batch at a time, on the later "
                     "stack's last stage (the earlier one's output sent up to it), from values of that "
                     "micro-batch alone",
                     "join the towers' outputs per micro-batch (each row's own terms), or pipeline one tower "
                     "only (leave the other's layer dim out of the layout: it runs whole on a stage)")


def _check_per_layer_outputs(cut: _Cut, i: int) -> None:
    """Refuse, saying why, a value the pipelined backward reads (made by step ``i`` after the
    micro-batches) that the loss made from the repeat's per-layer outputs across layers."""
    F = cut.steps[cut.F]
    names, nc = F.args.get("ys", ()), num_carries(F)
    ys = dict(zip(F.outs[2 * nc:2 * nc + len(names)], names))
    seen, todo, read, joins = set(), [i], [], None
    while todo:
        j = todo.pop()
        if j in seen:
            continue
        seen.add(j)
        s = cut.steps[j]
        if s.is_collective and cut.spec.axis in s.axes and joins is None:
            joins = s
        read += [ys[v] for v in s.ins if v in ys]
        todo += [cut.producer[v] for v in s.ins if v in cut.producer and cut.producer[v] != cut.F]
    if not read:
        return
    how = (f"{joins.kind} over {joins.axes} for {step_called(joins)} joins the layers of every stage"
           if joins is not None else f"{step_called(cut.steps[i])} reads them on every stage")
    raise _error(f"the loss reads the pipelined repeat's per-layer outputs {sorted(set(read))} across layers: "
                 f"their gradient, which the pipelined backward reads, needs the layers of every stage of a "
                 f"micro-batch at once.", cut.spec, [how],
                 "in a pipeline a loss reads a repeat's per-layer outputs layer by layer: a sum over the layer "
                 "dim of any elementwise function of them (reduce_sum(y), reduce_sum(y * y), reduce_sum(exp(y))), "
                 "which each stage differentiates on its own layers",
                 "write the term as a sum over layers of a per-layer function (computed in the block, or "
                 "after it), carry what spans layers (a running total) in the repeat's carry, or do not "
                 "pipeline this repeat (a layout without its layer dim on the stage axis)")


def insert_transfers(cut: _Cut) -> dict:
    """Pass 3: per segment, the ``(step, stages)`` list with a ``send``/``recv`` pair for each
    value read on a stage that does not hold it, the carry's transfers around the pipelined
    repeat's steps, and the chained stage sums expanded into transfers and adds."""
    lists: dict = {k: [] for k in Segment}
    tag, moved = max(carry_tags(max(st.nc for st in cut.stacks) - 1)), set()
    for i, s in enumerate(cut.steps):
        if cut.leaf[i]:
            continue
        before, tag = _moves_into(cut, i, lists, moved, tag) if i not in cut.stage_terms else ([], tag)
        seg = lists[cut.segment[i]]
        seg.extend(before)
        if i in cut.stage_terms:
            seg.extend(per_stage_steps(s, cut.stage_terms[i], cut.stages[i], cut.values, cut.spec.axis,
                                       cut.spec.mesh))
        elif i in cut.sums:
            st = cut.sum_of[i][0]
            moves, tag = expand_stage_sum(s, cut.values, cut.spec.mesh, cut.spec.axis, (st.lo, st.hi), tag,
                                          cut.sum_to[i])
            seg.extend(moves)
        elif i in cut.stack_at:
            seg.extend(_carried(cut, i))
            st = cut.stack_at[i]
            if st.on_some(cut.num_stages):
                # their empty or zero parts on the other stages, made in their F or B actions (where
                # the micro-batches' sums are taken, as on the stages that run its layers)
                seg.extend((zeros_step(v, cut.values, s.phase, dim), frozenset({t}))
                           for t in sorted(cut.every_stage - st.stages) for v, dim in _everywhere(cut, st, i))
        else:
            seg.append((s, cut.stages[i]))
        for v in s.outs:
            cut.held[v] = cut.held.get(v, cut.stages[i])
        for v, t in moved:
            cut.held[v] = cut.held[v] | {t}
    return lists


def _moves_into(cut: _Cut, i: int, lists: dict, moved: set, tag: int) -> tuple[list, int]:
    """The transfers step ``i`` needs of values held elsewhere: the sends go after their
    producer (in its segment, or just before the reader in the final one), the receives
    (returned) right before it.  Returns them and the last tag used."""
    s, spec, values = cut.steps[i], cut.spec, cut.values
    before = []
    for j, v in enumerate(s.ins):
        # a stack's carry (gradient) comes from the stage before (after) it, but its first (last)
        # stage reads it where it was made: a chained stack's first carry, made on the earlier
        # stack's last stage, goes up to it, and the earlier stack's output gradient comes down
        need = cut.stages[i]
        if cut.is_carry_in(i, j):
            st = cut.stack_at[i]
            need = frozenset({st.lo if i == st.F else st.hi})
        for t in sorted(need - cut.held.get(v, cut.every_stage)):
            if (v, t) in moved:
                continue
            moved.add((v, t))
            if spec.stacks and spec.axis in values[v].sharding.partial:
                # a stage's part of a sum over the stages (a gradient's square norm) where it holds
                # none of the stack that makes it: zero, not a copy of another stage's part
                before.append((zeros_step(v, values, s.phase), frozenset({t})))
                continue
            src = min(cut.held[v], key=lambda h: abs(h - t))
            pj = cut.producer[v]
            if not _may_move(cut.segment[pj], cut.segment[i], src, t):
                raise _error(f"'{s.op}' on stage {t} reads '{cut.steps[pj].op}' of stage {src} in the same pass.",
                             spec, [f"{cut.steps[pj].label} -> {s.label}"],
                             "within a micro-batch, values move forward with the carry and back with its "
                             "gradient", "restructure the model so each stage reads its own values")
            tag += 1
            what = f"{cut.steps[pj].label} to stage {t}"
            snd = (transfer_step("send", v, values, spec.mesh, spec.axis, t - src, tag, s.phase, what),
                   frozenset({src}))
            rcv = (transfer_step("recv", v, values, spec.mesh, spec.axis, t - src, tag, s.phase, what),
                   frozenset({t}))
            if cut.segment[i] == Segment.FINAL:
                before += [snd, rcv]
            else:
                lists[cut.segment[pj]].append(snd)  # after its producer (already placed), in its segment
                before.append(rcv)
    return before, tag


def _carried(cut: _Cut, i: int) -> list:
    """The pipelined repeat's step ``i`` (forward or backward) between the receive of its carry
    from the stage before it (after it, for the backward) and the send of its result on."""
    s, spec, st = cut.steps[i], cut.spec, cut.stack_at[i]
    fwd = i == st.F
    at, off = (0, 1) if fwd else (st.dy_pos, -1)
    # the stack's stages with a next one / a previous one
    first, last = frozenset(range(st.lo, st.hi)), frozenset(range(st.lo + 1, st.hi + 1))

    def moves(kind: str, v: int, c: int):
        # a tuple carry: one transfer per carried tensor (each its own shape and layout), each its own tag
        what = "carry" if st.nc == 1 else f"carry {c}"
        return (transfer_step(kind, v, cut.values, spec.mesh, spec.axis, off, carry_tags(c)[not fwd], s.phase, what),
                (last if fwd else first) if kind == "recv" else (first if fwd else last))
    out = [*(moves("recv", s.ins[at + c], c) for c in range(st.nc)), (s, st.stages),
           *(moves("send", s.outs[c], c) for c in range(st.nc))]
    return [(x, where) for x, where in out if where]   # a stack on one stage passes no carry


def partition(steps, values, outputs: dict[str, int], spec, bucket_mb: float = 0.0):
    """Cut ``steps`` into a ``pipeline`` step; returns (top-level steps, holders).

    The final segment's gradient allreduces are packed into buckets of about ``bucket_mb``
    MB (:func:`~.bucket.bucket_final`; 0: one per gradient).

    ``holders`` maps each param, input and output value id to the mesh ranks that
    hold it (the ranks of the stages reading or producing it).
    """
    chunks = spec.schedule.num_chunks if spec.stacks else 1
    # several stacks on virtual stages: cut on p * v logical stages, then put on the ranks (.stacks_on_ranks)
    cut = _cut(steps, values, outputs, dataclasses.replace(spec, num_stages=spec.num_stages * chunks)
               if chunks > 1 else spec)
    assign_stages(cut)
    update_where_held(cut)
    _check_stage_collectives(cut)
    assign_segments(cut)
    _check_exchanges_in_actions(cut)
    lists = insert_transfers(cut)
    lowered = {v: val.local_bytes(spec.mesh) for v, val in cut.values.items()}   # before the stage storage
    if spec.stacks:
        lists = split_stacks(cut, lists)
        if chunks > 1:
            lists = on_ranks(cut, lists, spec.num_stages)
    elif spec.schedule.num_chunks > 1:
        lists = interleave(cut, lists, spec.schedule.num_chunks)
    elif spec.stage_layers:
        lists = split_stages(cut, lists, spec.stage_layers)
    lists = with_given_parts(lists, cut.values)   # unequal stages: each rank's local steps over its own layers
    lists = with_given_lengths(lists, cut.values, spec.mesh)   # and its collectives over its own parts
    lists = with_stored_bytes(lists, cut.values, lowered, spec.mesh)
    lists[Segment.FINAL] = sum_microbatches_first(lists, Segment.FINAL, cut.values, spec.mesh, outputs,
                                                  spec.num_stages)
    in_actions = {v for k in (Segment.FORWARD, Segment.BACKWARD) for s, _ in lists[k] for v in s.outs}
    lists[Segment.FINAL] = bucket_final(lists[Segment.FINAL], values, outputs, bucket_mb, in_actions)
    leaves = [s for i, s in enumerate(cut.steps) if cut.leaf[i]]
    return leaves + [_pipeline_step(cut, lists, spec)], _holders(cut, leaves)


def _holders(cut: _Cut, leaves) -> dict:
    """Each param's, input's and output's mesh ranks: those of the stages holding it; a param of a
    stack on some of the stages is held on every stage (empty outside its run), as its gradient
    and updates are (:func:`assign_stages`), so that gathers and checkpoints run over the whole axis."""
    mesh, ax = cut.spec.mesh, cut.spec.axis
    some = {layer for (_, layer, _), st in zip(cut.spec.stacks, cut.stacks) if st.on_some(cut.num_stages)}
    out = {}
    for v in [v for s in leaves for v in s.outs] + list(cut.outputs.values()):
        st = cut.held.get(v, cut.demand.get(v, cut.every_stage))
        if some and any(cut.values[v].sharding.axes_of(d) == (ax,) for d in some):
            st = cut.every_stage
        ranks = {t % mesh.sizes[ax] for t in st}   # (virtual stages: stage t on rank t % p)
        out[v] = tuple(r for r in range(mesh.size) if mesh.coords(r)[ax] in ranks)
    return out


def pipeline_step(kind: str, label: str, lists: dict, spec, schedule, ins, outs, values, loops=frozenset(),
                  num_carried: int = 1) -> Step:
    """The ``pipeline`` (or ``accumulate``) step running the segment lists ``lists`` (segment ->
    ``(step, stages)`` pairs) by ``schedule``, with its :class:`~.pipeline_program.PipelineProgram`;
    ``loops``: the ids of the stacks' loop steps when several stacks share the stage axis;
    ``num_carried``: the most tensors a stack carries (a tuple carry's, each with its own tags)."""
    m, p = spec.num_microbatches, spec.num_stages
    mb_axis = MB_AXIS if m > 1 else None
    subplans = tuple(Plan(spec.mesh, spec.layout, [s for s, _ in lists[k]], values, {}) for k in Segment)
    stages = tuple(tuple(tuple(sorted(st)) for _, st in lists[k]) for k in Segment)
    stack_loops = frozenset((k, j) for k in Segment for j, (s, _) in enumerate(lists[k]) if id(s) in loops)
    program = PipelineProgram(spec.axis, p, m, mb_axis, schedule, subplans, stages,
                              tuple(t for c in range(num_carried) for t in carry_tags(c)), tuple(outs),
                              stack_loops)
    return Step(kind, -1, kind, label, "forward", tuple(ins), tuple(outs), (spec.axis,) if spec.axis else (),
                step_args(kind, {"axis": spec.axis, "num_stages": p, "microbatches": m, "mb_axis": mb_axis,
                                 "program": program}),
                subplans=subplans, sub_times=(1, m, m, 1), one_microbatch=(False, True, True, False))


def _pipeline_step(cut: _Cut, lists: dict, spec) -> Step:
    leaves = [s for i, s in enumerate(cut.steps) if cut.leaf[i]]
    made = {v for i, s in enumerate(cut.steps) if not cut.leaf[i] for v in s.outs}
    loops = {id(s) for k in (Segment.FORWARD, Segment.BACKWARD) for s, _ in lists[k]
             if s.kind == "repeat" and s.node in {cut.steps[i].node for i in cut.stack_at}} if cut.spec.stacks else ()
    return pipeline_step("pipeline", _label(spec.axis, spec.schedule), lists, spec, spec.schedule,
                         [v for s in leaves for v in s.outs], sorted(set(cut.outputs.values()) & made), cut.values,
                         frozenset(loops), max(st.nc for st in cut.stacks))


def program_of(step: Step) -> PipelineProgram:
    """The :class:`~.pipeline_program.PipelineProgram` a ``pipeline`` or ``accumulate`` step runs."""
    return step.args["program"]


def with_schedule(plan: Plan, schedule: str) -> Plan:
    """``plan`` with its pipeline run by ``schedule`` instead of the one it was compiled with, which
    runs as many stages per rank (``1f1b`` for ``gpipe``, ``interleaved-zb:2`` for ``interleaved:2``).

    The schedule is the only part of a compiled pipeline that depends on it (the segments, the
    stages and the transfers do not), so this equals compiling again with ``schedule``; the
    layout search uses it to compile a pipelined layout once for all the schedules it prices.
    A plan without a pipeline comes back as it is.

    Raises:
      ScheduleError: what :func:`.schedule_gen.make_schedule` raises for ``schedule``.
      ValueError: ``schedule`` runs another number of stages per rank than the plan (the chunks
        are cut at compilation: it needs its own).
    """
    chunks = parse_schedule(schedule)[1]
    steps = []
    for s in plan.steps:
        if s.kind == "pipeline":
            if program_of(s).schedule.num_chunks != chunks:
                raise ValueError(f"with_schedule: the plan's pipeline runs {program_of(s).schedule.num_chunks} "
                                 f"stage(s) per rank, '{schedule}' {chunks}; compile for it")
            sched = named_schedule(schedule, s.args["num_stages"], s.args["microbatches"])
            program = program_of(s).with_schedule(sched)
            s = dataclasses.replace(s, label=_label(s.args["axis"], sched),
                                    args=step_args("pipeline", {**s.args, "program": program}))
        steps.append(s)
    return dataclasses.replace(plan, steps=tuple(steps))


def _label(axis: str, schedule) -> str:
    """The pipeline step's label: its axis and schedule."""
    return f"pipeline over '{axis}' ({user_name(schedule)})"
