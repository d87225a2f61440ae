"""Lowering of repeat / repeat_grad: the block becomes a sub-plan run once per layer.

The carry keeps the layout its dims have everywhere (a tuple carry: each carried tensor
its own, fed as its own sub-plan input, ``carry``, ``carry.1``, ..., and handed on as its
own output, ``out``, ``out.1``, ...: nothing joins them); each stacked param is
sliced along ``layer`` locally.  ``layer`` is whole, or split over the pipeline
axis (:mod:`.pipeline`): then each stage's sub-plan runs its ``layers / p`` local
layers, and the stacked carries, activations and gradients stay split like the
params.  A repeat inside a block (a recurrence over ``seq``) whose scanned dim the layout
splits gathers it: each rank runs every step (:func:`_scan_target`; the outer backward reads the
gathered inputs the forward saved, :mod:`.saved_copies`, or, for one read from outside the block,
the copy gathered once before the loop, :mod:`.hoist`).  In the backward block,
parameter gradients may stay lazy partial sums, so they are reduced once, stacked, after the loop.

The forward sub-plan also outputs the activations the remat policy saves for the
backward block (``attrs["saved"]``, only those this plan uses, :mod:`meshdsl.ir.remat`),
each in the sharding the forward produced it in; they are stacked over ``layer`` and the
backward sub-plan takes them as inputs.  What it needs of the forward besides them it
recomputes from them and from the layer's input: those steps have phase ``recompute``
(``meshdsl plan`` shows them and their FLOPs).  An activation the backward reads itself is
saved reduced; one it only recomputes from is saved as the forward made it (a partial sum
too), so the recompute repeats the forward's kernels and collectives exactly.  Where the forward
moved a saved activation to another layout no larger than its own (an alltoall), it saves that
copy too, and the backward reads it instead of repeating the exchange; likewise the halo rows
its neighbours sent it (a sliding window's keys), glued on again, and, under remat, the small
results of the collectives its recompute would send again (:mod:`.saved_copies`).

The block's per-layer outputs (``(carry, {name: tensor})``) leave the forward sub-plan as
its rules leave them (``y/<name>``, partial sums kept) and are stacked over ``layer``; the
backward sub-plan takes one layer's slice of each one's stacked gradient
(``cotangent/<name>``).

Tensors the block reads from outside (:mod:`meshdsl.ir.closure`) are fed to every
layer in their own layout, reduced (where the block moves one, trades its halo, reduces a
partial sum of it or computes from it alone, that work is made once before the loop and the
block reads the copy, :mod:`.hoist`); the backward
sub-plan outputs each one's gradient as its rules leave it, and the loop sums the layers' (a
sum over the stages too when the layers are pipelined: one allreduce over the stage axis, made
transfers by :mod:`.partition`).  A partial sum a backward layer reads on the way to such a gradient and
elsewhere (DETR's object queries, added to the carry) stays partial both ways where that
makes the loop cheaper: the layers' sum of its share is reduced once, after the loop, and
the other reader reduces its own when it needs it whole (:func:`_lower_block`).  So does a
partial sum whose readers are all linear in it, one on the way to such a gradient or a stacked
param's (MQA's key gradient, read by its weight's gradient and the input's; a concat's
gradient read by its slices; Perceiver's input array's, read by its layer norm's backward):
it passes on partial to each reader instead of being reduced in every layer (:func:`_lazy_through`).
A split input that several projections read as it is, each leaving a partial sum (Evoformer's
q, k and v of the normed MSA row under ``c_m:model``), is gathered once with the projections'
weights where the loop, priced as it will be sent (packed), costs less and sends no more bytes:
in the forward block and in the backward's recompute (:func:`_gathered_once`).

The plan step is data: kind ``repeat``, the block's sub-plan in ``subplans``,
the layer count in ``times``; :mod:`meshdsl.runtime.layers` runs it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..core.graph import topo_nodes
from ..core.shape import Dim, Shape
from ..errors import LayoutError, message
from ..ir.block import carry_name
from ..ir.closure import PREFIX
from ..layout.sharding import Sharding
from .block_order import order_block
from .coalesce import coalesce
from .compiler import Lowerer, lower_into
from .dead_moves import live_steps
from .foresight import NONE, Foresight, foresee
from .hoist import copy_read, hoist_moves
from .pipeline import MB_AXIS
from .plan import Plan, register_step_kind, step_called, sum_begun_by
from .rules import lowering, rule_for
from .saved_copies import (RESULT, bind_result, copies_of, drop_unread, gathered_for_scan, halo_strips, record,
                           record_result, reglue, results_of, saved_results, strip_of, worth_saving)
from .shared_moves import foresee as foresee_shared, projected_once
from .shared_sums import meeting_sums

# names: the stacked params (sub-plan inputs); pos: each one's layer dim position;
# backward: a repeat_grad; saved: names of the saved activations the sub-plan outputs
# (forward) or takes (backward).
# ys: the block's per-layer outputs the sub-plan outputs as "y/<name>" (forward: the step outputs
# them stacked over layer after the layer inputs, before the saved activations), or whose
# cotangents it takes as "cotangent/<name>" (backward: stacked inputs after the carry gradient).
# streamed: (backward) names whose gradient the sub-plan reduces per layer (lowering/bucket.py,
# stream_loop_grads): the loop starts those reductions as each layer's gradient is made.
# closed: (only when the block reads tensors from outside) their sub-plan input names, fed after the
# stacked params (forward) or the saved activations (backward); a backward step outputs, after the
# stacked gradients, the gradient of each one the block differentiates (sub-plan output "d/<name>"),
# summed over the layers.
# carries: (only when the block carries several tensors, k) the step's first k inputs are the carried
# tensors (forward) or their stacked layer inputs (backward; then after the stacked params, their k
# gradients), and its first k outputs the last carries (forward: then their k stacked layer inputs)
# or their gradients (backward).
register_step_kind("repeat", ("names", "pos", "backward", "saved", "ys", "streamed", "closed", "carries"))

#: The phase of a backward block's steps that recompute the forward (remat, and values of params only).
RECOMPUTE = "recompute"


def _slice_sharding(stacked: Sharding, layer: str) -> Sharding:
    return Sharding(tuple((n, a) for n, a in stacked.dims if n != layer), stacked.partial)


def _stack_sharding(sub: Sharding, shape, layer: str, layer_axes=()) -> Sharding:
    split = dict(sub.dims)
    return Sharding(tuple((d.name, tuple(layer_axes) if d.name == layer else split[d.name]) for d in shape),
                    sub.partial)


@dataclass
class _Loop:
    """A repeat (or repeat_grad) node as its lowering sees it: its inputs by role, and what
    the step it lowers to feeds and outputs."""

    node: object
    backward: bool
    carry: list              # the carried tensors (forward), or their stacked layer inputs (backward)
    stacked: list
    dy: list = field(default_factory=list)      # the carried tensors' gradients (backward)
    dys: list = field(default_factory=list)     # the per-layer outputs' stacked gradients (backward)
    saved: list = field(default_factory=list)   # the saved activations (backward)
    closed: list = field(default_factory=list)  # the tensors the block reads from outside
    ys: list = field(default_factory=list)      # names of the per-layer outputs (forward: those used)
    want: list = field(default_factory=list)    # forward: indices of the saved activations used
    layer_axes: tuple = ()   # the axes splitting the layer dim (the pipeline axis, or none)
    copies: list = field(default_factory=list)  # (backward) (index into saved, stacked value): re-laid copies
    strips: dict = field(default_factory=dict)  # (forward) copy name -> the halo Strip it is (saved_copies)

    @property
    def blk(self):
        return self.node.attrs["block"]

    @property
    def layer(self) -> str:
        return self.node.attrs["layer"].name

    @property
    def names(self) -> list[str]:
        return list(self.blk.params)

    @property
    def carries(self) -> list:
        """The carried tensors the loop hands from layer to layer: forward, the carries; backward,
        their gradients."""
        return self.dy if self.backward else self.carry

    @property
    def num_carries(self) -> int:
        return len(self.carry)

    def carry_note(self, what: str, i: int) -> str:
        """``what`` of carried tensor ``i`` (a note on its move): of a single carry, ``what`` itself."""
        return what if self.num_carries == 1 else f"{what} {i}"


def _loop(lw: Lowerer, node) -> _Loop:
    from ..ir.repeat import num_fixed_outputs
    from ..ir.repeat_grad import split_inputs

    blk = node.attrs["block"]
    if node.op.name == "repeat_grad":
        carries, stacked, dy, dys, saved, closed = split_inputs(blk, len(blk.params), node.inputs)
        return _Loop(node, True, carries, list(stacked), dy, list(dys), list(saved), list(closed),
                     ys=list(blk.extra["dys"]))
    n, nc = len(blk.params), blk.num_carries
    closed = list(node.inputs[len(node.inputs) - len(blk.closed):])
    base = num_fixed_outputs(blk)
    ys = [k for i, k in enumerate(blk.y_names) if id(node.outputs[2 * nc + i]) in lw.used]
    want = [i for i in range(len(node.attrs.get("saved", []))) if id(node.outputs[base + i]) in lw.used]
    return _Loop(node, False, list(node.inputs[:nc]), list(node.inputs[nc:nc + n]), closed=closed, ys=ys, want=want)


@lowering("repeat", "repeat_grad")
def lower_repeat(lw: Lowerer, node) -> None:
    """Lower a repeat (or its gradient) to one step that runs the block's sub-plan per layer."""
    loop = _loop(lw, node)
    carry_sh = [lw.layout.targets(t.shape, (), lw.mesh, "carry", False)[0][0] for t in loop.carries]
    ins, feeds = _lower_operands(lw, loop, carry_sh)
    num_local = node.attrs["layer"].size // lw.mesh.axis_size(loop.layer_axes)  # layers per stage
    plan, saved_names = _lower_block(lw, loop, feeds, ins, num_local)
    if loop.saved:
        plan, ins, saved_names = drop_unread(lw, loop, plan, ins, saved_names)
    carry_bytes = sum(sh.local_numel(t.shape, lw.mesh) * t.dtype.itemsize for sh, t in zip(carry_sh, loop.carries))
    plan, ins, closed = hoist_moves(lw, node, plan, ins, tuple(loop.blk.closed), carry_bytes)
    for n in plan.notes:
        lw.note(f"{node.name} block: {n}")
    # The stage axis when the layers are pipelined: each stage sums its own layers' gradients
    # of a closed-over tensor, so the step's sum is partial over it.
    stage = loop.layer_axes if lw.mesh.axis_size(loop.layer_axes) > 1 else ()
    out_vids = _step_outputs(lw, loop, plan, carry_sh, stage, saved_names)
    args = {"names": tuple(loop.names), "pos": dict(node.attrs["pos"]), "backward": loop.backward,
            "saved": tuple(saved_names)}
    if loop.ys:
        args["ys"] = tuple(loop.ys)
    if closed:
        args["closed"] = closed
    if loop.num_carries > 1:
        args["carries"] = loop.num_carries
    lw.emit("repeat", node, ins, out_vids, args=args, subplans=(plan,), times=num_local)
    _bind_outputs(lw, loop, out_vids, stage)


