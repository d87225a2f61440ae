"""``--config k=v,...``: overrides of a model's ``Config`` dataclass fields, parsed and checked.

Each value is converted to the field's type (taken from the dataclass's type
hints, or from its default when a hint cannot be resolved): ``int``, ``float``,
``bool`` (``true/false/1/0/yes/no``) or ``str``; a field typed ``X | None`` takes an ``X`` or
``none``.  An unknown field, a value of
the wrong type or a malformed item is a :class:`ConfigError` that shows the
string with a caret under the item and suggests the closest field name.
"""
from __future__ import annotations

import dataclasses
import typing

from ..errors import MeshDSLError, Span, did_you_mean, message

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


class ConfigError(MeshDSLError):
    """A ``--config`` string names an unknown field or gives a value of the wrong type."""


_BASIC = (int, float, bool, str)


def _optional_of(t):
    """``X`` of a hint ``X | None`` (``Optional[X]``) with ``X`` a basic type, else None."""
    args = typing.get_args(t)
    rest = [a for a in args if a is not type(None)]
    return rest[0] if len(args) == 2 and len(rest) == 1 and rest[0] in _BASIC else None


def _field_types(cls) -> tuple[dict[str, type], set[str]]:
    """Each field's type, and the fields that also take None (typed ``X | None``)."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - unresolvable hints: fall back to the defaults' types
        hints = {}
    out, optional = {}, set()
    for f in dataclasses.fields(cls):
        t = hints.get(f.name)
        if _optional_of(t) is not None:
            t = _optional_of(t)
            optional.add(f.name)
        if t not in _BASIC:
            default = f.default if f.default is not dataclasses.MISSING else None
            t = type(default) if isinstance(default, (int, float, bool, str)) else str
        out[f.name] = t
    return out, optional


def _convert(text: str, kind: type):
    if kind is bool:
        low = text.strip().lower()
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
        raise ValueError("not a boolean (true/false)")
    if kind is int:
        return int(text)
    if kind is float:
        return float(text)
    return text


def parse_config(text: str, cls) -> dict:
    """Parse ``"d_model=128,layers=8"`` into typed overrides of dataclass ``cls``.

    Args:
      text: comma-separated ``field=value`` items (spaces around items are ignored).
      cls: the model's ``Config`` dataclass.

    Returns:
      ``{field: value}`` with each value of its field's type.

    Raises:
      ConfigError: a malformed item, an unknown field (with did-you-mean), a
        repeated field, or a value that does not convert to the field's type.
    """
    if not text or not text.strip():
        return {}
    if not dataclasses.is_dataclass(cls):
        raise ConfigError(message(f"--config {text!r}: the model's Config is not a dataclass.",
                                  rule="--config overrides fields of a Config dataclass",
                                  fix="make the model file's Config a @dataclass"))
    types, optional = _field_types(cls)
    allowed = "fields: " + ", ".join(f"{k} ({t.__name__}{' or none' if k in optional else ''})"
                                     for k, t in types.items())
    out: dict = {}
    pos = 0
    for item in text.split(","):
        start, end = pos, pos + len(item)
        pos = end + 1
        lead = len(item) - len(item.lstrip())
        span = Span(start + lead, max(start + lead + 1, end - (len(item) - len(item.rstrip()))))
        key, eq, value = item.strip().partition("=")
        key = key.strip()

        def fail(what, fix, rule="--config takes comma-separated field=value items of the model's Config",
                 span=span):
            raise ConfigError(message(f"--config: {what}", source=text, span=span, inputs=[allowed],
                                      rule=rule, fix=fix))

        if not eq or not key:
            fail(f"item {item.strip()!r} is not field=value.", "write e.g. --config d_model=128,layers=2")
        if key not in types:
            fail(f"{cls.__name__} has no field '{key}'.{did_you_mean(key, types)}",
                 "use one of the fields listed above")
        if key in out:
            fail(f"field '{key}' is given twice.", "give each field once")
        if key in optional and value.strip().lower() == "none":
            out[key] = None
            continue
        try:
            out[key] = _convert(value.strip(), types[key])
        except ValueError as e:
            kind = types[key].__name__
            a = "an" if kind[0] in "aeiou" else "a"
            detail = str(e) if types[key] is bool else f"not a valid {kind}"
            fail(f"{key}={value.strip()!r}: {detail}.", f"give {key} {a} {kind} value", rule=f"{key} is {a} {kind}")
    return out


def apply_config(cfg, overrides: dict):
    """``cfg`` with ``overrides`` replaced (:func:`dataclasses.replace`)."""
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


def config_dict(cfg) -> dict:
    """A Config dataclass as a JSON-able dict (None when ``cfg`` is not a dataclass)."""
    return dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else None


__all__ = ["ConfigError", "apply_config", "config_dict", "parse_config"]
