"""A repeat's gradient of a tensor it reads from outside stays a partial sum over the layers.

A backward block's gradient of a closed-over tensor (DETR's object queries ``query_pos``, added
to the decoder's carry before its self- and cross-attention queries) is summed over the layers
before anything reduces it.  Under Megatron the queries' gradient is a partial sum over
``model`` that the carry's gradient also reads: counted as two readers, it was reduced at its
first one in every layer (``add_12``: 4 allreduces per decoder layer backward).  Now the reads
on the way to the closed-over gradient do not count (``Lowerer.count_readers(summed=...)``):
the carry's share passes on lazily and meets the value path's partial sum (3 per layer), and
the queries' gradient is reduced once, after the loop.  The repeat lowers its backward block
both ways when that changes anything and keeps the cheaper loop (``lowering/repeat.py``), so
a block whose carry gradient would be reduced alone anyway (:func:`_block_model` without the
second branch) keeps its per-layer reduction and gets no extra one after the loop.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import assert_heldout_case_matches_dense, heldout_case_id
from meshdsl.train.step import training_outputs

HERE = Path(__file__).parent
DETR, BART, WHISPER = (str(HERE / f"heldout_{n}.py") for n in ("detr", "bart", "whisper"))
MEGATRON = "heads:model; d_ff:model"
PIPE = {"microbatches": 2, "schedule": "1f1b"}


def _collectives(plan, runs: int = 1) -> int:
    """The collectives a step of ``plan`` runs (a loop body's counted once per run)."""
    return sum(runs if s.is_collective else
               sum(_collectives(sub, runs * s.runs(k)) for k, sub in enumerate(s.subplans)) for s in plan.steps)


def _backward_loops(plan) -> list:
    return [s for s in plan.steps if s.kind == "repeat" and s.args["backward"]]


# (model, collectives per training step, allreduces in one decoder layer's backward). Before:
# DETR 24 and 4 (its queries' gradient reduced in every layer); BART and Whisper were 21 and 3
# already (their memory's gradient, read by the cross-attention's K and V only, stayed partial).
COUNTS = [(DETR, 23, 3), (BART, 21, 3), (WHISPER, 21, 3)]


@pytest.mark.parametrize("path, total, per_layer", COUNTS, ids=[Path(c[0]).stem for c in COUNTS])
def test_megatron_training_step_collectives(path, total, per_layer):
    """The SGD training step `bench/comm_audit.py` audits, tiny config, on ``model:2``."""
    model = md.load_model(path, tiny=True)
    plan = md.compile(training_outputs(model.loss, model.params, 0.1), "model:2", MEGATRON)
    assert _collectives(plan) == total
    decoder = max(_backward_loops(plan), key=lambda s: len(s.args.get("closed", ())))
    body = [s for s in decoder.subplans[0].steps if s.is_collective]
    assert [s.kind for s in body] == ["allreduce"] * per_layer


def test_detr_queries_gradient_is_reduced_once_after_the_decoder():
    """The queries' gradient leaves the loop partial over ``model`` and one allreduce after the
    loop makes it whole; inside, no collective reads a value the queries' gradient is made of."""
    model = md.load_model(DETR, tiny=True)
    cfg = model.config
    plan = md.compile(training_outputs(model.loss, model.params, 0.1), "model:2", MEGATRON)
    loop = next(s for s in _backward_loops(plan) if "closed/query_pos" in s.args.get("closed", ()))
    sub = loop.subplans[0]
    assert sub.values[sub.outputs["d/closed/query_pos"]].sharding.partial == ("model",)
    grad = loop.outs[1 + len(loop.args["names"]) + list(loop.args["closed"]).index("closed/query_pos")]
    readers = [s for s in plan.steps if grad in s.ins]
    assert [(s.kind, s.axes) for s in readers] == [("allreduce", ("model",))]
    assert [(d.name, d.size) for d in plan.values[grad].shape] == [("queries", cfg.queries), ("d_model", cfg.d_model)]


def _block_model(second_branch: bool):
    """A stack whose block adds an outside ``pos`` to its carry before a column-parallel matmul
    (the carry's gradient and ``pos``'s share one partial sum); ``second_branch``: a second
    column-parallel matmul of the carry whose input gradient that partial sum can meet lazily."""
    B, S, D, F, L = md.Dim("batch", 4), md.Dim("seq", 3), md.Dim("d_model", 8), md.Dim("d_ff", 16), md.Dim("layer", 3)
    with md.Graph("closure_sums"):
        x = md.input("x", [B, S, D])
        pos = md.param("pos", [S, D])
        p = {k: md.param(k, [L, D, F] if k != "w2" else [L, F, D]) for k in ("w1", "w2", "w3")}

        def block(t, q):
            h = md.relu(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", t + pos, q["w1"]))
            if second_branch:
                h = h + md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", t, q["w3"])
            return t + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", h, q["w2"])

        y = md.repeat(block, x, p, "layer")
        loss = md.reduce_sum(y * y) * 0.01
    params = {"pos": pos, **p}
    return {"loss": loss, **{f"grad/{k}": g for k, g in md.grad(loss, params).items()}}


@pytest.mark.parametrize("second_branch, per_layer, after", [(True, 1, 1), (False, 1, 0)])
def test_the_cheaper_loop_is_kept(second_branch, per_layer, after):
    """With a second branch the shared partial sum is reduced with the carry's gradient (1 per
    layer backward, was 2) and ``pos``'s once after the loop; without one, reducing it per layer
    is the carry's reduction anyway, and ``pos``'s gradient comes out of the loop whole."""
    outs = _block_model(second_branch)
    plan = md.compile(outs, "model:2", "d_ff:model")
    (loop,) = _backward_loops(plan)
    assert sum(s.is_collective for s in loop.subplans[0].steps) == per_layer
    grad_pos = loop.outs[-1]
    assert sum(s.is_collective and grad_pos in s.ins for s in plan.steps) == after
    feeds = {"x": torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(0))}
    got, want = md.run_simulated(plan, feeds), md.run_dense(outs, feeds)
    for k, w in want.items():
        # fp32 partial sums over 2 ranks and 3 layers added in another order: a few ulps of the
        # largest term; a lost or doubled share is off by O(1) of it
        torch.testing.assert_close(got[k], w, rtol=0, atol=1e-5 * float(w.abs().max()), msg=k)


# (model, config overrides, mesh, layout[, compile keywords]): the plans the change affects and
# their encoder-decoder neighbours, forward and every gradient against the dense program.
CASES = [
    (DETR, {}, "model:2", MEGATRON),
    (BART, {}, "model:2", MEGATRON),
    (WHISPER, {}, "model:2", MEGATRON),
    (DETR, {}, "stage:2; model:2", f"layer:stage; {MEGATRON}", PIPE),
    (DETR, {}, "stage:2; model:2", f"layer:stage; enc_layer:stage; {MEGATRON}", PIPE),
    (BART, {"enc_layer": "enc_layer"}, "stage:2; model:2", f"layer:stage; {MEGATRON}", PIPE),
    (DETR, {"layers": 4}, "stage:2; model:2", f"layer:stage; {MEGATRON}", {"microbatches": 2,
                                                                         "schedule": "interleaved:2"}),
    (DETR, {}, "data:2; model:2", f"batch:data; {MEGATRON}; params.d_model:data"),     # ZeRO/FSDP
]


@pytest.mark.parametrize("case", CASES, ids=[heldout_case_id(c) for c in CASES])
def test_plans_match_dense(case):
    assert_heldout_case_matches_dense(case)


@pytest.mark.parametrize("remat", ["selective", "full"])
def test_detr_megatron_under_remat_matches_dense(remat):
    model = md.load_model(DETR, tiny=True)
    outs = {"loss": model.loss, **{f"grad/{k}": g for k, g in md.grad(model.loss, model.params, remat=remat).items()}}
    plan = md.compile(outs, "model:2", MEGATRON)
    loop = next(s for s in _backward_loops(plan) if "closed/query_pos" in s.args.get("closed", ()))
    assert sum(s.is_collective and s.phase == "backward" for s in loop.subplans[0].steps) == 3
    got, want = md.run_simulated(plan, model.feeds(0)), md.run_dense(outs, model.feeds(0))
    top = max(float(w.abs().max()) for k, w in want.items() if k.startswith("grad/"))
    for k, w in want.items():
        # as assert_heldout_case_matches_dense: fp32 sums in another order, 1e-4 of the scale
        scale = top if k.startswith("grad/") else float(w.abs().max())
        torch.testing.assert_close(got[k], w, rtol=0, atol=1e-4 * scale, msg=k)


# As tests/test_closure.py's bf16 bound: 8 significant bits (2^-9 relative per rounding), a
# handful of roundings per gradient adding like a random walk (measured here 0.6e-2 to 0.7e-2
# in norm, with the per-layer reduction as before and without); a dropped layer or partial sum
# is off by far more.  (Tiny DETR in bf16 is 20% off its fp32 gradients even dense: no bound.)
BF16_GRAD_REL = 2e-2


def test_bf16_block_keeps_its_sums_partial_and_close_to_fp32():
    """Mixed precision replays the block: its loop keeps the shared partial sum lazy too, and the
    gradients are the fp32 ones rounded (the loop adds the layers' sums in the dtype it did)."""
    outs = _block_model(second_branch=True)
    loss = outs["loss"]
    params = {n.name: n.outputs[0] for n in loss.graph.nodes if n.op.name == "param"}
    low = md.mixed_precision(loss, "bf16")
    with loss.graph:
        grads = md.grad(low, params)
    plan = md.compile(grads, "model:2", "d_ff:model")
    (loop,) = _backward_loops(plan)
    assert sum(s.is_collective for s in loop.subplans[0].steps) == 1
    feeds = {"x": torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(0))}
    got, want = md.run_simulated(plan, feeds), md.run_dense({k: outs[f"grad/{k}"] for k in params}, feeds)
    for k in params:
        assert got[k].dtype == torch.float32
        assert 0 < (got[k] - want[k]).norm() <= BF16_GRAD_REL * want[k].norm(), k