def _lower_operands(lw: Lowerer, loop: _Loop, carry_sh: list[Sharding]) -> tuple[list, dict]:
    """The step's inputs, each brought to the layout the loop reads it in, and the sharding of
    each sub-plan input (each carried tensor, one layer's slice of each stacked param, the
    cotangents, the closed-over tensors) by name; sets ``loop.layer_axes``."""
    node, mesh, layer = loop.node, lw.mesh, loop.layer
    ins, feeds = [], {carry_name("carry", i): sh for i, sh in enumerate(carry_sh)}
    if loop.backward:
        names = loop.names
        la = _scan_target(lw, loop, names[0]).axes_of(layer) if names else ()
        for i, (t, sh) in enumerate(zip(loop.carry, carry_sh)):
            ins.append(lw.relayout(lw.value(t), _stack_sharding(sh, t.shape, layer, la), node,
                                   loop.carry_note("saved layer inputs", i)))
    else:
        for i, (t, sh) in enumerate(zip(loop.carry, carry_sh)):
            ins.append(lw.relayout(lw.value(t), sh, node, loop.carry_note("carry", i)))
    for k, t in zip(loop.names, loop.stacked):
        tgt = _scan_target(lw, loop, k)
        loop.layer_axes = tgt.axes_of(layer)
        src = lw.value(t)
        ins.append(lw.relayout(src, tgt, node, f"stacked param '{k}'"))
        if not loop.backward and mesh.axis_size(lw.sharding(src).axes_of(layer)) > mesh.axis_size(loop.layer_axes):
            gathered_for_scan(lw, src, tgt)   # a recurrence's input gathered whole: the backward reads it again
        feeds[k] = _slice_sharding(tgt, layer)
    if loop.backward:
        for i, (t, sh) in enumerate(zip(loop.dy, carry_sh)):
            ins.append(lw.relayout(lw.value(t), sh, node, loop.carry_note("carry gradient", i)))
            feeds[carry_name("cotangent", i)] = sh
        for k, t in zip(loop.ys, loop.dys):  # whole sums, one layer's slice per layer
            ph = loop.blk.extra["dys"][k]
            sh = lw.layout.targets(ph.shape, (), mesh, "cotangent", False)[0][0]
            ins.append(lw.relayout(lw.reduced(lw.value(t)), _stack_sharding(sh, t.shape, layer, loop.layer_axes),
                                   node, f"gradient of per-layer output '{k}'"))
            feeds[ph.node.name] = sh
        for t in loop.saved:  # as the forward saved them: no re-layout
            ins.append(lw.value(t))
            assert mesh.axis_size(lw.sharding(ins[-1]).axes_of(layer)) == mesh.axis_size(loop.layer_axes)
        for j, t in enumerate(loop.saved):  # the copies the forward saved of them, re-laid out
            for vid in copies_of(lw, t):
                ins.append(vid)
                loop.copies.append((j, vid))
        for vid in results_of(lw, loop.carry[0].node):   # the forward's collectives' results it recomputes from
            ins.append(vid)
            loop.copies.append((None, vid))   # (None: a tensor of the block, no saved activation's copy)
    for k, t in zip(loop.blk.closed, loop.closed):  # in its own layout, whole sums: every layer reads it
        why = f"'{t.name}', read by every layer"
        ins.append(lw.relayout(lw.reduced(lw.value(t)), lw.target(t).with_partial(()), node, why))
        feeds[k] = lw.sharding(ins[-1])
    return ins, feeds


