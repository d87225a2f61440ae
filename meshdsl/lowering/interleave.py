"""Virtual stages: a pipeline whose ranks each run several chunks of the layers (interleaved 1F1B).

With ``schedule="interleaved:v"`` a pipeline axis of size p runs ``p * v`` logical stages:
the layers are cut into ``p * v`` chunks of ``k = layers / (p * v)``, and rank r runs chunks
r, r + p, r + 2p, ... (logical stage ``s`` on rank ``s % p``), in the order of Megatron's
interleaved 1F1B (:func:`~.schedule_gen.interleaved_1f1b`), which cuts the bubble from
(p-1)/(m+p-1) to (p-1)/(vm+p-1).

:mod:`.partition` cuts the plan as for one stage per rank; :func:`interleave` then turns that
cut into ``v`` chunks, as a pass on the segment lists:

* the pipelined repeat's forward and backward steps become one step per chunk, each over
  ``k`` layers, with values of their own for the carry between chunks and for what a chunk's
  forward keeps for its backward (so two chunks of one rank never share a buffer);
* the carry travels from stage s to s + 1 (rank r to r + 1, or from the last rank back to
  the first between chunks) and its gradient back;
* what feeds the layers runs on stage 0 and what follows them on the last stage ``p v - 1``
  (both on the ranks they ran on before);
* every value whose layer dim the stage axis splits (the stacked params, their gradients
  and optimizer state) is stored where its chunks run: its sharding splits the layer dim
  block-cyclically (``Sharding.cyclic``), so rank r's local layers are its chunks r, r + p,
  .. one after another, as Megatron stores them.  Init, gathers and checkpoints read the
  sharding, so they stay in the global layer order; no param or gradient moves between
  ranks: chunk c of a rank reads its local layers ``c k ..``, and each chunk's gradient,
  summed over the micro-batches and the data axes, is joined into the rank's local stack;
* tables every layer reads (rotary embeddings' sines and cosines) are read by every chunk, and so
  is a tensor made per micro-batch before the layers (an encoder's output): it reaches each
  rank's first chunk as it reached its stage, and the later chunks of the rank read it there;
  each chunk's backward makes its own part of its gradient, and each rank adds its chunks'
  after its first chunk's backward (the micro-batch's last there), before the stage sums
  travel down the stages as without virtual stages;
* a value made per micro-batch before the layers and read after them (a skip around the stack,
  a loss term made from its input, as a VAE's KL term) is sent, as without virtual stages, from
  stage 0 (rank 0's first chunk) to rank p - 1, whose first chunk receives it; what reads it there
  runs on its last chunk (the last logical stage) when it reads the layers' output too, else on
  receipt.  The carry makes that receive wait no longer than rank p - 1's first chunk does, so the
  schedule's order holds.  Its gradient's term from what read it after the layers (the head's, made
  in the forward on the last logical stage) is sent down by that forward (rank p - 1's last chunk)
  and received by stage 0's backward of the same micro-batch, where it meets the layers' input
  gradient, as under 1f1b: a side encoder read by the layers and the head runs its backward there,
  per micro-batch (:func:`.partition._meet`);
* per-layer outputs (``(carry, {name: tensor})``): each chunk makes its layers', joined on its
  rank (its chunks one after another) in the rank's last chunk, where the loss's terms of
  them run (at the rank's own layer count when the chunks are unequal, :mod:`.local_parts`);
  each chunk's backward reads its layers of their cotangent;
* a stacked input made per micro-batch before the layers (every layer's cross-attention keys and
  values from one einsum, made on the rank's first chunk) is narrowed to each chunk's layers in
  that chunk's forward; a stacked gradient read after the micro-batches other than by their sum
  (that einsum's backward, a broadcast copy's sum over the layers) or returned is joined from the
  rank's chunks first.

With ``stage_layers`` (``p * v`` counts, one per virtual stage in layer order) the chunks are
unequal: virtual stage s runs ``n_s`` layers, so chunk c's step becomes one step per rank
(``n_{c p + r}`` layers on stage ``c p + r``), each rank's chunk of a stacked param is its own
slice of its local layers, and the stored blocks have the given lengths (``Sharding.blocks``).

Refused, with the reason (:func:`check`): the layers' stacked inputs or saved activations read
outside the repeat, other steps run per micro-batch on several stages, a value a chunk would read
before its rank holds it or that moves against the schedule's order (:func:`_out_of_order`), and a
stacked gradient read per micro-batch, before the micro-batches are summed.
"""
from __future__ import annotations

