"""Held-out models of round 21a (written from the README and docs alone).

``tests/heldout_sae.py`` (a top-k sparse autoencoder on fed activations: top-k over the dictionary,
unit-norm decoder columns normalised in the graph, MSE + a dead-latent auxiliary loss);
``tests/heldout_muzero.py`` (MuZero-lite: representation, dynamics unrolled by md.repeat over fed
actions with the hidden state's gradient halved between steps, policy/value/reward heads);
``tests/heldout_ttt.py`` (TTT-linear: an inner linear model per head updated by one gradient step
per chunk, the causal dual form, W the carry of an inner repeat over chunks; the inner gradient
in closed form or by md.vjp, second order); ``tests/heldout_mamba2.py`` (Mamba2-lite: the chunked
SSD with scalar per-head decays by md.cumsum, gated output, RMS norm over d_inner);
``tests/heldout_videomae.py`` (VideoMAE-lite: tube patches by rearrange, an encoder on the fed
visible tokens, a decoder with mask tokens scattered back, MSE on masked tubes). Each runs under
data, Megatron, sequence/feature splits (2-way, uneven 3-way), FSDP, pipelines (where a stack
allows one), remat and search layouts against the dense program. Findings: /work/notes/heldout-21a.md.
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
SAE, MUZERO, TTT, MAMBA, VMAE = (str(HERE / f"heldout_{n}.py") for n in ("sae", "muzero", "ttt", "mamba2", "videomae"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}
ZBH1 = {"microbatches": 2, "schedule": "zbh1"}
INTERLEAVED = {"microbatches": 2, "schedule": "interleaved:2"}

# (model, config overrides, mesh, layout[, compile keywords])
CASES = [
    (SAE, {}, "model:3", "dict:model"),                        # top-k over a split dictionary
    (MUZERO, {}, "stage:2", "unroll:stage", PIPE),             # the unroll pipelined, shared weights
]

SLOW_CASES = [
    (SAE, {}, "data:2", "batch:data"),
    (SAE, {}, "data:3", "batch:data"),
    (SAE, {}, "model:2", "dict:model"),
    (SAE, {}, "model:4", "dict:model"),
    (SAE, {}, "model:2", "d_model:model"),
    (SAE, {}, "model:3", "d_model:model"),
    (SAE, {}, "data:2; model:2", "batch:data; dict:model"),
    (SAE, {}, "data:2; model:2", "dict:(data, model)"),
    (SAE, {}, "data:2; model:2", "d_model:data; dict:model"),
    (SAE, {}, "data:2", "batch:data; params.dict:data"),
    (SAE, {}, "data:3", "batch:data; params.d_model:data"),
    (SAE, {"form": "threshold"}, "model:2", "dict:model"),
    (SAE, {"form": "threshold"}, "model:3", "dict:model"),
    (MUZERO, {}, "data:2", "batch:data"),
    (MUZERO, {}, "data:3", "batch:data"),
    (MUZERO, {}, "model:2", "hidden:model"),
    (MUZERO, {}, "model:3", "hidden:model"),
    (MUZERO, {}, "model:2", "hidden2:model"),
    (MUZERO, {}, "model:3", "actions:model"),
    (MUZERO, {}, "data:2; model:2", "batch:data; hidden:model"),
    (MUZERO, {}, "data:2", "batch:data; params.hidden:data"),
    (MUZERO, {}, "data:3", "batch:data; params.hidden2:data"),
    (MUZERO, {}, "stage:2", "unroll:stage", ZBH1),
    (MUZERO, {}, "stage:2", "unroll:stage", INTERLEAVED),
    (MUZERO, {"remat": "full"}, "model:2", "hidden:model"),
    (MUZERO, {"remat": "selective", "batch": 8}, "stage:2; data:2", "unroll:stage; batch:data", PIPE),
    (TTT, {}, "data:2", "batch:data"),
    (TTT, {}, "data:3", "batch:data"),
    (TTT, {}, "model:2", "heads:model"),
    (TTT, {}, "model:2", "seq:model"),                         # an inner repeat over split chunks
    (TTT, {}, "model:3", "seq:model"),
    (TTT, {}, "model:2", "d_head:model"),
    (TTT, {}, "model:3", "d_model:model"),
    (TTT, {}, "data:2; model:2", "batch:data; heads:model"),
    (TTT, {}, "data:2", "batch:data; params.d_model:data"),
    (TTT, {}, "data:3", "batch:data; params.d_head:data"),
    (TTT, {}, "stage:2", "layer:stage", PIPE),
    (TTT, {}, "stage:2", "layer:stage", ZBH1),
    (TTT, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (TTT, {"remat": "full"}, "model:2", "heads:model"),
    (TTT, {"form": "vjp"}, "model:2", "seq:model"),            # second-order outer gradient
    (TTT, {"form": "vjp"}, "data:2; model:2", "batch:data; d_head2:model"),
    (TTT, {"form": "vjp"}, "stage:2", "layer:stage", PIPE),
    (MAMBA, {}, "data:2", "batch:data"),
    (MAMBA, {}, "data:3", "batch:data"),
    (MAMBA, {}, "model:2", "heads:model"),
    (MAMBA, {}, "model:2", "d_head:model"),
    (MAMBA, {}, "model:3", "d_head:model"),
    (MAMBA, {}, "model:2", "seq:model"),
    (MAMBA, {}, "model:3", "seq:model"),
    (MAMBA, {}, "model:2", "d_state:model"),
    (MAMBA, {}, "data:2; model:2", "batch:data; seq:model"),
    (MAMBA, {}, "data:2", "batch:data; params.d_model:data"),
    (MAMBA, {}, "data:3", "batch:data; params.d_model:data"),
    (MAMBA, {}, "stage:2", "layer:stage", PIPE),
    (MAMBA, {}, "stage:2", "layer:stage", ZBH1),
    (MAMBA, {}, "stage:2", "layer:stage", INTERLEAVED),
    (MAMBA, {"remat": "full"}, "stage:2; model:2", "layer:stage; seq:model", PIPE),
    (MAMBA, {"remat": "selective"}, "model:2", "heads:model"),
    (VMAE, {}, "data:2", "batch:data"),
    (VMAE, {}, "data:3", "batch:data"),
    (VMAE, {}, "model:2", "heads:model; d_ff:model; d_ff_dec:model"),
    (VMAE, {}, "model:2", "tokens:model"),
    (VMAE, {}, "model:3", "tokens:model"),
    (VMAE, {}, "model:2", "visible:model"),
    (VMAE, {}, "model:3", "visible:model"),
    (VMAE, {}, "model:2", "masked:model"),
    (VMAE, {}, "model:2", "height:model"),
    (VMAE, {}, "model:2", "patch:model"),
    (VMAE, {}, "data:2; model:2", "batch:data; tokens:model"),
    (VMAE, {}, "data:2", "batch:data; params.d_model:data"),
    (VMAE, {}, "data:3", "batch:data; params.d_dec:data"),
    (VMAE, {}, "stage:2", "layer:stage", PIPE),
    (VMAE, {}, "stage:2", "layer:stage", ZBH1),
    (VMAE, {}, "stage:2", "dec_layer:stage", PIPE),
    (VMAE, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (VMAE, {"remat": "full"}, "model:2", "tokens:model"),
    (VMAE, {"remat": "selective"}, "model:2", "heads:model"),
]


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[heldout_case_id(c) for c in CASES + SLOW_CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


@pytest.mark.parametrize("path", [SAE, MUZERO, TTT, MAMBA, VMAE],
                         ids=["sae", "muzero", "ttt", "mamba2", "videomae"])
def test_the_model_is_its_torch_reference(path):
    """Each model written in plain torch (torch.topk + scatter; a Python unroll; TTT token by token;
    Mamba2's step-by-step recurrence; reshape/gather/scatter) gives the DSL model's loss."""
    mod = load_module(path)
    cfg = mod.Config.tiny()
    model = mod.build(cfg)
    params, feeds = random_params(model), model.feeds(0)
    got = md.run_dense({"loss": model.loss}, feeds, params=params)["loss"]
    want = mod.reference_loss(cfg, params, *[feeds[k] for k in getattr(mod, "REF_INPUTS", ("x",))])
    # fp32 against fp64 on a loss of ~1-10: ~1e-7 relative; a wrong decay, mask or index is O(1e-1)
    assert float(got) == pytest.approx(float(want), rel=1e-5)


@pytest.mark.slow
def test_ttt_outer_gradient_through_the_inner_step_is_autograds():
    """TTT's outer gradient flows through the inner gradient step (second order in the inner
    loss): the closed form and the md.vjp form both give torch autograd's gradients of the plain
    torch reference (float64), every param."""
    mod = load_module(TTT)
    for form in ("closed", "vjp"):
        model = md.load_model(TTT, tiny=True, form=form)
        params, feeds = random_params(model), model.feeds(0)
        got = md.run_dense(md.grad(model.loss, model.params), feeds, params=params)
        ref = {k: v.double().requires_grad_() for k, v in params.items()}
        mod.reference_loss(model.config, ref, feeds["ids"], feeds["labels"]).backward()
        for k, p in ref.items():
            # fp32 against fp64 through 2 layers: ~1e-7 of the gradients' scale (~1); md.grad
            # inside the block (its results constants to the outer grad) is off by ~0.1-0.4
            torch.testing.assert_close(got[k].double(), p.grad, rtol=0, atol=1e-5, msg=lambda m, k=k: f"{form} {k}: {m}")


def test_sae_top_k_over_the_split_dictionary_gathers_candidates_only():
    """The SAE's top-k over a dictionary split 3 ways gathers each rank's k candidates (values and
    indices), not the dictionary's scores (md.top_k's lowering over a split dim)."""
    model = md.load_model(SAE, tiny=True)
    cfg = model.config
    plan = md.compile({"loss": model.loss}, "model:3", "dict:model")
    gathers = [s for s in plan.steps if s.kind == "allgather"]
    # per rank: k (or k_aux) fp32 values + int64 indices a row, against dict / 3 fp32 scores a row
    assert sum(s.bytes for s in gathers) == cfg.batch * (cfg.k + cfg.k_aux) * (4 + 8), \
        [(s.label, s.bytes) for s in gathers]


@pytest.mark.slow
@pytest.mark.parametrize("path,mesh,layout", [
    (SAE, "model:2", "dict:model"),
    (MUZERO, "data:2", "batch:data"),
    (TTT, "model:2", "heads:model"),
    (MAMBA, "model:2", "seq:model"),
    (VMAE, "model:2", "tokens:model"),
], ids=["sae", "muzero", "ttt", "mamba2", "videomae"])
def test_the_cli_checks_each_model_on_two_real_processes(path, mesh, layout, capsys):
    """``meshdsl check ... --tiny --nproc 2``: the plan run on two gloo processes."""
    code, out, err = run_cli(capsys, ["check", path, "--tiny", "--mesh", mesh, "--layout", layout, "--nproc", "2"])
    assert code == 0 and "OK:" in out, out + err


@pytest.mark.slow
@pytest.mark.parametrize("path", [SAE, MUZERO, TTT, MAMBA, VMAE], ids=["sae", "muzero", "ttt", "mamba2", "videomae"])
def test_the_searchs_top_layouts_match_dense(path, monkeypatch, tmp_path):
    """``md.search_layouts`` on 4 processes (the default calibration): its three best candidates
    compile and give the dense program's loss and gradients."""
    assert_search_top_layouts_match_dense(path, monkeypatch, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("path,mesh,layout", [
    (SAE, "data:2; model:2", "batch:data; dict:model"),
    (MUZERO, "data:2; model:2", "batch:data; hidden:model"),
    (TTT, "data:2; model:2", "batch:data; seq:model"),
    (MAMBA, "data:2; model:2", "batch:data; heads:model"),
    (VMAE, "data:2; model:2", "params.d_model:data; tokens:model"),
], ids=["sae", "muzero", "ttt", "mamba2", "videomae"])
def test_adamw_steps_track_dense(path, mesh, layout):
    """Three AdamW steps (clipped at 1) on the layout give the dense program's losses."""
    assert_adamw_steps_track_dense(path, mesh, layout)
