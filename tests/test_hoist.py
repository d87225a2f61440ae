"""A collective of a loop-invariant tensor inside a repeat's block runs once per loop, not per layer.

The block reads ``r`` (a router-like weight) and ``s`` (a scale), params of the graph around it,
in every layer; the layouts split them where the block reads them whole (lowering/hoist.py).
So do the ops of them (``exp(r)``, ``1 + s``) and a halo of a closed-over input (``shift``
over a split ``seq``).  The dense program is the oracle of every plan.
"""
from __future__ import annotations

import multiprocessing

import pytest
import torch

import meshdsl as md

LAYERS = 4
PIPE = {"microbatches": 2, "schedule": "1f1b"}


def _model(computed: bool = False, remat=None):
    """``computed``: the block reads ``exp(r)`` and ``1 + s``, ops of the params made per layer
    before hoist2 (ir/closure.py keeps ops of params in the block)."""
    b, e, d, f = md.Dim("batch", 4), md.Dim("experts", 2), md.Dim("d", 4), md.Dim("f", 4)
    with md.Graph():
        x = md.input("x", [b, d])
        r = md.param("r", [e], scale=1.0)
        s = md.param("s", [d], scale=1.0)
        w = md.param("w", [md.Dim("layer", LAYERS), e, d, f], fan_out=["layer", "f"])

        def block(h, q):
            gate, scale = (md.exp(r), 1 + s) if computed else (r, s)
            u = md.einsum("batch experts d, experts d f -> batch experts f", h * gate, q["w"])
            return (h + md.rename(md.reduce_sum(md.tanh(u), "experts"), f="d")) * scale

        y = md.repeat(block, x, {"w": w}, "layer", remat=remat)
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


def _run_rank(comm, mesh, layout, feeds, computed=False):
    torch.set_num_threads(1)
    plan = md.compile(_model(computed), mesh, layout)
    ex = md.Executor(plan, comm)
    res = ex.run(feeds)
    return {k: ex.to_full_held(plan.outputs[k], xs) for k, xs in res.items()}


def _invariant_in_loops(plan) -> list[str]:
    """The ops of the params ``exp(r)`` and ``1 + s`` (and their moves) run per layer."""
    def walk(p, inside):
        for s in p.steps:
            if inside and s.kind != "input" and s.label in ("exp", "add", "constant"):
                yield f"{s.kind} {s.label}"
            for sub in s.subplans:
                yield from walk(sub, inside or s.kind == "repeat")
    return list(walk(plan, False))


def _assert_matches_dense(outs, plan, shape=(4, 4)):
    feeds = {"x": torch.randn(*shape, generator=torch.Generator().manual_seed(0))}
    got, want = md.run_simulated(plan, feeds), md.run_dense(outs, feeds)
    for k, w in want.items():
        # fp32 sums over 2 ranks added in another order: a few ulps of the largest entry
        torch.testing.assert_close(got[k], w, rtol=0, atol=1e-5 * float(w.abs().max()), msg=k)


def test_ops_of_closed_params_run_once_before_the_loop():
    # hoist2: exp(r) made and gathered once (was 4 layers x (forward + recompute): 8 allgathers), and
    # 1 + s made once; the backward loop takes the forward's copies
    outs = _model(computed=True)
    plan = md.compile(outs, "data:2", "batch:data; experts:data")
    assert _invariant_in_loops(plan) == []
    assert plan.totals()["allgather"]["count"] == 1
    made = [s for s in plan.steps if s.label in ("exp", "add") and "once before" in s.note]
    assert [s.label for s in made] == ["exp", "add"] and {s.phase for s in made} == {"forward"}
    fwd, bwd = [s for s in plan.steps if s.kind == "repeat"]
    # the forward reads 1 + s and exp(r) gathered; the backward those and exp(r) itself (grad_exp)
    (gathered,) = [s.outs[0] for s in plan.steps if s.kind == "allgather"]
    assert {made[1].outs[0], gathered} <= set(fwd.ins) & set(bwd.ins) and made[0].outs[0] in bwd.ins
    _assert_matches_dense(outs, plan)


