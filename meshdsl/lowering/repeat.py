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

The plan step is data: kind ``repeat``, the block's sub-plan in ``subplans``,
the layer count in ``times``; :mod:`meshdsl.exec.loop` runs it.
"""
from __future__ import annotations

from dataclasses import replace

from ..core.graph import topo_nodes
from ..core.shape import Shape
from ..errors import LayoutError, message
from ..layout.sharding import Sharding
from .compiler import Lowerer, lower_into
from .plan import Plan, register_step_kind
from .rules import lowering, rule_for

# names: the stacked params (sub-plan inputs); pos: each one's layer dim position;
# backward: a repeat_grad; saved: names of the saved activations the sub-plan outputs
# (forward) or takes (backward).
# streamed: (backward) names whose gradient the sub-plan reduces per layer (lowering/bucket.py,
# stream_loop_grads): the loop starts those reductions as each layer's gradient is made.
register_step_kind("repeat", ("names", "pos", "backward", "saved", "streamed"))


def _slice_sharding(stacked: Sharding, layer: str) -> Sharding:
    return Sharding(tuple((n, a) for n, a in stacked.dims if n != layer), stacked.partial)


def _stack_sharding(sub: Sharding, shape, layer: str, layer_axes=()) -> Sharding:
    split = dict(sub.dims)
    return Sharding(tuple((d.name, tuple(layer_axes) if d.name == layer else split[d.name]) for d in shape),
                    sub.partial)


@lowering("repeat", "repeat_grad")
def lower_repeat(lw: Lowerer, node) -> None:
    """Lower a repeat (or its gradient) to one step that runs the block's sub-plan per layer."""
    backward = node.op.name == "repeat_grad"
    mesh = lw.mesh
    blk = node.attrs["block"]
    layer = node.attrs["layer"].name
    stacked = node.attrs["stacked"]
    names = list(blk.params)
    saved_names: list[str] = []
    if backward:
        carries_t, *rest = node.inputs
        stacked_t, dy_t, saved_t = rest[:len(names)], rest[len(names)], rest[len(names) + 1:]
        carry_shape = dy_t.shape
        given = blk.extra.get("given", {})
        assert len(given) == len(saved_t), "repeat_grad: saved activations do not match its block"
        saved_names = list(given)  # sub-plan inputs, in the order of the saved_t inputs
    else:
        x_t, *stacked_t = node.inputs
        carry_shape = x_t.shape
        used = lw.used
        saved = node.attrs.get("saved", [])
        want = [i for i in range(len(saved)) if id(node.outputs[2 + i]) in used]
    carry_sh = lw.layout.targets(carry_shape, (), mesh, "carry", False)[0][0]
    ins = []
    if backward:
        la = lw.targets(stacked[names[0]], strict=True)[0][0].axes_of(layer) if names else ()
        ins.append(lw.relayout(lw.value(carries_t), _stack_sharding(
            carry_sh, Shape([node.attrs["layer"]] + list(carry_shape)), layer, la), node, "saved layer inputs"))
    else:
        ins.append(lw.relayout(lw.value(x_t), carry_sh, node, "carry"))
    slice_sh = {}
    layer_axes: tuple[str, ...] = ()
    for k, t in zip(names, stacked_t):
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
        ins.append(lw.relayout(lw.value(dy_t), carry_sh, node, "carry gradient"))
        for t in saved_t:  # as the forward saved them: no re-layout
            ins.append(lw.value(t))
            assert not lw.sharding(ins[-1]).partial and mesh.axis_size(lw.sharding(ins[-1]).axes_of(layer)) \
                == mesh.axis_size(layer_axes)

    sub = Lowerer(mesh, lw.layout, lw.cost)
    feeds = {"carry": carry_sh, **slice_sh}
    if backward:
        feeds["cotangent"] = carry_sh
    for name, sh in feeds.items():
        t = blk.graph.inputs[name]
        vid = sub.new_value(t.shape, t.dtype, sh)
        sub.emit("input", t.node, [], [vid], args={"name": name, "tensor": t})
        sub.inputs[name] = vid
        sub.bind(t, vid)
    if backward:  # the saved activations are given: lower_into does not lower what they need
        for (name, t), vid_out in zip(given.items(), ins[len(ins) - len(saved_t):]):
            vid = sub.new_value(t.shape, t.dtype, _slice_sharding(lw.sharding(vid_out), layer))
            sub.emit("input", t.node, [], [vid], args={"name": name, "tensor": t}, op="saved",
                     label=f"saved {t.name}")
            sub.inputs[name] = vid
            sub.bind(t, vid)
        outs = {"dcarry": blk.extra["dcarry"], **{f"d/{k}": g for k, g in blk.extra["dparams"].items()}}
        sub.count_readers(outs.values())
        ids = lower_into(sub, {"dcarry": outs["dcarry"]})
        ids.update(lower_into(sub, {k: v for k, v in outs.items() if k != "dcarry"}, lazy=True))
    else:
        sub.count_readers([blk.out, *(saved[i] for i in want)])
        ids = lower_into(sub, {"out": blk.out})
        if want:
            for n in topo_nodes([saved[i] for i in want], sub.env):  # normally all lowered already
                if not all(id(t) in sub.env for t in n.outputs):
                    rule_for(n.op.name)(sub, n)
        for i in want:
            f = saved[i]
            vid = sub.reduced(sub.value(f))
            if sub.sharding(vid).partial:
                vid = sub.relayout(vid, sub.sharding(vid).with_partial(()), f.node, "saved activation")
            saved_names.append(f"saved/{i}")
            ids[saved_names[-1]] = vid
    steps = [replace(s, phase=node.phase) for s in sub.steps]  # the block runs in its node's phase
    plan = Plan(mesh, lw.layout, steps, sub.values, ids, {}, sub.inputs, sub.notes)
    for n in sub.notes:
        lw.note(f"{node.name} block: {n}")

    L = node.attrs["layer"].size // mesh.axis_size(layer_axes)  # layers per stage
    out_vids = []
    if backward:
        out_vids.append(lw.new_value(carry_shape, dy_t.dtype, carry_sh))
        for k, t in zip(names, stacked_t):
            out_vids.append(lw.new_value(t.shape, t.dtype, _stack_sharding(plan.values[ids[f"d/{k}"]].sharding,
                                                                            t.shape, layer, layer_axes)))
    else:
        out_vids.append(lw.new_value(carry_shape, x_t.dtype, carry_sh))
        cs = node.outputs[1].shape
        out_vids.append(lw.new_value(cs, x_t.dtype, _stack_sharding(carry_sh, cs, layer, layer_axes)))
        for i in want:
            t = node.outputs[2 + i]
            out_vids.append(lw.new_value(t.shape, t.dtype, _stack_sharding(
                plan.values[ids[f"saved/{i}"]].sharding, t.shape, layer, layer_axes)))
    pos = node.attrs["pos"]
    lw.emit("repeat", node, ins, out_vids,
            args={"names": tuple(names), "pos": dict(pos), "backward": backward, "saved": tuple(saved_names)},
            subplans=(plan,), times=L)
    # The carry (and its gradient) take the carry's layout.  The stacked parameter gradients stay
    # as the block made them (split like the sub-plan's, partial sums lazy): their reader (the
    # update, sharded like the param) brings them where it needs them, so an FSDP gradient the
    # block reduce-scattered is not gathered here only to be split again by the update.
    if backward:
        for t, vid in zip(node.outputs[1:], out_vids[1:]):
            lw.bind(t, vid)
    n_main = 1 if backward else 2
    for t, vid in zip(node.outputs[:n_main], out_vids):
        lw.bind(t, lw.relayout(vid, lw.target(t).with_partial(
            tuple(a for a in lw.sharding(vid).partial if a not in lw.target(t).used_axes)), node,
            f"output of {node.op.name}"))
    if not backward:  # saved activations stay as the forward sub-plan made them
        for i, vid in zip(want, out_vids[2:]):
            lw.bind(node.outputs[2 + i], vid)

