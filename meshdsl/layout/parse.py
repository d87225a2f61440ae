"""Parsers for the two strings that place a model on devices: the mesh and the layout.

Each public function turns a string into a frozen dataclass of
:mod:`meshdsl.layout.specs` whose names remember their character spans.  The
grammars are ``grammar/mesh.lark`` and ``grammar/layout.lark``, loaded by
:mod:`meshdsl.core.grammar`; every problem is a
:class:`~meshdsl.errors.ParseError` that shows the string with a caret.
Line breaks are ``\\n``, ``\\r\\n`` or a lone ``\\r``.
"""
from __future__ import annotations

import functools

from lark import Transformer, v_args
from lark.exceptions import UnexpectedInput

from ..core.grammar import Language, check_parens, check_str, error, name_of, parse, parser
from ..core.names import Name
from ..errors import LINE_BREAKS, Span, clip
from .specs import EMPTY_RULE, SIZE_RULE, UNIQUE_RULE, AxisSpec, LayoutSpec, MeshSpec, Rule

MESH = Language(
    "mesh",
    rule="a mesh is 'axis:size' entries separated by ';', ',' or whitespace, "
         'e.g. "data:2; model:4".',
    fix="write each entry as 'axis:size', e.g. 'data:2'.",
    name_word="axis name", int_word="size")
LAYOUT = Language(
    "layout",
    rule="a layout is rules '[scope.]dim:axis', 'dim:(axis, axis)' or 'dim:()' (no axis: kept whole) "
         "separated by ';', ',' or newlines, e.g. \"batch:data; params.d_model:fsdp; d_ff:(data, model)\".",
    fix="write each rule as 'dim:axis', 'scope.dim:axis', 'dim:(axis, axis)' or 'scope.dim:()', "
        "e.g. 'batch:data'.",
    name_word="name",
    hidden=frozenset({"DOTTED_RULE"}))   # a dotted name is a name to the reader, not a regex


# ---------------------------------------------------------------- builders

class _MeshBuilder(Transformer):
    def axis(self, children):
        name, size = children
        return AxisSpec(name_of(name), int(size), Span(size.start_pos, size.end_pos))

    def start(self, axes):
        return tuple(axes)


class _LayoutBuilder(Transformer):
    @v_args(meta=True)
    def global_rule(self, meta, children):
        dim, axes = children
        return Rule(None, name_of(dim), axes, Span(meta.start_pos, meta.end_pos))

    @v_args(meta=True)
    def scoped_rule(self, meta, children):
        scope, dim, axes = children
        return Rule(name_of(scope), name_of(dim), axes, Span(meta.start_pos, meta.end_pos))

    @v_args(meta=True)
    def dotted_rule(self, meta, children):
        """'teacher.wte.t_model:data': the scope is the tensor's dotted name, the dim after its last dot."""
        tok, axes = children
        scope, dim = str(tok).rsplit(".", 1)
        start, cut = tok.start_pos, tok.start_pos + len(scope)
        return Rule(Name(scope, Span(start, cut)), Name(dim, Span(cut + 1, tok.end_pos)), axes,
                    Span(meta.start_pos, meta.end_pos))

    def one_axis(self, children):
        return (name_of(children[0]),)

    def axis_group(self, children):
        return tuple(name_of(t) for t in children)

    def no_axis(self, children):
        """'dim:()': split over no axis, so the dim stays whole where the rule applies."""
        return ()

    def start(self, rules):
        return tuple(rules)


# ---------------------------------------------------------------- semantic checks

def _check_mesh(spec: MeshSpec) -> None:
    src, seen = spec.source, {}
    if not spec.axes:
        # Blanks, separators and comments alone: almost always a variable left
        # empty by mistake, so only Python's explicit Mesh(()) means "no axes".
        start = len(src) - len(src.lstrip()) if src.strip() else 0  # the first comment or ';'
        end = min([i for i in (src.find(b, start) for b in LINE_BREAKS) if i >= 0] or [len(src)])
        raise error(MESH, src, Span(start, end), "the string names no mesh axis.",
                    rule=EMPTY_RULE,
                    fix="name at least one axis, e.g. 'data:1' for a single device.") from None
    for i, axis in enumerate(spec.axes):
        name = axis.name.name
        if i and axis.name.span.start == spec.axes[i - 1].size_span.end:
            before = f"{spec.axes[i - 1].name.name}:{spec.axes[i - 1].size}"
            raise error(MESH, src, axis.name.span,
                        f"expected ';', ',' or whitespace between '{before}' and '{name}'.",
                        fix=f"write '{before}; {name}:{axis.size}'.") from None
        if name in seen:
            raise error(MESH, src, axis.name.span, f"axis '{name}' is named twice.",
                        bullets=[f"first as '{name}:{seen[name]}', again as '{name}:{axis.size}'"],
                        rule=UNIQUE_RULE,
                        fix=f"rename one of them, or merge them into one axis "
                            f"'{name}:{seen[name] * axis.size}'.") from None
        if axis.size == 0:
            raise error(MESH, src, axis.size_span, f"axis '{name}' has size 0.",
                        rule=SIZE_RULE,
                        fix=f"use a size of at least 1, e.g. '{name}:1', or drop the axis.") from None
        seen[name] = axis.size


