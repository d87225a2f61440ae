"""Re-layout: the collectives that turn one sharding of a tensor into another.

Per mesh axis, following Mesh-TF's reshape rules and DTensor's redistribute:

* partial -> split on a dim  : reduce_scatter
* partial -> not split       : allreduce (one collective over all such axes)
* split on d -> split on d'  : alltoall (never allgather + slice)
* split on d -> not split    : allgather
* not split -> split on d    : local split (no communication)

Dims split over several axes are changed at their minor end, so each step
keeps the global element order exact.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from ..core.shape import Shape
from ..layout.mesh import Mesh
from ..layout.sharding import Sharding
from .cost import DEFAULT, CostModel


@dataclass(frozen=True)
class Move:
    """One re-layout step: ``kind`` over ``axes``, on dim ``dim`` (and ``dim2`` for alltoall).

    For alltoall ``dim`` is the dim that becomes whole (concat) and ``dim2`` the one
    that becomes split.  ``after`` is the sharding once the move is done.
    """

    kind: str
    axes: tuple[str, ...]
    dim: str | None
    dim2: str | None
    before: Sharding
    after: Sharding


def _mk(dims: dict[str, list[str]], order, partial) -> Sharding:
    return Sharding(tuple((n, tuple(dims[n])) for n in order), tuple(partial))


def plan_moves(shape: Shape, a: Sharding, b: Sharding, mesh: Mesh) -> list[Move]:
    """The moves turning sharding ``a`` into ``b`` (both of a tensor with ``shape``)."""
    if a == b:
        return []
    order = shape.names
    cur = {n: list(a.axes_of(n)) for n in order}
    partial = [x for x in a.partial]
    moves: list[Move] = []

    def snap():
        return _mk(cur, order, partial)

    # 1. Partial sums that b does not keep.
    pending = [x for x in partial if x not in b.partial]
    used = {x for axes in cur.values() for x in axes}
    scatter = []
    for x in pending:
        d = next((n for n in order if x in b.axes_of(n)), None)
        if d is not None and x not in used:
            want = b.axes_of(d)
            if tuple(cur[d]) + (x,) == want[:len(cur[d]) + 1]:
                scatter.append((x, d))
                used.add(x)
    reduce_all = [x for x in pending if x not in {s for s, _ in scatter}]
    if reduce_all:
        before = snap()
        partial = [x for x in partial if x not in reduce_all]
        moves.append(Move("allreduce", tuple(reduce_all), None, None, before, snap()))
    for x, d in scatter:
        before = snap()
        partial.remove(x)
        cur[d].append(x)
        moves.append(Move("reduce_scatter", (x,), d, None, before, snap()))

    # 2. Axes to take off each dim, minor end first: alltoall when the axis goes
    #    straight onto the minor end of another dim, else allgather.
    for n in order:
        want = b.axes_of(n)
        k = 0
        while k < len(cur[n]) and k < len(want) and cur[n][k] == want[k]:
            k += 1
        gather: list[str] = []  # popped from the minor end, minor first

        def flush():
            if gather:
                before = _mk({**cur, n: cur[n] + list(reversed(gather))}, order, partial)
                moves.append(Move("allgather", tuple(reversed(gather)), n, None, before, snap()))
                gather.clear()

        while len(cur[n]) > k:
            x = cur[n][-1]
            d2 = next((m for m in order if m != n and x in b.axes_of(m)), None)
            if d2 is not None and tuple(cur[d2]) + (x,) == b.axes_of(d2)[:len(cur[d2]) + 1]:
                flush()
                before = snap()
                cur[n].pop()
                cur[d2].append(x)
                moves.append(Move("alltoall", (x,), n, d2, before, snap()))
            else:
                gather.append(cur[n].pop())
        flush()

    # 3. Local splits for what b adds.
    for n in order:
        want = b.axes_of(n)
        if tuple(cur[n]) != want[:len(cur[n])]:
            raise AssertionError(f"relayout {a} -> {b}: dim {n} at {cur[n]}")
        extra = list(want[len(cur[n]):])
        if extra:
            before = snap()
            cur[n].extend(extra)
            moves.append(Move("split", tuple(extra), n, None, before, snap()))

    # 4. Partial axes b keeps but a lacked cannot be created (a bug upstream).
    assert set(partial) == set(b.partial), (a, b, partial)
    return moves


def move_bytes(m: Move, shape: Shape, mesh: Mesh, itemsize: int) -> int:
    """Per-rank bytes a move sends: the size of its local input."""
    if m.kind == "split":
        return 0
    return m.before.local_numel(shape, mesh) * itemsize


@functools.lru_cache(maxsize=1 << 16)
def relayout_cost(shape: Shape, a: Sharding, b: Sharding, mesh: Mesh, itemsize: int = 4,
                  model: CostModel = DEFAULT) -> float:
    """Seconds the moves from ``a`` to ``b`` are expected to take.

    Cached: the generic lowering rule prices the same few re-layouts for every
    candidate compute sharding of every node, and all arguments are immutable.
    """
    if a == b:
        return 0.0
    total = 0.0
    for m in plan_moves(shape, a, b, mesh):
        total += model.collective(m.kind, move_bytes(m, shape, mesh, itemsize), mesh.axis_size(m.axes))
    return total
