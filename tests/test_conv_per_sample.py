"""``md.conv(..., per=)``: per-sample and per-group weights (meshdsl/ops/conv.py, lowering/conv.py).

StyleGAN2's modulated conv holds one 3x3 filter bank per sample, ``w [batch, kh, kw, c_in,
c_out]``.  The dense program meets two references: torch's grouped conv (the batch as groups),
on both kernel paths, and the same conv written as one einsum per tap over shifted inputs
(the form StyleGAN2 had before ``per=``).  Layouts against the dense program: batch split
(every rank its own samples and filters, no collective), height split evenly and unevenly
(halo permutes, as a shared-weight conv trades), channel splits (a partial sum, as today).
Sizes: batch 4, 6x6 (5 rows on data:3), channels 4 -> 2, 3x3 taps.
"""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import meshdsl as md
from conftest import assert_heldout_case_matches_dense, heldout_outputs

F64 = torch.float64
CONV = importlib.import_module("meshdsl.ops.conv")
TAPS = {"height": "kh", "width": "kw"}


def _dims(res=6):
    return dict(b=md.Dim("batch", 4), h=md.Dim("height", res), w=md.Dim("width", res), c=md.Dim("channels", 4),
                o=md.Dim("c_out", 2), kh=md.Dim("kh", 3), kw=md.Dim("kw", 3))


def _values(d, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(d["b"].size, d["h"].size, d["w"].size, d["c"].size, generator=gen, dtype=dtype)
    w = torch.randn(d["b"].size, 3, 3, d["c"].size, d["o"].size, generator=gen, dtype=dtype)
    return x, w


def _graph(d, form: str, dtype=torch.float32, **kw):
    """y of a per-sample 3x3 'same' conv (``form``: ``conv`` by md.conv, ``einsum`` by shifted
    einsums), a cotangent's loss and its gradients of x and w."""
    x = md.input("x", [d["b"], d["h"], d["w"], d["c"]], dtype)
    w = md.input("w", [d["b"], d["kh"], d["kw"], d["c"], d["o"]], dtype)
    if form == "conv":
        y = md.conv(x, w, TAPS, per="batch", **kw)
    else:
        y = None
        for i in range(3):
            for j in range(3):
                xs = md.shift(md.shift(x, "height", 1 - i), "width", 1 - j)
                tap = md.squeeze(md.squeeze(md.slice_(md.slice_(w, "kh", i, i + 1), "kw", j, j + 1), "kh"), "kw")
                t = md.einsum("batch height width channels, batch channels c_out -> batch height width c_out", xs, tap)
                y = t if y is None else y + t
    cot = md.input("cot", y.shape, dtype)
    gx, gw = md.grad(md.reduce_sum(y * cot), [x, w])
    return {"y": y, "gx": gx, "gw": gw}


@pytest.mark.parametrize("small", [True, False], ids=["unfolded", "grouped"])
def test_per_sample_matches_torch_grouped_conv_and_the_einsum_form(small, monkeypatch):
    """Forward and both gradients, both kernel paths, against torch (batch as groups) and the
    shifted-einsum form's dense program."""
    monkeypatch.setattr(CONV, "SMALL_MACS", 1 << 62 if small else 0)
    d = _dims()
    xv, wv = _values(d, 0, F64)
    cv = torch.randn(4, 6, 6, 2, generator=torch.Generator().manual_seed(1), dtype=F64)
    feeds = {"x": xv, "w": wv, "cot": cv}
    with md.Graph():
        got = md.run_dense(_graph(d, "conv", F64), feeds)
    with md.Graph():
        einsum_form = md.run_dense(_graph(d, "einsum", F64), feeds)
    xt, wt = xv.clone().requires_grad_(), wv.clone().requires_grad_()
    flat = F.pad(xt.permute(0, 3, 1, 2).reshape(1, 16, 6, 6), (1, 1, 1, 1))
    want = F.conv2d(flat, wt.permute(0, 4, 3, 1, 2).reshape(8, 4, 3, 3), groups=4)
    want = want.reshape(4, 2, 6, 6).permute(0, 2, 3, 1)
    want_gx, want_gw = torch.autograd.grad((want * cv).sum(), [xt, wt])
    # float64, the same products summed in another order: rounding only (~1e-15 of values O(10)).
    for k, ref in (("y", want), ("gx", want_gx), ("gw", want_gw)):
        torch.testing.assert_close(got[k], ref.detach(), rtol=1e-12, atol=1e-12, msg=lambda m, k=k: f"{k}: {m}")
        torch.testing.assert_close(got[k], einsum_form[k], rtol=1e-12, atol=1e-12, msg=lambda m, k=k: f"{k}: {m}")


def test_per_group_strided_dilated_matches_a_loop_over_groups():
    """w [groups, tap, c_in, c_out] against x [batch, seq, groups, c_in], stride 2, dilation 2:
    each group's slice is a plain md.conv with its own filter (forward and both gradients)."""
    gen = torch.Generator().manual_seed(2)
    b, s, g, c, o, k = 2, 11, 3, 2, 4, 3
    xv = torch.randn(b, s, g, c, generator=gen, dtype=F64)
    wv = torch.randn(g, k, c, o, generator=gen, dtype=F64)
    dims = dict(b=md.Dim("batch", b), s=md.Dim("seq", s), g=md.Dim("groups", g), c=md.Dim("c_in", c),
                o=md.Dim("c_out", o), k=md.Dim("tap", k))
    kw = dict(padding="same", stride=2, dilation=2)
    with md.Graph():
        x = md.input("x", [dims["b"], dims["s"], dims["g"], dims["c"]], F64)
        w = md.input("w", [dims["g"], dims["k"], dims["c"], dims["o"]], F64)
        y = md.conv(x, w, {"seq": "tap"}, per="groups", **kw)
        cot = md.input("cot", y.shape, F64)
        cv = torch.randn(y.shape.sizes, generator=gen, dtype=F64)
        got = md.run_dense({"y": y, **dict(zip(("gx", "gw"), md.grad(md.reduce_sum(y * cot), [x, w])))},
                           {"x": xv, "w": wv, "cot": cv})
    assert y.shape.names == ("batch", "seq", "groups", "c_out")
    for i in range(g):
        with md.Graph():
            xi = md.input("x", [dims["b"], dims["s"], dims["c"]], F64)
            wi = md.input("w", [dims["k"], dims["c"], dims["o"]], F64)
            yi = md.conv(xi, wi, {"seq": "tap"}, **kw)
            ci = md.input("cot", yi.shape, F64)
            gxi, gwi = md.grad(md.reduce_sum(yi * ci), [xi, wi])
            want = md.run_dense({"y": yi, "gx": gxi, "gw": gwi}, {"x": xv[:, :, i], "w": wv[i], "cot": cv[:, :, i]})
        # float64, the same products in the same order per group: rounding only.
        torch.testing.assert_close(got["y"][:, :, i], want["y"], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["gx"][:, :, i], want["gx"], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["gw"][i], want["gw"], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mesh, layout, res, kinds", [
    ("data:2", "batch:data", 6, set()),                                   # each rank its samples: all local
    ("data:2", "height:data", 6, {"permute", "allreduce"}),               # halos; dw summed over the rows
    ("data:3", "height:data", 5, {"permute", "allreduce"}),               # uneven rows: 2, 2, 1
    ("data:2; model:2", "batch:data; channels:model", 6, {"allreduce"}),  # c_in split: a partial y
    ("data:2; model:2", "height:data; c_out:model", 6, {"permute", "allreduce"}),
])
def test_per_sample_layouts_match_dense(mesh, layout, res, kinds):
    """The per-sample conv's y and gradients under data, spatial (even, uneven) and channel splits
    give the dense numbers; halo permutes only under a spatial split, never a gather."""
    d = _dims(res)
    xv, wv = _values(d, 3)
    cv = torch.randn(4, res, res, 2, generator=torch.Generator().manual_seed(4))
    with md.Graph():
        outs = _graph(d, "conv")
        result = md.check(outs, mesh, layout, {"x": xv, "w": wv, "cot": cv})
        assert result.ok, str(result)
        totals = md.compile(outs, mesh, layout).totals()
    assert set(totals) == kinds, totals


