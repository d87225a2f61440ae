"""How every op computes under mixed precision: the one table.

``precision="bf16"`` (see :func:`meshdsl.ir.precision.mixed_precision`) keeps params,
optimizer state and the loss in fp32 and runs the matmul-like ops in bfloat16.  Each
op has one rule here:

* ``"bf16"``: floating inputs are cast down to bfloat16 (a param is read through a
  cast, so its gradient is cast back up and arrives in fp32); the matmul-like ops.
* ``"fp32"``: floating inputs are cast up to fp32 and the output is fp32: softmax
  (and the fused attention, whose softmax is inside it),
  the layer/RMS-norm statistics, sums (``reduce_sum`` accumulates, and reductions
  that produce the loss must not round at every add), the optimizer updates, and the Fourier
  transforms (``torch.fft`` has no 16-bit kernel on the CPU).
* ``"follow"``: the op computes in its floating inputs' dtype, and in bfloat16 as
  soon as one of them is bfloat16 (an fp32 operand, e.g. a bias or the position
  embedding, is cast down).  Elementwise maths, data movement, max/min.  A bf16
  activation stays bf16 through them, so the residual stream and the tensor-parallel
  activation allreduces are bf16.
* ``"none"``: no floating compute to decide (leaves, index ops, explicit casts), or an op
  that decides it itself (batch norm's, :mod:`.batchnorm`): the op is rebuilt as written.

Ops built only by gradients and optimizers (``*_backward``, ``scatter_add``,
``repeat_grad``, the updates) are listed too: their dtype follows from the forward's
casts (the cotangent of a tensor has its dtype), and the rule says what they do then.

Composites that are not one op get their rule from their name scope:
:data:`FP32_SCOPES` (``cross_entropy`` with its logsumexp, ``log_softmax``) compute in fp32.

Gradient reductions are fp32 by construction: a weight's bf16 partial gradient passes
the (linear) cast up to fp32 before any collective sums it, so every gradient
allreduce/reduce-scatter carries fp32.
"""
from __future__ import annotations

import torch

from ..errors import GraphError, message

#: The precisions a training step may compute in.
PRECISIONS = ("fp32", "bf16")

#: The compute dtype of each precision's "bf16"-rule ops.
COMPUTE_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}

_MATMUL = ("einsum", "gather", "conv", "conv_weight_grad")
_FP32 = ("softmax", "softmax_backward", "attention", "attention_backward", "cross_entropy",
         "cross_entropy_backward", "normalize", "normalize_backward", "layer_norm", "layer_norm_backward",
         "rms_norm", "rms_norm_backward", "reduce_sum", "cumsum", "scalar_sum", "sgd_step", "sgd_update",
         "adamw_update", "rfft", "irfft", "fft")
_FOLLOW = ("add", "sub", "mul", "div", "neg", "abs", "exp", "log", "pow", "sqrt", "rsqrt", "tanh", "sin", "cos", "sigmoid",
           "silu", "silu_backward", "relu", "relu_backward", "gelu", "gelu_backward", "gelu_tanh", "gelu_tanh_backward", "maximum", "minimum",
           "where", "dropout", "stop_gradient", "reduce_max", "reduce_min", "top_k", "scatter_add",
           "transpose", "broadcast_to", "rename", "reshape", "rearrange", "squeeze", "slice", "pad", "concat",
           "shift", "flip", "repeat", "repeat_grad", "equal", "not_equal", "greater", "greater_equal", "less",
           "less_equal", "erf", "log1p", "expm1", "square", "reciprocal", "sign", "floor", "ceil", "round",
           "softplus", "log_sigmoid", "leaky_relu", "elu", "mish", "clamp", "argmax", "argmin", "floor_divide", "remainder",
           "logaddexp")
_NONE = ("param", "input", "placeholder", "constant", "cast", "iota", "one_hot", "logical_not", "logical_and",
         "logical_or", "bitwise_xor",
         # batch norm's kernels sum in fp64 and compute in the statistics' dtype whatever x's, and
         # give y and dx x's dtype: a bf16 activation stays bf16, the sums' allreduce stays fp64
         "batch_norm_stats", "batch_norm", "batch_norm_backward_sums", "batch_norm_backward",
         # a split layer norm's row moments (built by the lowering, after this rewrite) compute in
         # the statistics' dtype whatever x's, as the norm's own kernel does (ops/moments.py)
         "part_moments", "sum_moments", "combine_moments")

#: op name -> "bf16" | "fp32" | "follow" | "none" (see the module docstring).
POLICY: dict[str, str] = {**{k: "bf16" for k in _MATMUL}, **{k: "fp32" for k in _FP32},
                          **{k: "follow" for k in _FOLLOW}, **{k: "none" for k in _NONE}}

#: Name scopes whose nodes compute in fp32 whatever their op (composite ops).
FP32_SCOPES = ("cross_entropy", "log_softmax")


def check_precision(precision, where: str) -> str:
    """Return ``precision`` if it is one of :data:`PRECISIONS`.

    Raises:
      GraphError: any other value, with the choices.
    """
    if precision not in PRECISIONS:
        raise GraphError(message(f"{where}: precision={precision!r} is not a known precision.",
                                 inputs=[f"known: {', '.join(PRECISIONS)}"],
                                 rule="fp32 computes everything in fp32; bf16 runs matmuls in bfloat16 "
                                      "with fp32 master weights, optimizer state, loss and gradient sums",
                                 fix="pass precision='fp32' or precision='bf16'"))
    return precision


def rule_for(op_name: str, node_name: str) -> str:
    """The rule of a node of op ``op_name`` named ``node_name`` (scopes included).

    Raises:
      GraphError: an op missing from :data:`POLICY`.
    """
    if any(part in FP32_SCOPES for part in node_name.split("/")[:-1]):
        return "fp32" if POLICY.get(op_name) != "none" else "none"
    rule = POLICY.get(op_name)
    if rule is None:
        raise GraphError(message(f"mixed precision: op '{op_name}' ({node_name}) has no precision rule.",
                                 rule="every op states how it computes under bf16 in meshdsl/ops/precision.py",
                                 fix=f"add '{op_name}' to POLICY there"))
    return rule
