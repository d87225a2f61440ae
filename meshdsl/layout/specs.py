"""Frozen dataclasses that mesh and layout strings parse into.

Each remembers its source string and the span of every name, so semantic errors
found later (an unknown axis, a size that does not divide) can underline the
exact spot.  No lark object ever leaves :mod:`meshdsl.layout.parse`.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core.names import Name
from ..errors import Span

# The rules a mesh obeys, shared by the mesh string's parser and Mesh's own checks.
SIZE_RULE = "mesh sizes are positive integers (an int >= 1; not a bool, float or str)."
UNIQUE_RULE = "each mesh axis has a unique name."
EMPTY_RULE = ("a mesh string names at least one axis; a mesh with no axes (one device) is "
              "asked for explicitly from Python, Mesh(()).")


@dataclass(frozen=True)
class AxisSpec:
    """One mesh axis, ``data:2``."""

    name: Name
    size: int
    size_span: Span


@dataclass(frozen=True)
class MeshSpec:
    """A parsed mesh string such as ``"data:2; model:4"``."""

    axes: tuple[AxisSpec, ...]
    source: str


@dataclass(frozen=True)
class Rule:
    """One layout rule: ``[scope.]dim:axis``, ``dim:(axis, axis)`` (first axis major) or
    ``dim:()``, no axis: the dim stays whole where the rule applies (``up.ch:()`` under
    ``ch:model`` keeps ``ch`` whole in the one tensor ``up``).

    ``scope`` is None for a global rule, ``params`` for every trainable
    parameter (and its gradient), or the name of one tensor.  Names carry their
    spans in the layout string; a rule built from a dict has no spans.

    Example: ``params.d_model:fsdp`` is ``Rule(scope=params, dim=d_model, axes=(fsdp,))``;
    ``up.ch:()`` is ``Rule(scope=up, dim=ch, axes=())``.
    """

    scope: Name | None
    dim: Name
    axes: tuple[Name, ...]
    span: Span | None = None

    @property
    def key(self) -> tuple[str | None, str]:
        """``(scope, dim)`` as plain strings: what the rule applies to."""
        return (self.scope.name if self.scope else None, self.dim.name)

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The mesh axes as plain strings, first major."""
        return tuple(a.name for a in self.axes)

    def __str__(self) -> str:
        names = self.axis_names
        axes = names[0] if len(names) == 1 else "(" + ",".join(names) + ")"
        return f"{self.scope.name + '.' if self.scope else ''}{self.dim.name}:{axes}"


@dataclass(frozen=True)
class LayoutSpec:
    """A parsed layout string: rules in the order written (earlier = higher priority)."""

    rules: tuple[Rule, ...]
    source: str