@pytest.mark.parametrize("w_dims, per, match", [
    (["batch", "kh", "kw", "c_out", "extra"], "batch", "are not one channel dim x has"),
    (["batch", "kh", "kw", "channels", "c_out"], (), r"ambiguous[\s\S]*did you mean per='batch'"),
    (["kh", "kw", "channels", "c_out"], "batch", "per names 'batch', which is not a dim of w"),
    (["batch", "kh", "kw", "channels", "c_out"], "time", "per names 'time', which is not a dim of x"),
    (["batch", "kh", "kw", "channels", "c_out"], ["batch", "channels"], "are not one channel dim x has"),
    (["batch", "kh", "kw", "channels", "c_out"], 3, "per=3 is not a dim name"),
])
def test_bad_per_sample_calls_are_clear_errors(w_dims, per, match):
    d = {**_dims(), "extra": md.Dim("extra", 2)}
    by_name = {v.name: v for v in d.values()}
    with md.Graph():
        x = md.input("x", [d["b"], d["h"], d["w"], d["c"]])
        w = md.input("w", [by_name[n] for n in w_dims])
        with pytest.raises(md.ShapeError, match=match) as e:
            md.conv(x, w, TAPS, per=per)
    assert "Fix:" in str(e.value)


STYLEGAN = str(Path(__file__).parent / "heldout_stylegan.py")


def test_stylegan_per_sample_conv_is_the_shifted_einsum_form():
    """tests/heldout_stylegan.py ``form=conv`` (one md.conv per layer, per='batch') against
    ``form=fused`` (one einsum per tap): the same model, loss and every gradient (tiny, dense)."""
    got, want = (_stylegan_dense({"form": form, "loss": "regress"}) for form in ("conv", "fused"))
    top = max(float(w.abs().max()) for k, w in want.items() if k.startswith("grad/"))
    for k, w in want.items():
        # fp32, the same products summed in another order (~1e-7 of each magnitude); a wrong tap
        # or filter is off by O(1).  Gradients at the scale of the largest one, as md.check's.
        scale = top if k.startswith("grad/") else float(w.abs().max())
        torch.testing.assert_close(got[k], w, rtol=0, atol=1e-5 * scale, msg=lambda m, k=k: f"{k}: {m}")


def test_stylegan_per_sample_conv_under_an_uneven_height_split_trades_halos():
    """The conv form under ``height:data`` on 3 ranks (6 rows: 2 each) matches the dense program,
    its per-sample convs trading halo rows: the forward gathers nothing along height."""
    assert_heldout_case_matches_dense((STYLEGAN, {"form": "conv", "loss": "regress"}, "data:3", "height:data"))
    m = md.load_model(STYLEGAN, tiny=True, form="conv", loss="regress")
    plan = md.compile(heldout_outputs(m), "data:3", "height:data")
    kinds = {s.kind for s, _ in plan.collectives()}
    assert "permute" in kinds, kinds
    gathers = [s.note for s, _ in plan.collectives() if s.kind == "allgather" and s.phase == "forward"]
    assert not gathers, gathers


def _stylegan_dense(over):
    m = md.load_model(STYLEGAN, tiny=True, **over)
    return md.run_dense(heldout_outputs(m), m.feeds(0))
