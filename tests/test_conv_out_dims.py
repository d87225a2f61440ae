"""``md.conv`` with several output channel dims (meshdsl/ops/conv.py, lowering/conv.py).

A ConvLSTM computes its four gates with one conv whose weight is ``[kh, kw, c_in, gates, hid]``:
every dim of ``w`` that ``x`` lacks (and that is not a tap) is an output dim, the output gets all of
them in ``w``'s order in ``c_in``'s place, and a layout may split any of them.  The dense program
meets torch's conv with the output dims flattened into one ``c_out`` (both kernel paths, strided,
dilated, per-group); layouts splitting each output dim, both, one unevenly, with a batch and a
spatial split give the dense numbers, and a split output dim costs no collective in the forward.
A ConvLSTM cell with its gates as their own dim under ``hid:model`` has no permute and no allgather
but h's into the hidden state's conv (flattened to one ``gates`` dim of 4 x hid, the gates' gradients
are gathered too).
Sizes: batch 2, 5x4 images (5 rows on data:3), channels 3 -> gates 2 x hid 3 (hid 5 on model:3).
"""
from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

import meshdsl as md

F64 = torch.float64
CONV = importlib.import_module("meshdsl.ops.conv")
TAPS = {"height": "kh", "width": "kw"}


def _dims(hid=3, height=5):
    return dict(b=md.Dim("batch", 2), h=md.Dim("height", height), w=md.Dim("width", 4), c=md.Dim("c_in", 3),
                g=md.Dim("gates", 2), n=md.Dim("hid", hid), kh=md.Dim("kh", 3), kw=md.Dim("kw", 3))


def _conv_graph(d, dtype=torch.float32, **kw):
    """y of ``x [batch, height, width, c_in]`` and ``w [hid, kh, c_in, kw, gates]`` (the output dims
    apart and in another order than the flattened weight's), a cotangent's loss and its gradients."""
    x = md.input("x", [d["b"], d["h"], d["w"], d["c"]], dtype)
    w = md.input("w", [d["n"], d["kh"], d["c"], d["kw"], d["g"]], dtype)
    y = md.conv(x, w, TAPS, **kw)
    cot = md.input("cot", y.shape, dtype)
    gx, gw = md.grad(md.reduce_sum(y * cot), [x, w])
    return {"y": y, "gx": gx, "gw": gw}


