"""The dense reference executor: the whole program on one device, no mesh.

It is the oracle every layout is compared to.  The graph is flattened once
into kernel calls by :class:`~meshdsl.ir.interpret.DenseProgram`.
"""
from __future__ import annotations

import torch

from ..errors import GraphError, did_you_mean, message
from ..ir.interpret import DenseProgram


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
    prog = DenseProgram(outputs)
    check_no_extra_feeds("run_dense", feeds or {}, prog.inputs)
    return prog(feeds, params, seed)