def _check_targets(src: str) -> None:
    """Refuse a rule whose ':' has no target ('up.ch:' at the end, before ';' or ',', or before the
    next rule), which lark would report as a missing name: the fix names both forms a target takes."""
    try:
        toks = list(parser(LAYOUT.key).lex(src))
    except UnexpectedInput:
        return   # a bad character: the parser's own message points at it
    for i, tok in enumerate(toks):
        if tok.type != "COLON":
            continue
        after = toks[i + 1:i + 3]
        starts_rule = len(after) == 2 and after[1].type in ("COLON", "DOT") and after[0].type != "LPAR"
        if after and after[0].type not in ("SEMICOLON", "COMMA") and not starts_rule:
            continue
        kinds = [t.type for t in toks[max(i - 3, 0):i]]
        if not kinds or kinds[-1] not in ("NAME", "DOTTED_RULE"):
            continue   # no dim before the ':' either: the parser's message says what a rule starts with
        first = toks[i - 3] if kinds == ["NAME", "DOT", "NAME"] else toks[i - 1]
        head = src[first.start_pos:tok.end_pos]
        dim = head[:-1].rsplit(".", 1)[-1]
        raise error(LAYOUT, src, Span(tok.start_pos, tok.end_pos),
                    f"rule '{clip(head)}' has no target after ':'.",
                    rule="a rule's target is a mesh axis, a group '(a, b)' (first major) or '()', no axis: "
                         "the dim stays whole where the rule applies",
                    fix=f"name a mesh axis ('{head}AXIS'), or write '{head}()' to keep '{dim}' whole") from None


def _check_layout(spec: LayoutSpec) -> None:
    src = spec.source
    for prev, rule in zip(spec.rules, spec.rules[1:]):
        if not any(c in src[prev.span.end:rule.span.start] for c in ";," + LINE_BREAKS):
            raise error(LAYOUT, src, rule.span.start,
                        "expected ';', ',' or a newline between rules.",
                        fix=f"write '{clip(src[prev.span.start:prev.span.end])}; "
                            f"{clip(src[rule.span.start:rule.span.end])}'.") from None
    for rule in spec.rules:
        seen = set()
        for axis in rule.axes:
            if axis.name in seen:
                raise error(LAYOUT, src, axis.span,
                            f"axis '{axis.name}' is listed twice for dim '{rule.dim.name}'.",
                            rule="a dim is split over distinct mesh axes, the first major.",
                            fix="list each mesh axis once.") from None
            seen.add(axis.name)


# ---------------------------------------------------------------- public API

def parse_mesh(s: str) -> MeshSpec:
    """Parse a mesh string.

    Args:
      s: ``'axis:size'`` entries separated by ``;``, ``,`` or whitespace, with ``#``
        comments, e.g. ``"data:2; model:4"``.  At least one axis: a mesh without
        axes is asked for from Python, ``Mesh(())``.

    Returns:
      A :class:`MeshSpec` with the axes in the order written (major first).

    Raises:
      ParseError: on a non-string, a syntax error, no axis at all, a repeated axis
        name or a size of 0.
    """
    check_str(MESH, s)
    return _parse_mesh(s)


@functools.lru_cache(maxsize=None)
def _parse_mesh(s: str) -> MeshSpec:
    spec = MeshSpec(parse(MESH, s, _MeshBuilder()), s)
    _check_mesh(spec)
    return spec


def parse_layout(s: str) -> LayoutSpec:
    """Parse layout rules.

    Args:
      s: rules ``[scope.]dim:axes`` separated by ``;``, ``,`` or line breaks, with
        ``#`` comments.  ``axes`` is one mesh axis, ``(a, b)`` (first major) or ``()``
        (no axis: the dim stays whole where the rule applies, e.g. ``up.ch:()`` keeps
        ``ch`` whole in the one tensor ``up`` while ``ch:model`` splits it elsewhere).
        ``scope`` is ``params`` (every trainable parameter, its gradient and optimizer
        state), ``grads`` (gradients), ``opt`` (optimizer state) or one
        tensor's name, e.g. ``"batch:data; params.d_model:fsdp; w1.d_ff:(data, model)"``.
        The empty layout replicates everything.

    Returns:
      A :class:`LayoutSpec` with the rules in the order written (earlier wins).

    Raises:
      ParseError: on a non-string, a syntax error, a rule with no target after
        ':', rules not separated, an axis listed twice in one rule or unbalanced
        parentheses.
    """
    check_str(LAYOUT, s)
    return _parse_layout(s)


@functools.lru_cache(maxsize=None)
def _parse_layout(s: str) -> LayoutSpec:
    check_parens(LAYOUT, s, stops=(";", *LINE_BREAKS), comments=True)
    _check_targets(s)
    spec = LayoutSpec(parse(LAYOUT, s, _LayoutBuilder()), s)
    _check_layout(spec)
    return spec
