"""A cross-attention cache with both stacks pipelined (issue 35): tests/heldout_xcache.py under
``layer:stage; enc_layer:stage``.

Every decoder layer's keys and values are made from the encoder's output by one einsum, before the
decoder stack, with the decoder's layer dim (a stacked input of the decoder's repeat).  Once refused
(the encoder's backward reads its output's gradient, which was a sum over the decoder's stages taken
after the micro-batches).  Now (lowering/partition.py ``_stacked_inputs``, ``_stacked_input_sums``):
each stage of the decoder's run makes its own layers' keys and values from the encoder's output sent
up to it, and in the backward its own layers' part of the output's gradient, per micro-batch, summed
down the decoder's stages to the encoder's last stage (a stage sum, :mod:`meshdsl.lowering.stage_sum`).
Before, a decoder over several stages read, on every stage, the first stage's keys and values: a
wrong loss, silently, even without gradients (checked here).  Every output matches the dense program:
each stack on its own stages, the encoder over both, the decoder over both, ``stage:3``, data
parallel, m = 2 and 4, virtual stages (``interleaved:V``, once refused too), the cache split by heads too
(``heads:model``, once refused as read otherwise), AdamW steps, one case on two
gloo processes.  Still refused, with the reason: the encoder's output read otherwise too (a skip around
the decoder, or the decoder's first carry made from it).
"""
from __future__ import annotations

import pathlib

import pytest

import meshdsl as md
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.errors import LayoutError
from meshdsl.processes import launcher as launch

from conftest import (assert_heldout_case_matches_dense, assert_matches_scaled, assert_ranks_match_dense,
                      assert_steps_track_dense, heldout_outputs, held_outputs_on_this_rank)

XCACHE = str(pathlib.Path(__file__).parent / "heldout_xcache.py")
BOTH = "layer:stage; enc_layer:stage"
# fp32 with O(1) values: the stages and micro-batches add the same terms in another order (n * 2**-24
# of the magnitudes), far below 1e-5; a stage's keys and values read on another, or a gradient part
# lost from the stage sum, is off by O(1).
REL = 1e-5


@pytest.mark.parametrize("mesh, layout, kw", [
    # 2 + 2 layers: the encoder on stage 0, the decoder on stage 1 (stored in parts, empty on stage 0)
    ("stage:2", BOTH, {"schedule": "1f1b", "microbatches": 2}),
    # the decoder over both stages: each makes its own layer's keys and values; the gradient's sum
    # runs from stage 1 down to stage 0, where the encoder ends
    ("stage:2", BOTH, {"schedule": "1f1b", "microbatches": 4, "stage_layers": (3, 1)}),
    # the encoder over both stages, the decoder on stage 1: the stages meet on stage 1
    ("stage:2", BOTH, {"schedule": "gpipe", "microbatches": 2, "stage_layers": (1, 3)}),
    ("stage:2; data:2", BOTH + "; batch:data", {"schedule": "zbh1", "microbatches": 2, "stage_layers": (3, 1)}),
    ("stage:3", BOTH, {"schedule": "1f1b", "microbatches": 2, "stage_layers": (1, 2, 1)}),
], ids=str)
def test_the_cache_model_with_both_stacks_pipelined_matches_dense(mesh, layout, kw):
    assert_heldout_case_matches_dense((XCACHE, {}, mesh, layout, kw))


def test_the_loss_alone_reads_each_stages_own_keys_and_values():
    """Without gradients too: the keys and values made on one stage, the decoder over two, gave a
    wrong loss (every stage read the first stage's layer) before each stage made its own."""
    model = md.load_model(XCACHE, tiny=True)
    want = md.run_dense({"loss": model.loss}, model.feeds(0))
    plan = md.compile({"loss": model.loss}, "stage:2", BOTH, microbatches=2, schedule="1f1b", stage_layers=(3, 1))
    assert_matches_scaled(md.run_simulated(plan, model.feeds(0)), want, "loss, decoder over both stages", REL)


@pytest.mark.parametrize("kw", [{"schedule": "1f1b"}, {"schedule": "1f1b", "stage_layers": (3, 1)},
                                {"schedule": "interleaved:2"}], ids=str)
def test_adamw_steps_on_the_cache_model_give_the_dense_params(kw, one_torch_thread):
    """The cache's params (the stacked key and value weights, stored at the decoder's counts) are
    updated on the stages holding their layers, so the next step reads them there."""
    model = md.load_model(XCACHE, tiny=True)

    def step(mesh, layout, **kw):
        mesh = md.Mesh.parse(mesh) if mesh else md.Mesh(())
        return md.TrainStep(model.loss, model.params, mesh, layout, SimulatedComm(mesh), optimizer=md.AdamW(lr=0.01),
                            **kw)
    pipe = step("stage:2", BOTH, microbatches=2, **kw)
    dense = step("", None)
    assert_steps_track_dense(pipe, dense, model, REL, f"AdamW, {kw}")