def _scan_target(lw: Lowerer, loop: _Loop, name: str) -> Sharding:
    """The sharding the loop reads stacked tensor ``name`` in: its target, but with the scanned dim
    whole where the layout splits it over other axes than the pipeline's.

    Only a repeat inside a block meets such a split (the outermost repeat's layer split is its
    pipeline, :mod:`.pipeline`): it runs its steps in order on every rank, so its stacked tensors
    are gathered at the step (an RWKV or xLSTM recurrence under ``seq:model``: the model around it
    stays sequence-parallel), and its stacked outputs leave it whole, so a reader that wants them
    split takes its local slice, no collective; backward, the per-step outputs' gradients are
    gathered likewise.  Even or uneven, over any axes, as GSPMD would.  The outer backward
    recomputes the inner repeat under ``full`` and ``selective`` (under ``none`` the forward saves
    its activations, :mod:`meshdsl.ir.remat`); where the remat policy saves a gathered input, the forward
    saves the gathered copy and the recompute reads it (:mod:`.saved_copies`; an input read from
    outside the block is gathered once before the loop, and the backward takes that copy,
    :mod:`.hoist`).

    Raises:
      LayoutError: the outermost repeat's layer dim split over other axes than its pipeline's (the
        pipeline's detection refuses such layouts first; kept for the step's invariant).
    """
    node, mesh, layer = loop.node, lw.mesh, loop.layer
    tgt = lw.targets(node.attrs["stacked"][name], strict=True)[0][0]
    axes = tgt.axes_of(layer)
    if mesh.axis_size(axes) == 1 or axes == (lw.pipeline_axis,):
        return tgt
    if not lw.in_block:
        raise LayoutError(message(
            f"repeat '{node.name}': stacked tensor '{name}' splits dim '{layer}' over mesh axes {axes}.",
            inputs=[f"layout: {lw.layout}", f"mesh: {mesh}"],
            rule=f"the outermost repeat's layers ('{layer}') are whole or split over its pipeline's axis",
            fix=f"split '{layer}' over one mesh axis (its pipeline stages), or remove the '{layer}:...' rule"))
    if not loop.backward:   # (its gradient gathers the same dim: one note)
        lw.note(f"repeat '{node.name}' scans '{layer}', split over {' x '.join(f'{a}:{mesh.sizes[a]}' for a in axes)}: "
                f"its steps run in order on every rank, so its stacked inputs are gathered whole at the repeat "
                f"and its per-step outputs read back as local slices")
    return Sharding(tuple((d, () if d == layer else a) for d, a in tgt.dims), tgt.partial,
                    *(tuple((d, x) for d, x in kept if d != layer) for kept in (tgt.parts, tgt.cyclic, tgt.blocks)))


def _lower_block(lw: Lowerer, loop: _Loop, feeds: dict, ins: list, times: int) -> tuple[Plan, list[str]]:
    """The block's sub-plan (one layer), and the names of the saved activations it outputs
    (forward) or takes (backward): the cheapest of its lowerings (:func:`_cheapest`), or, where
    several projections reduce around one split input, one that gathers it once
    (:func:`_gathered_once`; the forward, and the backward's recompute)."""
    plan, saved_names, (fewer, through, ahead_of, once) = _lower_block_once(lw, loop, feeds, ins, summed=True,
                                                                            through=True)
    best = _cheapest(lw, loop, feeds, ins, times, plan, (fewer, through, ahead_of))
    if not loop.backward:   # (a partial sum whose linear readers meet: :func:`_met_once`)
        best, saved_names = _met_once(lw, loop, feeds, ins, times, (best, saved_names))
    if once:
        best, saved_names = _gathered_once(lw, loop, feeds, ins, times, (best, saved_names), once,
                                           (fewer, through, ahead_of))
    return _ordered(loop, best), saved_names


