"""Lowering of ``reshape`` and ``rearrange``: a mesh split survives a merge or a split of dims
wherever row-major order allows, so no data moves (Mesh-TF's reshape rule).

A reshape regroups dims: each group of consecutive input dims becomes a group of
consecutive output dims with the same number of elements (a rearrange splits
each input dim into parts, moves parts, and merges parts into output dims: two
regroupings with a transpose between them).  A rank's slice of a group is one
contiguous run of its row-major elements when the group's split dims come first
(the outermost dims of size > 1, each split whole but the last) and the rest are
whole.  Its axes, in that order, cut the run into blocks; the same axes split
the output group from its outer end, an axis at a time, where each axis's size
divides what is left of the dim it lands on.  Then the local reshape of the
local slice *is* the output's local slice, and no data moves:

* ``[height, width] -> [(height width)]`` with ``height:data`` may give the
  merged dim split over ``data``; ``width:data`` may not (a rank's slice is not one
  run), so the split moves first.
* ``height -> [hp, ph]`` with ``height:data`` may give ``hp:data`` (``hp`` the
  outer part, when ``data``'s size divides it); with ``height:(x,y)``, ``x``
  and ``y`` may land on ``hp`` and ``ph`` in turn.
* a dim that passes alone (``batch`` in ``batch (h p) d -> batch h p d``) keeps any split,
  an uneven one too (``batch`` 6 on 4 ranks: 2, 2, 1, 1 rows): each rank regroups its own rows.
* a merged dim split block-cyclically (``Layout.cyclic``, GPT-2's ``(qkv heads d_head)``
  under ``heads:model``) carries its split to its part after the outer parts of its blocks
  and back (:func:`cyclic_carry`): each rank's blocks are that part's rows, in order.

The rule tries the input's own sharding, that sharding moved onto the outer
dims of its groups, the input shardings that give each of the output's layout
targets exactly, and the mixes of them that the generic rule would try, and
takes the cheapest.  The output's dims follow their
layout rules, as every tensor's do (Mesh-TF): the merged dim stays split when
the layout splits it too (``height:data; patches:data``), or when no rule names
it and the compiler implies the split (:mod:`.implied`); a split that must move
to another dim moves in one alltoall (a re-layout, :mod:`.relayout`), before the
reshape or after it, never through an allgather.  Partial sums pass through (the
op is linear).  The gradient of a reshape is a reshape back, so the backward
follows the same rule.
"""
from __future__ import annotations

import itertools

from ..layout.sharding import Sharding
from .generic import _price_output, op_flops
from .relayout import relayout_cost
from .rules import lowering


def carry(mesh, ins, outs) -> list[tuple[str, ...]] | None:
    """The axes splitting each output dim of one group when the input's split carries over.

    Args:
      mesh: the mesh (for axis sizes).
      ins: ``(size, axes)`` per input dim of the group, outer first.
      outs: the sizes of the group's output dims, outer first (same product).

    Returns:
      The axes of each output dim, or None when the local slices would not
      stay contiguous (no split of the output holds the same elements).
    """
    if len(ins) == 1 and len(outs) == 1:   # one dim passing alone: its rows are its rows, cut as they are
        return [tuple(ins[0][1])]
    seq: list[str] = []
    open_ = True   # every dim so far is split whole (one element per rank): the next may be split
    for size, axes in ins:
        if axes and not open_:
            return None
        seq.extend(axes)
        if mesh.axis_size(axes) < size:
            open_ = False
    return place(mesh, seq, outs)


def place(mesh, seq, sizes) -> list[tuple[str, ...]] | None:
    """Axes ``seq`` (major first) split dims of ``sizes`` from the outer end, each axis on the
    dim it lands on; None where an axis's size does not divide what is left of that dim."""
    out: list[list[str]] = [[] for _ in sizes]
    j, left = 0, sizes[0] if sizes else 1
    for a in seq:
        z = mesh.sizes[a]
        while left == 1 and j + 1 < len(sizes):
            j += 1
            left = sizes[j]
        if left % z:
            return None
        out[j].append(a)
        left //= z
    return [tuple(x) for x in out]


