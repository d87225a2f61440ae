"""Parsers for the four string sub-languages: mesh, layout, einsum and rearrange.

Each public function turns a string into a frozen dataclass of
:mod:`meshdsl.layout.specs` whose names remember their character spans.  The
grammars live in the repository's ``grammar/*.lark`` (installed as the
``meshdsl.grammar`` package data).  Lark is an implementation detail: no lark
tree, token or exception leaves this module; every problem is a
:class:`~meshdsl.errors.ParseError` that shows the string with a caret.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken

from ..errors import ParseError, Span, did_you_mean, message
from .specs import AxisSpec, EinsumSpec, Group, LayoutSpec, MeshSpec, Name, PatternSpec, RuleSpec

_RULES = {
    "mesh": "a mesh is 'axis:size' entries separated by ';', ',' or whitespace, "
            'e.g. "data:2; model:4".',
    "layout": "a layout is rules '[scope.]dim:axis' or 'dim:(axis, axis)' separated by ';', ',' "
              'or newlines, e.g. "batch:data; params.d_model:fsdp; d_ff:(data, model)".',
    "einsum": "an einsum lists operands of dim names separated by ',', then optionally '->' and "
              'the output dims, e.g. "batch d_model, d_model d_ff -> batch d_ff".',
    "rearrange": "a pattern is 'left -> right', each side dim names and '(...)' groups of names, "
                 'e.g. "batch seq (heads d_k) -> batch seq heads d_k".',
}
_FIXES = {
    "mesh": "write each entry as 'axis:size', e.g. 'data:2'.",
    "layout": "write each rule as 'dim:axis', 'scope.dim:axis' or 'dim:(axis, axis)', "
              "e.g. 'batch:data'.",
    "einsum": "separate dim names by spaces and operands by ',', "
              "e.g. 'batch d_model, d_model d_ff -> batch d_ff'.",
    "rearrange": "write 'left -> right' with dim names and (groups), e.g. 'b s (h d) -> b s h d'.",
}
_NAME_WORD = {"mesh": "axis name", "layout": "name", "einsum": "dim name", "rearrange": "dim name"}
# Terminals the rearrange grammar lexes only to reject them; never suggest them.
_HIDDEN = {"rearrange": {"ELLIPSIS", "INT"}}
_SEPARATORS = {"SEMICOLON", "COMMA"}
_ORDER = ["NAME", "INT", "COLON", "DOT", "LPAR", "RPAR", "COMMA", "SEMICOLON", "ARROW", "$END"]
_GLUE = {":": ":", ".": ".", ",": ", ", ";": "; "}


def _error(lang: str, source: str, span: Span | int | None, what: str, *, fix: str,
           rule: str | None = None, bullets: list[str] | None = None) -> ParseError:
    return ParseError(message(f"Invalid {lang} string: {what}", source=source, span=span,
                              bullets=bullets, rule=rule or _RULES[lang], fix=fix))


@functools.cache
def _parser(lang: str) -> Lark:
    try:
        folder = resources.files("meshdsl.grammar")
    except ModuleNotFoundError:
        # setuptools' editable finder cannot map a nested package that has no
        # __init__.py, so a source checkout reads its top-level grammar/ folder.
        folder = Path(__file__).resolve().parents[2] / "grammar"
    text = folder.joinpath(f"{lang}.lark").read_text(encoding="utf-8")
    return Lark(text, parser="lalr", propagate_positions=True)


def _name(tok: Token) -> Name:
    return Name(str(tok), Span(tok.start_pos, tok.end_pos))


# ---------------------------------------------------------------- syntax errors

def _describe(lang: str, kind: str, value: str) -> str:
    if kind == "NAME":
        return f"{_NAME_WORD[lang]} '{value}'"
    if kind == "INT":
        return f"size {value}" if lang == "mesh" else f"number {value}"
    return f"'{value}'"


def _word(parser: Lark, kind: str) -> str:
    if kind == "NAME":
        return "a name"
    if kind == "INT":
        return "an integer"
    if kind == "$END":
        return "the end of the string"
    return f"'{parser.get_terminal(kind).pattern.value}'"


def _previous_token(parser: Lark, source: str, pos: int) -> Token | None:
    try:
        tokens = list(parser.lex(source[:pos]))
    except UnexpectedInput:  # cannot happen for text the parser already consumed
        return None
    return tokens[-1] if tokens else None


def _syntax_error(lang: str, source: str, err: UnexpectedInput) -> ParseError:
    """Translate lark's error into words: what was expected, after what, and a caret."""
    parser = _parser(lang)
    if isinstance(err, UnexpectedToken):
        expected, tok = set(err.expected), err.token
        at_end = tok.type == "$END"
        pos = len(source) if at_end else tok.start_pos
    else:
        assert isinstance(err, UnexpectedCharacters), err
        expected, tok, at_end, pos = set(err.allowed), None, False, err.pos_in_stream
    prev = _previous_token(parser, source, pos)
    if at_end and prev is not None:
        pos = prev.end_pos  # point just past the last token, not at trailing blanks
    expected = (expected - _HIDDEN.get(lang, set())) or expected
    if (prev is None or prev.type in _SEPARATORS) and expected - _SEPARATORS - {"$END"}:
        expected -= _SEPARATORS | {"$END"}  # at the start of an entry, separators are noise
    kinds = sorted(expected, key=lambda k: _ORDER.index(k) if k in _ORDER else len(_ORDER))
    words = [_word(parser, k) for k in kinds]
    words_text = words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]
    where = f" after {_describe(lang, prev.type, prev.value)}" if prev else " at the start"
    found = ""
    if at_end:
        found = ", but the string ended"
    elif tok is None:
        found = f", found {source[pos]!r}"
    fix = _FIXES[lang]
    # A missing ':' (or the one literal expected) between two values: show the repair.
    glue = ":" if "COLON" in kinds else None
    if len(kinds) == 1 and kinds[0] not in ("NAME", "INT", "$END"):
        glue = parser.get_terminal(kinds[0]).pattern.value
    if glue and prev is not None and tok is not None and tok.type in ("NAME", "INT"):
        fix = f"write '{prev.value}{_GLUE.get(glue, f' {glue} ')}{tok.value}'."
    width = len(tok.value) if tok is not None and not at_end else 1
    return _error(lang, source, Span(pos, pos + width), f"expected {words_text}{where}{found}.",
                  fix=fix)


