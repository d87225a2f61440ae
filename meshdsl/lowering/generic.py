"""The generic lowering rule: choose how to shard an op's local compute.

Given the op's :class:`~meshdsl.ops.registry.ComputeSpec`, the current
shardings of its inputs and the layout's targets for its outputs, try every
assignment of mesh axes to compute dims that some input or target suggests,
price each with the cost model (input re-layouts + local FLOPs + output
re-layout; an input each rank can make again whole, :mod:`.remake`, at the
compute that takes where that is cheaper than gathering it), and emit the
cheapest; on a tie, the one that re-lays out fewer values.  Micro-batches (the virtual axis ``_mb``) stay split: a re-layout
that gathers or moves them is priced at infinity (see :mod:`.relayout`), so
their sums stay partial, and an output dim split by them stays so whatever
its layout rule says (MoE's ``expert_batch``).  A split 'sum'-reduced dim
leaves a lazy partial sum; 'max'/'min' get an allreduce at once.  Partial sums pass through linear ops lazily, also when
added to whole values (see :func:`_partial_modes`), and are reduced once, where
a reader needs the whole value (or reduce-scattered where it wants it split).
"""
from __future__ import annotations

import functools
import itertools

from ..core.lru import Lru
from ..layout.sharding import Sharding
from .pipeline import MB_AXIS
from .relayout import keep_microbatches, relayout_cost


def _partial_modes(lw, node, shs) -> list[tuple[tuple[str, ...], dict, dict]]:
    """The ways ``node`` may treat its partial-sum inputs, most lazy first.

    Each is ``(P, kept, scale)``: the output stays partial over axes ``P``; input
    ``i`` in ``kept`` is read still partial over ``kept[i]`` (the others are
    reduced first); input ``i`` in ``scale`` is multiplied by ``scale[i]`` in the
    kernel.  A jointly linear op (add, sub, concat) on inputs partial over
    different axes, or on a mix of partial and whole inputs, may stay lazy too:
    an input whole over some axes of ``P`` is divided by their size, so that
    summing the ranks' results over ``P`` counts it once.  The cost model
    chooses between that mode and reducing the inputs first; on a tie it stays
    lazy, since a later add of another partial sum is then free (Mesh-TF's lazy
    allreduce).  Only a partial input with one reader is passed on lazily, and
    a mix only into a result with one reader.
    """
    op = node.op
    # In a repeat's block the layers run one micro-batch at a time: a sum over them (a weight's
    # gradient, or the gradient of weight-only math in the block such as a weight norm) is
    # made after the layers, so the block passes the micro-batch axis of a partial sum on
    # wherever it would reduce it; only an op that is not linear in it still reduces it (which
    # the repeat then refuses, naming the op).
    mb = (MB_AXIS,) if lw.in_block else ()
    # A partial sum with several readers is reduced at its first one: passed on
    # lazily, each reader's result would need a reduction of its own.
    through = lw.lazy_through
    given, shs = shs, [s.with_partial(tuple(a for a in s.partial if a in mb))
                       if s.partial and lw.num_uses(t) > 1 and id(t) not in through else s
                       for s, t in zip(shs, node.inputs)]
    partial_in = [i for i, s in enumerate(shs) if s.partial]
    if not partial_in:
        return [((), {}, {})]
    if len(partial_in) == 1 and id(node.inputs[partial_in[0]]) in through and (
            op.multilinear or op.linear_in(node, partial_in[0]) or _stays_partial(lw, node, shs)):
        # A partial sum the block passes on to every reader (MQA's key gradient, read by its
        # weight's gradient and the input's; FAVOR+'s row sum's gradient broadcast back over
        # d_head): only the lazy mode, the block's price decides.
        P = shs[partial_in[0]].partial
        return [(P, {partial_in[0]: P}, {})]
    sets = {frozenset(shs[i].partial) for i in partial_in}
    eager = [((), {}, {})]

    def reduced_first(P):
        """The mode that reduces the partial inputs (all partial over ``P``) before the op."""
        kept = tuple(a for a in P if a in mb)
        return eager if not kept else [] if kept == P else [(kept, {i: kept for i in partial_in}, {})]

    if op.linear_in_all(node, partial_in) and len(sets) == 1:
        P = shs[partial_in[0]].partial
        # An op whose result outgrows its inputs (a broadcast_to of a row sum's gradient over a
        # split vocab) would pass a larger partial sum on: reducing the inputs first is priced too.
        grows = sum(t.shape.numel for t in node.outputs) > sum(t.shape.numel for t in node.inputs)
        return [(P, {i: P for i in partial_in}, {})] + (reduced_first(P) if grows else [])
    if mb and len(partial_in) == 1 and op.multilinear and set(shs[partial_in[0]].partial) & set(mb):
        # A weight-only value broadcast over the batch in a block (a Set Transformer's inducing
        # points projected once): its gradient is a sum over the micro-batches, read by the
        # einsums of its weights' gradients, which are sums over them too.
        P = shs[partial_in[0]].partial
        return reduced_first(P) if set(P) - set(mb) else [(P, {partial_in[0]: P}, {})]
    if len(partial_in) == 1 and op.linear_in(node, partial_in[0]):
        P = shs[partial_in[0]].partial
        # Several outputs (layer norm's backward: dx and the affine's gradients) would each
        # need a reduction of their own, and another input split over an axis of P (a row
        # statistic's partial sum times the rows split along the summed dim) would be gathered
        # for the result to stay partial: reducing the input first may cost less. So may a result
        # that outgrows the input (a partial gradient of the rows scatter-added into a table
        # bigger than them, a recommender's embedding). So may, in a lowering that packs, another
        # input partial over P, read elsewhere too, so reduced here anyway (a masked loss's count,
        # divided into its numerator's sum): beside it, one packed allreduce (:func:`packable`).
        clash = any(set(P) & s.used_axes or lw.pack_reductions and set(P) & set(g.partial)
                    for i, (s, g) in enumerate(zip(shs, given)) if i != partial_in[0])
        grows = sum(t.shape.numel for t in node.outputs) > node.inputs[partial_in[0]].shape.numel
        return [(P, {partial_in[0]: P}, {})] + (reduced_first(P) if len(node.outputs) > 1 or clash or grows else [])
    if len(partial_in) == 1 and op.multilinear:
        # An einsum is linear in one operand, the others fixed: its partial sum passes through
        # when the result is cheaper to reduce than the operand (a feature map's gradient
        # [.., feats] contracted to [.., d_head]); the cost model prices both, the output's
        # eventual reduction included (on a tie it stays lazy, as the modes above).
        P = shs[partial_in[0]].partial
        return reduced_first(P) + [(P, {partial_in[0]: P}, {})]
    return _mixed_modes(lw, node, shs, partial_in, mb)