import dataclasses

import torch

from ..core.shape import Dim, Shape
from ..errors import LayoutError, message
from ..layout.sharding import block_lengths
from .cyclic_moves import in_global_order
from .pipeline_program import PER_MICROBATCH, Segment, carry_tags, num_carries, transfer_step
from .schedule_gen import user_name
from .plan import Step, Value, step_args, step_called


def _narrow(ctx, attrs, x):
    """One chunk of a stacked tensor's local layers."""
    return x.narrow(attrs["dim"], attrs["start"], attrs["length"])


def _add(ctx, attrs, *parts):
    """The sum of a tensor's parts made by a rank's chunks."""
    out = parts[0]
    for x in parts[1:]:
        out = out + x
    return out


def _join(ctx, attrs, *parts):
    """A rank's chunks of a stacked tensor, one after another (its local order)."""
    return torch.cat(parts, attrs["dim"])


class _Chunks:
    """New values and steps for one interleaving: chunk values have the layer dim cut by ``v``."""

    def __init__(self, cut, v: int):
        self.cut, self.v, self.p = cut, v, cut.num_stages
        self.values, self.layer, self.spec = cut.values, cut.spec.layer, cut.spec
        #: each virtual stage's layers when given (unequal chunks), else ()
        self.counts = tuple(cut.spec.stage_layers)
        #: the tensors the pipelined repeat carries (a tuple carry's k)
        self.nc = num_carries(cut.steps[cut.F])

    def layers(self, c: int) -> list[int]:
        """Layers of chunk ``c`` on each rank (virtual stages ``c p .. c p + p - 1``)."""
        k = self.cut.steps[self.cut.F].times // self.v
        return [self.counts[c * self.p + r] if self.counts else k for r in range(self.p)]

    def like(self, vid: int, chunk: int | None = None) -> int:
        """A new value like ``vid``; with a ``chunk``, its layer dim holds that chunk's layers."""
        old = self.values[vid]
        size = sum(self.layers(chunk)) if chunk is not None else 0
        shape = Shape(Dim(d.name, size) if d.name == self.layer and chunk is not None else d for d in old.shape)
        sharding = old.sharding   # one chunk of the stack: each rank holds its one block
        if self.layer in sharding.cyclic_blocks:
            given = self.layers(chunk) if self.counts and chunk is not None else None
            sharding = sharding.with_cyclic(self.layer, 1, given)
        new = max(self.values) + 1
        self.values[new] = Value(new, shape, old.dtype, sharding)
        return new

    def local(self, op: str, fn, ins, out: int, attrs: dict, stages, label: str, phase: str = "forward"):
        v = self.values[out]
        args = step_args("local", {"fn": fn, "attrs": attrs, "compute": v.sharding.split,
                                   "sizes": {d.name: d.size for d in v.shape}})
        return Step("local", -1, op, label, phase, tuple(ins), (out,), (), args), frozenset(stages)

    def stacked_dim(self, vid: int) -> int:
        return self.values[vid].shape.names.index(self.layer)


def check(cut, lists, v: int) -> None:
    """Refuse what the interleaving pass cannot cut into chunks, with the reason.  A value made per
    micro-batch before the layers and read after them (a skip around the stack, a loss term made
    from its input) moves from the first stage to the last as it does without virtual stages;
    :func:`_out_of_order` checks the chunks' order of such moves."""
    why = _unsupported(cut, lists)
    if why is not None:
        raise _refusal(cut, v, why)


