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


def test_a_new_view_of_the_same_memory_keeps_the_slices():
    """An interleaved chunk's layers of a stacked param are a view made afresh each step: the
    same bytes in the same geometry keep the slices; another part of the memory remakes them."""
    w = torch.randn(4, 3, 5)
    slices = _LayerParams(("w",), {"w": 0}, range(1))
    first = slices([[w.narrow(0, 2, 2)]], 1)
    assert torch.equal(first["w"][0], w[3])
    assert slices([[w.narrow(0, 2, 2)]], 1) is first          # a new view object, the same memory
    w[3].add_(1.0)                                            # (a view: an update shows through)
    assert torch.equal(first["w"][0], w[3])
    other = slices([[w.narrow(0, 1, 2)]], 1)                  # other layers of the stack
    assert other is not first and torch.equal(other["w"][0], w[2])
    wider = slices([[w.narrow(0, 1, 3)]], 1)                  # same start, another shape
    assert wider is not other and torch.equal(wider["w"][0], w[2])


def test_an_interleaved_pipeline_slices_its_layers_once(monkeypatch):
    """Each F and B loop of every chunk and micro-batch takes its layers' slices from the chunk's
    stacked params; after the first run they are all reused (a run makes none), and the runs'
    numbers stay the dense program's."""
    cfg = dataclasses.replace(Config.tiny(), layers=4, batch=8)
    model = build(cfg)
    outs = training_outputs(model.loss, model.params, 0.1, with_grads=True)
    feeds = model.feeds(0)
    plan = md.compile(outs, "stage:2", "layer:stage", microbatches=4, schedule="interleaved:2")
    ex = md.Executor(plan, SimulatedComm(plan.mesh))
    params = md.run_dense(dict(model.params))
    want = md.run_dense(outs, feeds, params)
    local = {k: ex.local_slices(plan.values[plan.params[k]], v) for k, v in params.items()}
    made = []
    sliced = _LayerParams._slice
    monkeypatch.setattr(_LayerParams, "_slice", lambda self, *a: made.append(1) or sliced(self, *a))
    per_run = []
    for _ in range(3):
        made.clear()
        got = ex.full_outputs(ex.run(feeds, local))
        per_run.append(len(made))
        scale_of = want["loss"].abs().item()
        torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-5, atol=1e-5 * scale_of)  # fp32 order only
    # 2 ranks x 2 chunks x 4 micro-batches, an F and a B loop each, one layer per chunk
    assert per_run == [2 * 2 * 4 * 2, 0, 0]
