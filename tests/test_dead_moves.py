"""Collectives nothing reads are dropped (:mod:`meshdsl.lowering.dead_moves`), and a split value
sliced several times, each slice gathered by its readers, is gathered once instead
(:func:`meshdsl.lowering.shared_moves.sliced_whole`); both against the dense program.

Legend: b batch, d d_model, t time, c channels, b2 batch2 (the candidates, renamed from batch).
"""
from __future__ import annotations

import torch

import meshdsl as md

MESH = "data:2"


def _unread(plan) -> list[str]:
    """The collectives of ``plan`` (sub-plans included) none of whose results a step of their
    plan reads or the plan returns."""
    out = []

    def walk(p):
        read = {v for s in p.steps for v in s.ins} | set(p.outputs.values())
        for s in p.steps:
            if s.is_collective and s.outs and read.isdisjoint(s.outs):
                out.append(f"{s.kind} {s.label}: {s.note}")
            for sub in s.subplans:
                walk(sub)
    walk(plan)
    return out


def _step(loss, g) -> dict:
    """The loss and each param's gradient, as a training step computes them."""
    grads = md.grad(loss, g.params())
    return {"loss": loss, **{f"grad/{k}": v for k, v in grads.items()}}


def _assert_dense(outs: dict, plan, feeds: dict) -> None:
    want = md.run_dense(outs, feeds)
    got = md.run_simulated(plan, feeds)
    for k, w in want.items():
        # fp32 sums split over two ranks add in another order: ~2**-24 of the magnitudes summed,
        # far below 1e-5 of them; a lost or doubled shard is off by O(1)
        torch.testing.assert_close(got[k], w, rtol=1e-5, atol=1e-5 * float(w.abs().max()), msg=k)


def test_a_gather_every_reader_reads_around_is_dropped():
    """``sigmoid(a)`` of an FSDP weight is computed split over ``d_model`` and gathered to its whole
    target, but its reader (times ``b``, split alike) reads the split copy it was made from: the
    gather had no reader (MEGA's EMA decay under FSDP, x2 per layer)."""
    D, B = md.Dim("d_model", 8), md.Dim("batch", 4)
    with md.Graph("dead") as g:
        x = md.input("x", [B, D])
        y = x * (md.sigmoid(md.param("a", [D])) * md.param("b", [D]))
        loss = md.reduce_mean(y * y)
    outs = _step(loss, g)
    plan = md.compile(outs, MESH, "batch:data; params.d_model:data")
    assert _unread(plan) == []
    # the params' two gathers, and one reduction for both gradients (a bucket): the dead
    # sigmoid gather was the 4th
    assert sum(n for _, n in plan.collectives()) == 3, plan.totals()
    _assert_dense(outs, plan, {"x": torch.randn(4, 8, generator=torch.Generator().manual_seed(0))})


def _slices_renamed():
    """CPC's InfoNCE scores: for each step ahead ``s``, the prediction against the true future
    latents ``z[:, s:s+5]`` of every batch row, renamed to ``batch2`` (no rule splits it)."""
    B, T, C = md.Dim("batch", 4), md.Dim("time", 8), md.Dim("channels", 4)
    with md.Graph("cpc_slices") as g:
        x = md.input("x", [B, T, C])
        z = md.tanh(md.einsum("batch time channels, channels c_out -> batch time c_out", x,
                              md.param("w", [C, md.Dim("c_out", 4)])))
        z = md.rename(z, c_out="channels")
        pred = md.slice_(z, "time", 0, 5)
        total = None
        for s in (1, 2, 3):
            future = md.rename(md.slice_(z, "time", s, s + 5), batch="batch2")
            scores = md.einsum("batch time channels, batch2 time channels -> batch batch2 time", pred, future)
            term = md.reduce_mean(md.log_softmax(scores, "batch2"))
            total = term if total is None else total + term
    return _step(total, g)


def test_a_value_sliced_three_times_each_slice_gathered_is_gathered_once():
    """Under ``batch:data`` each renamed slice of ``z`` needs all of its rows: three gathers of
    5/8 of ``z`` each, or one of ``z`` (then each slice cut locally, its cut read whole again).
    In the backward, each slice's gradient (partial over ``data``: ``batch`` is contracted) is
    padded and added up partial, then reduce-scattered once, not once per slice."""
    outs = _slices_renamed()
    plan = md.compile(outs, MESH, "batch:data")
    moves = [(s.kind, s.phase, s.bytes) for s, _ in plan.collectives() if s.kind in ("allgather", "reduce_scatter")]
    z_bytes = 4 * 8 * 4 * 4   # [batch, time, channels] fp32
    # the gather sends one rank's half of z; the reduce-scatter all of z's partial gradient
    assert moves == [("allgather", "forward", z_bytes // 2), ("reduce_scatter", "backward", z_bytes)], \
        [(s.label, s.bytes, s.note) for s, _ in plan.collectives()]
    assert _unread(plan) == []
    _assert_dense(outs, plan, {"x": torch.randn(4, 8, 4, generator=torch.Generator().manual_seed(1))})