# (mesh, layout, options, remat, allgathers per step: before hoist2 12, 16, 8, 8, 8)
@pytest.mark.parametrize("mesh,layout,opts,remat,gathers", [
    ("model:2", "f:model; r.experts:model", {}, None, 5),
    ("data:2", "batch:data; params.d:data", {}, None, 9),   # FSDP: the stacked w's per-layer gathers stay
    ("data:2", "batch:data; experts:data", {}, "full", 1),   # remat: the backward recomputes the layer
    # a pipeline's backward loop takes only the copies its forward reads (it makes exp(r) again)
    ("stage:2; data:2", "layer:stage; batch:data; experts:data", PIPE, None, 1),
    ("stage:2; data:2", "layer:stage; batch:data; experts:data", {**PIPE, "schedule": "interleaved:2"}, None, 1),
], ids=["model", "fsdp", "remat", "1f1b", "interleaved"])
def test_ops_of_closed_params_hoisted_match_dense(mesh, layout, opts, remat, gathers):
    outs = _model(computed=True, remat=remat)
    plan = md.compile(outs, mesh, layout, **opts)
    assert plan.totals()["allgather"]["count"] == gathers
    _assert_matches_dense(outs, plan)


def _halo_model():
    b, t, d = md.Dim("batch", 2), md.Dim("seq", 8), md.Dim("d", 4)
    with md.Graph():
        x = md.input("x", [b, t, d])
        w = md.param("w", [md.Dim("layer", 3), d, md.Dim("f", 4)], fan_out=["layer", "f"])

        def block(h, q):   # every layer reads x shifted by one row along the split seq: a halo
            u = md.einsum("batch seq d, d f -> batch seq f", h + md.shift(x, "seq", 1), q["w"])
            return h + md.rename(md.tanh(u), f="d")

        y = md.repeat(block, x, {"w": w}, "layer")
        loss = md.reduce_sum(y * y)
        return {"loss": loss, **md.grad(loss, {"w": w})}


def test_a_halo_of_a_closed_over_tensor_is_traded_once():
    # hoist2: the strip x's neighbour sends is the same in every layer: one permute (was one per layer: 3)
    outs = _halo_model()
    plan = md.compile(outs, "model:2", "seq:model")
    assert plan.totals()["permute"]["count"] == 1
    (fwd,) = [s for s in plan.steps if s.kind == "repeat" and not s.args["backward"]]
    assert not [s for s in fwd.subplans[0].steps if s.kind == "permute"]
    _assert_matches_dense(outs, plan, shape=(2, 8, 4))


def _norm_model(remat=None):
    b, e, d, f = md.Dim("batch", 4), md.Dim("experts", 2), md.Dim("d", 4), md.Dim("f", 4)
    with md.Graph():
        x = md.input("x", [b, d])
        r = md.param("r", [e, d], scale=1.0)
        w = md.param("w", [md.Dim("layer", LAYERS), e, d, f], fan_out=["layer", "f"])

        def block(h, q):   # r normalised over experts: a sum over the split experts, saved for the backward
            gate = r * md.rsqrt(md.reduce_sum(r * r, "experts"))
            u = md.einsum("batch d, experts d, experts d f -> batch f", h, gate, q["w"])
            return h + md.rename(md.tanh(u), f="d")

        y = md.repeat(block, x, {"w": w}, "layer", remat=remat)
        loss = md.reduce_sum(y * y)
        return {"loss": loss, **md.grad(loss, {"w": w, "r": r})}


@pytest.mark.parametrize("opts,remat,allreduces", [
    ({}, None, 13), ({}, "full", 17), (PIPE, None, 16)], ids=["plain", "remat", "1f1b"])
def test_a_sum_of_a_closed_param_over_a_split_dim_is_reduced_once(opts, remat, allreduces):
    # hoist2: the norm's allreduce (its partial sum made of r alone) runs once before the forward loop,
    # its copy saved per layer as before (was 16, 24 with remat, 19 pipelined: one per layer more)
    outs = _norm_model(remat)
    mesh = "stage:2; model:2" if opts else "model:2"
    plan = md.compile(outs, mesh, ("layer:stage; " if opts else "") + "experts:model", **opts)
    assert plan.totals()["allreduce"]["count"] == allreduces
    _assert_matches_dense(outs, plan)


