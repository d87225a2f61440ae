"""Constants (:mod:`meshdsl.ops.constant`): the scalar form, tensor constants with named dims,
their slices on a mesh (no communication), their errors, and a rotary embedding computed in
the graph from position ids (``md.arange``), an inverse-frequency constant and ``sin``/``cos``,
against a plain-torch RoPE written as Meta's Llama reference does (complex rotation of pairs).

Legend: batch (b) 2, seq (s) 8, heads (h) 2, d_k (k) 4, half = d_k / 2, two (a pair's two parts).
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md
from meshdsl.tools import cli

B, S, H, K = md.Dim("batch", 2), md.Dim("seq", 8), md.Dim("heads", 2), md.Dim("d_k", 4)
HALF, TWO = md.Dim("half", 2), md.Dim("two", 2)
THETA = 100.0  # small, so that the angles of 8 positions differ in every pair


# ----------------------------------------------------------------------------- rotary embedding

def inv_freq() -> torch.Tensor:
    return 1.0 / THETA ** (torch.arange(0, K.size, 2, dtype=torch.float32) / K.size)


def rope(x: md.Tensor) -> md.Tensor:
    """Rotate each (even, odd) pair of ``x``'s d_k by its position's angles, in the graph."""
    angles = md.arange(S, torch.float32) * md.constant(inv_freq(), [HALF])        # [seq, half]
    cos, sin = md.cos(angles), md.sin(angles)
    pairs = md.rearrange(x, "batch seq heads (half two) -> batch seq heads half two", two=2)
    # (x0, x1) -> (-x1, x0): a pair turned by 90 degrees, as a contraction with a constant
    turn = md.constant([[0.0, 1.0], [-1.0, 0.0]], [TWO, "two_out"])
    turned = md.rename(md.einsum("batch seq heads half two, two two_out -> batch seq heads half two_out",
                                 pairs, turn), two_out="two")
    return md.reshape(pairs * cos + turned * sin, x.shape)


def rope_torch(x: torch.Tensor) -> torch.Tensor:
    """The reference: pairs as complex numbers times e^(i * position * inv_freq)."""
    b, s, h, k = x.shape
    angles = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq())
    z = torch.view_as_complex(x.reshape(b, s, h, k // 2, 2))
    return torch.view_as_real(z * torch.polar(torch.ones_like(angles), angles)[None, :, None, :]).reshape(b, s, h, k)


def rope_model():
    with md.Graph():
        x = md.input("x", [B, S, H, K])
        w = md.input("w", [B, S, H, K])  # a fixed weighting, so every output element has its own gradient
        y = rope(x)
        loss = md.reduce_sum(y * w)
        (gx,) = md.vjp([loss], [md.constant(1.0)], [x])
    return {"y": y, "loss": loss, "grad/x": gx}


def rope_feeds():
    gen = torch.Generator().manual_seed(0)
    return {"x": torch.randn(2, 8, 2, 4, generator=gen), "w": torch.randn(2, 8, 2, 4, generator=gen)}


# float32 sin/cos and a few products: the DSL and torch's complex multiply round differently,
# by a few ulps of O(1) values; 1e-5 is ~100 ulps and misses no wrong angle or swapped pair.
TOL = 1e-5


def test_rope_matches_plain_torch_with_its_gradient():
    feeds = rope_feeds()
    got = md.run_dense(rope_model(), feeds)
    x = feeds["x"].clone().requires_grad_(True)
    y = rope_torch(x)
    (gx,) = torch.autograd.grad((y * feeds["w"]).sum(), [x])
    torch.testing.assert_close(got["y"], y.detach(), rtol=TOL, atol=TOL)
    torch.testing.assert_close(got["grad/x"], gx, rtol=TOL, atol=TOL)


LOSS_ONLY = {"allreduce": {"count": 1, "bytes": 4}}  # the loss's partial sum; nothing else moves


@pytest.mark.parametrize("mesh, layout, totals", [
    ("x:2", "batch:x", LOSS_ONLY),
    ("x:2", "seq:x", LOSS_ONLY),      # each rank's positions start at its slice's offset
    ("x:2; y:2", "seq:x; heads:y", LOSS_ONLY),
    ("x:2; y:2", "half:x; seq:y", None),  # the tables split along half, which x's pairs are not: they meet
])
def test_rope_on_layouts(mesh, layout, totals):
    outs, feeds = rope_model(), rope_feeds()
    plan = md.compile(outs, mesh, layout)
    if totals is not None:
        assert plan.totals() == totals
    got, want = md.run_simulated(plan, feeds), md.run_dense(outs, feeds)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=TOL, atol=TOL, msg=lambda m, k=k: f"{k}: {m}")


# ----------------------------------------------------------------------------- tensor constants

def test_tensor_constant_by_dims_and_by_names():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    with md.Graph():
        a = md.constant(t, [md.Dim("r", 2), md.Dim("c", 3)])
        b = md.constant(t, ["r", "c"], name="table")
        c = md.constant([[1, 2, 3]], ["one", "c"])  # an array-like: ints stay ints, as in torch
    assert a.shape == b.shape and b.name == "table" and c.dtype == torch.int64
    t.add_(100.0)  # the constant holds its own copy
    got = md.run_dense({"a": a, "b": b, "c": c}, {})
    torch.testing.assert_close(got["a"], torch.arange(6, dtype=torch.float32).reshape(2, 3), rtol=0, atol=0)
    torch.testing.assert_close(got["c"], torch.tensor([[1, 2, 3]]), rtol=0, atol=0)


def test_scalar_form_keeps_working():
    with md.Graph():
        x = md.param("x", [S])
        s, d = md.constant(2.5), md.constant(1.0, torch.float64)
        y = x * md.constant(3.0, dtype=torch.float32) + 1.0  # scalars take the tensor's dtype
    assert s.shape == md.Shape() and s.dtype == torch.float32 and d.dtype == torch.float64
    assert y.dtype == torch.float32


def test_a_constant_is_sliced_by_the_layout_with_no_communication():
    t = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    with md.Graph():
        c = md.constant(t, [S, K])
        p = md.param("p", [S, K])
        y = c * p
        (gp,) = md.grad(md.reduce_sum(y * c), [p])
    outs = {"c": c, "y": y, "grad/p": gp}
    want = md.run_dense(outs, {})
    for layout in ("seq:x; d_k:y", "d_k:x; seq:y", "seq:(x,y)"):
        plan = md.compile(outs, "x:2; y:2", layout)
        assert plan.totals() == {}, (layout, plan.totals())  # each rank narrows its own slice
        got = md.run_simulated(plan, {})
        for k in want:  # narrowing copies nothing: the same numbers exactly
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=lambda m, k=k: f"{layout} {k}: {m}")


def test_a_constant_inside_a_repeat_block():
    layer = md.Dim("layer", 3)
    table = torch.linspace(-1.0, 1.0, 8)
    with md.Graph():
        x = md.param("x", [B, S], scale=1.0)
        w = md.param("w", [layer, S], scale=1.0)
        y = md.repeat(lambda h, p: md.tanh(h * p["w"] + md.constant(table, [S])), x, {"w": w}, layer)
        gx, gw = md.grad(md.reduce_sum(y * y), [x, w])
    outs = {"y": y, "gx": gx, "gw": gw}
    want = md.run_dense(outs, {})
    got = md.run_simulated(md.compile(outs, "x:2", "seq:x"), {})
    for k in want:  # splitting seq changes no sum's order here: elementwise only, except y*y's reduction
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_a_tensor_constant_under_bf16():
    # The bf16 rebuild casts a tensor constant like any fp32 operand of a bf16 op.
    with md.Graph():
        x = md.param("x", [B, S], scale=1.0)
        w = md.param("w", [S, K], scale=1.0)
        h = md.einsum("batch seq, seq d_k -> batch d_k", x, w) * md.constant(torch.linspace(0.5, 2.0, 4), [K])
        loss = md.reduce_mean(h * h)
    low = md.mixed_precision(loss, "bf16")
    assert low is not loss
    got, want = md.run_dense(low, {}), md.run_dense(loss, {})
    # bf16 keeps 8 bits of mantissa: products of O(1) values round by ~4e-3 relative.
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)


def test_arange_counts_along_a_dim():
    with md.Graph():
        i, f = md.arange(S), md.arange(S, torch.float32)
    got = md.run_dense({"i": i, "f": f}, {})
    assert got["i"].tolist() == list(range(8)) and got["f"].dtype == torch.float32


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("make, texts", [
    (lambda: md.constant(torch.zeros(2, 3), [md.Dim("r", 2)]),
     ["tensor of shape (2, 3) has 2 axes but 1 dims", "tensor shape: (2, 3)", "dims: [r:2]"]),
    (lambda: md.constant(torch.zeros(2, 3), [md.Dim("r", 2), md.Dim("c", 4)]),
     ["dim c:4 has size 4 but axis 1 of the tensor has 3", "tensor shape: (2, 3)", "Dim('c', 3)"]),
    (lambda: md.constant(torch.zeros(2, 3)), ["a tensor of shape (2, 3) was given without dims"]),
    (lambda: md.constant(torch.zeros(2), "r"), ["dims 'r' are not a list of Dims or names"]),
    (lambda: md.constant("abc", ["r"]), ["str value cannot become a tensor"]),
    (lambda: md.param("p", [S, K], dtype=torch.float32) * md.constant(torch.zeros(8, dtype=torch.float64), [S]),
     ["operands have different dtypes"]),
    (lambda: md.arange("seq"), ["'seq' is not a Dim"]),
])
def test_bad_constants_are_clear_errors(make, texts):
    with md.Graph():
        with pytest.raises(md.ShapeError) as info:
            make()
    msg = str(info.value)
    assert "Rule:" in msg and "Fix:" in msg, msg
    for t in texts:
        assert t in msg, f"{t!r} not in:\n{msg}"


BAD_CONSTANT_MODEL = '''
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    seq: int = 8


def build(cfg=Config()):
    s, half = md.Dim("seq", cfg.seq), md.Dim("half", 3)
    with md.Graph("bad_constant") as g:
        x = md.input("x", [s])
        table = md.constant(torch.zeros(cfg.seq, 2), [s, half])
        loss = md.reduce_sum(x * table)
    return md.Model(g, loss, {}, lambda seed=0: {"x": torch.zeros(cfg.seq)}, cfg)
'''


def test_a_constant_of_the_wrong_shape_exits_2_from_the_cli(capsys, tmp_path):
    path = tmp_path / "bad_constant.py"
    path.write_text(BAD_CONSTANT_MODEL)
    rc = cli.main(["plan", str(path), "--mesh", "data:2"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "tensor shape: (8, 2)" in err and "dims: [seq:8, half:3]" in err and "Traceback" not in err
