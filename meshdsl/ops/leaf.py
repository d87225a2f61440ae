"""Leaves of the graph: trainable params and fed inputs.

Params are initialised from a generator seeded by their name and a global
seed, as whole tensors that each rank then slices, so every layout and
process count starts from the same numbers.
"""
from __future__ import annotations

import math
import zlib

import torch

from ..core.graph import Graph, Tensor
from ..core.shape import as_shape
from ..errors import GraphError, did_you_mean, message
from .registry import ComputeSpec, Op, apply, register

INITS = ("normal", "zeros", "ones", "uniform")


@register
class Param(Op):
    name = "param"

    def infer(self, inputs, attrs):
        return [(attrs["shape"], attrs["dtype"])]

    def compute(self, ctx, attrs):
        raise GraphError("params are read from the executor's state, not computed")

    def spec(self, node):
        return ComputeSpec({d.name: d.size for d in node.outputs[0].shape})

    def grad(self, node, douts):
        return []


@register
class Input(Param):
    name = "input"


def init_value(t: Tensor, seed: int = 0) -> torch.Tensor:
    """The full initial value of param ``t``: deterministic in (name, seed), made on the CPU
    (the same numbers whatever the device; callers move it)."""
    a = t.node.attrs
    shape = t.shape.sizes
    kind = a["init"]
    if isinstance(kind, (int, float)) and not isinstance(kind, bool):
        return torch.full(shape, float(kind), dtype=a["dtype"], device="cpu")
    if kind == "zeros":
        return torch.zeros(shape, dtype=a["dtype"], device="cpu")
    if kind == "ones":
        return torch.ones(shape, dtype=a["dtype"], device="cpu")
    gen = torch.Generator().manual_seed((zlib.crc32(t.name.encode()) ^ (seed * 0x9E3779B1)) & 0x7FFFFFFF)
    scale = a["scale"]
    if scale is None:
        fan_in = math.prod(d.size for d in t.shape if d.name not in a["fan_out"]) if len(t.shape) > 1 else 1
        scale = 1.0 / math.sqrt(max(1, fan_in))
    if kind == "uniform":
        return ((torch.rand(shape, generator=gen, dtype=torch.float64, device="cpu") * 2 - 1) * scale).to(a["dtype"])
    return (torch.randn(shape, generator=gen, dtype=torch.float64, device="cpu") * scale).to(a["dtype"])


def _check_leaf(what: str, name, dtype) -> None:
    """A leaf's name is a non-empty str (feeds, checkpoints and layout scopes name it) and its
    dtype a torch.dtype."""
    if not isinstance(name, str) or not name:
        raise GraphError(message(f"{what}({name!r}, ...): the name is {name!r} ({type(name).__name__}), "
                                 "not a non-empty str.",
                                 rule=f"a {what} is named by a str: feeds, checkpoints and layout scopes use it",
                                 fix=f"write e.g. md.{what}('w1', [dims])"))
    if not isinstance(dtype, torch.dtype):
        raise GraphError(message(f"{what}('{name}'): dtype {dtype!r} ({type(dtype).__name__}) is not a torch.dtype.",
                                 rule="dtypes are torch dtypes",
                                 fix="write e.g. dtype=torch.float32 (torch.int64 for ids)"))


def _check_outside_blocks(what: str, name: str, g: Graph) -> None:
    """Params and inputs belong to the model's graph, never to a repeat block being traced."""
    if g.outer is None:
        return
    article = "an input" if what == "input" else "a param"
    raise GraphError(message(
        f"{what}('{name}') is created inside the repeat block '{g.name}'.",
        rule=f"params and inputs are made outside md.repeat: the block runs once per layer, and {article} made "
             "there would be no param or input of the model (not trained, not fed, not checkpointed)",
        fix=f"create it before the md.repeat call: the block may read it (every layer the same {what})"
            + (", or stack it with Dim('layer', N) and pass it in the params dict (one per layer)"
               if what == "param" else "")))


