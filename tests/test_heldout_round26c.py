"""Held-out models of round 26c (written from the README and docs alone, on the newest ops).

``tests/heldout_resnetpool.py`` (ResNet-18-lite: a 7x7/2 stem, batch norm with running statistics,
a 3x3/2 max pool, basic blocks with a strided 1x1 projection shortcut, a global average pool and a
label-smoothed cross-entropy); ``tests/heldout_dcgan.py`` (DCGAN-lite: a conv_transpose generator
and a strided-conv discriminator, both losses in one objective with stop_gradient);
``tests/heldout_sagesum.py`` (GIN then GraphSAGE-mean over fed edge lists: md.gather messages,
md.scatter_add sums, in-degree means, a scatter_add readout per graph); ``tests/heldout_bertmask.py``
(a BERT-style MLM: md.attention(mask=) from padded lengths, gelu(tanh), ignore_index=-100);
``tests/heldout_unetup.py`` (a two-level U-Net: max pools down, nearest and bilinear md.upsample or
conv_transpose up, skip concats, a per-pixel cross-entropy ignoring void pixels). Each runs under
data, Megatron-ish, spatial/edge/node/sequence splits (2-way and uneven 3-way), FSDP, a pipeline
(BERT's stack), remat and the search's layouts against the dense program, and is its own plain-torch
float64 reference. Findings: /work/notes/heldout-26c.md.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from meshdsl.train.model import load_module
from conftest import (assert_adamw_steps_track_dense, random_params, assert_heldout_case_matches_dense,
                      assert_search_top_layouts_match_dense, heldout_case_id, run_cli)

HERE = Path(__file__).parent
IDS = ["resnetpool", "dcgan", "sagesum", "bertmask", "unetup"]
RESNET, DCGAN, SAGE, BERT, UNET = ALL = [str(HERE / f"heldout_{n}.py") for n in IDS]
PIPE = {"microbatches": 2, "schedule": "1f1b"}
ZBH1 = {"microbatches": 2, "schedule": "zbh1"}
INTERLEAVED = {"microbatches": 2, "schedule": "interleaved:2"}

# (model, config overrides, mesh, layout[, compile keywords])
CASES = [
    (SAGE, {}, "model:3", "edges:model"),                           # partial tables reduced once
    (BERT, {}, "model:3", "seq:model"),                             # the padding mask's keys cut unevenly
    (UNET, {}, "model:3", "height:model"),                          # pools and upsamples over uneven rows
]

SLOW_CASES = [
    (RESNET, {}, "data:2", "batch:data"),
    (RESNET, {"batch": 6}, "data:3", "batch:data"),
    (RESNET, {}, "model:2", "height:model"),
    (RESNET, {}, "model:3", "width:model"),
    (RESNET, {}, "model:2", "co:model"),
    (RESNET, {}, "model:2", "ch:model"),
    (RESNET, {}, "data:2; model:2", "batch:data; height:model"),
    (RESNET, {}, "data:2; model:2", "batch:data; co:model; height:model"),
    (RESNET, {}, "data:2", "batch:data; params.co:data"),
    (DCGAN, {}, "data:2", "batch:data"),
    (DCGAN, {"batch": 6}, "data:3", "batch:data"),
    (DCGAN, {}, "model:2", "height:model"),
    (DCGAN, {}, "model:3", "height:model"),
    (DCGAN, {}, "model:2", "co:model"),
    (DCGAN, {}, "model:2", "ch:model"),
    (DCGAN, {}, "data:2; model:2", "batch:data; co:model"),
    (DCGAN, {}, "data:2; model:2", "height:data; width:model"),
    (DCGAN, {}, "data:2", "batch:data; params.co:data"),
    (SAGE, {}, "model:2", "edges:model"),
    (SAGE, {}, "model:2", "nodes:model"),
    (SAGE, {}, "model:3", "nodes:model"),
    (SAGE, {}, "model:2", "hidden:model"),
    (SAGE, {}, "model:3", "h_out:model"),
    (SAGE, {}, "data:2; model:2", "edges:data; hidden:model"),
    (SAGE, {}, "data:2; model:2", "nodes:data; edges:model"),
    (SAGE, {}, "model:2", "graphs:model"),
    (SAGE, {}, "data:2", "edges:data; params.hidden:data"),
    (BERT, {}, "data:2", "batch:data"),
    (BERT, {"batch": 6}, "data:3", "batch:data"),
    (BERT, {}, "model:2", "heads:model; d_ff:model"),
    (BERT, {"heads": 3}, "model:3", "heads:model"),
    (BERT, {}, "model:2", "seq:model"),
    (BERT, {}, "data:2; model:2", "batch:data; heads:model; d_ff:model"),
    (BERT, {}, "data:2", "batch:data; params.d_model:data"),
    (BERT, {}, "stage:2", "layer:stage", PIPE),
    (BERT, {}, "stage:2", "layer:stage", ZBH1),
    (BERT, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (BERT, {}, "stage:2; data:2", "layer:stage; batch:data", PIPE),
    (BERT, {"remat": "full"}, "model:2", "seq:model"),
    (BERT, {"remat": "selective"}, "model:2", "heads:model; d_ff:model"),
    (UNET, {}, "data:2", "batch:data"),
    (UNET, {"batch": 3}, "data:3", "batch:data"),
    (UNET, {}, "model:2", "height:model"),
    (UNET, {}, "model:2", "width:model"),
    (UNET, {}, "model:2", "co:model"),
    (UNET, {}, "model:3", "ch:model"),
    (UNET, {}, "data:2; model:2", "height:data; width:model"),
    (UNET, {}, "data:2", "batch:data; params.co:data"),
    (UNET, {"up": "transpose"}, "model:2", "height:model"),
    (UNET, {"up": "transpose"}, "model:3", "width:model"),
    (UNET, {"up": "transpose"}, "model:2", "ch:model"),
]


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[heldout_case_id(c) for c in CASES + SLOW_CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


REFERENCES = [(RESNET, {}), (DCGAN, {}), (SAGE, {}), (BERT, {}), (UNET, {}), (UNET, {"up": "transpose"})]


@pytest.mark.parametrize("path,over", [pytest.param(p, o, marks=[] if p == SAGE else pytest.mark.slow)
                                       for p, o in REFERENCES],
                         ids=[Path(p).stem.removeprefix("heldout_") + "".join(f"-{v}" for v in o.values())
                              for p, o in REFERENCES])
def test_the_model_is_its_torch_reference(path, over):
    """Each model written in plain torch (F.conv2d, F.max_pool2d, F.batch_norm, F.conv_transpose2d,
    F.interpolate, index_add, SDPA with a boolean attn_mask, F.cross_entropy with label_smoothing=
    and ignore_index=) gives the DSL model's loss, and torch autograd (float64) its gradients."""
    mod = load_module(path)
    model = md.load_model(path, tiny=True, **over)
    params, feeds = random_params(model), model.feeds(0)
    got = md.run_dense({"loss": model.loss, **md.grad(model.loss, model.params)}, feeds, params=params)
    ref = {k: v.double().requires_grad_() for k, v in params.items()}
    want = mod.torch_reference(model.config, ref, feeds)
    want.backward()
    # fp32 against fp64 on a loss of ~1-3: ~1e-7 relative; a wrong pad, mask or smoothing is O(1e-2)
    assert float(got["loss"]) == pytest.approx(float(want.detach()), rel=1e-5)
    top = max(float(p.grad.abs().max()) for p in ref.values())
    for k, p in ref.items():
        # fp32 rounding at the largest gradient's scale, as the layout checks allow
        torch.testing.assert_close(got[k].double(), p.grad, rtol=0, atol=1e-5 * top, msg=lambda m, k=k: f"{k}: {m}")