def _check_parens(lang: str, source: str, stops: tuple[str, ...]) -> None:
    """Reject ')' without '(', '(' left open (at a stop token or the end) and nested '('."""
    open_at, i = None, 0
    while i < len(source):
        ch = source[i]
        if ch == "#" and lang == "layout":
            i = source.find("\n", i)
            if i < 0:
                break
            ch = "\n"
        if ch == "(":
            if open_at is not None:
                raise _error(lang, source, i, "parentheses cannot nest.",
                             rule=_RULES[lang], fix="write one flat group, e.g. '(a b)'.") from None
            open_at = i
        elif ch == ")":
            if open_at is None:
                raise _error(lang, source, i, "unbalanced parenthesis: ')' has no matching '('.",
                             fix="remove the ')' or add the missing '('.") from None
            open_at = None
        elif open_at is not None and any(source.startswith(s, i) for s in stops):
            break
        i += 1
    if open_at is not None:
        raise _error(lang, source, open_at, "unbalanced parenthesis: '(' is never closed.",
                     fix="close the group with ')'.") from None


def _parse(lang: str, source: str, builder: Transformer):
    if not isinstance(source, str):
        got = type(source).__name__
        raise ParseError(f"Invalid {lang} string: expected a str, got {got}.") from None
    try:
        tree = _parser(lang).parse(source)
    except UnexpectedInput as err:
        problem = _syntax_error(lang, source, err)
    else:
        return builder.transform(tree)
    raise problem from None


# ---------------------------------------------------------------- builders

class _MeshBuilder(Transformer):
    def axis(self, children):
        name, size = children
        return AxisSpec(_name(name), int(size), Span(size.start_pos, size.end_pos))

    def start(self, axes):
        return tuple(axes)


class _LayoutBuilder(Transformer):
    @v_args(meta=True)
    def global_rule(self, meta, children):
        dim, axes = children
        return RuleSpec(None, _name(dim), axes, Span(meta.start_pos, meta.end_pos))

    @v_args(meta=True)
    def scoped_rule(self, meta, children):
        scope, dim, axes = children
        return RuleSpec(_name(scope), _name(dim), axes, Span(meta.start_pos, meta.end_pos))

    def one_axis(self, children):
        return (_name(children[0]),)

    def axis_group(self, children):
        return tuple(_name(t) for t in children)

    def start(self, rules):
        return tuple(rules)


class _EinsumBuilder(Transformer):
    def names(self, tokens):
        return tuple(_name(t) for t in tokens)

    def operands(self, operands):
        return tuple(operands)

    def implicit(self, children):
        return children[0], None

    def explicit(self, children):
        operands, _arrow, output = children
        return operands, output


