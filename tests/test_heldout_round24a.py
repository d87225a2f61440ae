"""Held-out models of round 24a (written from the README and docs alone).

``tests/heldout_rtdetr.py`` (a DETR-style detector: a two-scale conv backbone whose flattened tokens are
concatenated, an encoder stack, object queries cross-attending in a decoder, class cross-entropy over
every query and an L1 box loss on the fed matching); ``tests/heldout_hgnn.py`` (a hypergraph net:
node -> hyperedge -> node means over a fed incidence matrix, zero degrees by md.where, a masked node
cross-entropy); ``tests/heldout_retvit.py`` (a retention ViT: a 2-D Manhattan decay mask from
md.arange's integer math in the parallel retention form); ``tests/heldout_simcse.py`` (unsupervised
SimCSE: one encoder run twice with different dropout masks, in-batch InfoNCE over cosine
similarities); ``tests/heldout_mimo.py`` (MIMO-UNet-lite: three scales in and out, L1 at each and a
DFT loss from md.constant tables). Each runs under data, Megatron, token/node/edge/patch/spatial/
channel splits (2-way, uneven 3-way), FSDP, pipelines (where a layer stack allows one), remat and the
search's layouts against the dense program. Findings: /work/notes/heldout-24a.md.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import (assert_dense_is_its_torch_reference, assert_adamw_steps_track_dense, random_params, assert_heldout_case_matches_dense,
                      assert_search_top_layouts_match_dense, heldout_case_id, heldout_outputs, run_cli)

HERE = Path(__file__).parent
IDS = ["rtdetr", "hgnn", "retvit", "simcse", "mimo"]
RTDETR, HGNN, RETVIT, SIMCSE, MIMO = ALL = [str(HERE / f"heldout_{n}.py") for n in IDS]
PIPE = {"microbatches": 2, "schedule": "1f1b"}
ZBH1 = {"microbatches": 2, "schedule": "zbh1"}
INTERLEAVED = {"microbatches": 2, "schedule": "interleaved:2"}

# (model, config overrides, mesh, layout[, compile keywords])
CASES = [
    (HGNN, {}, "model:3", "nodes:model"),                          # incidence rows split unevenly
    (RETVIT, {}, "model:3", "patches:model"),                      # the decay mask's query rows split
    (MIMO, {}, "model:3", "height:model"),                         # the full scale's rows split unevenly
]

SLOW_CASES = [
    (RTDETR, {}, "data:2", "batch:data"),
    (RTDETR, {"batch": 4}, "data:3", "batch:data"),
    (RTDETR, {}, "model:2", "heads:model; d_ff:model"),
    (RTDETR, {}, "model:2", "tokens:model"),
    (RTDETR, {}, "model:3", "tokens:model"),
    (RTDETR, {}, "model:2", "queries:model"),
    (RTDETR, {"queries": 7}, "model:3", "queries:model"),
    (RTDETR, {}, "model:2", "height:model"),
    (RTDETR, {}, "data:2; model:2", "batch:data; heads:model"),
    (RTDETR, {}, "data:2; model:2", "tokens:data; queries:model"),
    (RTDETR, {}, "data:2", "batch:data; params.d_model:data"),
    (RTDETR, {}, "stage:2", "layer:stage", PIPE),
    (RTDETR, {"remat": "full"}, "model:2", "tokens:model"),
    (RTDETR, {"remat": "selective"}, "model:2", "heads:model"),
    (HGNN, {}, "model:2", "nodes:model"),
    (HGNN, {}, "model:2", "edges:model"),
    (HGNN, {}, "model:3", "edges:model"),
    (HGNN, {}, "model:2", "hidden:model"),
    (HGNN, {}, "model:3", "hidden:model"),
    (HGNN, {}, "model:2", "h_out:model"),
    (HGNN, {}, "data:2; model:2", "nodes:data; edges:model"),
    (HGNN, {}, "data:2; model:2", "nodes:data; hidden:model"),
    (HGNN, {}, "data:2", "nodes:data; params.hidden:data"),
    (HGNN, {}, "stage:2", "layer:stage"),
    (HGNN, {"remat": "full"}, "model:2", "edges:model"),
    (RETVIT, {}, "data:2", "batch:data"),
    (RETVIT, {"batch": 4}, "data:3", "batch:data"),
    (RETVIT, {}, "model:2", "patches:model"),
    (RETVIT, {}, "model:2", "key_patches:model"),
    (RETVIT, {}, "model:2", "heads:model; d_ff:model"),
    (RETVIT, {"heads": 3}, "model:3", "heads:model"),
    (RETVIT, {}, "data:2; model:2", "batch:data; patches:model"),
    (RETVIT, {}, "data:2", "batch:data; params.d_model:data"),
    (RETVIT, {}, "stage:2", "layer:stage", PIPE),
    (RETVIT, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (RETVIT, {"remat": "full"}, "model:2", "patches:model"),
    (SIMCSE, {}, "data:2", "batch:data"),
    (SIMCSE, {}, "data:3", "batch:data"),
    (SIMCSE, {}, "model:2", "heads:model; d_ff:model"),
    (SIMCSE, {}, "model:3", "d_ff:model"),
    (SIMCSE, {}, "model:2", "seq:model"),
    (SIMCSE, {}, "model:2", "batch2:model"),
    (SIMCSE, {}, "data:2; model:2", "batch:data; heads:model"),
    (SIMCSE, {}, "data:2", "batch:data; params.d_model:data"),
    (SIMCSE, {"joined": True}, "stage:2", "layer:stage", {"microbatches": 1, "schedule": "1f1b"}),
    (SIMCSE, {"joined": True}, "stage:2; data:2", "layer:stage; batch:data", {"microbatches": 1, "schedule": "gpipe"}),
    (SIMCSE, {"joined": True}, "data:3", "batch:data"),
    (SIMCSE, {"remat": "full"}, "data:2", "batch:data"),
    (SIMCSE, {"remat": "selective"}, "model:2", "heads:model; d_ff:model"),
    (MIMO, {}, "data:2", "batch:data"),
    (MIMO, {"batch": 4}, "data:3", "batch:data"),
    (MIMO, {}, "model:2", "height:model"),
    (MIMO, {}, "model:2", "width:model"),
    (MIMO, {}, "model:2", "height:model; height2:model; height4:model"),
    (MIMO, {}, "model:2", "channels:model"),
    (MIMO, {}, "model:3", "channels:model"),
    (MIMO, {}, "data:2; model:2", "height:data; width:model"),
    (MIMO, {}, "data:2; model:2", "batch:data; channels:model"),
    (MIMO, {}, "data:2", "batch:data; params.channels:data"),
]


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[heldout_case_id(c) for c in CASES + SLOW_CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


@pytest.mark.parametrize("path", [pytest.param(p, marks=[] if p == HGNN else pytest.mark.slow) for p in ALL], ids=IDS)
def test_the_model_is_its_torch_reference(path):
    """Each model written in plain torch (F.conv2d + sdpa + a scatter of the matched labels; dense
    degree vectors and matmuls; a meshgrid's Manhattan decay; SimCSE without dropout, md.dropout's
    masks being its own; F.interpolate + torch.fft.fft2) gives the DSL model's loss, and torch
    autograd (float64) its gradients."""
    over = {"dropout": 0.0} if path == SIMCSE else {}
    assert_dense_is_its_torch_reference(path, **over)


def test_simcse_views_differ_by_their_dropout_masks_alike_on_every_layout():
    """The two passes of one encoder over the same ids differ only by their dropout masks (seeds 1
    and 2): the views differ with dropout and are equal without it; a layout that splits the batch
    and the heads drops the same elements as the dense program (both views match it)."""
    model = md.load_model(SIMCSE, tiny=True)
    views = {"z1": model.outputs["z1"], "z2": model.outputs["z2"]}
    got = md.run_dense(views, model.feeds(0))
    assert float((got["z1"] - got["z2"]).abs().max()) > 1e-2       # unit vectors: O(0.1-1) apart
    plain = md.load_model(SIMCSE, tiny=True, dropout=0.0)
    same = md.run_dense({"z1": plain.outputs["z1"], "z2": plain.outputs["z2"]}, plain.feeds(0))
    torch.testing.assert_close(same["z1"], same["z2"], rtol=0, atol=0)   # the same ops on the same ids
    res = md.check({**heldout_outputs(model), **views}, "data:2; model:2", "batch:data; heads:model", model.feeds(0))
    assert res.ok, str(res)


def test_simcse_eval_runs_without_dropout():
    """md.evaluate gives the loss of the model without dropout (the same params), while a training
    step's loss with dropout is another number."""
    model, plain = md.load_model(SIMCSE, tiny=True), md.load_model(SIMCSE, tiny=True, dropout=0.0)
    params = random_params(model)
    got, want = md.evaluate(model, params, batches=2), md.evaluate(plain, params, batches=2)
    # the same dense ops on the same batches: equal to fp32 rounding
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6), (got, want)
    feeds = model.feeds(0)
    train = md.run_dense({"loss": model.loss}, feeds, params=params)["loss"]
    no_drop = md.run_dense({"loss": plain.loss}, feeds, params=params)["loss"]
    assert float(train) != pytest.approx(float(no_drop), rel=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("path,mesh,layout", [
    (RTDETR, "model:2", "tokens:model"),
    (HGNN, "model:2", "edges:model"),
    (RETVIT, "model:2", "patches:model"),
    (SIMCSE, "data:2", "batch:data"),
    (MIMO, "model:2", "height:model"),
], ids=IDS)
def test_the_cli_checks_each_model_on_two_real_processes(path, mesh, layout, capsys):
    """``meshdsl check ... --tiny --nproc 2``: the plan run on two gloo processes."""
    code, out, err = run_cli(capsys, ["check", path, "--tiny", "--mesh", mesh, "--layout", layout, "--nproc", "2"])
    assert code == 0 and "OK:" in out, out + err


@pytest.mark.slow
@pytest.mark.parametrize("path", ALL, ids=IDS)
def test_the_searchs_top_layouts_match_dense(path, monkeypatch, tmp_path):
    """``md.search_layouts`` on 4 processes (the default calibration): its three best candidates
    compile and give the dense program's loss and gradients."""
    assert_search_top_layouts_match_dense(path, monkeypatch, tmp_path)


@pytest.mark.parametrize("path,mesh,layout", [
    pytest.param(RTDETR, "data:2; model:2", "batch:data; heads:model", marks=pytest.mark.slow),
    pytest.param(HGNN, "data:2; model:2", "nodes:data; hidden:model", marks=pytest.mark.slow),
    pytest.param(RETVIT, "data:2; model:2", "batch:data; patches:model", marks=pytest.mark.slow),
    (SIMCSE, "data:2; model:2", "batch:data; d_ff:model"),
    pytest.param(MIMO, "data:2; model:2", "batch:data; height:model", marks=pytest.mark.slow),
], ids=IDS)
def test_adamw_steps_track_dense(path, mesh, layout):
    """Three AdamW steps (clipped at 1) on the layout give the dense program's losses. SimCSE's
    dropout draws new masks each step: the dense oracle must too (its steps 2-3 were compared
    with step 1's masks before conftest passed each step's salt)."""
    assert_adamw_steps_track_dense(path, mesh, layout)
