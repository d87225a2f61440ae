"""Held-out models of round 7b (written from the README and docs alone): model families beyond
transformers.

``tests/heldout_lstm.py`` (a two-layer LSTM language model under ``md.repeat`` over ``layer``, its
time steps a Python loop, or with ``recurrence="repeat"`` a second ``md.repeat`` over ``seq``
nested in the layer's block); ``tests/heldout_pixelcnn.py`` (masked 3x3 convs of type A then B
over ``height`` and ``width``, gated units, a 256-way softmax per pixel);
``tests/heldout_nerf.py`` (sin/cos encoding, a skip concat, volume rendering with an exclusive
cumulative product of ``1 - alpha`` over ``samples`` written as ``exp(cumsum(log))``);
``tests/heldout_simclr.py`` (two views through one encoder, the NT-Xent loss over the
``[2B, 2B]`` similarities: the batch contracted with itself); ``tests/heldout_settransformer.py``
(ISAB blocks with inducing points, PMA pooling); ``tests/heldout_patchtst.py`` (RevIN, patches by
``md.rearrange``, an encoder over patches, a linear horizon head). Each under data, tensor,
FSDP, split sequence/sample/spatial/set dims, uneven splits and 1f1b pipelines, forward and
gradients against the dense program; one gloo case; the layout search's top candidates. An LSTM
layer whose time steps are the outermost repeat pipelines over time (``seq:stage``).

What they led to: a weight-only value broadcast over the batch inside a repeat's block (the Set
Transformer's inducing points, projected once per layer) made the block's backward reduce its
gradient over the micro-batches, so every micro-batched run (a pipeline, accumulation) was
refused; its partial sum now passes through the einsums of the weights' gradients
(``lowering/generic.py``). The refusal of a split dim that a nested repeat scans named 'layer'
and a "stacked param"; a micro-batched model without a dim named ``batch`` did not say to name it.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import (assert_heldout_case_matches_dense, assert_ranks_match_dense,
                      assert_search_top_layouts_match_dense, heldout_case_id, heldout_outputs,
                      held_outputs_on_this_rank)

HERE = Path(__file__).parent
LSTM, PIXEL, NERF, SIMCLR, SETT, PATCH = (str(HERE / f"heldout_{n}.py") for n in
                                          ("lstm", "pixelcnn", "nerf", "simclr", "settransformer", "patchtst"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}
SCAN = {"recurrence": "repeat"}

# (model, config overrides, mesh, layout, compile keywords)
CASES = [
    (LSTM, {}, "data:2; model:2", "batch:data; d_model:model"),        # the recurrent matmul split each step
    (LSTM, {}, "data:2", "seq:data"),                                   # 5 steps on 2 ranks
    (LSTM, {}, "data:3", "batch:data; params.d_model:data"),            # FSDP, 4 rows on 3 ranks
    (LSTM, {}, "stage:2; model:2", "layer:stage; gate:model", PIPE),
    (LSTM, SCAN, "data:2; model:2", "batch:data; d_model:model"),       # the nested repeat over seq
    (LSTM, SCAN, "model:2", "gate:model"),
    (LSTM, SCAN, "stage:2", "layer:stage", PIPE),
    (PIXEL, {}, "data:2; model:2", "height:data; width:model"),         # halos both ways (6 and 5 rows)
    (PIXEL, {}, "data:3", "height:data"),
    (PIXEL, {}, "model:2", "d_out:model"),                              # gated convs' outputs split
    (PIXEL, {}, "data:2; model:2", "batch:data; levels:model"),         # the 256-way softmax split
    (PIXEL, {}, "data:2", "batch:data; params.d_model:data"),
    (PIXEL, {}, "stage:2", "layer:stage", PIPE),
    (NERF, {}, "data:2; model:2", "samples:data; d_hidden:model"),      # the cumsum over split samples
    (NERF, {"samples": 5}, "data:2", "samples:data"),
    (NERF, {}, "model:2", "d_cat:model"),                               # the skip concat split
    (NERF, {}, "model:3", "xyz:model"),                                 # the encoding's rearrange
    (NERF, {}, "data:2", "batch:data; params.d_hidden:data"),
    (NERF, {}, "stage:2; data:2", "layer:stage; samples:data", PIPE),
    (SIMCLR, {}, "data:2", "batch:data"),                               # [2B, 2B] from a split batch
    (SIMCLR, {}, "data:2", "view_batch:data; key:data"),
    (SIMCLR, {"batch": 5}, "data:2; model:2", "batch:data; d_ff:model"),
    (SIMCLR, {}, "data:2", "view:data; params.d_model:data"),
    (SIMCLR, {}, "stage:2", "layer:stage", {"microbatches": 1, "schedule": "1f1b"}),
    (SETT, {}, "data:2; model:2", "batch:data; heads:model; d_ff:model"),
    (SETT, {}, "model:2", "elems:model"),                               # the set split: keys, then queries
    (SETT, {"elems": 5}, "model:2", "elems:model"),
    (SETT, {}, "model:3", "induce:model"),
    (SETT, {}, "data:2", "batch:data; params.d_model:data"),
    (SETT, {}, "stage:2", "layer:stage", PIPE),                         # the inducing points under micro-batches
    (SETT, {}, "stage:2; model:2", "layer:stage; elems:model", PIPE),
    (PATCH, {}, "data:2; model:2", "batch:data; heads:model; d_ff:model"),
    (PATCH, {}, "data:3", "time:data"),                                 # patches straddle the ranks' rows
    (PATCH, {}, "model:3", "patches:model"),
    (PATCH, {}, "data:2", "channels:data; params.d_model:data"),
    (PATCH, {}, "stage:2; data:2", "layer:stage; channels:data", PIPE),
]


@pytest.mark.parametrize("case", CASES, ids=[heldout_case_id(c) for c in CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


def _dense(path, names):
    """The tiny model and its dense ``names`` outputs (with the loss, which reads every input)."""
    model = md.load_model(path, tiny=True)
    return model, md.run_dense({"loss": model.loss, **{n: model.outputs[n] for n in names}}, model.feeds(0))


def test_lstm_loop_and_nested_repeat_are_the_same_model():
    """The recurrence written as a Python loop and as a repeat over seq: the same loss and
    gradients (the same kernels in another order)."""
    a, b = md.load_model(LSTM, tiny=True), md.load_model(LSTM, tiny=True, **SCAN)
    ga, gb = md.run_dense(heldout_outputs(a), a.feeds(0)), md.run_dense(heldout_outputs(b), b.feeds(0))
    for k in ga:   # fp32 rounding of the same sums: ~1e-7 relative; a wrong gate or step is O(1)
        torch.testing.assert_close(gb[k], ga[k], rtol=1e-5, atol=1e-7)


def test_pixelcnn_is_causal_in_raster_order():
    """The logits of pixel (i, j) read only the pixels before it: changing pixel (2, 2) leaves
    every logit before it unchanged and changes some after it."""
    model = md.load_model(PIXEL, tiny=True)
    feeds = model.feeds(0)
    other = feeds["pixels"].clone()
    other[:, 2, 2] = (other[:, 2, 2] + 128) % 256
    f = lambda px: md.run_dense({"y": model.outputs["logits"]}, {"pixels": px})["y"]
    a, b = f(feeds["pixels"]), f(other)
    w = a.shape[2]
    moved = (a - b).abs().amax(dim=(0, 3)).flatten()      # per raster position
    assert moved[:2 * w + 3].max() == 0 and moved[2 * w + 3:].max() > 1e-4, moved


def test_nerf_weights_are_alpha_times_the_exclusive_product():
    """The rendering weights against torch's cumprod: T_i = prod_{j<i} (1 - alpha_j)."""
    _, out = _dense(NERF, ["alpha", "weights"])
    alpha = out["alpha"]
    trans = torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha[:, :-1]], 1), 1)
    # exp(cumsum(log(.))) against a product: fp32 rounding, ~1e-6 relative
    torch.testing.assert_close(out["weights"], alpha * trans, rtol=1e-5, atol=1e-7)
    assert float(alpha.max()) > 1e-3