@dataclass(frozen=True)
class _Rejected:
    """A pattern item the grammar lexes only so that it can be refused clearly."""

    kind: str
    token: Name


def _reject(tok: Token) -> _Rejected:
    return _Rejected("ellipsis" if tok.type == "ELLIPSIS" else "number", _name(tok))


class _PatternBuilder(Transformer):
    def name(self, children):
        return _name(children[0])

    @v_args(meta=True)
    def group(self, meta, children):
        rejected = [_reject(t) for t in children if t.type != "NAME"]
        if rejected:
            return rejected[0]
        return Group(tuple(_name(t) for t in children), Span(meta.start_pos, meta.end_pos))

    def ellipsis(self, children):
        return _reject(children[0])

    def number(self, children):
        return _reject(children[0])

    def side(self, items):
        return tuple(items)

    def start(self, children):
        left, _arrow, right = children
        return left, right


# ---------------------------------------------------------------- semantic checks

def _check_mesh(spec: MeshSpec) -> None:
    src, seen = spec.source, {}
    for i, axis in enumerate(spec.axes):
        name = axis.name.name
        if i and axis.name.span.start == spec.axes[i - 1].size_span.end:
            before = f"{spec.axes[i - 1].name.name}:{spec.axes[i - 1].size}"
            raise _error("mesh", src, axis.name.span,
                         f"expected ';', ',' or whitespace between '{before}' and '{name}'.",
                         fix=f"write '{before}; {name}:{axis.size}'.") from None
        if name in seen:
            raise _error("mesh", src, axis.name.span, f"axis '{name}' is named twice.",
                         bullets=[f"first as '{name}:{seen[name]}', again as '{name}:{axis.size}'"],
                         rule="each mesh axis has a unique name.",
                         fix=f"rename one of them, or merge them into one axis "
                             f"'{name}:{seen[name] * axis.size}'.") from None
        if axis.size == 0:
            raise _error("mesh", src, axis.size_span, f"axis '{name}' has size 0.",
                         rule="mesh sizes are positive integers.",
                         fix=f"use a size of at least 1, e.g. '{name}:1', or drop the axis."
                         ) from None
        seen[name] = axis.size


def _check_layout(spec: LayoutSpec) -> None:
    src = spec.source
    for prev, rule in zip(spec.rules, spec.rules[1:]):
        if not any(c in src[prev.span.end:rule.span.start] for c in ";,\n"):
            raise _error("layout", src, rule.span.start,
                         "expected ';', ',' or a newline between rules.",
                         fix=f"write '{src[prev.span.start:prev.span.end]}; "
                             f"{src[rule.span.start:rule.span.end]}'.") from None
    for rule in spec.rules:
        seen = set()
        for axis in rule.axes:
            if axis.name in seen:
                raise _error("layout", src, axis.span,
                             f"axis '{axis.name}' is listed twice for dim '{rule.dim.name}'.",
                             rule="a dim is split over distinct mesh axes, the first major.",
                             fix="list each mesh axis once.") from None
            seen.add(axis.name)


def _first_repeat(names) -> Name | None:
    seen = set()
    for n in names:
        if n.name in seen:
            return n
        seen.add(n.name)
    return None


def _check_einsum(spec: EinsumSpec) -> None:
    src = spec.source
    rule = "within one operand or the output each dim appears once; output dims come from inputs."
    operands = [(f"input {i + 1}", names) for i, names in enumerate(spec.inputs)]
    for label, names in operands + [("the output", spec.output or ())]:
        dup = _first_repeat(names)
        if dup is not None:
            raise _error("einsum", src, dup.span, f"dim '{dup.name}' appears twice in {label}.",
                         rule=rule, fix="name each dim of an operand once; rename one of them."
                         ) from None
    known = {n.name for names in spec.inputs for n in names}
    for n in spec.output or ():
        if n.name not in known:
            raise _error("einsum", src, n.span, f"output dim '{n.name}' appears in no input.",
                         rule=rule, fix=f"remove '{n.name}' from the output or add it to an "
                                        f"input.{did_you_mean(n.name, known)}") from None


def _flat(side) -> list[Name]:
    return [n for item in side for n in (item.names if isinstance(item, Group) else (item,))]


