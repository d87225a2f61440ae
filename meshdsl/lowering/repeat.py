"""Lowering of repeat / repeat_grad: the block becomes a sub-plan run once per layer.

The carry keeps the layout its dims have everywhere; each stacked param is
sliced along ``layer`` locally.  ``layer`` is whole, or split over the pipeline
axis (:mod:`.pipeline`): then each stage's sub-plan runs its ``layers / p`` local
layers, and the stacked carries, activations and gradients stay split like the
params.  In the backward block, parameter gradients may stay lazy partial sums,
so they are reduced once, stacked, after the loop.

The forward sub-plan also outputs the activations the backward block reads
(``attrs["saved"]``, only those this plan uses), each in the sharding the forward
produced it in (reduced if partial); they are stacked over ``layer`` and the
backward sub-plan takes them as inputs instead of recomputing the forward.

Tensors the block reads from outside (:mod:`meshdsl.ir.closure`) are fed to every
layer in their own layout, reduced; the backward sub-plan outputs each one's gradient as
its rules leave it, and the loop sums the layers' (a sum over the stages too when the
layers are pipelined: one allreduce over the stage axis, made transfers by
:mod:`.partition`).

The plan step is data: kind ``repeat``, the block's sub-plan in ``subplans``,
the layer count in ``times``; :mod:`meshdsl.exec.loop` runs it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..core.graph import topo_nodes
from ..core.shape import Shape
from ..errors import LayoutError, message
from ..layout.sharding import Sharding
from .compiler import Lowerer, lower_into
from .pipeline import MB_AXIS
from .plan import Plan, register_step_kind
from .rules import lowering, rule_for

# names: the stacked params (sub-plan inputs); pos: each one's layer dim position;
# backward: a repeat_grad; saved: names of the saved activations the sub-plan outputs
# (forward) or takes (backward).
# streamed: (backward) names whose gradient the sub-plan reduces per layer (lowering/bucket.py,
# stream_loop_grads): the loop starts those reductions as each layer's gradient is made.
# closed: (only when the block reads tensors from outside) their sub-plan input names, fed after the
# stacked params (forward) or the saved activations (backward); a backward step outputs, after the
# stacked gradients, the gradient of each one the block differentiates (sub-plan output "d/<name>"),
# summed over the layers.
register_step_kind("repeat", ("names", "pos", "backward", "saved", "streamed", "closed"))


def _slice_sharding(stacked: Sharding, layer: str) -> Sharding:
    return Sharding(tuple((n, a) for n, a in stacked.dims if n != layer), stacked.partial)


def _stack_sharding(sub: Sharding, shape, layer: str, layer_axes=()) -> Sharding:
    split = dict(sub.dims)
    return Sharding(tuple((d.name, tuple(layer_axes) if d.name == layer else split[d.name]) for d in shape),
                    sub.partial)


@dataclass
class _Operands:
    """A repeat node's (or repeat_grad node's) inputs by role."""

    carry: object            # the carry (forward), or the stacked layer inputs (backward)
    stacked: list
    dy: object = None        # the carry gradient (backward)
    saved: list = field(default_factory=list)   # the saved activations (backward)
    closed: list = field(default_factory=list)  # the tensors the block reads from outside


def _operands(node, backward: bool) -> _Operands:
    blk = node.attrs["block"]
    n, ins = len(blk.params), node.inputs
    closed = list(ins[len(ins) - len(blk.closed):])
    if not backward:
        return _Operands(ins[0], list(ins[1:1 + n]), closed=closed)
    given = blk.extra.get("given", {})
    ops = _Operands(ins[0], list(ins[1:1 + n]), ins[1 + n], list(ins[2 + n:2 + n + len(given)]), closed)
    assert len(ins) == 2 + n + len(given) + len(closed), "repeat_grad: saved activations do not match its block"
    return ops


@lowering("repeat", "repeat_grad")
def lower_repeat(lw: Lowerer, node) -> None:
    """Lower a repeat (or its gradient) to one step that runs the block's sub-plan per layer."""
    backward = node.op.name == "repeat_grad"
    mesh = lw.mesh
    blk = node.attrs["block"]
    layer = node.attrs["layer"].name
    stacked = node.attrs["stacked"]
    names = list(blk.params)
    ops = _operands(node, backward)
    saved_names: list[str] = []
    if backward:
        carry_shape = ops.dy.shape
        given = blk.extra.get("given", {})
        saved_names = list(given)  # sub-plan inputs, in the order of the saved inputs
    else:
        carry_shape = ops.carry.shape
        saved = node.attrs.get("saved", [])
        want = [i for i in range(len(saved)) if id(node.outputs[2 + i]) in lw.used]
    carry_sh = lw.layout.targets(carry_shape, (), mesh, "carry", False)[0][0]
    ins = []
    if backward:
        la = lw.targets(stacked[names[0]], strict=True)[0][0].axes_of(layer) if names else ()
        ins.append(lw.relayout(lw.value(ops.carry), _stack_sharding(
            carry_sh, Shape([node.attrs["layer"]] + list(carry_shape)), layer, la), node, "saved layer inputs"))
    else:
        ins.append(lw.relayout(lw.value(ops.carry), carry_sh, node, "carry"))
    slice_sh = {}
    layer_axes: tuple[str, ...] = ()
    for k, t in zip(names, ops.stacked):
        tgt = lw.targets(stacked[k], strict=True)[0][0]
        layer_axes = tgt.axes_of(layer)
        if mesh.axis_size(layer_axes) > 1 and layer_axes != (lw.pipeline_axis,):
            raise LayoutError(message(
                f"repeat '{node.name}': stacked param '{k}' splits dim '{layer}' over mesh axes "
                f"{tgt.axes_of(layer)}.", inputs=[f"layout: {lw.layout}", f"mesh: {mesh}"],
                rule="a repeat inside a block runs its layers in sequence on every rank, so 'layer' must be whole",
                fix=f"remove the '{layer}:...' rule; only the outermost repeat can be a pipeline"))
        ins.append(lw.relayout(lw.value(t), tgt, node, f"stacked param '{k}'"))
        slice_sh[k] = _slice_sharding(tgt, layer)
    if backward:
        ins.append(lw.relayout(lw.value(ops.dy), carry_sh, node, "carry gradient"))
        for t in ops.saved:  # as the forward saved them: no re-layout
            ins.append(lw.value(t))
            assert not lw.sharding(ins[-1]).partial and mesh.axis_size(lw.sharding(ins[-1]).axes_of(layer)) \
                == mesh.axis_size(layer_axes)
    closed_sh = {}
    for k, t in zip(blk.closed, ops.closed):  # in its own layout, whole sums: every layer reads it
        why = f"'{t.name}', read by every layer"
        ins.append(lw.relayout(lw.reduced(lw.value(t)), lw.target(t).with_partial(()), node, why))
        closed_sh[k] = lw.sharding(ins[-1])

    sub = Lowerer(mesh, lw.layout, lw.cost)
    feeds = {"carry": carry_sh, **slice_sh}
    if backward:
        feeds["cotangent"] = carry_sh
    feeds.update(closed_sh)
    for name, sh in feeds.items():
        t = blk.graph.inputs[name]
        vid = sub.new_value(t.shape, t.dtype, sh)
        sub.emit("input", t.node, [], [vid], args={"name": name, "tensor": t})
        sub.inputs[name] = vid
        sub.bind(t, vid)
    if backward:  # the saved activations are given: lower_into does not lower what they need
        for (name, t), vid_out in zip(given.items(), ins[len(ins) - len(ops.closed) - len(ops.saved):]):
            vid = sub.new_value(t.shape, t.dtype, _slice_sharding(lw.sharding(vid_out), layer))
            sub.emit("input", t.node, [], [vid], args={"name": name, "tensor": t}, op="saved",
                     label=f"saved {t.name}")
            sub.inputs[name] = vid
            sub.bind(t, vid)
        ids = _lower_backward_block(sub, blk)
    else:
        sub.count_readers([blk.out, *(saved[i] for i in want)])
        ids = lower_into(sub, {"out": blk.out})
        _lower_values(sub, [saved[i] for i in want])
        for i in want:
            f = saved[i]
            vid = sub.reduced(sub.value(f))
            if sub.sharding(vid).partial:
                vid = sub.relayout(vid, sub.sharding(vid).with_partial(()), f.node, "saved activation")
            saved_names.append(f"saved/{i}")
            ids[saved_names[-1]] = vid
    _check_no_microbatch_sums(lw, node, sub.steps)
    steps = [replace(s, phase=node.phase) for s in sub.steps]  # the block runs in its node's phase
    plan = Plan(mesh, lw.layout, steps, sub.values, ids, {}, sub.inputs, sub.notes)
    for n in sub.notes:
        lw.note(f"{node.name} block: {n}")

    # The stage axis when the layers are pipelined: each stage sums its own layers' gradients
    # of a closed-over tensor, so the step's sum is partial over it.
    stage = layer_axes if mesh.axis_size(layer_axes) > 1 else ()
    L = node.attrs["layer"].size // mesh.axis_size(layer_axes)  # layers per stage
    out_vids = []
    if backward:
        out_vids.append(lw.new_value(carry_shape, ops.dy.dtype, carry_sh))
        for k, t in zip(names, ops.stacked):
            out_vids.append(lw.new_value(t.shape, t.dtype, _stack_sharding(plan.values[ids[f"d/{k}"]].sharding,
                                                                            t.shape, layer, layer_axes)))
        for k, t in zip(blk.closed, ops.closed):
            if k in blk.extra["dclosed"]:
                sh = plan.values[ids[f"d/{k}"]].sharding
                out_vids.append(lw.new_value(t.shape, t.dtype, sh.with_partial(sh.partial + stage)))
    else:
        out_vids.append(lw.new_value(carry_shape, ops.carry.dtype, carry_sh))
        cs = node.outputs[1].shape
        out_vids.append(lw.new_value(cs, ops.carry.dtype, _stack_sharding(carry_sh, cs, layer, layer_axes)))
        for i in want:
            t = node.outputs[2 + i]
            out_vids.append(lw.new_value(t.shape, t.dtype, _stack_sharding(
                plan.values[ids[f"saved/{i}"]].sharding, t.shape, layer, layer_axes)))
    pos = node.attrs["pos"]
    args = {"names": tuple(names), "pos": dict(pos), "backward": backward, "saved": tuple(saved_names)}
    if blk.closed:
        args["closed"] = tuple(blk.closed)
    lw.emit("repeat", node, ins, out_vids, args=args, subplans=(plan,), times=L)
    _bind_outputs(lw, node, backward, out_vids, len(names), stage)
    if not backward:  # saved activations stay as the forward sub-plan made them
        for i, vid in zip(want, out_vids[2:]):
            lw.bind(node.outputs[2 + i], vid)


