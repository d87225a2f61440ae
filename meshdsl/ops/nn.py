"""Neural-network ops: softmax, log_softmax, layer_norm, rms_norm, cross_entropy, dropout.

* ``softmax`` and the normalisation inside ``layer_norm`` / ``rms_norm`` are
  fused primitives (one torch kernel forward, one backward, as torch's autograd
  uses).  Their reduced dim is ``fixed`` in the spec: it must be whole on a
  rank, so the compiler gathers it when it is split (correct, more traffic).
  ``layer_norm`` with a scale and/or bias over its dim alone is one op with its
  affine (:mod:`.layernorm`), ``rms_norm`` one op with its scale over its dim
  (:mod:`.rmsnorm`); otherwise the affine is elementwise mul/add.  Either way
  the parameter gradients, which reduce over the batch dims, lower generically.
* ``log_softmax`` and ``cross_entropy`` stay composites of primitives, so they
  lower on any layout without gathering, e.g. a vocab-split cross-entropy.
* ``dropout`` is a primitive whose mask depends only on the global element
  index and the seed, never on the layout.
"""
from __future__ import annotations

import numbers

import torch

from ..core.graph import Tensor
from ..core.shape import Dim
from ..errors import ShapeError, message
import torch.nn.functional as F

from .elementwise import exp, not_equal, where
from .reduce import reduced_dims, logsumexp, reduce_mean
from .registry import ComputeSpec, Op, apply, register
from .batchnorm import STAT_DIM, fused_batch_norm, running_attrs
from .layernorm import _last, fused_layer_norm
from .rmsnorm import fused_rms_norm
from .shape_ops import transpose
from .xent import fused_cross_entropy


def _name(dim) -> str:
    return dim.name if isinstance(dim, Dim) else dim


def _one_dim(x: Tensor, dim, what: str) -> str:
    if isinstance(dim, (list, tuple)) and len(dim) != 1:
        raise ShapeError(message(
            f"{what}: normalises over one dim; got {len(dim)}: {[_name(d) for d in dim]} of {x!r}.",
            rule=f"{what} takes one dim (md.softmax and md.log_softmax take several)",
            fix="merge them into one first (md.rearrange(x, '... (a b) ...')), or normalise over each in turn; "
                "md.batch_norm(x, dims) normalises over several dims (its scale and bias per value of the others)"))
    (d,) = reduced_dims(x, list(dim) if isinstance(dim, (list, tuple)) else [dim], what)
    return d


def _check_float(what: str, x: Tensor) -> None:
    if not x.dtype.is_floating_point:
        raise ShapeError(message(f"{what}: input {x!r} is {x.dtype}, not floating point.",
                                 rule=f"{what} is defined on floating-point tensors",
                                 fix="cast it first: meshdsl.cast(x, torch.float32)"))


def _like(g: Tensor, x: Tensor) -> Tensor:
    """``g`` with its dims in ``x``'s order (a cotangent may come in any order)."""
    if g.shape.names != x.shape.names:
        from .shape_ops import transpose
        g = transpose(g, x.shape.names)
    return g


class _AlongDim(Op):
    """Base of the fused ops: elementwise over the inputs' dims, ``attrs['dim']`` whole on a rank.

    The first input fixes the dims; later inputs are brought to its dim order
    by the op's builder, so the kernel sees one layout.
    """

    #: rough FLOPs per element, for the cost model
    per_elem = 5

    def infer(self, inputs, attrs):
        x = inputs[-1]
        attrs["pos"] = x.shape.index(attrs["dim"])
        return [(x.shape, x.dtype)]

    def spec(self, node):
        x = node.inputs[-1]
        return ComputeSpec({d.name: d.size for d in x.shape}, fixed=frozenset([node.attrs["dim"]]))

    def flops(self, node, local):
        return self.per_elem * super().flops(node, local)


class _Backward(_AlongDim):
    """(g, saved) -> dx: linear in the cotangent ``g``; no second-order gradient."""

    linear_args = (0,)
    differentiable = False


@register
class Softmax(_AlongDim):
    name = "softmax"

    def compute(self, ctx, attrs, x):
        return torch.softmax(x, dim=attrs["pos"])

    def grad(self, node, douts):
        y = node.outputs[0]
        return [apply("softmax_backward", [_like(douts[0], y), y], {"dim": node.attrs["dim"]})]


