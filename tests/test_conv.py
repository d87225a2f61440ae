"""``md.conv`` (meshdsl/ops/conv.py) against torch's own convolution, and its errors.

The layout-equivalence and gradient cases (test_ops_equivalence.py, test_op_grads.py) compare
the op with the DSL's dense program and with autograd through its own kernel; here the dense
program meets ``F.conv1d``/``F.conv2d`` on padded inputs, forward and both gradients, on
both kernel paths (the unfolded einsum for small problems, torch's convolution above
``SMALL_MACS``).  Sizes: batch 2, seq 9, h 6, channels 3 -> 4, taps 5 (and 3 along h).
"""
from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

import meshdsl as md

F64 = torch.float64
CONV = importlib.import_module("meshdsl.ops.conv")
BEFORE = {"same": lambda k: (k - 1) // 2, "valid": lambda k: 0, "causal": lambda k: k - 1}


def _pads(padding, k):
    if isinstance(padding, tuple):
        return padding
    before = BEFORE[padding](k)
    return before, (0 if padding != "same" else k - 1 - before)


def _reference(xv, wv, padding, two: bool):
    """torch's conv on x [seq, batch, c_in, (h)] and w [c_in, tap, c_out, (kh)] (the test's dim orders)."""
    if not two:
        b, a = _pads(padding, 5)
        y = F.conv1d(F.pad(xv.permute(1, 2, 0), (b, a)), wv.permute(2, 0, 1))   # (batch, c_out, seq)
        return y.permute(2, 0, 1)
    b, a = _pads(padding, 5)
    hb, ha = _pads(padding, 3)
    y = F.conv2d(F.pad(xv.permute(1, 2, 0, 3), (hb, ha, b, a)), wv.permute(2, 0, 1, 3))
    return y.permute(2, 0, 1, 3)


@pytest.mark.parametrize("small", [True, False], ids=["unfolded", "torch_conv"])
@pytest.mark.parametrize("two", [False, True], ids=["1d", "2d"])
@pytest.mark.parametrize("padding", ["same", "valid", "causal", (1, 2)])
def test_matches_torch_conv(padding, two, small, monkeypatch):
    monkeypatch.setattr(CONV, "SMALL_MACS", 1 << 62 if small else 0)
    seq, batch, c_in, c_out = md.Dim("seq", 9), md.Dim("batch", 2), md.Dim("c_in", 3), md.Dim("c_out", 4)
    x_dims = [seq, batch, c_in] + ([md.Dim("h", 6)] if two else [])
    w_dims = [c_in, md.Dim("tap", 5), c_out] + ([md.Dim("kh", 3)] if two else [])
    gen = torch.Generator().manual_seed(0)
    xv = torch.randn([d.size for d in x_dims], generator=gen, dtype=F64, requires_grad=True)
    wv = torch.randn([d.size for d in w_dims], generator=gen, dtype=F64, requires_grad=True)
    with md.Graph():
        x, w = md.input("x", x_dims, F64), md.input("w", w_dims, F64)
        y = md.conv(x, w, {"seq": "tap", **({"h": "kh"} if two else {})}, padding=padding)
        cot = md.input("cot", y.shape, F64)
        gx, gw = md.grad(md.reduce_sum(y * cot), [x, w])
        cv = torch.randn(y.shape.sizes, generator=gen, dtype=F64)
        got = md.run_dense({"y": y, "gx": gx, "gw": gw}, {"x": xv.detach(), "w": wv.detach(), "cot": cv})
    want = _reference(xv, wv, padding, two)
    want_gx, want_gw = torch.autograd.grad((want * cv).sum(), [xv, wv])
    # float64, the same sums in another order: rounding only (~1e-15 of values O(10)).
    for k, ref in (("y", want), ("gx", want_gx), ("gw", want_gw)):
        torch.testing.assert_close(got[k], ref.detach(), rtol=1e-12, atol=1e-12, msg=lambda m, k=k: f"{k}: {m}")


def test_output_dims_take_c_in_place_and_valid_shortens():
    with md.Graph():
        x = md.input("x", [md.Dim("c_in", 3), md.Dim("seq", 8), md.Dim("batch", 2)])
        y = md.conv(x, md.param("w", [md.Dim("c_out", 4), md.Dim("c_in", 3), md.Dim("tap", 3)]),
                    {"seq": "tap"}, padding="valid")
    assert [(d.name, d.size) for d in y.shape] == [("c_out", 4), ("seq", 6), ("batch", 2)]


@pytest.mark.parametrize("w_dims, taps, padding, match", [
    ([("tap", 3), ("c_in", 3), ("c_out", 4)], {"time": "tap"}, "same", "spatial dim 'time' is not a dim of x"),
    ([("tap", 3), ("c_in", 3), ("c_out", 4)], {"seq": "k"}, "same", "tap dim 'k' is not a dim of w"),
    ([("tap", 3), ("c_out", 4)], {"seq": "tap"}, "same", "one channel dim x has"),
    ([("tap", 3), ("c_out", 4), ("c2", 2)], {"seq": "tap"}, "same", "one channel dim x has"),
    ([("tap", 3), ("c_in", 2), ("c_out", 4)], {"seq": "tap"}, "same", "'c_in' has size 3 in x and 2 in w"),
    ([("tap", 3), ("c_in", 3), ("c_out", 4)], {"seq": "tap"}, "full", "padding 'full' for 'seq'"),
    ([("tap", 3), ("c_in", 3), ("c_out", 4)], {"seq": "tap"}, (3, 0), r"not a pair of ints in 0..2"),
    ([("tap", 9), ("c_in", 3), ("c_out", 4)], {"seq": "tap"}, "valid", "shorter than its 9 taps"),
    ([("tap", 3), ("c_in", 3), ("c_out", 4)], {"seq": "tap"}, {"time": "same"}, "'time', which is not a spatial"),
])
def test_bad_calls_are_clear_errors(w_dims, taps, padding, match):
    with md.Graph():
        x = md.input("x", [md.Dim("batch", 2), md.Dim("seq", 8), md.Dim("c_in", 3)])
        w = md.param("w", [md.Dim(n, s) for n, s in w_dims])
        with pytest.raises(md.ShapeError, match=match) as e:
            md.conv(x, w, taps, padding=padding)
    assert "Fix:" in str(e.value)


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("two", [False, True], ids=["1d", "2d"])
@pytest.mark.parametrize("padding", ["same", "valid", "causal", (0, 3)])
def test_depthwise_matches_torch_grouped_conv(padding, two, stride):
    """w [tap, (kh,) c_in] without c_out: one filter per channel, torch's ``groups=c_in``, forward
    and both gradients; built from shifts (pads and slices where 'valid' shortens), strided by phases."""
    seq, batch, ch = md.Dim("seq", 9), md.Dim("batch", 2), md.Dim("c_in", 3)
    x_dims = [seq, batch, ch] + ([md.Dim("h", 6)] if two else [])
    w_dims = [ch, md.Dim("tap", 4)] + ([md.Dim("kh", 3)] if two else [])
    gen = torch.Generator().manual_seed(1)
    xv = torch.randn([d.size for d in x_dims], generator=gen, dtype=F64, requires_grad=True)
    wv = torch.randn([d.size for d in w_dims], generator=gen, dtype=F64, requires_grad=True)
    with md.Graph():
        x, w = md.input("x", x_dims, F64), md.input("w", w_dims, F64)
        h_pad = (0, 2) if isinstance(padding, tuple) else padding      # at most taps - 1 = 2 along h
        pads = {"seq": padding, "h": h_pad} if two else padding
        y = md.conv(x, w, {"seq": "tap", **({"h": "kh"} if two else {})}, padding=pads, stride=stride)
        cot = md.input("cot", y.shape, F64)
        gx, gw = md.grad(md.reduce_sum(y * cot), [x, w])
        cv = torch.randn(y.shape.sizes, generator=gen, dtype=F64)
        got = md.run_dense({"y": y, "gx": gx, "gw": gw}, {"x": xv.detach(), "w": wv.detach(), "cot": cv})
    b, a = _pads(padding, 4)
    if two:
        hb, ha = _pads(h_pad, 3)
        want = F.conv2d(F.pad(xv.permute(1, 2, 0, 3), (hb, ha, b, a)), wv.unsqueeze(1), groups=3, stride=stride)
        want = want.permute(2, 0, 1, 3)
    else:
        want = F.conv1d(F.pad(xv.permute(1, 2, 0), (b, a)), wv.unsqueeze(1), groups=3, stride=stride).permute(2, 0, 1)
    want_gx, want_gw = torch.autograd.grad((want * cv).sum(), [xv, wv])
    # float64, the same products summed in another order: rounding only (~1e-15 of values O(10)).
    for k, ref in (("y", want), ("gx", want_gx), ("gw", want_gw)):
        torch.testing.assert_close(got[k], ref.detach(), rtol=1e-12, atol=1e-12, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("mesh, layout", [("data:3", "seq:data"), ("data:2; model:2", "seq:data; c_in:model")])
def test_depthwise_split_over_its_spatial_dim_trades_halos(mesh, layout):
    """A depthwise conv over a split (unevenly on data:3) seq: the dense numbers, forward and
    gradients, its shifts trading halo rows (permutes), nothing gathered."""
    seq, batch, ch, tap = md.Dim("seq", 8), md.Dim("batch", 2), md.Dim("c_in", 4), md.Dim("tap", 3)
    with md.Graph():
        x = md.input("x", [batch, seq, ch])
        w = md.param("w", [tap, ch], scale=1.0)
        y = md.conv(x, w, {"seq": "tap"})
        loss = md.reduce_sum(y * y)
        outs = {"y": y, **md.grad(loss, {"grad/w": w, "grad/x": x})}
    feeds = {"x": torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(0))}
    result = md.check(outs, mesh, layout, feeds)
    assert result.ok, str(result)
    totals = md.compile(outs, mesh, layout).totals()
    assert "permute" in totals and "allgather" not in totals, totals


def test_depthwise_over_several_dims_is_one_filter_per_pair():
    """w [tap, experts, c_in] against x [batch, seq, experts, c_in]: a depthwise conv over both
    (experts x c_in groups in torch's terms), causal and strided, forward and both gradients."""
    b, s, e, c, k = 2, 9, 3, 4, 3
    gen = torch.Generator().manual_seed(2)
    xv = torch.randn(b, s, e, c, generator=gen, dtype=F64, requires_grad=True)
    wv = torch.randn(k, e, c, generator=gen, dtype=F64, requires_grad=True)
    with md.Graph():
        x = md.input("x", [md.Dim("batch", b), md.Dim("seq", s), md.Dim("experts", e), md.Dim("c_in", c)], F64)
        w = md.input("w", [md.Dim("tap", k), md.Dim("experts", e), md.Dim("c_in", c)], F64)
        y = md.conv(x, w, {"seq": "tap"}, padding="causal", stride=2)
        cot = md.input("cot", y.shape, F64)
        gx, gw = md.grad(md.reduce_sum(y * cot), [x, w])
        cv = torch.randn(y.shape.sizes, generator=gen, dtype=F64)
        got = md.run_dense({"y": y, "gx": gx, "gw": gw}, {"x": xv.detach(), "w": wv.detach(), "cot": cv})
    flat = F.pad(xv.reshape(b, s, e * c).transpose(1, 2), (k - 1, 0))
    want = F.conv1d(flat, wv.reshape(k, e * c).t().unsqueeze(1), groups=e * c, stride=2)
    want = want.transpose(1, 2).reshape(b, -1, e, c)
    want_gx, want_gw = torch.autograd.grad((want * cv).sum(), [xv, wv])
    # float64, the same products summed in another order: rounding only
    for key, ref in (("y", want), ("gx", want_gx), ("gw", want_gw)):
        torch.testing.assert_close(got[key], ref.detach(), rtol=1e-12, atol=1e-12, msg=lambda m, key=key: f"{key}: {m}")
