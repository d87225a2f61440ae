"""einsum over dim names: matmul, outer products, transposes and batched matmuls.

Lowering: every dim may be split; a split contracted dim leaves a lazy partial
sum over its axes (reduced later by allreduce or reduce_scatter, or never if a
linear consumer keeps it partial).
"""
from __future__ import annotations

import math
import string

import torch

from ..core.graph import Tensor
from ..core.names import Name
from ..core.origin import dim_joined
from ..core.shape import Shape
from ..errors import ShapeError, Span, did_you_mean, message
from .einsum_order import pairwise_order
from .matmul_form import MatmulForm
from .registry import ComputeSpec, Op, apply, register


@register
class Einsum(Op):
    name = "einsum"
    linear = False
    multilinear = True

    def infer(self, inputs, attrs):
        names_out = attrs["out"]
        sizes = {}
        for x in inputs:
            for d in x.shape:
                sizes[d.name] = d.size
        letters = {}
        for n in list(sizes):
            letters[n] = string.ascii_letters[len(letters)]
        eq_in = ",".join("".join(letters[d] for d in x.shape.names) for x in inputs)
        attrs["eq"] = f"{eq_in}->{''.join(letters[n] for n in names_out)}"
        attrs["form"] = (MatmulForm.of(tuple(inputs[0].shape.names), tuple(inputs[1].shape.names), tuple(names_out))
                         if len(inputs) == 2 else None)
        return [(Shape([x.shape.get(n) for x in inputs if n in x.shape][0] for n in names_out), inputs[0].dtype)]

    def compute(self, ctx, attrs, *xs):
        form = attrs.get("form")
        return form.matmul(*xs) if form is not None else torch.einsum(attrs["eq"], *xs)

    def direct(self, attrs):
        form = attrs.get("form")
        return form.matmul if form is not None else None

    def direct_for(self, attrs, ins, outs):
        # the matmul generated for these shapes: no shape lookup per call (nor its compile check)
        form = attrs.get("form")
        return form.calls_for(*ins)[0] if form is not None else None

    def spec(self, node):
        dims = {d.name: d.size for x in node.inputs for d in x.shape}
        out = set(node.attrs["out"])
        return ComputeSpec(dims, reduce={n: "sum" for n in dims if n not in out})

    def flops(self, node, local):
        dims = {d.name: d.size for x in node.inputs for d in x.shape}
        return 2 * math.prod(local.get(n, s) for n, s in dims.items())

    def grad(self, node, douts):
        from .shape_ops import broadcast_to

        g = douts[0]
        grads = []
        for i, x in enumerate(node.inputs):
            if not x.dtype.is_floating_point:
                grads.append(None)
                continue
            others = [g] + [y for j, y in enumerate(node.inputs) if j != i]
            have = {n for t in others for n in t.shape.names}
            present = [n for n in x.shape.names if n in have]
            gi = _einsum_named(others, present)
            if len(present) != len(x.shape):
                gi = broadcast_to(gi, x.shape)
            grads.append(gi)
        return grads


def _einsum_named(xs: list[Tensor], out: list[str], chain: bool = True) -> Tensor:
    """``einsum(xs -> out)``; with ``chain``, three or more operands as a chain of two-operand
    einsums in the cheapest order (:func:`pairwise_order`).  The user's einsum is one node (its
    layout lowers it whole); its gradients are chains, so each contracts only what its pair does."""
    if len(xs) <= 2 or not chain:
        return apply("einsum", xs, {"in": tuple(x.shape.names for x in xs), "out": tuple(out)})
    sizes = {d.name: d.size for x in xs for d in x.shape}
    made = list(xs)
    for i, j, dims in pairwise_order([tuple(x.shape.names) for x in xs], tuple(out), sizes):
        made.append(_einsum_named([made[i], made[j]], list(dims)))
    return made[-1]