@register
class SoftmaxBackward(_Backward):
    name = "softmax_backward"

    def compute(self, ctx, attrs, g, y):
        return torch._softmax_backward_data(g, y, attrs["pos"], y.dtype)


def _layer_norm_stats(x, eps):
    n = x.shape[-1]
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [n], None, None, eps)
    return n, mean, rstd


@register
class Normalize(_AlongDim):
    """``(x - mean(x)) * rsqrt(var(x) + eps)`` over ``dim`` (layer norm without affine)."""

    name = "normalize"
    per_elem = 8

    def compute(self, ctx, attrs, x):
        eps = attrs["eps"]
        return _last(lambda v: F.layer_norm(v, (v.shape[-1],), eps=eps), attrs["pos"], x)

    def grad(self, node, douts):
        x = node.inputs[0]
        return [apply("normalize_backward", [_like(douts[0], x), x], dict(node.attrs))]


@register
class NormalizeBackward(_Backward):
    name = "normalize_backward"
    per_elem = 10

    def compute(self, ctx, attrs, g, x):
        eps = attrs["eps"]

        def bwd(g, x):
            n, mean, rstd = _layer_norm_stats(x, eps)
            return torch.ops.aten.native_layer_norm_backward(g, x, [n], mean, rstd, None, None,
                                                             [True, False, False])[0]
        return _last(bwd, attrs["pos"], g, x)


def softmax(x: Tensor, dim) -> Tensor:
    """Softmax along ``dim`` (one fused kernel; ``dim`` is gathered if it is split).

    ``dim`` may be a list of dims: one softmax over all of them at once (the keys of several
    retrieved passages, ``["nbrs", "nlen"]``), ``exp(x - logsumexp(x, dims))``, whose max and
    sum reduce a split dim in place.
    """
    _check_float("softmax", x)
    dims = reduced_dims(x, dim, "softmax") if dim is not None else (_one_dim(x, dim, "softmax"),)
    if len(dims) == 1:
        return apply("softmax", [x], {"dim": dims[0]})
    with x.graph.scope("softmax"):
        return exp(x - logsumexp(x, list(dims)))


def log_softmax(x: Tensor, dim) -> Tensor:
    """Log-softmax along ``dim`` (or a list of dims, normalised together)."""
    with x.graph.scope("log_softmax"):
        return x - logsumexp(x, _name(dim))


def _check_affine(what: str, x: Tensor, **params) -> None:
    """A norm's scale/bias may only use dims of ``x`` (else it would silently broadcast ``x``)."""
    for role, p in params.items():
        if p is not None and any(n not in x.shape for n in p.shape.names):
            extra = [n for n in p.shape.names if n not in x.shape]
            raise ShapeError(message(f"{what}: {role} {p!r} has dim(s) {extra} that {x!r} lacks.",
                                     rule=f"the {role} is shaped by dims of the normalised tensor",
                                     fix=f"give the {role} dims from {list(x.shape.names)}"))


def layer_norm(x: Tensor, dim, scale: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5) -> Tensor:
    """Layer norm over ``dim`` with optional ``scale`` and ``bias`` (as ``torch.nn.LayerNorm``).

    Args:
      x: a float tensor.
      dim: the dim normalized over (a name or a Dim), e.g. ``"d_model"``.
      scale, bias: params shaped ``[dim]`` (stacked per layer, ``[layer, d_model]``, a block reads
        each layer's ``[d_model]``); None leaves that term out.
      eps: added to the variance (default 1e-5, torch's).

    Returns:
      A tensor with ``x``'s dims.
    """
    _check_affine("layer_norm", x, scale=scale, bias=bias)
    _check_float("layer_norm", x)
    d = _one_dim(x, dim, "layer_norm")
    given = [t for t in (scale, bias) if t is not None]
    if given and all(t.shape.names == (d,) for t in given):
        return fused_layer_norm(x, d, scale, bias, eps)
    with x.graph.scope("layer_norm"):
        y = apply("normalize", [x], {"dim": d, "eps": float(eps)})
        if scale is not None:
            y = y * scale
        if bias is not None:
            y = y + bias
        return y


