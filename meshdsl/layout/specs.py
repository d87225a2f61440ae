"""Frozen dataclasses that the string sub-languages parse into.

Each remembers the source string and the span of every name, so semantic errors
found later (an unknown axis, a size that does not divide) can underline the
exact spot.  No lark object ever leaves :mod:`meshdsl.layout.parse`.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import Span


@dataclass(frozen=True)
class Name:
    """An identifier and where it stands in its source string."""

    name: str
    span: Span


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
class RuleSpec:
    """One layout rule: ``[scope.]dim : axis`` or ``dim : (axis, axis)``.

    ``scope`` is None for a global rule, ``"params"`` for every trainable
    parameter (and its gradient), or the name of one tensor.
    """

    scope: Name | None
    dim: Name
    axes: tuple[Name, ...]
    span: Span


@dataclass(frozen=True)
class LayoutSpec:
    """A parsed layout string: rules in the order written (earlier = higher priority)."""

    rules: tuple[RuleSpec, ...]
    source: str


@dataclass(frozen=True)
class EinsumSpec:
    """``"batch d_model, d_model d_ff -> batch d_ff"``; output None when ``->`` is omitted."""

    inputs: tuple[tuple[Name, ...], ...]
    output: tuple[Name, ...] | None
    source: str


@dataclass(frozen=True)
class Group:
    """A parenthesised composition ``(heads d_k)`` in a rearrange pattern."""

    names: tuple[Name, ...]
    span: Span


@dataclass(frozen=True)
class PatternSpec:
    """``"batch seq (heads d_k) -> batch seq heads d_k"``: each side a list of names or groups."""

    left: tuple[Name | Group, ...]
    right: tuple[Name | Group, ...]
    source: str
