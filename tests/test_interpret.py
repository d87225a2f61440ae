"""The dense interpreter's in-place adds (meshdsl/ir/interpret.py).

An add writes into an operand only when that operand is new storage (a matmul or
an elementwise result) that nothing else reads or returns.  Every case here checks
values against plain torch on the same numbers (exact: the same adds in the same
order) and which kernel each add got.
"""
from __future__ import annotations

import torch

import meshdsl as md
from meshdsl.ops import inplace
from meshdsl.ir.interpret import DenseProgram

B, D, E = md.Dim("batch", 3), md.Dim("d_model", 4), md.Dim("e", 4)
MM = "batch d_model, d_model e -> batch e"


def _kernels(prog):
    return [fn for fn, *_ in prog.code if fn in (inplace.add_into_first, inplace.add_into_second)]


def test_in_place_only_into_unshared_fresh_values():
    with md.Graph():
        x = md.input("x", [B, D])
        w = md.param("w", [D, E])
        a = md.einsum(MM, x, w)   # fresh, read once: added into
        b = md.einsum(MM, x, w)   # fresh, read twice: kept
        s1 = a + b
        s2 = md.rename(x, d_model="e") + b   # a view of a feed and a shared b: out of place
        out = {"s1": s1, "s2": s2, "b": b}
    xv, wv = torch.randn(3, 4), torch.randn(4, 4)
    prog = DenseProgram(out)
    got = prog({"x": xv}, {"w": wv})
    ref = xv @ wv
    torch.testing.assert_close(got["s1"], ref + ref, rtol=0, atol=0)
    torch.testing.assert_close(got["s2"], xv + ref, rtol=0, atol=0)
    torch.testing.assert_close(got["b"], ref, rtol=0, atol=0)
    assert _kernels(prog) == [inplace.add_into_first]  # s1 only


def test_outputs_and_broadcasts_are_never_written():
    with md.Graph():
        x = md.input("x", [B, D])
        y = x * 2.0
        z = y + 1.0              # y is an output: out of place
        bias = md.param("bias", [D])
        t = md.reduce_sum(x * x, "d_model") + bias   # [batch] + [d_model] broadcasts: out of place
        out = {"y": y, "z": z, "t": t}
    xv, bv = torch.randn(3, 4), torch.randn(4)
    prog = DenseProgram(out)
    got = prog({"x": xv}, {"bias": bv})
    torch.testing.assert_close(got["y"], xv * 2.0, rtol=0, atol=0)
    torch.testing.assert_close(got["z"], xv * 2.0 + 1.0, rtol=0, atol=0)
    torch.testing.assert_close(got["t"], (xv * xv).sum(1)[:, None] + bv, rtol=0, atol=0)
    assert _kernels(prog) == []


def test_residual_adds_into_the_block_output():
    with md.Graph():
        x = md.input("x", [B, E])
        w = md.param("w", [D, E])
        h = md.einsum(MM, md.rename(x, e="d_model"), w)
        y = x + h * 0.5          # x is a feed (and read twice); the scaled product is fresh
        out = {"y": y}
    xv, wv = torch.randn(3, 4), torch.randn(4, 4)
    keep = xv.clone()
    prog = DenseProgram(out)
    torch.testing.assert_close(prog({"x": xv}, {"w": wv})["y"], xv + (xv @ wv) * 0.5, rtol=0, atol=0)
    assert _kernels(prog) == [inplace.add_into_second]
    assert torch.equal(xv, keep)  # the feed is untouched


def test_autograd_through_the_program_stays_out_of_place():
    with md.Graph():
        x = md.input("x", [B, D])
        y = (x * 2.0) + (x * 3.0)
    xv = torch.randn(3, 4, requires_grad=True)
    r = DenseProgram({"y": y})({"x": xv})["y"]
    r.sum().backward()
    torch.testing.assert_close(xv.grad, torch.full((3, 4), 5.0), rtol=0, atol=0)
