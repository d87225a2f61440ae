"""A MIN and a MAX allreduce over the same split dim sent as one (:mod:`meshdsl.lowering.min_as_max`):
min-max normalisation over a split ``hidden`` (MuZero's hidden state, ``tests/heldout_muzero.py``)
packs ``-min`` with ``max`` into one MAX allreduce, outside and inside ``md.repeat``, with the
dense program's loss and gradients (ties across ranks included)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md

MUZERO = str(Path(__file__).parent / "heldout_muzero.py")
B, H, L = md.Dim("batch", 4), md.Dim("hidden", 8), md.Dim("layer", 2)


def _norm(x):
    lo, hi = md.reduce_min(x, "hidden"), md.reduce_max(x, "hidden")
    return (x - lo) / (hi - lo + 1e-5)


def _extremes(plan) -> list:
    """The forward collectives that reduce a min or a max, sub-plans' once each."""
    return [s for s, _ in plan.walk() if s.is_collective and s.phase == "forward" and s.args.get("op") in ("min", "max")]


def test_muzero_min_and_max_go_as_one_allreduce_outside_and_inside_the_repeat():
    """hidden 8 over 2 ranks: the representation's normalisation (outside the unroll) and the
    dynamics' (in its block) each send one bucket of the [batch] max and negated min (was: a MIN
    and a MAX allreduce each)."""
    model = md.load_model(MUZERO, tiny=True)
    plan = md.compile({"loss": model.loss, **md.grad(model.loss, model.params)}, "model:2", "hidden:model")
    sent = _extremes(plan)
    assert [(s.kind, s.args["op"]) for s in sent] == [("bucket_allreduce", "max")] * 2, \
        [(s.kind, s.label, s.args["op"]) for s in sent]
    assert all(s.bytes == 2 * model.config.batch * 4 for s in sent)   # fp32 [batch] twice
    block = next(s for s in plan.steps if s.kind == "repeat" and s.phase == "forward").subplans[0]
    assert any(s.kind == "bucket_allreduce" for s in block.steps)      # once a layer, in the block


def test_muzero_under_a_split_hidden_matches_dense():
    model = md.load_model(MUZERO, tiny=True)
    outputs = {"loss": model.loss, **md.grad(model.loss, model.params)}
    feeds = model.feeds(0)
    want = md.run_dense(outputs, feeds)
    got = md.run_simulated(md.compile(outputs, "model:2", "hidden:model"), feeds)
    for k in outputs:
        # fp32 sums in another order: ~1e-7 relative; a min taken as a max (or a sign lost) is O(1)
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5 * max(1.0, float(want[k].abs().max())),
                                   msg=lambda m, k=k: f"{k}: {m}")


def test_ties_across_ranks_take_the_dense_gradient():
    """Rows whose min and max are each held twice, once on each rank's half of hidden (and one
    whose min is held four times on one rank, its max once): the gradient of each is split
    between its ties as the dense program splits it."""
    rows = torch.tensor([[1., 3., 0., 2., 3., 0., 1., 2.],
                         [-2., 5., 5., 1., 0., -2., 4., 3.],
                         [0., 0., 0., 0., 7., 1., 1., 1.],
                         [4., -1., 2., 2., -1., 4., 3., 0.]])
    for inside in (False, True):
        with md.Graph():
            x = md.param("x", [B, H])
            y = md.repeat(lambda h, p: _norm(md.cos(h) + h), x, {}, L) if inside else _norm(x)
            loss = md.reduce_sum(md.sin(y) * md.cos(x))
            outputs = {"loss": loss, **md.grad(loss, {"g": x})}
            plan = md.compile(outputs, "model:2", "hidden:model")
        assert [s.kind for s in _extremes(plan)] == ["bucket_allreduce"]
        want, got = md.run_dense(outputs, params={"x": rows}), md.run_simulated(plan, params={"x": rows})
        for k in outputs:
            # negation is exact and the ties are exact: only fp32 sums in another order differ
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5, msg=lambda m, k=k: f"{inside} {k}: {m}")


@pytest.mark.parametrize("form", ["alone", "after_the_max"])
def test_a_min_with_no_max_to_pack_with_stays_a_min(form):
    """No MAX ready with it (none at all; one its input reads): the MIN allreduce is sent as it
    was, no negation kernels left behind, the dense program's numbers."""
    with md.Graph():
        x = md.param("x", [B, H])
        shifted = x - md.reduce_max(x, "hidden") - 1e-3 if form == "after_the_max" else x
        loss = md.reduce_sum(md.sin(x - md.reduce_min(shifted, "hidden")))
        outputs = {"loss": loss, **md.grad(loss, {"g": x})}
        plan = md.compile(outputs, "model:2", "hidden:model")
    ops = sorted(s.args["op"] for s in _extremes(plan))
    assert ops == (["max", "min"] if form == "after_the_max" else ["min"])
    assert all(s.kind == "allreduce" for s in _extremes(plan))
    assert not any(s.op == "neg" and s.label == "reduce_min" for s in plan.steps)
    assert all(v in plan.values for s in plan.steps for v in (*s.ins, *s.outs))
    xv = torch.randn(B.size, H.size, generator=torch.Generator().manual_seed(0))
    want, got = md.run_dense(outputs, params={"x": xv}), md.run_simulated(plan, params={"x": xv})
    for k in outputs:   # fp32 sums in another order
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5)
