"""md.conv_transpose (meshdsl/ir/conv_transpose.py): torch's transposed convolution over named dims,
built as the input gradient of the strided conv it transposes.

torch's ``conv_transpose1d``/``conv_transpose2d`` with autograd, and the dense program under split
layouts and a pipelined stack, are the oracles.  Built from the strided conv's backward, it runs no
forward conv of the zero it differentiates at and inserts no zeros between the input's positions.

Legend: batch 2, height 4-5, width 5, cin 3, cout 2, taps 3-4.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import meshdsl as md
from meshdsl.errors import ShapeError

# fp32 sums of O(10) products in another order than torch's kernel: rounding only
TOL = dict(rtol=1e-5, atol=1e-5)


def _model(h: int, k: int, two_d: bool, **kw):
    spatial = [md.Dim("height", h)] + ([md.Dim("width", 5)] if two_d else [])
    taps = {"height": "kh", **({"width": "kw"} if two_d else {})}
    x = md.input("x", [md.Dim("batch", 2), *spatial, md.Dim("cin", 3)])
    w = md.param("w", [md.Dim(t, k) for t in taps.values()] + [md.Dim("cin", 3), md.Dim("cout", 2)])
    out = md.conv_transpose(x, w, taps, **kw)
    loss = md.reduce_sum(out * out)
    gx, gw = md.grad(loss, [x, w])
    return {"out": out, "gx": gx, "gw": gw}


def _values(h: int, k: int, two_d: bool):
    gen = torch.Generator().manual_seed(h * 10 + k)
    spatial = (h, 5) if two_d else (h,)
    return ({"x": torch.randn(2, *spatial, 3, generator=gen)},
            {"w": torch.randn(*([k] * len(spatial)), 3, 2, generator=gen) * 0.5})


@pytest.mark.parametrize("h, k, two_d, kw", [
    (4, 4, True, dict(stride=2, padding=1)),                        # a DCGAN generator's layer
    (5, 3, True, dict(stride=2, padding=1, output_padding=1)),
    (4, 3, False, dict(stride=3)),
    (5, 3, False, dict(stride=1, padding=1)),
    (4, 3, False, dict(stride=2, dilation=2, padding=2)),
    (4, 3, True, dict(stride={"height": 2, "width": 1}, padding={"height": 1, "width": 0})),
])
def test_dense_forward_and_gradients_are_torchs(h, k, two_d, kw):
    with md.Graph():
        outs = _model(h, k, two_d, **kw)
        feeds, params = _values(h, k, two_d)
        got = md.run_dense(outs, feeds, params)
    n = 2 if two_d else 1
    perm_x, perm_w = (0, n + 1, *range(1, n + 1)), (n, n + 1, *range(n))
    x = feeds["x"].permute(perm_x).clone().requires_grad_()
    w = params["w"].permute(perm_w).clone().requires_grad_()
    args = {a: (tuple(v.values()) if isinstance(v, dict) else v) for a, v in kw.items()}
    y = (F.conv_transpose2d if two_d else F.conv_transpose1d)(x, w, **args)
    gx, gw = torch.autograd.grad((y * y).sum(), [x, w])
    back = tuple(sorted(range(n + 2), key=lambda i: perm_x[i]))
    torch.testing.assert_close(got["out"], y.detach().permute(0, *range(2, n + 2), 1), **TOL)
    torch.testing.assert_close(got["gx"], gx.permute(back), **TOL)
    torch.testing.assert_close(got["gw"], gw.permute(*range(2, n + 2), 0, 1), **TOL)


@pytest.mark.parametrize("mesh, layout", [("model:2", "height:model"), ("model:3", "height:model"),
                                          ("model:2", "cout:model"), ("model:2", "cin:model"),
                                          ("a:2; b:2", "batch:a, width:b")])
def test_split_layouts_match_the_dense_program(mesh, layout):
    with md.Graph():
        outs = _model(4, 4, True, stride=2, padding=1)
        feeds, params = _values(4, 4, True)
        plan = md.compile(outs, mesh, layout)
        got, want = md.run_simulated(plan, feeds, params), md.run_dense(outs, feeds, params)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_no_forward_conv_runs_and_a_split_height_trades_halos():
    with md.Graph():
        outs = _model(4, 4, False, stride=2, padding=1)
        plan = md.compile({"out": outs["out"]}, "model:2", "height:model")
    assert not any(s.op == "conv" and s.label == "conv" for s in plan.steps)   # the conv of the zero
    assert {s.kind for s, _ in plan.collectives()} <= {"permute"}


def test_a_pipelined_stack_of_up_and_down_convs_matches_dense():
    """Each layer upsamples by a transposed conv and comes back by a strided conv (a U-Net level)."""
    L = md.Dim("layer", 2)
    with md.Graph():
        x = md.input("x", [md.Dim("batch", 4), md.Dim("height", 6), md.Dim("ch", 3)])
        wt = md.param("wt", [L, md.Dim("kh", 4), md.Dim("ch", 3), md.Dim("up", 2)])
        wc = md.param("wc", [L, md.Dim("kc", 4), md.Dim("up", 2), md.Dim("ch2", 3)])

        def block(h, p):
            u = md.tanh(md.conv_transpose(h, p["wt"], {"height": "kh"}, stride=2, padding=1))
            return h + md.rename(md.conv(u, p["wc"], {"height": "kc"}, stride=2, padding=(1, 1)), {"ch2": "ch"})
        loss = md.reduce_mean(md.repeat(block, x, {"wt": wt, "wc": wc}, L) ** 2)
        outs = {"loss": loss, **{f"d{k}": v for k, v in md.grad(loss, {"x": x, "wt": wt, "wc": wc}).items()}}
        gen = torch.Generator().manual_seed(0)
        feeds = {"x": torch.randn(4, 6, 3, generator=gen)}
        params = {"wt": torch.randn(2, 4, 3, 2, generator=gen) * 0.3, "wc": torch.randn(2, 4, 2, 3, generator=gen) * 0.3}
        want = md.run_dense(outs, feeds, params)
        for mesh, layout in (("stage:2; data:2", "layer:stage, batch:data"), ("model:2", "height:model")):
            plan = md.compile(outs, mesh, layout, microbatches=2 if "stage" in mesh else 1)
            got = md.run_simulated(plan, feeds, params)
            for name in want:
                torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m, n=name: f"{mesh} {n}: {m}")


def test_errors_name_what_was_wrong_and_the_fix():
    with md.Graph():
        x = md.input("x", [md.Dim("batch", 2), md.Dim("height", 4), md.Dim("cin", 3)])
        w = md.param("w", [md.Dim("kh", 3), md.Dim("cin", 3), md.Dim("cout", 2)])
        with pytest.raises(ShapeError, match=r"taps=\{'h': 'kh'\} must map spatial dims"):
            md.conv_transpose(x, w, {"h": "kh"})
        with pytest.raises(ShapeError, match=r"output_padding 2 along 'height' is not less than the stride \(2\)"):
            md.conv_transpose(x, w, {"height": "kh"}, stride=2, output_padding=2)
        with pytest.raises(ShapeError, match=r"padding \(3, 3\) along 'height' crops more than the kernel's reach, 2"):
            md.conv_transpose(x, w, {"height": "kh"}, padding=3)
        with pytest.raises(ShapeError, match=r"stride 0 for 'height' is not a positive int"):
            md.conv_transpose(x, w, {"height": "kh"}, stride=0)
        w2 = md.param("w2", [md.Dim("kh", 3), md.Dim("c", 3), md.Dim("cout", 2)])
        with pytest.raises(ShapeError, match=r"are not one channel dim of x \(c_in\) and one it lacks"):
            md.conv_transpose(x, w2, {"height": "kh"})
