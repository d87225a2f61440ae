"""Held-out models of round 13c (written from the README and docs alone): quantised, speculative,
reinforcement-learning, local/global-attention and mobile-vision models.

``tests/heldout_bitnet.py`` (BitNet b1.58: ternary weights ``clamp(round(w / mean|w|), -1, 1)`` and
8-bit absmax activations per token, each straight-through by ``x + stop_gradient(q - x)``,
RMSNorm, a squared-ReLU MLP, blocks under ``md.repeat``); ``tests/heldout_medusa.py`` (Medusa: a GPT
backbone and K extra heads, each a residual SiLU MLP into the shared unembedding, predicting tokens
t+2..t+K+1 from labels sliced in the graph out of one token stream, a decayed sum of the losses);
``tests/heldout_ppo.py`` (PPO on a token policy: a transformer actor and a value head, the taken
action's log-probability by a one-hot contraction or the cross entropy, the clipped surrogate with
``md.clamp`` and ``md.minimum``, value loss and entropy bonus); ``tests/heldout_gemma3.py`` (Gemma 3:
a repeat of a block of local sliding-window layers and one global layer, GQA, QK-norm, RoPE of two
bases, pre- and post-norms, a tied soft-capped LM head); ``tests/heldout_mobilevit.py`` (MobileViT:
a conv stem, a local conv, patches unfolded by rearrange into ``(ph pw) (h w)``, a transformer over
the patches, folded back, fused with the input by concat and a 3x3 conv, a classifier). Each runs
under data, Megatron, sequence/spatial (2-way, uneven 3-way, 2x2), FSDP, pipeline (1f1b, zbh1,
interleaved:2) and remat layouts against the dense program. Findings: /work/notes/heldout-13c.md.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import assert_heldout_case_matches_dense, assert_search_top_layouts_match_dense, heldout_case_id, run_cli

HERE = Path(__file__).parent
BITNET, MEDUSA, PPO, GEMMA3, MOBILEVIT = (
    str(HERE / f"heldout_{n}.py") for n in ("bitnet", "medusa", "ppo", "gemma3", "mobilevit"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}
ZBH1 = {"microbatches": 2, "schedule": "zbh1"}
INTERLEAVED = {"microbatches": 2, "schedule": "interleaved:2"}
CE = {"form": "ce"}

# (model, config overrides, mesh, layout, compile keywords)
CASES = [
    (BITNET, {}, "model:3", "d_model:model"),                 # per-weight scales over an uneven split
    (MEDUSA, {}, "model:3", "pos:model"),                     # labels sliced out of a split token stream
    (PPO, CE, "model:3", "act:model"),                        # the clipped surrogate over split actions
    (GEMMA3, {}, "model:3", "seq:model"),                     # window halos beside global attention
    (MOBILEVIT, {}, "model:2", "height:model"),               # unfold, attention over patches, fold, halos
]

# more of the same kinds, with -m slow
SLOW_CASES = [
    (BITNET, {}, "data:2", "batch:data"),
    (BITNET, {}, "model:2", "heads:model; d_ff:model"),
    (BITNET, {}, "model:3", "d_ff:model"),
    (BITNET, {}, "model:2", "seq:model"),
    (BITNET, {}, "model:3", "seq:model"),
    (BITNET, {}, "model:2", "vocab:model"),
    (BITNET, {}, "data:2; model:2", "batch:data; heads:model; d_ff:model"),
    (BITNET, {}, "data:2", "batch:data; params.d_model:data"),
    (BITNET, {}, "stage:2", "layer:stage", PIPE),
    (BITNET, {}, "stage:2", "layer:stage", ZBH1),
    (BITNET, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (BITNET, {"remat": "full"}, "stage:2; model:2", "layer:stage; heads:model; d_ff:model", PIPE),
    (BITNET, {"remat": "selective"}, "model:2", "d_ff:model"),
    (MEDUSA, {}, "data:2", "batch:data"),
    (MEDUSA, {}, "model:2", "heads:model; d_ff:model"),
    (MEDUSA, {}, "model:3", "d_ff:model; mhead:model"),
    (MEDUSA, {}, "model:2", "mhead:model"),
    (MEDUSA, {}, "model:2", "vocab:model"),
    (MEDUSA, {}, "model:3", "seq:model"),
    (MEDUSA, {}, "data:2; model:2", "batch:data; mhead:model; vocab:model"),
    (MEDUSA, {}, "data:2", "batch:data; params.d_model:data"),
    (MEDUSA, {}, "stage:2", "layer:stage", PIPE),
    (MEDUSA, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (MEDUSA, {"remat": "full"}, "stage:2; model:2", "layer:stage; mhead:model", PIPE),
    (PPO, {}, "data:2", "batch:data"),
    (PPO, {}, "model:2", "heads:model; d_ff:model"),
    (PPO, {}, "model:3", "act:model"),
    (PPO, {}, "model:2", "seq:model"),
    (PPO, CE, "model:3", "seq:model"),
    (PPO, {}, "data:2; model:2", "batch:data; act:model; heads:model"),
    (PPO, {}, "data:2", "batch:data; params.d_model:data"),
    (PPO, {}, "stage:2", "layer:stage", PIPE),
    (PPO, CE, "stage:2", "layer:stage", ZBH1),
    (PPO, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (PPO, {"remat": "full"}, "stage:2; model:2", "layer:stage; act:model", PIPE),
    (GEMMA3, {}, "data:2", "batch:data"),
    (GEMMA3, {}, "model:2", "kv_heads:model; d_ff:model"),
    (GEMMA3, {}, "kv:2; grp:2", "kv_heads:kv; group:grp"),
    (GEMMA3, {}, "model:2", "d_head:model"),
    (GEMMA3, {}, "model:4", "seq:model"),
    (GEMMA3, {}, "data:2; model:2", "batch:data; seq:model"),
    (GEMMA3, {}, "data:2", "batch:data; params.d_model:data"),
    (GEMMA3, {}, "stage:2", "blk:stage", PIPE),
    (GEMMA3, {}, "stage:2", "blk:stage", ZBH1),
    (GEMMA3, {"blocks": 4}, "stage:2", "blk:stage", INTERLEAVED),
    (GEMMA3, {"remat": "full"}, "stage:2; model:2", "blk:stage; seq:model", PIPE),
    (GEMMA3, {"remat": "selective"}, "model:2", "kv_heads:model; d_ff:model"),
    (MOBILEVIT, {}, "data:2", "batch:data"),
    (MOBILEVIT, {}, "model:2", "heads:model; d_ff:model"),
    (MOBILEVIT, {}, "model:2", "width:model"),
    (MOBILEVIT, {}, "model:3", "height:model"),
    (MOBILEVIT, {}, "model:2", "h_w:model"),
    (MOBILEVIT, {}, "model:2", "ph_pw:model"),
    (MOBILEVIT, {}, "model:2", "cat:model"),
    (MOBILEVIT, {}, "data:2; model:2", "height:data; width:model"),
    (MOBILEVIT, {}, "data:2", "batch:data; params.d_model:data"),
    (MOBILEVIT, {}, "stage:2", "layer:stage", PIPE),
    (MOBILEVIT, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (MOBILEVIT, {"remat": "full"}, "stage:2; model:2", "layer:stage; height:model", PIPE),
    (MOBILEVIT, {"remat": "selective"}, "model:3", "h_w:model"),
]


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[heldout_case_id(c) for c in CASES + SLOW_CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


@pytest.mark.slow
@pytest.mark.parametrize("path,mesh,layout", [
    (BITNET, "model:2", "heads:model; d_ff:model"),
    (MEDUSA, "model:2", "mhead:model"),
    (PPO, "model:2", "act:model"),
    (GEMMA3, "model:2", "seq:model"),
    (MOBILEVIT, "model:2", "height:model"),
], ids=["bitnet", "medusa", "ppo", "gemma3", "mobilevit"])
def test_the_cli_checks_each_model_on_two_real_processes(path, mesh, layout, capsys):
    """``meshdsl check ... --tiny --nproc 2``: the plan run on two gloo processes."""
    code, out, err = run_cli(capsys, ["check", path, "--tiny", "--mesh", mesh, "--layout", layout, "--nproc", "2"])
    assert code == 0 and "OK:" in out, out + err


@pytest.mark.slow
@pytest.mark.parametrize("path", [BITNET, MEDUSA, PPO, GEMMA3, MOBILEVIT],
                         ids=["bitnet", "medusa", "ppo", "gemma3", "mobilevit"])
def test_the_searchs_top_layouts_match_dense(path, monkeypatch, tmp_path):
    """``md.search_layouts`` on 4 processes (the default calibration): its three best candidates
    compile and give the dense program's loss and gradients."""
    assert_search_top_layouts_match_dense(path, monkeypatch, tmp_path)
