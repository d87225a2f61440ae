"""Mixed precision as a graph transform: rebuild a loss with bf16 compute.

:func:`mixed_precision` replays the nodes a loss depends on into the same graph,
following each op's rule in :mod:`meshdsl.ops.precision`: a cast goes in front of
every input whose dtype the rule changes.  Params and inputs are reused as they are,
so the params stay fp32 master weights; a repeat's block is replayed the same way
inside its own sub-graph.  The rebuilt loss is differentiated as usual: a cast's
gradient casts the cotangent back to the input's dtype, so each param's gradient is
fp32 and its reduction sums in fp32.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ..core.graph import Graph, Tensor, topo_nodes
from ..errors import GraphError, message
from ..ops.elementwise import cast, constant
from ..ops.precision import COMPUTE_DTYPE, check_precision, rule_for
from .replay import replay

# (graph uid, id(loss), precision) -> (loss, rebuilt loss), the most recent 64.
_REBUILT: OrderedDict = OrderedDict()


def mixed_precision(loss: Tensor, precision: str = "bf16") -> Tensor:
    """The loss rebuilt to compute in ``precision`` (``loss`` itself for ``"fp32"``).

    Built once per (loss, precision): a second call returns the same tensor.

    Args:
      loss: a floating-point scalar Tensor.
      precision: ``"fp32"`` or ``"bf16"``.

    Returns:
      An fp32 scalar Tensor of the same graph, reading the same params and inputs.

    Raises:
      GraphError: an unknown precision, a loss that is not a Tensor, or an op
        without a precision rule.
    """
    check_precision(precision, "mixed_precision")
    if not isinstance(loss, Tensor):
        raise GraphError(message(f"mixed_precision: loss is {loss!r} ({type(loss).__name__}), not a Tensor.",
                                 rule="mixed precision rebuilds a graph's loss",
                                 fix="pass the loss Tensor"))
    if precision == "fp32":
        return loss
    key = (loss.graph.uid, id(loss), precision)
    hit = _REBUILT.get(key)
    if hit is not None and hit[0] is loss:
        _REBUILT.move_to_end(key)
        return hit[1]
    env: dict[int, Tensor] = {}
    with loss.graph:  # leaves without inputs (constants, masks) are rebuilt into the loss's graph
        replay(topo_nodes([loss]), env, _rule(COMPUTE_DTYPE[precision]))
        out = env[id(loss)]
        if out.dtype != loss.dtype:
            out = cast(out, loss.dtype)
    _REBUILT[key] = (loss, out)
    if len(_REBUILT) > 64:
        _REBUILT.popitem(last=False)
    return out


def _cast(t: Tensor, dtype: torch.dtype, casts: dict) -> Tensor:
    """``t`` in ``dtype``: one cast node per (tensor, dtype), shared by its readers.

    A scalar constant is rebuilt in ``dtype`` instead: kernels broadcast it to a
    full-rank tensor, and torch would then promote a bf16 operand to its fp32.
    """
    if t.dtype == dtype or not t.dtype.is_floating_point:
        return t
    key = (id(t), dtype, id(Graph.current()))   # (a block's casts are its own, as it is traced)
    if key not in casts:
        if t.node.op.name == "constant" and not t.shape:  # a tensor constant is cast like any tensor
            casts[key] = constant(t.node.attrs["value"], dtype)
        else:
            casts[key] = cast(t, dtype)
    return casts[key]


def _target(n, ins: list[Tensor], low: torch.dtype) -> torch.dtype | None:
    """The dtype node ``n`` computes in (None: leave its inputs as they are)."""
    rule = rule_for(n.op.name, n.name)
    if rule == "bf16":
        return low
    if rule == "fp32":
        return torch.float32
    if rule == "follow":
        floats = {t.dtype for t in ins if t.dtype.is_floating_point and t.node.op.name != "constant"}
        if low in floats:  # a low-precision activation keeps its dtype; fp32 operands are cast down
            return low
        return next(iter(floats)) if len(floats) == 1 else None
    return None


def _rule(low: torch.dtype):
    """:func:`~.replay.replay`'s rule for compute in ``low``: a cast in front of every input whose
    dtype the op's precision rule changes (one cast per tensor and dtype, shared by its readers)."""
    casts: dict = {}

    def rule(n, ins):
        target = _target(n, ins, low)
        return ([_cast(t, target, casts) for t in ins] if target is not None else ins), None
    return rule
