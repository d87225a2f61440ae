"""Held-out models of round 26d (written from the README and docs alone): tuple carries and gate dims.

``tests/heldout_seq2seqlstm.py`` (a seq2seq LSTM with Luong attention: a layer stack whose carry is
the tuple (encoder sequence, decoder sequence), each layer an encoder LSTM and a decoder LSTM as
inner repeats with (h, c) tuple carries and per-step outputs, the decoder attending over the
encoder's outputs read from outside its block; teacher forcing, CE); ``tests/heldout_evoformer2.py``
(Evoformer-lite: (MSA, pair) as the tuple carry of a layer stack: row attention with a pair bias,
an outer product mean, a triangle multiplicative update); ``tests/heldout_tacotron2.py`` (a
Tacotron-lite decoder: (state, attention weights) carried over frames, location-sensitive
attention from a conv of the previous weights, mel MSE + stop BCE); ``tests/heldout_convlstm2.py``
(a ConvLSTM whose gates are their own dim, md.conv with w [kh, kw, c_in, gate, hid], next-frame
MSE). Each runs under data, Megatron, sequence/residue/spatial splits (2-way, uneven 3-way), FSDP,
pipelines of the tuple carry (where a layer stack allows one) and remat against the dense program,
against a float64 torch reference, and for AdamW steps. Findings: /work/notes/heldout-26d.md.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import meshdsl as md
from conftest import (assert_dense_is_its_torch_reference, assert_adamw_steps_track_dense, assert_heldout_case_matches_dense,
                      heldout_case_id, run_cli)

HERE = Path(__file__).parent
IDS = ["seq2seqlstm", "evoformer2", "tacotron2", "convlstm2"]
S2S, EVO, TACO, CLSTM = ALL = [str(HERE / f"heldout_{n}.py") for n in IDS]
GPIPE = {"microbatches": 2}
ONEF1B = {"microbatches": 3, "schedule": "1f1b"}

# (model, config overrides, mesh, layout[, compile keywords])
CASES = [
    (EVO, {}, "stage:3", "layer:stage", GPIPE),                     # (MSA, pair) sent on at each boundary
    (TACO, {"enc_seq": 7}, "model:3", "enc_seq:model"),             # the carried weights split unevenly
]

SLOW_CASES = [
    (S2S, {}, "stage:3", "layer:stage", GPIPE),                     # (enc, dec) sent on at each boundary
    (S2S, {}, "data:2", "batch:data"),
    (S2S, {}, "data:3", "batch:data"),
    (S2S, {}, "model:2", "hidden:model"),
    (S2S, {"hidden": 7}, "model:3", "hidden:model"),
    (S2S, {}, "stage:2", "layer:stage", {**ONEF1B, "stage_layers": [2, 1]}),
    (S2S, {"layers": 4}, "stage:2", "layer:stage", {"microbatches": 2, "schedule": "interleaved:2"}),
    (S2S, {}, "data:2; stage:3", "batch:data; layer:stage", {"microbatches": 3, "schedule": "zbh1"}),
    (S2S, {}, "model:2; stage:3", "hidden:model; layer:stage", {"microbatches": 2, "schedule": "1f1b"}),
    (S2S, {}, "data:2", "batch:data; params.hidden:data"),
    (S2S, {"remat": "full"}, "data:2; model:2", "batch:data; hidden:model"),
    (S2S, {"remat": "selective"}, "stage:3", "layer:stage", GPIPE),
    (EVO, {}, "data:2", "batch:data"),
    (EVO, {}, "model:2", "c_m:model"),
    (EVO, {}, "model:3", "c_z:model"),
    (EVO, {}, "model:2", "heads:model"),
    (EVO, {}, "model:2", "res:model"),
    (EVO, {"res": 7}, "model:3", "res:model"),
    (EVO, {}, "data:2; model:2", "c_m:data; c_z:model"),
    (EVO, {}, "stage:2", "layer:stage", {"microbatches": 2, "schedule": "1f1b", "stage_layers": [1, 2]}),
    (EVO, {}, "model:2; stage:3", "heads:model; layer:stage", {"microbatches": 2, "schedule": "1f1b"}),
    (EVO, {}, "model:2; stage:3", "res:model; layer:stage", GPIPE),
    (EVO, {}, "data:2", "batch:data; params.c_m:data; params.c_z:data"),
    (EVO, {"remat": "full"}, "model:2", "res:model"),
    (EVO, {"remat": "selective"}, "model:2", "heads:model"),
    (TACO, {}, "data:2", "batch:data"),
    (TACO, {}, "model:2", "enc_seq:model"),
    (TACO, {}, "model:2", "d_dec:model"),
    (TACO, {}, "model:3", "d_dec:model"),
    (TACO, {"d_dec": 7}, "model:3", "d_dec:model"),
    (TACO, {}, "data:2; model:2", "batch:data; enc_seq:model"),
    (TACO, {}, "data:2", "batch:data; params.d_dec:data"),
    (TACO, {"remat": "full"}, "model:2", "enc_seq:model"),
    (CLSTM, {}, "data:2", "batch:data"),
    (CLSTM, {}, "model:2", "hid:model"),
    (CLSTM, {}, "model:3", "hid:model"),
    (CLSTM, {}, "model:2", "height:model"),
    (CLSTM, {"height": 7}, "model:3", "height:model"),
    (CLSTM, {}, "data:2; model:2", "batch:data; height:model"),
    (CLSTM, {}, "data:2; model:3", "batch:data; hid:model"),
    (CLSTM, {}, "data:2", "batch:data; params.hid:data"),
    (CLSTM, {"remat": "full"}, "model:2", "height:model"),
    (CLSTM, {"remat": "selective"}, "model:2", "hid:model"),
]


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[heldout_case_id(c) for c in CASES + SLOW_CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


@pytest.mark.parametrize("path", [pytest.param(p, marks=[] if p == CLSTM else pytest.mark.slow) for p in ALL], ids=IDS)
def test_the_model_is_its_torch_reference(path):
    """Each model written in plain torch (time loops; F.conv2d with gate x hid flattened into torch's
    out channels; sdpa with the pair bias as its float mask; F.conv1d of the previous weights) gives
    the DSL model's loss, and torch autograd (float64) its gradients."""
    assert_dense_is_its_torch_reference(path)


