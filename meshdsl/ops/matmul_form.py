"""A two-operand einsum as one (batched) matrix multiply, and its fused update form.

Every dim of a two-operand einsum whose summed dims occur in both operands is
a batch dim (both operands and the output), an m dim (first operand and
output), an n dim (second operand and output) or a k dim (both operands,
summed), so the einsum is ``A[b, M, K] @ B[b, K, N]``, viewed and permuted
to the output's dim order: ``torch.mm``/``bmm`` on permuted views (an operand
is copied once when no layout of it suits BLAS), instead of torch.einsum's
general path.  When the output lists its batch dims first and then all of one
operand's dims, no permute is needed, and ``p + alpha * einsum(a, b)`` is one
``addmm_``/``baddbmm_`` that writes into ``p`` without materialising the
einsum (the fused gradient and SGD update of :mod:`meshdsl.lowering.fuse`).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class MatmulForm:
    """How to run ``einsum(in0, in1 -> out)`` as ``A @ B`` (see the module docstring).

    Attributes:
      swap: A is the second operand (the output's first non-batch dim is its).
      perm_a: permutes A to (batch, m, k); perm_b: B to (batch, k, n).
      nb, nm: how many batch and m dims (A's leading groups); nk: k dims.
      out_perm: permutes the (batch, m, n) product to the output's order; None
        when it is already in that order (then ``add_matmul`` can write into p).
    """

    swap: bool
    perm_a: tuple[int, ...]
    perm_b: tuple[int, ...]
    nb: int
    nm: int
    nk: int
    out_perm: tuple[int, ...] | None = None

    @staticmethod
    def of(in0: tuple[str, ...], in1: tuple[str, ...], out: tuple[str, ...]) -> "MatmulForm | None":
        """The form of an einsum given its operands' and output's dim names, or None
        (a dim summed within one operand: torch.einsum's general path handles that)."""
        s0, s1, so = set(in0), set(in1), set(out)
        if not so <= s0 | s1 or (s0 ^ s1) - so:
            return None
        batch = [d for d in out if d in s0 and d in s1]
        rest = [d for d in out if d not in s0 or d not in s1]
        swap = bool(rest) and rest[0] in s1
        a_names, b_names = (in1, in0) if swap else (in0, in1)
        sa, sb = set(a_names), set(b_names)
        m = [d for d in rest if d in sa]
        n = [d for d in rest if d in sb]
        k = [d for d in a_names if d in sb and d not in so]
        order = batch + m + n
        out_perm = None if list(out) == order else tuple(order.index(d) for d in out)
        return MatmulForm(swap, tuple(a_names.index(d) for d in batch + m + k),
                          tuple(b_names.index(d) for d in batch + k + n), len(batch), len(m), len(k), out_perm)

    @property
    def in_order(self) -> bool:
        """The product comes out in the output's dim order (what ``add_matmul`` needs)."""
        return self.out_perm is None

    def __post_init__(self):
        # What a call may skip: a permute in dim order, a reshape of an operand whose dims
        # are already one per group ((batch,) rows, cols).
        nb, nn = self.nb, len(self.perm_b) - self.nb - self.nk
        ident = lambda p: p == tuple(range(len(p)))  # noqa: E731
        object.__setattr__(self, "_permute_a", not ident(self.perm_a))
        object.__setattr__(self, "_permute_b", not ident(self.perm_b))
        object.__setattr__(self, "_flat_a", nb <= 1 and self.nm == 1 and self.nk == 1)
        object.__setattr__(self, "_flat_b", nb <= 1 and self.nk == 1 and nn == 1)
        # B lists its n dims, then its k dims (a weight [out, in]): B's transpose is B itself viewed
        # as (N, K), which ``F.linear`` takes as it is (no batch dims)
        object.__setattr__(self, "_linear", not nb and nn >= 1 and self.nk >= 1
                           and self.perm_b == (*range(nn, nn + self.nk), *range(nn)))
        # (x's shape, y's shape) -> the calls generated for them (:meth:`_calls`): a plan calls a
        # kernel with the same shapes every step, so the sizes are worked out once per shape
        object.__setattr__(self, "_sizes", {})

    def _matrix_shapes(self, sa, sb):
        """(A's matrix shape or None (no reshape), B's, the product's shape) for operand shapes
        ``sa`` and ``sb`` (before the permutes)."""
        sa, sb = [sa[i] for i in self.perm_a], [sb[i] for i in self.perm_b]
        nb, nm, nk = self.nb, self.nm, self.nk
        bs, ms, ks, ns = sa[:nb], sa[nb:nb + nm], sa[nb + nm:], sb[nb + nk:]
        out = (*bs, *ms, *ns)
        if self._flat_a and self._flat_b:
            return None, None, out
        sizes = (math.prod(bs), math.prod(ms), math.prod(ks), math.prod(ns))
        if nb:
            return sizes[:3], (sizes[0], sizes[2], sizes[3]), out
        return sizes[1:3], sizes[2:], out

    def _recipe(self, sa, sb) -> tuple:
        """How a call with operand shapes ``sa``, ``sb`` (A's and B's, before the permutes) runs:
        ``(perm_a or None, A's shape or None, perm_b or None, B's shape or None, product shape or
        None, fold, shape, linear)``.  A permute in dim order and a reshape to the shape an operand
        has are left out (None); ``fold``: A (no batch dims, one k dim, not permuted) goes to
        ``torch.matmul`` as it is, which folds its m dims into the rows in C++; the product is then
        viewed to ``shape`` only where it does not come out in it (the product shape entry).
        ``linear``: for a B laid out (n dims, k dims), B's (N, K) shape (``()``: it has it), which
        :meth:`matmul` hands to ``F.linear`` unpermuted (perm_b and B's shape are for ``mm``)."""
        ma, mb, shape = self._matrix_shapes(sa, sb)
        pa = self.perm_a if self._permute_a else None
        pb = self.perm_b if self._permute_b else None
        fold = not self.nb and self.nk == 1 and pa is None and len(sa) > 1
        if fold:
            ma = None
        if ma is not None and tuple(ma) == tuple(sa[i] for i in self.perm_a):
            ma = None
        if mb is not None and tuple(mb) == tuple(sb[i] for i in self.perm_b):
            mb = None
        if fold:
            made = (*sa[:-1], mb[-1] if mb is not None else sb[self.perm_b[-1]])
        elif ma is None and mb is None:
            made = shape
        else:
            made = (*(ma if ma is not None else [sa[i] for i in self.perm_a])[:-1],
                    (mb if mb is not None else [sb[i] for i in self.perm_b])[-1])
        view = None if tuple(made) == tuple(shape) else shape
        linear = None
        if self._linear:   # B as (N, K), not permuted (no reshape: ()): F.linear multiplies by its transpose
            nn = len(sb) - self.nk
            linear = () if len(sb) == 2 else (math.prod(sb[:nn]), math.prod(sb[nn:]))
        return pa, ma, pb, mb, view, fold, shape, linear

    def _calls(self, x: torch.Tensor, y: torch.Tensor) -> tuple:
        """``(run, operands, shape, other, into)`` for operand shapes ``x.shape``, ``y.shape``: worked
        out once per shape (a plan calls a kernel with the same shapes every step).  ``run(x, y)``
        is :meth:`matmul`, ``operands(x, y)`` is :meth:`_operands`' ``(A, B)``, ``into(x, y, out,
        accumulate)`` is :meth:`matmul_into` run now (None for a form not in order), each one
        generated function holding only the calls these shapes need, the recipe's sizes written into it."""
        got = self._sizes.get((x.shape, y.shape))
        return got if got is not None else self.calls_for(x.shape, y.shape)

    def calls_for(self, x_shape: tuple, y_shape: tuple) -> tuple:
        """:meth:`_calls` for operands of shapes ``x_shape`` and ``y_shape``.  The executor's program
        binds ``run`` (``[0]``) per step from the plan's local shapes: no per-call lookup, eager only
        (it holds no ``torch.compile`` check)."""
        key = (x_shape, y_shape)
        got = self._sizes.get(key)
        if got is None:
            if len(self._sizes) > 64:
                self._sizes.clear()
            got = self._sizes[key] = self._generated(*((y_shape, x_shape) if self.swap else (x_shape, y_shape)))
        return got

    def _generated(self, sa: tuple, sb: tuple) -> tuple:
        """:meth:`_calls` for A's and B's shapes (source built from ints and the recipe's tuples only;
        sizes as separate arguments, which torch parses faster than a tuple)."""
        pa, ma, pb, mb, view, fold, shape, linear = self._recipe(sa, sb)
        ea, eb = ("y", "x") if self.swap else ("x", "y")
        ea = _moved(ea, pa, ma)
        if linear is not None:   # a @ B.T with B as (N, K): F.linear takes B's transposed view itself
            product = f"linear({ea}, {_moved(eb, None, linear or None)})"
        elif self.nb:   # (bmm would copy an operand BLAS cannot take one matrix at a time)
            product = f"bmm(blas({ea}), blas({_moved(eb, pb, mb)}))"
        else:           # (matmul folds A's rows in C++)
            product = f"{'matmul' if fold else 'mm'}({ea}, {_moved(eb, pb, mb)})"
        if view is not None:
            product += f".view({_args(view)})"
        if self.out_perm is not None:
            product += f".permute({_args(self.out_perm)}).contiguous()"
        # _operands: A and B as the BLAS call multiplies them (fold: A's rows folded here)
        oa, ob = ("y", "x") if self.swap else ("x", "y")
        oa, ob = _moved(oa, pa, (-1, sa[-1]) if fold and len(sa) > 2 else ma), _moved(ob, pb, mb)
        if self.nb:
            oa, ob = f"blas({oa})", f"blas({ob})"
        other = view is not None or (fold and len(shape) > 2)
        source = f"def run(x, y):\n    return {product}\ndef operands(x, y):\n    return {oa}, {ob}\n"
        if self.out_perm is None:   # matmul_into's steps for these shapes (its docstring says what)
            rows = (math.prod(sa[:-1]),) if fold and len(sa) > 2 else tuple(ma[:-1]) if ma is not None \
                else tuple(sa[i] for i in self.perm_a)[:-1]
            mat = (*rows, mb[-1] if mb is not None else sb[self.perm_b[-1]])   # the BLAS call's product
            mm, addmm = ("bmm", "baddbmm_") if self.nb else ("mm", "addmm_")
            source += (f"def into(x, y, out, acc):\n    a, b = {oa}, {ob}\n"
                       f"    if (out.shape != SHAPE or out.dtype is not a.dtype or b.dtype is not a.dtype\n"
                       f"            or out.get_device() != a.get_device() or not out.is_contiguous()):\n"
                       f"        return {mm}(a, b).view({_args(shape)})\n"
                       f"    q = out{f'.view({_args(mat)})' if other else ''}\n"
                       f"    if acc:\n        q.{addmm}(a, b)\n    else:\n        {mm}(a, b, out=q)\n"
                       f"    return out\n")
        space = {"linear": F.linear, "mm": torch.mm, "bmm": torch.bmm, "matmul": torch.matmul, "blas": _blas,
                 "SHAPE": tuple(shape)}
        exec(compile(source, "<meshdsl matmul form>", "exec"), space)
        return space["run"], space["operands"], shape, other, space.get("into")

    def _operands(self, x: torch.Tensor, y: torch.Tensor):
        """A and B as the matrices (batch of matrices) the BLAS call multiplies, the product's
        shape, and whether the BLAS call's product has another shape (its matrix shape)."""
        if not _compiling():
            _, operands, shape, other, _ = self._calls(x, y)
            return (*operands(x, y), shape, other)
        a, b = (y, x) if self.swap else (x, y)   # traced (--compile): no cache for the tracer to guard on
        pa, ma, pb, mb, view, fold, shape, _ = self._recipe(a.shape, b.shape)
        a = _moved_tensor(a, pa, (-1, a.shape[-1]) if fold and a.dim() > 2 else ma)
        b = _moved_tensor(b, pb, mb)
        other = view is not None or (fold and len(shape) > 2)
        if self.nb:   # mm copies an operand BLAS cannot take itself; bmm would copy it one matrix at a time
            return _blas(a), _blas(b), shape, other
        return a, b, shape, other

    def matmul(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``einsum(x, y)`` with the output's dims in order."""
        if not _compiling():   # the generated call for these shapes (the same steps as below)
            return self._calls(x, y)[0](x, y)
        a, b = (y, x) if self.swap else (x, y)   # traced (--compile): no cache for the tracer to guard on
        pa, ma, pb, mb, view, fold, _, linear = self._recipe(a.shape, b.shape)
        a = _moved_tensor(a, pa, ma)
        if linear is not None:   # a @ B.T with B as (N, K): the BLAS call mm makes of B's transposed view
            out = F.linear(a, b.reshape(linear) if linear else b)
        else:
            b = _moved_tensor(b, pb, mb)
            # (mm, or matmul folding A's rows, copies an operand BLAS cannot take itself; bmm would
            # copy it one matrix at a time)
            out = torch.bmm(_blas(a), _blas(b)) if self.nb else torch.matmul(a, b) if fold else torch.mm(a, b)
        if view is not None:
            out = out.view(view)
        # A permuted product is laid out in the output's order once, here: its readers
        # (attention's projections read q, k, v's gradients twice) would each copy it.
        return out if self.out_perm is None else out.permute(self.out_perm).contiguous()

    def matmul_into(self, x: torch.Tensor, y: torch.Tensor, out: torch.Tensor, accumulate: bool,
                    later: list | None = None, calls: tuple | None = None) -> torch.Tensor:
        """``einsum(x, y)`` written into ``out`` (``out + einsum(x, y)`` when ``accumulate``), in
        one BLAS call; returns ``out``.  Only for forms :attr:`in_order`.  When ``out`` cannot take
        it (another shape, dtype or device, not contiguous), the product is returned and ``out`` is untouched.

        With ``later`` (a list), the BLAS call is appended to it as a ready callable instead of
        run: ``out`` is returned unwritten, and holds the product once that callable has run.
        ``calls``: :meth:`calls_for` of ``x``'s and ``y``'s shapes, where the caller bound it (eager)."""
        assert self.out_perm is None, "matmul_into needs the product in the output's order"
        if calls is None and _compiling():
            a, b, shape, other = self._operands(x, y)
        else:   # (a loop calls this per layer and weight: the generated steps for these shapes)
            _, operands, shape, other, into = calls or self._calls(x, y)
            if later is None:
                return into(x, y, out, accumulate)
            a, b = operands(x, y)
        if (out.shape != shape or out.dtype is not a.dtype or b.dtype is not a.dtype
                or out.get_device() != a.get_device() or not out.is_contiguous()):
            return (torch.bmm(a, b) if self.nb else torch.mm(a, b)).view(shape)
        q = out.view(*a.shape[:-1], b.shape[-1]) if other else out
        if later is None:   # (a loop calls this per layer and weight: no partial to make)
            if accumulate:
                (q.baddbmm_ if self.nb else q.addmm_)(a, b)
            else:
                (torch.bmm if self.nb else torch.mm)(a, b, out=q)
        elif accumulate:
            later.append(functools.partial(q.baddbmm_ if self.nb else q.addmm_, a, b))
        else:
            later.append(functools.partial(torch.bmm if self.nb else torch.mm, a, b, out=q))
        return out

    def add_matmul(self, p: torch.Tensor, x: torch.Tensor, y: torch.Tensor, alpha: float,
                   inplace: bool = False) -> torch.Tensor:
        """``p + alpha * einsum(x, y)`` in one BLAS call; into ``p`` itself when ``inplace``.
        Only for forms :attr:`in_order`."""
        assert self.out_perm is None, "add_matmul needs the product in the output's order"
        a, b, shape, _ = self._operands(x, y)
        mat = (*a.shape[:-1], b.shape[-1])  # the product's (batch, M, N) or (M, N)
        if inplace and p.is_contiguous():
            q = p.view(mat)
            (q.baddbmm_ if self.nb else q.addmm_)(a, b, alpha=alpha)
            return p
        return (torch.baddbmm if self.nb else torch.addmm)(p.reshape(mat), a, b, alpha=alpha).view(shape)


_compiling = torch.compiler.is_compiling


def _args(sizes: tuple) -> str:
    """``sizes`` as a call's arguments in generated source: ``8, 8`` (``()`` for no dims)."""
    return ", ".join(map(str, sizes)) if sizes else "()"


def _moved_tensor(t: torch.Tensor, perm: tuple | None, shape: tuple | None) -> torch.Tensor:
    """``t`` permuted by ``perm`` and reshaped to ``shape`` (None: that step left out), as
    :func:`_moved` writes it into generated source."""
    if perm is not None:
        t = t.permute(perm)
    return t if shape is None else t.reshape(shape)


def _moved(name: str, perm: tuple | None, shape: tuple | None) -> str:
    """Source for operand ``name`` permuted by ``perm`` and reshaped to ``shape`` (None: not)."""
    return (name + (f".permute({_args(perm)})" if perm is not None else "")
            + (f".reshape({_args(shape)})" if shape is not None else ""))


def _blas(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a unit stride in one of its two matrix dims, copied once if need be.

    A permuted operand can reach bmm with neither; torch then copies it one
    matrix at a time, which costs far more than this single copy.
    """
    if x.stride(-1) == 1 or x.stride(-2) == 1 or x.shape[-1] == 1 or x.shape[-2] == 1:
        return x
    return x.contiguous()


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
