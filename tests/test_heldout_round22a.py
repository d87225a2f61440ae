"""Held-out models of round 22a (written from the README and docs alone).

``tests/heldout_anp.py`` (an attentive neural process: self-attention over the context,
cross-attention from the targets, a latent Gaussian from mean-pooled encodings reparameterised
with fed noise, Gaussian NLL + KL); ``tests/heldout_rqvae.py`` (RQ-VAE: conv encoder, residual
quantisation with 2 codebooks by argmin, a straight-through estimator by md.stop_gradient,
codebook + commitment losses, conv decoder); ``tests/heldout_splade.py`` (SPLADE: a small BERT,
MLM logits over the vocab, log(1 + relu) max-pooled over the sequence, in-batch contrastive loss +
FLOPS regulariser); ``tests/heldout_ecmoe.py`` (a GPT with expert-choice MoE layers: md.top_k over
the token dim); ``tests/heldout_bilstmcrf.py`` (BiLSTM-CRF: md.flip for the backward direction,
the CRF's forward algorithm as a recurrence over positions). Each runs under data, Megatron,
sequence/feature/spatial/codebook/vocab splits (2-way, uneven 3-way), FSDP, pipelines (where a
stack allows one), remat and search layouts against the dense program. Findings:
/work/notes/heldout-22a.md.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import meshdsl as md
from conftest import (assert_dense_is_its_torch_reference, assert_adamw_steps_track_dense, assert_heldout_case_matches_dense,
                      assert_search_top_layouts_match_dense, heldout_case_id, run_cli)

HERE = Path(__file__).parent
ANP, RQVAE, SPLADE, ECMOE, CRF = (str(HERE / f"heldout_{n}.py") for n in ("anp", "rqvae", "splade", "ecmoe", "bilstmcrf"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}
ZBH1 = {"microbatches": 2, "schedule": "zbh1"}
INTERLEAVED = {"microbatches": 2, "schedule": "interleaved:2"}

# (model, config overrides, mesh, layout[, compile keywords])
CASES = [
    (RQVAE, {}, "model:3", "codes:model"),                     # argmin over a codebook split unevenly
    (CRF, {}, "model:2", "seq:model"),                         # the recurrences over a split seq
]

SLOW_CASES = [
    (ANP, {}, "data:2", "batch:data"),
    (ANP, {}, "data:3", "batch:data"),
    (ANP, {}, "model:2", "heads:model"),
    (ANP, {}, "model:2", "ctx:model"),
    (ANP, {}, "model:3", "ctx:model"),
    (ANP, {}, "model:2", "tgt:model"),
    (ANP, {}, "model:3", "tgt:model"),
    (ANP, {}, "model:2", "d_model:model"),
    (ANP, {}, "model:2", "d_z:model"),
    (ANP, {}, "data:2; model:2", "batch:data; heads:model"),
    (ANP, {}, "data:2; model:2", "ctx:data; tgt:model"),
    (ANP, {}, "data:2", "batch:data; params.d_model:data"),
    (RQVAE, {}, "data:2", "batch:data"),
    (RQVAE, {}, "model:2", "codes:model"),
    (RQVAE, {}, "model:4", "codes:model"),
    (RQVAE, {}, "model:2", "height:model"),
    (RQVAE, {}, "model:3", "height:model"),
    (RQVAE, {}, "data:2; model:2", "height:data; width:model"),
    (RQVAE, {}, "model:2", "d_hid:model"),
    (RQVAE, {}, "model:2", "d_mid:model"),
    (RQVAE, {}, "data:2; model:2", "batch:data; codes:model; d_mid:model"),
    (RQVAE, {}, "data:2", "batch:data; params.codes:data"),
    (RQVAE, {}, "data:3", "height:data; params.d_hid:data"),
    (SPLADE, {}, "data:2", "batch:data"),
    (SPLADE, {}, "data:3", "seq:data"),
    (SPLADE, {}, "model:2", "vocab:model"),
    (SPLADE, {}, "model:3", "vocab:model"),
    (SPLADE, {}, "model:2", "heads:model; d_ff:model"),
    (SPLADE, {}, "model:2", "seq:model"),
    (SPLADE, {}, "model:2", "side:model"),
    (SPLADE, {}, "data:2; model:2", "batch:data; vocab:model"),
    (SPLADE, {}, "data:2", "batch:data; params.d_model:data"),
    (SPLADE, {}, "stage:2", "layer:stage", {"microbatches": 1, "schedule": "1f1b"}),
    (SPLADE, {"remat": "full"}, "model:2", "vocab:model"),
    (SPLADE, {"remat": "selective"}, "data:2", "batch:data"),
    (ECMOE, {}, "data:2", "batch:data"),
    (ECMOE, {}, "data:3", "batch:data"),
    (ECMOE, {}, "model:2", "experts:model"),
    (ECMOE, {}, "model:3", "experts:model"),
    (ECMOE, {}, "model:2", "heads:model; d_ff:model"),
    (ECMOE, {}, "model:2", "seq:model"),                       # top-k over the split token dim
    (ECMOE, {}, "model:3", "seq:model"),
    (ECMOE, {}, "data:2; model:2", "batch:data; experts:model"),
    (ECMOE, {}, "data:2", "batch:data; params.d_model:data"),
    (ECMOE, {}, "stage:2", "layer:stage", PIPE),
    (ECMOE, {}, "stage:2; data:2", "layer:stage; batch:data; experts:data", ZBH1),
    (ECMOE, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (ECMOE, {"remat": "full"}, "model:2", "seq:model"),
    (ECMOE, {"remat": "selective"}, "stage:2", "layer:stage", PIPE),
    (CRF, {}, "data:2", "batch:data"),
    (CRF, {}, "data:3", "batch:data"),
    (CRF, {}, "model:3", "seq:model"),
    (CRF, {}, "model:2", "hidden:model"),
    (CRF, {}, "model:3", "hidden:model"),
    (CRF, {}, "model:2", "tags:model"),
    (CRF, {}, "model:2", "gate:model"),
    (CRF, {}, "data:2; model:2", "batch:data; seq:model"),
    (CRF, {}, "data:2; model:2", "batch:data; hidden:model"),
    (CRF, {}, "data:2", "batch:data; params.d_emb:data"),
    (CRF, {"remat": "full"}, "model:2", "seq:model"),
    (CRF, {"remat": "selective"}, "model:2", "hidden:model"),
]


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[heldout_case_id(c) for c in CASES + SLOW_CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


@pytest.mark.slow
@pytest.mark.parametrize("path", [ANP, RQVAE, SPLADE, ECMOE, CRF], ids=["anp", "rqvae", "splade", "ecmoe", "bilstmcrf"])
def test_the_model_is_its_torch_reference(path):
    """Each model written in plain torch (sdpa + torch.distributions' log_prob and KL; F.conv2d +
    torch.cdist's argmin; a BERT loop + amax over the sequence; torch.topk over the tokens +
    index_add; a Python loop per LSTM direction and log Z over every tag path) gives the DSL
    model's loss, and torch autograd (float64) its gradients."""
    assert_dense_is_its_torch_reference(path)


