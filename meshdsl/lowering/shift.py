"""Lowering of shift/roll along a possibly split dim: a neighbour exchange.

When the dim is split over axes A, each rank cuts the strip that leaves its
slice, sends it one step along A (a collective permute), and glues what it
receives onto the other end.  Zero fill at the ends for shift, wrap for roll.
A shift longer than a local slice falls back to gathering the dim.
"""
from __future__ import annotations

from ..layout.sharding import Sharding
from ..ops.slicing import shift_local
from .rules import lowering


def _strip(ctx, attrs, x):
    k, pos = attrs["offset"], attrs["pos"]
    n = x.shape[pos]
    return x.narrow(pos, n - k, k) if k > 0 else x.narrow(pos, 0, -k)


def _glue(ctx, attrs, x, incoming):
    return shift_local(x, incoming, attrs["offset"], attrs["pos"])


@lowering("shift")
def lower_shift(lw, node) -> None:
    """Lower a shift or roll; see the module docstring."""
    mesh = lw.mesh
    (t,) = node.inputs
    out = node.outputs[0]
    vid = lw.value(t)
    cur = lw.sharding(vid)
    name, k = node.attrs["dim"], node.attrs["offset"]
    tgt = lw.target(out)
    # Compute in the target's split when the input can get there cheaply, else as the input is.
    comp = Sharding(tgt.dims) if not cur.partial else Sharding(cur.dims)
    axes = comp.axes_of(name)
    local_n = t.shape.get(name).size // mesh.axis_size(axes)
    if axes and abs(k) > local_n:
        comp = Sharding.of(t.shape, {n: a for n, a in comp.split.items() if n != name})
        axes = ()
        lw.note(f"{node.name}: shift by {k} exceeds the local slice of '{name}'; the dim is gathered")
    vid = lw.relayout(vid, comp, node, "input of shift")
    sizes = {d.name: d.size for d in t.shape}
    res = lw.new_value(out.shape, out.dtype, comp)
    if not axes or k == 0:
        lw.emit("local", node, [vid], [res], args={"fn": node.op.compute, "attrs": node.attrs,
                                                   "compute": comp.split, "sizes": sizes},
                flops=comp.local_numel(t.shape, mesh))
    else:
        strip_shape = t.shape  # the strip is a value of its own; its sharding is the compute's
        strip = lw.new_value(strip_shape, t.dtype, comp)
        lw.emit("local", node, [vid], [strip], args={"fn": _strip, "attrs": node.attrs, "compute": comp.split,
                                                     "sizes": sizes}, note="boundary strip")
        got = lw.new_value(strip_shape, t.dtype, comp)
        nbytes = comp.local_numel(t.shape, mesh) // local_n * abs(k) * t.dtype.itemsize
        lw.emit("permute", node, [strip], [got], axes, args={"offset": 1 if k > 0 else -1,
                                                            "wrap": node.attrs["wrap"]}, nbytes=nbytes)
        lw.emit("local", node, [vid, got], [res], args={"fn": _glue, "attrs": node.attrs,
                                                        "compute": comp.split, "sizes": sizes},
                flops=comp.local_numel(t.shape, mesh))
    lw.bind(out, lw.relayout(res, tgt, node, "output of shift"))