def _moved(plan, dim: str, runs: int = 1) -> list:
    """``(in a loop body, runs)`` of each collective of ``plan`` of a value with dim ``dim``."""
    out = []
    for s in plan.steps:
        if s.is_collective and dim in plan.values[s.ins[0]].shape.names:
            out.append((runs > 1, runs))
        for k, sub in enumerate(s.subplans):
            out += [(True, r) for _, r in _moved(sub, dim, runs * s.runs(k))]
    return out


def test_perceiver_input_gradient_is_reduced_once_after_the_layers():
    """Perceiver's byte array ``[batch, seq, d_model]``, read by every layer's cross-attention
    through a layer norm, gets its gradient (partial over ``model``: the K/V heads' share) summed
    over the layers.  Its one reader, the layer norm's backward, is linear in it, but its three
    results (the input's gradient and the norm's scale and bias) each priced as reduced in the
    layer cost more than reducing the input, so it was reduced in every layer (2 x 8 KiB, tiny).
    The block now passes it on partial (``lowering/repeat.py`` ``_lazy_through``: the norm's
    gradients leave the loop partial, summed or stacked) where the loop's price is lower, the
    scale's 64 B per layer; and after the loop the partial gradient goes on through the input
    projection, linear in it, to its weight's gradient (``lowering/lazy_grads.py``): the byte
    array's 8 KiB allreduce became a 512 B bucket of that weight's gradient, 28 -> 12.6 KiB."""
    model = md.load_model(str(HERE / "heldout_perceiver.py"), tiny=True)
    step = md.compile(training_outputs(model.loss, model.params, 0.1), "model:2", MEGATRON)
    assert _moved(step, "seq") == []
    assert _collectives(step) == 15
    outputs = {"loss": model.loss, **{f"grad/{k}": g for k, g in md.grad(model.loss, model.params).items()}}
    plan = md.compile(outputs, "model:2", MEGATRON)
    assert _moved(plan, "seq") == []
    feeds = model.feeds(0)
    got, want = md.run_simulated(plan, feeds), md.run_dense(outputs, feeds)
    top = max(float(w.abs().max()) for k, w in want.items() if k.startswith("grad/"))
    for k, w in want.items():
        # fp32: the heads' shares add in another order (~1e-7 relative); a lost or doubled share is O(1).
        scale = top if k.startswith("grad/") else float(w.abs().max())
        torch.testing.assert_close(got[k], w, rtol=0, atol=1e-4 * scale, msg=lambda m, k=k: f"{k}: {m}")
