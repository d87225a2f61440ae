"""Row moments over a dim cut into parts: each part's mean and centred M2, then one combine.

A layer norm over a dim a layout splits needs each row's mean and variance.  As a mean, then
the variance of the centred value, it is two dependent reductions over the split dim (two
collectives); as ``[sum x, sum x^2]`` it is one, but ``E[x^2] - E[x]^2`` cancels: at
``x = 1000 + noise`` fp32 loses the variance whole.  Here each part of the dim (each rank's,
where the dim is split) gives its own count ``n_i``, mean and centred ``M2_i`` (torch's
``var_mean``), and the parts are joined by Chan et al.'s parallel-variance formula,
``mean = sum n_i mean_i / N``, ``M2 = sum M2_i + sum n_i (mean_i - mean)^2``, whose terms are all
centred: as stable as the whole row's two-pass variance, with one small collective.  Two forms:

* ``part_moments``: ``x -> P [*rows, moment_part, moment_stat]``, each part's ``(mean_i, M2_i)``
  (parts cut at ``lengths``), in the statistics' dtype; ``combine_moments`` reads ``P`` whole,
  so where each rank makes its own part's row (``lowering/norms.py``) ``P`` is ONE allgather of
  two values a row a rank;
* ``sum_moments``: ``x -> S [*rows, moment_stat]``, ``[n_i mean_i, M2_i + n_i mean_i^2]`` in
  fp64: sums over the dim (its spec reduces it by ``sum``), so a split dim leaves ``S`` a partial
  sum, ONE allreduce of two fp64 values a row, fewer bytes than the gather on more than four
  ranks.  Chan's combine expanded into sums cancels as ``E[x^2] - E[x]^2`` does, but in fp64,
  after each part centred its own ``M2_i``: ~1e-16 * (mean/std)^2 of the variance.

``combine_moments``: ``P`` or ``S`` -> ``(mean, rstd)``, ``rstd = rsqrt(M2 / N + eps)``, in the
statistics' dtype (fp32 for a 16-bit ``x``, fp64 for fp64).  None of the three has a gradient:
they make a fused norm's statistics when it is lowered as its composite, whose backward is the
norm's own backward op.
"""
from __future__ import annotations

import math

import torch

from ..core.graph import Tensor
from ..core.shape import Dim, Shape
from .layernorm import _stats_dtype
from .registry import ComputeSpec, Op, apply, register

#: the dim of ``P`` that holds one row per part of the normalised dim
PART_DIM = "moment_part"
#: the dim of ``P`` and ``S`` that holds the two statistics
STAT_DIM = "moment_stat"


def part_stats(x: torch.Tensor, pos: int) -> torch.Tensor:
    """``[*rows, 2]``: ``(mean, M2)`` of ``x`` along dim ``pos``, in the statistics' dtype."""
    xf = x.to(_stats_dtype(x.dtype))
    var, mean = torch.var_mean(xf, pos, correction=0)
    return torch.stack([mean, var * x.shape[pos]], -1)


def _part_moments(pos: int, lengths, x):
    return torch.stack([part_stats(p, pos) for p in x.split(list(lengths), pos)], -2)


def own_part_moments(ctx, attrs, x):
    """The local kernel of ``part_moments`` on a rank that holds one part of the dim whole: its
    own row of ``P`` (``[*rows, 1, 2]``)."""
    return part_stats(x, attrs["pos"]).unsqueeze(-2)


def _sum_moments(pos: int, x):
    n = x.shape[pos]
    mean, m2 = part_stats(x, pos).double().unbind(-1)
    return torch.stack([n * mean, m2 + n * mean * mean], -1)


def _combine(form: str, lengths, eps: float, dtype, s):
    """``(mean, rstd)`` from ``P`` (``form`` ``"parts"``) or ``S`` (``"sums"``)."""
    total = sum(lengths)
    if form == "sums":
        mean = s[..., 0] / total
        var = (s[..., 1] / total - mean * mean).clamp(min=0)
        return mean.to(dtype), (var + eps).rsqrt().to(dtype)
    n = torch.tensor(lengths, dtype=s.dtype, device=s.device)
    means, m2s = s.unbind(-1)
    mean = (means * n).sum(-1) / total
    m2 = m2s.sum(-1) + (n * (means - mean.unsqueeze(-1)).square()).sum(-1)
    return mean, (m2 / total + eps).rsqrt()