# the hoisted copy is a closed-over input like any other on real processes (2 s each: with -m slow);
# computed: exp(r) and 1 + s made once before the loop too (hoist2)
@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("computed", [False, True], ids=["moved", "computed"])
def test_the_hoisted_gather_on_two_real_processes(computed):
    # the copy made before the loop is a closed-over input of every layer on real ranks too (gloo)
    from meshdsl.processes import launcher
    mesh, layout = "data:2", "batch:data; experts:data"
    feeds = {"x": torch.randn(4, 4, generator=torch.Generator().manual_seed(1))}
    want = md.run_dense(_model(computed), feeds)
    results = launcher.launch(_run_rank, mesh, args=(mesh, layout, feeds, computed), backend="gloo", timeout=100)
    assert multiprocessing.active_children() == [] and len(results) == 2
    for got in results:
        for k, w in want.items():
            # fp32 sums over 2 ranks added in another order: a few ulps of the largest entry
            torch.testing.assert_close(got[k], w, rtol=0, atol=1e-5 * float(w.abs().max()), msg=k)


def _kv_model(remat=None):
    """YOCO's cross stack in small: every layer attends to the same closed-over ``k`` and ``v``
    (split over ``key_seq``, gathered whole by the attention)."""
    b, s, d = md.Dim("batch", 2), md.Dim("seq", 8), md.Dim("d_model", 4)
    h, e, layer = md.Dim("heads", 2), md.Dim("d_head", 4), md.Dim("layer", 3)
    with md.Graph():
        x = md.input("x", [b, s, d])
        wk, wv = md.param("wk", [d, h, e]), md.param("wv", [d, h, e])
        wq, wo = md.param("wq", [layer, d, h, e]), md.param("wo", [layer, h, e, d])
        hn = md.rename(md.tanh(x), seq="key_seq")
        proj = "batch key_seq d_model, d_model heads d_head -> batch key_seq heads d_head"
        k, v = md.einsum(proj, hn, wk), md.einsum(proj, hn, wv)

        def block(c, p):
            q = md.einsum("batch seq d_model, d_model heads d_head -> batch seq heads d_head", c, p["wq"])
            y = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=True)
            return c + md.einsum("batch seq heads d_head, heads d_head d_model -> batch seq d_model", y, p["wo"])

        y = md.repeat(block, x, {"wq": wq, "wo": wo}, "layer", remat=remat)
        loss = md.reduce_sum(y * y)
        return {"loss": loss, **md.grad(loss, {"wk": wk, "wv": wv, "wq": wq, "wo": wo})}


def _in_loops(plan, kinds) -> int:
    """Collectives of ``kinds`` run per step inside the repeats' blocks."""
    def walk(p, inside, mult):
        return sum((mult if inside and s.kind in kinds else 0)
                   + sum(walk(sub, inside or s.kind == "repeat", mult * s.runs(k)) for k, sub in enumerate(s.subplans))
                   for s in p.steps)
    return walk(plan, False, 1)


@pytest.mark.parametrize("remat,copies", [(None, 2), ("selective", 2), ("full", 1)])
def test_two_closed_copies_hoisted_and_their_gradients_reduced_once(remat, copies):
    # yocohoist: k and v together outgrow the carry (the old rule held one copy: v gathered in every
    # layer, forward and backward; 7 allgathers, 6 reduce-scatters), not what the loop keeps for its
    # backward: both gathered once; their gradients summed over the layers whole, reduced after the
    # loop (into wk's and wv's, which are reduced anyway).  Under full remat the loop keeps its
    # layer inputs only (3 x 128 B): one 512 B copy, the memory rule's bite
    outs = _kv_model(remat)
    plan = md.compile(outs, "model:2", "seq:model; key_seq:model")
    # (k's and v's gathers, both before the loop, go in one bucket: lowering/coalesce.py)
    hoisted = [v for s in plan.steps if s.phase == "forward" and (s.kind == "bucket_allgather" or (
        s.kind == "allgather" and "once before repeat" in s.note)) for v in s.ins]
    assert len(hoisted) == copies
    assert (_in_loops(plan, ("allgather", "reduce_scatter", "allreduce")) == 0) == (copies == 2)
    feeds = {"x": torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(0))}
    got, want = md.run_simulated(plan, feeds), md.run_dense(outs, feeds)
    for k, w in want.items():
        # fp32 sums over 2 ranks (and 3 layers) added in another order: a few ulps of the largest entry
        torch.testing.assert_close(got[k], w, rtol=0, atol=1e-5 * float(w.abs().max()), msg=k)
