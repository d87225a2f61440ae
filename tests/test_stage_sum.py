"""Pipelines whose layers read tensors from outside their repeat (the partition's side inputs).

A tiny T5-style encoder-decoder (tests/t5_tiny.py): the decoder stack is pipelined
(``layer:stage``), the encoder stack runs on stage 0, and every decoder layer reads the
encoder's output, a batch-split padding mask, a position table without a batch dim and a
shared gate param.  The encoder's output goes from stage 0 to the later stages once per
micro-batch with the carry, and its gradient comes back down the stages the way the carry's
gradient does, each stage adding its layers' part (lowering/stage_sum.py); the tables are
fed to every stage that reads them, and the shared param's gradient is summed over the
stages after the micro-batches.  Every output matches the dense program (simulated mesh;
one case on two gloo processes).
"""
from __future__ import annotations

import multiprocessing

import pytest
import torch

import meshdsl as md
from meshdsl.processes import launcher as launch

import t5_tiny as t5
from conftest import assert_matches_scaled, held_outputs_on_this_rank

# fp32 with O(1) values: rounding only, relative to each output's magnitude (the stages and
# the micro-batches add the layers' and the batch's parts in other orders than the dense program)
REL = 1e-5
CFG = t5.Config()


@pytest.fixture(scope="module")
def model():
    outs, _ = t5.build(CFG)
    feeds = t5.feeds(CFG)
    return outs, feeds, md.run_dense(outs, feeds)


def _close(got, want, what=""):
    assert_matches_scaled(got, want, what, REL)


@pytest.mark.parametrize("mesh, layout, kw", [
    ("data:2; model:2", "batch:data; heads:model; d_ff:model", {}),
    ("data:2; model:2", "batch:data; heads:model; d_ff:model; params.d_model:data", {}),
    ("stage:2", "layer:stage", {"microbatches": 2, "schedule": "gpipe"}),
    ("stage:2", "layer:stage", {"microbatches": 4, "schedule": "zbh1"}),  # 1f1b: the gloo case below
    ("stage:2; data:2", "layer:stage; batch:data", {"microbatches": 2, "schedule": "1f1b"}),
])
def test_encoder_decoder_matches_dense(model, mesh, layout, kw):
    outs, feeds, want = model
    _close(md.run_simulated(md.compile(outs, mesh, layout, **kw), feeds), want, f"{mesh} / {layout} {kw}")


def _stage_of(plan, vid):
    return {plan.mesh.coords(r)["stage"] for r in plan.holders[vid]}


