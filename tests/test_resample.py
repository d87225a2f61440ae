"""md.upsample (meshdsl/ops/resample.py): nearest and (bi)linear upsampling by whole factors.

torch's ``F.interpolate(scale_factor=s, align_corners=False)`` and the dense program are the
oracles.  Nearest keeps an even split of the scaled dim split and moves nothing; linear mixes
neighbouring rows, so an even split trades one-row halos.

Legend: batch 2, height 4, width 5, ch 3.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import meshdsl as md
from meshdsl.errors import ShapeError


def _upsampled(mode: str, s: int):
    x = md.input("x", [md.Dim("batch", 2), md.Dim("height", 4), md.Dim("width", 5), md.Dim("ch", 3)])
    y = md.upsample(x, {"height": s, "width": s}, mode=mode)
    cot = md.input("cot", y.shape)
    (gx,) = md.grad(md.reduce_sum(y * cot), [x])
    return {"y": y, "gx": gx}


def _feeds(outs) -> dict:
    gen = torch.Generator().manual_seed(0)
    return {"x": torch.randn(2, 4, 5, 3, generator=gen), "cot": torch.randn(*outs["y"].shape.sizes, generator=gen)}


@pytest.mark.parametrize("mode, s", [("nearest", 2), ("nearest", 3), ("bilinear", 2), ("bilinear", 3)])
def test_dense_forward_and_gradient_are_torchs(mode, s):
    with md.Graph():
        outs = _upsampled(mode, s)
        feeds = _feeds(outs)
        got = md.run_dense(outs, feeds)
    x = feeds["x"].permute(0, 3, 1, 2).clone().requires_grad_()
    y = F.interpolate(x, scale_factor=s, mode=mode, **({} if mode == "nearest" else {"align_corners": False}))
    (gx,) = torch.autograd.grad((y * feeds["cot"].permute(0, 3, 1, 2)).sum(), [x])
    assert outs["y"].shape.sizes == (2, 4 * s, 5 * s, 3)
    # nearest copies: bit-equal; linear weighs two positions with weights rounded alike, up to fp32
    # rounding of the sum; the gradients sum the cotangents in another order
    tol = 0 if mode == "nearest" else 1e-6
    torch.testing.assert_close(got["y"], y.permute(0, 2, 3, 1).detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(got["gx"], gx.permute(0, 2, 3, 1), rtol=2e-6, atol=2e-6)


def test_linear_on_one_dim_is_torchs_linear():
    with md.Graph():
        x = md.input("x", [md.Dim("batch", 2), md.Dim("ch", 3), md.Dim("seq", 6)])
        y = md.upsample(x, {"seq": 2}, mode="linear")
        feeds = {"x": torch.randn(2, 3, 6, generator=torch.Generator().manual_seed(1))}
        got = md.run_dense({"y": y}, feeds)
    want = F.interpolate(feeds["x"], scale_factor=2, mode="linear", align_corners=False)
    torch.testing.assert_close(got["y"], want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
@pytest.mark.parametrize("mesh, layout", [("model:2", "height:model"), ("model:3", "width:model"),
                                          ("a:2; b:2", "batch:a, ch:b")])
def test_split_layouts_match_the_dense_program(mode, mesh, layout):
    with md.Graph():
        outs = _upsampled(mode, 2)
        plan = md.compile(outs, mesh, layout)
        feeds = _feeds(outs)
        got, want = md.run_simulated(plan, feeds), md.run_dense(outs, feeds)
    for name in want:
        # a split contraction sums its parts in another order: fp32 rounding of values O(1)
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_nearest_keeps_an_even_split_split():
    with md.Graph():
        plan = md.compile(_upsampled("nearest", 2), "model:2", "height:model")
    assert list(plan.collectives()) == []


def test_bilinear_over_an_even_split_trades_one_row_each_way():
    """Each output row mixes two neighbouring input rows, so a rank needs one row from each
    neighbour: 4 permutes of one [batch, 1, width, ch] row (forward and the gradient back), where
    a table einsum over the split dim gathered x and its gradient whole (2 allgathers, 720 B here,
    growing with the dim where the halo does not)."""
    with md.Graph():
        plan = md.compile(_upsampled("bilinear", 2), "model:2", "height:model")
    row = 2 * 1 * 5 * 3 * 4
    assert plan.totals() == {"permute": {"count": 4, "bytes": 4 * row}}


def test_errors_name_what_was_wrong_and_the_fix():
    with md.Graph():
        x = md.input("x", [md.Dim("batch", 2), md.Dim("height", 4)])
        with pytest.raises(ShapeError, match=r"scale names 'heigth', which is not a dim .* Did you mean 'height'"):
            md.upsample(x, {"heigth": 2})
        with pytest.raises(ShapeError, match=r"(?s)factor 1.5 along 'height' is not a positive int.*einsum"):
            md.upsample(x, {"height": 1.5})
        with pytest.raises(ShapeError, match=r"mode='bicubic' is not one of"):
            md.upsample(x, {"height": 2}, mode="bicubic")
        with pytest.raises(ShapeError, match=r"not a dict spatial dim -> factor"):
            md.upsample(x, 2)
        i = md.input("i", [md.Dim("height", 4)], dtype=torch.int64)
        with pytest.raises(ShapeError, match=r"not a float tensor"):
            md.upsample(i, {"height": 2})
