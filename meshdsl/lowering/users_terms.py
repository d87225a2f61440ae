"""Errors raised while lowering with micro-batches, restated in the user's terms.

A plan with ``m`` micro-batches is lowered on the user's mesh plus a virtual axis
:data:`~.pipeline.MB_AXIS` and a layout that splits ``batch`` over it first
(:mod:`.pipeline`).  Every rule, layout check and collective below sees that lowered
mesh and layout, so the messages they raise would say ``mesh: stage:2; _mb:2`` and
``layout: layer:stage; batch:_mb``, which the user never wrote.  Rather than thread the
user's pair through every message, :func:`users_terms` restates an error once, where it
leaves the lowering: the lowered mesh and layout become the user's (plus a line
``micro-batches: m``), and what is left of the virtual axis becomes words (a collective
"over the micro-batches", a split or a partial sum "micro-batches").  A message that does
not name the virtual axis is left as it is: it already speaks of what the user wrote.
"""
from __future__ import annotations

import re
from contextlib import contextmanager

from ..errors import MeshDSLError, clip
from ..layout.layout import Layout
from ..layout.mesh import Mesh
from ..layout.specs import Rule
from .pipeline import MB_AXIS
from .plan import Plan

#: How a split or a partial sum over the virtual axis reads.
WORDS = "micro-batches"

# A tuple of axis names that holds the virtual axis: "('_mb',)", "('_mb', 'data')".
_AXES_TUPLE = re.compile(r"\(((?:'[^'()]*',?\s*)*)\)")
# The virtual axis with its size, as mesh strings and axis products print it: "_mb:2".
_SIZED = re.compile(rf"(?<![\w.]){MB_AXIS}:(\d+)")
# Any other mention of the virtual axis: a layout rule's or a sharding's "batch:(_mb,data)", "partial(_mb)".
_BARE = re.compile(rf"'?(?<![\w.]){MB_AXIS}(?!\w)'?")


@contextmanager
def users_terms(lowered: tuple[Mesh, Layout], given: tuple[Mesh, Layout], num_microbatches: int):
    """Restate a :class:`~meshdsl.errors.MeshDSLError` raised inside in the user's terms.

    Args:
      lowered: the (mesh, layout) the plan is lowered on, with the virtual axis.
      given: the (mesh, layout) the user passed to compile.
      num_microbatches: m; with 1 (no virtual axis) errors pass as they are.

    The error is the same object (its type and traceback kept); only its text changes.
    """
    try:
        yield
    except MeshDSLError as e:
        if num_microbatches > 1 and len(e.args) == 1 and isinstance(e.args[0], str):
            e.args = (restate(e.args[0], lowered, given, num_microbatches),)
        raise


@contextmanager
def with_given(mesh: Mesh, layout: Layout, num_microbatches: int):
    """Give a :class:`~meshdsl.errors.MeshDSLError` raised inside, whose text names no mesh (a
    schedule's sizes refused, :mod:`.schedule_gen`), the shape of the other compile errors: what
    was called (``compile: ...``), then the mesh, layout and micro-batch count it was given."""
    try:
        yield
    except MeshDSLError as e:
        if len(e.args) == 1 and isinstance(e.args[0], str):
            e.args = (_with_given(e.args[0], mesh, layout, num_microbatches),)
        raise


def _with_given(text: str, mesh: Mesh, layout: Layout, num_microbatches: int) -> str:
    """``text`` with the mesh, layout and micro-batch lines after its first line where it has no
    mesh line, and an empty layout shown as ``(no rules)`` (as :func:`restate` shows it)."""
    lines = ["  layout: (no rules)" if line == "  layout: " else line for line in text.split("\n")]
    if any(line.startswith("  mesh: ") for line in lines):
        return "\n".join(lines)
    head = lines[0] if lines[0].startswith("compile") else f"compile: {lines[0]}"
    shown = [f"  mesh: {mesh}", f"  layout: {str(layout) or '(no rules)'}", f"  {WORDS}: {num_microbatches}"]
    return "\n".join([head, *shown, *lines[1:]])


