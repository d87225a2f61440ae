"""Argument checks at the DSL's front door: an op's Tensor parameters get meshdsl Tensors.

A public op whose signature annotates a parameter ``Tensor`` (or ``Tensor | None``) is
wrapped once, when :mod:`meshdsl.ops` is imported, so that a Python number, a torch tensor
or a list in that place is one clear error naming the op and the argument
(:func:`meshdsl.core.graph.not_a_tensor`), before the op reads ``.shape`` or ``.dtype`` of it.
"""
from __future__ import annotations

import functools
import inspect

from ..core.graph import Tensor, not_a_tensor
from ..core.torch_hints import TORCH_HINTS
from ..errors import GraphError, did_you_mean, message

_TENSOR = ("Tensor", "Tensor | None")


def _tensor_params(fn) -> list[tuple[int | None, str, bool]]:
    """(position or None for keyword-only, name, None allowed) of each Tensor parameter of ``fn``."""
    out = []
    for i, p in enumerate(inspect.signature(fn).parameters.values()):
        ann = p.annotation if isinstance(p.annotation, str) else ""
        if ann not in _TENSOR or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue  # (einsum's *xs check their operands themselves, with the equation)
        pos = i if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) else None
        out.append((pos, p.name, ann.endswith("None")))
    return out


def _bad_call(fn, sig: inspect.Signature, args: tuple, kwargs: dict) -> GraphError | None:
    """The house error for a call whose arguments do not fit ``fn``'s parameters (a missing dim,
    a keyword it lacks, one argument too many), or None when they fit."""
    try:
        sig.bind(*args, **kwargs)
        return None
    except TypeError as e:
        why = str(e)
    what = fn.__name__
    names = [p.name for p in sig.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    unknown = [k for k in kwargs if k not in sig.parameters]
    close = did_you_mean(unknown[0], names) if unknown and names else ""
    given = f"given: {len(args)} positional argument(s)" + (f", keywords {', '.join(kwargs)}" if kwargs else "")
    return GraphError(message(
        f"md.{what} was called with arguments that do not fit it: {why}.{close}",
        inputs=[f"signature: md.{what}{sig}", given],
        rule=f"md.{what} takes the arguments its signature lists (docs/guide/api.md)",
        fix=f"call it as md.{what}({', '.join(names)})" + (" with a dim name, e.g. 'd_model'"
                                                          if "dim" in names or "dims" in names else "")))


def checked_call(fn):
    """``fn``, raising the house error of :func:`_bad_call` for an argument list that does not fit
    it (``md.compile(..., micro_batches=2)``), in place of Python's TypeError."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TypeError:
            bad = _bad_call(fn, sig, args, kwargs)  # bound only on failure: no cost per call
            if bad is None:
                raise
        raise bad

    return checked


def check_tensor_args(fn):
    """``fn``, checking its Tensor parameters and its argument list on each call."""
    if not inspect.isfunction(fn):
        return fn
    checks = _tensor_params(fn)
    call = checked_call(fn)
    if not checks:
        return call
    what = fn.__name__

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        for pos, name, optional in checks:
            if pos is not None and pos < len(args):
                value = args[pos]
            elif name in kwargs:
                value = kwargs[name]
            else:
                continue
            if not isinstance(value, Tensor) and not (optional and value is None):
                raise not_a_tensor(what, f"argument '{name}'", value)
        return call(*args, **kwargs)

    return checked


class UnknownNameError(AttributeError):
    """``md.<name>`` for a name meshdsl lacks: an AttributeError (so ``hasattr`` is False)
    whose message has the house structure."""




def unknown_name(name: str, names) -> UnknownNameError:
    """The error for ``md.<name>`` when meshdsl has no such name (``names``: every public one)."""
    hint = TORCH_HINTS.get(name)
    close = "" if hint else did_you_mean(name, [n for n in names if not n.startswith("_")])
    return UnknownNameError(message(
        f"module 'meshdsl' has no attribute {name!r}: meshdsl has no op or name '{name}'.{close}",
        rule="meshdsl's ops are the named-tensor ops listed in docs/guide/api.md (dir(meshdsl) lists every name)",
        fix=f"write {hint}" if hint else "build it from the ops listed there, e.g. a composite of elementwise "
                                         "ops, md.einsum and reductions"))


def dims_to_ints(x: Tensor, mapping, what: str, arg: str, noun: str, fix: str) -> dict[str, int]:
    """``mapping`` (``arg`` of op ``what``: a dict dim of ``x`` -> a positive int, its ``noun``)
    checked, and ``x`` a float tensor; the dims by name.  ``fix``: what to pass for a bad value."""
    from ..core.shape import Dim
    from ..errors import ShapeError

    if not x.dtype.is_floating_point:
        raise ShapeError(message(f"{what}: {x!r} is {x.dtype}, not a float tensor.",
                                 rule=f"{what} takes float values", fix="md.cast it to a float dtype first"))
    if not isinstance(mapping, dict) or not mapping:
        raise ShapeError(message(f"{what}: {arg}={mapping!r} is not a dict spatial dim -> {noun}.",
                                 rule=f"{arg} names each dim of x it acts on and its {noun}",
                                 fix=f"pass e.g. {arg}={{'{x.shape.names[-1]}': 2}}"))
    out = {}
    for d, k in mapping.items():
        name = d.name if isinstance(d, Dim) else d
        if not isinstance(name, str) or name not in x.shape:
            hint = did_you_mean(name, x.shape.names) if isinstance(name, str) else ""
            raise ShapeError(message(f"{what}: {arg} names {d!r}, which is not a dim of {x!r}.{hint}",
                                     rule=f"{arg}'s keys are dims of x", fix="name one of x's dims"))
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ShapeError(message(f"{what}: the {noun} {k!r} along '{name}' is not a positive int.",
                                     rule=f"a {noun} is an int >= 1", fix=fix))
        out[name] = k
    return out


def per_dim_ints(value, dims, what: str, arg: str, least: int = 1, default=None) -> dict[str, int]:
    """``value`` (``arg`` of op ``what``: an int, or a dict spatial dim -> int) as each of ``dims``
    -> an int >= ``least``; a dim the dict leaves out takes ``default`` (an int, a dict dim ->
    int, or None: ``least``)."""
    from ..errors import ShapeError

    dims = list(dims)
    given = value if isinstance(value, dict) else {d: value for d in dims}
    noun = "a positive int" if least == 1 else f"an int >= {least}"
    bad = [f"{arg} names '{d}', which is not a spatial dim" for d in given if d not in dims]
    bad += [f"{arg} {v!r} for '{d}' is not {noun}" for d, v in given.items()
            if not isinstance(v, int) or isinstance(v, bool) or v < least]
    if bad:
        e = max(least, 1)
        raise ShapeError(message(f"{what}: bad {arg} {value!r}.", bullets=bad,
                                 rule=f"{arg} is {noun}, or a dict spatial dim -> {noun}",
                                 fix=f"pass e.g. {arg}={e} or {arg}={{'{dims[0]}': {e}}}"))
    fill = default if isinstance(default, dict) else {d: least if default is None else default for d in dims}
    return {d: given.get(d, fill[d]) for d in dims}
