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


# Characters that end a line in mesh and layout strings: "\n", "\r\n" and a lone "\r".
LINE_BREAKS = "\r\n"
# The most characters of one source line an error shows; a longer line is cut
# to a window around the caret, so a 100 KB layout is not echoed whole.
WINDOW = 100
_CONTEXT = 40  # characters kept before the caret when a line is cut


def clip(text: str, limit: int = WINDOW) -> str:
    """``text`` on one line, cut to ``limit`` characters with "..." when longer."""
    text = " ".join(text.splitlines())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _line_bounds(source: str, pos: int) -> tuple[int, int, int]:
    """Start, end and 1-based number of the line that holds ``pos``."""
    start = max(source.rfind(b, 0, pos) for b in LINE_BREAKS) + 1
    ends = [i for i in (source.find(b, pos) for b in LINE_BREAKS) if i >= 0]
    end = min(ends) if ends else len(source)
    head = source[:start]
    number = head.count("\n") + head.count("\r") - head.count("\r\n") + 1
    return start, end, number


def caret(source: str, span: Span | int | None, width: int | None = None) -> str:
    """Return the line of ``source`` that holds ``span`` and a caret line under it.

    Multi-line sources (any of ``\n``, ``\r\n``, ``\r``) show only the line that
    holds the span, prefixed with its line number, so layouts kept in files still
    point at the right spot.  A line longer than :data:`WINDOW` characters is cut
    to a window around the span, with "..." on each cut side.
    """
    if span is None:
        return f"    {clip(source)}"
    if isinstance(span, int):
        span = Span(span, span + (width or 1))
    pos = max(0, min(span.start, len(source)))
    line_start, line_end, lineno = _line_bounds(source, pos)
    line = source[line_start:line_end]
    col = pos - line_start
    length = max(1, min(span.end, line_end) - pos)
    if len(line) > WINDOW:
        lo = max(0, min(col - _CONTEXT, len(line) - WINDOW))
        hi = lo + WINDOW
        length = max(1, min(length, hi - col))
        left = "..." if lo else ""
        line = left + line[lo:hi] + ("..." if hi < len(line) else "")
        col += len(left) - lo
    prefix = "    "
    if any(b in source for b in LINE_BREAKS):
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


def env_choice(name: str, choices: tuple[str, ...], what: str, fix: str, error=MeshDSLError) -> str:
    """``$name``, one of ``choices`` (unset or blank: the first); else an ``error`` naming the
    value, the choices and ``fix`` (what to set instead)."""
    import os
    chosen = os.environ.get(name, "").strip() or choices[0]
    if chosen not in choices:
        raise error(message(
            f"{name}={chosen!r} is not {what} meshdsl knows",
            rule=f"{name} is one of {', '.join(choices)} (or unset: {choices[0]})",
            fix=f"unset {name}, or {fix}"))
    return chosen
