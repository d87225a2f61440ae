"""Ops that change a tensor's dims without arithmetic: transpose, broadcast_to,
rename, reshape and einops-style rearrange.

Renaming is how a layout changes (Mesh-TF): the same data under new dim names
picks up the new names' layout rules, so the compiler inserts the allgather,
local split or alltoall that turns one into the other.
"""
from __future__ import annotations

import math

import einops

from ..core.graph import Tensor
from ..core.names import Name
from ..core.shape import Dim, Shape, as_shape
from ..errors import ShapeError, did_you_mean, message
from .broadcasting import align, align_plan, sum_to
from .registry import ComputeSpec, Op, apply, register


@register
class Transpose(Op):
    name = "transpose"
    linear = True

    def infer(self, inputs, attrs):
        (x,) = inputs
        shape = Shape(x.shape.get(n) for n in attrs["names"])
        attrs["perm"] = tuple(x.shape.index(n) for n in attrs["names"])
        return [(shape, x.dtype)]

    def compute(self, ctx, attrs, x):
        return x.permute(attrs["perm"])

    def grad(self, node, douts):
        return [transpose(douts[0], node.inputs[0].shape.names)]


@register
class BroadcastTo(Op):
    name = "broadcast_to"
    linear = True

    def infer(self, inputs, attrs):
        (x,) = inputs
        shape = attrs["shape"]
        attrs["align"] = align_plan(x.shape, shape)
        attrs["full"] = tuple((d.name, d.size) for d in shape)
        return [(shape, x.dtype)]

    def compute(self, ctx, attrs, x):
        # a view: consumers read it, and nothing writes into a broadcast (donated in-place
        # updates write only into params); collectives make their own contiguous copy
        return align(x, attrs["align"]).expand(*(ctx.size(n, s) for n, s in attrs["full"]))

    def direct_for(self, attrs, ins, outs):
        # the local sizes written in (the plan fixes them); expand itself puts new leading dims in front
        (out,) = outs
        plan = attrs["align"]
        if plan[0] is None and (plan[1] is None or all(i is None for i in plan[1][:len(out) - len(ins[0])])):
            return lambda x: x.expand(out)
        return lambda x: align(x, plan).expand(out)

    def grad(self, node, douts):
        return [sum_to(douts[0], node.inputs[0])]


@register
class Rename(Op):
    name = "rename"
    linear = True
    cse = True   # a second identical rename of a tensor is the first (core/graph.py, add_node)

    def infer(self, inputs, attrs):
        (x,) = inputs
        m = attrs["mapping"]
        return [(Shape(Dim(m.get(d.name, d.name), d.size) for d in x.shape), x.dtype)]

    def compute(self, ctx, attrs, x):
        return x

    def spec(self, node):
        x = node.inputs[0]
        inv = {v: k for k, v in node.attrs["mapping"].items()}
        return ComputeSpec({d.name: d.size for d in x.shape},
                           out_rename={d.name: inv.get(d.name, d.name) for d in node.outputs[0].shape})

    def grad(self, node, douts):
        inv = {v: k for k, v in node.attrs["mapping"].items()}
        return [rename(douts[0], inv)]


@register
class Reshape(Op):
    """Row-major reshape.  Its lowering (``meshdsl/lowering/reshape.py``) keeps a mesh split
    across a merge or a split of dims where row-major order allows; ``spec`` (every dim
    after the common leading prefix whole) is the plain form, and its checks."""

    name = "reshape"
    linear = True

    def infer(self, inputs, attrs):
        (x,) = inputs
        shape = attrs["shape"]
        k = 0
        while k < min(len(x.shape), len(shape)) and x.shape[k] == shape[k]:
            k += 1
        attrs["prefix"] = tuple(d.name for d in shape[:k])
        attrs["rest"] = tuple(d.size for d in shape[k:])
        return [(shape, x.dtype)]

    def compute(self, ctx, attrs, x):
        lead = x.shape[:len(attrs["prefix"])]
        return x.reshape(*lead, *attrs["rest"])

    def spec(self, node):
        x, y = node.inputs[0], node.outputs[0]
        keep = set(node.attrs["prefix"])
        dims = {d.name: d.size for d in x.shape}
        dims.update({d.name: d.size for d in y.shape})
        fixed = frozenset(n for n in dims if n not in keep)
        clash = [d.name for d in y.shape if d.name in x.shape and d.name not in keep
                 and x.shape.get(d.name).size != d.size]
        if clash:
            raise ShapeError(message(
                f"reshape {x.shape} -> {y.shape}: dim '{clash[0]}' changes size but keeps its name.",
                rule="a dim name means one size within an op", fix="give the new dim another name"))
        return ComputeSpec(dims, fixed=fixed, out_rename={})

    def grad(self, node, douts):
        return [reshape(douts[0], node.inputs[0].shape)]


