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
    return [(st.bytes, st.note) for st in plan.steps if st.kind == "permute" and st.phase == phase]


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
    shifts its own gradient (2 + 4 rows of 3 channels, not 4 rows of 8); numbers as dense."""
    outs, feeds = _shift_conv(c_out=8)
    plan = md.compile(outs, "data:2", "seq:data")
    row = 2 * 3 * 4   # batch x c_in float32s per seq row
    assert sorted(n for n, _ in _halos(plan, "backward")) == [2 * row, 4 * row]
    result = md.check(outs, "data:2", "seq:data", feeds)
    assert result.ok, str(result)


def test_the_tcn_as_shifts_moves_the_bytes_of_the_tcn_as_convs():
    """tests/heldout_tcn.py tiny under ``time:model`` on 3 ranks: the shift form now trades what
    the conv form (``md.conv(..., dilation=d)``) does, 15 KiB a step (it traded 18.75 KiB)."""
    def permutes(form: str) -> dict:
        model = md.load_model(TCN, tiny=True, form=form)
        return md.compile(heldout_outputs(model), "model:3", "time:model").totals()["permute"]
    assert permutes("shift") == permutes("conv") == {"count": 32, "bytes": 15360}
