"""Layout rules: which mesh axes split each named dim, and for which tensors.

A layout string such as ``"batch:data; d_ff:model; params.d_model:data"`` is
an ordered list of rules.  A rule without a scope applies to every tensor; a
``params.`` rule applies to trainable parameters, their gradients and their
optimizer state (so weights can be sharded differently from activations, as
FSDP/ZeRO-3 wants); a ``grads.`` rule to gradients only and an ``opt.`` rule to
optimizer state only (ZeRO-1: ``opt.d_model:data``; ZeRO-2 adds
``grads.d_model:data``); a ``NAME.`` rule applies to the one tensor called NAME
(and to that param's gradient and state).  The most specific rule wins: NAME,
then ``grads.``/``opt.``, then ``params.``, then the global rule.  When two dims of one tensor want the same axis, rules written
earlier have priority, and the compiler may pick the cheaper of the variants.  The compiler adds
*implied* global rules for dims without a written global rule, which a reshape makes from a
split dim (:mod:`meshdsl.lowering.implied`); they rank after every written rule.
"""
from __future__ import annotations

import itertools

from ..core.names import NAME_RULE, Name, is_name, is_scope
from ..core.shape import Shape
from ..errors import LayoutError, clip, did_you_mean, message
from .mesh import Mesh
from .sharding import Sharding
from .specs import Rule

#: Scopes that name a kind of tensor rather than one tensor.  Most specific first:
#: a tensor's own name, then 'grads.' (its gradient) or 'opt.' (its optimizer state),
#: then 'params.' (the param, its gradient and its state), then a global rule.
SCOPES = ("grads", "opt", "params")
#: Words a user may write for "no axis" ('up.ch:none'): not on the mesh, the message names '()'.
_WHOLE_WORDS = frozenset({"none", "null", "whole", "replicated", "replicate", "unsplit", "nothing"})


def _own_scope(scopes: tuple[str, ...]) -> str | None:
    """The first scope of a tensor of ``scopes`` that a layout rule can name (a param's own name,
    also its gradient's and optimizer state's), or None."""
    return next((s for s in scopes if is_scope(s)), None)


def free_axes(mesh: Mesh, busy) -> list[str]:
    """The axes of ``mesh`` that split something (size > 1) and are not among ``busy``: the
    only 'other axes' a fix may offer (a one-axis mesh has none)."""
    return [a for a in mesh.names if mesh.sizes[a] > 1 and a not in busy]


def _move_off_fix(mesh: Mesh, scopes: tuple[str, ...], dim: str, busy, drop: str = "") -> str:
    """The fix that takes ``dim`` of one tensor (of ``scopes``) off its axes, in forms ``mesh``
    can take: keep it whole there (``'up.ch:()'``), or split it over a free axis (none of
    ``busy``) where the mesh has one; else ``drop`` (a rule to drop) if given."""
    scope, free = _own_scope(scopes), free_axes(mesh, busy)
    head = f"{scope}.{dim}" if scope else dim
    ways = [f"keep '{dim}' whole in this tensor with the rule '{head}:()' (it stays split in the others)"
            ] if scope else []
    if free:
        ways.append(f"split it over an axis no other dim of it uses, e.g. '{head}:{free[0]}'")
    if drop and not ways:
        ways.append(f"drop the rule '{drop}'")
    return ", or ".join(ways)


_ONE_DIM_PER_AXIS = ("a mesh axis may split at most one dim of a param or input (rules written earlier "
                     "win only in intermediates)")