@pytest.mark.parametrize("over, mesh, layout, kw", [
    ({}, "stage:2", BOTH, {"microbatches": 4}),
    ({}, "stage:2; data:2", BOTH + "; batch:data", {"microbatches": 2}),
    # the decoder on both chunks of each rank: each chunk its own layers' keys, values and their gradients
    ({"layers": 4}, "stage:2", BOTH, {"microbatches": 2, "stage_layers": (1, 2, 1, 2)}),
    ({"layers": 4}, "stage:2", BOTH, {"microbatches": 4, "schedule": "interleaved-zb:3", "stage_layers": (1,) * 6}),
], ids=str)
def test_the_cache_model_on_virtual_stages_matches_dense(over, mesh, layout, kw):
    """Once refused (a stacked gradient read per micro-batch under virtual stages): each chunk runs the
    steps of its own layers of the stacked key and value gradients (:mod:`meshdsl.lowering.stacks_on_ranks`),
    the gradient's parts summed down the logical stages (a copy between two chunks of one rank)."""
    assert_heldout_case_matches_dense((XCACHE, over, mesh, layout, {"schedule": "interleaved:2", **kw}))


def _cache_model(skip: bool, heads: bool = False):
    """An encoder's output ``mem`` read by the decoder as a stacked input (``k``, one row per decoder
    layer, made by an einsum with a stacked param) and, with ``skip``, by the loss too.  With ``heads``
    the cache has a ``heads`` dim instead of ``d_model`` (its einsum contracts ``d_model``, the
    gradient's contracts ``heads``: partial over ``model`` too under ``heads:model``)."""
    import torch
    b, d, le, ld = md.Dim("batch", 8), md.Dim("d_model", 4), md.Dim("enc_layer", 2), md.Dim("layer", 2)
    h = md.Dim("heads", 2)
    with md.Graph("tiny_cache"):
        x, y0 = md.input("x", [b, d]), md.input("y", [b, d])
        we, wd = md.param("we", [le, d]), md.param("wd", [ld, d])
        wk = md.param("wk", [ld, d, h] if heads else [ld, d])
        mem = md.repeat(lambda h, p: md.tanh(h * p["w"]) + h, x, {"w": we}, "enc_layer")
        ps = {"w": wd, "k": md.einsum(f"batch d_model, layer d_model{' heads' * heads} -> layer batch "
                                      f"{'heads' if heads else 'd_model'}", mem, wk)}
        if heads:
            ps["o"] = md.param("wo", [ld, h, d])
        y = md.repeat(lambda h, p: md.tanh(h * p["w"] + (md.einsum("batch heads, heads d_model -> batch d_model",
                                                                  p["k"], p["o"]) if heads else p["k"])) + h,
                      y0, ps, "layer")
        loss = md.reduce_sum(y * y) + (0.1 * md.reduce_sum(mem * mem) if skip else 0.0)
    gen = torch.Generator().manual_seed(2)
    return ({"loss": loss, **md.grad(loss, {"we": we, "wd": wd, "wk": wk, **({"wo": ps["o"]} if heads else {})})},
            {"x": torch.randn(8, 4, generator=gen), "y": torch.randn(8, 4, generator=gen)})


@pytest.mark.parametrize("stage_layers", [None, (3, 1)], ids=str)
def test_the_encoders_output_also_read_after_the_decoder_stays_refused(stage_layers):
    """The output's gradient then adds the loss's own term to the decoder's parts; each stage's part of
    the lowering's sum over the stages holds a share of that term (1/p), which the decoder's stages
    alone would not sum: refused with the reason, as it once was for every cache.  Without the skip
    the same model runs."""
    outs, feeds = _cache_model(skip=False)
    plan = md.compile(outs, "stage:2", BOTH, microbatches=2, schedule="1f1b", stage_layers=stage_layers)
    assert_matches_scaled(md.run_simulated(plan, feeds), md.run_dense(outs, feeds), f"{stage_layers}", REL)
    outs, _ = _cache_model(skip=True)
    with pytest.raises(LayoutError, match=r"(?s)the backward of stack 'enc_layer' reads its output's gradient.*"
                                          r"stacked gradient of \['k'\] of stack 'layer' and other terms.*"
                                          r"also read otherwise.*Fix: read the output of 'enc_layer' only"):
        md.compile(outs, "stage:2", BOTH, microbatches=2, schedule="1f1b", stage_layers=stage_layers)


