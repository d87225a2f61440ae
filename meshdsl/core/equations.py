"""Parsers for the equations user code writes: einsum and rearrange strings.

``einsum("batch d_model, d_model d_ff -> batch d_ff", x, w)`` and
``rearrange(x, "batch seq (heads d_k) -> batch seq heads d_k", heads=8)`` name
dims, never positions.  ``...`` (:class:`Rest`) stands for the dims of a tensor
that its term does not name: ``einsum("... d, d f -> ... f", x, w)`` is a layer for
any leading dims.  Each parser returns a frozen dataclass whose names remember their
spans, so the ops can underline a name that does not fit the tensors.  Every problem
is a :class:`~meshdsl.errors.ParseError` with a caret; what ``...`` stands for needs
the tensors, so the ops resolve it (:mod:`meshdsl.ops.einsum`, :mod:`meshdsl.ops.shape_ops`).
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
    name_word="dim name",
    hidden=frozenset({"ELLIPSIS"}))  # valid, but never what a syntax error lacks
REARRANGE = Language(
    "rearrange",
    rule="a pattern is 'left -> right', each side dim names and '(...)' groups of names, "
         'e.g. "batch seq (heads d_k) -> batch seq heads d_k".',
    fix="write 'left -> right' with dim names and (groups), e.g. 'b s (h d) -> b s h d'.",
    name_word="dim name",
    # INT is lexed only so that it can be refused clearly, and '...' is rarely what a
    # syntax error lacks: never suggest them.
    hidden=frozenset({"ELLIPSIS", "INT"}))


@dataclass(frozen=True)
class Rest:
    """``...`` in an einsum term or a rearrange side: the dims of a tensor its term does not
    name, in the tensor's order (which those are, only the op knows: it has the tensors)."""

    span: Span


@dataclass(frozen=True)
class EinsumSpec:
    """``"batch d_model, d_model d_ff -> batch d_ff"``; output None when ``->`` is omitted.
    A term holds at most one :class:`Rest`, the output only if some input does."""

    inputs: tuple[tuple[Name | Rest, ...], ...]
    output: tuple[Name | Rest, ...] | None
    source: str

    @property
    def has_rest(self) -> bool:
        """Whether some input term holds ``...``."""
        return any(isinstance(n, Rest) for names in self.inputs for n in names)


@dataclass(frozen=True)
class Group:
    """A parenthesised composition ``(heads d_k)`` in a rearrange pattern (``(... d)`` on the
    right merges the dims ``...`` stands for with ``d``)."""

    names: tuple[Name | Rest, ...]
    span: Span


@dataclass(frozen=True)
class PatternSpec:
    """``"batch seq (heads d_k) -> batch seq heads d_k"``: each side a list of names or groups;
    ``...`` (a :class:`Rest`) on both sides or neither, at most once a side, never in a left group."""

    left: tuple[Name | Group | Rest, ...]
    right: tuple[Name | Group | Rest, ...]
    source: str


# ---------------------------------------------------------------- builders

def _name_or_rest(tok: Token) -> Name | Rest:
    return Rest(Span(tok.start_pos, tok.end_pos)) if tok.type == "ELLIPSIS" else name_of(tok)


class _EinsumBuilder(Transformer):
    def names(self, tokens):
        return tuple(_name_or_rest(t) for t in tokens)

    def operands(self, operands):
        return tuple(operands)

    def implicit(self, children):
        return children[0], None

    def explicit(self, children):
        operands, _arrow, output = children
        return operands, output


@dataclass(frozen=True)
class _Rejected:
    """A number in a pattern: the grammar lexes it only so that it can be refused clearly."""

    token: Name


def _reject(tok: Token) -> _Rejected:
    return _Rejected(name_of(tok))


class _PatternBuilder(Transformer):
    def name(self, children):
        return name_of(children[0])

    @v_args(meta=True)
    def group(self, meta, children):
        rejected = [_reject(t) for t in children if t.type == "INT"]
        if rejected:
            return rejected[0]
        return Group(tuple(_name_or_rest(t) for t in children), Span(meta.start_pos, meta.end_pos))

    def ellipsis(self, children):
        return _name_or_rest(children[0])

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


_REST_RULE = ("'...' stands for the dims of an operand that its term does not name, so a term "
              "holds it once at most; the output's '...' stands for those of the inputs' '...'.")


