"""Optimizer update kernels and the global sum that exact gradient clipping needs.

Each update is one elementwise op over its param's dims with several outputs
(the new param and the new optimizer state), so the generic lowering runs it
on whatever slice the layout gives the param or its state (ZeRO: a slice).
Hyperparameters arrive as scalar tensors (graph inputs, fed every step), so a
learning-rate schedule never recompiles; the kernels read them once per call.

* ``sgd_step``: ``p, g, [buf], lr, momentum, weight_decay, scale`` ->
  ``p', [buf']`` (torch.optim.SGD's rule, no dampening).
* ``adamw_update``: ``p, g, m, v, lr, beta1, beta2, eps, weight_decay, step, scale``
  -> ``p', m', v'`` (decoupled weight decay, bias correction).
* ``scalar_sum``: a sum of scalars that may be partial sums over different mesh
  axes; its lowering reduces each set of axes once (:mod:`meshdsl.lowering.global_sum`).

``scale`` multiplies the gradient first: the clip factor ``min(1, c / norm)``.
"""
from __future__ import annotations

import math

import torch

from ..core.shape import Shape
from ..errors import ShapeError, message
from .elementwise import constant, exp, log, sqrt
from .reduce import reduce_sum
from .registry import ComputeSpec, Op, local_elements, register
from .shape_ops import broadcast_to


def _check(what: str, p, tensors, scalars) -> None:
    for t in tensors:
        if t.shape != p.shape or t.dtype != p.dtype:
            raise ShapeError(message(f"{what}: {t!r} does not match param {p!r}.",
                                     rule="gradients and optimizer state have their param's dims (in order) and dtype",
                                     fix="pass the gradients md.grad returned for these params"))
    for s in scalars:
        if len(s.shape):
            raise ShapeError(message(f"{what}: hyperparameter {s!r} is not a scalar.",
                                     rule="hyperparameters are scalar tensors (graph inputs fed each step)",
                                     fix="use meshdsl.input(name, []) for each hyperparameter"))


class _Update(Op):
    """An elementwise update: outputs shaped like the param (input 0)."""

    num_tensors = 2  # param, gradient, then state tensors; the rest are scalars

    def tensors_of(self, attrs) -> int:
        return self.num_tensors

    def infer(self, inputs, attrs):
        k = self.tensors_of(attrs)
        p = inputs[0]
        _check(self.name, p, inputs[1:k], inputs[k:])
        return [(p.shape, p.dtype)] * (k - 1)

    def spec(self, node):
        return ComputeSpec({d.name: d.size for d in node.inputs[0].shape})

    def flops(self, node, local):
        return 10 * local_elements(node.inputs[0].shape, local)


@register
class SgdStep(_Update):
    """``buf = momentum * buf + g``; ``p - lr * buf`` (no buffer when ``momentum`` is off)."""

    name = "sgd_step"

    def tensors_of(self, attrs):
        return 3 if attrs["momentum"] else 2

    def compute(self, ctx, attrs, p, g, *rest):
        return _sgd(p, g, rest, attrs["momentum"], inplace=False)

    def compute_inplace(self, ctx, attrs, p, g, *rest):
        """The same update written into ``p`` (the executor donates the old param)."""
        return _sgd(p, g, rest, attrs["momentum"], inplace=True)

    def grad(self, node, douts):
        """Reverse mode through ``step = momentum * buf + scale * g + wd * p``, ``p - lr * step``:
        every tensor and hyperparameter input gets its gradient."""
        p, g, *rest = node.inputs
        buf = rest[0] if node.attrs["momentum"] else None
        lr, mom, wd, scale = rest[-4:]
        d_new = _zero_if_none(douts[0], p)
        d_step = d_new * -lr
        if buf is not None:
            d_step = d_step + _zero_if_none(douts[1], p)
        step = node.outputs[1] if buf is not None else g * scale + wd * p
        grads = [d_new + d_step * wd, d_step * scale]
        if buf is not None:
            grads.append(d_step * mom)
        return grads + [reduce_sum(-(d_new * step)), reduce_sum(d_step * buf) if buf is not None else None,
                        reduce_sum(d_step * p), reduce_sum(d_step * g)]