def _broadcast_joins(x: Tensor, extra: list[str], listed: list[str]) -> dict | None:
    """The bullets, rule and fix of an operand that carries ``extra`` dims an earlier op
    broadcast into it (None when no op did: the dims were the tensor's from the start)."""
    joins = {d: dim_joined(x, d, listed) for d in extra}
    joins = {d: j for d, j in joins.items() if j is not None}
    if not joins:
        return None
    bullets = [f"dim '{d}' entered at {j.node.op.name} '{j.node.name}', which broadcast "
               f"{j.carrier.name} {j.carrier.shape} over {j.stream.name} {j.stream.shape}"
               for d, j in joins.items()]
    d, j = next(iter(joins.items()))
    size = j.carrier.shape.get(d).size
    same = [n.name for n in j.stream.shape if n.size == size and n.name not in j.carrier.shape]
    how = (f"e.g. md.rename({j.carrier.name}, {d}='{same[0]}') if they index the same positions"
           if same else f"slice, reduce or rename '{d}' first")
    return {"bullets": bullets,
            "rule": "ops broadcast by dim name: a result has every dim of its operands, so a dim an "
                    "operand should not have spreads to everything computed from it",
            "fix": f"fix {j.node.op.name} '{j.node.name}': give {j.carrier.name} {j.carrier.shape} dims that "
                   f"match {j.stream.name} {j.stream.shape} ({how}), so its result keeps "
                   f"[{', '.join(j.stream.shape.names)}]"}


def _check_operands(equation: str, spec, xs) -> None:
    """Tensors, one per operand, of one dtype."""
    bad = next((x for x in xs if not isinstance(x, Tensor)), None)
    if bad is not None:
        raise ShapeError(message(f"einsum('{equation}'): operand {bad!r} ({type(bad).__name__}) is not a Tensor.",
                                 rule="einsum contracts meshdsl Tensors", fix="pass Tensors built by ops or leaves"))
    if len(spec.inputs) != len(xs):
        raise ShapeError(message(
            f"einsum('{equation}'): the equation has {len(spec.inputs)} operand(s) but {len(xs)} tensor(s) were given.",
            inputs=[f"tensors: {', '.join(map(repr, xs))}"], rule="one equation operand per tensor",
            fix="add or remove operands in the equation"))
    if len({x.dtype for x in xs}) > 1:
        raise ShapeError(message(
            f"einsum('{equation}'): the operands have different dtypes "
            f"{[str(x.dtype).replace('torch.', '') for x in xs]}.",
            inputs=[f"operands: {', '.join(map(repr, xs))}"],
            rule="einsum's operands share one dtype (no silent promotion); for bf16 matmuls with fp32 weights "
                 "cast both, or build the step with precision='bf16' (--precision bf16), which does it",
            fix="cast one operand with md.cast(x, dtype)"))


def _resolve_rest(spec, xs, rest_type) -> tuple[list[list[Name]], list[list[str] | None]]:
    """Each operand's term with its '...' replaced by the dims of its tensor that the term does
    not name, in the tensor's order, each underlined at the '...'; and those dims per operand
    (None for a term without '...')."""
    terms, extras = [], []
    for names, x in zip(spec.inputs, xs):
        rest = next((n for n in names if isinstance(n, rest_type)), None)
        if rest is None:
            terms.append(list(names))
            extras.append(None)
            continue
        named = {n.name for n in names if n is not rest}
        extra = [d for d in x.shape.names if d not in named]
        terms.append([m for n in names for m in ([Name(d, rest.span) for d in extra] if n is rest else [n])])
        extras.append(extra)
    return terms, extras


def _check_term(equation: str, k: int, names: list[Name], x: Tensor, sizes: dict) -> None:
    """Operand ``k``'s term lists exactly its tensor's dims, each the size it has elsewhere."""
    got = [n.name for n in names]
    if sorted(got) != sorted(x.shape.names):
        missing = [n for n in x.shape.names if n not in got]
        bad = next((n for n in names if n.name not in x.shape), None)
        what = (f"names '{bad.name}', which tensor {k} {x.shape} lacks" if bad is not None else
                f"omits dim(s) {missing} of tensor {k} {x.shape}")
        joined = _broadcast_joins(x, missing, got) if bad is None else None
        if joined:
            span = Span(names[0].span.start, names[-1].span.end) if names and names[0].span else None
            raise ShapeError(message(f"einsum: operand {k} {what}.", source=equation, span=span, **joined))
        raise ShapeError(message(
            f"einsum: operand {k} {what}.", source=equation, span=bad.span if bad is not None else None,
            rule="each operand lists exactly its tensor's dim names (in any order)",
            fix=f"write operand {k} as '{' '.join(x.shape.names)}'"))
    for d in x.shape:
        if sizes.setdefault(d.name, d.size) != d.size:
            raise ShapeError(message(
                f"einsum: dim '{d.name}' has size {sizes[d.name]} in one operand and {d.size} in operand {k}.",
                source=equation, span=next(n.span for n in names if n.name == d.name),
                rule="a dim name means one size in all operands",
                fix=f"rename one of the '{d.name}' dims"))


