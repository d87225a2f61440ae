"""top_k over a split dim (:mod:`meshdsl.lowering.topk`): each rank's top k of its part, then the
top k of the candidates, with the dense program's values, indices and gradient, and a gather of
the candidates instead of the whole dim (a top-k sparse autoencoder's dictionary split over ranks,
``tests/heldout_sae.py``)."""
from __future__ import annotations

import pytest
import torch

import meshdsl as md

B, D, N, K = 4, 6, 64, 3


def _graph():
    b, d, n = md.Dim("batch", B), md.Dim("d_model", D), md.Dim("dict", N)
    with md.Graph() as g:
        x = md.input("x", [b, d])
        w = md.param("w", [d, n], fan_out=["dict"])
        pre = md.einsum("batch d_model, d_model dict -> batch dict", x, w)      # partial where d_model is split
        vals, idx = md.top_k(pre, "dict", K, new_dim="kept")
        z = md.einsum("batch kept, batch kept dict -> batch dict", md.relu(vals), md.one_hot(idx, n))
        loss = md.reduce_sum(md.sin(vals)) + md.reduce_mean(z * z)
    return g, {"loss": loss, "vals": vals, "idx": idx, **md.grad(loss, {"grad/w": w})}


def _feeds():
    return {"x": torch.randn(B, D, generator=torch.Generator().manual_seed(0))}


@pytest.mark.parametrize("mesh,layout", [
    ("model:2", "dict:model"),
    ("model:4", "dict:model"),
    ("data:2; model:2", "batch:data; dict:model"),
    ("data:2; model:2", "dict:(data, model)"),
    ("data:2; model:2", "d_model:data; dict:model"),     # the scores arrive as a partial sum over data
    ("model:3", "dict:model"),                           # 64 over 3: uneven, gathered as before
])
def test_split_top_k_matches_dense(mesh, layout):
    _, outputs = _graph()
    want = md.run_dense(outputs, _feeds())
    got = md.run_simulated(md.compile(outputs, mesh, layout), _feeds())
    assert torch.equal(got["idx"], want["idx"])            # distinct random scores: no ties
    # fp32 partial sums in another order: ~1e-7 relative; a wrong candidate is O(1) off
    for k in ("loss", "vals", "grad/w"):
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5 * float(want[k].abs().max()))


def test_split_top_k_gathers_the_candidates_not_the_dim():
    """dict 64 over 4 ranks, k 3: each rank hands in its 3 candidates' values (fp32) and indices
    (int64) a row, not its part's 16 scores (was: the whole dim gathered, 256 B a rank)."""
    _, outputs = _graph()
    plan = md.compile(outputs, "model:4", "dict:model")
    gathers = [s for s in plan.steps if s.kind == "allgather" and s.phase == "forward"]
    assert sum(s.bytes for s in gathers) == B * K * (4 + 8), [(s.label, s.bytes) for s in gathers]
