"""The logical mesh: named axes with sizes, and rank <-> coordinate maths.

Ranks are numbered row-major over the axes in the order written, so in
``"data:2; model:2"`` ranks 0 and 1 differ only in ``model``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from ..errors import MeshError, did_you_mean, message


@dataclass(frozen=True)
class Mesh:
    """An ordered set of named mesh axes.

    Args:
      axes: ``((name, size), ...)`` in major-to-minor order.
      source: the string it was parsed from, when there was one.

    Example: ``Mesh.parse("data:2; model:2")``.
    """

    axes: tuple[tuple[str, int], ...]
    source: str | None = None

    @staticmethod
    def parse(text: "str | Mesh | dict") -> "Mesh":
        """Build a mesh from a mesh string, a dict ``{axis: size}``, or a Mesh."""
        if isinstance(text, Mesh):
            return text
        if isinstance(text, dict):
            return Mesh(tuple((str(k), int(v)) for k, v in text.items()))
        from .parse import parse_mesh

        spec = parse_mesh(text)
        return Mesh(tuple((a.name.name, a.size) for a in spec.axes), source=spec.source)

    @cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.axes)

    @cached_property
    def sizes(self) -> dict[str, int]:
        return dict(self.axes)

    @cached_property
    def size(self) -> int:
        return math.prod(s for _, s in self.axes)

    def __str__(self) -> str:
        return "; ".join(f"{n}:{s}" for n, s in self.axes) or "(no axes)"

    def axis_size(self, axes) -> int:
        """Product of the sizes of ``axes`` (1 for none)."""
        return math.prod(self.sizes[a] for a in axes)

    def check_axis(self, axis: str, context: str) -> None:
        if axis not in self.sizes:
            raise MeshError(message(
                f"{context}: unknown mesh axis '{axis}'.{did_you_mean(axis, self.names)}",
                inputs=[f"mesh: {self}"], rule="every axis named in a layout must be an axis of the mesh",
                fix=f"use one of {list(self.names)} or add '{axis}:N' to the mesh"))

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinate of ``rank`` on every axis."""
        out = {}
        for name, size in reversed(self.axes):
            out[name] = rank % size
            rank //= size
        return out

    def rank(self, coords: dict[str, int]) -> int:
        r = 0
        for name, size in self.axes:
            r = r * size + coords[name]
        return r

    def index_along(self, rank: int, axes) -> int:
        """Linear index of ``rank`` within the group over ``axes`` (first axis major)."""
        c = self.coords(rank)
        i = 0
        for a in axes:
            i = i * self.sizes[a] + c[a]
        return i

    def group(self, rank: int, axes) -> tuple[int, ...]:
        """Ranks that differ from ``rank`` only along ``axes``, in linear order over ``axes``."""
        c = dict(self.coords(rank))
        out = []
        n = self.axis_size(axes)
        for i in range(n):
            rem = i
            for a in reversed(tuple(axes)):
                c[a] = rem % self.sizes[a]
                rem //= self.sizes[a]
            out.append(self.rank(c))
        return tuple(out)

    def groups(self, axes) -> tuple[tuple[int, ...], ...]:
        """Every group over ``axes``, each listed once, ordered by first rank."""
        seen, out = set(), []
        for r in range(self.size):
            g = self.group(r, axes)
            if g not in seen:
                seen.add(g)
                out.append(g)
        return tuple(out)