def batch_norm(x: Tensor, dims, scale: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5, stats: bool = False, running=None, momentum: float = 0.1):
    """Batch norm: ``x`` normalised over ``dims`` per value of its other dims (the features),
    with the batch statistics (as ``torch.nn.BatchNorm2d`` in training).

    Where a layout splits ``dims`` (``batch:data``, a spatial split, several axes) each rank
    sums its slice and ONE allreduce combines the sums (fp64 ``[sum x, sum x^2]``); the backward
    sends ONE more (``[sum g, sum g * x_hat]``), whose rows are also the bias's and the scale's
    gradients.  Over dims other than the batch it is a normalisation over several dims (a
    GroupNorm-like norm: its affine then elementwise, ``batch_norm(x, ["cpg", "h", "w"]) * s + b``).

    Args:
      x: a float tensor, e.g. ``[batch, height, width, hidden]``.
      dims: the dims normalised over (names or Dims), e.g. ``["batch", "height", "width"]``.
      scale, bias: params shaped by ``x``'s other dims (``[hidden]``; stacked per layer,
        ``[layer, hidden]``, a block reads each layer's); None leaves that term out.
      eps: added to the variance (default 1e-5, torch's).
      stats: also return the batch ``mean`` and biased ``var`` (per feature), for running
        statistics kept by ``md.Model(updates=...)`` (docs/guide/training.md).
      running: ``(mean, var)``, two frozen params of the features (``md.param``, left out of the
        Model's params; ``init='zeros'`` and ``'ones'``) kept as ``torch.nn.BatchNorm2d`` keeps its
        running statistics: the training step sets them (``(1 - momentum) * old + momentum *
        batch``, the variance unbiased) and eval mode (a run's evals, ``meshdsl eval``,
        ``md.evaluate``, ``md.generate``) normalises with them.  Not inside ``md.repeat``.
      momentum: how far the running statistics move each step (default 0.1, torch's).

    Returns:
      ``y`` with ``x``'s dims, or ``(y, mean, var)`` when ``stats``.

    Raises:
      ShapeError: a dim ``x`` lacks, no dim or every dim to normalise over, a non-float ``x``,
        a scale/bias not shaped by ``x``'s other dims, a bad ``running``/``momentum``/``eps``.
    """
    what = "batch_norm"
    _check_float(what, x)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < float("inf"):
        raise ShapeError(message(f"{what}: eps={eps!r} is not a finite number >= 0.",
                                 rule="eps is added to the variance before its square root",
                                 fix="pass e.g. eps=1e-5 (torch's default)"))
    names = reduced_dims(x, dims, what) if dims is not None else None
    if STAT_DIM in x.shape:
        raise ShapeError(message(f"{what}: {x!r} has a dim '{STAT_DIM}', the name batch_norm's statistics use.",
                                 rule=f"'{STAT_DIM}' holds batch_norm's [sum, sum of squares] rows",
                                 fix=f"rename it first: md.rename(x, {STAT_DIM}='...')"))
    if not names or len(names) == len(x.shape):
        raise ShapeError(message(
            f"{what}: dims={dims!r} of {x!r} leave no feature to normalise per."
            if names else f"{what}: dims={dims!r}: no dim to normalise over in {x!r}.",
            inputs=[f"x: {x.shape}"],
            rule=f"{what} normalises over some of x's dims per value of the others",
            fix="name the batch (and spatial) dims, e.g. ['batch', 'height', 'width']; over every dim, "
                "write (x - reduce_mean(x)) * rsqrt(...) or layer_norm"))
    features = x.shape.without(names)
    params = []
    for role, p in (("scale", scale), ("bias", bias)):
        if p is None:
            params.append(None)
            continue
        if not isinstance(p, Tensor) or set(p.shape.names) != set(features.names):
            raise ShapeError(message(
                f"{what}: {role} {p!r} must have the dims of {x!r} not normalised over.",
                inputs=[f"x: {x.shape}", f"dims: {list(names)}", f"{role}: {getattr(p, 'shape', p)}"],
                rule=f"the {role} holds one value per feature: x's dims but {list(names)}",
                fix=f"give the {role} dims {list(features.names)} (a scale over other dims: multiply after)"))
        params.append(p if p.shape.names == features.names else transpose(p, features.names))
    y, mean, var = fused_batch_norm(x, names, params[0], params[1], eps,
                                    running_attrs(what, x, features, running, momentum))
    return (y, mean, var) if stats else y


