"""Lowering of flip: local where its dims are whole, one reversing permute where they are split.

Over the ``p`` ranks of the axes that split a flipped dim evenly, rank ``j`` holds block ``j``;
block ``j`` of the flip is block ``p - 1 - j`` of the input, flipped.  So each rank flips its own
block and trades it with the mirrored rank: one ``permute`` with ``reverse`` (member ``j``
receives member ``p - 1 - j``'s block; the middle rank of an odd group keeps its own), one
block's bytes a rank, where gathering the dim would move ``p - 1`` blocks.  Flipping several
dims split over several axes reverses every one of those axes' indices, which is the group
index over all of them reversed: one permute serves them all.

Where the blocks do not line up, the node is lowered generically, which gathers the dim (an
allgather, priced by the cost model) and flips it whole: a dim cut unevenly (7 rows over 3
ranks: 3, 2, 2, whose reversed blocks straddle two ranks), at given or block-cyclic parts, split
by micro-batches, or an output its layout wants split otherwise (the gather it would need after
the permute moves the dim anyway).
"""
from __future__ import annotations

from ..layout.sharding import is_even
from .generic import lower_generic
from .plan import MB_AXIS
from .relayout import keep_microbatches
from .rules import lowering


def _why_gathered(lw, dims, cur, tgt, shape) -> str:
    """Why a flip of ``dims`` (input at ``cur``, output wanted at ``tgt``) gathers rather than
    trades blocks, or "" where one reversing permute serves it."""
    for d in dims:
        axes = cur.axes_of(d)
        if not axes:
            continue
        size = shape.get(d).size
        if MB_AXIS in axes:
            return f"'{d}' is split by micro-batches"
        if d in cur.given_parts or d in cur.cyclic_blocks:
            return f"'{d}' is split at given or block-cyclic parts"
        if not is_even(size, lw.mesh, axes):
            return (f"'{d}' ({size}) is split unevenly over {','.join(axes)}: its reversed blocks do not "
                    "line up with the ranks' parts")
        if tgt.axes_of(d) != axes:
            return f"its output's layout wants '{d}' split otherwise"
    return ""


@lowering("flip")
def lower_flip(lw, node) -> None:
    """Lower a flip; see the module docstring."""
    mesh, src, out, dims = lw.mesh, node.inputs[0], node.outputs[0], node.attrs["dims"]
    vid = lw.reduced(lw.value(src))
    cur = lw.sharding(vid)
    axes = tuple(a for d in dims for a in cur.axes_of(d))
    if not axes:
        lower_generic(lw, node)
        return
    # A partial sum passes through (a flip is linear) where the flip is its only reader, as the
    # generic rule lets it through linear ops; otherwise it is reduced first, once for all readers.
    comp = cur if lw.num_uses(src) == 1 else cur.with_partial(())
    tgt = lw.target(out)
    tgt = keep_microbatches(tgt.with_partial(tuple(a for a in comp.partial if a not in tgt.used_axes)),
                            comp, out.shape, mesh)
    why = _why_gathered(lw, dims, comp, tgt, src.shape)
    if why:
        lw.note(f"{node.name}: {why}; the dim is gathered")
        lower_generic(lw, node)
        return
    vid = lw.relayout(vid, comp, node, "input of flip")
    sizes = {d.name: d.size for d in src.shape}
    own = lw.new_value(out.shape, out.dtype, comp)
    lw.emit("local", node, [vid], [own], args={"fn": node.op.compute, "attrs": node.attrs,
                                               "compute": comp.split, "sizes": sizes},
            flops=comp.local_numel(out.shape, mesh))
    mirrored = lw.new_value(out.shape, out.dtype, comp)
    lw.emit("permute", node, [own], [mirrored], axes, args={"offset": 0, "wrap": False, "reverse": True},
            nbytes=lw.values[own].local_bytes(mesh),
            note=f"flip: each rank's block of {', '.join(repr(d) for d in dims if comp.axes_of(d))} "
                 "to the rank mirrored across " + ",".join(axes))
    lw.bind(out, lw.relayout(mirrored, tgt, node, "output of flip"))
