"""A two-operand einsum as one (batched) matrix multiply, and its fused update form.

Every dim of a two-operand einsum whose summed dims occur in both operands is
a batch dim (both operands and the output), an m dim (first operand and
output), an n dim (second operand and output) or a k dim (both operands,
summed).  When the output lists its batch dims first and then all of one
operand's dims, the einsum is ``A[b, M, K] @ B[b, K, N]`` viewed as the output:
``torch.mm``/``bmm`` with transposed views instead of ``torch.einsum``'s
general path, and ``p + alpha * einsum(a, b)`` is one ``addmm_``/``baddbmm_``
that writes into ``p`` without materialising the einsum (the fused gradient
and SGD update of :mod:`meshdsl.lowering.fuse`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MatmulForm:
    """How to run ``einsum(in0, in1 -> out)`` as ``A @ B`` (see the module docstring).

    Attributes:
      swap: A is the second operand (the output's non-batch dims start with its dims).
      perm_a: permutes A to (batch, m, k); perm_b: B to (batch, k, n).
      nb, nm: how many batch and m dims (A's leading groups); nk: k dims.
    """

    swap: bool
    perm_a: tuple[int, ...]
    perm_b: tuple[int, ...]
    nb: int
    nm: int
    nk: int

    @staticmethod
    def of(in0: tuple[str, ...], in1: tuple[str, ...], out: tuple[str, ...]) -> "MatmulForm | None":
        """The form of an einsum given its operands' and output's dim names, or None."""
        s0, s1, so = set(in0), set(in1), set(out)
        if not so <= s0 | s1 or (s0 ^ s1) - so:  # a dim summed within one operand
            return None
        batch = [d for d in out if d in s0 and d in s1]
        rest = [d for d in out if d not in s0 or d not in s1]
        if list(out[:len(batch)]) != batch:
            return None
        swap = bool(rest) and rest[0] in s1
        a_names, b_names = (in1, in0) if swap else (in0, in1)
        sa, sb = set(a_names), set(b_names)
        m = [d for d in rest if d in sa]
        n = [d for d in rest if d in sb]
        if rest != m + n:
            return None
        k = [d for d in a_names if d in sb and d not in so]
        return MatmulForm(swap, tuple(a_names.index(d) for d in batch + m + k),
                          tuple(b_names.index(d) for d in batch + k + n), len(batch), len(m), len(k))

    def _operands(self, x: torch.Tensor, y: torch.Tensor):
        a, b = (y, x) if self.swap else (x, y)
        a, b = a.permute(self.perm_a), b.permute(self.perm_b)
        nb, nm, nk = self.nb, self.nm, self.nk
        bs, ms, ks, ns = a.shape[:nb], a.shape[nb:nb + nm], a.shape[nb + nm:], b.shape[nb + nk:]
        sizes = (math.prod(bs), math.prod(ms), math.prod(ks), math.prod(ns))
        if nb:
            return a.reshape(sizes[:3]), b.reshape(sizes[0], sizes[2], sizes[3]), (*bs, *ms, *ns)
        return a.reshape(sizes[1:3]), b.reshape(sizes[2:]), (*ms, *ns)

    def matmul(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``einsum(x, y)`` with the output's dims in order."""
        a, b, shape = self._operands(x, y)
        return (torch.bmm(a, b) if self.nb else torch.mm(a, b)).view(shape)

    def add_matmul(self, p: torch.Tensor, x: torch.Tensor, y: torch.Tensor, alpha: float,
                   inplace: bool = False) -> torch.Tensor:
        """``p + alpha * einsum(x, y)`` in one BLAS call; into ``p`` itself when ``inplace``."""
        a, b, shape = self._operands(x, y)
        if inplace and p.is_contiguous():
            q = p.view(a.shape[0], a.shape[-2], b.shape[-1]) if self.nb else p.view(a.shape[-2], b.shape[-1])
            (q.baddbmm_ if self.nb else q.addmm_)(a, b, alpha=alpha)
            return p
        q = p.reshape(a.shape[0], a.shape[-2], b.shape[-1]) if self.nb else p.reshape(a.shape[-2], b.shape[-1])
        return (torch.baddbmm if self.nb else torch.addmm)(q, a, b, alpha=alpha).view(shape)


class AddMatmul:
    """The plan kernel ``p + alpha * einsum(a, b)``: ``ins = (p, a, b)``, attrs ``form``, ``alpha``.

    ``compute_inplace`` writes into ``p``; an executor that donates params uses it
    when the kernel is its param's last reader.
    """

    def compute(self, ctx, attrs, p, a, b):
        return attrs["form"].add_matmul(p, a, b, attrs["alpha"])

    def compute_inplace(self, ctx, attrs, p, a, b):
        return attrs["form"].add_matmul(p, a, b, attrs["alpha"], inplace=True)


ADD_MATMUL = AddMatmul()
