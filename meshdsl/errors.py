"""The one exception hierarchy of meshdsl, and helpers that format messages the JAX way.

Every error a user can cause derives from :class:`MeshDSLError`, itself a
``ValueError``.  A message says what was called, the inputs, one bullet per bad
item, the rule and the fix.  Errors about strings show the string with a caret.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """A half-open character range ``[start, end)`` inside a source string."""

    start: int
    end: int


class MeshDSLError(ValueError):
    """Root of every user-facing meshdsl error."""


class ParseError(MeshDSLError):
    """A mesh, layout, einsum or rearrange string is not well formed."""


class ShapeError(MeshDSLError):
    """Dims do not fit together (unknown name, size mismatch, duplicate name)."""


class LayoutError(MeshDSLError):
    """A layout cannot be applied (unknown axis, divisibility, conflicts)."""


class MeshError(MeshDSLError):
    """The mesh is malformed or does not match the process count."""


class GraphError(MeshDSLError):
    """A graph is built or used wrongly (mixing graphs, missing feeds, bad grads)."""


class DistributedError(MeshDSLError):
    """A multi-process run failed: a rank died, timed out or compiled another plan."""


def caret(source: str, span: Span | int | None, width: int | None = None) -> str:
    """Return ``source`` on one line and a caret line under ``span``.

    Multi-line sources show only the line that holds the span, prefixed with its
    line number, so layouts kept in files still point at the right spot.
    """
    if span is None:
        return f"    {source}"
    if isinstance(span, int):
        span = Span(span, span + (width or 1))
    start = max(0, min(span.start, len(source)))
    line_start = source.rfind("\n", 0, start) + 1
    line_end = source.find("\n", start)
    if line_end < 0:
        line_end = len(source)
    line = source[line_start:line_end]
    col = start - line_start
    length = max(1, min(span.end, line_end) - start)
    prefix = "    "
    if "\n" in source:
        lineno = source.count("\n", 0, line_start) + 1
        prefix = f"    line {lineno}: "
    return f"{prefix}{line}\n{' ' * (len(prefix) + col)}{'^' * length}"


def message(what: str, *, inputs: list[str] | None = None, bullets: list[str] | None = None,
            rule: str | None = None, fix: str | None = None, source: str | None = None,
            span: Span | int | None = None) -> str:
    """Compose a message in the house structure: what, inputs, bullets, rule, fix."""
    parts = [what]
    if source is not None:
        parts.append(caret(source, span))
    for line in inputs or []:
        parts.append(f"  {line}")
    for b in bullets or []:
        parts.append(f"  * {b}")
    if rule:
        parts.append(f"Rule: {rule}")
    if fix:
        parts.append(f"Fix: {fix}")
    return "\n".join(parts)


def did_you_mean(name: str, choices) -> str:
    """Return ' Did you mean 'x'?' for the closest choice, or ''."""
    import difflib

    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else ""