def _cheapest(lw: Lowerer, loop: _Loop, feeds: dict, ins: list, times: int, plan: Plan, seen: tuple) -> Plan:
    """The cheapest of the block's lowerings, ``plan`` the first (``seen``: what it showed).

    A backward block whose gradients of tensors read from outside could stay partial sums
    over the layers (:func:`_lower_backward_block`), or whose partial sums could pass on to
    readers all linear in them (:func:`_lazy_through`), is lowered both so and as before, and
    the cheaper loop is kept: its ``times`` layers' collectives plus the reductions its
    outside and stacked gradients leave after the loop (:func:`_loop_price`).  So is one that
    foresees the re-layouts the first lowering made (:mod:`.foresight`), and one that makes the
    gradients of closed-over tensors read as copies made before the loop where the copies are
    (:func:`_copies_read`)."""
    fewer, through, ahead_of = seen
    tries = [plan]
    if through:
        tries.append(_lower_block_once(lw, loop, feeds, ins, summed=True, through=False)[0])
    if fewer:
        tries.append(_lower_block_once(lw, loop, feeds, ins, summed=False, through=False)[0])
    foreseen, as_read = ahead_of if loop.backward else NONE, _copies_read(lw, loop, ins)
    if len(tries) == 1 and not foreseen and not as_read:
        return plan
    # the cheapest; on a tie, the plainer (later) lowering
    prices = [_loop_price(lw, loop, p, times) for p in tries]
    best, price = next((p, c) for p, c in reversed(list(zip(tries, prices))) if c <= min(prices))
    if foreseen:
        # taken only where it is cheaper and sends no more bytes: it prices free what it merely
        # forecasts (fewer collectives of more bytes are no gain to take)
        ahead = _lower_block_once(lw, loop, feeds, ins, summed=True, through=True, foreseen=foreseen)[0]
        if _loop_price(lw, loop, ahead, times) < price - 1e-12 and \
                _loop_price(lw, loop, ahead, times, sent=True) <= _loop_price(lw, loop, best, times, sent=True):
            best = ahead
    if as_read:   # (as the foreseen one: taken where cheaper, sending no more bytes)
        read = _lower_block_once(lw, loop, feeds, ins, summed=True, through=True, as_read=as_read)[0]
        if _loop_price(lw, loop, read, times) < _loop_price(lw, loop, best, times) - 1e-12 and \
                _loop_price(lw, loop, read, times, sent=True) <= _loop_price(lw, loop, best, times, sent=True):
            best = read
    return best


def _met_once(lw: Lowerer, loop: _Loop, feeds: dict, ins: list, times: int, first: tuple) -> tuple[Plan, list[str]]:
    """Forward block ``first`` (its sub-plan and saved names), or the block lowered again passing a
    partial sum read by several ops, all linear in it, on to where they meet and on to the sum it
    joins, reduced once there (:func:`.shared_sums.meeting_sums`: FNO's spectrum, its low and high
    kept modes sliced and joined again, added to the local path).  Kept where its loop, as sent
    (:func:`_as_sent`), costs less and sends no more bytes; the saved activations are the kept
    lowering's."""
    blk, saved = loop.blk, loop.node.attrs.get("saved", [])
    ends = [*blk.outs, *(blk.ys[k] for k in loop.ys), *(saved[i] for i in loop.want)]
    meet = meeting_sums(topo_nodes(ends), ends)
    if not meet:
        return first
    strips = dict(loop.strips)
    again, names, _ = _lower_block_once(lw, loop, feeds, ins, summed=True, through=True, meet=meet)
    new, old = _as_sent(lw, loop, again), _as_sent(lw, loop, first[0])
    if _loop_price(lw, loop, new, times) < _loop_price(lw, loop, old, times) - 1e-12 and \
            _loop_price(lw, loop, new, times, sent=True) <= _loop_price(lw, loop, old, times, sent=True):
        return again, names
    loop.strips = strips   # (the halo strips the first lowering saved)
    return first


def _ordered(loop: _Loop, plan: Plan) -> Plan:
    """A backward block's sub-plan with cotangents and recomputed values freed early
    (:mod:`.block_order`); ordered once it is chosen, since the lowerings are compared by their
    collectives, whatever their order."""
    return order_block(plan, lambda s: s.phase == RECOMPUTE) if loop.backward else plan


def _gathered_once(lw: Lowerer, loop: _Loop, feeds: dict, ins: list, times: int, best: tuple,
                   once: Foresight, seen: tuple) -> tuple[Plan, list[str]]:
    """``best`` (the block's cheapest sub-plan and its saved names), or the block lowered again
    foreseeing ``once``: a split input that several projections read as it is, each leaving a partial
    sum, gathered once (:func:`.shared_moves.projected_once`: Evoformer's q, k and v of the normed MSA
    row), the params' gathers as the generic rule then chooses: lowered as :func:`_cheapest` lowers it
    (``seen``), the cheapest kept where its loop costs less and sends no more bytes, both priced as they will be sent
    (:func:`_as_sent`): one projection alone sees two gathers against one reduction, but the
    reductions, as the gathers, go packed.  A forward's saved activations are the kept lowering's."""
    fewer, through, ahead_of = seen
    strips = dict(loop.strips)
    tries = [_lower_block_once(lw, loop, feeds, ins, summed=True, through=True, foreseen=_joined(once, ahead_of))]
    for summed, passed in ((True, False),) * through + ((False, False),) * fewer:
        tries.append(_lower_block_once(lw, loop, feeds, ins, summed=summed, through=passed, foreseen=once))
    sent = [_as_sent(lw, loop, p) for p, _, _ in tries]
    price = [_loop_price(lw, loop, p, times) for p in sent]
    k = price.index(min(price))
    old = _as_sent(lw, loop, best[0])
    if price[k] < _loop_price(lw, loop, old, times) - 1e-12 and \
            _loop_price(lw, loop, sent[k], times, sent=True) <= _loop_price(lw, loop, old, times, sent=True):
        if not loop.backward:
            lw.note(f"repeat '{loop.node.name}': a split input several projections read gathered once per layer")
        return tries[k][0], tries[k][1]
    loop.strips = strips   # (the halo strips the first lowering saved)
    return best


def _as_sent(lw: Lowerer, loop: _Loop, plan: Plan) -> Plan:
    """Block sub-plan ``plan`` as the plan will send it: collectives nothing reads dropped
    (:mod:`.dead_moves`), and, where the plan is coalesced (no pipeline, no micro-batches),
    small ones made back to back packed (:mod:`.coalesce`, as it packs a block)."""
    steps = live_steps(list(plan.steps), plan.outputs.values())
    values = dict(plan.values)
    if lw.pipeline_axis is None and MB_AXIS not in lw.mesh.sizes:
        steps = coalesce(steps, values, dict(plan.outputs), lw.cost, lw.mesh, frozenset(loop.names))
    return replace(plan, steps=tuple(steps), values=values)


def _joined(a: Foresight, b: Foresight) -> Foresight:
    """What ``a`` and ``b`` foresee together."""
    held = dict(a.held)
    for tid, to in b.held.items():
        held[tid] = held.get(tid, frozenset()) | to
    return Foresight(held, {**a.wanted, **b.wanted})


