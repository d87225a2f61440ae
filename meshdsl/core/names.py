"""The one rule for names: what a dim, a mesh axis or a layout scope may be called.

Every string language (``grammar/*.lark``) and :class:`~meshdsl.core.shape.Dim`
accept exactly the names :data:`NAME_PATTERN` matches: ASCII identifiers (a layout rule's
scope may also be a tensor's dotted name, :data:`SCOPE_PATTERN`).  The
grammars cannot import Python, so each ``NAME`` terminal repeats the pattern;
``tests/test_parse.py`` checks that every grammar and ``Dim`` agree with it.
A :class:`Name` is one such name together with where it stands in its source
string, so later errors can underline it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import Span

# ASCII only, so a name a layout can spell is a name a terminal can show and a
# user can type; unicode identifiers would also admit look-alike letters.
NAME_PATTERN = r"[A-Za-z_][A-Za-z0-9_]*"
NAME_RULE = ("a name is an ASCII identifier: a letter or '_', then letters, digits or '_' "
             "(e.g. 'batch', 'd_model')")
_NAME_RE = re.compile(NAME_PATTERN)


def is_name(text: object) -> bool:
    """Whether ``text`` is a str that the grammars accept as one name."""
    return isinstance(text, str) and _NAME_RE.fullmatch(text) is not None


# A layout rule's scope may also be a tensor's dotted name ('teacher.wte', 'layers.0.wq': a param
# named as torch's state_dict keys are); grammar/layout.lark's DOTTED_RULE repeats it, then '.dim'.
SCOPE_PATTERN = NAME_PATTERN + r"(?:\.[A-Za-z0-9_]+)*"
_SCOPE_RE = re.compile(SCOPE_PATTERN)


def is_scope(text: object) -> bool:
    """Whether ``text`` is a str a layout rule may be scoped to: a name, or a dotted tensor name."""
    return isinstance(text, str) and _SCOPE_RE.fullmatch(text) is not None


@dataclass(frozen=True)
class Name:
    """An identifier and where it stands in its source string (None when built from Python)."""

    name: str
    span: Span | None
