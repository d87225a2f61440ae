"""``md.conv(..., dilation=)`` (meshdsl/ops/conv.py): dense against torch, layouts against dense.

The dense program meets ``F.conv1d``/``F.conv2d`` with torch's own ``dilation`` (and ``stride``),
forward and both gradients, on both kernel paths, full convs and depthwise ones; then split
spatial dims (2-way, 3-way uneven, 2x2 over two spatial dims) give the dense numbers, each
split trading a halo of ``dilation * (taps - 1)`` rows in all (meshdsl/lowering/conv.py).
"""
from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

import meshdsl as md
from meshdsl.lowering.cost import CostModel

F64 = torch.float64
CONV = importlib.import_module("meshdsl.ops.conv")


def _pads(padding, span: int) -> tuple[int, int]:
    if isinstance(padding, tuple):
        return padding
    before = {"same": (span - 1) // 2, "valid": 0, "causal": span - 1}[padding]
    return before, (span - 1 - before if padding == "same" else 0)


def _dense(x_dims, w_dims, taps, seed: int, **kw):
    """y, dy/dx, dy/dw of md.conv in float64 (a random cotangent), and the torch leaves."""
    gen = torch.Generator().manual_seed(seed)
    xv = torch.randn([d.size for d in x_dims], generator=gen, dtype=F64, requires_grad=True)
    wv = torch.randn([d.size for d in w_dims], generator=gen, dtype=F64, requires_grad=True)
    with md.Graph():
        x, w = md.input("x", x_dims, F64), md.input("w", w_dims, F64)
        y = md.conv(x, w, taps, **kw)
        cot = md.input("cot", y.shape, F64)
        gx, gw = md.grad(md.reduce_sum(y * cot), [x, w])
        cv = torch.randn(y.shape.sizes, generator=gen, dtype=F64)
        got = md.run_dense({"y": y, "gx": gx, "gw": gw}, {"x": xv.detach(), "w": wv.detach(), "cot": cv})
    return got, xv, wv, cv


def _agree(got, want, xv, wv, cv):
    want_gx, want_gw = torch.autograd.grad((want * cv).sum(), [xv, wv])
    # float64, the same products summed in another order: rounding only (~1e-15 of values O(10)).
    for k, ref in (("y", want), ("gx", want_gx), ("gw", want_gw)):
        torch.testing.assert_close(got[k], ref.detach(), rtol=1e-12, atol=1e-12, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("small", [True, False], ids=["unfolded", "torch_conv"])
@pytest.mark.parametrize("k, dilation, stride, padding", [
    (3, 2, 1, "same"), (3, 4, 1, "causal"), (2, 3, 1, "valid"), (4, 2, 1, (5, 1)), (3, 2, 2, "same"),
    (3, 3, 2, "causal"), (5, 2, 3, (1, 6)), (3, 2, 4, "valid"), (2, 6, 3, "same")])
def test_dilated_matches_torch(k, dilation, stride, padding, small, monkeypatch):
    """x [seq 13, batch 2, c_in 3], w [c_in, tap, c_out 2]: torch's conv1d with its dilation and stride."""
    monkeypatch.setattr(CONV, "SMALL_MACS", 1 << 62 if small else 0)
    seq, batch, c_in, c_out = md.Dim("seq", 13), md.Dim("batch", 2), md.Dim("c_in", 3), md.Dim("c_out", 2)
    got, xv, wv, cv = _dense([seq, batch, c_in], [c_in, md.Dim("tap", k), c_out], {"seq": "tap"}, 0,
                             padding=padding, stride=stride, dilation=dilation)
    b, a = _pads(padding, dilation * (k - 1) + 1)
    want = F.conv1d(F.pad(xv.permute(1, 2, 0), (b, a)), wv.permute(2, 0, 1), stride=stride, dilation=dilation)
    _agree(got, want.permute(2, 0, 1), xv, wv, cv)


@pytest.mark.parametrize("stride", [1, 2])
def test_dilated_2d_per_dim_matches_torch(stride):
    """Dilation per spatial dim ({'h': 2}, w undilated), 'same' along h and causal along w."""
    h, wd, ch, co = md.Dim("h", 7), md.Dim("w", 6), md.Dim("c_in", 2), md.Dim("c_out", 3)
    got, xv, wv, cv = _dense([ch, h, wd], [md.Dim("kh", 3), md.Dim("kw", 2), ch, co], {"h": "kh", "w": "kw"}, 1,
                             padding={"h": "same", "w": "causal"}, stride=stride, dilation={"h": 2})
    want = F.conv2d(F.pad(xv.unsqueeze(0), (1, 0, 2, 2)), wv.permute(3, 2, 0, 1), stride=stride, dilation=(2, 1))
    _agree(got, want.squeeze(0), xv, wv, cv)


@pytest.mark.parametrize("k, dilation, stride, padding", [(3, 2, 1, "same"), (3, 3, 1, "valid"),
                                                          (2, 4, 1, "causal"), (3, 2, 2, "same")])
def test_dilated_depthwise_matches_torch(k, dilation, stride, padding):
    """w [tap, c_in]: torch's groups=c_in conv with its dilation (shifts by dilation * t)."""
    seq, batch, ch = md.Dim("seq", 11), md.Dim("batch", 2), md.Dim("c_in", 3)
    got, xv, wv, cv = _dense([batch, seq, ch], [md.Dim("tap", k), ch], {"seq": "tap"}, 2,
                             padding=padding, stride=stride, dilation=dilation)
    b, a = _pads(padding, dilation * (k - 1) + 1)
    want = F.conv1d(F.pad(xv.transpose(1, 2), (b, a)), wv.t().unsqueeze(1), groups=3, stride=stride,
                    dilation=dilation)
    _agree(got, want.transpose(1, 2), xv, wv, cv)


def test_dilated_padding_and_length_rules_are_clear_errors():
    seq, c_in, c_out, tap = md.Dim("seq", 6), md.Dim("c_in", 2), md.Dim("c_out", 2), md.Dim("tap", 3)
    with md.Graph():
        x, w = md.input("x", [seq, c_in]), md.param("w", [tap, c_in, c_out])
        assert md.conv(x, w, {"seq": "tap"}, padding=(4, 4), dilation=2).shape.get("seq").size == 10   # 6 + 8 - 5 + 1
        with pytest.raises(md.ShapeError, match="span: 5"):
            md.conv(x, w, {"seq": "tap"}, padding=(5, 0), dilation=2)
        with pytest.raises(md.ShapeError, match="dilated 3"):
            md.conv(x, w, {"seq": "tap"}, padding="valid", dilation=3)
        with pytest.raises(md.ShapeError, match="dilation 0 for 'seq' is not a positive int"):
            md.conv(x, w, {"seq": "tap"}, dilation=0)
        with pytest.raises(md.ShapeError, match="dilation names 'time'"):
            md.conv(x, w, {"seq": "tap"}, dilation={"time": 2})


def _layout_case(x_dims, w_dims, taps, **kw):
    with md.Graph():
        x = md.input("x", x_dims)
        w = md.param("w", w_dims)
        y = md.conv(x, w, taps, **kw)
        loss = md.reduce_sum(y * y)
        outs = {"y": y, **md.grad(loss, {"grad/w": w, "grad/x": x})}
    gen = torch.Generator().manual_seed(3)
    return outs, {"x": torch.randn([d.size for d in x_dims], generator=gen)}


@pytest.mark.parametrize("mesh, layout, seq, kw", [
    ("data:2", "seq:data", 12, {"padding": "causal", "dilation": 2}),                # halo 4 rows, before only
    ("data:3", "seq:data", 14, {"padding": "same", "dilation": 2}),                  # uneven 5/5/4, 2 + 2 rows
    ("data:3", "seq:data", 12, {"padding": (3, 1), "dilation": 2, "stride": 2}),    # phases of 6 over 3
    ("data:2; model:2", "seq:data; c_out:model", 12, {"padding": (5, 3), "dilation": 4}),
])
def test_dilated_split_spatial_dim_matches_dense(mesh, layout, seq, kw):
    """A dilated conv over a split seq: the dense numbers (md.check's tolerances), forward and
    both gradients, by halo permutes, seq never gathered."""
    batch, ch, co = md.Dim("batch", 2), md.Dim("c_in", 2), md.Dim("c_out", 2)
    outs, feeds = _layout_case([batch, md.Dim("seq", seq), ch], [md.Dim("tap", 3), ch, co], {"seq": "tap"}, **kw)
    result = md.check(outs, mesh, layout, feeds)
    assert result.ok, str(result)
    totals = md.compile(outs, mesh, layout).totals()
    assert "permute" in totals and "allgather" not in totals, totals


def test_dilated_2d_split_2x2_matches_dense():
    """h over data, w over model (2x2), dilations 2 and 3: both dims trade halos."""
    h, wd, ch, co = md.Dim("h", 8), md.Dim("w", 10), md.Dim("c_in", 2), md.Dim("c_out", 2)
    outs, feeds = _layout_case([h, wd, ch], [md.Dim("kh", 3), md.Dim("kw", 2), ch, co], {"h": "kh", "w": "kw"},
                               padding={"h": "same", "w": "causal"}, dilation={"h": 2, "w": 3})
    result = md.check(outs, "data:2; model:2", "h:data; w:model", feeds)
    assert result.ok, str(result)
    assert "allgather" not in md.compile(outs, "data:2; model:2", "h:data; w:model").totals()


def test_dilated_halo_counts_the_span():
    """seq 16 over data:2, taps 3 dilated 4, causal: each rank takes 8 rows from its left
    neighbour (forward), the output gradient's 8 from its right one (backward): 8 = 4 * (3 - 1)."""
    batch, ch, co = md.Dim("batch", 2), md.Dim("c_in", 2), md.Dim("c_out", 2)
    outs, _ = _layout_case([batch, md.Dim("seq", 16), ch], [md.Dim("tap", 3), ch, co], {"seq": "tap"},
                           padding="causal", dilation=4)
    plan = md.compile(outs, "data:2", "seq:data")
    notes = [s.note for s in plan.steps if s.kind == "permute"]
    assert notes and all("8 'seq' rows" in n for n in notes), notes


def test_a_dilated_halo_wider_than_a_block_comes_from_the_ranks_further_on():
    """seq 24 over data:4 (6 rows each), taps 3 dilated 4, causal: 8 rows back, more than a
    neighbour holds. Each rank takes its left neighbour's whole block and 2 rows of the rank
    2 to the left (forward; the output gradient's from the right, backward): 8 rows a side,
    not the 18 a gather brings, where the cost model finds that cheaper; the numbers are the
    dense ones."""
    batch, ch, co = md.Dim("batch", 2), md.Dim("c_in", 2), md.Dim("c_out", 2)
    outs, feeds = _layout_case([batch, md.Dim("seq", 24), ch], [md.Dim("tap", 3), ch, co], {"seq": "tap"},
                               padding="causal", dilation=4)
    # priced by the cost model: at 96 B a row, the default link's 50 us latency makes one
    # allgather cheaper than 2 permutes a side; a link with no latency prices bytes alone
    assert "permute" not in md.compile(outs, "data:4", "seq:data").totals()
    bytes_only = CostModel(latency_s=0.0)
    plan = md.compile(outs, "data:4", "seq:data", cost=bytes_only)
    notes = sorted(s.note for s in plan.steps if s.kind == "permute")
    assert notes == ["halo: 2 'seq' rows from the rank 2 to the left", "halo: 2 'seq' rows from the rank 2 to the right",
                     "halo: 6 'seq' rows from the left neighbour", "halo: 6 'seq' rows from the right neighbour"], notes
    assert "allgather" not in plan.totals(), plan.totals()
    result = md.check(outs, "data:4", "seq:data", feeds, cost=bytes_only)
    assert result.ok, str(result)


def test_a_dilated_halo_wider_than_an_uneven_block_is_gathered_and_matches_dense():
    """seq 14 over data:3 (5, 5, 4 rows), taps 3 dilated 3, causal: 6 rows back, more than a
    neighbour holds, over unequal blocks: the dim is gathered, and the numbers are the dense ones."""
    batch, ch, co = md.Dim("batch", 2), md.Dim("c_in", 2), md.Dim("c_out", 2)
    outs, feeds = _layout_case([batch, md.Dim("seq", 14), ch], [md.Dim("tap", 3), ch, co], {"seq": "tap"},
                               padding="causal", dilation=3)
    assert "allgather" in md.compile(outs, "data:3", "seq:data").totals()
    result = md.check(outs, "data:3", "seq:data", feeds)
    assert result.ok, str(result)