class Layout:
    """An ordered set of layout rules.

    Example: ``Layout.parse("batch:data; d_ff:model")``.
    """

    def __init__(self, rules: tuple[Rule, ...] = (), source: str | None = None,
                 implied: tuple[tuple[Rule, str], ...] = (), empty_ok: frozenset = frozenset(),
                 cyclic: tuple[tuple[str, int, int], ...] = ()):
        self.rules = tuple(rules)
        self.source = source
        #: dims whose split may leave a rank an empty part (see :meth:`with_empty_parts`)
        self.empty_ok = frozenset(empty_ok)
        # (rule, where it comes from) for dims without a written global rule: see with_implied
        self.implied = tuple((r, why) for r, why in implied if all(w.key != r.key for w in self.rules))
        #: ((dim, v, size), ...): implied dims split block-cyclically, ``v`` blocks per rank where the
        #: dim has ``size`` (a flat fused weight's ``(qkv heads d_head)`` under ``heads:model``: v = 3;
        #: :mod:`meshdsl.lowering.cyclic_dims`); where it has another size n, ``v n / size`` blocks
        #: (q sliced off it: 1, a contiguous split), see :meth:`cyclic_blocks_of`
        self.cyclic = tuple(c for c in cyclic if any(r.key == (None, c[0]) for r, _ in self.implied))
        self._by_key: dict[tuple[str | None, str], Rule] = {}
        self._order: dict[tuple[str | None, str], int] = {}  # earlier rules win conflicts
        self._targets: dict = {}  # (shape, scopes, mesh, strict) -> targets(...), computed once
        for i, r in enumerate(self.rules):
            key = r.key
            if key in self._by_key and self._by_key[key].axis_names != r.axis_names:
                first = self._by_key[key]
                where = f"'{key[0]}.{key[1]}'" if key[0] else f"'{key[1]}'"
                scoped = "" if key[0] else f", or scope one of them (e.g. 'params.{key[1]}:...' for weights)"
                raise LayoutError(message(
                    f"Contradicting layout rules for {where}: '{first}' and '{r}'.",
                    source=self.source, span=r.span,
                    rule="each (scope, dim) is mapped to one set of mesh axes",
                    fix=f"keep one of '{first}' and '{r}'{scoped}"))
            self._by_key.setdefault(key, r)
            self._order.setdefault(key, i)
        for i, (r, _) in enumerate(self.implied, len(self.rules)):
            self._by_key[r.key] = r
            self._order[r.key] = i

    @staticmethod
    def parse(text: "str | Layout | dict | None") -> "Layout":
        """Build a layout from a layout string, a dict ``{dim: axis or (axes)}`` or a Layout.

        Args:
          text: e.g. ``"batch:data; d_ff:(data, model)"`` or
            ``{"batch": "data", "params.d_model": "fsdp"}``; None or ``""`` is the
            empty layout (everything replicated).

        Raises:
          ParseError: on a malformed layout string (with a caret under the spot).
          LayoutError: on a bad dict entry or an argument of another type.
        """
        if isinstance(text, Layout):
            return text
        if text is None:
            return Layout()
        if isinstance(text, dict):
            return Layout(tuple(_dict_rule(text, k, v) for k, v in text.items()))
        if not isinstance(text, str):
            raise LayoutError(message(
                f"Invalid layout {clip(repr(text))}: expected a layout, got {type(text).__name__}.",
                rule="a layout is a layout string such as \"batch:data; d_ff:model\", a dict "
                     "{dim: axis or (axes)}, a Layout or None",
                fix='write e.g. "batch:data; d_ff:model"'))
        from .parse import parse_layout

        spec = parse_layout(text)
        return Layout(spec.rules, source=spec.source)

    def with_implied(self, implied: tuple[tuple[Rule, str], ...], cyclic=()) -> "Layout":
        """These written rules plus ``implied`` ones, each ``(rule, why)``, instead of this layout's.

        Implied rules are global rules ranked after every written one, for dims without a
        written global rule (a scoped written rule still wins for its tensors); ``rules``,
        ``str()`` and :meth:`validate` stay the written ones (what the user typed).  ``cyclic``:
        ``(dim, v, size)`` for the implied dims split block-cyclically, ``v`` blocks per rank at
        that size of the dim.
        """
        if tuple(implied) == self.implied and tuple(cyclic) == self.cyclic:
            return self
        return Layout(self.rules, self.source, implied, self.empty_ok, tuple(cyclic))

    @property
    def cyclic_blocks(self) -> dict[str, int]:
        """Dim -> its blocks per rank at its largest size, for the implied dims split block-cyclically."""
        return {d: v for d, v, _ in self.cyclic}

    def cyclic_blocks_of(self, *shapes) -> dict[str, int]:
        """Dim -> its blocks per rank at its size in ``shapes``, for the block-cyclic dims they hold
        with more than one block per rank there (a slice of one group of the dim is split plainly)."""
        out = {}
        for d, v, size in self.cyclic:
            for shape in shapes:
                n = shape.get(d).size * v if d in shape.names else 0
                if n and n % size == 0 and n // size > 1:
                    out[d] = n // size
        return out

    def with_empty_parts(self, dims) -> "Layout":
        """This layout, with a split of dims ``dims`` allowed to leave some ranks an empty part
        (a dim of another is refused where smaller than its axes).  The compiler asks it for the
        layer dims of pipelined stacks sharing a stage axis: a stage outside a stack's run of
        stages holds none of its layers (``lowering/stage_layers.py``)."""
        dims = frozenset(dims) | self.empty_ok
        return self if dims == self.empty_ok else Layout(self.rules, self.source, self.implied, dims, self.cyclic)

    def __str__(self) -> str:
        return "; ".join(map(str, self.rules))

    def _err(self, what, span, **kw):
        return LayoutError(message(what, source=self.source, span=span, **kw))

    def validate(self, mesh: Mesh, dims: dict[str, int], tensor_names: set[str], has_repeat: bool = True) -> None:
        """Check every rule against the mesh and the graph's dims and tensor names.

        ``has_repeat``: whether the graph has an ``md.repeat``; without one, a rule's missing dim
        may be meant as the layers of a Python loop, which have no dim: the message says so.
        """
        for r in self.rules:
            scope, dim = r.key
            for axis_name in r.axes:
                axis = axis_name.name
                if axis not in mesh.sizes:
                    whole = axis.lower() in _WHOLE_WORDS   # 'up.ch:none': meant as "no axis"
                    raise self._err(
                        f"Layout rule '{dim}' names unknown mesh axis '{axis}'."
                        f"{'' if whole else did_you_mean(axis, mesh.names)}",
                        axis_name.span or r.span, inputs=[f"mesh: {mesh}"],
                        rule="a layout maps dims to axes of the mesh" + (", or to '()', no axis (the dim stays "
                                                                          "whole)" if whole else ""),
                        fix=(f"to keep '{dim}' whole write '{Rule(r.scope, r.dim, ())}'; to split it, " if whole
                             else "") + f"use one of {list(mesh.names)} or add '{axis}:N' to the mesh")
            if dim not in dims:
                typo = did_you_mean(dim, dims)
                loop = not has_repeat   # a near name (depth ~ width) may still be the loop's layers
                raise self._err(
                    f"Layout rule names dim '{dim}', which no tensor of the model has.{typo}", r.dim.span or r.span,
                    inputs=[f"model dims: {', '.join(sorted(dims))}"],
                    bullets=[f"this model has no md.repeat: if '{dim}' means its layers, layers made by a "
                             f"Python loop (one set of params per layer) have no dim to split"] if loop else None,
                    rule="every rule's dim must be a dim of some tensor in the model"
                         + ("; a layer dim, what a pipeline ('layer:stage') or a per-layer split splits, is "
                            "the dim of an md.repeat" if loop else ""),
                    fix="correct the dim name or drop the rule" + (
                        f"; or, to pipeline the layers, stack each layer's params along a Dim('{dim}', L) "
                        f"(fan_out=['{dim}', ...]) and run the block with "
                        f"md.repeat(block, x, stacked_params, '{dim}')" if loop else ""))
            if scope and scope not in SCOPES and scope not in tensor_names:
                raise self._err(
                    f"Layout rule scope '{scope}' is neither 'params' nor the name of a tensor (nor 'grads' or 'opt')."
                    f"{did_you_mean(scope, tensor_names | set(SCOPES))}", r.scope.span or r.span,
                    inputs=[f"named tensors: {', '.join(sorted(n for n in tensor_names if is_scope(n))) or '(none)'}"],
                    rule="'SCOPE.dim:axis' applies to all params (params), their gradients (grads), "
                         "optimizer state (opt), or the tensor named SCOPE",
                    fix="use 'params.', 'grads.', 'opt.' or the name of a param or input")

    def rule_for(self, dim: str, scopes: tuple[str, ...]) -> Rule | None:
        for s in scopes:
            r = self._by_key.get((s, dim))
            if r is not None:
                return r
        return self._by_key.get((None, dim))

    def wanted(self, shape: Shape, scopes: tuple[str, ...]) -> dict[str, Rule]:
        """The rule of each dim of ``shape`` that one applies to.

        A dim of size 1 is never split (as an axis of size 1 splits nothing): the
        ``seq:1`` of a class token or of ``slice_(h, "seq", 0, 1)`` stays whole under
        ``seq:model`` while the sequence it joins or was cut from is split.
        """
        out = {}
        for d in shape:
            if d.size == 1:
                continue
            r = self.rule_for(d.name, scopes)
            if r is not None:
                out[d.name] = r
        return out

    def targets(self, shape: Shape, scopes: tuple[str, ...], mesh: Mesh, what: str,
                strict: bool) -> list[tuple[Sharding, str]]:
        """Conflict-free shardings the rules allow for a tensor, best-priority first.

        Each is paired with a note ('' when the rules did not conflict).  With
        ``strict`` (params and inputs) a conflict is an error instead.  Axes of
        size 1 split nothing, so they are left out: a dim split only over such
        axes is whole, and two dims never contend for one, so a plan on
        ``data:2; model:1`` is the plan on ``data:2``.
        """
        key = (shape, scopes, mesh, strict)
        hit = self._targets.get(key)
        if hit is not None:   # what it returns does not depend on ``what`` (only its errors do)
            return list(hit)
        out = self._targets_of(shape, scopes, mesh, what, strict)
        self._targets[key] = tuple(out)
        return out

    def check_even(self, shape: Shape, scopes: tuple[str, ...], mesh: Mesh, what: str,
                   intermediate: bool = False) -> None:
        """Refuse a dim of tensor ``what`` that its rule's axes do not divide (strict splits).

        Without strict splits such a dim is split unevenly (see :mod:`.sharding`).  An
        ``intermediate``'s dim smaller than its axes is not refused: it is kept whole
        (:meth:`targets`), no split at all.

        Raises:
          LayoutError: naming the tensor, the dim, its size and the axes' sizes, with a caret
            under the rule.
        """
        for name, r in self.wanted(shape, scopes).items():
            size = shape.get(name).size
            n = mesh.axis_size(r.axis_names)
            if size % n and not (intermediate and size < n and name not in self.empty_ok):
                raise self._err(
                    f"Tensor '{what}': dim '{name}' of size {size} is not divisible by mesh axes "
                    f"{_axes_text(mesh, r.axis_names)} (= {n}).",
                    r.span, inputs=[f"tensor shape: {shape}", f"mesh: {mesh}"],
                    bullets=[f"parts: {_parts_text(size, n)} (strict splits refuse an uneven split)"],
                    rule="with strict splits, a split dim's size is a multiple of the product of its axes' sizes",
                    fix=f"make '{name}' a multiple of {n} (pad it), "
                        + _whole_or_divisor(mesh, name, size, r)
                        + ", or split it unevenly: leave out --strict-splits (strict_splits=True)")

    def check_leaves(self, leaves, mesh: Mesh) -> None:
        """Refuse at once every param or input of ``leaves`` (``(name, shape, scopes)`` each) that has
        two dims on one mesh axis, when there are several (one is refused where it is laid out,
        :meth:`targets`), each with its fix, so that one compile names them all.

        Raises:
          LayoutError: a bullet and a fix per tensor, a caret under the first one's rule that gives way.
        """
        found = [(what, shape, c) for what, shape, scopes in leaves
                 if (c := self._strict_conflict(shape, scopes, mesh)) is not None]
        if len(found) < 2:
            return
        by_fix: dict[str, list[str]] = {}   # a param's optimizer state takes the param's fix
        for what, _, (_, _, _, fix) in found:
            by_fix.setdefault(fix, []).append(what)
        raise self._err(
            f"{len(found)} params or inputs each have two dims on one mesh axis: "
            + ", ".join(f"'{what}'" for what, _, _ in found) + ".",
            found[0][2][2].span, inputs=[f"mesh: {mesh}", f"layout: {clip(str(self))}"],
            bullets=[f"Tensor '{what}' {shape}: mesh axis '{a}' is used by dims {ns}"
                     for what, shape, (a, ns, _, _) in found],
            rule=_ONE_DIM_PER_AXIS, fix="; ".join(f"for {' and '.join(map(repr, whats))}: {fix}"
                                                  for fix, whats in by_fix.items()))

    def _strict_conflict(self, shape: Shape, scopes: tuple[str, ...], mesh: Mesh):
        """``(axis, dims, rule, fix)`` where two dims of a param or input want one mesh axis (the
        first such axis; ``rule`` is the one written later, which gives way, as for intermediates),
        or None."""
        wanted = self.wanted(shape, scopes)
        axes_of = {n: tuple(a for a in r.axis_names if mesh.sizes[a] > 1) for n, r in wanted.items()}
        users: dict[str, list[str]] = {}
        for name, axes in axes_of.items():
            for a in axes:
                users.setdefault(a, []).append(name)
        a, ns = next(((a, ns) for a, ns in users.items() if len(ns) > 1), (None, None))
        if a is None:
            return None
        loser = max(ns, key=lambda n: self._order[wanted[n].key])
        busy = {x for axes in axes_of.values() for x in axes}
        return a, ns, wanted[loser], _move_off_fix(mesh, scopes, loser, busy, drop=str(wanted[loser]))

    def _targets_of(self, shape, scopes, mesh, what, strict) -> list[tuple[Sharding, str]]:
        wanted = self.wanted(shape, scopes)
        small = []
        for name, r in list(wanted.items()):
            size = shape.get(name).size
            n = mesh.axis_size(r.axis_names)
            if size < n and name not in self.empty_ok and not strict:
                # An intermediate (a slice of a split dim, a few global tokens) smaller than
                # its rule's axes: kept whole, as a dim of size 1 is; a rank holds all of it.
                del wanted[name]
                small.append(f"'{name}' ({size}) kept whole: fewer elements than "
                             f"{_axes_text(mesh, r.axis_names)} (= {n}) have ranks")
            elif size < n and name not in self.empty_ok:
                raise self._err(
                    f"Tensor '{what}': dim '{name}' of size {size} is not divisible by mesh axes "
                    f"{_axes_text(mesh, r.axis_names)} (= {n}), and too small to split unevenly: "
                    "some ranks would hold none of it.",
                    r.span, inputs=[f"tensor shape: {shape}", f"mesh: {mesh}"],
                    rule="a split dim has at least one element per part (an uneven split is allowed, "
                         "an empty part is not)",
                    fix=_small_fix(mesh, scopes, name, size, r))
        axes_of = {n: tuple(a for a in r.axis_names if mesh.sizes[a] > 1) for n, r in wanted.items()}
        users: dict[str, list[str]] = {}
        for name, axes in axes_of.items():
            for a in axes:
                users.setdefault(a, []).append(name)
        contested = {a: ns for a, ns in users.items() if len(ns) > 1}
        if not contested:
            return [(Sharding.of(shape, axes_of), "; ".join(small))]
        prio = {n: self._order[r.key] for n, r in wanted.items()}
        if strict:
            a, ns, loser, fix = self._strict_conflict(shape, scopes, mesh)
            raise self._err(f"Tensor '{what}' {shape}: mesh axis '{a}' is used by dims {ns}.", loser.span,
                            inputs=[f"mesh: {mesh}", f"layout: {clip(str(self))}"], rule=_ONE_DIM_PER_AXIS, fix=fix)
        # Each contested axis goes to one of its contenders; a dim keeps only the
        # axes it won (dropping a dim's axis keeps its remaining ones in order).
        out = []
        names = list(contested)
        for choice in itertools.product(*(contested[a] for a in names)):
            won = dict(zip(names, choice))
            split = {n: tuple(a for a in axes if won.get(a, n) == n) for n, axes in axes_of.items()}
            why = "; ".join(f"'{a}' -> {won[a]} (not {', '.join(x for x in contested[a] if x != won[a])})"
                            for a in names)
            key = tuple(prio[won[a]] for a in names)
            out.append((key, Sharding.of(shape, split), "; ".join(["axis conflict resolved: " + why, *small])))
        out.sort(key=lambda t: t[0])
        return [(s, note) for _, s, note in out]