def _loop_price(lw: Lowerer, loop: _Loop, plan: Plan, times: int, sent: bool = False) -> float:
    """Seconds (:mod:`.cost`) of a backward block's collectives over ``times`` layers, plus one
    allreduce of each outside tensor's gradient it leaves partial (over other axes than the
    micro-batches and the stages, whose sums are made either way); bytes sent when ``sent``."""
    mesh = lw.mesh
    collective = (lambda kind, nbytes, n: nbytes) if sent else lw.cost.collective

    def price(p: Plan) -> float:
        return sum(collective(s.kind, s.bytes, mesh.axis_size(s.axes)) if s.is_collective else
                   sum(s.runs(k) * price(sub) for k, sub in enumerate(s.subplans)) for s in p.steps)

    def reduced_after(name: str, layers: int) -> float:
        """One allreduce of output ``name``'s partial sum over ``layers`` layers (stacked: each
        layer's share; summed over the layers: one share)."""
        v = plan.values[plan.outputs[name]]
        axes = tuple(a for a in v.sharding.partial if a != MB_AXIS and a not in loop.layer_axes)
        return collective("allreduce", layers * v.sharding.local_numel(v.shape, mesh) * v.dtype.itemsize,
                          mesh.axis_size(axes))

    after = sum(reduced_after(f"d/{k}", 1) for k in loop.blk.extra.get("dclosed", ()))
    after += sum(reduced_after(f"d/{k}", times) for k in loop.blk.extra.get("dparams", ()))
    return times * price(plan) + after


def _lower_block_once(lw: Lowerer, loop: _Loop, feeds: dict, ins: list, summed: bool,
                      through: bool, foreseen: Foresight = NONE,
                      as_read: dict | None = None, meet: frozenset = frozenset()) -> tuple[Plan, list[str], tuple]:
    """:func:`_lower_block`'s sub-plan, lowered with or without ``summed`` and ``through`` (see
    :func:`_lower_backward_block`), and whether each may have changed anything: how its values'
    readers count, and whether a value passed on was met partial where the rule alone might have
    chosen otherwise (:attr:`.Lowerer.through_used`); and what it moved (:mod:`.foresight`); and, the
    first lowering only, the split inputs several projections reduce around (:func:`_gathered_once`).
    ``as_read``: closed-over tensors whose gradients the block makes at the given shardings
    (:func:`_copies_read`); ``meet``: a forward block's values passed on partial to every reader
    (:func:`_met_once`)."""
    blk, node = loop.blk, loop.node
    sub = Lowerer(lw.mesh, lw.layout, lw.cost)
    sub.in_block = True
    sub.lazy_through = meet
    sub.foreseen, sub.wanted = foreseen.held, foreseen.wanted
    for name, sh in feeds.items():
        t = blk.graph.inputs[name]
        vid = sub.new_value(t.shape, t.dtype, sh)
        sub.emit("input", t.node, [], [vid], args={"name": name, "tensor": t})
        sub.inputs[name] = vid
        sub.bind(t, vid)
    if loop.backward:  # the saved activations are given: lower_into does not lower what they need
        saved_names = _bind_saved(lw, sub, loop, ins)
        for k, to in (as_read or {}).items():   # (the gradient, and what its stop_gradient reads)
            for g in (blk.extra["dclosed"][k], *blk.extra["dclosed"][k].node.inputs):
                sub.set_target(g, to, f"summed over the layers as its copy '{k}' is read")
        ids, fewer = _lower_backward_block(sub, blk, summed, through)
    else:
        (ids, saved_names), fewer = _lower_forward_block(sub, loop), False
    _check_no_microbatch_sums(lw, node, sub.steps)
    num_forward = blk.extra.get("num_forward", 0) if loop.backward else 0
    # the block runs in its node's phase; a backward block's forward nodes recompute
    phases = [RECOMPUTE if s.kind != "input" and 0 <= s.node < num_forward else node.phase for s in sub.steps]
    steps = [s if s.phase == ph else replace(s, phase=ph) for s, ph in zip(sub.steps, phases)]
    plan = Plan(lw.mesh, lw.layout, steps, sub.values, ids, {}, sub.inputs, sub.notes)
    return plan, saved_names, (fewer, sub.through_used, foresee(sub, plan) if loop.backward else NONE,
                               _projected(sub, loop) if not foreseen and as_read is None and summed and through
                               else NONE)


def _projected(sub: Lowerer, loop: _Loop) -> Foresight:
    """The split inputs several projections reduce around in block lowerer ``sub``'s first lowering
    (:func:`.shared_moves.projected_once`, one layer's slices of the stacked params as the params);
    in a backward block, also one its gradients gather anyway (a weight's gradient reads the normed
    input whole) that its recompute's projections reduce around (:func:`.shared_moves.foresee`)."""
    once = projected_once(sub, params=[sub.inputs[k] for k in loop.names])
    held = _joined(Foresight(once, {}), foresee_shared(sub)) if loop.backward else Foresight(once, {})
    return held if held else NONE


def _copies_read(lw: Lowerer, loop: _Loop, ins: list) -> dict:
    """A backward loop's closed-over tensors whose gradients it makes, that the forward loop read as
    a copy made once before it (:func:`.hoist.copy_read`: gathered whole), and each copy's sharding:
    the block may make the gradient there, partial sums kept, so the loop adds the layers' up and
    the sum is reduced to the tensor's layout once, after it (not in a pipeline)."""
    if not loop.backward or lw.pipeline_axis is not None:
        return {}
    dclosed = loop.blk.extra["dclosed"]
    pairs = ((k, copy_read(lw, vid)) for k, vid in zip(loop.blk.closed, ins[len(ins) - len(loop.closed):])
             if k in dclosed)
    return {k: to for k, to in pairs if to is not None}