def _sgd(p, g, rest, momentum: bool, inplace: bool):
    """One SGD step; ``rest`` is (buf?, lr, momentum, weight decay, grad scale)."""
    buf = rest[0] if momentum else None
    if _traced(rest[-4:]):
        return _sgd_traced(p, g, buf, rest[-4:], inplace)
    lr, mom, wd, scale = (float(x) for x in rest[-4:])
    g = g * scale if scale != 1.0 else g
    if wd:
        g = g.add(p, alpha=wd)
    step = g if buf is None else buf.mul(mom).add_(g)
    new = p.add_(step, alpha=-lr) if inplace else p.add(step, alpha=-lr)
    return new if buf is None else (new, step)


@register
class AdamwUpdate(_Update):
    """AdamW (Loshchilov & Hutter): decoupled weight decay, bias-corrected moments."""

    name = "adamw_update"
    num_tensors = 4
    donates = (0, 2, 3)

    def compute(self, ctx, attrs, p, g, m, v, *hyper):
        return _adamw(p.clone(), g, m.clone(), v.clone(), hyper)

    def compute_inplace(self, ctx, attrs, p, g, m, v, *hyper):
        """The same update written into ``p``, ``m`` and ``v`` (the executor donates all three)."""
        return _adamw(p, g, m, v, hyper)

    def grad(self, node, douts):
        return _adamw_grad(node.inputs, node.outputs, [_zero_if_none(d, node.inputs[0]) for d in douts])


def _adamw(p, g, m, v, hyper):
    """One AdamW step, in place into ``p``, ``m``, ``v``; ``hyper`` is (lr, beta1, beta2, eps,
    weight decay, step, grad scale).  One fused pass (torch's ``_fused_adamw_``, the kernel
    of ``torch.optim.AdamW(fused=True)``) where torch has it for the dtype, else the same
    rule in separate in-place kernels."""
    if _traced(hyper):
        return _adamw_traced(p, g, m, v, hyper)
    lr, b1, b2, eps, wd, t, scale = (float(x) for x in hyper)
    if scale != 1.0:
        g = g * scale
    # The fused kernel reads its tensors as dense memory, ignoring strides: a gradient can be a
    # strided view (a layer loop's gradients live in their buckets, runtime/layers.py).
    g = g.contiguous()
    # float64 takes the separate kernels: the fused one reads the step count in float32.
    if _FUSED_ADAMW is not None and p.dtype in (torch.float32, torch.bfloat16, torch.float16) \
            and p.is_contiguous() and m.is_contiguous() and v.is_contiguous():
        _FUSED_ADAMW([p], [g], [m], [v], [], [torch.full((), t, device=p.device)], lr=lr, beta1=b1, beta2=b2,
                     weight_decay=wd, eps=eps, amsgrad=False, maximize=False)
        return p, m, v
    m.mul_(b1).add_(g, alpha=1.0 - b1)
    v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
    bc1, bc2 = 1.0 - b1 ** t, 1.0 - b2 ** t
    denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
    if wd:
        p.mul_(1.0 - lr * wd)
    return p.addcdiv_(m, denom, value=-lr / bc1), m, v


_FUSED_ADAMW = getattr(torch, "_fused_adamw_", None)


# -- traced: a whole step compiled (runtime/whole.py) traces the hyperparameters as tensors ------

def _traced(hyper) -> bool:
    """Whether a hyperparameter is a tensor being traced (make_fx or dynamo), whose value
    ``float()`` cannot read: the clip scale, the scheduled lr and the step count are fed per step."""
    if not any(isinstance(x, torch.Tensor) for x in hyper):
        return False
    from torch.fx.experimental.proxy_tensor import get_proxy_mode   # torch's, loaded with make_fx
    return torch.compiler.is_compiling() or get_proxy_mode() is not None


