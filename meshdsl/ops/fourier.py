"""Discrete Fourier transforms along a named dim: ``rfft``, ``irfft``, ``fft``, ``ifft`` (and
``fft2``/``ifft2``, two 1-D transforms).

A complex tensor is a real tensor with a size-2 *part* dim (real, imaginary), as
``torch.view_as_real`` lays it out, so the rest of the IR, the layouts and the collectives see
plain real tensors and need nothing new.  The kernels are ``torch.fft``'s.

Gradients.  Each transform is linear; its vjp is the adjoint transform, whose scale is the
forward's, so it runs with the *dual* norm (``backward`` <-> ``forward``, ``ortho`` itself):

* ``fft``'s vjp is ``ifft`` (dual norm), and ``ifft``'s is ``fft``;
* ``rfft`` (``X_k = s sum_j x_j e^{-2 pi i jk/n}``, ``k < m = n//2 + 1``): ``dx_j = s Re sum_k
  G_k e^{+2 pi i jk/n}``.  ``irfft`` counts every frequency but DC and (even ``n``) Nyquist twice,
  as the Hermitian half it stands for, and drops the imaginary parts of those two, which
  contribute nothing to ``Re`` here either: so ``dx = irfft(w G)`` with ``w = 1/2`` on the
  frequencies counted twice, 1 on the others (dual norm);
* ``irfft`` (``x_j = t sum_{k<m} c_k Re(X_k e^{+2 pi i jk/n})``, ``c_k`` 1 or 2 as above):
  ``dX_k = t c_k sum_j g_j e^{-2 pi i jk/n}``, the first ``m`` frequencies of ``rfft(g)``
  (dual norm) weighted by ``c``; DC's and Nyquist's imaginary parts come out 0, as torch's.

Compute spec: the transformed dim, the frequency dim and the part dim are whole on a rank
(``fixed``); every other dim may stay split, so a split batch or channel dim moves nothing and a
split transformed dim is gathered by the generic rule.  Precision: ``torch.fft`` has no 16-bit
kernel on the CPU, so a 16-bit input is transformed in fp32 and the result given its dtype; under
``precision="bf16"`` the ops' rule is ``fp32`` (:mod:`.precision`), input and output.
"""
from __future__ import annotations

import functools
import math

import torch

from ..core.graph import Tensor
from ..core.shape import Dim, Shape
from ..errors import ShapeError, did_you_mean, message
from .registry import ComputeSpec, Op, apply, local_elements, register

NORMS = ("backward", "ortho", "forward")
#: the norm of a transform's adjoint: the adjoint's scale is the transform's
_DUAL = {"backward": "forward", "ortho": "ortho", "forward": "backward"}


# --- kernels -------------------------------------------------------------------------------

def _up(x: torch.Tensor) -> torch.Tensor:
    """``x`` in a dtype ``torch.fft`` transforms (a 16-bit float in fp32)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _as_complex(x: torch.Tensor, ppos: int) -> torch.Tensor:
    """The complex tensor whose (real, imaginary) parts lie along ``x``'s position ``ppos``."""
    return torch.view_as_complex(_up(x).movedim(ppos, -1).contiguous())


def rfft_kernel(pos: int, norm: str, x: torch.Tensor) -> torch.Tensor:
    """``rfft`` along ``pos``: the frequencies where ``pos`` was, (re, im) as a new last dim."""
    return torch.view_as_real(torch.fft.rfft(_up(x), dim=pos, norm=norm)).to(x.dtype)


def irfft_kernel(fpos: int, ppos: int, n: int, norm: str, x: torch.Tensor) -> torch.Tensor:
    """``irfft`` to ``n`` points along ``fpos``; the part dim at ``ppos`` is dropped."""
    return torch.fft.irfft(_as_complex(x, ppos), n=n, dim=fpos - (ppos < fpos), norm=norm).to(x.dtype)


def fft_kernel(pos: int, ppos: int, norm: str, inverse: bool, x: torch.Tensor) -> torch.Tensor:
    """``fft`` (``ifft``) along ``pos`` of the complex tensor whose parts lie along ``ppos``."""
    transform = torch.fft.ifft if inverse else torch.fft.fft
    y = torch.view_as_real(transform(_as_complex(x, ppos), dim=pos - (ppos < pos), norm=norm))
    return y.movedim(-1, ppos).contiguous().to(x.dtype)