def _bind_saved(lw: Lowerer, sub: Lowerer, loop: _Loop, ins: list) -> list[str]:
    """Give backward sub-plan ``sub`` the saved activations (step inputs ``ins``) as inputs, and
    their re-laid copies (``<name>@<k>``) as values they are already held at
    (:meth:`.Lowerer.hold`, :mod:`.saved_copies`): a reader that needs one takes it, no
    collective.  Returns the inputs' names in step order."""
    given = loop.blk.extra.get("given", {})
    at = len(ins) - len(loop.closed) - len(loop.copies) - len(loop.saved)
    vids, names = [], list(given)
    for (name, t), vid_out in zip(given.items(), ins[at:]):
        vid = sub.new_value(t.shape, t.dtype, _slice_sharding(lw.sharding(vid_out), loop.layer))
        sub.emit("input", t.node, [], [vid], args={"name": name, "tensor": t}, op="saved", label=f"saved {t.name}")
        sub.inputs[name] = vid
        sub.bind(t, vid)
        vids.append(vid)
    num, strips = {}, {}
    for j, vid_out in loop.copies:
        if j is None:   # a collective's result the recompute starts from (saved_copies.saved_results)
            names.append(bind_result(lw, sub, loop.blk, vid_out, Shape(d for d in lw.values[vid_out].shape
                                     if d.name != loop.layer), _slice_sharding(lw.sharding(vid_out), loop.layer)))
            continue
        t, k, strip = list(given.values())[j], num.get(j, 0), strip_of(lw, vid_out)
        num[j], name = k + 1, f"{names[j]}@{k}"
        shape = Shape(d for d in lw.values[vid_out].shape if d.name != loop.layer)
        vid = sub.new_value(shape, t.dtype, _slice_sharding(lw.sharding(vid_out), loop.layer))
        sub.emit("input", t.node, [], [vid], args={"name": name, "tensor": t}, op="saved",
                 label=f"saved {t.name} (" + ("halo strip)" if strip else "re-laid)"))
        sub.inputs[name] = vid
        if strip is None:
            sub.hold(vids[j], sub.sharding(vid), vid)
        else:
            strips.setdefault(j, []).append((strip, vid))
        names.append(name)
    for j, pieces in strips.items():   # the forward's halo glued on again: no exchange
        reglue(sub, list(given.values())[j].node, vids[j], pieces)
    return names


def _lower_forward_block(sub: Lowerer, loop: _Loop) -> tuple[dict[str, int], list[str]]:
    """The forward block's outputs: the next carry in the carry's layout; each per-layer
    output as its rules leave it (partial sums kept: stacked, they stay sums over the same
    axes, reduced where the loss reads them); each saved activation.

    A saved activation the backward reads is reduced.  One it only recomputes from (remat)
    is handed on as the forward made it, a partial sum too, and is no extra reader: the
    forward lowers as it would without saving it, and the backward's recompute of its
    readers repeats the forward's kernels and collectives, so it makes the same numbers.
    """
    blk = loop.blk
    saved, read = loop.node.attrs.get("saved", []), loop.node.attrs.get("saved_read", [])
    ys = {f"y/{k}": blk.ys[k] for k in loop.ys}
    sub.count_readers([*blk.outs, *ys.values(), *(saved[i] for i in loop.want if read[i])],
                      kept=[saved[i] for i in loop.want if not read[i]])
    # read before the carry is lowered, with all they are made from: a nested repeat making the carry
    # and a per-layer output (itself, or from its per-step outputs) then lowers once with both
    _mark_read(sub, [*ys.values(), *(saved[i] for i in loop.want)])
    ids = lower_into(sub, {carry_name("out", i): o for i, o in enumerate(blk.outs)})
    _lower_values(sub, [*ys.values(), *(saved[i] for i in loop.want)])
    ids.update((k, sub.value(y)) for k, y in ys.items())
    names, copies = [], []
    for i in loop.want:
        f = saved[i]
        vid = sub.reduced(sub.value(f))
        if read[i] and sub.sharding(vid).partial:
            vid = sub.relayout(vid, sub.sharding(vid).with_partial(()), f.node, "saved activation")
        names.append(f"saved/{i}")
        ids[names[-1]] = vid
        for k, to in enumerate(worth_saving(sub, vid)):
            copies.append(f"saved/{i}@{k}")
            ids[copies[-1]] = sub.relayout(vid, to, f.node)   # made already: no new step
        for k, (strip, piece) in enumerate(halo_strips(sub, vid)):
            copies.append(f"saved/{i}@h{k}")
            ids[copies[-1]], loop.strips[copies[-1]] = piece, strip
    results = saved_results(sub, loop.node, ids)   # (results of collectives its recompute would send again)
    ids.update(results)
    return ids, names + copies + list(results)


def _step_outputs(lw: Lowerer, loop: _Loop, plan: Plan, carry_sh: list[Sharding], stage: tuple,
                  saved_names: list[str]) -> list[int]:
    """The step's output values: forward, the carry, the stacked layer inputs, per-layer outputs
    and saved activations (then their re-laid copies, ``saved/<i>@<k>``, recorded in ``lw.memo``
    for the backward step); backward, the carry gradient, the stacked gradients and those of the
    closed-over tensors.  Stacked values are split over the layer axes like the params."""
    node, layer, la = loop.node, loop.layer, loop.layer_axes
    ids = plan.outputs

    def stacked(t, name) -> int:
        return lw.new_value(t.shape, t.dtype, _stack_sharding(plan.values[ids[name]].sharding, t.shape, layer, la))

    nc = loop.num_carries
    if loop.backward:
        out = [lw.new_value(t.shape, t.dtype, sh) for t, sh in zip(loop.dy, carry_sh)]
        out += [stacked(t, f"d/{k}") for k, t in zip(loop.names, loop.stacked)]
        for k, t in zip(loop.blk.closed, loop.closed):
            if k in loop.blk.extra["dclosed"]:
                sh = plan.values[ids[f"d/{k}"]].sharding
                out.append(lw.new_value(t.shape, t.dtype, sh.with_partial(sh.partial + stage)))
        return out
    out = [lw.new_value(t.shape, t.dtype, sh) for t, sh in zip(loop.carry, carry_sh)]
    out += [lw.new_value(t.shape, t.dtype, _stack_sharding(sh, t.shape, layer, la))
            for t, sh in zip(node.outputs[nc:2 * nc], carry_sh)]
    names = loop.blk.y_names
    out += [stacked(node.outputs[2 * nc + names.index(k)], f"y/{k}") for k in loop.ys]
    base = 2 * nc + len(names)
    out += [stacked(node.outputs[base + i], f"saved/{i}") for i in loop.want]
    for name in saved_names[len(loop.want):]:   # copies: no tensor of the graph, read by the backward step
        if name.startswith(RESULT):   # a collective's result, a tensor of the block (saved_copies.saved_results)
            v = plan.values[ids[name]]
            shape = Shape([node.attrs["layer"], *v.shape])
            out.append(lw.new_value(shape, v.dtype, _stack_sharding(v.sharding, shape, layer, la)))
            record_result(lw, node, name, out[-1])
            continue
        t = node.outputs[base + int(name.split("/")[1].split("@")[0])]
        per = plan.values[ids[name]].shape   # (a halo strip is shorter along its dim)
        shape = Shape(Dim(d.name, per.get(d.name).size) if d.name in per.names else d for d in t.shape)
        out.append(lw.new_value(shape, t.dtype, _stack_sharding(plan.values[ids[name]].sharding, shape, layer, la)))
        record(lw, t, out[-1], loop.strips.get(name))
    return out