def _rows(x: Tensor, dim: str) -> Shape:
    return x.shape.without([dim])


@register
class PartMoments(Op):
    """x -> P [*rows, moment_part, moment_stat]: each part's (mean, M2) along attr ``dim`` cut at
    ``lengths``; no gradient."""

    name = "part_moments"
    differentiable = False

    def infer(self, inputs, attrs):
        x = inputs[0]
        attrs["pos"] = x.shape.index(attrs["dim"])
        shape = Shape([*_rows(x, attrs["dim"]), Dim(PART_DIM, len(attrs["lengths"])), Dim(STAT_DIM, 2)])
        return [(shape, _stats_dtype(x.dtype))]

    def compute(self, ctx, attrs, x):
        return _part_moments(attrs["pos"], attrs["lengths"], x)

    def spec(self, node):
        x = node.inputs[0]
        dims = {PART_DIM: len(node.attrs["lengths"]), STAT_DIM: 2, **{t.name: t.size for t in x.shape}}
        return ComputeSpec(dims, fixed=frozenset({node.attrs["dim"], PART_DIM, STAT_DIM}))

    def flops(self, node, local):
        return 4 * math.prod(local.get(d.name, d.size) for d in node.inputs[0].shape)


@register
class SumMoments(Op):
    """x -> S [*rows, moment_stat]: [n mean, M2 + n mean^2] along attr ``dim`` (fp64), sums over
    ``dim``; no gradient."""

    name = "sum_moments"
    differentiable = False

    def infer(self, inputs, attrs):
        x = inputs[0]
        attrs["pos"] = x.shape.index(attrs["dim"])
        return [(Shape([*_rows(x, attrs["dim"]), Dim(STAT_DIM, 2)]), torch.float64)]

    def compute(self, ctx, attrs, x):
        return _sum_moments(attrs["pos"], x)

    def spec(self, node):
        x = node.inputs[0]
        dims = {STAT_DIM: 2, **{t.name: t.size for t in x.shape}}
        return ComputeSpec(dims, fixed=frozenset({STAT_DIM}), reduce={node.attrs["dim"]: "sum"})

    def flops(self, node, local):
        return 4 * math.prod(local.get(d.name, d.size) for d in node.inputs[0].shape)


@register
class CombineMoments(Op):
    """P or S -> (mean, rstd) per row; attrs ``form`` (``"parts"``, ``"sums"``), ``lengths``,
    ``eps``, ``dtype`` (the statistics'); no gradient."""

    name = "combine_moments"
    differentiable = False

    def infer(self, inputs, attrs):
        s = inputs[0]
        rows = (s.shape.without([n for n in (PART_DIM, STAT_DIM) if n in s.shape.names]), attrs["dtype"])
        return [rows, rows]

    def compute(self, ctx, attrs, s):
        return _combine(attrs["form"], attrs["lengths"], attrs["eps"], attrs["dtype"], s)

    def spec(self, node):
        s = node.inputs[0]
        return ComputeSpec({t.name: t.size for t in s.shape},
                           fixed=frozenset(n for n in (PART_DIM, STAT_DIM) if n in s.shape.names))

    def flops(self, node, local):
        return 6 * math.prod(local.get(d.name, d.size) for d in node.inputs[0].shape)


def row_moments(x: Tensor, dim: str, eps: float, lengths: tuple[int, ...] | None) -> tuple[Tensor, Tensor]:
    """``(mean, rstd)`` of ``x`` along ``dim``, in the statistics' dtype: from each part's moments
    (``dim`` cut at ``lengths``) joined by Chan's formula, or, with ``lengths`` None, from fp64
    sums of the centred parts (see the module docstring)."""
    size = x.shape.get(dim).size
    attrs = {"eps": float(eps), "dtype": _stats_dtype(x.dtype)}
    if lengths is None:
        s = apply("sum_moments", [x], {"dim": dim})
        return tuple(apply("combine_moments", [s], {**attrs, "form": "sums", "lengths": (size,)}))
    assert sum(lengths) == size, f"parts {lengths} do not cut '{dim}' ({size})"
    p = apply("part_moments", [x], {"dim": dim, "lengths": tuple(lengths)})
    return tuple(apply("combine_moments", [p], {**attrs, "form": "parts", "lengths": tuple(lengths)}))