def _stays_partial(lw, node, shs) -> bool:
    """Whether one-input linear ``node`` (a broadcast) may pass its partial input on without its
    result being reduced at once: no layout target of the result splits it over the partial
    axes.  (A batch norm's statistic's gradient broadcast back over a split batch would be
    reduce-scattered there, its full size: the rule's own pricing reduces the statistic first.)"""
    if not (node.op.is_linear(node) and len(shs) == 1):
        return False
    P = set(shs[0].partial)
    return not any(P & sh.used_axes for t in node.outputs for sh, _ in lw.targets(t))


def _mixed_modes(lw, node, shs, partial_in, mb) -> list[tuple[tuple[str, ...], dict, dict]]:
    """:func:`_partial_modes` of a jointly linear op on inputs partial over different axes, or on
    a mix of partial and whole inputs: lazy with the whole ones scaled, or reduced first."""
    eager = [((), {}, {})]
    # A lazy result with several readers would be reduced at its first one: no
    # better than reducing the inputs now, and the scaling would cost a kernel.  Unless the
    # block passes it on to every reader (:func:`.repeat._lazy_through`: the gradient of elu + 1,
    # where(y > 0, y + 1, exp(y)), read by both of where's gradients).
    if not (node.op.is_linear(node) and all(t.dtype.is_floating_point for t in node.inputs)
            and all(lw.num_uses(t) == 1 or id(t) in lw.lazy_through for t in node.outputs)):
        return eager
    mesh = lw.mesh
    P = tuple(a for a in mesh.names if any(a in shs[i].partial for i in partial_in))
    scale = {}
    for i, s in enumerate(shs):
        missing = tuple(a for a in P if a not in s.partial)
        if missing:
            scale[i] = 1.0 / mesh.axis_size(missing)
    return [(P, {i: shs[i].partial for i in partial_in}, scale)] + (eager if not set(P) & set(mb) else [])


