"""A layer loop's per-layer param slices (runtime/layers.py ``_LayerParams``) and its body's feeds.

A pipeline stage runs its layers once per micro-batch and every step with the same
stacked params: the slices are made once and reused while the stacked tensors are the
same objects.  Reuse must never serve stale values: an in-place update shows through
(the slices are views), and a new stacked tensor gets new slices.
"""
from __future__ import annotations

import dataclasses

import torch

import meshdsl as md
from meshdsl.runtime.layers import _LayerParams
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.train.step import training_outputs
from models.transformer import Config, build


def test_slices_are_reused_for_the_same_tensors_and_remade_for_new_ones():
    w, b = torch.randn(3, 4, 5), torch.randn(5, 3)
    slices = _LayerParams(("w", "b"), {"w": 0, "b": 1}, range(1))
    first = slices([[w], [b]], 2)
    assert torch.equal(first["w"][0], w[2]) and torch.equal(first["b"][0], b[:, 2])
    assert slices([[w], [b]], 2) is first                 # same tensors: the same slices
    w.add_(1.0)                                           # an update in place shows through
    assert torch.equal(first["w"][0], w[2])
    w2 = w.clone() * 3                                    # a new stacked tensor: new slices
    again = slices([[w2], [b]], 2)
    assert again is not first and torch.equal(again["w"][0], w2[2])
    assert slices([[w2], [b]], 1)["w"][0].data_ptr() == w2[1].data_ptr()


def test_a_pipeline_over_new_params_each_run_matches_the_dense_program():
    """Params given anew to every run (no donation): each run computes with its own."""
    cfg = dataclasses.replace(Config.tiny(), layers=4, batch=8)
    model = build(cfg)
    outs = training_outputs(model.loss, model.params, 0.1, with_grads=True)
    feeds = model.feeds(0)
    plan = md.compile(outs, "stage:2", "layer:stage", microbatches=4, schedule="zbh1")
    ex = md.Executor(plan, SimulatedComm(plan.mesh))
    base = md.run_dense(dict(model.params))
    for scale in (1.0, 0.5, 1.0):
        params = {k: v * scale for k, v in base.items()}
        want = md.run_dense(outs, feeds, params)
        local = {k: ex.local_slices(plan.values[plan.params[k]], v) for k, v in params.items()}
        got = ex.full_outputs(ex.run(feeds, local))
        scale_of = want["loss"].abs().item()
        torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-5, atol=1e-5 * scale_of)
        for k in (k for k in want if k.startswith("grad/")):
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5 * want[k].abs().max().item())