def test_the_sage_feeds_hold_nodes_without_in_edges():
    """The mean's md.where branch is exercised: some nodes receive no edge (their mean is 0)."""
    model = md.load_model(SAGE, tiny=True)
    feeds = model.feeds(0)
    degree = torch.bincount(feeds["dst"], minlength=model.config.nodes)
    assert (degree == 0).any() and (degree > 1).any()


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["batch:data", "height:data"])
def test_resnet_running_statistics_are_torchs_after_a_step(layout):
    """One training step on ``data:2`` sets every batch norm's running mean and (unbiased) variance
    as torch.nn.BatchNorm2d's forward in training mode does from the same params and images."""
    model = md.load_model(RESNET, tiny=True)
    step = md.TrainStep(model.loss, model.params, "data:2", layout, md.SimulatedComm(md.Mesh.parse("data:2")),
                        optimizer=md.SGD(lr=0.0))
    before, feeds = step.full_params(frozen=True), model.feeds(0)
    step(feeds)
    after = step.full_params(frozen=True)
    names = [k[:-3] for k in before if k.endswith("_rm")]
    running = {n: [before[f"{n}_rm"].double().clone(), before[f"{n}_rv"].double().clone()] for n in names}
    load_module(RESNET).torch_reference(model.config, before, feeds, running=running)
    assert len(names) == 6
    for n, (mean, var) in running.items():
        assert not torch.equal(mean, before[f"{n}_rm"].double())          # the step moved them
        # fp32 batch sums against fp64: ~1e-7 relative; a biased variance or a wrong momentum is O(1e-2)
        torch.testing.assert_close(after[f"{n}_rm"].double(), mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(after[f"{n}_rv"].double(), var, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("path,mesh,layout", [
    (RESNET, "model:2", "height:model"),
    (DCGAN, "data:2", "batch:data"),
    (SAGE, "model:2", "edges:model"),
    (BERT, "model:2", "seq:model"),
    (UNET, "model:2", "width:model"),
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
    pytest.param(RESNET, "data:2; model:2", "batch:data; height:model", marks=pytest.mark.slow),
    pytest.param(DCGAN, "data:2; model:2", "batch:data; co:model", marks=pytest.mark.slow),
    (SAGE, "data:2; model:2", "edges:data; hidden:model"),
    pytest.param(BERT, "data:2; model:2", "batch:data; heads:model", marks=pytest.mark.slow),
    pytest.param(UNET, "data:2; model:2", "batch:data; height:model", marks=pytest.mark.slow),
], ids=IDS)
def test_adamw_steps_track_dense(path, mesh, layout):
    """Three AdamW steps (clipped at 1) on the layout give the dense program's losses."""
    assert_adamw_steps_track_dense(path, mesh, layout)