#: (node, its inputs' shardings, its outputs' targets, the mesh, the cost model, the readers of
#: its inputs and outputs, the dims the layout lets have empty parts) -> the choice
#: :func:`_cheapest` made, for the last 16384: one graph compiled under many layouts (a
#: search, a test of every layout) meets the same node with the same inputs and targets again and
#: again.  Everything of ``lw`` the choice reads is in the key (a new read must join it).
_CHOICES = Lru(1 << 14)


def lower_generic(lw, node) -> None:
    """Lower ``node`` by the cheapest compute sharding (see module docstring)."""
    spec = node.op.spec(node)
    ins = [lw.reduced(lw.value(t)) for t in node.inputs]
    shs = [lw.sharding(v) for v in ins]
    targets = [tuple(lw.targets(t)) for t in node.outputs]
    through = tuple(id(t) in lw.lazy_through for t in node.inputs)
    # whether passing a marked partial sum on may choose otherwise than the rule alone: it has
    # several readers, or this op is not one a partial sum passes through anyway
    lw.through_used |= any(k and s.partial and (lw.num_uses(t) > 1 or not node.op.is_linear(node))
                           for k, s, t in zip(through, shs, node.inputs))
    # the shardings each input was already brought to (an FSDP weight gathered for one einsum is
    # whole for the next that reads it: that re-layout is free)
    held = tuple(_held(lw, v, t) for v, t in zip(ins, node.inputs))
    # the inputs each rank can make again whole for the compute it takes, instead of gathering them
    # (a one-hot of a gathered top-k, made split by the layout: :mod:`.remake`)
    remade = tuple(lw.remade_whole(v) for v in ins)
    # where the readers of each output will move it (a block's first lowering saw them do so)
    wanted = tuple(lw.wanted.get(id(t)) for t in node.outputs) if lw.wanted else ()
    # each output's share of the one reduction of a sum it is a term of (:mod:`.shared_sums`)
    shares = tuple(lw.shared_sums.get(id(t), 1) for t in node.outputs) if lw.shared_sums else ()
    key = (node, tuple(shs), tuple(targets), lw.mesh, lw.cost, tuple(lw.num_uses(t) for t in node.inputs),
           tuple(lw.num_uses(t) for t in node.outputs), lw.layout.empty_ok, lw.in_block, through, held, wanted,
           shares, remade, lw.pack_reductions)
    lw.packable |= not lw.pack_reductions and packable(lw, node, shs)
    C, plan, P, scale = _CHOICES.get_or_make(
        key, lambda: _cheapest(lw, node, spec, shs, targets, held, wanted, shares, remade))
    _emit(lw, node, spec, ins, dict(C), plan, P, scale)


def packable(lw, node, shs) -> bool:
    """Whether ``node`` reduces a partial input read elsewhere too (reduced at its first reader)
    beside another input partial over its axes, with one reader, that the node is linear in (a
    masked loss's count and numerator, divided): reduced there too, the two would go as one
    packed allreduce (:mod:`.coalesce`), where the other waits to be reduced after the node.  A
    lowering that packs (``lw.pack_reductions``: the compiler's :func:`~.compiler._offered` tries
    one where this held, keeping it where the plan then costs less and sends no more bytes) offers
    reducing it there and prices reductions made together as one (:func:`_packed_saving`)."""
    forced = {a for s, t in zip(shs, node.inputs) if s.partial and lw.num_uses(t) > 1
              and id(t) not in lw.lazy_through for a in s.partial}
    return bool(forced) and any(set(s.partial) & forced and lw.num_uses(t) == 1 and node.op.linear_in(node, i)
                                for i, (s, t) in enumerate(zip(shs, node.inputs)))


def _held(lw, vid, t) -> frozenset:
    """The shardings value ``vid`` (of tensor ``t``) was brought to or will be (``lw.foreseen``):
    the held set itself when nothing is foreseen (its hash, a cache key's, is then worked out once)."""
    held, foreseen = lw.held(vid), lw.foreseen.get(id(t))
    return held | foreseen if foreseen else held


