"""Lowering of ``scalar_sum``: one reduction per set of mesh axes, however many inputs.

The inputs are sums of squares of gradients, each a lazy partial sum over the
axes its gradient is split on (a tensor-parallel weight: ``model``; an FSDP
weight: ``data``; both: both).  Adding them pairwise would reduce at every
change of axis set; instead the inputs are grouped by their partial axes, each
group is added locally and reduced by one allreduce of a scalar, and the group
results are added.  The plan thus holds one scalar allreduce per distinct axis
set, and the norm is exact under any layout.
"""
from __future__ import annotations

from ..layout.sharding import Sharding
from .rules import lowering


@lowering("scalar_sum")
def _lower_scalar_sum(lw, node) -> None:
    t = node.outputs[0]
    groups: dict[tuple[str, ...], list[int]] = {}
    for x in node.inputs:
        vid = lw.value(x)
        axes = tuple(a for a in lw.mesh.names if a in lw.sharding(vid).partial)
        groups.setdefault(axes, []).append(vid)
    fn, attrs = node.op.compute, node.attrs
    done = []
    for axes, vids in groups.items():
        part = lw.new_value(t.shape, t.dtype, Sharding.replicated(t.shape).with_partial(axes))
        lw.emit("local", node, vids, [part], args={"fn": fn, "inplace": None, "attrs": attrs,
                                                   "compute": {}, "sizes": {}},
                flops=len(vids), note=f"{len(vids)} sum(s) of squares partial over {list(axes) or 'no axis'}")
        done.append(lw.relayout(part, Sharding.replicated(t.shape), node, "global norm"))
    if len(done) == 1:
        lw.bind(t, done[0])
        return
    out = lw.new_value(t.shape, t.dtype, Sharding.replicated(t.shape))
    lw.emit("local", node, done, [out], args={"fn": fn, "inplace": None, "attrs": attrs, "compute": {},
                                              "sizes": {}}, flops=len(done))
    lw.bind(t, out)