def twice_counted(n: int, m: int, twice: float, once: float) -> torch.Tensor:
    """``[m]`` float64: ``twice`` at the frequencies an ``irfft`` to ``n`` points counts twice (all
    but DC and, for even ``n``, Nyquist), ``once`` at the others."""
    w = torch.full((m,), float(twice), dtype=torch.float64)
    w[0] = once
    if n % 2 == 0 and m > n // 2:
        w[n // 2] = once
    return w


def _spec(node, *names) -> ComputeSpec:
    dims = {}
    for t in (*node.inputs, *node.outputs):
        dims.update({d.name: d.size for d in t.shape})
    return ComputeSpec(dims, fixed=frozenset(names))


def _fft_flops(node, local: dict, n: int, real: bool) -> int:
    """~5 n log2 n per complex transform of length ``n`` (half that for a real one), times the
    local rows (the elements of the dims that are not transformed)."""
    a = node.attrs
    whole = {a["dim"], a.get("freq"), a["part"]}
    rows = local_elements(Shape(d for d in node.inputs[0].shape if d.name not in whole), local)
    return int(rows * 5 * n * max(1.0, math.log2(max(n, 2))) * (0.5 if real else 1.0))


# --- ops -----------------------------------------------------------------------------------

@register
class RFFT(Op):
    """``torch.fft.rfft`` along ``attrs["dim"]`` (``n`` points), as ``view_as_real``: the dim
    replaced by ``attrs["freq"]`` (``n//2 + 1``), ``attrs["part"]`` (2) last."""

    name = "rfft"
    linear = True

    def infer(self, inputs, attrs):
        (x,) = inputs
        attrs["pos"] = x.shape.index(attrs["dim"])
        freq = Dim(attrs["freq"], attrs["n"] // 2 + 1)
        shape = Shape([*(freq if d.name == attrs["dim"] else d for d in x.shape), Dim(attrs["part"], 2)])
        return [(shape, x.dtype)]

    def spec(self, node):
        a = node.attrs
        return _spec(node, a["dim"], a["freq"], a["part"])

    def compute(self, ctx, attrs, x):
        return rfft_kernel(attrs["pos"], attrs["norm"], x)

    def direct(self, attrs):
        return functools.partial(rfft_kernel, attrs["pos"], attrs["norm"])

    def flops(self, node, local):
        return _fft_flops(node, local, node.attrs["n"], real=True)

    def grad(self, node, douts):
        from .constant import constant

        g, a = douts[0], node.attrs
        if g is None:
            return [None]
        half = twice_counted(a["n"], a["n"] // 2 + 1, 0.5, 1.0).to(g.dtype)
        w = constant(half, [g.shape.get(a["freq"])], like=g, name="rfft_grad_weights")
        return [irfft(g * w, a["freq"], a["part"], a["dim"], a["n"], _DUAL[a["norm"]])]


@register
class IRFFT(Op):
    """``torch.fft.irfft`` to ``attrs["n"]`` points along ``attrs["freq"]`` of the complex tensor
    whose parts lie along ``attrs["part"]``: the freq dim replaced by ``attrs["dim"]``, the part
    dim dropped."""

    name = "irfft"
    linear = True

    def infer(self, inputs, attrs):
        (x,) = inputs
        attrs["pos"], attrs["ppos"] = x.shape.index(attrs["freq"]), x.shape.index(attrs["part"])
        out = Dim(attrs["dim"], attrs["n"])
        shape = Shape(out if d.name == attrs["freq"] else d for d in x.shape if d.name != attrs["part"])
        return [(shape, x.dtype)]

    def spec(self, node):
        a = node.attrs
        return _spec(node, a["dim"], a["freq"], a["part"])

    def compute(self, ctx, attrs, x):
        return irfft_kernel(attrs["pos"], attrs["ppos"], attrs["n"], attrs["norm"], x)

    def direct(self, attrs):
        return functools.partial(irfft_kernel, attrs["pos"], attrs["ppos"], attrs["n"], attrs["norm"])

    def flops(self, node, local):
        return _fft_flops(node, local, node.attrs["n"], real=True)

    def grad(self, node, douts):
        from .constant import constant
        from .slicing import slice_

        g, a = douts[0], node.attrs
        if g is None:
            return [None]
        freq = node.inputs[0].shape.get(a["freq"])
        spectrum = rfft(g, a["dim"], a["freq"], a["part"], _DUAL[a["norm"]])
        if freq.size < a["n"] // 2 + 1:      # the frequencies irfft zero-padded get no gradient
            spectrum = slice_(spectrum, a["freq"], 0, freq.size)
        double = twice_counted(a["n"], freq.size, 2.0, 1.0).to(g.dtype)
        return [spectrum * constant(double, [freq], like=g, name="irfft_grad_weights")]


@register
class FFT(Op):
    """``torch.fft.fft`` (``ifft`` where ``attrs["inverse"]``) along ``attrs["dim"]`` of the
    complex tensor whose parts lie along ``attrs["part"]``; the same dims out."""

    name = "fft"
    linear = True

    def infer(self, inputs, attrs):
        (x,) = inputs
        attrs["pos"], attrs["ppos"] = x.shape.index(attrs["dim"]), x.shape.index(attrs["part"])
        return [(x.shape, x.dtype)]

    def spec(self, node):
        return _spec(node, node.attrs["dim"], node.attrs["part"])

    def compute(self, ctx, attrs, x):
        return fft_kernel(attrs["pos"], attrs["ppos"], attrs["norm"], attrs["inverse"], x)

    def direct(self, attrs):
        return functools.partial(fft_kernel, attrs["pos"], attrs["ppos"], attrs["norm"], attrs["inverse"])

    def flops(self, node, local):
        return _fft_flops(node, local, node.inputs[0].shape.get(node.attrs["dim"]).size, real=False)

    def grad(self, node, douts):
        g, a = douts[0], node.attrs
        if g is None:
            return [None]
        return [_fft(g, a["dim"], a["part"], _DUAL[a["norm"]], not a["inverse"])]


# --- argument checks -----------------------------------------------------------------------

def _dim_of(op: str, x: Tensor, dim, role: str) -> str:
    """The name ``dim`` (a name or a Dim) gives, a dim of ``x``."""
    if not isinstance(dim, (str, Dim)):
        raise ShapeError(message(
            f"{op}: {role}={dim!r} ({type(dim).__name__}) names no dim of {x!r}: dims are named, not numbered.",
            rule=f"{op} takes its {role} as a dim name or a Dim",
            fix=f"name it, e.g. {role}='{x.shape.names[-1] if x.shape.names else 'seq'}'"))
    name = dim.name if isinstance(dim, Dim) else dim
    if name not in x.shape:
        raise ShapeError(message(
            f"{op}: {role} '{name}' is not a dim of {x!r}.{did_you_mean(name, x.shape.names)}",
            rule=f"{op} transforms along a dim of its input", fix=f"use a dim from {list(x.shape.names)}"))
    if isinstance(dim, Dim) and x.shape.get(name) != dim:
        raise ShapeError(message(
            f"{op}: {dim!r} is not a dim of {x!r}: its '{name}' has size {x.shape.get(name).size}.",
            rule="a Dim names a dim of the same name and size", fix=f"pass the name, {role}='{name}'"))
    return name


def _new_dim(op: str, x: Tensor, name, role: str, taken=()) -> str:
    """A name for a dim ``op`` makes: a str (or Dim) that is no dim of ``x`` nor in ``taken``."""
    if isinstance(name, Dim):
        name = name.name
    if not isinstance(name, str) or not name:
        raise ShapeError(message(f"{op}: {role}={name!r} is not a dim name.",
                                 rule=f"{op} names the {role} dim it makes", fix=f"pass a str, e.g. {role}='{role}'"))
    clash = name in x.shape or name in taken
    if clash:
        raise ShapeError(message(
            f"{op}: {role}='{name}', a dim it makes, is already a dim of {x!r}"
            + (f" or named for another of its dims ({', '.join(taken)})." if taken else "."),
            rule="every dim of a tensor has its own name: the dims a transform makes are new",
            fix=f"pass another name, e.g. {role}='{name}_{role}'"))
    return name


def _checked_part(op: str, x: Tensor, part, dim: str) -> str:
    """``part``: a dim of ``x`` of size 2 (real, imaginary), other than the transformed ``dim``."""
    missing = part.name if isinstance(part, Dim) else part
    if isinstance(missing, str) and missing not in x.shape:
        # the likely cause is a real tensor passed where a complex one is wanted: say how to make one
        real = ("the part= of the md.rfft it inverts" if op == "irfft" else
                f"or transform the real x with md.rfft(x, '{dim}')")
        raise ShapeError(message(
            f"{op}: part '{missing}' is not a dim of {x!r}.{did_you_mean(missing, x.shape.names)}",
            rule=f"{op} transforms a complex tensor, held as a real one with a size-2 (real, imaginary) part dim",
            fix=f"name its part dim (one of {list(x.shape.names)}), {real}; a real x is complex as "
                f"md.pad(md.unsqueeze(x, '{missing}'), '{missing}', 0, 1)"))
    name = _dim_of(op, x, part, "part")
    size = x.shape.get(name).size
    if size != 2 or name == dim:
        raise ShapeError(message(
            f"{op}: the part dim '{name}' of {x!r} " + (f"has size {size}, not 2." if size != 2
                                                        else "is the dim it transforms."),
            rule="a complex tensor holds its real and imaginary parts along a dim of size 2 (as "
                 "torch.view_as_real), which is not the transformed dim",
            fix="pass the (real, imaginary) dim, e.g. the part= an md.rfft made, or build one with "
                "md.concat of the two parts (each md.unsqueeze'd)"))
    return name


def _checked_x(op: str, x: Tensor, norm: str) -> None:
    if not x.dtype.is_floating_point:
        raise ShapeError(message(f"{op}: {x!r} has dtype {x.dtype}; it transforms floating-point values.",
                                 rule=f"{op} is torch.fft's, on float tensors",
                                 fix="cast it first: md.cast(x, torch.float32)"))
    if norm not in NORMS:
        raise ShapeError(message(f"{op}: norm={norm!r} is not one of {NORMS}.",
                                 rule="backward scales the inverse by 1/n, forward the forward, ortho both "
                                      "by 1/sqrt(n) (torch.fft's norm)",
                                 fix="pass norm='backward' (the default), 'ortho' or 'forward'"))


# --- public API ----------------------------------------------------------------------------

def rfft(x: Tensor, dim, freq="freq", part="reim", norm: str = "backward") -> Tensor:
    """The one-sided DFT of real ``x`` along ``dim``, as ``torch.view_as_real(torch.fft.rfft(...))``.

    Args:
      x: a float Tensor, e.g. ``[batch, seq, hidden]``.
      dim: the dim to transform (``n`` points).
      freq: the name of the frequency dim (``n//2 + 1``) that takes ``dim``'s place.
      part: the name of the new last dim of size 2: (real, imaginary).
      norm: ``"backward"`` (no scale), ``"ortho"`` (``1/sqrt(n)``) or ``"forward"`` (``1/n``).

    Returns:
      ``x``'s dims with ``dim`` replaced by ``freq``, and ``part`` last.  Under a layout that splits
      another dim (``"batch:data"``) each rank transforms its rows, moving nothing; a split ``dim``
      is gathered first.

    Raises:
      ShapeError: ``dim`` not a dim of ``x``, ``freq``/``part`` already dims of it, an integer
        ``x``, an unknown ``norm``.
    """
    _checked_x("rfft", x, norm)
    name = _dim_of("rfft", x, dim, "dim")
    f = _new_dim("rfft", x, freq, "freq")
    p = _new_dim("rfft", x, part, "part", taken=(f,))
    return apply("rfft", [x], {"dim": name, "freq": f, "part": p, "n": x.shape.get(name).size, "norm": norm})


def irfft(x: Tensor, freq, part, dim, n: int | None = None, norm: str = "backward") -> Tensor:
    """The inverse of :func:`rfft`: ``n`` real points from a one-sided spectrum, as
    ``torch.fft.irfft(torch.view_as_complex(...), n)``.

    Args:
      x: the spectrum, a float Tensor with a frequency dim and a (real, imaginary) part dim.
      freq: its frequency dim (``m`` values; ``m < n//2 + 1`` is zero-padded, as an FNO's kept modes).
      part: its part dim, of size 2.
      dim: the name of the real dim of ``n`` points that takes ``freq``'s place.
      n: the output length (default ``2 (m - 1)``, torch's); ``m <= n//2 + 1``.
      norm: as :func:`rfft`'s (``"backward"`` scales by ``1/n`` here).

    Returns:
      ``x``'s dims without ``part``, ``freq`` replaced by ``dim``.

    Raises:
      ShapeError: ``freq``/``part`` not dims of ``x``, a part dim not of size 2, ``dim`` already a
        dim of ``x``, or ``n`` too small to hold ``m`` frequencies.
    """
    _checked_x("irfft", x, norm)
    f = _dim_of("irfft", x, freq, "freq")
    p = _checked_part("irfft", x, part, f)
    name = _new_dim("irfft", x, dim, "dim")
    m = x.shape.get(f).size
    n = 2 * (m - 1) if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or m > n // 2 + 1:
        raise ShapeError(message(
            f"irfft: n={n!r} is too small for the {m} frequencies of '{f}' in {x!r}." if isinstance(n, int)
            and not isinstance(n, bool) else f"irfft: n={n!r} ({type(n).__name__}) is not an int.",
            rule="n real points have n//2 + 1 frequencies: irfft takes at most that many (fewer are "
                 "zero-padded), and n >= 1",
            fix=f"pass n >= {max(1, 2 * (m - 1))}, or md.slice_(x, '{f}', 0, k) first to drop the high frequencies"))
    return apply("irfft", [x], {"dim": name, "freq": f, "part": p, "n": n, "norm": norm})


def _fft(x: Tensor, dim, part, norm: str, inverse: bool) -> Tensor:
    op = "ifft" if inverse else "fft"
    _checked_x(op, x, norm)
    name = _dim_of(op, x, dim, "dim")
    p = _checked_part(op, x, part, name)
    return apply("fft", [x], {"dim": name, "part": p, "norm": norm, "inverse": inverse})


def fft(x: Tensor, dim, part="reim", norm: str = "backward") -> Tensor:
    """The DFT along ``dim`` of complex ``x`` (its parts along ``part``), as ``torch.fft.fft``.

    Args:
      x: a float Tensor ``[..., dim, ..., part]`` (the part dim of size 2 anywhere).
      dim: the dim to transform; part: the (real, imaginary) dim; norm: as :func:`rfft`'s.

    Returns:
      A Tensor of ``x``'s dims.  A real signal is ``md.pad(md.unsqueeze(x, ...), part, 0, 1)``.

    Raises:
      ShapeError: ``dim`` or ``part`` not a dim of ``x``, a part dim not of size 2, ``dim == part``.
    """
    return _fft(x, dim, part, norm, inverse=False)


def ifft(x: Tensor, dim, part="reim", norm: str = "backward") -> Tensor:
    """The inverse DFT of :func:`fft`, as ``torch.fft.ifft`` (``"backward"`` scales by ``1/n``)."""
    return _fft(x, dim, part, norm, inverse=True)


def fft2(x: Tensor, dims, part="reim", norm: str = "backward") -> Tensor:
    """The 2-D DFT over two named dims, as ``torch.fft.fft2``: one :func:`fft` along each."""
    first, second = _two_dims("fft2", x, dims, part, norm)
    return fft(fft(x, first, part, norm), second, part, norm)


def ifft2(x: Tensor, dims, part="reim", norm: str = "backward") -> Tensor:
    """The inverse of :func:`fft2`, as ``torch.fft.ifft2``: one :func:`ifft` along each dim."""
    first, second = _two_dims("ifft2", x, dims, part, norm)
    return ifft(ifft(x, first, part, norm), second, part, norm)


def _two_dims(op: str, x: Tensor, dims, part, norm: str) -> tuple:
    """The two dims of a 2-D transform, its arguments checked here so an error names ``op``."""
    if not isinstance(dims, (list, tuple)) or len(dims) != 2 or dims[0] == dims[1]:
        raise ShapeError(message(f"{op}: dims={dims!r} is not a pair of two different dims of {x!r}.",
                                 rule=f"{op} transforms along two named dims",
                                 fix=f"pass two names, e.g. dims=('height', 'width'), or md.{op[:-1]} for one"))
    _checked_x(op, x, norm)
    for d in dims:
        _checked_part(op, x, part, _dim_of(op, x, d, "dim"))
    return tuple(dims)


__all__ = ["fft", "fft2", "ifft", "ifft2", "irfft", "rfft"]
