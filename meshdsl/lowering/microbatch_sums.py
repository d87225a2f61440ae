"""A pipeline's final segment: sums over the micro-batches taken locally before a value moves.

A value still partial over the micro-batch axis (:data:`~.plan.MB_AXIS`: a tied embedding's head
term of its gradient, a loss term made on another stage) varies by micro-batch, so a process runs
every step of it once per micro-batch it holds (:meth:`~.plan.Plan.held_runs`): a ``send`` of it to
another stage, or a ``reduce_scatter`` over ``data`` that keeps it partial over the micro-batches,
would move it ``m`` times.  The sum over the micro-batches is linear and local to a process (it
holds all its micro-batches), so here it is taken first, on the stages holding the value (an
``allreduce`` over the micro-batch axis alone, which the pipeline runtime folds into a running sum
as each micro-batch finishes), and the sum moves once.  What reads the moved value then reads sums:

* a local step whose result is partial over the micro-batches (an ``add`` of two such terms: the
  lowering made it partial because it is linear in them) reads every such input summed, and makes
  its result summed;
* a collective over other axes (the ``reduce_scatter`` over ``data``) reduces the sum, once;
* a collective over the micro-batch axis and others drops that axis (its input is summed already);
  over the micro-batch axis alone it becomes a copy.

A value is summed so only when every step of the final segment reading it (and, through the
readers above, what they make) is one of those: else it moves as before, per micro-batch.
"""
from __future__ import annotations

import dataclasses

from .plan import MB_AXIS, Step, Value, step_args

_SUMS = ("allreduce", "reduce_scatter")


def sum_microbatches_first(lists: dict, final_key, values: dict, mesh, outputs, num_ranks: int) -> list:
    """The final segment ``lists[final_key]`` (``(step, stages)`` pairs in order; ``lists`` holds
    every segment's) with each value partial over the micro-batches that it sends, or reduces over
    other axes only, summed over the micro-batches first (new values added to ``values``) where all
    that reads it allows.  Stage ``t`` runs on rank ``t % num_ranks`` (virtual stages share a rank's
    values): a sum is taken where the value was made, once per rank."""
    final = lists[final_key]
    readers: dict[int, list[int]] = {}
    for j, (s, _) in enumerate(final):
        for v in s.ins:
            readers.setdefault(v, []).append(j)
    keep = set(outputs.values())
    summed: set[int] = set()
    for v in _seeds(final, values):
        if v not in summed:
            summed |= _closure(v, final, values, readers, keep) or set()
    if not summed:
        return final
    made = {v: st for seg in lists.values() for s, st in seg for v in s.outs if v in summed}
    return _rewrite(final, values, mesh, summed, made, num_ranks)


def _mb_partial(values: dict, v: int) -> bool:
    """Whether ``v`` is partial over the micro-batch axis, and neither split over it nor cut at
    given parts (unequal stages), so that a sum of it over that axis is one local allreduce."""
    sh = values[v].sharding
    return MB_AXIS in sh.partial and not any(MB_AXIS in axes for axes in sh.split.values()) and not sh.parts


def _seeds(final: list, values: dict) -> list[int]:
    """The values the final segment sends, or reduces over axes other than the micro-batches' into
    a result still partial over them, that are partial over the micro-batches."""
    out = []
    for s, _ in final:
        if s.kind == "send" or (s.kind in _SUMS and MB_AXIS not in s.axes and s.args.get("op", "sum") == "sum"):
            out += [v for v in s.ins if _mb_partial(values, v)]
    return out


def _closure(seed: int, final: list, values: dict, readers: dict, keep: set) -> set[int] | None:
    """The values to sum with ``seed``: it, the inputs partial over the micro-batches of the local
    steps reading them, and what those steps (and collectives over other axes) make; None when a
    step reading one of them cannot read the sum instead (a nonlinear one, an output)."""
    found, todo = set(), [seed]
    while todo:
        v = todo.pop()
        if v in found:
            continue
        if v in keep or not _mb_partial(values, v):
            return None
        found.add(v)
        for j in readers.get(v, ()):
            s = final[j][0]
            more = _reads_sums(s, values)
            if more is None:
                return None
            todo += more
    return found


def _reads_sums(s: Step, values: dict) -> list[int] | None:
    """What else must be summed for step ``s`` to read sums over the micro-batches (see the module
    docstring), or None when it cannot."""
    if s.kind == "send":
        return []
    if s.kind in _SUMS and s.args.get("op", "sum") == "sum":
        out_mb = [MB_AXIS in values[v].sharding.used_axes for v in s.outs]
        if MB_AXIS in s.axes:
            return None if any(out_mb) else []
        return list(s.outs) if all(_mb_partial(values, v) for v in s.outs) else None
    if s.kind == "local" and s.outs and all(_mb_partial(values, v) for v in s.outs):
        ins = [v for v in s.ins if MB_AXIS in values[v].sharding.used_axes]
        # linear in them: a function of one, a sum of terms each partial over the micro-batches (or
        # the same for every micro-batch, scaled by 1/m: :func:`_sum_of_terms`), or a product of one
        # with values the same for every micro-batch
        linear = (len(s.ins) == 1 or (ins and s.op in ("add", "sub"))
                  or (len(ins) == 1 and s.op in ("mul", "einsum")))
        if linear and all(_mb_partial(values, v) for v in ins):
            return [*ins, *s.outs]
    return None


