"""Held-out models of round 16b (written from the README and docs alone): deformable attention,
MEGA, ConvMixer, SASRec/BERT4Rec and StreamingLLM-style attention sinks.

``tests/heldout_deform.py`` (Deformable-DETR-lite encoder: per-query offsets and weights, values read
at fractional positions by linear (1d) or bilinear (2d) interpolation written as one-hot einsums);
``tests/heldout_mega.py`` (MEGA: a damped multi-dimensional EMA over seq as a causal depthwise conv
with a kernel built from params, or the cumsum form, then single-head gated attention with reset
and update gates); ``tests/heldout_convmixer.py`` (ConvMixer: a strided patch conv, 5x5 depthwise
'same' convs and pointwise convs with batch-statistics or layer norms); ``tests/heldout_sasrec.py``
(SASRec causal + BCE against fed negatives, or BERT4Rec bidirectional + a sampled softmax at masked
positions, the item table tied to the output); ``tests/heldout_sinks.py`` (a GQA RoPE decoder whose
mask is a sliding window plus always-visible sink tokens, from iota comparisons, or md.attention's
fused window without sinks). Each runs under data, Megatron, sequence/spatial/feature (2-way, uneven
3-way), FSDP, pipeline (1f1b, zbh1, interleaved:2) and remat layouts against the dense program.
Findings: /work/notes/heldout-16b.md.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import meshdsl as md
from conftest import (assert_adamw_steps_track_dense, assert_heldout_case_matches_dense,
                      assert_search_top_layouts_match_dense, heldout_case_id,
                      run_cli)

HERE = Path(__file__).parent
DEFORM, MEGA, CONVMIXER, SASREC, SINKS = (
    str(HERE / f"heldout_{n}.py") for n in ("deform", "mega", "convmixer", "sasrec", "sinks"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}
ZBH1 = {"microbatches": 2, "schedule": "zbh1"}
INTERLEAVED = {"microbatches": 2, "schedule": "interleaved:2"}
D2, CUMSUM, BN, BERT, WINDOW = ({"form": "2d"}, {"form": "cumsum"}, {"form": "batch"}, {"form": "bert4rec"},
                                {"form": "window", "sinks": 0})

# (model, config overrides, mesh, layout[, compile keywords])
CASES = [
    (DEFORM, {}, "model:3", "seq:model"),                     # fractional reads across an uneven split
    (MEGA, {}, "model:2", "seq:model"),                       # the EMA kernel's causal conv over a split seq
    (SINKS, {}, "model:3", "seq:model"),                      # the sink/window mask over an uneven split
]

SLOW_CASES = [
    (DEFORM, {}, "data:2", "batch:data"),
    (DEFORM, {}, "model:2", "heads:model"),
    (DEFORM, {}, "model:2", "points:model"),
    (DEFORM, {}, "model:2", "seq:model"),
    (DEFORM, {}, "model:3", "d_model:model"),
    (DEFORM, {}, "data:2; model:2", "batch:data; heads:model"),
    (DEFORM, {}, "data:2", "batch:data; params.d_model:data"),
    (DEFORM, {}, "stage:2", "layer:stage", PIPE),
    (DEFORM, D2, "stage:2", "layer:stage", ZBH1),
    (DEFORM, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (DEFORM, {"remat": "full"}, "stage:2; model:2", "layer:stage; heads:model", PIPE),
    (DEFORM, D2, "model:2", "height:model"),
    (DEFORM, D2, "model:3", "width:model"),
    (DEFORM, D2, "data:2; model:2", "height:data; width:model"),
    (MEGA, {}, "data:2", "batch:data"),
    (MEGA, {}, "model:2", "d_v:model; ema:model"),
    (MEGA, {}, "model:3", "d_model:model"),
    (MEGA, {}, "model:2", "d_qk:model; vocab:model"),
    (MEGA, CUMSUM, "model:2", "seq:model"),
    (MEGA, {}, "model:3", "seq:model"),
    (MEGA, CUMSUM, "model:3", "seq:model"),
    (MEGA, {}, "data:2; model:2", "batch:data; seq:model"),
    (MEGA, {}, "data:2", "batch:data; params.d_model:data"),
    (MEGA, {}, "stage:2", "layer:stage", PIPE),
    (MEGA, CUMSUM, "stage:2", "layer:stage", ZBH1),
    (MEGA, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (MEGA, {"remat": "selective"}, "model:2", "d_v:model"),
    (MEGA, {"remat": "full"}, "stage:2; model:2", "layer:stage; seq:model", PIPE),
    (CONVMIXER, {}, "data:2", "batch:data"),
    (CONVMIXER, BN, "data:2", "batch:data"),
    (CONVMIXER, {}, "model:2", "hidden:model"),
    (CONVMIXER, BN, "model:3", "hidden:model"),
    (CONVMIXER, {}, "model:2", "height:model"),
    (CONVMIXER, BN, "model:2", "height:model"),
    (CONVMIXER, {}, "model:3", "width:model"),
    (CONVMIXER, BN, "data:2; model:2", "height:data; width:model"),
    (CONVMIXER, {}, "data:2", "batch:data; params.hidden:data"),
    (CONVMIXER, {}, "stage:2", "layer:stage", PIPE),
    (CONVMIXER, {}, "stage:2", "layer:stage", ZBH1),
    (CONVMIXER, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (CONVMIXER, {"remat": "full"}, "stage:2; model:2", "layer:stage; height:model", PIPE),
    (SASREC, {}, "data:2", "batch:data"),
    (SASREC, {}, "model:2", "heads:model; d_ff:model"),
    (SASREC, {}, "model:2", "items:model"),
    (SASREC, BERT, "model:3", "items:model"),
    (SASREC, {}, "model:2", "seq:model"),
    (SASREC, BERT, "model:3", "seq:model"),
    (SASREC, BERT, "model:3", "cand:model"),
    (SASREC, {}, "data:2; model:2", "batch:data; items:model"),
    (SASREC, {}, "data:2", "batch:data; params.d_model:data"),
    (SASREC, {}, "stage:2", "layer:stage", PIPE),
    (SASREC, BERT, "stage:2", "layer:stage", ZBH1),
    (SASREC, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (SASREC, {"remat": "selective"}, "model:2", "heads:model; d_ff:model"),
    (SINKS, {}, "data:2", "batch:data"),
    (SINKS, {}, "model:2", "kv_heads:model; d_ff:model"),
    (SINKS, {}, "model:2", "group:model; vocab:model"),
    (SINKS, {}, "model:2", "seq:model"),
    (SINKS, {}, "model:4", "seq:model"),
    (SINKS, WINDOW, "model:3", "seq:model"),
    (SINKS, {}, "data:2; model:2", "batch:data; seq:model"),
    (SINKS, {}, "data:2", "batch:data; params.d_model:data"),
    (SINKS, {}, "stage:2", "layer:stage", PIPE),
    (SINKS, WINDOW, "stage:2", "layer:stage", ZBH1),
    (SINKS, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (SINKS, {"remat": "full"}, "stage:2; model:2", "layer:stage; seq:model", PIPE),
    (SINKS, {"remat": "selective"}, "model:2", "kv_heads:model; d_ff:model"),
]


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[heldout_case_id(c) for c in CASES + SLOW_CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


@pytest.mark.slow
@pytest.mark.parametrize("path,over", [(MEGA, {}), (SINKS, {"sinks": 0})], ids=["mega", "sinks"])
def test_the_two_forms_give_the_same_model(path, over):
    """MEGA's conv and cumsum EMAs, and the sink mask with no sinks against md.attention's fused
    window, are the same math: the dense losses agree (fp32 rounding of ~1e-6)."""
    other = {"form": "cumsum"} if path == MEGA else {"form": "window", "sinks": 0}
    a, b = (md.load_model(path, tiny=True, **o) for o in (over, other))
    la, lb = (float(md.run_dense({"loss": m.loss}, m.feeds(0))["loss"]) for m in (a, b))
    assert la == pytest.approx(lb, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("path,mesh,layout", [
    (DEFORM, "model:2", "seq:model"),
    (MEGA, "model:2", "seq:model"),
    (CONVMIXER, "model:2", "height:model"),
    (SASREC, "model:2", "items:model"),
    (SINKS, "model:2", "seq:model"),
], ids=["deform", "mega", "convmixer", "sasrec", "sinks"])
def test_the_cli_checks_each_model_on_two_real_processes(path, mesh, layout, capsys):
    """``meshdsl check ... --tiny --nproc 2``: the plan run on two gloo processes."""
    code, out, err = run_cli(capsys, ["check", path, "--tiny", "--mesh", mesh, "--layout", layout, "--nproc", "2"])
    assert code == 0 and "OK:" in out, out + err


@pytest.mark.slow
@pytest.mark.parametrize("path", [DEFORM, MEGA, CONVMIXER, SASREC, SINKS],
                         ids=["deform", "mega", "convmixer", "sasrec", "sinks"])
def test_the_searchs_top_layouts_match_dense(path, monkeypatch, tmp_path):
    """``md.search_layouts`` on 4 processes (the default calibration): its three best candidates
    compile and give the dense program's loss and gradients."""
    assert_search_top_layouts_match_dense(path, monkeypatch, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("path,mesh,layout", [
    (DEFORM, "data:2; model:2", "batch:data; seq:model"),
    (MEGA, "data:2; model:2", "batch:data; seq:model"),
    (CONVMIXER, "data:2; model:2", "batch:data; height:model"),
    (SASREC, "data:2; model:2", "batch:data; items:model"),
    (SINKS, "data:2; model:2", "params.d_model:data; seq:model"),
], ids=["deform", "mega", "convmixer", "sasrec", "sinks"])
def test_adamw_steps_track_dense(path, mesh, layout):
    """Three AdamW steps (clipped at 1) on the layout give the dense program's losses."""
    assert_adamw_steps_track_dense(path, mesh, layout)