@register
class Rearrange(Op):
    name = "rearrange"
    linear = True

    def infer(self, inputs, attrs):
        return [(attrs["shape"], inputs[0].dtype)]

    def compute(self, ctx, attrs, x):
        return einops.rearrange(x, attrs["pattern"], **attrs["sizes"])

    def spec(self, node):
        x, y = node.inputs[0], node.outputs[0]
        dims = {d.name: d.size for d in x.shape}
        dims.update({d.name: d.size for d in y.shape})
        dims.update(node.attrs["parts"])
        return ComputeSpec(dims, fixed=frozenset(node.attrs["fixed"]))

    def grad(self, node, douts):
        return [apply("rearrange", [douts[0]], node.attrs["back"])]


# ----------------------------------------------------------------------------- public API


def transpose(x: Tensor, names) -> Tensor:
    """Reorder ``x``'s dims to ``names`` (a permutation of its dim names)."""
    names = tuple(n.name if isinstance(n, Dim) else n for n in names)
    if sorted(names) != sorted(x.shape.names):
        raise ShapeError(message(f"transpose: {list(names)} is not a permutation of {list(x.shape.names)}.",
                                 rule="transpose lists every dim once", fix=f"use an order of {list(x.shape.names)}"))
    if names == x.shape.names:
        return x
    return apply("transpose", [x], {"names": names})


def broadcast_to(x: Tensor, shape) -> Tensor:
    """Repeat ``x`` along the dims of ``shape`` it lacks (and order it like ``shape``)."""
    shape = as_shape(shape)
    for d in x.shape:
        if d not in shape:
            raise ShapeError(message(f"broadcast_to: dim {d!r} of {x!r} is not in target {shape}.",
                                     rule="broadcasting only adds dims", fix="reduce or rename it first"))
    if shape == x.shape:
        return x
    return apply("broadcast_to", [x], {"shape": shape})


def rename(x: Tensor, mapping: dict | None = None, **kw) -> Tensor:
    """Rename dims: ``rename(x, batch="experts_batch")`` or ``rename(x, {"batch": ...})``.

    The data do not change; the layout does, when the names have different rules.
    """
    if mapping is not None and not isinstance(mapping, dict):
        raise ShapeError(message(
            f"rename: the mapping of {x!r} is {mapping!r} ({type(mapping).__name__}), not a dict.",
            rule="rename maps each old dim name to its new one",
            fix=f"write md.rename(x, {{'{x.shape.names[0] if x.shape.names else 'old'}': 'new_name'}}) "
                "or md.rename(x, old='new_name')"))
    m = {(k.name if isinstance(k, Dim) else k): (v.name if isinstance(v, Dim) else v)
         for k, v in {**(mapping or {}), **kw}.items()}
    for k in m:
        if k not in x.shape:
            raise ShapeError(message(f"rename: {x!r} has no dim '{k}'.{did_you_mean(k, x.shape.names)}",
                                     rule="rename maps existing dim names to new ones",
                                     fix=f"use dims from {list(x.shape.names)}"))
    m = {k: v for k, v in m.items() if k != v}
    after = [m.get(n, n) for n in x.shape.names]
    twice = sorted({n for n in after if after.count(n) > 1})
    if twice:
        raise ShapeError(message(
            f"rename {m} of {x!r}: dim name(s) {twice} would appear twice.",
            rule="dim names within one tensor are unique: a new name must not be one the tensor keeps",
            fix=f"pick a new name that is not among {list(x.shape.names)}, or rename the other dim too"))
    return apply("rename", [x], {"mapping": m}) if m else x


