"""A partial sum read by several linear ops that meet again, reduced once where they meet
(lowering/shared_sums.py's meeting_sums, lowering/compiler.py's relowering).

``a = x @ w1`` contracts the split ``c``: a partial sum over ``model``.  Read by two slices that a
concat joins, by two slices padded back and added, or by two scalings concatenated, it used to
be reduced at its first reader (two readers, each would need a reduction of its own), and the
add of ``z = x @ w2`` (partial too) reduced again: two allreduces.  The sum over the ranks
commutes with slice, pad, concat, add and a scaling, so one allreduce after the add gives the
same numbers.  A reader not linear in it (a product of two of its slices) keeps the reduction.

Legend: b batch, s seq (sliced), c features (split, contracted), d the projection's output.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import assert_heldout_case_matches_dense, heldout_outputs

import meshdsl as md

FORMS = ["concat of two slices", "pads of two slices added", "concat of two scalings", "product of two slices"]


def _graph(form: str) -> dict:
    """Loss and gradients of ``sum(sin(f(a) + z))``, ``a`` and ``z`` partial sums over split ``c``
    (``x`` big enough that gathering it costs more than reducing them)."""
    b, s, c, d = md.Dim("batch", 16), md.Dim("seq", 4), md.Dim("c", 16), md.Dim("d", 2)
    with md.Graph():
        x = md.input("x", [b, s, c])
        w1, w2 = md.param("w1", [c, d]), md.param("w2", [c, d])
        a = md.einsum("batch seq c, c d -> batch seq d", x, w1)
        xx = md.concat([x, x], "seq") if "scalings" in form else x
        z = md.einsum("batch seq c, c d -> batch seq d", xx, w2)
        lo, hi = md.slice_(a, "seq", 0, 2), md.slice_(a, "seq", 2, 4)
        if form == "concat of two slices":
            a = md.concat([lo, hi], "seq")
        elif form == "pads of two slices added":
            a = md.pad(lo, "seq", 0, 2) + md.pad(hi, "seq", 2, 0)
        elif form == "concat of two scalings":
            a = md.concat([a * 2.0, a * 3.0], "seq")
        else:
            a = md.concat([lo * hi, hi], "seq")
        loss = md.reduce_sum(md.sin(a + z))
        return {"loss": loss, **md.grad(loss, {"w1": w1, "w2": w2})}


def _forward(plan) -> list[tuple[str, int]]:
    return [(s.kind, s.bytes) for s, _ in plan.walk() if s.is_collective and s.phase == "forward"]


@pytest.mark.parametrize("form", FORMS)
def test_a_partial_sum_whose_linear_readers_meet_is_reduced_once(form):
    outs = _graph(form)
    plan = md.compile(outs, "model:2", "c:model")
    size = 16 * 4 * 2 * 4 * (2 if "scalings" in form else 1)   # the sum a + z, fp32 bytes
    if form == "product of two slices":   # (a product is not linear in both: a and z reduced first)
        assert [(s.kind, len(s.ins)) for s, _ in plan.walk() if s.is_collective and s.phase == "forward"] \
            == [("bucket_allreduce", 2)]
    else:   # was 2 allreduces: a at its first reader, then a + z
        assert _forward(plan) == [("allreduce", size)]
    g = torch.Generator().manual_seed(5)
    feeds = {"x": torch.randn(16, 4, 16, generator=g)}
    params = {"w1": torch.randn(16, 2, generator=g), "w2": torch.randn(16, 2, generator=g)}
    got, want = md.run_simulated(plan, feeds, params), md.run_dense(outs, feeds, params)
    for k in want:
        # fp32 sums over the split c added in another order than the dense program: ~1e-7
        # relative; a partial sum reduced twice or not at all is off by a factor of 2
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5 * max(1.0, float(want[k].abs().max())),
                                   msg=lambda m, k=k: f"{k}: {m}")


def test_fno2ds_spectrum_and_local_path_are_reduced_once_a_layer():
    """FNO-2D (tests/heldout_fno2d.py, tiny) under ``width:model``: each layer's spectrum, partial
    over the split width, is sliced into its low and high kept modes, joined again, transformed back
    and added to the local path (partial too).  Was per layer one packed allreduce of the spectrum
    (1536 B) and the local path (3072 B); now one allreduce of their sum before the gelu."""
    case = (Path(__file__).parent / "heldout_fno2d.py", {}, "model:2", "width:model")
    plan = md.compile(heldout_outputs(md.load_model(case[0], tiny=True)), *case[2:])
    # the layer's sum (3072 B), run twice; the prediction's partial sum in the loss (768 B)
    assert _forward(plan) == [("allreduce", 3072), ("allreduce", 768)]
    assert {k: (v["count"], v["bytes"]) for k, v in plan.totals().items()} == \
        {"allreduce": (3, 6912), "allgather": (2, 3072)}   # was 5 collectives, 13056 B
    assert_heldout_case_matches_dense(case)