def _check_no_microbatch_sums(lw: Lowerer, node, steps) -> None:
    """Refuse a block that sums over the micro-batches inside its layers: they run one
    micro-batch at a time (a sum over the batch must leave the block as a partial sum)."""
    bad = next((s for s in steps if s.is_collective and MB_AXIS in s.axes), None)
    if bad is not None:
        raise LayoutError(message(
            f"repeat '{node.name}': '{bad.label}' ({bad.op}) in its block sums over the micro-batches in every layer.",
            inputs=[f"mesh: {lw.mesh}", f"layout: {lw.layout}"], bullets=[f"{bad.kind} over {bad.axes}: {bad.note}"],
            rule="a repeat's layers run one micro-batch at a time, so a sum over the batch leaves the block "
                 "unreduced and is added up after the micro-batches",
            fix="compute what the op reads outside the block (a lookup into a table read from outside: before "
                "the repeat) and read the result in the block, or use microbatches=1"))


def _lower_values(sub: Lowerer, tensors) -> None:
    """Lower what ``tensors`` need that ``sub`` has not lowered yet (their values as the rules
    leave them: no re-layout to a target)."""
    if tensors:
        sub.used.update(id(t) for t in tensors)
        for n in topo_nodes(list(tensors), sub.env):
            sub.used.update(id(t) for t in n.inputs)
            if not all(id(t) in sub.env for t in n.outputs):
                rule_for(n.op.name)(sub, n)


