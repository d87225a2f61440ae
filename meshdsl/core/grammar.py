"""Shared machinery of the string languages: loading a grammar, and turning lark's
errors into :class:`~meshdsl.errors.ParseError` messages with a caret.

The grammars live in the repository's ``grammar/*.lark`` (installed as the
``meshdsl.grammar`` package data) and are loaded once each, LALR with
positions.  Lark is an implementation detail: no lark tree, token or exception
leaves the parsers built on this module (:mod:`meshdsl.core.equations` for
einsum and rearrange, :mod:`meshdsl.layout.parse` for mesh and layout).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from lark import Lark, Token, Transformer
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken

from ..errors import LINE_BREAKS, ParseError, Span, message
from .names import Name


@dataclass(frozen=True)
class Language:
    """One string language: its grammar file and the words its messages use.

    Args:
      key: the grammar's file stem and the word in "Invalid <key> string".
      rule: the ``Rule:`` line of a syntax error.
      fix: the ``Fix:`` line when no more specific repair is known.
      name_word: what a NAME token is called in messages ("axis name", "dim name").
      int_word: what an INT token is called ("size", "number").
      hidden: terminals lexed only to be refused later; never offered as expected.
    """

    key: str
    rule: str
    fix: str
    name_word: str
    int_word: str = "number"
    hidden: frozenset[str] = frozenset()


_SEPARATORS = {"SEMICOLON", "COMMA"}
_ORDER = ["NAME", "INT", "COLON", "DOT", "LPAR", "RPAR", "COMMA", "SEMICOLON", "ARROW", "$END"]
_GLUE = {":": ":", ".": ".", ",": ", ", ";": "; "}


@functools.cache
def parser(key: str) -> Lark:
    """The LALR parser of ``grammar/<key>.lark``, loaded once."""
    try:
        folder = resources.files("meshdsl.grammar")
    except ModuleNotFoundError:
        # setuptools' editable finder cannot map a nested package that has no
        # __init__.py, so a source checkout reads its top-level grammar/ folder.
        folder = Path(__file__).resolve().parents[2] / "grammar"
    text = folder.joinpath(f"{key}.lark").read_text(encoding="utf-8")
    return Lark(text, parser="lalr", propagate_positions=True)


def name_of(tok: Token) -> Name:
    """A lark NAME token as a plain :class:`Name` with its span."""
    return Name(str(tok), Span(tok.start_pos, tok.end_pos))


def error(lang: Language, source: str, span: Span | int | None, what: str, *, fix: str,
          rule: str | None = None, bullets: list[str] | None = None) -> ParseError:
    """A ParseError in the house structure, with a caret under ``span``."""
    return ParseError(message(f"Invalid {lang.key} string: {what}", source=source, span=span,
                              bullets=bullets, rule=rule or lang.rule, fix=fix))


def check_str(lang: Language, source: object) -> None:
    """Refuse a non-string before it reaches a cache or the parser."""
    if not isinstance(source, str):
        got = type(source).__name__
        raise ParseError(message(f"Invalid {lang.key} string: expected a str, got {got}.",
                                 rule=lang.rule, fix=lang.fix)) from None


def parse(lang: Language, source: str, builder: Transformer):
    """Parse ``source`` (a str: callers run :func:`check_str` before their cache) with
    ``builder``; syntax errors become ParseErrors."""
    try:
        tree = parser(lang.key).parse(source)
    except UnexpectedInput as err:
        problem = _syntax_error(lang, source, err)
    else:
        return builder.transform(tree)
    raise problem from None


def check_parens(lang: Language, source: str, stops: tuple[str, ...], comments: bool) -> None:
    """Reject ')' without '(', '(' left open (at a stop token or the end) and nested '('.

    With ``comments``, '#' starts a comment that runs to the next line break.
    """
    open_at, i = None, 0
    while i < len(source):
        ch = source[i]
        if ch == "#" and comments:
            ends = [j for j in (source.find(b, i) for b in LINE_BREAKS) if j >= 0]
            if not ends:
                break
            i = min(ends)
            ch = source[i]
        if ch == "(":
            if open_at is not None:
                raise error(lang, source, i, "parentheses cannot nest.",
                            fix="write one flat group, e.g. '(a b)'.") from None
            open_at = i
        elif ch == ")":
            if open_at is None:
                raise error(lang, source, i, "unbalanced parenthesis: ')' has no matching '('.",
                            fix="remove the ')' or add the missing '('.") from None
            open_at = None
        elif open_at is not None and any(source.startswith(s, i) for s in stops):
            break
        i += 1
    if open_at is not None:
        raise error(lang, source, open_at, "unbalanced parenthesis: '(' is never closed.",
                    fix="close the group with ')'.") from None


# ---------------------------------------------------------------- syntax errors

def _describe(lang: Language, kind: str, value: str) -> str:
    if kind == "NAME":
        return f"{lang.name_word} '{value}'"
    if kind == "INT":
        return f"{lang.int_word} {value}"
    return f"'{value}'"


def _word(lark: Lark, kind: str) -> str:
    if kind == "NAME":
        return "a name"
    if kind == "INT":
        return "an integer"
    if kind == "$END":
        return "the end of the string"
    return f"'{lark.get_terminal(kind).pattern.value}'"


def _previous_token(lark: Lark, source: str, pos: int) -> Token | None:
    try:
        tokens = list(lark.lex(source[:pos]))
    except UnexpectedInput:  # cannot happen for text the parser already consumed
        return None
    return tokens[-1] if tokens else None


def _syntax_error(lang: Language, source: str, err: UnexpectedInput) -> ParseError:
    """Translate lark's error into words: what was expected, after what, and a caret."""
    lark = parser(lang.key)
    if isinstance(err, UnexpectedToken):
        expected, tok = set(err.expected), err.token
        at_end = tok.type == "$END"
        pos = len(source) if at_end else tok.start_pos
    else:
        assert isinstance(err, UnexpectedCharacters), err
        expected, tok, at_end, pos = set(err.allowed), None, False, err.pos_in_stream
    prev = _previous_token(lark, source, pos)
    if at_end and prev is not None:
        pos = prev.end_pos  # point just past the last token, not at trailing blanks
    expected = (expected - lang.hidden) or expected
    if (prev is None or prev.type in _SEPARATORS) and expected - _SEPARATORS - {"$END"}:
        expected -= _SEPARATORS | {"$END"}  # at the start of an entry, separators are noise
    kinds = sorted(expected, key=lambda k: _ORDER.index(k) if k in _ORDER else len(_ORDER))
    words = [_word(lark, k) for k in kinds]
    words_text = words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]
    where = f" after {_describe(lang, prev.type, prev.value)}" if prev else " at the start"
    found = ""
    if at_end:
        found = ", but the string ended"
    elif tok is None:
        found = f", found {source[pos]!r}"
    fix = lang.fix
    # A missing ':' (or the one literal expected) between two values: show the repair.
    glue = ":" if "COLON" in kinds else None
    if len(kinds) == 1 and kinds[0] not in ("NAME", "INT", "$END"):
        glue = lark.get_terminal(kinds[0]).pattern.value
    if glue and prev is not None and tok is not None and tok.type in ("NAME", "INT"):
        fix = f"write '{prev.value}{_GLUE.get(glue, f' {glue} ')}{tok.value}'."
    width = len(tok.value) if tok is not None and not at_end else 1
    return error(lang, source, Span(pos, pos + width), f"expected {words_text}{where}{found}.", fix=fix)