def rms_norm(x: Tensor, dim, scale: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """RMS norm over ``dim`` with an optional ``scale``: ``x / sqrt(mean(x ** 2) + eps) * scale``.

    Args:
      x: a float tensor.
      dim: the dim normalized over (a name or a Dim), e.g. ``"d_model"``.
      scale: a param shaped ``[dim]`` (init ``"ones"``), or None.
      eps: added to the mean square (default 1e-6, as Llama's).

    Returns:
      A tensor with ``x``'s dims.
    """
    _check_affine("rms_norm", x, scale=scale)
    _check_float("rms_norm", x)
    d = _one_dim(x, dim, "rms_norm")
    if scale is None or (scale.shape.names == (d,) and scale.dtype == x.dtype):
        return fused_rms_norm(x, d, scale, eps)
    with x.graph.scope("rms_norm"):   # a scale over other dims too: an elementwise product
        return fused_rms_norm(x, d, None, eps) * scale


def cross_entropy(logits: Tensor, labels: Tensor, dim, label_smoothing: float = 0.0,
                  ignore_index: int | None = None) -> Tensor:
    """Per-example cross-entropy of integer ``labels`` under ``logits`` along ``dim``
    (``torch.nn.functional.cross_entropy(..., reduction="none")``).

    One fused op (:mod:`.xent`): torch's kernel forward and backward where ``dim`` is
    whole on a rank, the composite of the same math where a layout splits it.

    Args:
      logits, labels: float scores and integer labels in ``[0, classes)``, labels with the
        logits' dims but ``dim``.
      dim: the class dim (a name or a Dim).
      label_smoothing: ``eps`` in ``[0, 1]``: the target is ``1 - eps`` on the label plus
        ``eps / classes`` on every class, as torch's: ``(1 - eps) * ce + eps * (logsumexp(logits)
        - mean(logits))``.
      ignore_index: a label value (torch's -100) whose examples get a loss of 0 and no gradient.

    Returns a tensor with ``labels``' dims; take ``reduce_mean`` for the loss (with
    ``ignore_index``, divide the sum by the number of kept labels, as torch's mean does).
    """
    d = _name(dim)
    _check_xent_options(label_smoothing, ignore_index)
    if labels.shape != logits.shape.without([d]):
        raise ShapeError(message(
            f"cross_entropy: labels {labels.shape} must have the logits' dims minus '{d}' "
            f"({logits.shape.without([d])}).", rule="one label per example, indexing dim '" + d + "'",
            fix="rename or transpose the labels"))
    if not logits.dtype.is_floating_point:
        raise ShapeError(message(f"cross_entropy: logits {logits!r} are {logits.dtype}, not floating point.",
                                 rule="logits are real-valued scores along '" + d + "'",
                                 fix="pass the float scores (md.cast(logits, torch.float32)), the labels second"))
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ShapeError(message(f"cross_entropy: labels {labels!r} are {labels.dtype}.",
                                 rule="labels are integer class indices along '" + d + "'",
                                 fix="make them torch.int64 (md.input(name, shape, dtype=torch.int64), or md.cast)"))
    keep = None if ignore_index is None else not_equal(labels, ignore_index)
    ce = fused_cross_entropy(logits, labels if keep is None else where(keep, labels, 0), d)
    if label_smoothing:
        with logits.graph.scope("label_smoothing"):
            spread = logsumexp(logits, d) - reduce_mean(logits, d)
            ce = ce * (1.0 - label_smoothing) + spread * label_smoothing
    return ce if keep is None else where(keep, ce, 0.0)


def _check_xent_options(label_smoothing, ignore_index) -> None:
    """Raise a ShapeError for a label smoothing outside [0, 1] or an ignore_index that is no int."""
    bad = []
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) \
            or not 0.0 <= label_smoothing <= 1.0:
        bad.append(f"label_smoothing={label_smoothing!r} is not a number in [0, 1]")
    if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, int)):
        bad.append(f"ignore_index={ignore_index!r} is not an int")
    if bad:
        raise ShapeError(message("cross_entropy: bad option.", bullets=bad,
                                 rule="label_smoothing is a fraction in [0, 1]; ignore_index is a label value "
                                      "(an int, such as -100) whose examples are left out",
                                 fix="e.g. md.cross_entropy(logits, labels, 'vocab', label_smoothing=0.1, "
                                     "ignore_index=-100)"))


