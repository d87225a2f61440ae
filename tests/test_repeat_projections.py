"""Projections of one split input inside ``md.repeat``, gathered once per layer (lowering/repeat.py's
``_gathered_once``, :func:`meshdsl.lowering.shared_moves.projected_once`).

Each layer reads ``m = tanh(h)``, split along ``d`` (``d:model``), through three projections
``q, k, v`` whose ``[d, f]`` weights are split along ``d`` too: each alone reduces its ``[batch, f]``
result (one latency against two for gathering ``m`` and its weight), so the block sent q and k as
one packed allreduce and v's product after them: ``2 x batch x f`` floats a layer.  Gathering ``m``
once and the three weights (one packed gather, prefetched a layer ahead) sends ``batch x d / 2``
and ``3 x d x f / 2``.  A forward block was lowered once, so the plan never saw it; it is now lowered
again foreseeing that gather, and kept where the loop, priced as it will be sent (packed), costs
less and sends no more bytes.  Under ``remat="full"`` the backward's recompute finds the same
projections (their input gathered anyway for the weights' gradients) and gathers it too.

Legend: b batch, d features (split), f projected features, L layers.
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md

L, D = md.Dim("layer", 2), md.Dim("d", 8)
PROJ = "batch d, d f -> batch f"


def _model(batch: int, features: int, remat: str) -> dict:
    """Loss and every weight's gradient of a stack of ``h + (q * k * v) @ wo``."""
    b, f = md.Dim("batch", batch), md.Dim("f", features)
    with md.Graph():
        x = md.input("x", [b, D])
        ws = {k: md.param(k, [L, D, f]) for k in ("wq", "wk", "wv")}
        ws["wo"] = md.param("wo", [L, f, D])

        def layer(h, p):
            m = md.tanh(h)
            q, k, v = (md.einsum(PROJ, m, p[n]) for n in ("wq", "wk", "wv"))
            return h + md.einsum("batch f, f d -> batch d", q * k * v, p["wo"])

        y = md.repeat(layer, x, ws, "layer", remat=remat)
        loss = md.reduce_sum(y * y)
        return {"loss": loss, **md.grad(loss, ws)}


def _data(batch: int, features: int) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(0)
    params = {k: torch.randn(2, 8, features, generator=g) * 0.3 for k in ("wq", "wk", "wv")}
    params["wo"] = torch.randn(2, features, 8, generator=g) * 0.3
    return {"x": torch.randn(batch, 8, generator=g)}, params


def _assert_dense(got: dict, want: dict) -> None:
    for k in want:
        # fp32 sums over the split d added in another order than the dense program: ~1e-6 relative
        # after two layers of cubic products; a layer's sum reduced twice or not at all is off by 2x
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-4 * max(1.0, float(want[k].abs().max())),
                                   msg=lambda m, k=k: f"{k}: {m}")


def _sent(plan, phase: str) -> list[tuple[str, int]]:
    """(kind, members) of each collective of ``phase`` in the loop's block."""
    return [(s.kind, len(s.ins)) for s, _ in plan.walk() if s.is_collective and s.phase == phase]


@pytest.mark.parametrize("remat", ["none", "selective", "full"])
def test_a_layers_projections_of_one_split_input_gather_it_once(remat):
    outs = _model(128, 64, remat)
    plan = md.compile(outs, "model:2", "d:model")
    # was [bucket_allreduce of q and k (2 x 32 KiB), allreduce of q*k*v (32 KiB)] per layer
    assert _sent(plan, "forward") == [("allgather", 1), ("bucket_allgather", 3), ("allreduce", 1)]
    # (the last forward allreduce is the loss's; the recompute repeats the forward's choice)
    assert _sent(plan, "recompute") == ([("allgather", 1), ("bucket_allgather", 3)] if remat == "full" else [])
    feeds, params = _data(128, 64)
    _assert_dense(md.run_simulated(plan, feeds, params), md.run_dense(outs, feeds, params))


def test_projections_whose_weights_outweigh_their_results_still_reduce():
    """With 4 rows, gathering m and the weights sends more than reducing the products."""
    plan = md.compile(_model(4, 8, "none"), "model:2", "d:model")
    kinds = [k for k, _ in _sent(plan, "forward")]
    assert kinds[0] == "bucket_allreduce" and "allgather" not in kinds and "bucket_allgather" not in kinds


def test_a_pipelined_stack_gathers_once_and_computes_the_dense_numbers():
    outs = _model(128, 64, "selective")
    plan = md.compile(outs, "stage:2,model:2", "layer:stage, d:model")
    # a pipeline is not coalesced: m and the three weights gathered one by one (4 x 1 KiB a stage)
    # where q, k and q*k*v were reduced (3 x 32 KiB); the loss's and a gradient's allreduces remain
    assert plan.totals()["allgather"]["count"] == 4 and plan.totals()["allreduce"]["count"] == 2
    feeds, params = _data(128, 64)
    _assert_dense(md.run_simulated(plan, feeds, params), md.run_dense(outs, feeds, params))