def reshape(x: Tensor, shape) -> Tensor:
    """Mesh-TF reshape: a rename when sizes line up dim for dim, else a row-major reshape."""
    shape = as_shape(shape)
    if shape.numel != x.shape.numel:
        raise ShapeError(message(f"reshape {x.shape} -> {shape}: {x.shape.numel} elements cannot become {shape.numel}.",
                                 rule="reshape keeps the number of elements", fix="check the new dims' sizes"))
    if len(shape) == len(x.shape) and shape.sizes == x.shape.sizes:
        return rename(x, {a.name: b.name for a, b in zip(x.shape, shape)})
    return apply("reshape", [x], {"shape": shape})


def _in_left_order(x: Tensor, left, group_type) -> Tensor:
    """``x`` transposed to the order a rearrange's left side names its dims in: a plain name is
    the dim of that name (as an einsum operand lists its dims in any order), and each group one
    of the dims no plain name names, in ``x``'s order.  A left side that names a dim ``x`` lacks,
    or has the wrong number of entries, is left to the checks that say what is wrong."""
    plain = [it.name for it in left if not isinstance(it, group_type)]
    if len(left) != len(x.shape) or len(set(plain)) != len(plain) or not all(n in x.shape for n in plain):
        return x
    rest = iter([n for n in x.shape.names if n not in plain])
    order = tuple(next(rest) if isinstance(it, group_type) else it.name for it in left)
    return x if order == x.shape.names else transpose(x, list(order))


def _expand_rest(x: Tensor, spec, group_type, rest_type) -> tuple[tuple, tuple]:
    """A pattern's sides with ``...`` replaced by the dims it stands for, each underlined at the
    ``...``: ``x``'s dims that no plain name on the left names, less those the left's groups
    split (the groups before ``...`` split the first of them, those after it the last, in
    ``x``'s order: einops' positions, counted among the unnamed dims).  A pattern without
    ``...`` comes back as it is; one whose groups outnumber the unnamed dims is left to the
    check that counts the entries."""
    left, right = spec.left, spec.right
    at = next((i for i, it in enumerate(left) if isinstance(it, rest_type)), None)
    if at is None:
        return left, right
    plain = {it.name for it in left if not isinstance(it, (group_type, rest_type))}
    unnamed = [n for n in x.shape.names if n not in plain]
    before = sum(isinstance(it, group_type) for it in left[:at])
    after = sum(isinstance(it, group_type) for it in left[at + 1:])
    dims = unnamed[before:len(unnamed) - after] if before + after <= len(unnamed) else []

    def expand(items):
        out = []
        for it in items:
            if isinstance(it, rest_type):
                out += [Name(n, it.span) for n in dims]
            elif isinstance(it, group_type):
                out.append(group_type(tuple(expand(it.names)), it.span))
            else:
                out.append(it)
        return out
    return tuple(expand(left)), tuple(expand(right))


def _check_sizes(x: Tensor, pattern: str, sizes: dict) -> None:
    """Each size keyword of a rearrange is a positive int ("2" or 2.0 would reach the arithmetic)."""
    bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1}
    if bad:
        raise ShapeError(message(
            f"rearrange: the size(s) {bad} of {x!r} are not positive ints.", source=pattern, span=None,
            rule="each keyword gives a part's size in a group of the pattern, as a Python int >= 1",
            fix=f"write e.g. {next(iter(bad))}=2"))


def _right_side(right, part_sizes: dict, fixed: set, group_type) -> tuple[Shape, list[str]]:
    """The output's shape and einops tokens from a rearrange's right side: a group merges its
    parts into one dim named by joining them with ``_`` (and it and its parts join ``fixed``)."""
    out_dims, tokens = [], []
    for item in right:
        if isinstance(item, group_type):
            names = [n.name for n in item.names]
            merged = "_".join(names)
            out_dims.append(Dim(merged, math.prod(part_sizes[n] for n in names)))
            fixed.update(names)
            fixed.add(merged)
            tokens.append("(" + " ".join(names) + ")")
        else:
            out_dims.append(Dim(item.name, part_sizes[item.name]))
            tokens.append(item.name)
    return Shape(out_dims), tokens