def _fan_out(name: str, shape, fan_out) -> tuple[str, ...]:
    """``fan_out`` as dim names of ``shape``; a bare string or a name the param lacks is refused (it
    would be ignored, and the init scale silently count the dim it meant to leave out)."""
    names = None if isinstance(fan_out, str) else [d.name if hasattr(d, "name") else d for d in fan_out]
    bad = [fan_out] if names is None else [n for n in names if n not in shape.names]
    if bad:
        raise GraphError(message(
            f"param('{name}'): fan_out={fan_out!r} is a str, not a list of dim names." if names is None else
            f"param('{name}'): fan_out={fan_out!r} names {bad}, not dims of the param {list(shape.names)}."
            + (did_you_mean(bad[0], shape.names) if isinstance(bad[0], str) else ""),
            rule="fan_out lists dims of the param (its outputs), left out of fan_in for the init scale",
            fix=f"pass a list of its dim names, e.g. fan_out=[{(fan_out if names is None else shape.names[-1])!r}]"
            if shape.names else
                "leave fan_out out"))
    return tuple(names)


def param(name: str, shape, init="normal", scale: float | None = None, dtype=torch.float32,
          fan_out=()) -> Tensor:
    """A trainable parameter.

    Args:
      name: unique name; also a layout scope (``"w1.d_ff:model"``).
      shape: list of Dims.
      init: 'normal', 'uniform', 'zeros', 'ones' or a number.
      scale: std (normal) or bound (uniform); default 1/sqrt(fan_in), where fan_in
        is the product of the dims not listed in ``fan_out``.
      fan_out: dim names that are outputs (excluded from fan_in).
    """
    _check_leaf("param", name, dtype)
    g = Graph.current()
    _check_outside_blocks("param", name, g)
    if name in g.params or name in g.inputs:
        raise GraphError(message(f"param('{name}'): the name is already used in graph '{g.name}'.",
                                 rule="param and input names are unique", fix="pick another name"))
    if init not in INITS and not isinstance(init, (int, float)):
        raise GraphError(message(f"param('{name}'): unknown init {init!r}.", rule=f"init is one of {INITS} or a number",
                                 fix="use init='normal'"))
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale)):
        raise GraphError(message(f"param('{name}'): scale={scale!r} ({type(scale).__name__}) is not a number.",
                                 rule="scale is None (1/sqrt(fan_in)) or a finite number: the std (normal) or "
                                      "bound (uniform)",
                                 fix=f"pass scale as a float, e.g. scale=float({scale!r}) or scale=0.02"))
    shape = as_shape(shape)
    fan_out = _fan_out(name, shape, fan_out)
    t = apply("param", [], {"shape": shape, "dtype": dtype, "init": init, "scale": scale,
                            "fan_out": fan_out}, name=name)
    t.node.name = name  # params keep their exact name, whatever the name scope
    t.scopes = (name, "params")
    g.params[name] = t
    return t


def input(name: str, shape, dtype=torch.float32) -> Tensor:  # noqa: A001 - the DSL's word
    """A value fed at run time (a full tensor, or per-rank slices)."""
    _check_leaf("input", name, dtype)
    g = Graph.current()
    _check_outside_blocks("input", name, g)
    if name in g.params or name in g.inputs:
        raise GraphError(message(f"input('{name}'): the name is already used in graph '{g.name}'.",
                                 rule="param and input names are unique", fix="pick another name"))
    t = apply("input", [], {"shape": as_shape(shape), "dtype": dtype}, name=name)
    t.node.name = name
    t.scopes = (name,)
    g.inputs[name] = t
    return t


__all__ = ["param", "input", "init_value"]


@register
class Placeholder(Param):
    """An input of a sub-graph (a repeat block); its layout is set by the enclosing op."""

    name = "placeholder"


def placeholder(name: str, shape, dtype=torch.float32, scopes: tuple[str, ...] = ()) -> Tensor:
    """A named sub-graph input (used by ``repeat``)."""
    _check_leaf("placeholder", name, dtype)
    t = apply("placeholder", [], {"shape": as_shape(shape), "dtype": dtype}, name=name)
    t.node.name = name
    t.scopes = scopes
    Graph.current().inputs[name] = t
    return t
