"""md.rfft / md.irfft / md.fft / md.ifft / md.fft2 (meshdsl/ops/fourier.py).

Oracles: torch.fft and its autograd (complex values as ``view_as_real`` pairs) for each op's
numbers and gradient, in float64; the dense program for every layout; and for an FNet block,
its twin written with DFT tables (``tests/heldout_fnet.py``'s way).

Tolerances: float64 transforms of O(1) values over <= 8 points agree with torch's to ~1e-15
(the same pocketfft kernels; our gradients take another but exact route), so 1e-12.  float32:
1e-5 (~100 ulps at the O(1)-O(10) magnitudes of a spectrum of 8 points).

Legend: batch 2, seq n (6 or 7), ch 3; freq n//2 + 1; reim the (real, imaginary) part dim.
"""
from __future__ import annotations

import math

import pytest
import torch

import meshdsl as md
from meshdsl.errors import ShapeError

B, C = 2, 3
F64 = dict(rtol=1e-12, atol=1e-12)   # float64, see the module docstring
F32 = dict(rtol=1e-5, atol=1e-5)     # float32, see the module docstring


def _randn(*shape, dtype=torch.float64, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _real_graph(n: int, norm: str, dtype=torch.float64, m: int | None = None):
    """rfft of x along seq and irfft of a spectrum s (``m`` frequencies) to n points, with the
    gradients of ``sum(rfft(x) * cx) + sum(irfft(s) * cs)`` by x and s."""
    m = n // 2 + 1 if m is None else m
    x = md.input("x", [md.Dim("batch", B), md.Dim("seq", n), md.Dim("ch", C)], dtype=dtype)
    s = md.input("s", [md.Dim("batch", B), md.Dim("freq", m), md.Dim("reim", 2), md.Dim("ch", C)], dtype=dtype)
    X = md.rfft(x, "seq", norm=norm)
    y = md.irfft(s, "freq", "reim", "seq", n=n, norm=norm)
    cx, cs = md.input("cx", X.shape, dtype=dtype), md.input("cs", y.shape, dtype=dtype)
    gx, gs = md.grad(md.reduce_sum(X * cx) + md.reduce_sum(y * cs), [x, s])
    return {"X": X, "y": y, "gx": gx, "gs": gs}


def _real_feeds(n: int, dtype=torch.float64, m: int | None = None):
    m = n // 2 + 1 if m is None else m
    return {"x": _randn(B, n, C, dtype=dtype), "s": _randn(B, m, 2, C, dtype=dtype, seed=1),
            "cx": _randn(B, n // 2 + 1, C, 2, dtype=dtype, seed=2), "cs": _randn(B, n, C, dtype=dtype, seed=3)}


def _torch_real(feeds, n: int, norm: str):
    """torch's rfft/irfft and autograd on the same feeds (the spectrum's part dim moved last)."""
    x = feeds["x"].clone().requires_grad_()
    s = feeds["s"].clone().requires_grad_()
    X = torch.view_as_real(torch.fft.rfft(x, dim=1, norm=norm))
    y = torch.fft.irfft(torch.view_as_complex(s.movedim(2, -1).contiguous()), n=n, dim=1, norm=norm)
    gx, gs = torch.autograd.grad((X * feeds["cx"]).sum() + (y * feeds["cs"]).sum(), [x, s])
    return {"X": X.detach(), "y": y.detach(), "gx": gx, "gs": gs}


@pytest.mark.parametrize("n", [6, 7])
@pytest.mark.parametrize("norm", ["backward", "ortho", "forward"])
def test_rfft_and_irfft_match_torch_and_its_autograd(n, norm):
    with md.Graph():
        outs = _real_graph(n, norm)
        feeds = _real_feeds(n)
        got = md.run_dense(outs, feeds)
    want = _torch_real(feeds, n, norm)
    assert outs["X"].shape.names == ("batch", "freq", "ch", "reim") and outs["X"].shape["freq"].size == n // 2 + 1
    assert outs["y"].shape.names == ("batch", "seq", "ch")
    for k in want:
        torch.testing.assert_close(got[k], want[k], **F64, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("n, m", [(8, 3), (7, 2)])
def test_irfft_of_fewer_modes_zero_pads_them_as_torch(n, m):
    """An FNO keeps the lowest m modes and irffts them to n points: the rest are zero, and the
    gradient reaches only the kept ones."""
    with md.Graph():
        outs = _real_graph(n, "backward", m=m)
        feeds = _real_feeds(n, m=m)
        got = md.run_dense(outs, feeds)
    want = _torch_real(feeds, n, "backward")
    for k in ("y", "gs"):
        torch.testing.assert_close(got[k], want[k], **F64, msg=lambda msg, k=k: f"{k}: {msg}")


def test_float32_and_bf16():
    """float32 against torch at float32's tolerance; a bf16 input is transformed in fp32 and
    rounded once to bf16 (torch.fft has no 16-bit CPU kernel), and under precision="bf16" the
    transforms read and give fp32."""
    n = 8
    with md.Graph():
        outs = _real_graph(n, "ortho", dtype=torch.float32)
        feeds = _real_feeds(n, dtype=torch.float32)
        got = md.run_dense(outs, feeds)
    want = _torch_real(feeds, n, "ortho")
    for k in want:
        torch.testing.assert_close(got[k], want[k], **F32, msg=lambda m, k=k: f"{k}: {m}")
    with md.Graph():
        xb = md.input("x", [md.Dim("seq", n)], dtype=torch.bfloat16)
        X = md.rfft(xb, "seq")
        xv = _randn(n, dtype=torch.float32).bfloat16()
        got = md.run_dense({"X": X}, {"x": xv})["X"]
    assert X.dtype == got.dtype == torch.bfloat16
    assert torch.equal(got, torch.view_as_real(torch.fft.rfft(xv.float())).bfloat16())
    with md.Graph():
        x = md.input("x", [md.Dim("seq", n), md.Dim("ch", C)])
        w = md.param("w", [md.Dim("ch", C), md.Dim("out", C)])
        h = md.einsum("seq ch, ch out -> seq out", x, w)
        loss = md.mixed_precision(md.reduce_sum(md.square(md.rfft(h, "seq"))))
        rebuilt = [r for r in loss.graph.nodes if r.op.name == "rfft" and r.inputs[0].node.op.name == "cast"]
    # the rebuilt rfft reads the bf16 einsum's result cast up, and gives fp32
    assert [(r.inputs[0].node.inputs[0].dtype, r.inputs[0].dtype, r.outputs[0].dtype) for r in rebuilt] == [
        (torch.bfloat16, torch.float32, torch.float32)]


def _complex_graph(n: int, norm: str):
    """fft and ifft along seq, fft2/ifft2 over (seq, ch), the part dim in the middle, and the
    gradient by x of the weighted sum of all four."""
    x = md.input("x", [md.Dim("batch", B), md.Dim("reim", 2), md.Dim("seq", n), md.Dim("ch", C)],
                 dtype=torch.float64)
    ys = {"f": md.fft(x, "seq", "reim", norm), "i": md.ifft(x, "seq", "reim", norm),
          "f2": md.fft2(x, ("seq", "ch"), "reim", norm), "i2": md.ifft2(x, ("seq", "ch"), "reim", norm)}
    cot = md.input("cot", x.shape, dtype=torch.float64)
    (gx,) = md.grad(sum((md.reduce_sum(y * cot) * (i + 1) for i, y in enumerate(ys.values())),
                        md.constant(0.0, torch.float64)), [x])
    return {**ys, "gx": gx}


@pytest.mark.parametrize("n, norm", [(6, "backward"), (7, "ortho"), (5, "forward")])
def test_fft_ifft_fft2_match_torch_and_its_autograd(n, norm):
    with md.Graph():
        outs = _complex_graph(n, norm)
        feeds = {"x": _randn(B, 2, n, C), "cot": _randn(B, 2, n, C, seed=1)}
        got = md.run_dense(outs, feeds)
    x = feeds["x"].clone().requires_grad_()
    xc = torch.view_as_complex(x.movedim(1, -1).contiguous())
    fs = {"f": torch.fft.fft(xc, dim=1, norm=norm), "i": torch.fft.ifft(xc, dim=1, norm=norm),
          "f2": torch.fft.fft2(xc, dim=(1, 2), norm=norm), "i2": torch.fft.ifft2(xc, dim=(1, 2), norm=norm)}
    want = {k: torch.view_as_real(v).movedim(-1, 1) for k, v in fs.items()}
    (want["gx"],) = torch.autograd.grad(sum((v * feeds["cot"]).sum() * (i + 1) for i, v in enumerate(want.values())), [x])
    for k in want:
        torch.testing.assert_close(got[k], want[k].detach(), **F64, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("layout, moved", [
    ("batch:model", []),            # a split batch moves nothing
    ("ch:model", []),               # nor a split channel dim (3 over 2: uneven, still local)
    # a split transformed dim is gathered once, by the rfft; its gradient (an irfft to seq) keeps
    # each rank's rows of the whole result: no collective
    ("seq:model", [("allgather", "rfft")]),
])
def test_layouts_match_the_dense_program(layout, moved):
    """rfft along seq, then fft along its frequencies, and the gradient by x (an ifft, then an irfft)."""
    n = 6
    with md.Graph():
        x = md.input("x", [md.Dim("batch", B), md.Dim("seq", n), md.Dim("ch", C)], dtype=torch.float64)
        X = md.rfft(x, "seq")
        z = md.fft(X, "freq")
        cz = md.input("cz", z.shape, dtype=torch.float64)
        (gx,) = md.grad(md.reduce_sum(z * cz), [x])
        outs = {"X": X, "z": z, "gx": gx}
        plan = md.compile(outs, "model:2", layout)
        feeds = {"x": _randn(B, n, C), "cz": _randn(B, n // 2 + 1, C, 2, seed=4)}
        got, want = md.run_simulated(plan, feeds), md.run_dense(outs, feeds)
    assert [(s.kind, s.label) for s, _ in plan.collectives()] == moved
    for k in want:
        # the same kernels on whole rows (or the gathered dim): equal to float64 rounding
        torch.testing.assert_close(got[k], want[k], **F64, msg=lambda m, k=k: f"{layout} {k}: {m}")


# --- FNet's token mixing against its DFT-table twin; a global filter against torch.fft.rfft2 ---

T, H = 6, 5     # tok (even) and hid (odd): both of irfft's weightings


def _dft_tables(n: int):
    jk = (torch.arange(n)[:, None] * torch.arange(n)[None, :]) % n
    angle = 2 * math.pi * jk.double() / n
    return torch.cos(angle), torch.sin(angle)


def _fnet_block(form: str):
    """``LN(x + Re(DFT_tok x DFT_hid)) @ w``: the mixing by md.fft2 of x made complex (a zero
    imaginary part), or by the DFT tables as tests/heldout_fnet.py writes it."""
    ex, tok, hid = md.Dim("ex", B), md.Dim("tok", T), md.Dim("hid", H)
    x = md.input("x", [ex, tok, hid], dtype=torch.float64)
    w = md.param("w", [hid, md.Dim("out", 4)], dtype=torch.float64)
    if form == "fft":
        xc = md.pad(md.unsqueeze(x, "reim"), "reim", 0, 1)
        mix = md.squeeze(md.slice_(md.fft2(xc, ("tok", "hid"), "reim"), "reim", 0, 1), "reim")
    else:
        (ct, st), (ch, sh) = _dft_tables(T), _dft_tables(H)
        ft, fh = md.Dim("ftok", T), md.Dim("fhid", H)
        ct, st = md.constant(ct, [tok, ft]), md.constant(st, [tok, ft])
        ch, sh = md.constant(ch, [hid, fh]), md.constant(sh, [hid, fh])
        xc = md.einsum("ex tok hid, hid fhid -> ex tok fhid", x, ch)
        xs = md.einsum("ex tok hid, hid fhid -> ex tok fhid", x, sh)
        mix = md.rename(md.einsum("ex tok fhid, tok ftok -> ex ftok fhid", xc, ct)
                        - md.einsum("ex tok fhid, tok ftok -> ex ftok fhid", xs, st), ftok="tok", fhid="hid")
    y = md.einsum("ex tok hid, hid out -> ex tok out", md.layer_norm(x + mix, "hid"), w)
    loss = md.reduce_sum(md.square(y))
    gx, gw = md.grad(loss, [x, w])
    return {"loss": loss, "y": y, "gx": gx, "gw": gw}


def test_fnet_mixing_matches_its_dft_table_twin():
    feeds, params = {"x": _randn(B, T, H)}, {"w": _randn(H, 4, seed=1)}
    with md.Graph():
        twin = md.run_dense(_fnet_block("tables"), feeds, params)
    with md.Graph():
        outs = _fnet_block("fft")
        got = md.run_dense(outs, feeds, params)
        # examples split: each rank mixes its own examples; only w's gradient is summed
        split = md.run_simulated(md.compile(outs, "model:2", "ex:model"), feeds, params)
    for k in twin:
        # float64: the table twin sums T*H products in another order, values O(10): 1e-10
        torch.testing.assert_close(got[k], twin[k], rtol=1e-10, atol=1e-10, msg=lambda m, k=k: f"{k}: {m}")
        torch.testing.assert_close(split[k], got[k], **F64, msg=lambda m, k=k: f"ex:model {k}: {m}")


def _cmul(a, b, part="reim"):
    """(a_re b_re - a_im b_im, a_re b_im + a_im b_re) along ``part``."""
    ar, ai = (md.squeeze(md.slice_(a, part, i, i + 1), part) for i in (0, 1))
    br, bi = (md.squeeze(md.slice_(b, part, i, i + 1), part) for i in (0, 1))
    return md.concat([md.unsqueeze(ar * br - ai * bi, part), md.unsqueeze(ar * bi + ai * br, part)], part)


def test_a_global_filter_by_rfft_and_irfft_over_two_dims_matches_torch():
    """GFNet's mixing: rfft over hid, fft over tok, times a learned complex filter, back by ifft
    and irfft: torch's irfft2(rfft2(x) * k) and its gradients by x and the filter."""
    ex, tok, hid = md.Dim("ex", B), md.Dim("tok", T), md.Dim("hid", H)
    with md.Graph():
        x = md.input("x", [ex, tok, hid], dtype=torch.float64)
        k = md.param("k", [tok, md.Dim("fhid", H // 2 + 1), md.Dim("reim", 2)], dtype=torch.float64)
        spec = md.fft(md.rfft(x, "hid", freq="fhid"), "tok")
        y = md.irfft(md.ifft(_cmul(spec, k), "tok"), "fhid", "reim", "hid", n=H)
        cot = md.input("cot", y.shape, dtype=torch.float64)
        gx, gk = md.grad(md.reduce_sum(y * cot), [x, k])
        feeds, params = {"x": _randn(B, T, H), "cot": _randn(B, T, H, seed=2)}, {"k": _randn(T, H // 2 + 1, 2, seed=1)}
        got = md.run_dense({"y": y, "gx": gx, "gk": gk}, feeds, params)
    xt, kt = feeds["x"].clone().requires_grad_(), params["k"].clone().requires_grad_()
    yt = torch.fft.irfft2(torch.fft.rfft2(xt, dim=(1, 2)) * torch.view_as_complex(kt), s=(T, H), dim=(1, 2))
    want = dict(zip(("gx", "gk"), torch.autograd.grad((yt * feeds["cot"]).sum(), [xt, kt])), y=yt.detach())
    for name in want:
        torch.testing.assert_close(got[name], want[name], **F64, msg=lambda m, n_=name: f"{n_}: {m}")


# --- errors ----------------------------------------------------------------------------------

def test_errors_name_the_input_the_rule_and_the_fix():
    with md.Graph():
        x = md.input("x", [md.Dim("batch", 2), md.Dim("seq", 8)])
        X = md.rfft(x, "seq")
        with pytest.raises(ShapeError, match=r"rfft: dim 'sq' is not a dim .* Did you mean 'seq'\?"):
            md.rfft(x, "sq")
        with pytest.raises(ShapeError, match=r"dims are named, not numbered"):
            md.rfft(x, 1)
        with pytest.raises(ShapeError, match=r"rfft: freq='batch', a dim it makes, is already a dim"):
            md.rfft(x, "seq", freq="batch")
        with pytest.raises(ShapeError, match=r"norm='half' is not one of"):
            md.rfft(x, "seq", norm="half")
        with pytest.raises(ShapeError, match=r"(?s)has dtype torch.int64.*md.cast"):
            md.rfft(md.input("i", [md.Dim("seq", 4)], dtype=torch.int64), "seq")
        with pytest.raises(ShapeError, match=r"irfft: the part dim 'seq' .* has size 8, not 2"):
            md.irfft(x, "batch", "seq", "t")
        with pytest.raises(ShapeError, match=r"(?s)irfft: n=4 is too small for the 5 frequencies of 'freq'.*"
                                             r"pass n >= 8, or md.slice_"):
            md.irfft(X, "freq", "reim", "seq", n=4)
        with pytest.raises(ShapeError, match=r"irfft: dim='batch', a dim it makes, is already a dim"):
            md.irfft(X, "freq", "reim", "batch")
        with pytest.raises(ShapeError, match=r"fft: the part dim 'reim' .* is the dim it transforms"):
            md.fft(X, "reim")
        with pytest.raises(ShapeError, match=r"fft2: dims=\('freq', 'freq'\) is not a pair"):
            md.fft2(X, ("freq", "freq"))
