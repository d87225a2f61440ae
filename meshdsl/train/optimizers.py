"""Optimizers that build their update into the training graph: SGD, AdamW, Adafactor.

An optimizer adds, per param ``k``, its state tensors as zero-initialised
params named ``opt/<k>/<slot>`` (carried between steps like params, never
differentiated) and an update producing ``new/<k>`` and ``new/opt/<k>/<slot>``.
Hyperparameters are scalar graph inputs ``opt/<name>`` fed every step
(:meth:`Optimizer.feeds`), so a changed learning rate never recompiles.

Layout scopes: a state tensor has the scopes ``(<k>, "opt", "params")`` and a
gradient ``(<k>, "grads", "params")``, so the most specific rule wins: a rule
naming the param, then an ``opt.``/``grads.`` rule, then a ``params.`` rule,
then a global one.  ``"batch:data; opt.d_model:data"`` is ZeRO-1.
"""
from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..core.graph import Graph, Tensor
from ..errors import MeshDSLError, message
from ..ops import elementwise as ew
from ..ops.leaf import input as input_
from ..ops.leaf import param
from ..ops.reduce import reduce_mean, reduce_sum
from ..ops.registry import apply
from ..ops.shape_ops import transpose


def state_param(p: Tensor, slot: str, shape=None) -> Tensor:
    """The zero-initialised state tensor ``opt/<p>/<slot>`` (one per graph: built once)."""
    g = p.graph
    name = f"opt/{p.name}/{slot}"
    t = g.params.get(name)
    if t is None:
        with g:
            t = param(name, list(shape if shape is not None else p.shape), init="zeros", dtype=p.dtype)
        t.scopes = (p.name, "opt", "params")
    return t


def hyper(g: Graph, name: str, dtype=torch.float32) -> Tensor:
    """The scalar graph input ``opt/<name>`` (one per graph)."""
    key = f"opt/{name}"
    t = g.inputs.get(key)
    if t is None:
        with g:
            t = input_(key, [], dtype)
    return t


class OptimizerError(MeshDSLError):
    """An optimizer built with a hyperparameter outside its range."""


def _check_ranges(opt, ranges: dict) -> None:
    """Raise OptimizerError naming every hyperparameter outside its range ``(test, text)``."""
    bad = [f"{k}={getattr(opt, k)!r}: {text}" for k, (ok, text) in ranges.items() if not ok(getattr(opt, k))]
    if bad:
        raise OptimizerError(message(f"{type(opt).__name__}: invalid hyperparameters.", bullets=bad,
                                     rule="learning rates, decays and eps are finite numbers in their ranges",
                                     fix=f"e.g. {type(opt).__name__}()'s defaults"))


def _num(lo, hi=math.inf, lo_open=False, hi_open=False):
    def ok(x):
        return (isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                and (x > lo if lo_open else x >= lo) and (x < hi if hi_open else x <= hi))
    return ok


_LR = (_num(0.0), "a finite number >= 0")
_DECAY = (_num(0.0), "a finite number >= 0")