def _feeds(d, seed, dtype=torch.float32, y_sizes=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(d["b"].size, d["h"].size, d["w"].size, d["c"].size, generator=gen, dtype=dtype)
    w = torch.randn(d["n"].size, 3, d["c"].size, 3, d["g"].size, generator=gen, dtype=dtype)
    y_sizes = y_sizes or (d["b"].size, d["h"].size, d["w"].size, d["n"].size, d["g"].size)
    return {"x": x, "w": w, "cot": torch.randn(y_sizes, generator=gen, dtype=dtype)}


@pytest.mark.parametrize("small", [True, False], ids=["unfolded", "torch"])
@pytest.mark.parametrize("kw", [{}, {"stride": 2, "dilation": {"width": 2}}], ids=["plain", "strided-dilated"])
def test_output_dims_match_torch_with_the_weight_flattened(small, kw, monkeypatch):
    """Forward and both gradients against F.conv2d with (hid, gates) flattened into c_out, on both
    kernel paths; y holds w's output dims in w's order where x held c_in."""
    monkeypatch.setattr(CONV, "SMALL_MACS", 1 << 62 if small else 0)
    d = _dims()
    with md.Graph():
        outs = _conv_graph(d, F64, **kw)
        assert outs["y"].shape.names == ("batch", "height", "width", "hid", "gates")
        feeds = _feeds(d, 0, F64, outs["y"].shape.sizes)
        got = md.run_dense(outs, feeds)
    xt, wt = feeds["x"].clone().requires_grad_(), feeds["w"].clone().requires_grad_()
    flat_w = wt.permute(0, 4, 2, 1, 3).reshape(6, 3, 3, 3)          # (hid gates, c_in, kh, kw)
    want = F.conv2d(xt.permute(0, 3, 1, 2), flat_w, padding=(1, 2) if kw else 1, stride=kw.get("stride", 1),
                    dilation=(1, 2) if kw else 1)
    want = want.reshape(2, 3, 2, *want.shape[2:]).permute(0, 3, 4, 1, 2)   # (batch, h, w, hid, gates)
    want_gx, want_gw = torch.autograd.grad((want * feeds["cot"]).sum(), [xt, wt])
    # float64, the same products summed in another order: rounding only (~1e-15 of values O(10)).
    for k, ref in (("y", want), ("gx", want_gx), ("gw", want_gw)):
        torch.testing.assert_close(got[k], ref.detach(), rtol=1e-12, atol=1e-12, msg=lambda m, k=k: f"{k}: {m}")


def test_per_group_weights_with_two_output_dims_match_a_loop_over_groups():
    """``per='groups'`` and two output dims: each group's slice is the conv of its own filter."""
    gen = torch.Generator().manual_seed(4)
    dims = dict(b=md.Dim("batch", 2), s=md.Dim("seq", 7), g=md.Dim("groups", 2), c=md.Dim("c_in", 2),
                o=md.Dim("gates", 2), n=md.Dim("hid", 3), k=md.Dim("tap", 3))
    xv = torch.randn(2, 7, 2, 2, generator=gen, dtype=F64)
    wv = torch.randn(2, 2, 3, 2, 3, generator=gen, dtype=F64)     # [gates, groups, tap, c_in, hid]
    cv = torch.randn(2, 7, 2, 2, 3, generator=gen, dtype=F64)
    with md.Graph():
        x = md.input("x", [dims["b"], dims["s"], dims["g"], dims["c"]], F64)
        w = md.input("w", [dims["o"], dims["g"], dims["k"], dims["c"], dims["n"]], F64)
        y = md.conv(x, w, {"seq": "tap"}, per="groups")
        assert y.shape.names == ("batch", "seq", "groups", "gates", "hid")
        cot = md.input("cot", y.shape, F64)
        got = md.run_dense({"y": y, **dict(zip(("gx", "gw"), md.grad(md.reduce_sum(y * cot), [x, w])))},
                           {"x": xv, "w": wv, "cot": cv})
    for i in range(2):
        xt, wt = xv[:, :, i].clone().requires_grad_(), wv[:, i].clone().requires_grad_()
        want = F.conv1d(xt.transpose(1, 2), wt.permute(0, 3, 2, 1).reshape(6, 2, 3), padding=1)
        want = want.reshape(2, 2, 3, 7).permute(0, 3, 1, 2)
        want_gx, want_gw = torch.autograd.grad((want * cv[:, :, i]).sum(), [xt, wt])
        # float64, the same products in another order: rounding only.
        torch.testing.assert_close(got["y"][:, :, i], want.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["gx"][:, :, i], want_gx, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["gw"][:, i], want_gw, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mesh, layout, hid, height", [
    ("model:2", "gates:model", 3, 5),
    ("model:3", "hid:model", 3, 5),
    ("data:2; model:3", "gates:data; hid:model", 3, 5),
    ("model:3", "hid:model", 5, 5),                                      # uneven: 2, 2, 1 channels
    ("data:2; model:3", "batch:data; hid:model", 3, 5),
    ("data:3; model:2", "height:data; gates:model", 3, 5),               # uneven rows 2, 2, 1: halos
])
def test_split_output_dims_match_dense(mesh, layout, hid, height):
    """y and both gradients under layouts splitting either output dim, both, one unevenly, with a
    batch and a spatial split; the forward alone moves nothing but a spatial split's halos."""
    d = _dims(hid, height)
    with md.Graph():
        outs = _conv_graph(d)
        result = md.check(outs, mesh, layout, _feeds(d, 1))
        assert result.ok, str(result)
        forward = md.compile({"y": outs["y"]}, mesh, layout).totals()
    assert set(forward) <= ({"permute"} if "height" in layout else set()), forward