def _whole_or_divisor(mesh: Mesh, dim: str, size: int, r: Rule) -> str:
    """The middle of a fix for ``dim`` (``size``) that rule ``r``'s axes do not divide: map it to
    an axis of ``mesh`` that divides it, where there is one, or keep it whole.  Whole by the rule
    itself, not in one tensor: the intermediates that hold the dim at this size are strict too."""
    fit = [a for a in free_axes(mesh, r.axis_names) if size % mesh.sizes[a] == 0]
    head = f"{r.scope.name}.{dim}" if r.scope else dim
    ways = [f"map it to an axis that divides it ('{head}:{fit[0]}')"] if fit else []
    ways.append(f"keep it whole with '{head}:()' in place of '{r}'" if r.scope
                else f"drop the rule '{r}' (the dim stays whole)")
    return ", ".join(ways)


def _small_fix(mesh: Mesh, scopes, dim: str, size: int, r: Rule) -> str:
    """The fix for ``dim`` of a param or input (``scopes``) smaller than rule ``r``'s axes."""
    scope = _own_scope(scopes)
    smaller = [a for a in free_axes(mesh, ()) if mesh.sizes[a] <= size and a not in r.axis_names]
    ways = [f"keep '{dim}' whole in this tensor with the rule '{scope}.{dim}:()' (it stays split in the "
            "others)"] if scope else []
    ways.append(f"give this tensor's dim a name of its own (e.g. Dim('{dim}_{size}', {size}) in its md.param or "
                "md.input, and md.rename what meets it), which the rule does not reach")
    if smaller:
        ways.append(f"map '{dim}' to smaller axes ('{dim}:{smaller[0]}')")
    return ", or ".join(ways + [f"drop the rule '{r}'"])