class Optimizer(ABC):
    """Base: :meth:`update` builds the graph, :meth:`feeds` gives the step's hyperparameters."""

    name = "optimizer"
    lr: float

    def graph_key(self) -> tuple:
        """What the update graph depends on (hyperparameters fed at run time do not count)."""
        return (self.name,)

    def state_key(self) -> tuple:
        """What the set of state tensors depends on: a checkpoint's state continues only
        under an optimizer with the same key."""
        return (self.name,)

    def settings(self) -> dict:
        """The hyperparameters other than ``lr``, as JSON (what a checkpoint records)."""
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
                for f in dataclasses.fields(self) if f.name != "lr"}

    @abstractmethod
    def hparams(self) -> tuple[str, ...]:
        """Names of the scalar hyperparameter inputs the update reads."""

    def feeds(self, step: int, lr: float | None = None) -> dict[str, torch.Tensor]:
        """The hyperparameter feeds of (0-based) step ``step``, with ``lr`` overriding ``self.lr``."""
        vals = self._values(step + 1, self.lr if lr is None else float(lr))
        return {f"opt/{k}": torch.tensor(float(vals[k])) for k in self.hparams()}

    @abstractmethod
    def _values(self, t: int, lr: float) -> dict[str, float]:
        """Each hyperparameter's value at 1-based step ``t`` with learning rate ``lr``."""

    def update(self, params: dict[str, Tensor], grads: dict[str, Tensor], scale: Tensor
               ) -> dict[str, Tensor]:
        """``{"new/<k>": param', "new/opt/<k>/<slot>": state'}`` for every param."""
        out = {}
        for k, p in params.items():
            g = p.graph
            hp = [hyper(g, h, p.dtype) for h in self.hparams()]
            with g.in_phase("update"):
                res = self._update_one(p, grads[k], hp, scale)
            for slot, t in res.items():
                name = f"new/{k}" if slot == "" else f"new/opt/{k}/{slot}"
                t.scopes = p.scopes if slot == "" else state_param(p, slot).scopes
                out[name] = t
        return out

    @abstractmethod
    def _update_one(self, p, g, hp, scale) -> dict[str, Tensor]:
        """Slot -> updated tensor for one param (slot ``""`` is the param itself)."""


@dataclass
class SGD(Optimizer):
    """SGD with optional momentum and (coupled) weight decay, as ``torch.optim.SGD``.

    Args:
      lr: learning rate (a default; each step may pass its own).
      momentum: 0 for plain SGD (no state); else a momentum buffer per param.
      weight_decay: L2 penalty added to the gradient.
    """

    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    name = "sgd"

    def __post_init__(self):
        _check_ranges(self, {"lr": _LR, "momentum": (_num(0.0), "a finite number >= 0"),
                             "weight_decay": _DECAY})

    def graph_key(self):
        return (self.name, bool(self.momentum))

    def state_key(self):
        return self.graph_key()    # a momentum buffer only with momentum

    def hparams(self):
        return ("lr", "momentum", "weight_decay")

    def _values(self, t, lr):
        return {"lr": lr, "momentum": self.momentum, "weight_decay": self.weight_decay}

    def _update_one(self, p, g, hp, scale):
        mom = bool(self.momentum)
        ins = [p, g] + ([state_param(p, "momentum_buffer")] if mom else []) + hp + [scale]
        res = apply("sgd_step", ins, {"momentum": mom}, name=f"new/{p.name}")
        if not mom:
            return {"": res}
        return {"": res[0], "momentum_buffer": res[1]}


@dataclass
class AdamW(Optimizer):
    """AdamW: decoupled weight decay and bias-corrected moments, one fused kernel per param.

    Args:
      lr: learning rate (a default; each step may pass its own).
      betas: decay rates of the first and second moments.
      eps: added to the denominator.
      weight_decay: decoupled decay, ``p *= 1 - lr * weight_decay``.
    """

    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    name = "adamw"

    def __post_init__(self):
        b = self.betas
        ok = isinstance(b, (tuple, list)) and len(b) == 2 and all(_num(0.0, 1.0, hi_open=True)(x) for x in b)
        _check_ranges(self, {"lr": _LR, "betas": (lambda _: ok, "two numbers in [0, 1)"),
                             "eps": (_num(0.0, lo_open=True), "a finite number > 0"), "weight_decay": _DECAY})
        self.betas = tuple(float(x) for x in b)

    def hparams(self):
        return ("lr", "beta1", "beta2", "eps", "weight_decay", "step")

    def _values(self, t, lr):
        return {"lr": lr, "beta1": self.betas[0], "beta2": self.betas[1], "eps": self.eps,
                "weight_decay": self.weight_decay, "step": t}

    def _update_one(self, p, g, hp, scale):
        m, v = state_param(p, "exp_avg"), state_param(p, "exp_avg_sq")
        new, m2, v2 = apply("adamw_update", [p, g, m, v, *hp, scale], name=f"new/{p.name}")
        return {"": new, "exp_avg": m2, "exp_avg_sq": v2}


