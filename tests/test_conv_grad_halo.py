"""A conv over a split spatial dim trades the narrower of two strips (lowering/conv.py): its
input's halo (``c_in`` wide), or, computed on each rank's own input rows, the overlap of its
output (``c_out`` wide) sent to the neighbours and added there. A conv's input gradient reads the
output's gradient (the wide side where ``c_out > c_in``): it folds its own, narrower, overlap.

Legend: ci / co the conv's input and output channels (of the user's conv: its input gradient
reads co and makes ci), seq / h the spatial dims, simulated meshes of 2 (even) and 3 ranks (uneven).
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md

F64 = torch.float64


def _permute_bytes(plan, phase: str) -> list[int]:
    return sorted(st.bytes for st, mult in plan.walk() for _ in range(mult)
                  if st.is_collective and st.phase == phase and st.kind == "permute")


def _dense_and_simulated(outs, feeds, mesh, layout):
    plan = md.compile(outs, mesh, layout)
    want, got = md.run_dense(outs, feeds), md.run_simulated(plan, feeds)
    # float64, the same products summed in another order (a row's terms split between two ranks
    # and added): rounding only, ~1e-15 of values O(10)
    for k in outs:
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-12, msg=lambda m, k=k: f"{k}: {m}")
    return plan


def test_the_input_gradient_sends_its_own_overlap_not_the_output_gradients_halo():
    """c_in 1, c_out 16, 3 taps over seq:model: the backward's permutes carry one row of the
    partial input gradient (1 channel, 8 B), not of the output's gradient (16 channels, 128 B)."""
    b, s, ci, co, k = md.Dim("batch", 2), md.Dim("seq", 16), md.Dim("c_in", 1), md.Dim("c_out", 16), md.Dim("tap", 3)
    with md.Graph():
        x = md.input("x", [b, s, ci], F64)
        w = md.input("w", [k, ci, co], F64)
        y = md.conv(x, w, {"seq": "tap"}, padding="same")
        loss = md.reduce_sum(y * y)
        outs = {"loss": loss, **md.grad(loss, {"grad/x": x, "grad/w": w})}
    gen = torch.Generator().manual_seed(0)
    feeds = {"x": torch.randn(2, 16, 1, generator=gen, dtype=F64), "w": torch.randn(3, 1, 16, generator=gen, dtype=F64)}
    plan = _dense_and_simulated(outs, feeds, "model:2", "seq:model")
    assert _permute_bytes(plan, "forward") == [16, 16]      # x's halo: 2 samples x 1 channel x 8 B
    assert _permute_bytes(plan, "backward") == [16, 16], _permute_bytes(plan, "backward")   # 128 B each before