def _cheapest(lw, node, spec, shs, targets, held, wanted=(), shares=(), remade=()) -> tuple:
    """``(C, plan, P, scale)`` of the cheapest compute sharding of ``node`` (see module docstring).
    Of ``lw`` it reads only what :data:`_CHOICES`' key holds."""
    mesh = lw.mesh
    modes = _partial_modes(lw, node, shs)
    comp = {o.name: spec.out_rename.get(o.name, o.name) for t in node.outputs for o in t.shape}

    # Suggestions: compute-dim -> axes, from inputs and output targets.
    sources: list[dict[str, tuple[str, ...]]] = [dict(s.split) for s in shs]
    for tl in targets:
        for sh, _ in tl:
            sources.append({comp[n]: axes for n, axes in sh.split.items()})
    splittable = [d for d in spec.dims if d not in spec.fixed]
    uneven = _uneven_sources(mesh, node, shs, targets, comp)

    def order_key(d, a):
        for i, src in enumerate(sources):
            if a in src.get(d, ()):
                return (i, src[d].index(a))
        return (len(sources), mesh.names.index(a))

    # Per output, what every candidate's pricing reads: its shape, targets, each dim's compute
    # dim, and the 'sum'-reduced compute dims it lacks (it is a partial sum over their axes; an
    # op may keep a reduced dim in one output: layer norm's backward, its input gradient).
    outs_info = []
    for j, (t, tl) in enumerate(zip(node.outputs, targets)):
        pairs = tuple((o.name, comp[o.name]) for o in t.shape)
        kept = {c for _, c in pairs}
        sum_dims = tuple(d for d, kind in spec.reduce.items() if kind == "sum" and d not in kept)
        outs_info.append((t.shape, t.dtype.itemsize, tl, pairs, sum_dims, wanted[j] if wanted else None,
                          shares[j] if shares else 1))
    best = None
    for P, keep, scale in modes:
        memo: dict = {}   # what candidates of this mode share: their inputs' re-layouts and prices
        free_axes = [a for a in mesh.names if a not in P and mesh.sizes[a] > 1]
        options = [[None] + [d for d in splittable if any(a in src.get(d, ()) for src in sources)]
                   for a in free_axes]
        for choice in itertools.product(*options):
            split: dict[str, list[str]] = {}
            for a, d in zip(free_axes, choice):
                if d is not None:
                    split.setdefault(d, []).append(a)
            C = {d: tuple(sorted(axes, key=lambda a: order_key(d, a))) for d, axes in split.items()}
            if not all(_splits(spec.dims[d], mesh.axis_size(ax), (d, ax) in uneven, d in lw.layout.empty_ok)
                       for d, ax in C.items()):
                continue
            cost, plan = _price(lw, node, spec, C, shs, P, keep, outs_info, memo, held, remade)
            # On a tie in time, the lowering that moves fewer values wins: doing nothing.  Reading
            # a copy already held at the sharding asked for is no move (the saved activation's
            # re-laid copy a repeat's backward is given: reading it spares moving the result).
            moves = (sum(r != s and r not in h for r, s, h in zip(plan["req"], shs, held))
                     + sum(o[0] != o[1] for o in plan["outs"]))
            if best is None or cost < best[0] - 1e-12 or (cost <= best[0] + 1e-12 and moves < best[1]):
                best = (cost, moves, C, plan, P, scale)
    assert best is not None, node
    return best[2:]


def _splits(size: int, n: int, uneven_ok: bool, empty_ok: bool = False) -> bool:
    """Whether ``n`` parts of a compute dim of ``size`` may run: equal ones, or unequal ones where
    an operand or target is already split so, none empty unless ``empty_ok`` (a dim the layout
    lets have empty parts, a pipelined stack's layer dim: :meth:`~meshdsl.layout.layout.Layout.with_empty_parts`)."""
    return size % n == 0 or (uneven_ok and (size >= n or empty_ok))


