"""The logical mesh: named axes with sizes, and rank <-> coordinate maths.

Ranks are numbered row-major over the axes in the order written, so in
``"data:2; model:2"`` ranks 0 and 1 differ only in ``model``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache

from ..core.names import NAME_RULE, is_name
from ..errors import MeshError, clip, did_you_mean, message
from .specs import SIZE_RULE, UNIQUE_RULE

_FORMS = ("a mesh string such as \"data:2; model:2\", a dict {axis: size} such as "
          "{\"data\": 2, \"model\": 2}, or a Mesh")


def _mesh_error(called: str, what: str, *, rule: str, fix: str, bullets=None) -> MeshError:
    return MeshError(message(f"{called}: {what}", bullets=bullets, rule=rule, fix=fix))


def _check_axes(axes, called: str) -> tuple[tuple[str, int], ...]:
    """The axes as a tuple of ``(name, size)`` pairs, or a MeshError naming the bad entry.

    The same rules as a mesh string: names are identifiers, sizes ints >= 1, no
    name twice.  ``called`` names what the user called, for the message.
    """
    if not isinstance(axes, (tuple, list)):
        raise _mesh_error(called, f"axes must be a tuple of (name, size) pairs, got "
                                  f"{type(axes).__name__}.", rule="a Mesh is built from "
                                  "((axis, size), ...) in major-to-minor order",
                          fix='write Mesh((("data", 2), ("model", 2))) or Mesh.parse("data:2; model:2")')
    out, seen = [], {}
    for entry in axes:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
            raise _mesh_error(called, f"entry {entry!r} is not a (name, size) pair.",
                              rule="a Mesh is built from ((axis, size), ...) in major-to-minor order",
                              fix='write each axis as ("data", 2)')
        name, size = entry
        if not is_name(name):
            shown = f"'{name}'" if isinstance(name, str) else f"{name!r} ({type(name).__name__})"
            raise _mesh_error(called, f"axis name {shown} is not a valid name.", rule=NAME_RULE,
                              fix="rename the axis, e.g. 'data' or 'model_2'")
        if isinstance(size, bool) or not isinstance(size, int):
            raise _mesh_error(called, f"axis '{name}' has size {size!r} ({type(size).__name__}).",
                              rule=SIZE_RULE, fix=f"give axis '{name}' an int size >= 1, e.g. 2")
        if size < 1:
            raise _mesh_error(called, f"axis '{name}' has size {size}.", rule=SIZE_RULE,
                              fix=f"give axis '{name}' a size of at least 1 (1 splits nothing), or drop it")
        if name in seen:
            raise _mesh_error(called, f"axis '{name}' is named twice.", rule=UNIQUE_RULE,
                              bullets=[f"first with size {seen[name]}, again with size {size}"],
                              fix=f"rename one of them, or merge them into one axis of size "
                                  f"{seen[name] * size}")
        seen[name] = size
        out.append((name, size))
    return tuple(out)


@dataclass(frozen=True)
class Mesh:
    """An ordered set of named mesh axes.

    Args:
      axes: ``((name, size), ...)`` in major-to-minor order.  Names are
        identifiers, sizes ints >= 1, no name twice.  ``Mesh(())`` is the mesh
        with no axes (a single device); a mesh string cannot be empty.
      source: the string it was parsed from, when there was one.

    Raises:
      MeshError: on a bad name, a bad size, a repeated name or a malformed ``axes``.

    Example: ``Mesh.parse("data:2; model:2")``.
    """

    axes: tuple[tuple[str, int], ...]
    source: str | None = None

    def __post_init__(self):
        # Frozen: normalise lists to tuples so every Mesh is hashable (plans are
        # cached on it).
        object.__setattr__(self, "axes", _check_axes(self.axes, f"Mesh(axes={clip(repr(self.axes))})"))

    @staticmethod
    def parse(text: "str | Mesh | dict") -> "Mesh":
        """Build a mesh from a mesh string, a dict ``{axis: size}``, or a Mesh.

        Args:
          text: e.g. ``"data:2; model:2"`` or ``{"data": 2, "model": 2}``.  The
            empty dict is the mesh with no axes; the empty string is an error.

        Raises:
          ParseError: on a malformed mesh string (with a caret under the spot).
          MeshError: on a bad dict entry or an argument of another type.
        """
        if isinstance(text, Mesh):
            return text
        if isinstance(text, dict):
            return Mesh(_check_axes(tuple(text.items()), f"Invalid mesh {clip(repr(text))}"))
        if not isinstance(text, str):
            raise MeshError(message(
                f"Invalid mesh {clip(repr(text))}: expected a mesh, got {type(text).__name__}.",
                rule=f"a mesh is {_FORMS}", fix='write e.g. "data:2; model:2"'))
        return _parsed(text)

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

    @cached_property
    def _memo(self) -> dict:
        """Answers about axis groups, which the compiler and the collectives ask for often:
        ``axes`` -> :meth:`axis_size`, ``("group", rank, axes)`` -> :meth:`group`, ``("groups",
        axes)`` -> :meth:`groups`.  Only answers are kept (an unknown axis raises each time)."""
        return {}

    def _remember(self, key, compute):
        got = self._memo.get(key)
        if got is None:
            got = self._memo[key] = compute()
        return got

    def axis_size(self, axes) -> int:
        """Product of the sizes of ``axes`` (1 for none)."""
        if type(axes) is tuple:   # the hot path, inline: a tuple of axis names is its own key
            n = self._memo.get(axes)
            if n is None:
                n = self._memo[axes] = math.prod(self.sizes[a] for a in axes)
            return n
        return math.prod(self.sizes[a] for a in axes)

    def check_axis(self, axis: str, context: str) -> None:
        if axis not in self.sizes:
            raise MeshError(message(
                f"{context}: unknown mesh axis '{axis}'.{did_you_mean(axis, self.names)}",
                inputs=[f"mesh: {self}"], rule="every axis named in a layout must be an axis of the mesh",
                fix=f"use one of {list(self.names)} or add '{axis}:N' to the mesh"))

    @cached_property
    def _coords(self) -> dict:
        """Rank -> :meth:`coords`, filled as ranks are asked for (every chunk of a sharded dim asks)."""
        return {}

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinate of ``rank`` on every axis.  The dict is shared by every caller: read it,
        or copy it (``dict(mesh.coords(r))``) to change it."""
        out = self._coords.get(rank)
        if out is None:
            out, r = {}, rank
            for name, size in reversed(self.axes):
                out[name] = r % size
                r //= size
            self._coords[rank] = out
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
        axes = tuple(axes)
        return self._remember(("group", rank, axes), lambda: self._group(rank, axes))

    def _group(self, rank: int, axes: tuple) -> tuple[int, ...]:
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
        axes = tuple(axes)
        return self._remember(("groups", axes), lambda: self._all_groups(axes))

    def _all_groups(self, axes: tuple) -> tuple[tuple[int, ...], ...]:
        seen, out = set(), []
        for r in range(self.size):
            g = self.group(r, axes)
            if g not in seen:
                seen.add(g)
                out.append(g)
        return tuple(out)


@lru_cache(maxsize=256)
def _parsed(text: str) -> Mesh:
    """The Mesh of mesh string ``text``, one per string: a frozen Mesh is shared, and so are the
    memos it fills (``coords``, ``group``) by every compile and run of one mesh string."""
    from .parse import parse_mesh

    spec = parse_mesh(text)
    return Mesh(tuple((a.name.name, a.size) for a in spec.axes), source=spec.source)