class Regroup:
    """A reshape or a rearrange as stages of groups: ``stages[k]`` lists ``(ins, outs)``,
    each a tuple of ``(name, size)``; stage k's output names are stage k+1's input names
    (a rearrange's transpose is free: a dim's split goes with its name)."""

    def __init__(self, stages):
        self.stages = stages

    @staticmethod
    def of(node) -> "Regroup":
        x, y = node.inputs[0].shape, node.outputs[0].shape
        if node.op.name == "rearrange":
            parts = node.attrs["parts"]
            left = [(((d.name, d.size),), tuple((p, parts[p]) for p in g)) for d, g in zip(x, node.attrs["left"])]
            right = [(tuple((p, parts[p]) for p in g), ((d.name, d.size),)) for d, g in zip(y, node.attrs["right"])]
            return Regroup([left, right])
        return Regroup([_groups(x, y)])

    def passing(self) -> dict[str, str]:
        """Input dim -> output dim for each dim that every stage takes alone to one dim of its size:
        any split of it carries over, an uneven one too (its rows stay where they are)."""
        at = {n: n for ins, _ in self.stages[0] for n, _ in ins}
        for st in self.stages:
            alone = {ins[0][0]: outs[0][0] for ins, outs in st if len(ins) == 1 and len(outs) == 1}
            at = {src: alone[d] for src, d in at.items() if d in alone}
        return at

    def inverse(self) -> "Regroup":
        return Regroup([[(o, i) for i, o in st] for st in reversed(self.stages)])

    def map(self, mesh, split: dict, mode: str = "strict", cyclic=None, found=None) -> list[dict] | None:
        """The split after each stage, given the input's ``split`` (dim -> axes).

        Where a group's split does not carry over, ``mode`` says what happens:
        "strict": the answer is None; "drop": that group's output is whole;
        "move": its axes, in order, split its output from the outer end (the split
        the output would have, had the input's split sat on the group's outer dims).
        The last two are suggestions only.

        ``cyclic``: dim -> blocks per rank, for the dims split block-cyclically
        (:func:`cyclic_carry`); with ``found`` (a dict), a merge that only a block-cyclic split
        of its one output dim carries gives it that split, and ``found[dim]`` its blocks.
        """
        out = []
        cyclic = cyclic or {}
        for st in self.stages:
            nxt = {}
            for ins, outs in st:
                got = cyclic_carry(mesh, ins, outs, split, cyclic, found)
                if got is None:
                    got = carry(mesh, [(s, split.get(n, ())) for n, s in ins], [s for _, s in outs])
                elif got is False:
                    got = None
                if got is None and mode == "move":
                    got = place(mesh, [a for n, _ in ins for a in split.get(n, ())], [s for _, s in outs])
                if got is None:
                    if mode == "strict":
                        return None
                    continue
                nxt.update({n: a for (n, _), a in zip(outs, got) if a})
            out.append(nxt)
            split = nxt
        return out


def cyclic_carry(mesh, ins, outs, split: dict, cyclic: dict, found=None):
    """The axes of each output dim of one group ``ins -> outs`` (each ``(name, size)``) where a
    block-cyclic dim carries its split: None where no block-cyclic dim is in the group (the
    contiguous rule, :func:`carry`, decides), False where one is but its split does not carry.

    A merged dim ``F = (o1 .. ok s i1 .. im)`` whose part ``s`` is split over one axis of size p,
    every other part whole, is split block-cyclically with ``v = |o1| .. |ok|`` blocks per rank:
    F cut into ``p v`` blocks, rank r's rows are blocks r, r + p, .. (``Sharding.cyclic``), which in
    that order are a row-major ``(o1 .. ok, s / p, i1 .. im)`` array, so the local reshape of the
    local part is the other side's local part both ways (GPT-2's ``c_attn`` ``(qkv heads d_head)``
    under ``heads:model``: v = 3).  ``found`` (a dict): a merge into a dim not in ``cyclic`` may
    make it block-cyclic (``found[F] = v``, the implied rule's question, :mod:`.implied`)."""
    if len(ins) == 1 and len(outs) == 1:   # a dim passing alone keeps its blocks
        return None
    if len(ins) == 1 and ins[0][0] in cyclic:   # F cut into its parts
        (name, _), = ins
        axes = split.get(name, ())
        if not axes:
            return None
        at = _blocked_part([s for _, s in outs], cyclic[name])
        if at is None or len(axes) != 1 or outs[at][1] % mesh.axis_size(axes):
            return False
        return [axes if j == at else () for j in range(len(outs))]
    if len(outs) == 1 and (outs[0][0] in cyclic or found is not None):   # parts merged into F
        name = outs[0][0]
        split_at = [j for j, (n, _) in enumerate(ins) if split.get(n)]
        if not split_at:
            return None
        j, axes = split_at[0], split[ins[split_at[0]][0]]
        v = _prod(s for _, s in ins[:j])
        if len(split_at) != 1 or len(axes) != 1 or v == 1 or ins[j][1] % mesh.axis_size(axes) \
                or cyclic.get(name, v) != v:
            return False if name in cyclic else None
        if name not in cyclic:
            found[name] = v
        return [axes]
    if any(n in cyclic and split.get(n) for n, _ in ins) or \
            (any(n in cyclic for n, _ in outs) and any(split.get(n) for n, _ in ins)):
        return False   # a block-cyclic dim merged with others, or made by another merge
    return None


