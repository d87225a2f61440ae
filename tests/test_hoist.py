"""A collective of a loop-invariant tensor inside a repeat's block runs once per loop, not per layer.

The block reads ``r`` (a router-like weight) and ``s`` (a scale), params of the graph around it,
in every layer; the layouts split them where the block reads them whole (lowering/hoist.py).
The dense program is the oracle of every plan.
"""
from __future__ import annotations

import multiprocessing

import pytest
import torch

import meshdsl as md

LAYERS = 4
PIPE = {"microbatches": 2, "schedule": "1f1b"}


def _model():
    b, e, d, f = md.Dim("batch", 4), md.Dim("experts", 2), md.Dim("d", 4), md.Dim("f", 4)
    with md.Graph():
        x = md.input("x", [b, d])
        r = md.param("r", [e], scale=1.0)
        s = md.param("s", [d], scale=1.0)
        w = md.param("w", [md.Dim("layer", LAYERS), e, d, f], fan_out=["layer", "f"])

        def block(h, q):
            u = md.einsum("batch experts d, experts d f -> batch experts f", h * r, q["w"])
            return (h + md.rename(md.reduce_sum(md.tanh(u), "experts"), f="d")) * s

        y = md.repeat(block, x, {"w": w}, "layer")
        loss = md.reduce_sum(y * y)
        return {"loss": loss, **md.grad(loss, {"w": w, "r": r, "s": s})}


def _moves_of(plan, names, in_loops: bool) -> int:
    """Allgathers of the closed-over params ``names`` run per step (inside the repeats' blocks
    when ``in_loops``, else in the plan around them)."""
    def walk(p, inside, mult):
        n = 0
        for s in p.steps:
            if s.kind == "allgather" and inside == in_loops and any(k in s.note for k in names):
                n += mult
            for k, sub in enumerate(s.subplans):
                n += walk(sub, inside or s.kind == "repeat", mult * s.runs(k))
        return n
    return walk(plan, False, 1)


# (mesh, layout, options, the closed-over params the layout gathers)
CASES = [
    ("data:2", "batch:data; experts:data", {}, ["'r'", "input 1 of mul"]),
    ("model:2", "f:model; r.experts:model", {}, ["input 1 of mul"]),
    ("data:2", "batch:data; params.d:data", {}, ["input 1 of mul"]),   # FSDP: r whole, s gathered
    ("stage:2; data:2", "layer:stage; batch:data; experts:data", PIPE, ["input 1 of mul"]),
    # chunks of an interleaved pipeline: the backward reads only what the forward reads
    ("stage:2; data:2", "layer:stage; batch:data; experts:data", {**PIPE, "schedule": "interleaved:2"},
     ["input 1 of mul"]),
]


@pytest.mark.parametrize("mesh,layout,opts,names", CASES, ids=["data", "model", "fsdp", "1f1b", "interleaved"])
def test_invariant_gathers_leave_the_loop_and_match_dense(mesh, layout, opts, names):
    outs = _model()
    plan = md.compile(outs, mesh, layout, **opts)
    # none left per layer; one per gathered param before the forward loop, the backward reads it too
    assert _moves_of(plan, names, in_loops=True) == 0
    assert 1 <= _moves_of(plan, names, in_loops=False) <= 2   # r and s
    feeds = {"x": torch.randn(4, 4, generator=torch.Generator().manual_seed(0))}
    got, want = md.run_simulated(plan, feeds), md.run_dense(outs, feeds)
    assert set(want) == {"loss", "w", "r", "s"}   # the loss and every gradient
    for k, w in want.items():
        # fp32 sums over 2 ranks added in another order: a few ulps of the largest entry
        torch.testing.assert_close(got[k], w, rtol=0, atol=1e-5 * float(w.abs().max()), msg=k)


def test_dup3_soft_moe_gathers_the_router_once_per_step():
    # the brief's repro: 1 allgather per layer forward and 1 backward (4 layers: 8) -> 1 before the
    # forward loop, whose copy the backward loop reads too
    plan = md.compile(_model(), "data:2", "batch:data; experts:data")
    assert plan.totals()["allgather"]["count"] == 1
    (hoisted,) = [s for s in plan.steps if s.kind == "allgather"]
    assert hoisted.phase == "forward"
    fwd, bwd = [s for s in plan.steps if s.kind == "repeat"]
    for loop in (fwd, bwd):
        (name,) = [k for k in loop.args["closed"] if "@moved" in k]
        assert loop.ins[len(loop.ins) - len(loop.args["closed"]) + loop.args["closed"].index(name)] == hoisted.outs[0]


def test_a_per_layer_reduction_stays_in_the_block():
    # r's gradient is made per layer: its reduce-scatter is no loop-invariant collective
    plan = md.compile(_model(), "data:2", "batch:data; experts:data")
    (bwd,) = [s for s in plan.steps if s.kind == "repeat" and s.args["backward"]]
    assert [s.kind for s in bwd.subplans[0].steps if s.is_collective].count("reduce_scatter") == 1


def _run_rank(comm, mesh, layout, feeds):
    torch.set_num_threads(1)
    plan = md.compile(_model(), mesh, layout)
    ex = md.Executor(plan, comm)
    res = ex.run(feeds)
    return {k: ex.to_full_held(plan.outputs[k], xs) for k, xs in res.items()}


# the hoisted copy is a closed-over input like any other on real processes (2 s: with -m slow)
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_hoisted_gather_on_two_real_processes():
    # the copy made before the loop is a closed-over input of every layer on real ranks too (gloo)
    from meshdsl.processes import launcher
    mesh, layout = "data:2", "batch:data; experts:data"
    feeds = {"x": torch.randn(4, 4, generator=torch.Generator().manual_seed(1))}
    want = md.run_dense(_model(), feeds)
    results = launcher.launch(_run_rank, mesh, args=(mesh, layout, feeds), backend="gloo", timeout=100)
    assert multiprocessing.active_children() == [] and len(results) == 2
    for got in results:
        for k, w in want.items():
            # fp32 sums over 2 ranks added in another order: a few ulps of the largest entry
            torch.testing.assert_close(got[k], w, rtol=0, atol=1e-5 * float(w.abs().max()), msg=k)
