"""Named dims and ordered shapes: the vocabulary every other module speaks.

A :class:`Dim` is a named tensor dimension with a size.  A :class:`Shape` is an
ordered tuple of dims with unique names.  Alignment and broadcasting go by
name, never by position.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable

from ..errors import ShapeError, did_you_mean, message
from .names import NAME_RULE, is_name


@dataclass(frozen=True)
class Dim:
    """A named tensor dimension, e.g. ``Dim("batch", 32)``.

    Args:
      name: an ASCII identifier (:data:`meshdsl.core.names.NAME_PATTERN`), the
        same names a layout string can spell.
      size: an int >= 1 (not a bool).

    Raises:
      ShapeError: on a bad name or size.
    """

    name: str
    size: int

    def __post_init__(self):
        if not is_name(self.name):
            # The same rule as the grammars' NAME, so every dim can be named in a layout.
            raise ShapeError(message(f"Dim(name={self.name!r}, size={self.size!r}): bad name.",
                                     rule=NAME_RULE,
                                     fix="use ASCII letters, digits and '_', not starting with a digit"))
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise ShapeError(message(
                f"Dim({self.name!r}, {self.size!r}): size must be a positive int, got "
                f"{self.size!r} ({type(self.size).__name__}).",
                rule="every dim has a size >= 1, an int (not a bool or float)",
                fix=f"write Dim({self.name!r}, N) with an int N >= 1"))

    def __repr__(self) -> str:
        return f"{self.name}:{self.size}"


class Shape(tuple):
    """An ordered tuple of :class:`Dim` with unique names."""

    def __new__(cls, dims: Iterable[Dim] = ()):
        dims = tuple(dims)
        for d in dims:
            if not isinstance(d, Dim):
                raise ShapeError(message(f"Shape({list(dims)}): {d!r} is not a Dim.",
                                         rule="a shape is a list of Dim objects",
                                         fix="build dims with meshdsl.Dim(name, size)"))
        names = [d.name for d in dims]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ShapeError(message(f"Shape({list(dims)}): dim name(s) {dup} appear twice.",
                                     rule="dim names within one tensor are unique",
                                     fix="rename one of them, e.g. 'seq' and 'key_seq'"))
        return super().__new__(cls, dims)

    @cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(d.size for d in self)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def __contains__(self, item) -> bool:
        if isinstance(item, str):
            return any(d.name == item for d in self)
        return tuple.__contains__(self, item)

    def index(self, name) -> int:  # type: ignore[override]
        if isinstance(name, Dim):
            name = name.name
        for i, d in enumerate(self):
            if d.name == name:
                return i
        if not isinstance(name, str):   # concat([x, y], 0): a position, as torch's dim=0
            raise ShapeError(message(f"dim {name!r} ({type(name).__name__}) is no dim of shape {self}: dims are "
                                     "named, not numbered.", rule="ops refer to dims by name",
                                     fix=f"use one of {list(self.names)}"))
        raise ShapeError(message(f"dim '{name}' is not in shape {self}.{did_you_mean(name, self.names)}",
                                 rule="ops refer to dims by name", fix=f"use one of {list(self.names)}"))

    def get(self, name: str) -> Dim:
        return tuple.__getitem__(self, self.index(name))

    def __getitem__(self, key):
        """``shape["seq"]`` (or ``shape[dim]``) is that dim; an int or a slice indexes by position."""
        if isinstance(key, (str, Dim)):
            return self.get(key)
        return tuple.__getitem__(self, key)

    def without(self, names) -> "Shape":
        names = {n.name if isinstance(n, Dim) else n for n in names}
        return Shape(d for d in self if d.name not in names)

    def __repr__(self) -> str:
        return "[" + ", ".join(repr(d) for d in self) + "]"

    __str__ = __repr__


def as_shape(x) -> Shape:
    """Accept a Shape, a list of Dims, or a single Dim."""
    if isinstance(x, Shape):
        return x
    if isinstance(x, Dim):
        return Shape([x])
    if isinstance(x, str):   # list("batch") would be the letters b, a, t, c, h
        raise ShapeError(message(f"shape {x!r} is a str, not a list of Dims.",
                                 rule="a shape is a list of Dim objects, each with its name and size",
                                 fix="build dims with meshdsl.Dim(name, size): "
                                     "[md.Dim('batch', 8), md.Dim('d_model', 4)]"))
    return Shape(list(x))


def broadcast_shapes(shapes: list[Shape], what: str) -> Shape:
    """Union of dims by name, in order of first appearance; sizes must agree."""
    out: dict[str, Dim] = {}
    for s in shapes:
        for d in s:
            if d.name in out and out[d.name].size != d.size:
                raise ShapeError(message(
                    f"{what}: dim '{d.name}' has size {out[d.name].size} in one operand and {d.size} in another.",
                    inputs=[f"operand shapes: {', '.join(map(str, shapes))}"],
                    rule="operands are aligned by dim name; a name means one size",
                    fix=f"rename one of the '{d.name}' dims or make the sizes equal"))
            out.setdefault(d.name, d)
    return Shape(out.values())
