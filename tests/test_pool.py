"""md.max_pool and md.avg_pool (meshdsl/ops/pool.py): windows over named spatial dims.

torch's ``max_pool2d``/``avg_pool2d``/``max_pool1d`` and the dense program are the oracles.  A
pool is built from slices of the padded input's stride phases, so a split spatial dim trades
halos (permutes) and gives the dense program's numbers; a window that tiles the split (2x2,
stride 2, on an even split) moves nothing.

Legend: batch 2, height/width 5-9, ch 3.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import meshdsl as md
from meshdsl.errors import ShapeError

B, C = 2, 3


def _pooled(h: int, w: int, kind: str, k, stride, padding, cip=True):
    x = md.input("x", [md.Dim("batch", B), md.Dim("height", h), md.Dim("width", w), md.Dim("ch", C)])
    kh, kw = (k, k) if isinstance(k, int) else k
    extra = {} if kind == "max" else {"count_include_pad": cip}
    pool = md.max_pool if kind == "max" else md.avg_pool
    y = pool(x, {"height": kh, "width": kw}, stride=stride, padding=padding, **extra)
    cot = md.input("cot", y.shape)
    (gx,) = md.grad(md.reduce_sum(y * cot), [x])
    return {"y": y, "gx": gx}


def _feeds(h: int, w: int, outs) -> dict:
    gen = torch.Generator().manual_seed(0)
    return {"x": torch.randn(B, h, w, C, generator=gen),
            "cot": torch.randn(*outs["y"].shape.sizes, generator=gen)}


CASES = [  # (kind, height, width, window, stride, padding, count_include_pad)
    ("max", 7, 6, 3, 2, 1, True),        # a ResNet stem's pool
    ("max", 9, 5, 3, 1, 1, True),
    ("max", 8, 8, 2, None, 0, True),     # stride defaults to the window
    ("max", 7, 8, (3, 2), {"height": 2, "width": 1}, {"height": 1, "width": 0}, True),
    ("avg", 8, 8, 2, 2, 0, True),
    ("avg", 7, 7, 3, 2, 1, True),
    ("avg", 7, 7, 3, 2, 1, False),       # divide by the positions of x in each window
    ("avg", 6, 9, 3, 3, 0, True),
]


def _torch_pool(x, kind, k, stride, padding, cip):
    stride = k if stride is None else stride
    stride, padding = (tuple(v.values()) if isinstance(v, dict) else v for v in (stride, padding))
    if kind == "max":
        return F.max_pool2d(x, k, stride, padding)
    return F.avg_pool2d(x, k, stride, padding, count_include_pad=cip)


@pytest.mark.parametrize("kind, h, w, k, stride, padding, cip", CASES)
def test_dense_forward_and_gradient_are_torchs(kind, h, w, k, stride, padding, cip):
    with md.Graph():
        outs = _pooled(h, w, kind, k, stride, padding, cip)
        feeds = _feeds(h, w, outs)
        got = md.run_dense(outs, feeds)
    x = feeds["x"].permute(0, 3, 1, 2).clone().requires_grad_()
    y = _torch_pool(x, kind, k, stride, padding, cip)
    (gx,) = torch.autograd.grad((y * feeds["cot"].permute(0, 3, 1, 2)).sum(), [x])
    # a max picks an element: bit-equal (random inputs: no ties); a mean sums in another order, and
    # an element in several windows sums their cotangents in another order: fp32 rounding
    tol = 0 if kind == "max" else 1e-6
    torch.testing.assert_close(got["y"], y.permute(0, 2, 3, 1).detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(got["gx"], gx.permute(0, 2, 3, 1), rtol=1e-6, atol=1e-6)


def test_one_dim_and_a_dim_given_as_a_Dim():
    with md.Graph():
        seq = md.Dim("seq", 9)
        x = md.input("x", [md.Dim("batch", B), md.Dim("ch", C), seq])
        y = md.max_pool(x, {seq: 3}, stride=2, padding="valid")
        feeds = {"x": torch.randn(B, C, 9, generator=torch.Generator().manual_seed(1))}
        got = md.run_dense({"y": y}, feeds)
    assert y.shape.names == ("batch", "ch", "seq") and y.shape.get("seq").size == 4
    torch.testing.assert_close(got["y"], F.max_pool1d(feeds["x"], 3, 2), rtol=0, atol=0)


@pytest.mark.parametrize("kind, h, w, k, stride, padding, cip", [CASES[0], CASES[2], CASES[4], CASES[6]])
@pytest.mark.parametrize("mesh, layout", [
    ("model:2", "height:model"),
    ("model:3", "height:model"),          # uneven: 7 or 8 rows over 3
    ("a:2; b:2", "batch:a, width:b"),
    ("model:2", "ch:model"),
])
def test_split_layouts_match_the_dense_program(kind, h, w, k, stride, padding, cip, mesh, layout):
    with md.Graph():
        outs = _pooled(h, w, kind, k, stride, padding, cip)
        plan = md.compile(outs, mesh, layout)
        feeds = _feeds(h, w, outs)
        got, want = md.run_simulated(plan, feeds), md.run_dense(outs, feeds)
    for name in want:
        # the same kernels on each rank's rows: equal to the dense program's bits
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("kind", ["max", "avg"])
def test_a_window_that_tiles_an_even_split_moves_nothing(kind):
    """2x2 windows at stride 2 over 8 rows split in 2: each rank pools its own 4 rows."""
    with md.Graph():
        plan = md.compile(_pooled(8, 8, kind, 2, 2, 0), "model:2", "height:model")
    assert list(plan.collectives()) == []


def test_stride_one_trades_halos_not_the_whole_dim():
    with md.Graph():
        plan = md.compile(_pooled(9, 5, "max", 3, 1, 1), "model:2", "height:model")
    assert {s.kind for s, _ in plan.collectives()} == {"permute"}


def test_a_resnet_stem_pool_over_an_even_split_sends_one_halo_each_way():
    """3x3 windows at stride 2, padding 1, 16 rows over 2 ranks: each rank's first window reaches
    one row back into its neighbour's phase, so one permute forward and one for the gradient."""
    with md.Graph():
        outs = _pooled(16, 16, "max", 3, 2, 1)
        plan = md.compile(outs, "model:2", "height:model")
        feeds = _feeds(16, 16, outs)
        got, want = md.run_simulated(plan, feeds), md.run_dense(outs, feeds)
    assert [s.kind for s, _ in plan.collectives()] == ["permute", "permute"]
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_inside_a_repeat_matches_dense():
    """A stack of (conv-free) blocks h + max_pool(tanh(h @ w), 3x3, stride 1, 'same'), height split."""
    L = md.Dim("layer", 2)
    with md.Graph():
        x = md.input("x", [md.Dim("batch", B), md.Dim("height", 6), md.Dim("width", 5), md.Dim("ch", C)])
        w = md.param("w", [L, md.Dim("ch", C), md.Dim("c2", C)])

        def block(h, p):
            z = md.rename(md.tanh(md.einsum("batch height width ch, ch c2 -> batch height width c2", h, p["w"])),
                          {"c2": "ch"})
            return h + md.max_pool(z, {"height": 3, "width": 3}, stride=1, padding="same")
        loss = md.reduce_sum(md.repeat(block, x, {"w": w}, L) ** 2)
        outs = {"loss": loss, **{f"d{k}": g for k, g in md.grad(loss, {"x": x, "w": w}).items()}}
        plan = md.compile(outs, "model:2", "height:model")
        feeds = {"x": torch.randn(B, 6, 5, C, generator=torch.Generator().manual_seed(2))}
        params = {"w": torch.randn(2, C, C, generator=torch.Generator().manual_seed(3))}
        got, want = md.run_simulated(plan, feeds, params), md.run_dense(outs, feeds, params)
    for k in want:
        # fp32: the loss and w's gradient sum the ranks' rows in another order
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_errors_name_what_was_wrong_and_the_fix():
    with md.Graph():
        x = md.input("x", [md.Dim("batch", 2), md.Dim("height", 5), md.Dim("width", 5)])
        with pytest.raises(ShapeError, match=r"window names 'heigth', which is not a dim .* Did you mean 'height'"):
            md.max_pool(x, {"heigth": 2})
        with pytest.raises(ShapeError, match=r"window length 0 along 'height' is not a positive int"):
            md.max_pool(x, {"height": 0})
        with pytest.raises(ShapeError, match=r"not a dict spatial dim -> window length"):
            md.avg_pool(x, 2)
        with pytest.raises(ShapeError, match=r"padding \(2, 2\) along 'height' is outside 0..1"):
            md.max_pool(x, {"height": 2}, padding=2)
        with pytest.raises(ShapeError, match=r"stride names 'width', which is not a spatial dim"):
            md.max_pool(x, {"height": 2}, stride={"width": 2})
        with pytest.raises(ShapeError, match=r"stride 0 for 'height' is not a positive int"):
            md.avg_pool(x, {"height": 2}, stride=0)
        with pytest.raises(ShapeError, match=r"padding 'full' for 'height'"):
            md.avg_pool(x, {"height": 2}, padding="full")
        with pytest.raises(ShapeError, match=r"count_include_pad='no' is not a bool"):
            md.avg_pool(x, {"height": 2}, count_include_pad="no")
        with pytest.raises(ShapeError, match=r"'height' has 5 positions, 0 padded, fewer than its window 6"):
            md.max_pool(x, {"height": 6})
        i = md.input("i", [md.Dim("height", 4)], dtype=torch.int64)
        with pytest.raises(ShapeError, match=r"(?s)not a float tensor.*md.cast"):
            md.max_pool(i, {"height": 2})
