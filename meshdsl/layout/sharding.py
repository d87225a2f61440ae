"""How one tensor is laid out on the mesh: which axes split each dim, which are partial.

A :class:`Sharding` maps every dim of a tensor (by name) to the tuple of mesh
axes that split it, first axis major, plus the axes over which the local
values are still *partial sums* (Mesh-TF's lazy allreduce).

A dim its axes do not divide is split unevenly, as ``torch.tensor_split`` cuts:
each axis, first to last, cuts the part the axes before it left into parts whose
sizes differ by at most one, the first ``size % n`` of them one longer
(:func:`chunk`).  Cutting axis by axis keeps every re-layout exact: a re-layout
only adds or removes axes at a dim's minor end, so the parts a collective joins
or cuts are always the parts of one axis's cut.  Every part has ``floor`` or
``ceil`` of ``size / n`` elements (``n`` the axes' product), so the largest local
shape (:meth:`Sharding.local_shape` without a rank) is the ceiling on every dim.

A dim split over one axis may instead have given part lengths (``Sharding.parts``): a
pipeline whose stages run unequal numbers of layers stores each stage's layers where it
runs them (``lowering/stage_layers.py``).  Collectives that join or cut such a dim carry
the lengths (``collectives.parts_of``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from ..core.shape import Shape
from .mesh import Mesh


def chunk(size: int, mesh: Mesh, rank: int, axes) -> tuple[int, int]:
    """``(offset, length)`` of ``rank``'s part of a dim of ``size`` split over ``axes``.

    Each axis, first (major) to last, cuts the part left so far into
    ``mesh.sizes[axis]`` parts as ``torch.tensor_split`` does; with every axis
    dividing what it cuts, this is ``index * size // n``, the even split.
    """
    off, n = 0, size
    if axes:
        coords = mesh.coords(rank)
        for a in axes:
            q, r = divmod(n, mesh.sizes[a])
            i = coords[a]
            off += i * q + min(i, r)
            n = q + (i < r)
    return off, n


def part_sizes(size: int, mesh: Mesh, members, axes) -> tuple[int, ...]:
    """The length of each member's part of a dim of ``size`` split over ``axes`` (see :func:`chunk`)."""
    return tuple(chunk(size, mesh, r, axes)[1] for r in members)


def is_even(size: int, mesh: Mesh, axes) -> bool:
    """Whether ``axes`` split a dim of ``size`` into parts of one length."""
    return size % mesh.axis_size(tuple(axes)) == 0


@dataclass(frozen=True)
class Sharding:
    """``dims``: ((dim_name, axes), ...) in the tensor's dim order; ``partial``: axes."""

    dims: tuple[tuple[str, tuple[str, ...]], ...]
    partial: tuple[str, ...] = ()
    #: ((dim_name, lengths), ...): given part lengths of dims split over one axis, by the axis's
    #: index (the other dims are cut as :func:`chunk` does)
    parts: tuple[tuple[str, tuple[int, ...]], ...] = ()

    @staticmethod
    def replicated(shape: Shape) -> "Sharding":
        return Sharding(tuple((n, ()) for n in shape.names))

    @staticmethod
    def of(shape: Shape, split: dict[str, tuple[str, ...]], partial=()) -> "Sharding":
        return Sharding(tuple((n, tuple(split.get(n, ()))) for n in shape.names), tuple(partial))

    @cached_property
    def split(self) -> dict[str, tuple[str, ...]]:
        return {n: a for n, a in self.dims if a}

    def axes_of(self, name: str) -> tuple[str, ...]:
        return self.split.get(name, ())

    @cached_property
    def used_axes(self) -> frozenset[str]:
        return frozenset(a for _, axes in self.dims for a in axes) | frozenset(self.partial)

    def with_partial(self, partial) -> "Sharding":
        return Sharding(self.dims, tuple(partial), self.parts)

    @cached_property
    def given_parts(self) -> dict[str, tuple[int, ...]]:
        """Dim name -> its given part lengths (see :attr:`parts`)."""
        return dict(self.parts)

    def with_parts(self, name: str, lengths) -> "Sharding":
        """This sharding with dim ``name`` (split over one axis) cut into parts of ``lengths``."""
        assert len(self.axes_of(name)) == 1, f"given parts of '{name}' need one axis, not {self.axes_of(name)}"
        return Sharding(self.dims, self.partial,
                        tuple((n, p) for n, p in self.parts if n != name) + ((name, tuple(lengths)),))

    def _chunk(self, size: int, name: str, mesh: Mesh, rank: int) -> tuple[int, int]:
        """``(offset, length)`` of ``rank``'s part of dim ``name`` (see :func:`chunk`)."""
        lengths = self.given_parts.get(name) if self.parts else None
        if lengths is None:
            return chunk(size, mesh, rank, self.axes_of(name))
        i = mesh.coords(rank)[self.axes_of(name)[0]]
        return sum(lengths[:i]), lengths[i]

    def local_shape(self, shape: Shape, mesh: Mesh, rank: int | None = None) -> tuple[int, ...]:
        """``rank``'s local shape; without a rank the largest one (every rank's when the split is even)."""
        if rank is not None:
            return tuple(self._chunk(d.size, d.name, mesh, rank)[1] for d in shape)
        given = self.given_parts if self.parts else {}
        return tuple(max(given[d.name]) if d.name in given else -(-d.size // mesh.axis_size(self.axes_of(d.name)))
                     for d in shape)

    def offsets(self, shape: Shape, mesh: Mesh, rank: int) -> tuple[int, ...]:
        return tuple(self._chunk(d.size, d.name, mesh, rank)[0] for d in shape)

    def slice_index(self, shape: Shape, mesh: Mesh, rank: int) -> tuple[slice, ...]:
        """The index of this rank's slice in the full tensor (dims in ``shape`` order)."""
        return tuple(slice(off, off + n) for off, n in
                     (self._chunk(d.size, d.name, mesh, rank) for d in shape))

    def local_numel(self, shape: Shape, mesh: Mesh) -> int:
        """Elements of the largest local slice (what costs and memory reports count)."""
        return math.prod(self.local_shape(shape, mesh))

    def __str__(self) -> str:
        given = self.given_parts if self.parts else {}
        parts = [f"{n}:{'(' + ','.join(a) + ')' if len(a) > 1 else a[0]}"
                 + (f"[{','.join(map(str, given[n]))}]" if n in given else "") for n, a in self.dims if a]
        s = "{" + ", ".join(parts) + "}"
        if self.partial:
            s += f" partial({','.join(self.partial)})"
        return s
