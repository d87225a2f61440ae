"""Every op of the DSL, re-exported.  Importing this package fills the op table
and gives tensors their operators (``x + y`` is :func:`add`)."""
import sys as _sys

from ..core.graph import set_operators as _set_operators
from .attention import attention
from .einsum import einsum
from .constant import constant
from .conv import conv
from .elementwise import bitwise_xor, floor_divide, logaddexp, remainder
from .elementwise import (abs, add, cast, ceil, cos, div, equal, erf, exp, expm1, floor, gelu, greater,
                          greater_equal, less, less_equal, log, log1p, logical_and, logical_not, logical_or,
                          maximum, minimum, mul, neg, not_equal, pow, reciprocal, relu, round, rsqrt, sigmoid,
                          sign, silu, sin, sqrt, square, stop_gradient, sub, tanh, where)
from .activations import clamp, elu, leaky_relu, log_sigmoid, mish, softplus
from .argmax import argmax, argmin
from .flip import flip
from .fourier import fft, fft2, ifft, ifft2, irfft, rfft
from .embed import arange, causal_mask, gather, iota, one_hot, scatter_add
from .leaf import input, param, placeholder
from . import optim as _optim  # noqa: F401  (registers the optimizer update ops)
from .pool import avg_pool, max_pool
from .resample import upsample
from .nn import batch_norm, cross_entropy, dropout, layer_norm, log_softmax, rms_norm, softmax
from . import xent as _xent  # noqa: F401  (registers the fused cross-entropy ops)
from .reduce import logsumexp, reduce_max, reduce_mean, reduce_min, reduce_sum
from .registry import OPS
from .scan import cumsum, squeeze, unsqueeze
from .shape_ops import broadcast_to, rearrange, rename, reshape, transpose
from .slicing import concat, pad, roll, shift, slice_
from .topk import top_k

# The ops, not the submodules that hold them (``md.embed`` or ``md.reduce`` is no op: an unknown name).
__all__ = [n for n in dir() if not n.startswith("_") and not isinstance(globals()[n], type(_sys))]
# A number or a torch tensor where an op takes a Tensor: one clear error (ops/arguments.py).
from .arguments import check_tensor_args as _check_tensor_args  # noqa: E402
for _n in __all__:
    globals()[_n] = _check_tensor_args(globals()[_n])
_set_operators(_sys.modules[__name__])
