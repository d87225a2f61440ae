"""A slice of a split dim whose result is kept split by a halo exchange, then gathered by its
readers (MIMO-UNet's DFT patch under ``height:model``): the rows move once
(:func:`meshdsl.lowering.shared_moves.halo_slices_read_whole`, :mod:`meshdsl.lowering.window`),
against the dense program.

Legend: b batch, h height (split), w width, ph/pw the patch's rows/columns, fh/fw its frequencies.
"""
from __future__ import annotations

import torch

import meshdsl as md


def _patch_dft():
    """rows/columns 0-3 of an 8x8 image split over ``height`` (all on rank 0), renamed to the
    patch's dims, read whole by four DFT-like einsums."""
    B, H, W = md.Dim("batch", 2), md.Dim("height", 8), md.Dim("width", 8)
    gen = torch.Generator().manual_seed(0)
    with md.Graph("patch") as g:
        x_bhw = md.input("x", [B, H, W])
        y_bhw = x_bhw * md.param("w", [W])
        p = md.rename(md.slice_(md.slice_(y_bhw, "height", 0, 4), "width", 0, 4), {"height": "ph", "width": "pw"})
        c = md.constant(torch.randn(4, 4, generator=gen), ["ph", "fh"])
        s = md.constant(torch.randn(4, 4, generator=gen), ["ph", "fh"])
        cw, sw = md.rename(c, {"ph": "pw", "fh": "fw"}), md.rename(s, {"ph": "pw", "fh": "fw"})
        e = "batch ph pw, ph fh, pw fw -> batch fh fw"
        re = md.einsum(e, p, c, cw) - md.einsum(e, p, s, sw)
        im = md.einsum(e, p, s, cw) + md.einsum(e, p, c, sw)
        loss = md.reduce_mean(abs(re)) + md.reduce_mean(abs(im)) + md.reduce_mean(y_bhw * y_bhw)
    grads = md.grad(loss, g.params())
    return {"loss": loss, **{f"grad/{k}": v for k, v in grads.items()}}


def _forward_moves(plan) -> list[tuple[str, int]]:
    return [(s.kind, s.bytes) for s in plan.steps if s.is_collective and s.phase == "forward"]


def test_a_patch_of_rows_one_rank_holds_moves_once_for_readers_that_want_it_whole():
    """Before: a 128 B halo permute spread the 4 rows over both ranks, then the einsums gathered
    them (64 B).  Now each rank's overlap is summed once (128 B), after the width slice."""
    outs = _patch_dft()
    plan = md.compile(outs, "model:2", "height:model")
    moves = _forward_moves(plan)
    assert not any(k == "permute" for k, _ in moves), moves
    assert not any(k == "allgather" for k, _ in moves), moves
    assert sum(b for _, b in moves) < 128 + 64, moves
    feeds = {"x": torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(1))}
    want, got = md.run_dense(outs, feeds), md.run_simulated(plan, feeds)
    for k, w in want.items():
        # fp32 sums over two ranks add in another order: ~1e-7 relative; a lost or doubled row is O(1)
        torch.testing.assert_close(got[k], w, rtol=1e-5, atol=1e-5 * float(w.abs().max()), msg=k)