def _inner_repeats(plan) -> list[int]:
    """Per forward top-level repeat step: how many repeat steps its block's sub-plan runs."""
    return [sum(t.kind == "repeat" for sp in s.subplans for t in sp.steps)
            for s in plan.steps if s.kind == "repeat" and s.phase == "forward"]


def test_a_nested_recurrence_with_per_step_outputs_runs_once_in_the_forward():
    """A recurrence nested in a one-layer block (so a layout may split its dim) that returns
    per-step outputs (an LSTM's hidden states) runs once per forward: its carry and its per-step
    outputs come from one lowering of the inner repeat (it ran twice: 3 allgathers per step and
    direction under hidden:model, 2 of them in the forward)."""
    model = md.load_model(CRF, tiny=True)
    plan = md.compile({"loss": model.loss, **md.grad(model.loss, model.params)}, "model:2", "hidden:model")
    assert _inner_repeats(plan) == [1, 1, 1]                  # LSTM forward, LSTM backward, CRF
    seq = model.config.seq
    # per direction and step: h gathered for W_hh in the forward only (under remat none the
    # backward reads the forward's saved activations, and runs no recompute)
    assert plan.totals()["allgather"]["count"] == 2 * seq


def test_an_in_batch_contrastive_loss_is_refused_under_micro_batches():
    """SPLADE's [batch, doc] scores read every micro-batch's documents: micro-batching refuses it
    with a user error naming the op and the fix (not a traceback, not wrong numbers)."""
    model = md.load_model(SPLADE, tiny=True)
    with pytest.raises(md.LayoutError, match="in-batch negatives"):
        md.compile({"loss": model.loss}, "stage:2", "layer:stage", microbatches=2, schedule="1f1b")


@pytest.mark.slow
@pytest.mark.parametrize("path,mesh,layout", [
    (ANP, "model:2", "ctx:model"),
    (RQVAE, "model:2", "codes:model"),
    (SPLADE, "model:2", "vocab:model"),
    (ECMOE, "model:2", "seq:model"),
    (CRF, "model:2", "seq:model"),
], ids=["anp", "rqvae", "splade", "ecmoe", "bilstmcrf"])
def test_the_cli_checks_each_model_on_two_real_processes(path, mesh, layout, capsys):
    """``meshdsl check ... --tiny --nproc 2``: the plan run on two gloo processes."""
    code, out, err = run_cli(capsys, ["check", path, "--tiny", "--mesh", mesh, "--layout", layout, "--nproc", "2"])
    assert code == 0 and "OK:" in out, out + err


@pytest.mark.slow
@pytest.mark.parametrize("path", [ANP, RQVAE, SPLADE, ECMOE, CRF], ids=["anp", "rqvae", "splade", "ecmoe", "bilstmcrf"])
def test_the_searchs_top_layouts_match_dense(path, monkeypatch, tmp_path):
    """``md.search_layouts`` on 4 processes (the default calibration): its three best candidates
    compile and give the dense program's loss and gradients."""
    assert_search_top_layouts_match_dense(path, monkeypatch, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("path,mesh,layout", [
    (ANP, "data:2; model:2", "batch:data; heads:model"),
    (RQVAE, "data:2; model:2", "batch:data; codes:model"),
    (SPLADE, "data:2; model:2", "batch:data; vocab:model"),
    (ECMOE, "data:2; model:2", "batch:data; experts:model"),
    (CRF, "data:2; model:2", "batch:data; seq:model"),
], ids=["anp", "rqvae", "splade", "ecmoe", "bilstmcrf"])
def test_adamw_steps_track_dense(path, mesh, layout):
    """Three AdamW steps (clipped at 1) on the layout give the dense program's losses."""
    assert_adamw_steps_track_dense(path, mesh, layout)