def _sgd_traced(p, g, buf, hyper, inplace: bool):
    """:func:`_sgd`'s rule in tensor math, no branch on a hyperparameter's value."""
    lr, mom, wd, scale = hyper
    g = g * scale + p * wd
    step = g if buf is None else buf.mul(mom).add_(g)
    new = p.sub_(step * lr) if inplace else p - step * lr
    return new if buf is None else (new, step)


def _adamw_traced(p, g, m, v, hyper):
    """:func:`_adamw`'s rule in tensor math, no branch on a hyperparameter's value."""
    lr, b1, b2, eps, wd, t, scale = (torch.as_tensor(x, device=p.device) for x in hyper)  # floats too
    g = g * scale
    m.mul_(b1).add_(g * (1.0 - b1))
    v.mul_(b2).add_(g * g * (1.0 - b2))
    denom = (v.sqrt() / (1.0 - b2 ** t).sqrt()).add_(eps)
    p.mul_(1.0 - lr * wd)
    return p.sub_(m / denom * (lr / (1.0 - b1 ** t))), m, v


def _zero_if_none(d, like):
    return d if d is not None else broadcast_to(constant(0.0, like.dtype, like), like.shape)


def _adamw_grad(inputs, outputs, douts):
    """Reverse mode through AdamW's step, term by term (see :func:`_adamw` for the forward):
    ``m' = b1 m + (1 - b1) s g``, ``v' = b2 v + (1 - b2) (s g)^2``,
    ``p' = p (1 - lr wd) - lr / c1 * m' / (sqrt(v') / sqrt(c2) + eps)`` with ``c = 1 - b ** t``."""
    p, g, m, v, lr, b1, b2, eps, wd, t, scale = inputs
    _, m2, v2 = outputs
    d_new, d_m2, d_v2 = douts
    b1t, b2t = exp(t * log(b1)), exp(t * log(b2))
    c1, c2 = 1.0 - b1t, 1.0 - b2t
    root_v, root_c2 = sqrt(v2), sqrt(c2)
    denom = root_v / root_c2 + eps
    step = m2 / denom                                # p' = p (1 - lr wd) - lr / c1 * step
    d_step = d_new * -(lr / c1)
    d_denom = -(d_step * step) / denom
    d_m2 = d_m2 + d_step / denom
    d_v2 = d_v2 + d_denom / (root_v * root_c2 * 2.0)
    gs = g * scale
    d_gs = d_m2 * (1.0 - b1) + d_v2 * (1.0 - b2) * (gs + gs)
    d_c1 = reduce_sum(d_new * lr * step) / (c1 * c1)
    d_c2 = reduce_sum(-(d_denom * root_v)) / (root_c2 * c2 * 2.0)
    return [d_new * (1.0 - lr * wd), d_gs * scale, d_m2 * b1, d_v2 * b2,
            reduce_sum(-(d_new * (p * wd + step / c1))),
            reduce_sum(d_m2 * (m - gs)) - d_c1 * t * b1t / b1,
            reduce_sum(d_v2 * (v - gs * gs)) - d_c2 * t * b2t / b2,
            reduce_sum(d_denom), reduce_sum(-(d_new * p * lr)),
            -(d_c1 * b1t * log(b1)) - d_c2 * b2t * log(b2), reduce_sum(d_gs * g)]


@register
class ScalarSum(Op):
    """The sum of scalar inputs (sums of squares of gradients, for one global norm)."""

    name = "scalar_sum"
    linear = True

    def infer(self, inputs, attrs):
        for x in inputs:
            if len(x.shape):
                raise ShapeError(message(f"scalar_sum: {x!r} is not a scalar.", rule="scalar_sum adds scalars",
                                         fix="reduce each tensor first, e.g. reduce_sum(g * g)"))
        return [(Shape(), inputs[0].dtype)]

    def compute(self, ctx, attrs, *xs):
        return torch.stack(list(xs)).sum()

    def spec(self, node):
        return ComputeSpec({})

    def grad(self, node, douts):
        return [douts[0]] * len(node.inputs)
