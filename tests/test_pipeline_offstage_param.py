"""A trained param read on a pipeline stage other than the one its gradient is made on.

MoCo's key encoder reads the query encoder's params through ``md.stop_gradient`` on the last
stage, so their gradients come from stage 0 only, and a tied token table is read by the
embedding on stage 0 and by the LM head on the last stage.  Such a param is held on every stage
that reads it, so its next value (and its optimizer state's) must be made on each of them
(:func:`meshdsl.lowering.partition.update_where_held`): the first step alone cannot show a
stale or missing copy, so each test runs three steps against the dense program's.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import meshdsl as md
from models.transformer import Config, build

STEPS = 3
# fp32: the pipelined step sums each gradient over 2 micro-batches where the dense program sums the
# whole batch at once; three optimizer steps of that reordering stay within a few ulps (brief: 1e-5)
RTOL = ATOL = 1e-5


def _run(model, mesh, layout, opt, microbatches=2, schedule="gpipe", clip_norm=None):
    """The losses of ``STEPS`` steps (feeds ``model.feeds(i)``) and the params after them."""
    step = md.TrainStep(model.loss, model.params, mesh, layout, md.SimulatedComm(md.Mesh.parse(mesh)),
                        optimizer=opt, microbatches=microbatches, schedule=schedule, clip_norm=clip_norm)
    losses = [step(model.feeds(i))[0] for i in range(STEPS)]
    return losses, step.full_params()


def _check(model, mesh, layout, opt, clip_norm=None, **kw):
    want_losses, want_params = _run(model, "data:1", "", opt, microbatches=1, clip_norm=clip_norm)
    losses, params = _run(model, mesh, layout, opt, clip_norm=clip_norm, **kw)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=RTOL, atol=ATOL)
    assert want_losses[-1] != want_losses[0]   # the params did move
    for k, want in want_params.items():
        torch.testing.assert_close(params[k], want, rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("mesh,layout,opt,kw", [
    ("stage:2", "layer:stage", md.AdamW(lr=0.05), {}),
    ("stage:2; data:2", "layer:stage; batch:data", md.SGD(lr=0.1), {"schedule": "zbh1"}),
    # one micro-batch: the update runs in the B actions, not after the micro-batches (unclipped: a
    # clipped update reads the global norm, held on every stage, so it ran on every stage already)
    ("stage:2", "layer:stage", md.AdamW(lr=0.05, weight_decay=0.01), {"microbatches": 1}),
    ("stage:2", "layer:stage", md.AdamW(lr=0.05), {"clip_norm": 0.5}),
    # ZeRO-2: the next value is all-gathered over 'data' within each stage, on both stages
    ("stage:2; data:2", "layer:stage; batch:data; grads.d_model:data; opt.d_model:data", md.AdamW(lr=0.05), {}),
], ids=["adamw", "sgd-data-zbh1", "adamw-m1", "adamw-clipped", "adamw-zero2"])
def test_moco_query_params_read_through_stop_gradient_on_the_last_stage(mesh, layout, opt, kw):
    model = md.load_model("tests/heldout_moco.py", tiny=True, key="stop")
    _check(model, mesh, layout, opt, **kw)


def test_the_update_of_a_param_read_on_two_stages_is_made_on_both():
    model = md.load_model("tests/heldout_moco.py", tiny=True, key="stop")
    step = md.TrainStep(model.loss, model.params, "stage:2", "layer:stage", md.SimulatedComm(md.Mesh.parse("stage:2")),
                        optimizer=md.AdamW(lr=0.05), microbatches=2)
    plan = step.plan
    assert plan.holders[plan.params["q_w_in"]] == (0, 1, 2, 3)   # read on both stages (2 micro-batch ranks each)
    for k in step.carried:   # the param and its optimizer state: next values where they are held
        assert plan.holders[plan.params[k]] == plan.holders[plan.outputs[f"new/{k}"]], k


# read directly on both stages, with a gradient from each: already updated on both (a guard)
@pytest.mark.parametrize("mesh,layout,opt,schedule", [
    ("stage:2", "layer:stage", md.AdamW(lr=0.05), "gpipe"),
    ("stage:2; data:2", "layer:stage; batch:data", md.SGD(lr=0.1), "zbh1"),
], ids=["adamw", "sgd-data-zbh1"])
def test_a_tied_token_table_read_on_the_first_and_last_stages(mesh, layout, opt, schedule):
    model = build(dataclasses.replace(Config.tiny(), tied=True, batch=4))
    _check(model, mesh, layout, opt, schedule=schedule)