def _refusal(cut, v: int, why: str) -> LayoutError:
    spec = cut.spec
    return LayoutError(message(
        f"compile (pipeline over '{spec.axis}', {v} virtual stages per rank): {why}.",
        inputs=[f"mesh: {spec.given[0]}", f"layout: {spec.given[1]}", f"schedule: {user_name(spec.schedule)}",
                *([f"stage layers: {','.join(map(str, spec.stage_layers))}"] if spec.stage_layers else [])],
        rule="virtual stages cut the pipelined layers into chunks that pass only the carry, what the block "
             "reads from outside, and values made before the layers for after them between stages",
        fix="use one stage per rank (--schedule 1f1b or zbh1)"))


def _out_of_order(ch: _Chunks, lists: dict) -> str | None:
    """Why the chunked per-micro-batch segments ``lists`` would read a value on a rank before the
    rank holds it, or move one against the schedule's order, or None.

    A rank runs a micro-batch's actions in the order F of its chunks 0 .. v-1, then B of chunks
    v-1 .. 0, and the schedule orders F of logical stage s before F of s + 1 (B the other way).
    So a value made (or received) in one action of a rank is read there in the same or a later
    action, and a transfer goes up the stages in the forward and down them in the backward: a
    value made before the layers and read after them is sent by logical stage 0 and received by
    rank p - 1's first chunk, where its last chunk reads it; its gradient goes back down in the
    backward, as without virtual stages.  A forward may also send down what a backward receives
    (the head's term of a side encoder's output gradient, from the last logical stage to stage 0):
    every B of a micro-batch follows all its Fs, whichever the stages."""
    p, v = ch.p, ch.v
    when = {Segment.FORWARD: lambda t: t // p, Segment.BACKWARD: lambda t: 2 * v - 1 - t // p}
    made: dict = {}   # (value, rank) -> the rank's first action making it
    for seg in PER_MICROBATCH:
        for s, st in lists[seg]:
            for t in st:
                for x in s.outs:
                    made[(x, t % p)] = min(made.get((x, t % p), 2 * v), when[seg](t))
    # (a transfer the forward sends and the backward receives: every B of a micro-batch follows all its Fs)
    to_backward = {s.args["tag"] for s, _ in lists[Segment.BACKWARD] if s.kind == "recv" and not _is_carry(s, ch.nc)}
    for seg in PER_MICROBATCH:
        up = 1 if seg == Segment.FORWARD else -1
        for s, st in lists[seg]:
            if (s.kind in ("send", "recv") and not _is_carry(s, ch.nc) and s.args["offset"] * up < 0
                    and not (s.kind == "send" and seg == Segment.FORWARD and s.args["tag"] in to_backward)):
                return f"{step_called(s)} moves a value {'down' if up > 0 else 'up'} the stages in the {seg.name.lower()}"
            late = [x for t in st for x in s.ins if made.get((x, t % p), -1) > when[seg](t)]
            if late:
                return f"{step_called(s)} reads a value that its rank makes in a later chunk"
    return None


def _unsupported(cut, lists, chunked: bool = True) -> str | None:
    """Why the cut's pipelined layers (of each pipelined stack) cannot be cut into chunks, or None;
    with ``chunked`` False (unequal stages, several stacks on one stage per rank), why they cannot be
    cut into per-stage steps: each stage's step then writes its own layers of a whole stacked
    gradient, which any step may read.
    A per-micro-batch value may move between stages besides the carry (what runs between chained
    stacks, a value made before the layers and read after them): :func:`_out_of_order` checks that
    no chunk reads one before its rank holds it."""
    blocks = [(cut.steps[st.F], cut.steps[st.B] if st.B is not None else None) for st in cut.stacks]
    own = [x for pair in blocks for x in pair if x is not None]
    own_parts = {id(cut.steps[i]) for i in cut.spread}   # each rank's part of the per-layer outputs' terms
    # what a block reads from outside travels up the first chunks' stages, and its gradient's
    # stage sums back down them (:func:`_closed_transfer`)
    closed, after_b = set(), set()
    for F, B in blocks:
        n, nc = len(F.args["names"]), num_carries(F)
        closed |= set(F.ins[nc + n:])
        after_b |= _made_from(lists[Segment.BACKWARD], B.outs[nc + n:]) if B is not None else set()
    most = max(num_carries(F) for F, _ in blocks)
    per_mb = [s for seg in (Segment.FORWARD, Segment.BACKWARD) for s, st in lists[seg]
              if s not in own and not _is_carry(s, most) and id(s) not in own_parts
              and len(st) > 1
              and not _closed_transfer(s, seg, closed, after_b)]
    if per_mb:
        s = per_mb[0]
        if s.kind in ("send", "recv"):   # what the user wrote: a value made before the layers, read after
            v = (s.ins or s.outs)[0]
            made = next((t.label for pairs in lists.values() for t, _ in pairs
                         if v in t.outs and t.kind not in ("send", "recv")), s.label)
            return (f"'{made}', made per micro-batch before the pipelined layers, is read after them (a skip "
                    "around the stack, or a loss term made from its input)")
        return f"{step_called(s)} runs on several stages or moves between them besides the carry"
    for F, B in blocks:
        why = _unsupported_block(cut, lists, F, B, chunked)
        if why is not None:
            return why
    return None


def _unsupported_block(cut, lists, F: Step, B: Step | None, chunked: bool) -> str | None:
    """Why one pipelined repeat's layers (forward ``F``, backward ``B``) cannot be cut into chunks
    (``chunked``; else run on unequal stages or beside other stacks), or None."""
    n, nc = len(F.args["names"]), num_carries(F)
    ys, dys = _per_layer_outputs(F, B, n)
    readers = [s for pairs in lists.values() for s, _ in pairs
               if s is not B and (set(F.outs[nc:]) - set(ys)) & set(s.ins)]
    known = set(F.outs[nc:]) | set(F.ins[nc:]) | (set(B.ins[nc:2 * nc + n]) | set(dys) if B is not None else set())
    if readers or (B is not None and not set(B.ins) <= known):
        return "its layers' stacked inputs or saved activations are read outside the repeat"
    # read after the micro-batches (an output, a cross-attention cache's einsum's backward, a broadcast
    # copy's sum over the layers), a gradient is joined from its chunks first (:func:`_gather_grads`)
    grads = dict(zip(B.outs[nc:nc + n], F.args["names"])) if B is not None else {}
    # (several stacks: a stage's own-part step, run by each chunk on its layers, :mod:`.stacks_on_ranks`)
    own = {id(cut.steps[i]) for i in cut.spread} if cut.spec.stacks else set()
    for seg in (Segment.FORWARD, Segment.BACKWARD) if chunked else ():
        for s, _ in lists[seg]:
            read = [grads[v] for v in s.ins if v in grads and id(s) not in own]
            if read:
                return (f"the stacked gradient of '{read[0]}' is read by {step_called(s)} per micro-batch, before "
                        "the micro-batches are summed")
    return None


def _made_from(pairs, values) -> set:
    """The values the steps of ``pairs`` make from ``values``, directly or not (``values`` too),
    those received where a step sends one, and those added to them (a stage sum's received part)."""
    live, tags = set(values), set()
    for s, _ in pairs:
        if live & set(s.ins) or (s.kind == "recv" and s.args["tag"] in tags):   # a received one too
            live.update(s.outs)
            if s.kind == "send":
                tags.add(s.args["tag"])
    return live | {x for s, _ in pairs if s.op == "add" and live & set(s.ins) for x in s.ins}


def _closed_transfer(s: Step, seg: Segment, closed: set, after_b: set) -> bool:
    """Whether ``s`` moves, between the ranks' first chunks, a tensor the block reads from outside
    (forward: an encoder's output made per micro-batch, sent up the stages with the carry) or
    the stage sum of its gradient (backward: each rank's sum over its chunks, sent back down)."""
    moved = set(s.ins) | set(s.outs)
    if seg == Segment.FORWARD:
        return s.kind in ("send", "recv") and bool(moved & closed)
    return (s.kind in ("send", "recv") or s.op == "add") and bool(moved & after_b)


def _per_layer_outputs(F: Step, B: Step | None, n: int) -> tuple[tuple, tuple]:
    """The pipelined repeat's per-layer outputs (``F``'s outputs after the stacked layer inputs)
    and their stacked gradients ``B`` reads (its inputs after the carry's gradients)."""
    k, nc = len(F.args.get("ys", ())), num_carries(F)
    dys = B.ins[2 * nc + n:2 * nc + n + len(B.args.get("ys", ()))] if B is not None else ()
    return F.outs[2 * nc:2 * nc + k], dys


def _is_carry(s: Step, nc: int = 1) -> bool:
    """A transfer of the carry (of each of its ``nc`` tensors: :func:`~.pipeline_program.carry_tags`),
    made per chunk here."""
    return s.kind in ("send", "recv") and s.args["tag"] in {t for c in range(nc) for t in carry_tags(c)}


def interleave(cut, lists: dict, v: int) -> dict:
    """The segment lists of a one-stage-per-rank cut (``lists``), as ``v`` chunks per rank.

    Stages in the result are logical (stage ``s`` on rank ``s % p``); the prologue and the
    final segment keep rank r's steps on stage r."""
    check(cut, lists, v)
    store_chunks_in_place(cut.values, cut.spec, v, cut.spec.stage_layers)
    ch = _Chunks(cut, v)
    F = cut.steps[cut.F]
    B = cut.steps[cut.B] if cut.B is not None else None
    n, nc = len(F.args["names"]), ch.nc
    params = dict.fromkeys(F.ins[nc:nc + n] + (B.ins[nc:nc + n] if B is not None else ()))
    chunk_params = {s: [ch.like(s, c) for c in range(v)] for s in params}
    per_mb = {x for s, _ in lists[Segment.FORWARD] for x in s.outs} & set(params)   # stacked, made per micro-batch
    fwd, bwd, grads = _chunked_blocks(ch, F, B, chunk_params, per_mb)
    once = {s: chunks for s, chunks in chunk_params.items() if s not in per_mb}
    out = {Segment.PROLOGUE: list(lists[Segment.PROLOGUE]) + _chunks_of_params(ch, once),
           Segment.FORWARD: _relabel(ch, lists[Segment.FORWARD], F, fwd, last_after=True),
           Segment.BACKWARD: _relabel(ch, lists[Segment.BACKWARD], B, bwd, last_after=False),
           Segment.FINAL: _gather_grads(ch, lists[Segment.FINAL], B, grads) if B is not None
           else list(lists[Segment.FINAL])}
    why = _out_of_order(ch, out)
    if why is not None:
        raise _refusal(cut, v, why)
    return in_global_order(cut.values, out, cut.spec.mesh)


def _chunked_blocks(ch: _Chunks, F: Step, B: Step | None, chunk_params: dict,
                    per_mb: set) -> tuple[list, list, list]:
    """The pipelined repeat's forward (and backward) step per chunk, with their carry transfers:
    ``(step, stages)`` pairs in run order (the backward's from the last chunk down), and each
    chunk's stacked gradients (the backward's outputs besides the carry's gradient).  A stacked
    input made per micro-batch (``per_mb``: a cross-attention cache made before the layers, on the
    ranks' first chunks) is narrowed to each chunk's layers in that chunk's forward."""
    v, nc = ch.v, ch.nc
    n = len(F.args["names"])
    # each chunk's input carry and its output (a tuple carry's nc tensors each)
    x = [F.ins[:nc]] + [tuple(ch.like(a) for a in F.ins[:nc]) for _ in range(v - 1)]
    y = [tuple(ch.like(o) for o in F.outs[:nc]) for _ in range(v - 1)] + [F.outs[:nc]]
    kept = [[ch.like(o, c) for o in F.outs[nc:]] for c in range(v)]       # stacked inputs, saved
    fwd = []
    for c in range(v):
        params = tuple(chunk_params[s][c] for s in F.ins[nc:nc + n])   # then the tables every layer reads
        step = dataclasses.replace(F, ins=(*x[c], *params, *F.ins[nc + n:]), outs=(*y[c], *kept[c]),
                                   label=f"{F.label} (chunk {c})")
        narrow = [(t, frozenset(c * ch.p + r for r in ranks)) for x_mb in F.ins[nc:nc + n] if x_mb in per_mb
                  for t, ranks in _chunk_of(ch, x_mb, chunk_params[x_mb][c], c, "forward", "stacked input's")]
        fwd += narrow + _carry(ch, c, x[c], y[c], _per_rank(ch, c, step), +1)
    ys, dys = _per_layer_outputs(F, B, n)
    # each per-layer output whole on its rank (its chunks one after another, the stored order),
    # joined in the rank's last chunk, where what the loss makes of it runs (:func:`_relabel`)
    last = [(v - 1) * ch.p + r for r in range(ch.p)]
    fwd += [(step, frozenset(last)) for step, _ in
            _join_chunks(ch, [(yv, [kept[c][nc + i] for c in range(v)], F.phase) for i, yv in enumerate(ys)],
                         "per-layer output: the rank's chunks")]
    if B is None:
        return fwd, [], []
    d_in = B.ins[nc + n:2 * nc + n]   # the carry's gradients
    dy = [tuple(ch.like(d) for d in d_in) for _ in range(v - 1)] + [d_in]
    dx = [B.outs[:nc]] + [tuple(ch.like(o) for o in B.outs[:nc]) for _ in range(v - 1)]
    bwd, grads = [], [()] * v
    d_closed = [tuple(ch.like(o) for o in B.outs[nc + n:]) for _ in range(v)]   # per chunk, partial sums
    for c in reversed(range(v)):
        # the backward reads the forward's stacked outputs, the params and the carry's gradient
        dys_c = {d: ch.like(d, c) for d in dys}   # chunk c's layers of the per-layer outputs' gradients
        own = {**{x: x for x in F.ins[nc + n:]}, **dict(zip(F.outs[nc:], kept[c])),
               **{s: chunks[c] for s, chunks in chunk_params.items()}, **dict(zip(d_in, dy[c])), **dys_c}
        grads[c] = tuple(ch.like(o, c) for o in B.outs[nc:nc + n])
        step = dataclasses.replace(B, ins=tuple(own[x] for x in B.ins), outs=(*dx[c], *grads[c], *d_closed[c]),
                                   label=f"{B.label} (chunk {c})")
        narrow = [(s, frozenset(c * ch.p + r for r in ranks))
                  for d, dc in dys_c.items() for s, ranks in _chunk_of(ch, d, dc, c, "backward",
                                                                       "per-layer output gradient")]
        bwd += narrow + _carry(ch, c, dy[c], dx[c], _per_rank(ch, c, step), -1)
    # the gradients of what the block reads from outside: each rank's sum over its chunks, made
    # after its first chunk's backward, its micro-batch's last (then summed over the stages as before)
    bwd += [ch.local("add", _add, [d_closed[c][i] for c in range(v)], total, {}, range(ch.p),
                     f"{B.label}: the sum over the rank's chunks", B.phase) for i, total in enumerate(B.outs[nc + n:])]
    return fwd, bwd, grads


def _per_rank(ch: _Chunks, c: int, step: Step) -> list:
    """Chunk ``c``'s ``step`` on its stages as ``(step, stages)`` pairs: one step over the p
    stages for equal chunks, else one per stage, each over its own layers."""
    layers, stages = ch.layers(c), [c * ch.p + r for r in range(ch.p)]
    if not ch.counts:
        return [(dataclasses.replace(step, times=layers[0]), frozenset(stages))]
    return [(dataclasses.replace(step, times=k, label=f"{step.label[:-1]}, stage {s})"), frozenset({s}))
            for s, k in zip(stages, layers)]


def _carry(ch: _Chunks, c: int, into: tuple, out: tuple, steps: list, way: int) -> list:
    """Chunk ``c``'s ``(step, stages)`` pairs on its p stages between the receive of its carry
    (``into``, each carried tensor) and the send of its result (``out``): from stage s to s +
    ``way``, the last rank handing on to the first between chunks (and back for gradients); each
    carried tensor of a tuple carry by transfers of its own (:func:`~.pipeline_program.carry_tags`)."""
    p, last = ch.p, ch.p * ch.v - 1
    step = steps[0][0]
    stages = [c * p + r for r in range(p)]
    recv = [s for s in stages if 0 <= s - way <= last]
    send = [s for s in stages if 0 <= s + way <= last]

    def transfer(kind: str, v: int, k: int, offset: int) -> Step:
        what = f"carry (chunk {c})" if len(into) == 1 else f"carry {k} (chunk {c})"
        return transfer_step(kind, v, ch.values, ch.spec.mesh, ch.spec.axis, offset, carry_tags(k)[way < 0],
                             step.phase, what)
    out_pairs = []
    for offset in sorted({(s % p) - ((s - way) % p) for s in recv}):
        at = frozenset(s for s in recv if (s % p) - ((s - way) % p) == offset)
        out_pairs += [(transfer("recv", v, k, offset), at) for k, v in enumerate(into)]
    out_pairs += steps
    for offset in sorted({((s + way) % p) - (s % p) for s in send}):
        at = frozenset(s for s in send if ((s + way) % p) - (s % p) == offset)
        out_pairs += [(transfer("send", v, k, offset), at) for k, v in enumerate(out)]
    return out_pairs


def _relabel(ch: _Chunks, pairs: list, block: Step | None, chunked: list, last_after: bool) -> list:
    """A per-micro-batch segment with its pipelined step replaced by the chunks' steps, and the
    other steps on logical stages: before the layers (forward) or after them (backward) on the
    first chunk of their rank, the others on its last chunk."""
    if block is None:
        return list(pairs)
    p, v = ch.p, ch.v
    after, out = set(block.outs), []
    for s, st in pairs:
        if s is block:
            out += chunked
            continue
        if _is_carry(s, ch.nc):   # made per chunk
            continue
        downstream = any(x in after for x in s.ins)
        if downstream:
            after.update(s.outs)
        # other transfers (what the block reads from outside, its gradient's stage sums) run on
        # the ranks' first chunks, as they ran on their stages; a forward send of what the head
        # made after the layers (its term of a side encoder's output gradient) on the last chunk
        if s.kind in ("send", "recv"):
            late = s.kind == "send" and last_after and downstream
        else:
            late = downstream if last_after else not downstream
        out.append((s, frozenset(r + (v - 1) * p if late else r for r in st)))
    return out


def store_chunks_in_place(values: dict, spec, v: int, counts=()) -> None:
    """Every value of ``values`` whose layer dim the stage axis alone splits, split
    block-cyclically with ``v`` blocks per rank (of ``counts`` layers, one per virtual stage,
    when given): rank r's local layers are its chunks r, r + p, ..."""
    for vid, val in list(values.items()):
        if val.sharding.axes_of(spec.layer) == (spec.axis,):
            sharding = val.sharding.with_cyclic(spec.layer, v, tuple(counts) or None)
            values[vid] = dataclasses.replace(val, sharding=sharding)


def _chunks_of_params(ch: _Chunks, chunk_params: dict) -> list:
    """Prologue steps giving each chunk its layers of each stacked param: chunk c of every rank
    is its local layers ``c k .. (c + 1) k`` (a view: nothing moves); for unequal chunks each
    rank's own slice (one step per rank)."""
    return [(step, frozenset(ranks)) for s, chunks in chunk_params.items() for c, vid in enumerate(chunks)
            for step, ranks in _chunk_of(ch, s, vid, c, "forward", "stacked params'")]


def _chunk_of(ch: _Chunks, whole: int, part: int, c: int, phase: str, what: str) -> list:
    """The steps making ``part``, chunk ``c``'s layers of each rank's stacked ``whole``, as
    ``(step, ranks)`` pairs: one step over every rank, or one per rank for unequal chunks."""
    every = [(r,) for r in range(ch.p)] if ch.counts else [tuple(range(ch.p))]
    out = []
    for ranks in every:
        r = ranks[0]
        start = sum(ch.layers(j)[r] for j in range(c))
        attrs = {"dim": ch.stacked_dim(whole), "start": start, "length": ch.layers(c)[r]}
        label = f"{what} layers of chunk {c}" + (f" (rank {r})" if ch.counts else "")
        out.append((ch.local("narrow", _narrow, (whole,), part, attrs, ranks, label, phase)[0], ranks))
    return out


def _gather_grads(ch: _Chunks, pairs: list, B: Step, grads: list) -> list:
    """The final segment with each stacked gradient's sum over the micro-batches made per chunk
    (``grads``: chunk c's stacked gradients), then joined on each rank into the sum the rest reads;
    a stacked gradient that a step other than its sum reads, or that is an output, is joined whole.

    The sums (they read only the backward's per-chunk gradients) come first, then the joins,
    and the segment's other steps in order."""
    v = ch.v
    per_chunk = {g: [grads[c][i] for c in range(v)] for i, g in enumerate(B.outs[ch.nc:ch.nc + len(grads[0])])}
    # a gradient read otherwise (by a cross-attention cache's einsum's backward) or an output: its
    # chunks joined first, for every reader
    whole = [g for g in per_chunk if g in ch.cut.outputs.values() or any(
        g in s.ins and (s.kind != "allreduce" or len(s.ins) > 1) for s, _ in pairs)]
    sums_first, rest, joined = [], [], [(g, per_chunk.pop(g), B.phase) for g in whole]
    for s, st in pairs:
        if s.kind != "allreduce" or s.ins[0] not in per_chunk:
            rest.append((s, st))
            continue
        sums = [ch.like(s.outs[0], c) for c in range(v)]
        for c in range(v):
            size = ch.values[sums[c]].local_bytes(ch.spec.mesh) if ch.counts else s.bytes // v
            sums_first.append((dataclasses.replace(s, ins=(per_chunk[s.ins[0]][c],), outs=(sums[c],),
                                                   bytes=size, label=f"{s.label} (chunk {c})"), st))
        joined.append((s.outs[0], sums, s.phase))
    return sums_first + _join_chunks(ch, joined) + rest


def _join_chunks(ch: _Chunks, joined: list, label: str = "stacked gradient: the rank's chunks") -> list:
    """Each rank's stored layers of each ``(whole, parts, phase)`` of ``joined``: its chunks'
    parts one after another (the block-cyclic local order)."""
    return [ch.local("join", _join, parts, whole, {"dim": ch.stacked_dim(whole)}, range(ch.p), label, phase)
            for whole, parts, phase in joined]


def stored_layers(plan) -> str | None:
    """``meshdsl plan``: where an interleaved pipeline stores its layers (each rank its chunks,
    ``Sharding.cyclic``, of the virtual stages' given layer counts: ``Sharding.blocks``; several
    stacks each so, a stack's block empty on a virtual stage holding none of it), or None for a
    plan storing none so."""
    first: dict = {}   # layer dim -> a value storing it so
    for val in plan.values.values():
        for layer, _ in val.sharding.cyclic:
            first.setdefault(layer, val)
    if not first:
        return None
    each = [_stored(plan, layer, val) for layer, val in first.items()]
    if len(each) == 1:
        where, ranks = each[0]
        return f"layers stored where they run, {where} (no param or gradient moves): {ranks}"
    return "layers stored where they run (no param or gradient moves): " + " | ".join(
        f"{where}: {ranks}" for where, ranks in each)


def _stored(plan, layer: str, v) -> tuple[str, str]:
    """A block-cyclic layer dim's sharding and the layers each rank holds of it, as words."""
    blocks = v.sharding.cyclic_blocks[layer]
    axis = v.sharding.axes_of(layer)[0]
    p = plan.mesh.sizes[axis]
    lengths = block_lengths(v.shape.get(layer).size, p, blocks, v.sharding.given_blocks.get(layer))
    start = [sum(lengths[:s]) for s in range(p * blocks)]
    span = (lambda s: f"{start[s]}" if lengths[s] == 1 else f"{start[s]}-{start[s] + lengths[s] - 1}")

    def holds(i):
        mine = [s for s in range(i, p * blocks, p) if lengths[s]]
        if not mine:
            return f"rank {i} holds none"
        return (f"rank {i} holds layers {', '.join(span(s) for s in mine)} "
                f"(stage{'s' if len(mine) > 1 else ''} {', '.join(str(s) for s in mine)})")
    where = f"{layer}:{axis}[cyclic {blocks}]" + (f"[blocks {','.join(map(str, lengths))}]"
                                                  if layer in v.sharding.given_blocks else "")
    return where, "; ".join(holds(i) for i in range(p))