def _check_no_microbatch_sums(lw: Lowerer, node, steps) -> None:
    """Refuse a block that sums over the micro-batches inside its layers: they run one
    micro-batch at a time (a sum over the batch must leave the block as a partial sum)."""
    bad = next((s for s in steps if s.is_collective and MB_AXIS in s.axes), None)
    if bad is not None:
        stat = _sum_of_outside_tensors(steps)
        red = bad.args.get("op", "sum")
        what = "sums over" if red == "sum" else f"takes the {red} over"
        kind = bad.kind if red == "sum" else f"{bad.kind} ({red})"
        bullets = [f"{kind} over {bad.axes}: {bad.note or f'the result of {step_called(bad)}'}"]
        began = sum_begun_by(steps, lw.values, bad.ins[0], MB_AXIS) if red == "sum" and bad.ins else None
        if began is not None:
            bullets.append(f"the sum over the batch is begun by {step_called(began)}")
        first = ""
        if stat is not None:
            made, read = stat
            names = ", ".join(f"'{n}'" for n in read)
            bullets.append(f"{step_called(made)} is a sum over the batch made in the block from {names} only, "
                           "read from outside it: the same in every layer")
            first = (f"make '{made.label}' ({made.op} of {names}) before the repeat and read it in the block (a "
                     "whole-batch count of the inputs made outside a block is made once per step, before the "
                     "micro-batches); otherwise: ")
        raise LayoutError(message(
            f"repeat '{node.name}': {step_called(bad)} in its block {what} the micro-batches in every layer.",
            inputs=[f"mesh: {lw.mesh}", f"layout: {lw.layout}"], bullets=bullets,
            rule="a repeat's layers run one micro-batch at a time, so a sum over the batch leaves the block "
                 "unreduced and is added up after the micro-batches; a max or min over the batch has no such form",
            fix=first + "compute what the op reads outside the block (a lookup into a table read from outside: before "
                "the repeat) and read the result in the block; a statistic of the whole batch that the layer "
                "multiplies (a load-balancing loss's per-expert fractions and mean probabilities) per sequence "
                "instead, averaged over the batch last, so the micro-batches add up; a normalisation by "
                "statistics of the whole batch (a batch norm's mean and variance over 'batch') has no "
                "micro-batched form with the dense numbers: normalise each example (layer_norm over its own "
                "dims); a max or min over the whole batch (a scale taken over every example) per example instead; "
                "or use microbatches=1"))


def _sum_of_outside_tensors(steps):
    """The first local step of a block (and the names of the outside tensors it is made from)
    whose value an allreduce over the micro-batches reads, made only from tensors the block
    reads from outside (``closed/...`` inputs: no carry, no stacked param), or None.  Such a
    value is the same in every layer: made before the repeat, a whole-batch statistic of the
    inputs is made once per step (:mod:`.batch_stats`)."""
    producer = {v: s for s in steps for v in s.outs}
    reads: dict[int, frozenset | None] = {}    # value -> the outside tensors it is made from (None: not only)

    def outside(v) -> frozenset | None:
        if v not in reads:
            s = producer.get(v)
            if s is None:
                reads[v] = None
            elif s.kind == "input":
                name = s.args.get("name", "")
                reads[v] = frozenset([name[len(PREFIX):]]) if name.startswith(PREFIX) else None
            else:
                parts = [outside(u) for u in s.ins]
                reads[v] = None if None in parts else frozenset().union(*parts)
        return reads[v]

    for s in steps:
        made = producer.get(s.ins[0]) if s.is_collective and MB_AXIS in s.axes and s.ins else None
        if made is not None and made.kind != "input" and outside(s.ins[0]):
            return made, sorted(outside(s.ins[0]))
    return None


def _lower_values(sub: Lowerer, tensors) -> None:
    """Lower what ``tensors`` need that ``sub`` has not lowered yet (their values as the rules
    leave them: no re-layout to a target)."""
    if tensors:
        for n in _mark_read(sub, tensors):
            if not all(id(t) in sub.env for t in n.outputs):
                rule_for(n.op.name)(sub, n)


def _mark_read(sub: Lowerer, tensors) -> list:
    """Mark ``tensors`` and every input of the nodes they need as read in ``sub`` (so a repeat
    among them lowers with each of its optional outputs that any of them reads: an inner
    repeat's per-step outputs that a later node reads), before any is lowered; returns those
    nodes, in build order."""
    nodes = topo_nodes(list(tensors), sub.env)
    sub.used.update(id(t) for t in tensors)
    sub.used.update(id(t) for n in nodes for t in n.inputs)
    return nodes


def _linear_reads(nodes) -> dict[int, list]:
    """``id(tensor) -> [(reader, linear)]``: each read of a tensor among ``nodes``, and whether the
    reader is linear in it (jointly linear ops, an input it is linear in on its own, ``linear_in``,
    an einsum's operand)."""
    reads: dict[int, list] = {}
    for n in nodes:
        for i, x in enumerate(n.inputs):
            reads.setdefault(id(x), []).append((n, n.op.is_linear(n) or n.op.linear_in(n, i) or n.op.multilinear))
    return reads


def _lazy_through(nodes, lazy_outputs, outputs, num_forward: int, level: int) -> frozenset[int]:
    """Ids of the backward block's values that may pass on lazily, as partial sums, to every
    reader: read by ops each linear in it, one of them on a path of linear ops to a gradient the
    loop leaves partial (a stacked param's, reduced once after the layers; an outside tensor's,
    summed over them): a path to nothing else (``level`` 1: Perceiver's input array's gradient,
    read by its layer norm's backward), or, for a value with several readers, any such path (2: a
    concat's gradient whose slices reach the key weight's gradient as well as the input's; one
    reader passes a partial sum through a linear op anyway).  MQA's key gradient, partial over the
    split heads: reducing the key weight's gradient (and the input's, which joins the queries'
    partial sum) costs less than reducing it, ``[batch, key_seq, d_head]``, in every layer.
    Whether passing them on is cheaper the block's price decides (:func:`_lower_block`)."""
    reads = _linear_reads(nodes)
    want, outs = {id(t) for t in lazy_outputs}, {id(t) for t in outputs}
    to_lazy: set[int] = set()   # ids of nodes whose results reach ``want`` (level 1: only it, or nothing)
    for n in reversed(nodes):
        if level == 1 and all(id(t) in want or (id(t) not in outs and all(
                lin and r.id in to_lazy for r, lin in reads.get(id(t), ()))) for t in n.outputs):
            to_lazy.add(n.id)
        if level == 2 and any(id(t) in want or any(lin and r.id in to_lazy for r, lin in reads.get(id(t), ()))
                              for t in n.outputs):
            to_lazy.add(n.id)
    # level 2: where a partial sum branches, or enters an op whose result outgrows it (a row sum's
    # gradient broadcast back over d_head: priced alone, reducing first looks cheaper), not every
    # linear op on a path
    least = 1 if level == 1 else 2
    return frozenset(id(t) for n in nodes if n.id >= num_forward for t in n.outputs
                     if t.dtype.is_floating_point and _branches(reads.get(id(t), ()), least)
                     and all(lin for _, lin in reads[id(t)]) and any(r.id in to_lazy for r, _ in reads[id(t)]))