@pytest.mark.parametrize("stage_layers", [None, (3, 1)], ids=str)
def test_a_cache_split_by_heads_too_matches_dense(stage_layers):
    """Once refused as read otherwise (it was not): under ``heads:model`` the gradient of the encoder's
    output, from the cache's einsum, is partial over (stage, model) and the lowering made one allreduce
    over both.  Now (lowering/partition.py ``_stage_sums_first``) it is summed down the decoder's stages
    per micro-batch, then over ``model`` on the stage where the encoder ends.  The skip still refused."""
    layout = BOTH + "; heads:model"
    outs, feeds = _cache_model(skip=False, heads=True)
    plan = md.compile(outs, "stage:2; model:2", layout, microbatches=2, schedule="1f1b", stage_layers=stage_layers)
    assert_matches_scaled(md.run_simulated(plan, feeds), md.run_dense(outs, feeds), f"heads, {stage_layers}", REL)
    outs, _ = _cache_model(skip=True, heads=True)
    with pytest.raises(LayoutError, match=r"(?s)the backward of stack 'enc_layer' reads its output's gradient.*"
                                          r"also read otherwise"):
        md.compile(outs, "stage:2; model:2", layout, microbatches=2, schedule="1f1b", stage_layers=stage_layers)


@pytest.mark.parametrize("case", [
    (XCACHE, {}, "stage:2; model:2", BOTH + "; heads:model", {"schedule": "1f1b", "microbatches": 2}),
    # Flamingo's width split: its cache's einsum contracts it, so the gradient is partial over (stage, model) too
    (str(pathlib.Path(__file__).parent / "heldout_flamingo.py"), {"kv_stacked": True}, "stage:2; model:2",
     "blk:stage; rl:stage; e:model", {"schedule": "zbh1", "microbatches": 2}),
], ids=str)
def test_the_held_out_caches_split_by_heads_match_dense(case):
    assert_heldout_case_matches_dense(case)


def _on_two_processes(comm):
    import torch
    torch.set_num_threads(1)
    model = md.load_model(XCACHE, tiny=True)
    plan = md.compile(heldout_outputs(model), "stage:2", BOTH, microbatches=2, schedule="1f1b", stage_layers=(3, 1))
    return held_outputs_on_this_rank(comm, plan, model.feeds(0))


@pytest.mark.timeout(200)
def test_the_cache_model_on_two_gloo_processes():
    model = md.load_model(XCACHE, tiny=True)
    want = md.run_dense(heldout_outputs(model), model.feeds(0))
    results = launch.spawn(_on_two_processes, 2, mesh="stage:2", timeout=180)
    assert_ranks_match_dense(results, want, REL)


@pytest.mark.parametrize("stage_layers", [None, (3, 1)], ids=str)
def test_a_cache_whose_einsum_contracts_a_split_width_matches_dense(stage_layers):
    """Under ``d_model:model`` the cache's einsum contracts the split width: partial over ``model``, summed
    within each stage (an allreduce over ``model``), and in the backward the stacked gradient too (the block's
    einsum contracts ``d_model``).  Once the forward's sum and what it sums ran on the encoder's last stage,
    which sent on its own part of the decoder's layers: on the simulated mesh a wrong loss with the decoder
    over both stages (each read the first stage's keys); with the decoder on stage 1 only, the held-out model
    sent an empty part (an internal error).  And the backward's sum hid the stage sum: a false refusal.  Now
    (lowering/partition.py ``_stacked_inputs``, ``_steps_behind``) a collective within a stage is one of the
    steps each stage of the decoder's run makes its own layers' part with.  The skip is still refused."""
    layout = BOTH + "; d_model:model"
    outs, feeds = _cache_model(skip=False, heads=True)
    plan = md.compile(outs, "stage:2; model:2", layout, microbatches=2, schedule="1f1b", stage_layers=stage_layers)
    assert_matches_scaled(md.run_simulated(plan, feeds), md.run_dense(outs, feeds), f"d_model, {stage_layers}", REL)
    outs, _ = _cache_model(skip=True, heads=True)   # (or refused as the towers' outputs joined after them)
    with pytest.raises(LayoutError, match=r"(?s)the backward of stack 'enc_layer' reads its output's gradient.*"
                                          r"also read otherwise|reads the outputs of 2 pipelined stacks"):
        md.compile(outs, "stage:2; model:2", layout, microbatches=2, schedule="1f1b", stage_layers=stage_layers)


def test_the_held_out_cache_under_a_split_width_matches_dense():
    """The report's case (``meshdsl check`` gave 'rank 4 was sent (0, 2, 6, 2, 4), its plan expects
    (2, 2, 6, 2, 4)'): the decoder on stage 1 only, its keys and values summed over ``model`` there."""
    assert_heldout_case_matches_dense((XCACHE, {}, "stage:2; model:2", BOTH + "; d_model:model",
                                       {"schedule": "1f1b", "microbatches": 2}))