def _check_pattern(src: str, left, right) -> None:
    for item in (*left, *right):
        if isinstance(item, _Rejected) and item.kind == "ellipsis":
            raise _error("rearrange", src, item.token.span, "'...' is not supported.",
                         rule="dims are named, so a pattern lists every dim; there is no ellipsis.",
                         fix="write out the dims that '...' stands for.") from None
        if isinstance(item, _Rejected):
            raise _error("rearrange", src, item.token.span,
                         f"numbers are not allowed: '{item.token.name}'.",
                         rule="patterns use dim names only; sizes come from the tensor's dims.",
                         fix="use a dim name instead of a size.") from None
    for label, side in (("left", left), ("right", right)):
        dup = _first_repeat(_flat(side))
        if dup is not None:
            raise _error("rearrange", src, dup.span,
                         f"dim '{dup.name}' appears twice on the {label} side.",
                         rule="each dim appears exactly once on each side.",
                         fix=f"remove the second '{dup.name}' or rename it.") from None
    for label, side, other_label, other in (("left", left, "right", right),
                                            ("right", right, "left", left)):
        other_names = {n.name for n in _flat(other)}
        for n in _flat(side):
            if n.name not in other_names:
                raise _error("rearrange", src, n.span,
                             f"dim '{n.name}' is on the {label} side but not on the {other_label}.",
                             rule="rearrange only moves, splits and merges dims: each dim "
                                  "appears exactly once on each side.",
                             fix=f"add '{n.name}' to the {other_label} side or remove it."
                                 f"{did_you_mean(n.name, other_names)}") from None


# ---------------------------------------------------------------- public API

@functools.lru_cache(maxsize=None)
def parse_mesh(s: str) -> MeshSpec:
    """Parse a mesh string.

    Args:
      s: ``'axis:size'`` entries separated by ``;``, ``,`` or whitespace, with ``#``
        comments, e.g. ``"data:2; model:4"``.  The empty string is a mesh with no axes.

    Returns:
      A :class:`MeshSpec` with the axes in the order written (major first).

    Raises:
      ParseError: on a syntax error, a repeated axis name or a size of 0.
    """
    spec = MeshSpec(_parse("mesh", s, _MeshBuilder()), s)
    _check_mesh(spec)
    return spec


@functools.lru_cache(maxsize=None)
def parse_layout(s: str) -> LayoutSpec:
    """Parse layout rules.

    Args:
      s: rules ``[scope.]dim:axes`` separated by ``;``, ``,`` or newlines, with ``#``
        comments.  ``axes`` is one mesh axis or ``(a, b)`` (first major).  ``scope`` is
        ``params`` (every trainable parameter and its gradient) or one tensor's name,
        e.g. ``"batch:data; params.d_model:fsdp; w1.d_ff:(data, model)"``.

    Returns:
      A :class:`LayoutSpec` with the rules in the order written (earlier wins).

    Raises:
      ParseError: on a syntax error, rules not separated, an axis listed twice in one
        rule or unbalanced parentheses.
    """
    if isinstance(s, str):
        _check_parens("layout", s, stops=(";", "\n"))
    spec = LayoutSpec(_parse("layout", s, _LayoutBuilder()), s)
    _check_layout(spec)
    return spec


@functools.lru_cache(maxsize=None)
def parse_einsum(s: str) -> EinsumSpec:
    """Parse an einsum over dim names.

    Args:
      s: operands separated by ``,``, names by whitespace, then optionally ``->`` and
        the output, e.g. ``"batch d_model, d_model d_ff -> batch d_ff"``.  An empty
        operand or output is a scalar (``"batch, batch ->"``).

    Returns:
      An :class:`EinsumSpec`; ``output`` is None when ``->`` is omitted.

    Raises:
      ParseError: on a syntax error, a dim repeated within one operand or the output,
        or an output dim that appears in no input.
    """
    inputs, output = _parse("einsum", s, _EinsumBuilder())
    spec = EinsumSpec(inputs, output, s)
    _check_einsum(spec)
    return spec


@functools.lru_cache(maxsize=None)
def parse_rearrange(s: str) -> PatternSpec:
    """Parse a rearrange pattern (einops semantics over dim names).

    Args:
      s: ``left -> right``, each side dim names and flat ``(...)`` groups,
        e.g. ``"batch seq (heads d_k) -> batch seq heads d_k"``.

    Returns:
      A :class:`PatternSpec` of :class:`Name` and :class:`Group` items per side.

    Raises:
      ParseError: on a syntax error, ``...``, numbers, nested or unbalanced
        parentheses, a dim repeated on one side or missing from the other.
    """
    if isinstance(s, str):
        _check_parens("rearrange", s, stops=("->",))
    left, right = _parse("rearrange", s, _PatternBuilder())
    _check_pattern(s, left, right)
    return PatternSpec(left, right, s)