def test_simclr_loss_is_nt_xent():
    """The loss against NT-Xent written in torch from the projections: the other view's index as
    the label, the diagonal left out."""
    model, out = _dense(SIMCLR, ["z"])
    z, b = out["z"], model.config.batch
    assert torch.allclose(z.norm(dim=1), torch.ones(2 * b), atol=1e-5)
    sim = (z @ z.T / model.config.temperature).masked_fill(torch.eye(2 * b, dtype=torch.bool), float("-inf"))
    want = torch.nn.functional.cross_entropy(sim, torch.cat([torch.arange(b, 2 * b), torch.arange(b)]))
    torch.testing.assert_close(out["loss"], want, rtol=1e-5, atol=0)    # fp32 rounding


def test_set_transformer_is_permutation_invariant():
    """Shuffling the elements of each set leaves the logits as they are (fp32 rounding)."""
    model = md.load_model(SETT, tiny=True)
    feeds = model.feeds(0)
    perm = torch.randperm(model.config.elems, generator=torch.Generator().manual_seed(1))
    f = lambda x: md.run_dense({"y": model.outputs["logits"]}, {"x": x})["y"]
    torch.testing.assert_close(f(feeds["x"][:, perm]), f(feeds["x"]), rtol=1e-5, atol=1e-6)