def test_side_inputs_reach_the_stages_that_read_them(model):
    outs, _, _ = model
    m = 2
    plan = md.compile(outs, "stage:2", "layer:stage", microbatches=m)
    pipe = plan.steps[-1]
    _, forward, backward, final = pipe.subplans
    # the encoder runs on stage 0 only; the decoder's stacked params and the shared gate on both;
    # the tables are fed to both stages, not sent
    assert _stage_of(plan, plan.params["enc_wq"]) == {0}
    assert _stage_of(plan, plan.params["dec_xq"]) == _stage_of(plan, plan.params["gate"]) == {0, 1}
    assert _stage_of(plan, plan.inputs["pos"]) == _stage_of(plan, plan.inputs["src_mask"]) == {0, 1}
    enc_bytes = CFG.batch // m * CFG.src_seq * CFG.d_model * 4  # one micro-batch's encoder output
    # forward: the carry and the encoder's output, stage 0 to 1
    sends = [s for s in forward.steps if s.kind == "send"]
    assert sorted(s.bytes for s in sends) == sorted([enc_bytes, CFG.batch // m * CFG.tgt_seq * CFG.d_model * 4])
    assert all(s.args["offset"] == 1 for s in sends)
    # backward: the carry's gradient and stage 1's part of the encoder output's gradient, 1 to 0,
    # added on stage 0 to its own part before the encoder's backward
    sends = [s for s in backward.steps if s.kind == "send"]
    assert sorted(s.bytes for s in sends) == sorted([enc_bytes, CFG.batch // m * CFG.tgt_seq * CFG.d_model * 4])
    assert all(s.args["offset"] == -1 for s in sends)
    adds = [(s, st) for s, st in zip(backward.steps, pipe.args["program"].stages[2]) if "sum over the stages" in s.label]
    assert len(adds) == 1 and adds[0][1] == (0,)
    # after the micro-batches: the shared gate's gradient, summed over the stages and micro-batches
    over_stage = [s for s in final.steps if "stage" in s.axes and s.kind not in ("send", "recv")]
    assert [(s.kind, set(s.axes), s.bytes) for s in over_stage] == [("allreduce", {"stage", "_mb"}, CFG.d_model * 4)]


def test_a_table_stacked_along_layer_is_computed_on_every_stage():
    """A table fed as an input and broadcast along the layer dim as a stacked param (the way
    rotary tables were passed before a block could read it): no crash, the dense numbers."""
    b, s, d, l = md.Dim("batch", 4), md.Dim("seq", 3), md.Dim("d_model", 4), md.Dim("layer", 2)
    with md.Graph("tables"):
        x, tab, w = md.input("x", [b, s, d]), md.input("tab", [s, d]), md.param("w", [l, d])
        y = md.repeat(lambda h, p: md.tanh(h * p["w"] + p["t"]), x,
                      {"w": w, "t": md.broadcast_to(tab, md.Shape([l, s, d]))}, "layer")
        loss = md.reduce_sum(y * y)
        outs = {"loss": loss, "grad/w": md.grad(loss, [w])[0]}
    feeds = {"x": torch.randn(4, 3, 4), "tab": torch.randn(3, 4)}
    plan = md.compile(outs, "stage:2", "layer:stage", microbatches=2)
    prologue, forward = plan.steps[-1].subplans[:2]
    # once per step on each stage (its own layers' part), not per micro-batch
    assert "broadcast_to" in [s.op for s in prologue.steps] and "broadcast_to" not in [s.op for s in forward.steps]
    _close(md.run_simulated(plan, feeds), md.run_dense(outs, feeds))


def test_dropout_streams_of_pipelined_layers_after_an_encoder_of_another_depth():
    """Each pipelined layer salts its dropout by its global index, whatever stack runs before it
    on stage 0 (here an encoder of 3 layers, the decoder's stages 2 each)."""
    b, d, l, e = md.Dim("batch", 4), md.Dim("d_model", 8), md.Dim("layer", 4), md.Dim("enc_layer", 3)
    with md.Graph("salted"):
        x, we, wd = md.input("x", [b, d]), md.param("we", [e, d]), md.param("wd", [l, d])
        enc = md.repeat(lambda h, p: md.tanh(h * p["w"]), x, {"w": we}, "enc_layer")
        y = md.repeat(lambda h, p: md.dropout(md.tanh(h * p["w"] + enc), 0.5, 7), x, {"w": wd}, "layer")
        loss = md.reduce_sum(y * y)
        outs = {"loss": loss, **md.grad(loss, {"we": we, "wd": wd})}
    feeds = {"x": torch.randn(4, 8, generator=torch.Generator().manual_seed(0))}
    for m in (1, 2):
        _close(md.run_simulated(md.compile(outs, "stage:2", "layer:stage", microbatches=m), feeds),
               md.run_dense(outs, feeds), f"m={m}")


def test_a_batch_statistic_read_by_pipelined_layers_matches_dense():
    """Every micro-batch's layers read the whole batch's mean of a value made from params and the
    inputs, fixed when the step starts: it is made once before the micro-batches, and its gradient,
    each stage's sum over its own layers, is summed over the batch after them (it was refused)."""
    b, d, l = md.Dim("batch", 8), md.Dim("d_model", 4), md.Dim("layer", 2)
    with md.Graph("stat"):
        x, w, w0 = md.input("x", [b, d]), md.param("w", [l, d]), md.param("w0", [d])
        mean = md.reduce_mean(x * w0, "batch")
        loss = md.reduce_sum(md.repeat(lambda h, p: md.tanh(h * p["w"] + mean), x, {"w": w}, "layer"))
        outs = {"loss": loss, **{f"grad/{k}": g for k, g in md.grad(loss, {"w": w, "w0": w0}).items()}}
    feeds = {"x": torch.randn(8, 4, generator=torch.Generator().manual_seed(0)) + 1.0}
    res = md.check(outs, "stage:2", "layer:stage", feeds, microbatches=2, schedule="1f1b")
    assert res.ok, str(res)


def _pipelined_t5(comm, mesh, layout, m, schedule):
    outs, _ = t5.build(CFG)
    plan = md.compile(outs, mesh, layout, microbatches=m, schedule=schedule)
    return held_outputs_on_this_rank(comm, plan, t5.feeds(CFG))


@pytest.mark.timeout(200)
def test_encoder_decoder_pipelined_on_gloo_processes(model):
    _, _, want = model
    results = launch.spawn(_pipelined_t5, 2, args=("stage:2", "layer:stage", 2, "1f1b"), mesh="stage:2",
                           timeout=180)
    assert multiprocessing.active_children() == []
    seen: dict = {}
    for rank, got in enumerate(results):
        _close(got, {k: want[k] for k in got}, f"rank {rank}")
        seen.update(got)
    assert set(seen) == set(want)  # every output is held by some rank
