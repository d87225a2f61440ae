"""The backward of a conv written as shifts (meshdsl/ops/slicing.py ``shift_into``) over a split dim.

``sum_t einsum(shift(x, o_t), w_t)``: tap t's input gradient is the shift by ``-o_t`` of
``einsum(dy, w_t)``, a tensor of its own per tap, and each traded its own halo (taps 3 dilated
``d``: ``d + 2d`` rows where ``md.conv`` trades ``2d``).  Shifting ``dy`` inside the einsum
instead lets every tap read one halo of ``dy``, as wide as the widest.  The plan's halo permutes
and the numbers (against the dense program) are checked; a product that widens the rows (more
output channels than input ones) keeps its own shifts, since ``dy``'s rows would cost more.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import heldout_outputs

TCN = str(Path(__file__).parent / "heldout_tcn.py")


def _shift_conv(c_out: int, dilation: int = 2, seq: int = 12):
    """A causal conv of 3 taps ``dilation`` apart as shifts, its loss and gradients."""
    b, s, c, co, tap = (md.Dim("batch", 2), md.Dim("seq", seq), md.Dim("c_in", 3), md.Dim("c_out", c_out),
                        md.Dim("tap", 3))
    with md.Graph():
        x = md.input("x", [b, s, c])
        w = md.param("w", [tap, c, co], scale=1.0)
        y = None
        for t in range(3):
            wt = md.squeeze(md.slice_(w, "tap", t, t + 1), "tap")
            term = md.einsum("batch seq c_in, c_in c_out -> batch seq c_out", md.shift(x, "seq", dilation * (2 - t)), wt)
            y = term if y is None else y + term
        loss = md.reduce_mean(md.tanh(y) * md.cast(md.arange(s), torch.float32))
        outs = {"loss": loss, **md.grad(loss, {"grad/w": w, "grad/x": x})}
    return outs, {"x": torch.randn(2, seq, 3, generator=torch.Generator().manual_seed(0))}


def _halos(plan, phase: str) -> list[tuple[int, str]]:
    # (several to one neighbour go as one bucket_permute: lowering/coalesce.py)
    return [(st.bytes, st.note) for st in plan.steps if st.kind in ("permute", "bucket_permute") and st.phase == phase]


@pytest.mark.parametrize("mesh", ["data:2", "data:3"])
def test_the_taps_input_gradients_share_one_halo_of_the_output_gradient(mesh):
    """c_in = c_out = 3, dilation 2, seq 12: backward, one permute of 4 rows of dy (the widest
    tap's), where the taps' own halos were 2 + 4 rows; the numbers are the dense ones."""
    outs, feeds = _shift_conv(c_out=3)
    plan = md.compile(outs, mesh, "seq:data")
    back = _halos(plan, "backward")
    row = 2 * 3 * 4   # batch x c_out float32s per seq row
    assert [n for n, _ in back] == [4 * row], back
    assert "shared by 3 readers" in back[0][1], back   # the taps' shifts by -4, -2 and 0
    result = md.check(outs, mesh, "seq:data", feeds)
    assert result.ok, str(result)


def test_a_product_that_widens_the_rows_keeps_its_own_shifts():
    """c_out = 8 > c_in = 3: dy's rows are wider than each tap's gradient, so each tap still
    shifts its own gradient (2 + 4 rows of 3 channels, in one buffer, not 4 rows of 8); numbers as dense."""
    outs, feeds = _shift_conv(c_out=8)
    plan = md.compile(outs, "data:2", "seq:data")
    row = 2 * 3 * 4   # batch x c_in float32s per seq row
    assert [n for n, _ in _halos(plan, "backward")] == [2 * row + 4 * row]
    result = md.check(outs, "data:2", "seq:data", feeds)
    assert result.ok, str(result)


def test_the_tcn_as_shifts_moves_the_bytes_of_the_tcn_as_convs():
    """tests/heldout_tcn.py tiny under ``time:model`` on 3 ranks: the shift form now trades what
    the conv form (``md.conv(..., dilation=d)``) does, 15 KiB a step (it traded 18.75 KiB)."""
    def permutes(form: str) -> dict:
        model = md.load_model(TCN, tiny=True, form=form)
        return md.compile(heldout_outputs(model), "model:3", "time:model").totals()["permute"]
    assert permutes("shift") == permutes("conv") == {"count": 32, "bytes": 15360}


def test_a_depthwise_2d_convs_backward_shares_one_halo_of_the_output_gradient():
    """``md.conv`` builds a depthwise 2-D conv as ``shift(shift(x, height, o_h), width, o_w) *
    w_t`` summed over the taps. Tap t's input gradient was ``shift(shift(dy, width, -o_w), height,
    -o_h) * w_t``: its height shift read one tensor per ``o_w``, so under ``height:model`` each
    traded its own halo (a 5x5: 2 forward permutes, 18 backward). The height shift now goes
    inside, every tap shifts ``dy`` itself, and the backward trades one halo, as the forward does
    (ConvNeXt-V2's 7x7, tests/heldout_convnextv2.py: 38 backward permutes where 2 do)."""
    b, h, w, c = md.Dim("batch", 2), md.Dim("height", 8), md.Dim("width", 6), md.Dim("chan", 3)
    with md.Graph():
        x = md.input("x", [b, h, w, c])
        wt = md.param("w", [md.Dim("kh", 5), md.Dim("kw", 5), c], scale=1.0)
        y = md.conv(x, wt, {"height": "kh", "width": "kw"})
        loss = md.reduce_mean(md.tanh(y) * md.cast(md.arange(h), torch.float32))
        outs = {"loss": loss, **md.grad(loss, {"grad/w": wt, "grad/x": x})}
        plan = md.compile(outs, "model:2", "height:model")
    back, fwd = _halos(plan, "backward"), _halos(plan, "forward")
    assert len(back) == len(fwd) == 2, (fwd, back)   # 2 rows of dy from each neighbour, as of x
    feeds = {"x": torch.randn(2, 8, 6, 3, generator=torch.Generator().manual_seed(0))}
    want, got = md.run_dense(outs, feeds), md.run_simulated(plan, feeds)
    for k in want:
        # the same products summed in another order (a split height): fp32 rounding, ~1e-7 relative
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_a_depthwise_2d_conv_under_a_split_width_shares_one_halo_each_way():
    """Under ``width:model`` each width shift of ``md.conv``'s depthwise 2-D conv read its own
    height-shifted tensor (``shift(shift(x, height, o_h), width, o_w)``) and traded its own halo (a
    5x5: 18 forward permutes; with the backward mirrored, 18 backward). Shifts along two dims
    commute, so the lowering shifts ``x`` along the split width first (one shared exchange) and
    then along the whole height locally: 2 permutes each way, the numbers the dense ones."""
    b, h, w, c = md.Dim("batch", 2), md.Dim("height", 6), md.Dim("width", 8), md.Dim("chan", 3)
    with md.Graph():
        x = md.input("x", [b, h, w, c])
        wt = md.param("w", [md.Dim("kh", 5), md.Dim("kw", 5), c], scale=1.0)
        y = md.conv(x, wt, {"height": "kh", "width": "kw"})
        loss = md.reduce_mean(md.tanh(y) * md.cast(md.arange(w), torch.float32))
        outs = {"loss": loss, **md.grad(loss, {"grad/w": wt, "grad/x": x})}
        plan = md.compile(outs, "model:2", "width:model")
    back, fwd = _halos(plan, "backward"), _halos(plan, "forward")
    assert len(back) == len(fwd) == 2, (fwd, back)   # 2 width rows of x, then of dy, each way
    feeds = {"x": torch.randn(2, 6, 8, 3, generator=torch.Generator().manual_seed(0))}
    want, got = md.run_dense(outs, feeds), md.run_simulated(plan, feeds)
    for k in want:
        # the same products summed in another order (a split width): fp32 rounding, ~1e-7 relative
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