@dataclass
class Adafactor(Optimizer):
    """Adafactor (Shazeer & Stern, 2018) with a fixed learning rate.

    Params with two or more dims keep factored second moments over their last two
    dims (a row and a column statistic, ``exp_avg_sq_row``/``_col``); others keep a
    full one.  Per step ``t``: ``beta2_t = 1 - t ** beta2_decay``; the moments
    follow ``g * g + eps``; the update ``g / sqrt(v)`` is divided by
    ``max(1, rms(update) / clip_threshold)``; then ``p = p * (1 - lr * wd) - lr * update``.
    Built from named-tensor ops, so its row/column means reduce over whatever
    axes the layout splits them on.

    Args:
      lr: learning rate.
      beta2_decay: exponent of the second-moment decay schedule (negative).
      eps: added to the squared gradient.
      clip_threshold: the update's RMS bound.
      weight_decay: decoupled decay.
    """

    lr: float = 1e-2
    beta2_decay: float = -0.8
    eps: float = 1e-30
    clip_threshold: float = 1.0
    weight_decay: float = 0.0
    name = "adafactor"

    def __post_init__(self):
        _check_ranges(self, {"lr": _LR, "beta2_decay": (_num(-math.inf, 0.0, hi_open=True), "a number < 0"),
                             "eps": (_num(0.0, lo_open=True), "a finite number > 0 (a zero gradient "
                                                              "would divide 0 by 0)"),
                             "clip_threshold": (_num(0.0, lo_open=True), "a finite number > 0"),
                             "weight_decay": _DECAY})

    def graph_key(self):
        return (self.name, self.eps)

    def hparams(self):
        return ("lr", "one_minus_beta2", "clip_threshold", "weight_decay")

    def _values(self, t, lr):
        return {"lr": lr, "one_minus_beta2": float(t) ** self.beta2_decay,
                "clip_threshold": self.clip_threshold, "weight_decay": self.weight_decay}

    def _update_one(self, p, g, hp, scale):
        lr, rho, d, wd = hp
        g = g * scale
        g2 = g * g + self.eps
        names = p.shape.names
        out = {}
        if len(names) >= 2:
            rows, cols = names[-2], names[-1]
            r_old = state_param(p, "exp_avg_sq_row", p.shape.without([cols]))
            c_old = state_param(p, "exp_avg_sq_col", p.shape.without([rows]))
            r = r_old + (reduce_mean(g2, [cols]) - r_old) * rho
            c = c_old + (reduce_mean(g2, [rows]) - c_old) * rho
            v = (r * c) / reduce_mean(r, [rows])
            out["exp_avg_sq_row"], out["exp_avg_sq_col"] = r, c
        else:
            v_old = state_param(p, "exp_avg_sq")
            v = v_old + (g2 - v_old) * rho
            out["exp_avg_sq"] = v
        u = g * ew.rsqrt(v)
        rms = ew.sqrt(reduce_mean(u * u))
        u = u / ew.maximum(rms / d, ew.constant(1.0, p.dtype, p))
        new = p * (1.0 - lr * wd) - lr * u
        if new.shape.names != names:
            new = transpose(new, names)
        for k, t in out.items():
            want = state_param(p, k).shape.names
            if t.shape.names != want:
                out[k] = transpose(t, want)
        return {"": new, **out}


def global_norm(grads: dict[str, Tensor]) -> Tensor:
    """The global L2 norm of ``grads``: exact under any layout, one reduction per axis set.

    Each gradient's sum of squares is a partial sum over the axes its layout
    splits it on; ``scalar_sum`` adds them and reduces each set of axes once.
    """
    sums = []
    for k, g in grads.items():
        sq = g * g
        sq.scopes = g.scopes  # square it in the gradient's own layout (grads./params. rules)
        sums.append(reduce_sum(sq))
    total = apply("scalar_sum", sums, name="grad_norm_sq")
    return ew.sqrt(total)


def clip_scale(norm: Tensor, clip: Tensor) -> Tensor:
    """``min(1, clip / (norm + 1e-6))``, the factor of ``torch.nn.utils.clip_grad_norm_``."""
    return ew.minimum(clip / (norm + 1e-6), ew.constant(1.0, norm.dtype, norm))


OPTIMIZERS = {"sgd": SGD, "adamw": AdamW, "adafactor": Adafactor}