CASES = {   # name: (c_in, c_out, 2-D, stride, mesh, layout)
    "1d_co_wide": (2, 6, False, 1, "model:2", "seq:model"),
    "1d_ci_wide": (6, 2, False, 1, "model:2", "seq:model"),
    "2d_co_wide_uneven": (2, 6, True, 1, "model:3", "h:model"),
    "2d_ci_wide_both_split": (6, 2, True, 1, "a:2; b:2", "seq:a; h:b"),
    "1d_stride2": (2, 6, False, 2, "model:2", "seq:model"),
    "1d_uneven": (2, 6, False, 1, "model:3", "seq:model"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_split_spatial_dims_match_dense(name):
    """Forward and both gradients as the dense program, folding or not, 1-D and 2-D, strided,
    evenly and unevenly split (seq 11 over 3 ranks: 4, 4, 3; h 7: 3, 2, 2); where c_out is the
    wider, the backward's permutes carry c_in-wide rows (the input gradient's overlap)."""
    ci, co, two, stride, mesh, layout = CASES[name]
    gen = torch.Generator().manual_seed(1)
    dims = [md.Dim("batch", 2), md.Dim("seq", 11 if "model:3" == mesh else 12)] + ([md.Dim("h", 7)] if two else [])
    taps = {"seq": "tap", **({"h": "kh"} if two else {})}
    with md.Graph():
        x = md.input("x", dims + [md.Dim("c_in", ci)], F64)
        w = md.input("w", [md.Dim("tap", 3)] + ([md.Dim("kh", 3)] if two else [])
                     + [md.Dim("c_in", ci), md.Dim("c_out", co)], F64)
        y = md.conv(x, w, taps, padding="same", stride=stride)
        cot = md.input("cot", y.shape, F64)
        outs = {"y": y, **md.grad(md.reduce_sum(y * cot), {"grad/x": x, "grad/w": w})}
        feeds = {t.name: torch.randn(t.shape.sizes, generator=gen, dtype=F64) for t in (x, w, cot)}
    plan = _dense_and_simulated(outs, feeds, mesh, layout)
    if co > ci:   # the backward's rows are ci wide where the forward's are too
        assert _permute_bytes(plan, "backward") == _permute_bytes(plan, "forward"), \
            (_permute_bytes(plan, "forward"), _permute_bytes(plan, "backward"))
        assert any("each rank convolves its own" in n for n in plan.notes), plan.notes


def test_conv_transpose_gradient_sends_the_narrower_rows():
    """md.conv_transpose (2 channels to 6, stride 2) under seq:model: the dense numbers, and the
    gradient of its input, a strided conv of the result's 6-channel gradient, sends its own
    2-channel overlap (32 B: batch 2 x 2 channels x 8 B) where it read a 6-channel halo (96 B)."""
    gen = torch.Generator().manual_seed(2)
    with md.Graph():
        x = md.input("x", [md.Dim("batch", 2), md.Dim("seq", 8), md.Dim("c_in", 2)], F64)
        w = md.input("w", [md.Dim("tap", 3), md.Dim("c_in", 2), md.Dim("c_out", 6)], F64)
        y = md.conv_transpose(x, w, {"seq": "tap"}, stride=2, padding=1, output_padding=1)
        cot = md.input("cot", y.shape, F64)
        outs = {"y": y, **md.grad(md.reduce_sum(y * cot), {"grad/x": x, "grad/w": w})}
        feeds = {t.name: torch.randn(t.shape.sizes, generator=gen, dtype=F64) for t in (x, w, cot)}
    plan = _dense_and_simulated(outs, feeds, "model:2", "seq:model")
    assert _permute_bytes(plan, "backward") == [32, 32], _permute_bytes(plan, "backward")


def test_a_recurrent_conv_weight_gradient_reads_the_saved_halo_instead():
    """A conv recurrence (h -> gates [gate, hid] -> h, 3 gates) under height:model: the backward's
    weight gradient, built from the gates' gradient and h (lowering/conv.py ``_swapped``), reads h's
    halo the forward saved, and the input gradient folds its hid-wide overlap: no permute carries
    the 3-gate-wide gradient (96 B a row before, 32 B now)."""
    b, t, y = md.Dim("batch", 2), md.Dim("time", 3), md.Dim("height", 6)
    hid, hin, g, k = md.Dim("hid", 2), md.Dim("hid_in", 2), md.Dim("gate", 3), md.Dim("kh", 3)
    gen = torch.Generator().manual_seed(3)
    with md.Graph():
        xs = md.input("xs", [t, b, y, hid], F64)
        w = md.input("w", [k, hin, g, hid], F64)

        def step(h, s):
            gates = md.conv(md.rename(h, hid="hid_in"), w, {"height": "kh"}, padding="same")
            h = md.tanh(md.reduce_sum(gates, "gate") + s["x"])
            return h, {"h": h}
        _, per = md.repeat(step, md.constant(0.0, [b, y, hid], dtype=F64), {"x": xs}, "time")
        loss = md.reduce_sum(per["h"] * per["h"])
        outs = {"loss": loss, **md.grad(loss, {"grad/w": w, "grad/xs": xs})}
        feeds = {n.name: torch.randn(n.shape.sizes, generator=gen, dtype=F64) for n in (xs, w)}
    plan = _dense_and_simulated(outs, feeds, "model:2", "height:model")
    assert _permute_bytes(plan, "backward") == [32] * 6, _permute_bytes(plan, "backward")
    assert any("the other way round" in n for n in plan.notes), plan.notes