def _branches(reads, least: int) -> bool:
    """Whether a value read as ``reads`` says has ``least`` readers, or one whose result has more
    elements than its inputs (a broadcast)."""
    if len(reads) != 1:
        return len(reads) >= least
    r = reads[0][0]
    return least == 1 or sum(t.shape.numel for t in r.outputs) > sum(t.shape.numel for t in r.inputs)


def _lower_backward_block(sub: Lowerer, blk, summed: bool, through: bool = False) -> tuple[dict[str, int], bool]:
    """The backward block's outputs: the carry gradient in the carry's layout, each stacked
    param's gradient lazily (in its layout, partial sums kept), and each closed-over tensor's
    as its rules leave it (partial sums kept whatever its layout: the loop adds the layers'
    up before anything reduces them).  A partial sum read both on the way to such a gradient
    and elsewhere passes on lazily to both when ``summed`` (:meth:`.Lowerer.count_readers`): its
    share of the gradient is reduced once after the layers, not at its first reader per layer.
    When ``through``, a value :func:`_lazy_through` marks passes on partial to every reader.
    Also returns whether ``summed`` changed how any value's readers count."""
    dcarries = {carry_name("dcarry", i): g for i, g in enumerate(blk.extra["dcarries"])}
    outs = {**dcarries, **{f"d/{k}": g for k, g in blk.extra["dparams"].items()}}
    dclosed = {f"d/{k}": g for k, g in blk.extra["dclosed"].items()}
    fewer = sub.count_readers([*outs.values(), *dclosed.values()], summed=dclosed.values() if summed else ())
    if through:
        lazy = [*dclosed.values(), *(g for k, g in outs.items() if k not in dcarries)]
        every = [*outs.values(), *dclosed.values()]
        nodes, num_forward = topo_nodes(every, sub.env), blk.extra.get("num_forward", 0)
        sub.lazy_through = _lazy_through(nodes, lazy, every, num_forward, 1) | _lazy_through(
            nodes, lazy, every, num_forward, 2)
    # every phase's reads marked first: a recomputed inner repeat lowers once, with the per-step
    # outputs a later phase reads (a stacked param's gradient linear in them), not once per phase
    _mark_read(sub, [*outs.values(), *dclosed.values()])
    ids = lower_into(sub, dcarries)
    ids.update(lower_into(sub, {k: v for k, v in outs.items() if k not in dcarries}, lazy=True))
    _lower_values(sub, list(dclosed.values()))
    ids.update((k, sub.value(g)) for k, g in dclosed.items())
    return ids, fewer


def _bind_outputs(lw: Lowerer, loop: _Loop, out_vids: list, stage: tuple) -> None:
    """Bind the step's outputs to the node's.

    The carry (and its gradient) take the carry's layout; the stacked layer inputs the stacked
    params' (an inner repeat's stay whole over its gathered scanned dim: only its gradient reads
    them, so).  The stacked parameter gradients stay
    as the block made them (split like the sub-plan's, partial sums lazy): their reader (the
    update, sharded like the param) brings them where it needs them, so an FSDP gradient the
    block reduce-scattered is not gathered here only to be split again by the update.  So do
    the gradients of closed-over tensors, but in a pipeline their sums over the stages are
    made at once, with their sums over the micro-batches (one allreduce; over the stage axis
    alone, for a tensor made per micro-batch, the partition turns it into transfers between
    stages, :mod:`.stage_sum`).  The per-layer outputs and saved activations stay as the
    forward sub-plan made them.
    """
    node, num_stacked, nc = loop.node, len(loop.names), loop.num_carries
    if loop.backward:
        for t, vid in zip(node.outputs[nc:nc + num_stacked], out_vids[nc:nc + num_stacked]):
            lw.bind(t, vid)
        dclosed = loop.blk.extra["dclosed"]
        leaf = [c.node.op.name == "param" for k, c in zip(loop.blk.closed, loop.closed) if k in dclosed]
        for t, vid, of_param in zip(node.outputs[nc + num_stacked:], out_vids[nc + num_stacked:], leaf, strict=True):
            sh = lw.sharding(vid)
            if stage:
                # a shared param's gradient is summed over the axes its target leaves whole (``data``)
                # with the stages: one allreduce (a sum over both), which the final segment buckets
                whole = (a for a in sh.partial if of_param and a not in lw.target(t).used_axes)
                axes = (*stage, MB_AXIS, *whole)
                vid = lw.relayout(vid, sh.with_partial(tuple(a for a in sh.partial if a not in axes)), node,
                                  f"gradient of '{t.name}', summed over the stages")
            lw.bind(t, vid)
    else:
        names, base = loop.blk.y_names, 2 * nc + len(loop.blk.y_names)
        rest = [node.outputs[2 * nc + names.index(k)] for k in loop.ys] + [node.outputs[base + i] for i in loop.want]
        for t, vid in zip(rest, out_vids[2 * nc:]):
            lw.bind(t, vid)
    n_main = nc if loop.backward else 2 * nc
    for j, (t, vid) in enumerate(zip(node.outputs[:n_main], out_vids)):
        to = lw.target(t)
        if lw.in_block and not loop.backward and j >= nc and to.axes_of(loop.layer) != tuple(loop.layer_axes):
            # an inner repeat's gathered layer inputs, read by its gradient only: kept whole
            to = _stack_sharding(_slice_sharding(to, loop.layer), t.shape, loop.layer, loop.layer_axes)
        kept = tuple(a for a in lw.sharding(vid).partial if a not in to.used_axes)
        lw.bind(t, lw.relayout(vid, to.with_partial(kept), node, f"output of {node.op.name}"))
