"""repeat's per-layer outputs: a block returning ``(carry, {name: tensor})`` makes the repeat
return ``(carry, {name: stacked over layer})``, with gradients when the loss reads them.

The oracle is the same block unrolled in a Python loop (each layer's outputs read one by
one).  Covered: values (float, and an int64 count that has no gradient) and gradients
densely; a loss that reads only the per-layer outputs; remat; simulated DP, TP and FSDP
meshes and a 1F1B pipeline; mixed precision's replay of such a block; the refusals.
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md

B, D, FF, L = md.Dim("batch", 4), md.Dim("d_model", 4), md.Dim("d_ff", 8), md.Dim("layer", 4)
PARAMS = {"w1": [D, FF], "w2": [FF, D]}


def _block(h, p):
    u = md.tanh(md.einsum("batch d_model, d_model d_ff -> batch d_ff", h, p["w1"]))
    outs = {"aux": md.reduce_mean(md.reduce_sum(u * u, "d_ff"), "batch"),        # a partial sum under DP
            "row": md.reduce_sum(u, "d_ff"),                                     # [batch] per layer
            "count": md.reduce_sum(md.cast(md.greater_equal(u, 0.0), torch.int64))}  # no gradient
    return h + md.einsum("batch d_ff, d_ff d_model -> batch d_model", u, p["w2"]), outs


def _loss(y, x, aux, rows, carry: bool = True, square: bool = True):
    """``aux`` and ``rows``: per layer (lists) or stacked over layer.  ``square``: the loss reads
    ``rows`` squared (else linearly, as MoE's balance loss is summed: a pipeline's case)."""
    weight = md.cast(md.iota(L), torch.float32) + 1.0  # each layer's aux weighs differently
    if isinstance(aux, list):
        extra = sum(a * float(l + 1) for l, a in enumerate(aux)) + \
            sum(md.reduce_sum(r * r if square else r) for r in rows)
    else:
        extra = md.reduce_sum(aux * weight) + md.reduce_sum(rows * rows if square else rows)
    return md.reduce_sum(md.tanh(y) * x) + extra if carry else extra


def _repeat_model(carry: bool = True, remat=None, square: bool = True):
    with md.Graph("rep"):
        x = md.input("x", [B, D])
        ps = {k: md.param(k, [L] + dims, scale=1.0) for k, dims in PARAMS.items()}
        y, per = md.repeat(_block, x, ps, "layer", remat=remat)
        loss = _loss(y, x, per["aux"], per["row"], carry, square)
        grads = md.grad(loss, ps)
    return {"loss": loss, "aux": per["aux"], "count": per["count"], **{f"d/{k}": v for k, v in grads.items()}}


def _unrolled(params, feeds, carry: bool = True):
    with md.Graph("unrolled"):
        x = md.input("x", [B, D])
        per = [{k: md.param(f"{k}_{l}", dims, scale=1.0) for k, dims in PARAMS.items()} for l in range(L.size)]
        h, outs = x, []
        for p in per:
            h, o = _block(h, p)
            outs.append(o)
        loss = _loss(h, x, [o["aux"] for o in outs], [o["row"] for o in outs], carry)
        grads = [md.grad(loss, p) for p in per]
    r = md.run_dense({"loss": loss, **{f"aux{l}": o["aux"] for l, o in enumerate(outs)},
                      **{f"count{l}": o["count"] for l, o in enumerate(outs)},
                      **{f"d/{k}_{l}": grads[l][k] for l in range(L.size) for k in PARAMS}},
                     feeds, {f"{k}_{l}": params[k][l] for l in range(L.size) for k in PARAMS})
    return {"loss": r["loss"], "aux": torch.stack([r[f"aux{l}"] for l in range(L.size)]),
            "count": torch.stack([r[f"count{l}"] for l in range(L.size)]),
            **{f"d/{k}": torch.stack([r[f"d/{k}_{l}"] for l in range(L.size)]) for k in PARAMS}}


def _inputs():
    gen = torch.Generator().manual_seed(3)
    return ({k: torch.randn([L.size] + [d.size for d in dims], generator=gen) for k, dims in PARAMS.items()},
            {"x": torch.randn(4, 4, generator=gen)})


def _close(got, want, what=""):
    for k in want:
        if want[k].dtype == torch.int64:
            assert torch.equal(got[k], want[k]), f"{what} {k}"
        else:
            # fp32 with values up to ~50: the repeat and the unrolled loop (or a split program)
            # run the same kernels, summing split dims in another order: rounding only.
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-4, msg=lambda m, k=k: f"{what} {k}: {m}")


@pytest.mark.parametrize("carry", [True, False], ids=["carry+outputs", "outputs-only"])
def test_dense_matches_the_unrolled_loop(carry):
    params, feeds = _inputs()
    got = md.run_dense(_repeat_model(carry), feeds, params)
    assert got["aux"].shape == (L.size,) and got["count"].dtype == torch.int64
    _close(got, _unrolled(params, feeds, carry))


def test_remat_keeps_the_numbers():
    params, feeds = _inputs()
    want = md.run_dense(_repeat_model(), feeds, params)
    for policy in ("selective", "full"):
        got = md.run_dense(_repeat_model(remat=policy), feeds, params)
        assert all(torch.equal(got[k], want[k]) for k in want), policy


@pytest.mark.parametrize("mesh, layout, microbatches, schedule", [
    ("data:2", "batch:data", 1, "gpipe"),
    ("model:2", "d_ff:model", 1, "gpipe"),
    ("data:2; model:2", "batch:data; d_ff:model; params.d_model:data", 1, "gpipe"),
    ("data:2", "batch:data", 2, "gpipe"),
    # a pipeline: the loss reads the per-layer outputs linearly here (their cotangents are made
    # from constants, before the micro-batches); tests/test_pipeline_stacked_loss.py reads them
    # non-linearly (a cotangent each stage makes from its own outputs)
    ("stage:2", "layer:stage", 2, "1f1b"),
    ("stage:2; data:2", "layer:stage; batch:data", 2, "1f1b"),
])
def test_meshes_match_the_dense_program(mesh, layout, microbatches, schedule):
    params, feeds = _inputs()
    outs = _repeat_model(remat="full", square="stage" not in mesh)
    want = md.run_dense(outs, feeds, params)
    plan = md.compile(outs, mesh, layout, microbatches=microbatches, schedule=schedule)
    _close(md.run_simulated(plan, feeds, params), want, f"'{mesh}' '{layout}'")


def test_per_layer_outputs_stay_partial_sums_until_the_loss():
    # the aux's mean over the batch stays a partial sum through the stack and the loss's sum
    # over layers: no collective per layer for it in the forward block
    plan = md.compile(_repeat_model(), "data:2", "batch:data")
    fwd = next(s for s in plan.steps if s.kind == "repeat" and not s.args["backward"])
    assert fwd.args["ys"] == ("aux", "row", "count")
    assert not any(s.is_collective for s in fwd.subplans[0].steps)


def test_mixed_precision_replays_the_outputs():
    with md.Graph():
        x = md.input("x", [B, D])
        ps = {k: md.param(k, [L] + dims, scale=1.0) for k, dims in PARAMS.items()}
        y, per = md.repeat(_block, x, ps, "layer", remat="selective")
        loss = _loss(y, x, per["aux"], per["row"])
        low = md.mixed_precision(loss, "bf16")
        grads = md.grad(low, ps)
    (node,) = [n for n in low.graph.nodes if n.op.name == "repeat" and n is not y.node]
    assert node.attrs["remat"].text == "selective" and node.attrs["block"].y_names == ["aux", "row", "count"]
    params, feeds = _inputs()
    got, want = md.run_dense({"loss": low, **grads}, feeds, params), md.run_dense({"loss": loss}, feeds, params)
    # bf16 matmuls: 8 bits of mantissa, over a sum of O(50): a loose bound, far from a lost term
    torch.testing.assert_close(got["loss"], want["loss"], rtol=5e-2, atol=0)


@pytest.mark.parametrize("ret, words", [
    (lambda h, u: (h, {"aux": 1.0}), "per-layer output 'aux'"),
    (lambda h, u: (h, {"a/b": u}), "without '/'"),
    (lambda h, u: (h, [u]), "not a dict of per-layer outputs"),
])
def test_bad_per_layer_outputs_are_refused(ret, words):
    with md.Graph():
        x = md.input("x", [B, D])
        ps = {k: md.param(k, [L] + dims) for k, dims in PARAMS.items()}
        with pytest.raises(md.ShapeError, match=words):
            md.repeat(lambda h, p: ret(h, md.reduce_sum(h)), x, ps, "layer")