def _cell(d, flat: bool):
    """One ConvLSTM step: the four gates from a conv of the frame and one of h (``flat``: one
    ``gates`` dim of 4 x hid sliced apart, else ``[gate, hid]``), ``c' = f c + i g``, ``h' = o
    tanh(c')``; the loss reads h' and c'."""
    n, gate = d["n"], md.Dim("gate", 4)
    out = [md.Dim("gates", 4 * n.size)] if flat else [gate, n]
    x = md.input("x", [d["b"], d["h"], d["w"], d["c"]])
    h = md.input("h", [d["b"], d["h"], d["w"], n])
    c = md.input("c", [d["b"], d["h"], d["w"], n])
    wx = md.param("wx", [d["kh"], d["kw"], d["c"], *out])
    wh = md.param("wh", [d["kh"], d["kw"], md.Dim("hid_in", n.size), *out])
    gates = md.conv(x, wx, TAPS) + md.conv(md.rename(h, hid="hid_in"), wh, TAPS)
    if flat:
        i, f, o, g = (md.rename(md.slice_(gates, "gates", k * n.size, (k + 1) * n.size), gates="hid")
                      for k in range(4))
    else:
        i, f, o, g = (md.squeeze(md.slice_(gates, "gate", k, k + 1), "gate") for k in range(4))
    c = md.sigmoid(f) * c + md.sigmoid(i) * md.tanh(g)
    h = md.sigmoid(o) * md.tanh(c)
    return md.reduce_sum(h * h) + md.reduce_sum(c)


def _moves(plan) -> list[tuple[str, str]]:
    """(kind, op) of each permute and allgather of ``plan``, bucketed ones as the bucket."""
    return sorted((s.kind, s.op) for s, _ in plan.collectives() if "permute" in s.kind or "allgather" in s.kind)


def test_convlstm_cell_with_a_gate_dim_gathers_only_h_under_hid_model():
    """Gates as their own dim: under hid:model every rank computes its hid of each gate, so the
    only allgather is h's, into the hidden state's conv (its input channel ``hid_in`` whole, as a
    column-parallel matmul reads its input); no permute.  The flat gates' slices (4 x hid, the
    weight's ``gates`` dim not split by ``hid:model``) add the gates' gradients gathered back
    whole.  Both give the dense program's numbers."""
    d = _dims(hid=3)
    feeds = {k: torch.randn(2, 5, 4, s, generator=torch.Generator().manual_seed(i))
             for i, (k, s) in enumerate((("x", 3), ("h", 3), ("c", 3)))}
    moves = {}
    for flat in (True, False):
        with md.Graph():
            loss = _cell(d, flat)
            outs = {"loss": loss, **md.grad(loss, loss.graph.params())}
            result = md.check(outs, "model:3", "hid:model", feeds)
            assert result.ok, str(result)
            moves[flat] = _moves(md.compile(outs, "model:3", "hid:model"))
    assert moves[False] == [("allgather", "rename")], moves[False]
    assert len(moves[True]) > 1, moves[True]


@pytest.mark.parametrize("x_dims, w_dims, match", [
    # an output dim named as a dim of x, of another size: read as a second input channel
    ([("c_in", 3), ("hid", 2)], [("c_in", 3), ("gates", 4), ("hid", 5)],
     r"the size of \['hid'\] differs[\s\S]*'hid' has size 2 in x and 5 in w[\s\S]*md.rename\(w, hid='hid_out'\)"),
    # two output dims and no input channel
    ([("c_in", 3)], [("gates", 4), ("hid", 5)], "one channel dim x has"),
    # two dims of x of one size each besides the output dims: which is summed is ambiguous
    ([("c_in", 3), ("hid", 5)], [("c_in", 3), ("gates", 4), ("hid", 5)], "ambiguous"),
])
def test_bad_output_dims_are_clear_errors(x_dims, w_dims, match):
    with md.Graph():
        x = md.input("x", [md.Dim("batch", 2), md.Dim("seq", 8)] + [md.Dim(n, s) for n, s in x_dims])
        w = md.param("w", [md.Dim("tap", 3)] + [md.Dim(n, s) for n, s in w_dims])
        with pytest.raises(md.ShapeError, match=match) as e:
            md.conv(x, w, {"seq": "tap"})
    assert "Fix:" in str(e.value)
