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

    ``params`` may hold any param of the outputs' graph: one they do not read (a batch norm's
    running statistics next to a training loss) is checked, then ignored, as by
    :func:`~meshdsl.run_simulated` and :func:`~meshdsl.check`.

    Raises:
      GraphError: a missing feed, a feed of the wrong shape or dtype, or a feed no input reads;
        a param named that is no param of the outputs' graph, or given in another shape or dtype.
    """
    _check_outputs(outputs)
    prog = DenseProgram(outputs)
    check_no_extra_feeds("run_dense", feeds_dict("run_dense", feeds), prog.inputs)
    check_given_params("run_dense", feeds_dict("run_dense", params, "params"),
                       graph_params(prog.outputs, prog.params))
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


def graph_params(outputs: dict, read: dict) -> dict:
    """Every param of the graph (or graphs) of ``outputs`` (a dict name -> Tensor) by name:
    (shape, dtype), as :attr:`~meshdsl.lowering.plan.Plan.graph_params` keeps them; ``read`` (name
    -> Tensor or plan Value), the params the outputs read, are among them whatever their graph."""
    from ..lowering.compiler import graph_params_of

    return {**graph_params_of(outputs), **{k: (t.shape, t.dtype) for k, t in read.items()}}


def check_given_params(caller: str, params: dict, declared: dict) -> None:
    """Raise one GraphError naming every bad item of ``params`` (param name -> full tensor)
    against ``declared`` (every param of the outputs' graph: name -> (shape, dtype)): a name that
    is no param of the graph (with the closest), a value that is no torch tensor, or one of
    another shape or dtype than its param's.  A param of the graph that the outputs do not read
    (a batch norm's running statistics, next to a training loss) passes, and is then left alone:
    a model's every param may be given (a checkpoint, ``g.params()``'s names) for a part of it."""
    bad = []
    for k, v in params.items():
        if k not in declared:
            bad.append(f"'{k}' is no param of the outputs' graph.{did_you_mean(str(k), declared)}")
            continue
        shape, dtype = declared[k]
        if not isinstance(v, torch.Tensor):
            bad.append(f"param '{k}' is a {type(v).__name__}, not a torch tensor")
        elif tuple(v.shape) != shape.sizes:
            bad.append(f"param '{k}' is of shape {tuple(v.shape)}, not of shape {shape.sizes} ({shape})")
        elif v.dtype != dtype:
            bad.append(f"param '{k}' is {v.dtype}, not {dtype} (its declared dtype)")
    if bad:
        raise GraphError(message(
            f"{caller}: {len(bad)} of the {len(params)} params given by name fit no param of the outputs' graph.",
            inputs=[f"params of the graph: {clip(', '.join(sorted(declared)) or '(none)', 300)}"],
            bullets=bad,
            rule="params are given by the names of md.param in the outputs' graph, each a torch tensor of its "
                 "declared shape (dims in order) and dtype; one the outputs do not read is ignored",
            fix="correct the names, drop what is no param of the graph, and pass each as a tensor of its shape "
                "and dtype (e.g. .to(torch.float32))"))