def _hash_uniform(shape_full, ctx, local_shape, names, seed: int, device=None) -> torch.Tensor:
    """Uniform [0,1) numbers from a 32-bit integer hash of each element's global index, on ``device``."""
    idx = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for i in reversed(range(len(names))):
        n = local_shape[i]
        ar = torch.arange(ctx.offset(names[i]), ctx.offset(names[i]) + n, dtype=torch.int64, device=device) * stride
        view = [1] * len(names)
        view[i] = n
        idx = idx + ar.view(view)
        stride *= shape_full[i]
    m = 0xFFFFFFFF
    h = (idx ^ ((seed * 0x9E3779B1 + 0x7F4A7C15) & m)) & m
    for _ in range(2):
        h = (((h >> 16) ^ h) * 0x45D9F3B) & m
    h = ((h >> 16) ^ h) & m
    return h.to(torch.float64).div_(4294967296.0).to(torch.float32)


#: the kernel salt of one training step spans this many layer salts (layer ``l`` of a
#: repeat adds ``l + 1``), so every (step, layer) pair draws its own dropout mask.
STEP_SALT = 1 << 20


def step_salt(step: int) -> int:
    """The salt a training step's run passes to its kernels (see :data:`STEP_SALT`)."""
    return step * STEP_SALT


@register
class Dropout(Op):
    name = "dropout"
    linear = True
    reads_salt = True

    def infer(self, inputs, attrs):
        (x,) = inputs
        attrs["names"] = x.shape.names
        attrs["full"] = x.shape.sizes
        return [(x.shape, x.dtype)]

    def compute(self, ctx, attrs, x):
        seed = attrs["seed"] + 1000003 * ctx.salt
        u = _hash_uniform(attrs["full"], ctx, x.shape, attrs["names"], seed, x.device)
        keep = (u >= attrs["rate"]).to(x.dtype)
        return x * keep * (1.0 / (1.0 - attrs["rate"]))

    def grad(self, node, douts):
        g = douts[0]
        if g.shape.names != node.inputs[0].shape.names:
            from .shape_ops import transpose
            g = transpose(g, node.inputs[0].shape.names)
        return [apply("dropout", [g], dict(node.attrs))]


def dropout(x: Tensor, rate: float, seed: int = 0) -> Tensor:
    """Zero each element with probability ``rate`` and scale the rest by 1/(1-rate).

    The mask is a function of the element's global index and ``seed`` only, so
    every layout and process count drops the same elements.
    """
    if not x.dtype.is_floating_point:
        raise ShapeError(message(f"dropout: {x!r} is {x.dtype}, not floating point.",
                                 rule="dropout scales the kept elements by 1/(1-rate)", fix="cast it to a float dtype"))
    number = isinstance(rate, numbers.Real) and not isinstance(rate, bool)
    if not number or not 0.0 <= rate < 1.0:
        shown = f"{rate} is not in [0, 1)" if number else f"{rate!r} ({type(rate).__name__}) is not a number"
        raise ShapeError(message(f"dropout: rate {shown}.",
                                 rule="the rate is a Python number, 0 <= rate < 1",
                                 fix="pass a rate such as 0.1"))
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ShapeError(message(f"dropout: seed {seed!r} ({type(seed).__name__}) is not an int.",
                                 rule="the mask is a function of each element's index and an int seed",
                                 fix="pass seed=0, or another int per dropout site"))
    if rate == 0.0:
        return x
    return apply("dropout", [x], {"rate": float(rate), "seed": int(seed)})


__all__ = ["softmax", "log_softmax", "layer_norm", "rms_norm", "cross_entropy", "dropout"]