def _blocked_part(sizes, v: int):
    """The part of a merged dim of parts ``sizes`` that a block-cyclic split with ``v`` blocks per
    rank splits: the first of size > 1 after parts of product ``v``; None where there is none."""
    outer = 1
    for j, size in enumerate(sizes):
        if outer == v and size > 1:
            return j
        outer *= size
    return None


def _prod(sizes) -> int:
    out = 1
    for s in sizes:
        out *= s
    return out


def _groups(x, y) -> list:
    """The groups of a row-major reshape from shape ``x`` to ``y``: runs of consecutive dims
    with equal products, as small as possible."""
    groups, i, j = [], 0, 0
    while i < len(x) or j < len(y):
        gi, gj, pa, pb = [], [], 1, 1
        if i < len(x):
            gi.append(x[i])
            pa, i = pa * x[i].size, i + 1
        if j < len(y):
            gj.append(y[j])
            pb, j = pb * y[j].size, j + 1
        while pa != pb:
            if pa < pb:
                gi.append(x[i])
                pa, i = pa * x[i].size, i + 1
            else:
                gj.append(y[j])
                pb, j = pb * y[j].size, j + 1
        groups.append((tuple((d.name, d.size) for d in gi), tuple((d.name, d.size) for d in gj)))
    return groups


@lowering("reshape", "rearrange")
def lower_reshape(lw, node) -> None:
    """Lower a reshape or rearrange; see the module docstring."""
    node.op.spec(node)   # its checks (a dim that changes size but keeps its name)
    mesh, (t,), out = lw.mesh, node.inputs, node.outputs[0]
    rg = Regroup.of(node)
    vid = lw.reduced(lw.value(t))
    cur = lw.sharding(vid)
    # A partial sum passes through lazily when this is its only reader (see generic.py).
    P = cur.partial if lw.num_uses(t) == 1 else ()
    tl = tuple(lw.targets(out))
    # Where the input's split could go: as it is, onto the outer dims of its groups (one
    # alltoall), or where each of the output's targets comes out of the reshape exactly.
    back, cyc = rg.inverse(), lw.layout.cyclic_blocks_of(t.shape, out.shape)   # (block-cyclic: :func:`cyclic_carry`)
    sources = [dict(cur.split), back.map(mesh, rg.map(mesh, dict(cur.split), "move", cyc)[-1], "drop", cyc)[-1]]
    for tgt, _ in tl:
        sources.append(back.map(mesh, dict(tgt.split), "drop", cyc)[-1])
    free = [a for a in mesh.names if a not in P and mesh.sizes[a] > 1]
    options = [[None] + [d.name for d in t.shape if any(a in s.get(d.name, ()) for s in sources)] for a in free]

    def order_key(d, a):
        for i, s in enumerate(sources):
            if a in s.get(d, ()):
                return (i, s[d].index(a))
        return (len(sources), mesh.names.index(a))

    itemsize = t.dtype.itemsize
    alone = rg.passing()   # dims whose split, even or not, the local kernel keeps as it is
    best = None
    for choice in itertools.product(*options):
        C: dict[str, list[str]] = {}
        for a, d in zip(free, choice):
            if d is not None:
                C.setdefault(d, []).append(a)
        C = {d: tuple(sorted(ax, key=lambda a: order_key(d, a))) for d, ax in C.items()}
        if any(t.shape.get(d).size % mesh.axis_size(ax) for d, ax in C.items() if d not in alone):
            continue
        stages = rg.map(mesh, C, "strict", cyc)
        if stages is None:
            continue
        c_in = Sharding.of(t.shape, C, P)
        c_out = Sharding.of(out.shape, stages[-1], P)
        c_move, lazy, note = _price_output(out.shape, out.dtype.itemsize, tl, c_out, (), mesh, lw.cost)
        cost = relayout_cost(t.shape, cur, c_in, mesh, itemsize, lw.cost) + c_move
        moves = (c_in != cur) + (lazy != c_out)
        if best is None or cost < best[0] - 1e-12 or (cost <= best[0] + 1e-12 and moves < best[1]):
            best = (cost, moves, C, stages, c_in, c_out, lazy, note)
    assert best is not None, node   # the whole tensor always regroups
    _, _, C, stages, c_in, c_out, lazy, note = best
    vid = lw.relayout(vid, c_in, node, f"input of {node.op.name}")
    res = lw.new_value(out.shape, out.dtype, c_out)
    # The note says where a split crossed a merge or a split of dims without moving.
    ins_split = [C] + stages[:-1]
    kept = any(len(ins) > 1 or len(outs) > 1 for st, sp in zip(rg.stages, ins_split) for ins, outs in st
               if any(sp.get(n) for n, _ in ins))
    local = dict(zip(out.shape.names, c_out.local_shape(out.shape, mesh)))
    fn, attrs = _local_kernel(node, mesh, stages, c_in, c_out, alone)
    lw.emit("local", node, [vid], [res],
            args={"fn": fn, "inplace": None, "attrs": attrs, "compute": {}, "sizes": {}},
            flops=op_flops(node, local), note=f"keeps the split: {c_in} -> {c_out}" if kept else "")
    if note:
        lw.note(f"{node.name}: {note}")
    if node.phase == "forward" and tl:
        for text in _inner_split_notes(node, rg, mesh, tl[0][0], c_out):
            lw.note(text)
    lw.bind(out, lw.relayout(res, lazy, node, f"output of {node.op.name} to its layout"))