def _lower_backward_block(sub: Lowerer, blk) -> dict[str, int]:
    """The backward block's outputs: the carry gradient in the carry's layout, each stacked
    param's gradient lazily (in its layout, partial sums kept), and each closed-over tensor's
    as its rules leave it (partial sums kept whatever its layout: the loop adds the layers'
    up before anything reduces them)."""
    outs = {"dcarry": blk.extra["dcarry"], **{f"d/{k}": g for k, g in blk.extra["dparams"].items()}}
    dclosed = {f"d/{k}": g for k, g in blk.extra["dclosed"].items()}
    sub.count_readers([*outs.values(), *dclosed.values()])
    ids = lower_into(sub, {"dcarry": outs["dcarry"]})
    ids.update(lower_into(sub, {k: v for k, v in outs.items() if k != "dcarry"}, lazy=True))
    _lower_values(sub, list(dclosed.values()))
    ids.update((k, sub.value(g)) for k, g in dclosed.items())
    return ids


def _bind_outputs(lw: Lowerer, node, backward: bool, out_vids: list, num_stacked: int, stage: tuple) -> None:
    """Bind the step's outputs to the node's.

    The carry (and its gradient) take the carry's layout.  The stacked parameter gradients stay
    as the block made them (split like the sub-plan's, partial sums lazy): their reader (the
    update, sharded like the param) brings them where it needs them, so an FSDP gradient the
    block reduce-scattered is not gathered here only to be split again by the update.  So do
    the gradients of closed-over tensors, but in a pipeline their sums over the stages are
    made at once, with their sums over the micro-batches (one allreduce; over the stage axis
    alone, for a tensor made per micro-batch, the partition turns it into transfers between
    stages, :mod:`.stage_sum`).
    """
    if backward:
        for t, vid in zip(node.outputs[1:1 + num_stacked], out_vids[1:1 + num_stacked]):
            lw.bind(t, vid)
        for t, vid in zip(node.outputs[1 + num_stacked:], out_vids[1 + num_stacked:]):
            sh = lw.sharding(vid)
            if stage:
                axes = (*stage, MB_AXIS)
                vid = lw.relayout(vid, sh.with_partial(tuple(a for a in sh.partial if a not in axes)), node,
                                  f"gradient of '{t.name}', summed over the stages")
            lw.bind(t, vid)
    n_main = 1 if backward else 2
    for t, vid in zip(node.outputs[:n_main], out_vids):
        lw.bind(t, lw.relayout(vid, lw.target(t).with_partial(
            tuple(a for a in lw.sharding(vid).partial if a not in lw.target(t).used_axes)), node,
            f"output of {node.op.name}"))
