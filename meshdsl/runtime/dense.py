"""The dense reference executor: the whole program on one device, no mesh.

It is the oracle every layout is compared to.  The graph is flattened once
into kernel calls by :class:`~meshdsl.ir.interpret.DenseProgram`.
"""
from __future__ import annotations

import torch

from ..core.graph import Tensor
from ..errors import GraphError, clip, did_you_mean, message
from ..ir.interpret import DenseProgram, feeds_dict, outputs_dict


def check_no_extra_feeds(caller: str, feeds: dict, inputs) -> None:
    """Raise a GraphError naming every feed that is not one of ``inputs``.

    A feed no input reads is almost always a typo or a stale name; ignoring it
    would run the program on something other than what the caller meant.
    """
    extra = sorted(k for k in feeds if k not in inputs)
    if extra:
        raise GraphError(message(
            f"{caller}: {len(extra)} feed(s) match no input of the program.",
            inputs=[f"inputs read: {sorted(inputs) or '(none)'}", f"fed: {sorted(feeds)}"],
            bullets=[f"'{k}' is not an input.{did_you_mean(k, list(inputs))}" for k in extra],
            rule="every feed names an input that the outputs read",
            fix="drop the extra feeds or correct their names"))


def run_dense(outputs, feeds: dict | None = None, params: dict | None = None,
              seed: int = 0) -> dict[str, torch.Tensor]:
    """Evaluate ``outputs`` densely.  Params default to their deterministic init (``seed``).

    Raises:
      GraphError: a missing feed, a feed of the wrong shape or dtype, or a feed no input reads.
    """
    _check_outputs(outputs)
    prog = DenseProgram(outputs)
    check_no_extra_feeds("run_dense", feeds_dict("run_dense", feeds), prog.inputs)
    _check_params(prog, feeds_dict("run_dense", params, "params"))
    return prog(feeds, params, seed)


def _check_outputs(outputs) -> None:
    """run_dense's outputs: a Tensor, or a dict or sequence of Tensors."""
    known = isinstance(outputs, (Tensor, dict, list, tuple))
    items = outputs_dict(outputs) if known else {"outputs": outputs}
    bad = [(k, t) for k, t in items.items() if not isinstance(t, Tensor)]
    if bad:
        k, t = bad[0]
        raise GraphError(message(f"run_dense: output '{k}' is {clip(repr(t), 80)} ({type(t).__name__}), not a Tensor.",
                                 rule="outputs are a meshdsl Tensor, or a dict (or list) of them",
                                 fix="pass the Tensors returned by ops, e.g. {'loss': loss}"))


def _check_params(prog: DenseProgram, params: dict) -> None:
    """Each given param the outputs read is a tensor of its declared shape (a param they do not
    read is left alone, as a model's full set of params may be given for a part of it)."""
    for k, v in params.items():
        t = prog.params.get(k)
        if t is not None and (not isinstance(v, torch.Tensor) or tuple(v.shape) != t.shape.sizes):
            got = f"of shape {tuple(v.shape)}" if isinstance(v, torch.Tensor) else f"a {type(v).__name__}"
            raise GraphError(message(f"run_dense: param '{k}' is {got}, not of shape {t.shape.sizes} ({t.shape}).",
                                     rule="a full param has its declared shape, dims in order",
                                     fix=f"pass a torch tensor of shape {t.shape.sizes}"))