def _inner_split_notes(node, rg: Regroup, mesh, target: Sharding, c_out: Sharding):
    """A note for each output dim whose layout split no contiguous split of the input reaches:
    the dim is an inner part of a merged input dim (a flat fused projection's ``heads`` in
    ``(qkv heads d_head)``), so what makes the input runs without that split."""
    back = rg.inverse()
    for d, axes in target.split.items():
        if d in c_out.split or back.map(mesh, {d: axes}, "strict") is not None:
            continue
        names, parts = {d}, []
        for st in reversed(rg.stages):   # the input dims whose row-major group holds d, and its parts
            groups = [(ins, outs) for ins, outs in st if names & {o for o, _ in outs}]
            names, parts = {n for ins, _ in groups for n, _ in ins}, [o for _, outs in groups for o, _ in outs]
        merged = ", ".join(x.name for x in node.inputs[0].shape if x.name in names)
        n, p = node.outputs[0].shape.get(d).size, mesh.axis_size(axes)
        # (a block-cyclic split, :mod:`.cyclic_dims`, cuts every part into equal blocks)
        uneven = f"; not block-cyclic either: '{d}' ({n}) over {','.join(axes)} ({p}) is uneven" if n % p else ""
        yield (f"{node.name}: '{d}:{','.join(axes)}' is an inner part of '{merged}' = ({' '.join(parts)}): no "
               f"split of '{merged}' carries over to it, so what makes '{merged}' runs without that split; "
               f"kept as separate dims {', '.join(parts)} (a fused weight stored by dims, not flat), it would keep "
               f"the split{uneven}")


def _local_kernel(node, mesh, stages, c_in: Sharding, c_out: Sharding, alone: dict):
    """The kernel and attrs of the local step.  A reshape whose passing dim is split unevenly
    (batch 6 on 4 ranks: 2, 2, 1, 1 rows) has no one local shape: :func:`_reshape_keeping` reads
    that dim's length off the rank's slice.  A rearrange's sizes never name such a dim."""
    attrs = _local_attrs(node, mesh, stages, c_out)
    t, out = node.inputs[0].shape, node.outputs[0].shape
    uneven = [d for d, ax in c_in.split.items() if d in alone and t.get(d).size % mesh.axis_size(ax)]
    if node.op.name == "rearrange" or not uneven:
        return node.op.compute, attrs
    kept = tuple((out.names.index(alone[d]), t.names.index(d)) for d in uneven)
    return _reshape_keeping, {**attrs, "kept": kept}


def _reshape_keeping(ctx, attrs, x):
    """A local reshape whose output dims at ``attrs["kept"]`` ``(out_pos, in_pos)`` have the
    input's local length there (a dim split unevenly passing the reshape alone)."""
    shape = list(attrs["rest"])
    for o, i in attrs["kept"]:
        shape[o] = x.shape[i]
    return x.reshape(shape)


def _local_attrs(node, mesh, stages, c_out) -> dict:
    """The attrs of the op's own kernel on a rank's slice: local sizes instead of global ones."""
    if node.op.name == "rearrange":
        parts = node.attrs["parts"]
        split = stages[0]
        return {**node.attrs, "sizes": {n: parts[n] // mesh.axis_size(split.get(n, ()))
                                        for n in node.attrs["sizes"]}}
    out = node.outputs[0].shape
    return {"prefix": (), "rest": c_out.local_shape(out, mesh)}
