"""A concat along a split dim (meshdsl/lowering/concat.py): lowered as a sum of pads, it trades
halo rows (none here) instead of gathering the dim, with the dense program's numbers.

A ViT's tokens: a class token ``[seq:1, d]`` (given the batch by ``broadcast_to``) joined
before the patches ``[batch, seq:16, d]``, which arrive split by ``seq``; then a register
token after them. Legend: batch 2, d 3.
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md

B, D, P = 2, 3, 16


def _tokens():
    batch, d = md.Dim("batch", B), md.Dim("d", D)
    x = md.input("x", [batch, md.Dim("seq", P), d])
    cls = md.param("cls", [md.Dim("seq", 1), d], scale=1.0)
    reg = md.param("reg", [md.Dim("seq", 1), d], scale=1.0)
    w = md.param("w", [d, md.Dim("e", 4)], scale=1.0)
    h = md.concat([md.broadcast_to(cls, [batch, cls.shape["seq"], d]), x], "seq")
    h = md.concat([h, md.broadcast_to(reg, [batch, reg.shape["seq"], d])], "seq")    # seq 18
    y = md.einsum("batch seq d, d e -> batch seq e", h, w)
    loss = md.reduce_sum(md.tanh(y))
    return {"y": y, "loss": loss, **md.grad(loss, {"g/x": x, "g/cls": cls, "g/reg": reg, "g/w": w})}


@pytest.mark.parametrize("mesh", ["data:2", "a:2; b:2"])
def test_a_token_joined_to_split_patches_trades_halos(mesh):
    with md.Graph():
        outs = _tokens()
        layout = "seq:data" if mesh == "data:2" else "seq:a; batch:b"
        plan = md.compile(outs, mesh, layout)
    kinds = [s.kind for s, _ in plan.collectives()]
    # seq 16 (8, 8) -> 17 (9, 8) -> 18 (9, 9): every output block is read from its own rank's
    # block (the token's row lands on rank 0, whose block grows by it): nothing moves at all
    assert "allgather" not in kinds and "permute" not in kinds, kinds
    feeds = {"x": torch.randn(B, P, D, generator=torch.Generator().manual_seed(0))}
    got, want = md.run_simulated(plan, feeds), md.run_dense(outs, feeds)
    for k in want:
        # the concat is exact (each element plus zeros); the einsum and sums: fp32 rounding
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_a_concat_wanted_whole_stays_torch_cat():
    """The output's layout leaves the dim whole (seq 18 under a 'seq' rule on 4 ranks does split,
    so here the rule is scoped away): the concat is the generic kernel, its split operand gathered."""
    with md.Graph():
        outs = _tokens()
        plan = md.compile(outs, "data:2", "x.seq:data")
    assert any(s.op == "concat" for s in plan.steps)
    assert "allgather" in [s.kind for s, _ in plan.collectives()]
    feeds = {"x": torch.randn(B, P, D, generator=torch.Generator().manual_seed(0))}
    got, want = md.run_simulated(plan, feeds), md.run_dense(outs, feeds)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