def test_patchtst_forecast_follows_a_rescaled_series():
    """RevIN: a series scaled by a and shifted by b gets the forecast scaled and shifted alike."""
    model = md.load_model(PATCH, tiny=True)
    feeds = model.feeds(0)
    f = lambda x: md.run_dense({"y": model.outputs["forecast"]}, {"x": x})["y"]
    # the normalised input is the same up to fp32 rounding of the mean and std (~1e-6 relative)
    torch.testing.assert_close(f(feeds["x"] * 3.0 + 7.0), f(feeds["x"]) * 3.0 + 7.0, rtol=1e-4, atol=1e-4)


def test_a_weight_only_value_broadcast_over_the_batch_in_a_block_accumulates():
    """A per-layer param projected once, then read by every example, in a repeat's block: its
    gradient sums over the micro-batches; it passes on partial through the weights' gradient
    einsums (it was refused as a sum over the micro-batches in every layer)."""
    b, d, layer, ind = md.Dim("batch", 4), md.Dim("d_model", 3), md.Dim("layer", 2), md.Dim("induce", 2)
    with md.Graph():
        x = md.input("x", [b, d])
        pts = md.param("pts", [layer, ind, d], fan_out=["layer"], scale=1.0)
        w = md.param("w", [layer, d, md.Dim("d_out", 3)], fan_out=["layer", "d_out"])

        def block(h, p):
            q = md.rename(md.einsum("induce d_model, d_model d_out -> induce d_out", p["pts"], p["w"]),
                          d_out="d_model")
            s = md.einsum("batch d_model, induce d_model -> batch induce", h, q)
            return h + md.einsum("batch induce, induce d_model -> batch d_model", md.tanh(s), q)

        loss = md.reduce_mean(md.repeat(block, x, {"pts": pts, "w": w}, "layer") ** 2)
        outs = {"loss": loss, **md.grad(loss, {"pts": pts, "w": w})}
    feeds = {"x": torch.randn(4, 3, generator=torch.Generator().manual_seed(0))}
    for mesh, layout, kw in [("data:1", "", {"microbatches": 2}),
                             ("stage:2; model:2", "layer:stage; d_model:model", PIPE)]:
        assert md.check(outs, mesh, layout, feeds, **kw).ok, (mesh, layout)


def test_a_recurrence_as_the_outermost_repeat_pipelines_over_time():
    """One LSTM layer whose time steps are the outermost repeat (over ``seq``, the per-step input
    projections its stacked tensor, made from a param before the stack; the recurrent weight
    read from outside): ``seq:stage`` pipelines the time steps, micro-batched, with the dense
    numbers, and so does plain accumulation."""
    b, s, d = md.Dim("batch", 4), md.Dim("seq", 4), md.Dim("d_model", 3)
    d_in, d_h = md.Dim("d_in", 3), md.Dim("d_h", 3)
    gate, hc = md.Dim("gate", 4), md.Dim("hc", 2)
    with md.Graph():
        x = md.input("x", [b, s, d_in])
        wx = md.param("wx", [d_in, gate, d], fan_out=["gate", "d_model"])
        wh = md.param("wh", [d_h, gate, d], fan_out=["gate", "d_model"])
        xp = md.einsum("batch seq d_in, d_in gate d_model -> batch seq gate d_model", x, wx)

        def step(hc_t, p):
            h, c = (md.squeeze(md.slice_(hc_t, "hc", k, k + 1), "hc") for k in (0, 1))
            pre = p["xp"] + md.einsum("batch d_h, d_h gate d_model -> batch gate d_model",
                                      md.rename(h, d_model="d_h"), wh)
            g = lambda k: md.squeeze(md.slice_(pre, "gate", k, k + 1), "gate")
            c = md.sigmoid(g(1)) * c + md.sigmoid(g(0)) * md.tanh(g(2))
            h = md.sigmoid(g(3)) * md.tanh(c)
            one = md.Dim("hc", 1)
            return md.concat([md.unsqueeze(h, one, 1), md.unsqueeze(c, one, 1)], "hc"), {"h": h}

        last, per_step = md.repeat(step, md.constant(torch.zeros(4, 2, 3), [b, hc, d]), {"xp": xp}, "seq")
        loss = md.reduce_mean(per_step["h"] ** 2) + md.reduce_mean(last)
        outs = {"loss": loss, **md.grad(loss, {"wx": wx, "wh": wh})}
    feeds = {"x": torch.randn(4, 4, 3, generator=torch.Generator().manual_seed(0))}
    for mesh, layout, kw in [("stage:2", "seq:stage", PIPE), ("data:1", "", {"microbatches": 2})]:
        assert md.check(outs, mesh, layout, feeds, **kw).ok, (mesh, layout)