def _axes_text(mesh: Mesh, axes) -> str:
    return " x ".join(f"{a}:{mesh.sizes[a]}" for a in axes)


def _parts_text(size: int, n: int) -> str:
    """How ``torch.tensor_split`` cuts ``size`` into ``n`` parts, e.g. ``'65 x 1, 64 x 3'``."""
    q, r = divmod(size, n)
    return ", ".join(f"{k} x {c}" for k, c in ((q + 1, r), (q, n - r)) if c)


def _dict_rule(layout: dict, key, value) -> Rule:
    """One entry of a layout dict as a Rule, or a LayoutError naming the entry."""
    axes = ((value,) if isinstance(value, str) else tuple(value) if isinstance(value, (tuple, list))
            else None)
    scope, dim = key.rsplit(".", 1) if isinstance(key, str) and "." in key else (None, key)
    names = ([] if scope is None else [scope]) + [dim] + list(axes or ())
    bad = [n for i, n in enumerate(names) if not (is_scope(n) if i == 0 and scope is not None else is_name(n))]
    if bad:
        bad_name = bad[0]
        shown = f"'{bad_name}'" if isinstance(bad_name, str) else f"{bad_name!r} ({type(bad_name).__name__})"
        raise LayoutError(message(
            f"Layout dict entry {key!r}: {value!r}: {shown} is not a valid name.",
            inputs=[f"layout: {clip(repr(layout))}"], rule=NAME_RULE,
            fix="write e.g. {'batch': 'data', 'params.d_model': 'fsdp'}"))
    if axes is None or len(set(axes)) != len(axes):
        raise LayoutError(message(
            f"Layout dict entry {key!r}: {value!r} is not a mesh axis or a tuple of distinct axes.",
            inputs=[f"layout: {clip(repr(layout))}"],
            rule="a layout dict maps '[scope.]dim' to an axis name or a tuple of distinct axis names "
                 "(the empty tuple: no axis, the dim stays whole)",
            fix="write e.g. {'batch': 'data', 'd_ff': ('data', 'model')}"
                + (f", or {{{key!r}: ()}} to keep it whole" if value is None else "")))
    return Rule(Name(scope, None) if scope else None, Name(dim, None), tuple(Name(a, None) for a in axes))