def _uneven_sources(mesh, node, shs, targets, comp) -> set[tuple[str, tuple[str, ...]]]:
    """The ``(compute dim, axes)`` splits an input or an output's layout target already makes
    unevenly: the only uneven compute splits worth trying (an even layout's plans never try one)."""
    out = set()
    for t, s in zip(node.inputs, shs):
        out.update((d, ax) for d, ax in s.split.items() if t.shape.get(d).size % mesh.axis_size(ax))
    for t, tl in zip(node.outputs, targets):
        for sh, _ in tl:
            out.update((comp[d], ax) for d, ax in sh.split.items() if t.shape.get(d).size % mesh.axis_size(ax))
    return out


def _price(lw, node, spec, C, shs, P, keep, outs_info, memo, held, remade=()):
    """The cost of computing ``node`` with compute sharding ``C`` (see :func:`lower_generic`), and
    the re-layouts that takes (free where ``held[i]``, input ``i``'s shardings made already, has it;
    at most the compute of making it again where ``remade[i]`` offers that sharding).
    ``memo`` holds, for one partial-sum mode, the prices that
    candidates share: an input's re-layout depends only on the axes ``C`` gives its own dims, an
    output's on those and the axes of the dims it sums (and a 'max'/'min' reduction's)."""
    mesh = lw.mesh
    model = lw.cost
    cost = 0.0
    req, reductions = [], []
    for i, (t, s) in enumerate(zip(node.inputs, shs)):
        names = t.shape.names
        key = (i, tuple(C.get(n, ()) for n in names))
        hit = memo.get(key)
        if hit is None:
            r = _required(names, key[1], tuple(keep.get(i, ())))
            hit = memo[key] = (r, 0.0 if r in held[i] else min(
                [relayout_cost(t.shape, s, r, mesh, t.dtype.itemsize, model)]
                + [c for sh, c in (remade[i] if remade else ()) if sh == r]))
        req.append(hit[0])
        cost += hit[1]
        if s.partial and hit[0] == s.with_partial(()) and hit[0] not in held[i]:
            reductions.append((s.partial, hit[1]))
    cost -= _packed_saving(reductions, model, mesh) if len(reductions) > 1 and lw.pack_reductions else 0.0
    local = {d: -(-size // mesh.axis_size(C.get(d, ()))) for d, size in spec.dims.items()}   # the largest part
    cost += model.compute(op_flops(node, local))
    ext_axes = tuple(a for d, kind in spec.reduce.items() if kind != "sum" for a in C.get(d, ()))
    outs = []
    for j, (shape, itemsize, tl, pairs, sum_dims, want, share) in enumerate(outs_info):
        # an output's price depends on the axes C gives its own dims and its summed ones
        key = ("out", j, tuple(C.get(c, ()) for _, c in pairs), tuple(a for d in sum_dims for a in C.get(d, ())),
               ext_axes)
        hit = memo.get(key)
        if hit is None:
            out_sh = Sharding(tuple((o, axes) for (o, _), axes in zip(pairs, key[2])),
                              tuple(a for a in mesh.names if a in P or a in key[3]))
            hit = memo[key] = (out_sh, *_price_output(shape, itemsize, tl, out_sh, ext_axes, mesh, model, want, share))
        out_sh, c, lazy, note = hit
        cost += c
        outs.append((out_sh, lazy, note))
    return cost, {"req": req, "outs": outs, "ext_axes": ext_axes, "local": local}


def _packed_saving(reductions, model, mesh) -> float:
    """Seconds saved where an op's inputs are only reduced, several over the same axes
    (``reductions``: ``(axes, seconds of its allreduce)`` each): made back to back, independent,
    :mod:`.coalesce` sends them as one allreduce, one latency for all, where the first's wait for
    the others' bytes stays within the latency each of them saves (as it decides)."""
    saved = 0.0
    for axes in {a for a, _ in reductions}:
        latency = model.collective("allreduce", 0, mesh.axis_size(axes))
        rest = [c for a, c in reductions if a == axes][1:]
        if rest and sum(c - latency for c in rest) <= latency:
            saved += latency * len(rest)
    return saved


@functools.lru_cache(maxsize=1 << 16)
def _required(names, axes, partial) -> Sharding:
    """``Sharding.of`` an input with dims ``names`` split over ``axes`` (one tuple per dim), partial
    over ``partial``: the same few are asked for by many candidates, nodes and layouts, and a
    lookup costs less than building one."""
    return Sharding(tuple(zip(names, axes)), partial)


@functools.lru_cache(maxsize=1 << 16)
def _price_output(shape, itemsize, tl, out_sh, ext_axes, mesh, model, want=None, share=1):
    """(cost, sharding, note) of an output of ``shape`` computed with ``out_sh``: its allreduce
    over the 'max'/'min' axes ``ext_axes``, then the cheapest way to the layout's targets ``tl``,
    and on from there to ``want`` where every reader will move it so (:mod:`.foresight`).  A
    partial sum that is one of ``share`` terms of a sum (:mod:`.shared_sums`) may also stay as
    made, paying its share of the sum's one way there.

    Cached as :func:`~.relayout.relayout_cost` is: every argument is immutable, and the same
    outputs are priced for many candidates, nodes and layouts."""
    cost = 0.0
    if ext_axes:
        nbytes = out_sh.local_numel(shape, mesh) * itemsize
        cost += model.collective("allreduce", nbytes, mesh.axis_size(ext_axes))
    best = None
    for tgt, note in tl:
        lazy = tgt.with_partial(tuple(a for a in out_sh.partial if a not in tgt.used_axes))
        lazy = keep_microbatches(lazy, out_sh, shape, mesh)
        c = relayout_cost(shape, out_sh, lazy, mesh, itemsize, model)
        if want is not None:   # (a partial sum is reduced on the way)
            c += relayout_cost(shape, lazy, want, mesh, itemsize, model)
        elif lazy.partial:  # it will be reduced eventually
            c += model.collective("allreduce", lazy.local_numel(shape, mesh) * itemsize,
                                  mesh.axis_size(lazy.partial))
        if best is None or c < best[0] - 1e-12 or (c <= best[0] + 1e-12 and best[1] != out_sh == lazy):
            best = (c, lazy, note)
        if share > 1 and out_sh.partial and want is None and c / share < best[0] - 1e-12:
            best = (c / share, out_sh, note)
    return cost + best[0], best[1], best[2]


def op_flops(node, local) -> int:
    return node.op.flops(node, local)


def _scaled(fn, scale: tuple):
    """``fn`` reading input ``i`` multiplied by ``scale[i]`` (1.0: as it is)."""
    def kernel(ctx, attrs, *xs):
        return fn(ctx, attrs, *(x if k == 1.0 else x * k for x, k in zip(xs, scale)))
    return kernel


def _emit(lw, node, spec, ins, C, plan, P, scale):
    mesh = lw.mesh
    fn, inplace, why = node.op.compute, node.op.compute_inplace, ""
    if scale:
        fn, inplace = _scaled(fn, tuple(scale.get(i, 1.0) for i in range(len(ins)))), None
        why = (f"lazy partial sum over {','.join(P)}: "
               + ", ".join(f"input {i} x {k:g}" for i, k in sorted(scale.items())))
    # (an input already at its sharding, most, skips the re-layout and the reason's text)
    vids = [v if lw.values[v].sharding == r else lw.relayout(v, r, node, f"input {i} of {node.op.name}")
            for i, (v, r) in enumerate(zip(ins, plan["req"]))]
    ext = plan["ext_axes"]
    out_vids = []
    for t, (out_sh, lazy, note) in zip(node.outputs, plan["outs"]):
        out_vids.append(lw.new_value(t.shape, t.dtype, out_sh))
    lw.emit("local", node, vids, out_vids, args={"fn": fn, "inplace": inplace, "donates": node.op.donates,
                                                 "attrs": node.attrs, "compute": C,
                                                 "sizes": dict(spec.dims)},
            flops=op_flops(node, plan["local"]), note=why)
    for t, vid, (out_sh, lazy, note) in zip(node.outputs, out_vids, plan["outs"]):
        if ext:
            red = lw.new_value(t.shape, t.dtype, out_sh)
            kind = next(k for k in spec.reduce.values() if k != "sum")
            lw.emit("allreduce", node, [vid], [red], axes=ext, args={"op": kind},
                    nbytes=lw.values[vid].local_bytes(mesh))
            vid = red
        if note:
            lw.note(f"{node.name}: {note}")
        if lazy != out_sh:   # (the result is made at ``out_sh``: else no re-layout to make)
            vid = lw.relayout(vid, lazy, node, f"output of {node.op.name} to its layout")
        lw.bind(t, vid)
