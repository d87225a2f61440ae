"""Re-layout: the collectives that turn one sharding of a tensor into another.

Per mesh axis, following Mesh-TF's reshape rules and DTensor's redistribute:

* partial -> split on a dim  : reduce_scatter
* partial -> not split       : allreduce (one collective over all such axes)
* split on d -> split on d'  : alltoall (never allgather + slice)
* split on d -> not split    : allgather
* not split -> split on d    : local split (no communication)

Dims split over several axes are changed at their minor end, so each step
keeps the global element order exact; a run of axes that moves together (from
partial sums or from one dim onto another) is one collective over the run.

The virtual micro-batch axis (:data:`~.pipeline.MB_AXIS`) carries only partial
sums: a process holds all its micro-batches and can fold them by summing only,
and a micro-batch exists only while its step runs.  Any other move over it is
*blocked* (:func:`blocked`): priced at infinity, so the lowering rules pick the
partial-sum form, and refused by :meth:`~.compiler.Lowerer.emit`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from ..core.shape import Shape
from ..layout.mesh import Mesh
from ..layout.sharding import Sharding
from .cost import DEFAULT, CostModel
from .pipeline import MB_AXIS
from .uneven import uneven_arg


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


def move_args(m, shape, mesh: Mesh) -> dict:
    """The step args of re-layout move ``m`` on a tensor of ``shape`` (dims by position); a move
    that joins or cuts parts of unequal length carries them (:func:`.uneven.uneven_arg`)."""
    pos = shape.index(m.dim) if m.dim else None
    if m.kind == "allreduce":
        return {"op": "sum"}
    if m.kind == "alltoall":
        args = {"concat_dim": pos, "split_dim": shape.index(m.dim2)}
    elif m.kind == "reduce_scatter":
        args = {"dim": pos, "op": "sum"}
    else:
        args = {"dim": pos}  # allgather, split
    uneven = uneven_arg(shape, m.before, m.after, mesh, m.axes) if m.kind != "split" else None
    return {**args, "uneven": uneven} if uneven else args


def _mk(dims: dict[str, list[str]], order, partial) -> Sharding:
    return Sharding(tuple((n, tuple(dims[n])) for n in order), tuple(partial))


@functools.lru_cache(maxsize=1 << 14)
def plan_moves(shape: Shape, a: Sharding, b: Sharding, mesh: Mesh) -> tuple[Move, ...]:
    """The moves turning sharding ``a`` into ``b`` (both of a tensor with ``shape``).

    Cached (every argument and every :class:`Move` is immutable): a compile re-lays out the
    same values the same ways for many nodes, and the pricing asks for the same moves."""
    return tuple(_plan_moves(shape, a, b, mesh))


def _plan_moves(shape: Shape, a: Sharding, b: Sharding, mesh: Mesh) -> list[Move]:
    if a == b:
        return []
    st = _Relayout(shape, a)
    _reduce_partials(st, b)
    for n in st.order:
        _take_off(st, n, b)
    _split_locally(st, a, b)
    # Partial axes b keeps but a lacked cannot be created (a bug upstream).
    assert set(st.partial) == set(b.partial), (a, b, st.partial)
    return st.moves


class _Relayout:
    """A re-layout under way: each dim's mesh axes and the partial axes as the moves so far
    leave them, and those moves."""

    __slots__ = ("order", "cur", "partial", "moves")

    def __init__(self, shape: Shape, a: Sharding):
        self.order = shape.names
        self.cur = {n: list(a.axes_of(n)) for n in self.order}
        self.partial = list(a.partial)
        self.moves: list[Move] = []

    def snap(self) -> Sharding:
        return _mk(self.cur, self.order, self.partial)

    def record(self, kind: str, axes: tuple[str, ...], dim: str | None, dim2: str | None,
               before: Sharding) -> None:
        """Append the move that led from ``before`` to the sharding now."""
        self.moves.append(Move(kind, axes, dim, dim2, before, self.snap()))


def _reduce_partials(st: _Relayout, b: Sharding) -> None:
    """Pass 1. Partial sums that ``b`` does not keep: reduce_scatter the axes that extend a
    dim's split in b's order (one collective per dim, over all such axes at once),
    allreduce the rest."""
    pending = [x for x in st.partial if x not in b.partial]
    scatter: list[tuple[str, tuple[str, ...]]] = []
    for d in st.order:
        want, have = b.axes_of(d), len(st.cur[d])
        if tuple(st.cur[d]) != want[:have]:
            continue
        run: list[str] = []
        for x in want[have:]:
            if x not in pending:
                break
            run.append(x)
        if run:
            scatter.append((d, tuple(run)))
    scattered = {x for _, axes in scatter for x in axes}
    reduce_all = [x for x in pending if x not in scattered]
    if reduce_all:
        before = st.snap()
        st.partial = [x for x in st.partial if x not in reduce_all]
        st.record("allreduce", tuple(reduce_all), None, None, before)
    for d, axes in scatter:
        before = st.snap()
        st.partial = [x for x in st.partial if x not in axes]
        st.cur[d].extend(axes)
        st.record("reduce_scatter", axes, d, None, before)


def _take_off(st: _Relayout, n: str, b: Sharding) -> None:
    """Pass 2, for dim ``n``: the axes to take off it, minor end first: alltoall when the
    axis goes straight onto the minor end of another dim, else allgather."""
    want = b.axes_of(n)
    k = 0
    while k < len(st.cur[n]) and k < len(want) and st.cur[n][k] == want[k]:
        k += 1
    gather: list[str] = []  # popped from the minor end, minor first

    def flush():
        if gather:
            before = _mk({**st.cur, n: st.cur[n] + list(reversed(gather))}, st.order, st.partial)
            st.record("allgather", tuple(reversed(gather)), n, None, before)
            gather.clear()

    while len(st.cur[n]) > k:
        hit = _alltoall_run(st, n, k, b)
        if hit is None:
            gather.append(st.cur[n].pop())
            continue
        flush()
        j, d2, run = hit
        before = st.snap()
        del st.cur[n][j:]
        st.cur[d2].extend(run)
        st.record("alltoall", run, n, d2, before)
    flush()


def _alltoall_run(st: _Relayout, n: str, k: int, b: Sharding):
    """The longest minor-end run of ``n``'s axes (from position ``k`` on) that goes, in order,
    onto the minor end of one other dim, which moves in one alltoall over the run:
    ``(start, that dim, run)``, or None."""
    for j in range(k, len(st.cur[n])):
        run = tuple(st.cur[n][j:])
        d2 = next((m for m in st.order if m != n and run[0] in b.axes_of(m)), None)
        if d2 is not None and tuple(st.cur[d2]) + run == b.axes_of(d2)[:len(st.cur[d2]) + len(run)]:
            return j, d2, run
    return None


def _split_locally(st: _Relayout, a: Sharding, b: Sharding) -> None:
    """Pass 3. Local splits for what ``b`` adds."""
    for n in st.order:
        want = b.axes_of(n)
        if tuple(st.cur[n]) != want[:len(st.cur[n])]:
            raise AssertionError(f"relayout {a} -> {b}: dim {n} at {st.cur[n]}")
        extra = list(want[len(st.cur[n]):])
        if extra:
            before = st.snap()
            st.cur[n].extend(extra)
            st.record("split", tuple(extra), n, None, before)


def blocked(m: Move) -> bool:
    """Whether move ``m`` is one no plan may make: a move over the micro-batch axis that is not
    the allreduce of a partial sum (gathering, scattering or splitting micro-batches)."""
    return m.kind != "allreduce" and MB_AXIS in m.axes


def keep_microbatches(target: Sharding, sh: Sharding, shape: Shape, mesh: Mesh) -> Sharding:
    """``target``, except that the dim ``sh`` splits over the micro-batch axis stays split over it.

    A dim split by micro-batches (``batch``, or one renamed from it, as MoE's
    ``expert_batch``) stays a per-micro-batch dim whatever its layout rule says:
    gathering it would be a :func:`blocked` move.  The axis goes major, where
    :mod:`.pipeline` puts it on ``batch``.  ``target`` is kept as it is when it
    already uses the axis or the dim's size does not allow it.
    """
    if MB_AXIS not in sh.used_axes or MB_AXIS in target.used_axes:
        return target
    dim = next((n for n, axes in sh.dims if MB_AXIS in axes), None)
    if dim is None:
        return target
    axes = (MB_AXIS,) + target.axes_of(dim)
    # A micro-batch's rows fewer than the target's axes (2 rows of 'expert_batch' under a:4): the
    # micro-batch axis stays, with the target's axes that still divide them (the rest replicate).
    while len(axes) > 1 and shape.get(dim).size % mesh.axis_size(axes):
        axes = axes[:-1]
    if shape.get(dim).size % mesh.axis_size(axes):
        return target
    return Sharding(tuple((n, axes if n == dim else a) for n, a in target.dims), target.partial)


def move_bytes(m: Move, shape: Shape, mesh: Mesh, itemsize: int) -> int:
    """Per-rank bytes a move sends: the size of its local input."""
    if m.kind == "split":
        return 0
    return m.before.local_numel(shape, mesh) * itemsize


@functools.lru_cache(maxsize=1 << 16)
def relayout_cost(shape: Shape, a: Sharding, b: Sharding, mesh: Mesh, itemsize: int = 4,
                  model: CostModel = DEFAULT) -> float:
    """Seconds the moves from ``a`` to ``b`` are expected to take; infinity when one is
    :func:`blocked`, so no lowering chooses it.

    Cached: the generic lowering rule prices the same few re-layouts for every
    candidate compute sharding of every node, and all arguments are immutable.
    """
    if a == b:
        return 0.0
    total = 0.0
    for m in plan_moves(shape, a, b, mesh):
        if blocked(m):
            return float("inf")
        total += model.collective(m.kind, move_bytes(m, shape, mesh, itemsize), mesh.axis_size(m.axes))
    return total