def _rewrite(final: list, values: dict, mesh, summed: set, made: dict, p: int) -> list:
    """``final`` with the values of ``summed`` read as their sums over the micro-batches, each sum
    taken on the stages (of the ranks) that read it, on the stage that made it where it ran there
    (``made``: value -> its producer's stages)."""
    new: dict[int, int] = {}
    have: dict[int, frozenset] = {}   # value -> the ranks holding its sum

    def ranks(st) -> frozenset:
        return frozenset(t % p for t in st)

    def sum_of(v: int) -> int:
        if v not in new:
            new[v] = max(values) + 1
            sh = values[v].sharding
            values[new[v]] = Value(new[v], values[v].shape, values[v].dtype,
                                   sh.with_partial(tuple(a for a in sh.partial if a != MB_AXIS)))
        return new[v]

    out = []
    for s, st in final:
        reads = [v for v in s.ins if v in summed]
        if s.kind == "recv" and s.outs[0] in summed:
            out.append((dataclasses.replace(s, outs=(sum_of(s.outs[0]),)), st))
            have[s.outs[0]] = have.get(s.outs[0], frozenset()) | ranks(st)
            continue
        if not reads:
            out.append((s, st))
            continue
        for v in reads:   # each micro-batch's term summed where this step reads it, once per rank
            missing = ranks(st) - have.get(v, frozenset())
            if missing:
                at = frozenset(_stage_on(r, made.get(v, ()), st, p) for r in missing)
                out.append((_local_sum(s, v, sum_of(v), values, mesh), at))
                have[v] = have.get(v, frozenset()) | missing
        ins = tuple(new[v] if v in summed else v for v in s.ins)
        if s.kind == "local" and s.op in ("add", "sub") and len(reads) < len(s.ins):
            s = _sum_of_terms(s, [v in summed for v in s.ins], mesh.axis_size((MB_AXIS,)))
        if s.is_collective and MB_AXIS in s.axes:
            axes = tuple(a for a in s.axes if a != MB_AXIS)
            s = dataclasses.replace(s, ins=ins, axes=axes) if axes else _copy(s, ins[0], values)
        else:
            have.update((v, have.get(v, frozenset()) | ranks(st)) for v in s.outs if v in summed)
            s = dataclasses.replace(s, ins=ins, outs=tuple(sum_of(v) if v in summed else v for v in s.outs))
        out.append((s, st))
    return out


def _sum_of_terms(s: Step, summed: list[bool], m: int) -> Step:
    """Add or sub ``s`` reading the terms ``summed`` marks as their sums over the ``m`` micro-batches:
    its result, partial over them, is the sum of the terms, each partial over them or the same for
    every micro-batch, that last scaled by 1/m (a loss term made from every micro-batch's per-layer
    outputs added to one made per micro-batch).  The sum over the micro-batches of such a step is
    the step on the summed terms and on ``m`` times each of the others (it is linear in them all)."""
    fn = s.args["fn"]

    def kernel(ctx, attrs, *xs):
        return fn(ctx, attrs, *(x if k else x * m for x, k in zip(xs, summed)))
    return dataclasses.replace(s, args=step_args("local", {**s.args, "fn": kernel, "inplace": None}),
                               note=f"{s.note}; terms the same for every micro-batch x {m}".lstrip("; "))


def _stage_on(r: int, made, read, p: int) -> int:
    """The stage of rank ``r`` that sums a value: one that made it, else one that reads it."""
    return min([u for u in made if u % p == r] or [u for u in read if u % p == r])


def _local_sum(reader: Step, v: int, to: int, values: dict, mesh) -> Step:
    """An allreduce of ``v`` over the micro-batch axis alone into ``to``: local to a process."""
    return Step("allreduce", reader.node, "microbatch_sum", f"micro-batch sum for {reader.label}", reader.phase,
                (v,), (to,), (MB_AXIS,), step_args("allreduce", {"op": "sum"}), values[v].local_bytes(mesh),
                note="summed over the micro-batches before it moves")


def _same(ctx, attrs, x):
    return x


def _copy(s: Step, v: int, values: dict) -> Step:
    """Step ``s`` (an allreduce over the micro-batch axis alone) once its input is summed: a copy."""
    out = values[s.outs[0]]
    return Step("local", s.node, s.op, s.label, s.phase, (v,), s.outs, (),
                step_args("local", {"fn": _same, "attrs": {}, "compute": out.sharding.split,
                                    "sizes": {d.name: d.size for d in out.shape}}),
                note="its micro-batches were summed before")