def rearrange(x: Tensor, pattern: str, **sizes: int) -> Tensor:
    """einops-style rearrange over names.

    The left side lists ``x``'s dims, by name in any order (``x`` is transposed to it); a
    group ``(heads d_k)`` on the left splits a dim, one of those it does not name, taken in
    ``x``'s order (give all but one part's size as keywords).  A group on the right merges
    dims into one named by joining the parts with ``_``.  ``...`` stands for the dims the left
    side does not name (nor its groups split), in ``x``'s order; the right side places them, alone
    or merged in a group (``(... d)``).

    Example: ``rearrange(x, "batch seq (heads d_k) -> batch seq heads d_k", heads=8)``, or for
    any leading dims ``rearrange(x, "... (heads d_k) -> ... heads d_k", heads=8)``.
    """
    from ..core.equations import Group, Rest, parse_rearrange

    _check_sizes(x, pattern, sizes)
    left, right = _expand_rest(x, parse_rearrange(pattern), Group, Rest)
    x = _in_left_order(x, left, Group)
    if len(left) != len(x.shape):
        raise ShapeError(message(
            f"rearrange: the left side has {len(left)} entries but {x!r} has {len(x.shape)} dims.",
            source=pattern, span=None,
            rule="the left side names each of the input's dims once, in any order (a group splits one)",
            fix=f"start the pattern with '{' '.join(x.shape.names)} ->'"))
    part_sizes: dict[str, int] = {}
    fixed: set[str] = set()
    left_tokens = []
    for item, d in zip(left, x.shape):
        if isinstance(item, Group):
            names = [n.name for n in item.names]
            known = [sizes[n] for n in names if n in sizes]
            unknown = [n for n in names if n not in sizes]
            if len(unknown) > 1 or (not unknown and math.prod(known) != d.size) or d.size % max(1, math.prod(known)):
                raise ShapeError(message(
                    f"rearrange: cannot split dim {d!r} into ({' '.join(names)}) with sizes {sizes}.",
                    source=pattern, span=item.span,
                    rule="the parts of a split dim multiply to its size; give all but one as keywords",
                    fix=f"e.g. rearrange(x, pattern, {names[0]}=N)"))
            for n in names:
                part_sizes[n] = sizes.get(n) or d.size // math.prod(known)
            fixed.update(names)
            fixed.add(d.name)
            left_tokens.append("(" + " ".join(names) + ")")
        else:
            if item.name != d.name:
                raise ShapeError(message(
                    f"rearrange: left side names '{item.name}' where {x!r} has dim '{d.name}'.",
                    source=pattern, span=item.span,
                    rule="the left side names each of the input's dims once, in any order (a group splits one)",
                    fix=f"write '{d.name}' there"))
            part_sizes[d.name] = d.size
            left_tokens.append(d.name)
    shape, right_tokens = _right_side(right, part_sizes, fixed, Group)
    kw = {n: part_sizes[n] for item in left if isinstance(item, Group) for n in [i.name for i in item.names][1:]}
    fwd = f"{' '.join(left_tokens)} -> {' '.join(right_tokens)}"
    back_kw = {n: part_sizes[n] for item in right if isinstance(item, Group) for n in [i.name for i in item.names][1:]}
    back_shape = x.shape
    # The parts of each input dim (left) and of each output dim (right), for the lowering
    # (meshdsl/lowering/reshape.py: a split survives where the parts' order allows).
    left_parts = tuple(tuple(n.name for n in item.names) if isinstance(item, Group) else (item.name,)
                       for item in left)
    right_parts = tuple(tuple(n.name for n in item.names) if isinstance(item, Group) else (item.name,)
                        for item in right)
    attrs = {"pattern": fwd, "sizes": kw, "shape": shape, "fixed": tuple(sorted(fixed)),
             "parts": {n: s for n, s in part_sizes.items()}, "left": left_parts, "right": right_parts}
    attrs["back"] = {"pattern": f"{' '.join(right_tokens)} -> {' '.join(left_tokens)}", "sizes": back_kw,
                     "shape": back_shape, "fixed": attrs["fixed"], "parts": attrs["parts"],
                     "left": right_parts, "right": left_parts}
    attrs["back"]["back"] = {k: v for k, v in attrs.items() if k != "back"}
    return apply("rearrange", [x], attrs)


__all__ = ["transpose", "broadcast_to", "rename", "reshape", "rearrange"]