def test_a_nested_repeat_over_a_split_dim_gathers_it_and_says_so():
    """An LSTM's steps over ``seq`` (a repeat inside the layer's block) under ``seq:data``: once
    refused, now its per-step inputs are gathered at the repeat, noted in the plan (its numbers:
    ``tests/test_inner_repeat_split.py``)."""
    model = md.load_model(LSTM, tiny=True, seq=4, **SCAN)
    plan = md.compile(heldout_outputs(model), "data:2", "seq:data")
    assert any("scans 'seq', split over data:2" in n and "gathered whole" in n for n in plan.notes), plan.notes


def test_micro_batches_cut_the_examples_dim_or_say_to_name_it():
    """Without a dim named ``batch``, micro-batches cut the examples' dim read off the graph (the
    input dim no param holds: ``rays``); a graph with none is refused, saying to name it."""
    rays, d = md.Dim("rays", 4), md.Dim("d", 3)
    with md.Graph():
        w = md.param("w", [d])
        loss = md.reduce_mean(md.input("x", [rays, d]) * w)
    feeds = {"x": torch.randn(4, 3)}
    got = md.run_simulated(md.compile({"loss": loss}, "data:1", "", microbatches=2), feeds)
    # the mean of two micro-batches' means: fp32 sums in another order, ~1e-7 of the magnitudes
    torch.testing.assert_close(got["loss"], md.run_dense({"loss": loss}, feeds)["loss"], rtol=1e-6, atol=1e-6)
    with md.Graph():
        w = md.param("w", [rays, d])
        loss = md.reduce_mean(md.input("x", [rays, d]) * w)
    with pytest.raises(md.LayoutError, match="the graph has no examples' dim to cut") as e:
        md.compile({"loss": loss}, "data:1", "", microbatches=2)
    assert "Fix: name the dim that indexes the examples 'batch'" in str(e.value)


def test_simclr_under_micro_batches_is_refused_naming_the_contrastive_loss():
    """NT-Xent reads every row of the batch at once: micro-batches would give other numbers."""
    model = md.load_model(SIMCLR, tiny=True)
    with pytest.raises(md.LayoutError, match="cannot be micro-batched") as e:
        md.compile(heldout_outputs(model), "stage:2", "layer:stage", **PIPE)
    assert "contrastive loss" in str(e.value) and "Fix:" in str(e.value)


@pytest.mark.parametrize("path", [PIXEL, SIMCLR], ids=["pixelcnn", "simclr"])
def test_the_searchs_top_layouts_match_dense(path, monkeypatch, tmp_path):
    """``md.search_layouts`` on 4 processes (the default calibration): its three best candidates
    compile and give the dense program's loss and gradients."""
    assert_search_top_layouts_match_dense(path, monkeypatch, tmp_path)


def _set_transformer_on_two_processes(comm):
    torch.set_num_threads(1)
    m = md.load_model(SETT, tiny=True)
    plan = md.compile(heldout_outputs(m), "stage:2", "layer:stage", **PIPE)
    return held_outputs_on_this_rank(comm, plan, m.feeds(0))


@pytest.mark.slow   # by default: this plan simulated (CASES' SETT stage:2 layer:stage PIPE row), pipelines on gloo in
# tests/test_pipeline_dist.py
@pytest.mark.timeout(200)
def test_set_transformer_pipeline_on_two_gloo_processes():
    """The micro-batched pipeline whose block passes a micro-batch partial sum on, on 2 real
    processes: every output is the dense program's."""
    from meshdsl.processes import launcher
    m = md.load_model(SETT, tiny=True)
    want = md.run_dense(heldout_outputs(m), m.feeds(0))
    results = launcher.spawn(_set_transformer_on_two_processes, 2, mesh="stage:2", timeout=180)
    # fp32, O(1) values: the stages and micro-batches add the same terms in another order (~1e-7)
    assert_ranks_match_dense(results, want, 1e-5)