def test_tacotron_keeps_the_carried_weights_split_over_enc_seq():
    """Under enc_seq:model the attention weights carried from frame to frame stay split: each frame
    trades one-row halos for the location conv (permutes) and allreduces the softmax's max and sum
    and the context's partial sums, and never gathers enc_seq (no allgather anywhere)."""
    model = md.load_model(TACO, tiny=True)
    plan = md.compile({"loss": model.loss, **md.grad(model.loss, model.params)}, "model:2", "enc_seq:model")
    kinds = plan.totals()
    assert not any("allgather" in k for k in kinds), kinds
    assert kinds["permute"]["count"] == 4 * model.config.frames, kinds     # a halo each way, forward and backward


@pytest.mark.parametrize("path,mesh,layout,kw", [
    pytest.param(S2S, "stage:2", "layer:stage", {"stage_layers": "2,1", "microbatches": 2},
                 marks=pytest.mark.slow),
    pytest.param(EVO, "model:2", "res:model", {}, marks=pytest.mark.slow),
    pytest.param(TACO, "model:2", "enc_seq:model", {}, marks=pytest.mark.slow),
    pytest.param(CLSTM, "model:2", "height:model", {}, marks=pytest.mark.slow),
], ids=IDS)
def test_the_cli_checks_each_model_on_two_real_processes(path, mesh, layout, kw, capsys):
    """``meshdsl check ... --tiny --nproc 2``: the plan run on two gloo processes."""
    extra = [a for k, v in kw.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    code, out, err = run_cli(capsys, ["check", path, "--tiny", "--mesh", mesh, "--layout", layout,
                                      "--nproc", "2", *extra])
    assert code == 0 and "OK:" in out, out + err


@pytest.mark.parametrize("path,mesh,layout", [
    pytest.param(S2S, "data:2; model:2", "batch:data; hidden:model", marks=pytest.mark.slow),
    pytest.param(EVO, "data:2; model:2", "batch:data; res:model", marks=pytest.mark.slow),
    pytest.param(TACO, "data:2; model:2", "batch:data; enc_seq:model", marks=pytest.mark.slow),
    (CLSTM, "data:2", "batch:data"),
], ids=IDS)
def test_adamw_steps_track_dense(path, mesh, layout):
    """Three AdamW steps (clipped at 1) on the layout give the dense program's losses."""
    assert_adamw_steps_track_dense(path, mesh, layout)