_REST_RULE = ("an operand's '...' stands for its tensor's dims that its term does not name; the output's "
              "'...' for all of those, in order of first appearance (an operand whose '...' lacks one "
              "is broadcast over it, as over any named dim); the output lists each dim once")


def _output_names(equation: str, spec, terms, extras, rest_type) -> list[str]:
    """The output's dim names: its '...' stands for the inputs' '...' dims.  Without '->', those
    dims and then the named dims that appear in exactly one term (numpy's order)."""
    rest_dims = list(dict.fromkeys(d for extra in extras if extra for d in extra))
    if spec.output is None:
        counts: dict[str, int] = {}
        for names in spec.inputs:
            for n in names:
                if not isinstance(n, rest_type):
                    counts[n.name] = counts.get(n.name, 0) + 1
        return rest_dims + [n for n, c in counts.items() if c == 1 and n not in rest_dims]
    has_rest = any(isinstance(n, rest_type) for n in spec.output)
    known = {n.name for names in terms for n in names}
    for n in spec.output:
        if isinstance(n, rest_type):
            continue
        if n.name not in known:   # only possible with '...' in an input: the parser checks the rest
            raise ShapeError(message(
                f"einsum: output dim '{n.name}' is in no operand.{did_you_mean(n.name, known)}",
                source=equation, span=n.span, inputs=[f"operand {k}: {list(t.name for t in names)}"
                                                      for k, names in enumerate(terms)],
                rule=_REST_RULE, fix=f"remove '{n.name}' from the output, or rename it to one of the operands' dims"))
        if has_rest and n.name in rest_dims:
            where = [k for k, extra in enumerate(extras) if extra and n.name in extra]
            raise ShapeError(message(
                f"einsum: output dim '{n.name}' is named in the output and is also one of the dims its '...' "
                f"stands for {rest_dims}.", source=equation, span=n.span, rule=_REST_RULE,
                fix=f"remove '{n.name}' from the output (its '...' keeps it), or name '{n.name}' in the term of "
                    f"operand(s) {where} (e.g. '{n.name} ... d'), so that their '...' no longer stands for it"))
    return [m for n in spec.output for m in (rest_dims if isinstance(n, rest_type) else [n.name])]


def einsum(equation: str, *xs: Tensor) -> Tensor:
    """Einstein summation over dim names.

    Args:
      equation: operands' dim names separated by ',', then '->' and the output's,
        e.g. ``"batch d_model, d_model d_ff -> batch d_ff"``.  Without '->' the output
        holds the dims that appear in exactly one operand, in order of appearance.
        ``...`` in an operand stands for its tensor's dims that the operand does not
        name, in the tensor's order; in the output, for all of those, in order of first
        appearance: ``"... d_model, d_model d_ff -> ... d_ff"`` is a layer for
        ``[batch, d_model]`` and ``[batch, seq, d_model]`` alike (without '->' they lead
        the output, as numpy's).
      *xs: one Tensor per operand.  Names are matched by name, so an operand's
        names may be listed in any order, but must be exactly its dims.  Three or
        more are one op, lowered whole; its gradients are contracted two at a time,
        in the order of fewest multiply-adds (as opt_einsum's), so each moves only
        what its pairs need.

    Returns:
      The result, dims in the output order.

    Raises:
      ParseError, ShapeError: on a malformed equation or names that do not match.
    """
    from ..core.equations import Rest, parse_einsum

    spec = parse_einsum(equation)
    _check_operands(equation, spec, xs)
    terms, extras = _resolve_rest(spec, xs, Rest)
    sizes: dict[str, int] = {}
    for k, (names, x) in enumerate(zip(terms, xs)):
        _check_term(equation, k, names, x, sizes)
    return _einsum_named(list(xs), _output_names(equation, spec, terms, extras, Rest), chain=False)


__all__ = ["einsum"]