def _check_einsum_rest(spec: EinsumSpec, operands: list) -> None:
    """At most one '...' a term; one in the output only if an input has one."""
    for label, names in operands:
        rests = [n for n in names if isinstance(n, Rest)]
        if len(rests) > 1:
            raise error(EINSUM, spec.source, rests[1].span, f"'...' appears twice in {label}.",
                        rule=_REST_RULE, fix="keep one '...' and name the other dims around it, "
                        "e.g. 'batch ... d'.") from None
    rest = next((n for n in spec.output or () if isinstance(n, Rest)), None)
    if rest is not None and not spec.has_rest:
        raise error(EINSUM, spec.source, rest.span, "'...' is in the output but in no input.",
                    rule=_REST_RULE, fix="add '...' to the input(s) whose other dims the output keeps, "
                    "e.g. '... d, d f -> ... f', or name the output's dims.") from None


def _check_einsum(spec: EinsumSpec) -> None:
    src = spec.source
    rule = "within one operand or the output each dim appears once; output dims come from inputs."
    operands = [(f"input {i + 1}", names) for i, names in enumerate(spec.inputs)]
    operands.append(("the output", spec.output or ()))
    _check_einsum_rest(spec, operands)
    for label, names in operands:
        dup = _first_repeat(n for n in names if isinstance(n, Name))
        if dup is not None:
            raise error(EINSUM, src, dup.span, f"dim '{dup.name}' appears twice in {label}.",
                        rule=rule, fix="name each dim of an operand once; rename one of them."
                        ) from None
    if spec.has_rest:
        return  # an output dim no input names may be one an input's '...' stands for: the op checks
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


def _flat(side, kind=Name) -> list:
    """The names (or with ``kind=Rest`` the '...') of a side, groups opened."""
    items = [n for item in side for n in (item.names if isinstance(item, Group) else (item,))]
    return [n for n in items if isinstance(n, kind)]


def _check_pattern_rest(src: str, left, right) -> None:
    """'...' at most once a side, on both sides or neither, and never inside a left group."""
    rule = ("'...' stands for the input's dims that the left side does not name; the right side "
            "places them, alone or merged in a group ('(... d)'), so each side holds it once.")
    for label, side, other, other_side in (("left", left, "right", right), ("right", right, "left", left)):
        rests = _flat(side, Rest)
        if len(rests) > 1:
            raise error(REARRANGE, src, rests[1].span, f"'...' appears twice on the {label} side.",
                        rule=rule, fix="keep one '...' and name the other dims.") from None
        if rests and not _flat(other_side, Rest):
            raise error(REARRANGE, src, rests[0].span,
                        f"'...' is on the {label} side but not on the {other}.", rule=rule,
                        fix=f"add '...' to the {other} side, e.g. 'b ... (h d) -> b ... h d'.") from None
    group = next((item for item in left if isinstance(item, Group) and _flat([item], Rest)), None)
    if group is not None:
        raise error(REARRANGE, src, _flat([group], Rest)[0].span,
                    "'...' is inside a group on the left side.", rule=rule,
                    fix="a left group splits one dim into named parts: write '...' outside it, "
                        "e.g. '... (h d) -> ... h d'.") from None


def _check_pattern(src: str, left, right) -> None:
    for item in (*left, *right):
        if isinstance(item, _Rejected):
            raise error(REARRANGE, src, item.token.span,
                        f"numbers are not allowed: '{item.token.name}'.",
                        rule="patterns use dim names only; sizes come from the tensor's dims.",
                        fix="use a dim name instead of a size.") from None
    _check_pattern_rest(src, left, right)
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
        operand or output is a scalar (``"batch, batch ->"``); ``...`` stands for an
        operand's dims its term does not name (``"... d, d f -> ... f"``).

    Returns:
      An :class:`EinsumSpec`; ``output`` is None when ``->`` is omitted.

    Raises:
      ParseError: on a non-string, a syntax error, a dim or ``...`` repeated within one
        operand or the output, an output dim that appears in no input (when no input has
        ``...``), or ``...`` in the output but in no input.
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
      s: ``left -> right``, each side dim names, flat ``(...)`` groups and at most one
        ``...``, e.g. ``"batch seq (heads d_k) -> batch seq heads d_k"`` or
        ``"... (heads d_k) -> ... heads d_k"``.

    Returns:
      A :class:`PatternSpec` of :class:`Name`, :class:`Group` and :class:`Rest` items per side.

    Raises:
      ParseError: on a non-string, a syntax error, numbers, nested or unbalanced
        parentheses, a dim repeated on one side or missing from the other, or ``...``
        repeated on a side, on one side only, or inside a left group.
    """
    check_str(REARRANGE, s)
    return _parse_rearrange(s)


@functools.lru_cache(maxsize=None)
def _parse_rearrange(s: str) -> PatternSpec:
    check_parens(REARRANGE, s, stops=("->",), comments=False)
    left, right = parse(REARRANGE, s, _PatternBuilder())
    _check_pattern(s, left, right)
    return PatternSpec(left, right, s)
