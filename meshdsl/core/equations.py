"""Parsers for the equations user code writes: einsum and rearrange strings.

``einsum("batch d_model, d_model d_ff -> batch d_ff", x, w)`` and
``rearrange(x, "batch seq (heads d_k) -> batch seq heads d_k", heads=8)`` name
dims, never positions.  Each parser returns a frozen dataclass whose names
remember their spans, so the ops can underline a name that does not fit the
tensors.  Every problem is a :class:`~meshdsl.errors.ParseError` with a caret.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from lark import Token, Transformer, v_args

from ..errors import Span, did_you_mean
from .grammar import Language, check_parens, check_str, error, name_of, parse
from .names import Name

EINSUM = Language(
    "einsum",
    rule="an einsum lists operands of dim names separated by ',', then optionally '->' and "
         'the output dims, e.g. "batch d_model, d_model d_ff -> batch d_ff".',
    fix="separate dim names by spaces and operands by ',', "
        "e.g. 'batch d_model, d_model d_ff -> batch d_ff'.",
    name_word="dim name")
REARRANGE = Language(
    "rearrange",
    rule="a pattern is 'left -> right', each side dim names and '(...)' groups of names, "
         'e.g. "batch seq (heads d_k) -> batch seq heads d_k".',
    fix="write 'left -> right' with dim names and (groups), e.g. 'b s (h d) -> b s h d'.",
    name_word="dim name",
    # Lexed only so that they can be refused clearly; never suggest them.
    hidden=frozenset({"ELLIPSIS", "INT"}))


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


# ---------------------------------------------------------------- builders

class _EinsumBuilder(Transformer):
    def names(self, tokens):
        return tuple(name_of(t) for t in tokens)

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
    return _Rejected("ellipsis" if tok.type == "ELLIPSIS" else "number", name_of(tok))


class _PatternBuilder(Transformer):
    def name(self, children):
        return name_of(children[0])

    @v_args(meta=True)
    def group(self, meta, children):
        rejected = [_reject(t) for t in children if t.type != "NAME"]
        if rejected:
            return rejected[0]
        return Group(tuple(name_of(t) for t in children), Span(meta.start_pos, meta.end_pos))

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
            raise error(EINSUM, src, dup.span, f"dim '{dup.name}' appears twice in {label}.",
                        rule=rule, fix="name each dim of an operand once; rename one of them."
                        ) from None
    known = {n.name for names in spec.inputs for n in names}
    # 'ij,jk->ik' (numpy's letters): every side one name, so 'ik' is one dim, not i and k
    letters = all(len(names) <= 1 for names in (*spec.inputs, spec.output or ()))
    for n in spec.output or ():
        if n.name not in known:
            raise error(EINSUM, src, n.span, f"output dim '{n.name}' appears in no input."
                        + (f" Dims are whole names separated by spaces: '{n.name}' is one dim, not "
                           f"{' and '.join(n.name)}." if letters and len(n.name) > 1 else ""),
                        rule=rule, fix=("name each dim, e.g. 'batch d_model, d_model d_ff -> batch d_ff'"
                                        if letters and len(n.name) > 1 else
                                        f"remove '{n.name}' from the output or add it to an "
                                        f"input.{did_you_mean(n.name, known)}")) from None


def _flat(side) -> list[Name]:
    return [n for item in side for n in (item.names if isinstance(item, Group) else (item,))]


def _check_pattern(src: str, left, right) -> None:
    for item in (*left, *right):
        if isinstance(item, _Rejected) and item.kind == "ellipsis":
            raise error(REARRANGE, src, item.token.span, "'...' is not supported.",
                        rule="dims are named, so a pattern lists every dim; there is no ellipsis.",
                        fix="write out the dims that '...' stands for.") from None
        if isinstance(item, _Rejected):
            raise error(REARRANGE, src, item.token.span,
                        f"numbers are not allowed: '{item.token.name}'.",
                        rule="patterns use dim names only; sizes come from the tensor's dims.",
                        fix="use a dim name instead of a size.") from None
    for label, side in (("left", left), ("right", right)):
        dup = _first_repeat(_flat(side))
        if dup is not None:
            raise error(REARRANGE, src, dup.span,
                        f"dim '{dup.name}' appears twice on the {label} side.",
                        rule="each dim appears exactly once on each side.",
                        fix=f"remove the second '{dup.name}' or rename it.") from None
    for label, side, other_label, other in (("left", left, "right", right),
                                            ("right", right, "left", left)):
        other_names = {n.name for n in _flat(other)}
        for n in _flat(side):
            if n.name not in other_names:
                raise error(REARRANGE, src, n.span,
                            f"dim '{n.name}' is on the {label} side but not on the {other_label}.",
                            rule="rearrange only moves, splits and merges dims: each dim "
                                 "appears exactly once on each side.",
                            fix=f"add '{n.name}' to the {other_label} side or remove it."
                                f"{did_you_mean(n.name, other_names)}") from None


# ---------------------------------------------------------------- public API

def parse_einsum(s: str) -> EinsumSpec:
    """Parse an einsum over dim names.

    Args:
      s: operands separated by ``,``, names by whitespace, then optionally ``->`` and
        the output, e.g. ``"batch d_model, d_model d_ff -> batch d_ff"``.  An empty
        operand or output is a scalar (``"batch, batch ->"``).

    Returns:
      An :class:`EinsumSpec`; ``output`` is None when ``->`` is omitted.

    Raises:
      ParseError: on a non-string, a syntax error, a dim repeated within one operand
        or the output, or an output dim that appears in no input.
    """
    check_str(EINSUM, s)
    return _parse_einsum(s)


@functools.lru_cache(maxsize=None)
def _parse_einsum(s: str) -> EinsumSpec:
    inputs, output = parse(EINSUM, s, _EinsumBuilder())
    spec = EinsumSpec(inputs, output, s)
    _check_einsum(spec)
    return spec


def parse_rearrange(s: str) -> PatternSpec:
    """Parse a rearrange pattern (einops semantics over dim names).

    Args:
      s: ``left -> right``, each side dim names and flat ``(...)`` groups,
        e.g. ``"batch seq (heads d_k) -> batch seq heads d_k"``.

    Returns:
      A :class:`PatternSpec` of :class:`Name` and :class:`Group` items per side.

    Raises:
      ParseError: on a non-string, a syntax error, ``...``, numbers, nested or
        unbalanced parentheses, a dim repeated on one side or missing from the other.
    """
    check_str(REARRANGE, s)
    return _parse_rearrange(s)


@functools.lru_cache(maxsize=None)
def _parse_rearrange(s: str) -> PatternSpec:
    check_parens(REARRANGE, s, stops=("->",), comments=False)
    left, right = parse(REARRANGE, s, _PatternBuilder())
    _check_pattern(s, left, right)
    return PatternSpec(left, right, s)