def restate(text: str, lowered: tuple[Mesh, Layout], given: tuple[Mesh, Layout], num_microbatches: int) -> str:
    """``text`` with the lowered mesh and layout shown as ``given`` and every other mention of the
    virtual micro-batch axis in words; a text that does not name the axis comes back unchanged.

    Example (m = 2, the user's ``"stage:2"``, ``"layer:stage"``)::

        mesh: stage:2; _mb:2                  ->  mesh: stage:2
        layout: layer:stage; batch:_mb        ->  layout: layer:stage
                                                  micro-batches: 2
        * allreduce over ('_mb',): ...        ->  * allreduce over the micro-batches: ...
        {batch:(_mb,data)} partial(_mb)       ->  {batch:(micro-batches,data)} partial(micro-batches)
    """
    if MB_AXIS not in text:
        return text
    (mesh, layout), (user_mesh, user_layout) = lowered, given
    shown_layout = str(user_layout) or "(no rules)"
    lines = []
    for line in text.split("\n"):
        head, _, value = line.partition(": ")
        if head.strip() == "mesh" and value == str(mesh):
            line = f"{head}: {user_mesh}"
        elif head.strip() == "layout" and value in (str(layout), clip(str(layout))):
            line = f"{head}: {shown_layout}"
        lines.append(line)
    lines = _with_count(lines, num_microbatches)
    out = "\n".join(lines).replace(f"'{mesh}'", f"'{user_mesh}'")
    out = _AXES_TUPLE.sub(_axes_in_words, out)
    out = _SIZED.sub(lambda m: f"{m.group(1)} {WORDS}", out)
    return _BARE.sub(WORDS, out)


def user_mesh_layout(plan: Plan) -> tuple[Mesh, Layout]:
    """The mesh and layout as the user wrote them: without the virtual micro-batch axis.

    A plan with micro-batches is lowered on ``mesh + _mb:m`` with ``batch`` split over
    ``_mb`` first; the user asked for neither, so printed plans and messages leave both
    out and state the micro-batch count on its own.
    """
    mesh = Mesh(tuple((a, n) for a, n in plan.mesh.axes if a != MB_AXIS))
    rules = []
    for r in plan.layout.rules:
        axes = tuple(a for a in r.axes if a.name != MB_AXIS)
        if axes != r.axes and not axes and r.span is None:
            # the rule the micro-batches added (the user's layout left the batch whole); a 'batch:()'
            # the user wrote keeps its span (a dict layout's rules have none: dropped as well)
            continue
        rules.append(r if axes == r.axes else Rule(r.scope, r.dim, axes, r.span))
    return mesh, Layout(tuple(rules), source=plan.layout.source)


def num_microbatches(plan: Plan) -> int:
    """m: the size of the virtual micro-batch axis (1 without micro-batches)."""
    return plan.mesh.sizes.get(MB_AXIS, 1)


def about_plan(text: str, plan: Plan) -> str:
    """``text``, a message about a compiled ``plan`` (its ``mesh: ...`` and ``layout: ...``
    lines print ``plan.mesh`` and ``plan.layout``), restated as :func:`restate` does: in the
    user's mesh and layout, the micro-batch count on its own line."""
    return restate(text, (plan.mesh, plan.layout), user_mesh_layout(plan), num_microbatches(plan))


def _with_count(lines: list[str], m: int) -> list[str]:
    """``lines`` with an inputs line ``micro-batches: m`` after the mesh and layout lines (where
    the message has one and no count yet)."""
    if any(line.strip().startswith(f"{WORDS}:") for line in lines):
        return lines
    at = [i for i, line in enumerate(lines) if line.startswith("  ") and line.strip().split(":")[0] in ("mesh", "layout")]
    if not at:
        return lines
    return lines[:at[-1] + 1] + [f"  {WORDS}: {m}"] + lines[at[-1] + 1:]


def _axes_in_words(match: re.Match) -> str:
    """An axes tuple holding the virtual axis, in words: ``('_mb',)`` -> "the micro-batches",
    ``('_mb', 'data')`` -> "('data',) and the micro-batches"."""
    names = re.findall(r"'([^']*)'", match.group(1))
    if MB_AXIS not in names:
        return match.group(0)
    rest = tuple(n for n in names if n != MB_AXIS)
    return f"{rest} and the {WORDS}" if rest else f"the {WORDS}"
