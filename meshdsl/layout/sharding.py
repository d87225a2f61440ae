"""How one tensor is laid out on the mesh: which axes split each dim, which are partial.

A :class:`Sharding` maps every dim of a tensor (by name) to the tuple of mesh
axes that split it, first axis major, plus the axes over which the local
values are still *partial sums* (Mesh-TF's lazy allreduce).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from ..core.shape import Shape
from .mesh import Mesh


@dataclass(frozen=True)
class Sharding:
    """``dims``: ((dim_name, axes), ...) in the tensor's dim order; ``partial``: axes."""

    dims: tuple[tuple[str, tuple[str, ...]], ...]
    partial: tuple[str, ...] = ()

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
        return Sharding(self.dims, tuple(partial))

    def local_shape(self, shape: Shape, mesh: Mesh) -> tuple[int, ...]:
        return tuple(d.size // mesh.axis_size(self.axes_of(d.name)) for d in shape)

    def offsets(self, shape: Shape, mesh: Mesh, rank: int) -> tuple[int, ...]:
        out = []
        for d in shape:
            axes = self.axes_of(d.name)
            if axes:
                out.append(mesh.index_along(rank, axes) * (d.size // mesh.axis_size(axes)))
            else:
                out.append(0)
        return tuple(out)

    def slice_index(self, shape: Shape, mesh: Mesh, rank: int) -> tuple[slice, ...]:
        """The index of this rank's slice in the full tensor (dims in ``shape`` order)."""
        idx = []
        for d, off in zip(shape, self.offsets(shape, mesh, rank)):
            n = d.size // mesh.axis_size(self.axes_of(d.name))
            idx.append(slice(off, off + n))
        return tuple(idx)

    def slice_of(self, full, shape: Shape, mesh: Mesh, rank: int):
        """This rank's slice of the full tensor ``full`` (dims in ``shape`` order)."""
        return full[self.slice_index(shape, mesh, rank)]

    def local_numel(self, shape: Shape, mesh: Mesh) -> int:
        return math.prod(self.local_shape(shape, mesh))

    def __str__(self) -> str:
        parts = [f"{n}:{'(' + ','.join(a) + ')' if len(a) > 1 else a[0]}" for n, a in self.dims if a]
        s = "{" + ", ".join(parts) + "}"
        if self.partial:
            s += f" partial({','.join(self.partial)})"
        return s
