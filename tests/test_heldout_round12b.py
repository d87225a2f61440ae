"""Held-out models of round 12b (written from the README and docs alone): diffusion, vision,
point clouds, segmentation and audio.

``tests/heldout_sdunet.py`` (a Stable-Diffusion-style U-Net in NHWC letters: a sinusoidal timestep
embedding, ResNet blocks with GroupNorm written from reductions over ``(H, W, Cg)`` and FiLM from
the timestep, a strided-conv downsample, a mid stack of ResNet blocks with spatial self-attention
over the merged pixels and cross-attention to text tokens, an upsample by rearrange, a
flow-matching MSE loss); ``tests/heldout_convnextv2.py`` (ConvNeXt-V2: 7x7 depthwise convs, dilated
in the first stage, Global Response Normalization, a strided-conv stem and downsample);
``tests/heldout_pointtf.py`` (a Point Transformer: kNN by ``md.top_k`` over negative distances,
neighbours fetched by a one-hot einsum or by ``md.gather`` from a flattened table, vector attention
with relative position encodings, per-point cross entropy); ``tests/heldout_deeplab.py`` (an
atrous spatial pyramid in NHWC letters: parallel convs dilated 1, 2, 4 and a global pooling
branch, concatenated, per-pixel cross entropy with ignored labels masked);
``tests/heldout_wavenet.py`` (a WaveNet: gated dilated causal convs, dilations 1..8 unrolled in
each stack of a repeat, the skips' running sum carried beside the residual stream, a 256-way
mu-law softmax). Each runs under data, tensor, spatial (height, width, time, points, 2-way,
uneven 3-way, 2x2), FSDP, pipeline (1f1b, zbh1, interleaved:2) and remat layouts against the
dense program. Findings: /work/notes/heldout-12b.md.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import meshdsl as md
from conftest import assert_heldout_case_matches_dense, assert_search_top_layouts_match_dense, heldout_case_id, run_cli

HERE = Path(__file__).parent
SDUNET, CONVNEXTV2, POINTTF, DEEPLAB, WAVENET = (
    str(HERE / f"heldout_{n}.py") for n in ("sdunet", "convnextv2", "pointtf", "deeplab", "wavenet"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}
INTERLEAVED = {"microbatches": 2, "schedule": "interleaved:2"}
GATHER = {"form": "gather"}

# (model, config overrides, mesh, layout, compile keywords)
CASES = [
    (POINTTF, {}, "model:3", "point:model"),                                 # top_k rows and the one-hot split
    (POINTTF, GATHER, "model:2", "point:model"),                             # md.gather from a flat table
    (DEEPLAB, {}, "model:3", "H:model; Y:model"),                            # dilated halos over uneven rows
    (DEEPLAB, {}, "stage:2", "R:stage", PIPE),
    (WAVENET, {}, "model:3", "time:model"),                                  # causal halos of 1..8 rows
    (WAVENET, {}, "stage:2", "stack:stage", {**PIPE, "schedule": "zbh1"}),
    (SDUNET, {}, "model:2", "H:model; h:model"),                             # group norm and attention over split pixels
]

# more of the same kinds, with -m slow (the file keeps under 3 s on a quiet machine)
SLOW_CASES = [
    (SDUNET, {}, "data:2", "N:data"),
    (SDUNET, {}, "model:2", "A:model"),
    (SDUNET, {}, "model:2", "C:model"),
    (SDUNET, {}, "model:3", "H:model; h:model"),
    (SDUNET, {}, "data:2; model:2", "H:data; W:model"),
    (SDUNET, {}, "model:2", "h_w:model"),
    (SDUNET, {}, "model:2", "T:model"),
    (SDUNET, {}, "data:2", "N:data; params.D:data"),
    (SDUNET, {}, "stage:2", "B:stage", PIPE),
    (SDUNET, {"blocks": 4}, "stage:2", "B:stage", INTERLEAVED),
    (SDUNET, {"remat": "full"}, "stage:2; model:2", "B:stage; A:model", PIPE),
    (SDUNET, {"remat": "selective"}, "model:2", "h:model"),
    (CONVNEXTV2, {}, "data:2", "batch:data"),
    (CONVNEXTV2, {}, "model:2", "ff:model; ff2:model"),
    (CONVNEXTV2, {}, "model:2", "chan:model"),
    (CONVNEXTV2, {}, "model:2", "height:model; row:model"),                 # a 13-row dilated span over 6-row blocks
    (CONVNEXTV2, {}, "model:3", "height:model"),
    (CONVNEXTV2, {}, "model:4", "height:model"),
    (CONVNEXTV2, {}, "data:2; model:2", "height:data; width:model"),
    (CONVNEXTV2, {}, "model:3", "row:model"),
    (CONVNEXTV2, {}, "data:2", "batch:data; params.ff:data"),
    (CONVNEXTV2, {}, "stage:2", "blk:stage", PIPE),
    (CONVNEXTV2, {}, "stage:2", "blk2:stage", {**PIPE, "schedule": "zbh1"}),
    (CONVNEXTV2, {"depth1": 4}, "stage:2", "blk:stage", INTERLEAVED),
    (CONVNEXTV2, {"remat": "full"}, "stage:2; model:2", "blk:stage; height:model", PIPE),
    (CONVNEXTV2, {"remat": "selective"}, "model:2", "ff:model"),
    (POINTTF, {}, "data:2", "cloud:data"),
    (POINTTF, GATHER, "data:2", "cloud:data"),
    (POINTTF, {}, "model:2", "feat:model"),
    (POINTTF, GATHER, "model:3", "point:model"),
    (POINTTF, {}, "model:3", "pt2:model"),
    (POINTTF, {}, "model:2", "nbr:model"),
    (POINTTF, GATHER, "model:2", "nbr:model"),
    (POINTTF, {}, "data:2; model:2", "cloud:data; point:model"),
    (POINTTF, GATHER, "data:2; model:2", "point:data; f2:model"),
    (POINTTF, {}, "data:2", "cloud:data; params.feat:data"),
    (POINTTF, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (POINTTF, {"remat": "full"}, "stage:2; model:2", "layer:stage; point:model", PIPE),
    (POINTTF, {**GATHER, "remat": "selective"}, "model:2", "point:model"),
    (DEEPLAB, {}, "data:2", "N:data"),
    (DEEPLAB, {}, "model:2", "C2:model"),
    (DEEPLAB, {}, "model:2", "K:model"),
    (DEEPLAB, {}, "model:4", "Y:model"),
    (DEEPLAB, {}, "data:2; model:2", "H:data; W:model; Y:data; X:model"),
    (DEEPLAB, {}, "data:2", "N:data; params.C:data"),
    (DEEPLAB, {"blocks": 4}, "stage:2", "R:stage", INTERLEAVED),
    (DEEPLAB, {"remat": "full"}, "stage:2; model:2", "R:stage; Y:model", PIPE),
    (WAVENET, {}, "data:2", "batch:data"),
    (WAVENET, {}, "model:2", "r2:model"),
    (WAVENET, {}, "model:2", "mu2:model"),
    (WAVENET, {}, "model:2", "ch:model"),
    (WAVENET, {}, "model:4", "time:model"),
    (WAVENET, {}, "data:2; model:2", "batch:data; time:model"),
    (WAVENET, {}, "data:2", "batch:data; params.r2:data"),
    (WAVENET, {"stacks": 4}, "stage:2", "stack:stage", INTERLEAVED),
    (WAVENET, {"remat": "full"}, "stage:2; model:2", "stack:stage; time:model", PIPE),
    (WAVENET, {"remat": "selective"}, "model:3", "time:model"),
]


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[heldout_case_id(c) for c in CASES + SLOW_CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


def test_the_point_transformers_two_neighbour_fetches_compute_the_same_thing():
    """Neighbours fetched by a one-hot einsum or by ``md.gather`` from a flattened table give the
    same loss."""
    def loss(**over):
        m = md.load_model(POINTTF, tiny=True, **over)
        return float(md.run_dense({"l": m.loss}, m.feeds(0))["l"])

    # the same picks, summed as one-hot products or copied: fp32 rounding, ~1e-7 relative
    assert loss(form="gather") == pytest.approx(loss(), rel=1e-5)


def test_a_gather_from_a_table_of_every_cloud_micro_batched_is_refused_with_the_fix(capsys):
    """The gather form's table ``(cloud pt2)`` holds every cloud, its ids global: one micro-batch
    cannot read another's rows, so ``meshdsl check`` refuses to pipeline it (exit 2), saying why."""
    code, out, err = run_cli(capsys, ["check", POINTTF, "--tiny", "--config", "form=gather", "--mesh", "stage:2",
                                      "--layout", "layer:stage", "--microbatches", "2", "--schedule", "1f1b"])
    assert code == 2 and "cannot be micro-batched" in err and "Fix:" in err, out + err


@pytest.mark.slow
def test_the_cli_checks_the_wavenet_pipelined_with_split_time(capsys):
    """``meshdsl check`` on the WaveNet, its stacks pipelined and time split (halos inside stages)."""
    code, out, err = run_cli(capsys, ["check", WAVENET, "--tiny", "--mesh", "stage:2; model:2", "--layout",
                                      "stack:stage; time:model", "--microbatches", "2", "--schedule", "1f1b"])
    assert code == 0 and "OK:" in out, out + err


# each search takes 3-10 s on a quiet machine: with -m slow. ConvNeXt-V2 is left out: its 7x7
# depthwise convs are 49 shifted products each, a compile takes seconds, and its search takes over a
# minute (it passes; /work/notes/heldout-12b.md, finding 5)
@pytest.mark.slow
@pytest.mark.parametrize("path", [SDUNET, POINTTF, DEEPLAB, WAVENET], ids=["sdunet", "pointtf", "deeplab", "wavenet"])
def test_the_searchs_top_layouts_match_dense(path, monkeypatch, tmp_path):
    """``md.search_layouts`` on 4 processes (the default calibration): its three best candidates
    compile and give the dense program's loss and gradients."""
    assert_search_top_layouts_match_dense(path, monkeypatch, tmp_path)
