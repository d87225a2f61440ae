"""Held-out models of round 18b (written from the README and docs alone): OLMo 2, YOCO, Hymba,
Zamba and DeepSeek-V3's auxiliary-loss-free MoE.

``tests/heldout_olmo2.py`` (reordered RMS norms after attention and MLP, parametric or not, QK-norm
per head, RoPE, SwiGLU, a z-loss; einsums with ``...``; form=sinks: md.attention's window + sinks);
``tests/heldout_yoco.py`` (a sliding-window self-decoder stack, one global k/v made from its output,
a cross-decoder stack attending causally to that one k/v in every layer; form=mask: the window as a
composite mask); ``tests/heldout_hymba.py`` (meta tokens prepended; attention heads and SSM heads
(a selective diagonal recurrence as a masked decay einsum, or form=scan a nested md.repeat over seq)
in parallel, each normed, averaged); ``tests/heldout_zamba.py`` (groups of Mamba-like gated
recurrences, an inner repeat, with ONE shared attention + MLP block reading the hidden state
concatenated with the embedding before each group; form=cumsum); ``tests/heldout_dsv3bias.py``
(sigmoid top-k routing by score + a per-expert bias that only picks, the bias moved in the step by
``gamma * sign(mean load - load)`` through ``md.Model(updates=)``, a shared expert, a sequence-wise
balance loss; form=softmax). Each runs under data, Megatron, sequence/feature (2-way, uneven
3-way), FSDP, pipeline (1f1b, zbh1, interleaved:2, two stacks for YOCO), remat and expert layouts
against the dense program. Findings: /work/notes/heldout-18b.md.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import (assert_adamw_steps_track_dense, assert_heldout_case_matches_dense,
                      assert_search_top_layouts_match_dense, heldout_case_id,
                      run_cli)

HERE = Path(__file__).parent
OLMO2, YOCO, HYMBA, ZAMBA, DSV3 = (
    str(HERE / f"heldout_{n}.py") for n in ("olmo2", "yoco", "hymba", "zamba", "dsv3bias"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}
ZBH1 = {"microbatches": 2, "schedule": "zbh1"}
INTERLEAVED = {"microbatches": 2, "schedule": "interleaved:2"}
SINKS, MASK, SCAN, CUMSUM, SOFTMAX = ({"form": "sinks"}, {"form": "mask"}, {"form": "scan"}, {"form": "cumsum"},
                                      {"form": "softmax"})
BOTH = "self_layer:stage; cross_layer:stage"

# (model, config overrides, mesh, layout[, compile keywords])
CASES = [
    (OLMO2, SINKS, "model:3", "seq:model"),                   # QK-norm + window/sinks over an uneven split
    (YOCO, {}, "stage:2", BOTH, PIPE),                        # two stacks, one k/v read by the second
]

SLOW_CASES = [
    (OLMO2, {}, "data:2", "batch:data"),
    (OLMO2, {}, "model:2", "heads:model; d_ff:model"),
    (OLMO2, {}, "model:2", "d_head:model"),                   # QK-norm and RoPE's halves over a split d_head
    (OLMO2, {}, "model:2", "seq:model"),
    (OLMO2, {}, "model:3", "seq:model"),
    (OLMO2, SINKS, "model:2", "seq:model"),
    (OLMO2, {}, "model:3", "d_ff:model; vocab:model"),        # the z-loss's logsumexp over a split vocab
    (OLMO2, {"norm_scale": False}, "model:3", "d_model:model"),
    (OLMO2, {}, "data:2; model:2", "batch:data; heads:model; d_ff:model"),
    (OLMO2, {}, "data:2", "batch:data; params.d_model:data"),
    (OLMO2, {}, "stage:2", "layer:stage", PIPE),
    (OLMO2, SINKS, "stage:2", "layer:stage", ZBH1),
    (OLMO2, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (OLMO2, {"remat": "full"}, "stage:2; model:2", "layer:stage; seq:model", PIPE),
    (OLMO2, {"remat": "selective"}, "model:2", "heads:model; d_ff:model"),
    (YOCO, {}, "data:2", "batch:data"),
    (YOCO, {}, "model:2", "heads:model; d_ff:model"),
    (YOCO, {}, "model:2", "seq:model"),
    (YOCO, {}, "model:3", "seq:model"),
    (YOCO, MASK, "model:3", "seq:model"),
    (YOCO, {}, "model:3", "d_model:model"),
    (YOCO, {}, "data:2; model:2", "batch:data; seq:model"),
    (YOCO, {}, "data:2", "batch:data; params.d_model:data"),
    (YOCO, MASK, "stage:2", BOTH, ZBH1),
    (YOCO, {"self_layers": 4, "cross_layers": 4}, "stage:2", BOTH, INTERLEAVED),
    (YOCO, {}, "stage:2", "cross_layer:stage", PIPE),         # only the cross stack pipelined
    (YOCO, {"remat": "full"}, "stage:2; model:2", BOTH + "; seq:model", PIPE),
    (YOCO, {"remat": "selective"}, "model:2", "heads:model; d_ff:model"),
    (HYMBA, {}, "data:2", "batch:data"),
    (HYMBA, {}, "model:2", "heads:model; d_ssm:model; d_ff:model"),
    (HYMBA, {}, "model:2", "seq:model"),
    (HYMBA, {}, "model:3", "seq:model"),                      # meta rows + tokens over an uneven split
    (HYMBA, SCAN, "model:3", "seq:model"),
    (HYMBA, {}, "model:3", "d_model:model"),
    (HYMBA, {}, "model:2", "meta:model"),
    (HYMBA, {}, "data:2; model:2", "batch:data; seq:model"),
    (HYMBA, {}, "data:2", "batch:data; params.d_model:data"),
    (HYMBA, {}, "stage:2", "layer:stage", PIPE),
    (HYMBA, SCAN, "stage:2", "layer:stage", ZBH1),
    (HYMBA, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (HYMBA, {"remat": "full"}, "stage:2; model:2", "layer:stage; seq:model", PIPE),
    (HYMBA, {"remat": "selective"}, "model:2", "d_ssm:model"),
    (ZAMBA, {}, "data:2", "batch:data"),
    (ZAMBA, {}, "model:2", "heads:model; d_inner:model; d_ff:model"),
    (ZAMBA, {}, "model:2", "seq:model"),
    (ZAMBA, {}, "model:3", "seq:model"),
    (ZAMBA, CUMSUM, "model:3", "seq:model"),
    (ZAMBA, {}, "model:2", "d_model:model"),                  # the concat with the embedding over a split d_model
    (ZAMBA, {}, "model:3", "d_cat:model; d_inner:model"),
    (ZAMBA, {}, "data:2; model:2", "batch:data; seq:model"),
    (ZAMBA, {}, "data:2", "batch:data; params.d_model:data"),
    (ZAMBA, {}, "stage:2", "group:stage", PIPE),
    (ZAMBA, CUMSUM, "stage:2", "group:stage", ZBH1),
    (ZAMBA, {"groups": 4}, "stage:2", "group:stage", INTERLEAVED),
    (ZAMBA, {"remat": "full"}, "stage:2; model:2", "group:stage; seq:model", PIPE),
    (ZAMBA, {"remat": "selective"}, "model:2", "d_inner:model"),
    (DSV3, {}, "data:2", "batch:data"),
    (DSV3, {}, "model:2", "experts:model"),
    (DSV3, {}, "model:3", "experts:model"),                   # bias-picked experts split unevenly
    (DSV3, {}, "data:2", "batch:data; experts:data"),
    (DSV3, {}, "model:2", "heads:model; d_ff:model"),
    (DSV3, {}, "model:2", "seq:model"),
    (DSV3, SOFTMAX, "model:3", "seq:model"),
    (DSV3, {}, "model:3", "gate_experts:model"),
    (DSV3, {}, "data:2; model:2", "batch:data; experts:model"),
    (DSV3, {}, "data:2", "batch:data; params.d_model:data"),
    (DSV3, {}, "stage:2", "layer:stage", PIPE),
    (DSV3, SOFTMAX, "stage:2", "layer:stage", ZBH1),
    (DSV3, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (DSV3, {"remat": "full"}, "stage:2; model:2", "layer:stage; experts:model", PIPE),
    (DSV3, {"remat": "selective"}, "model:2", "experts:model"),
]


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[heldout_case_id(c) for c in CASES + SLOW_CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


@pytest.mark.slow
@pytest.mark.parametrize("path,a,b", [
    (YOCO, {}, MASK), (HYMBA, {}, SCAN), (ZAMBA, {}, CUMSUM),
], ids=["yoco", "hymba", "zamba"])
def test_the_two_forms_give_the_same_model(path, a, b):
    """YOCO's fused window and its composite mask, Hymba's decay einsum and its nested scan, Zamba's
    decay einsum and its cumsum form are the same math: the dense losses agree (fp32 rounding ~1e-6)."""
    la, lb = (float(md.run_dense({"loss": m.loss}, m.feeds(0))["loss"])
              for m in (md.load_model(path, tiny=True, **o) for o in (a, b)))
    assert la == pytest.approx(lb, rel=1e-5)


def _dense_bias_loop(model, steps, opt=None, clip=1.0, lr=0.01, feeds=None):
    """The dense step without ``updates=``, the bias moved in torch between steps from the load the
    dense program reports for the params before the step: the oracle of the compiled update.
    Step ``t`` reads ``feeds(t)`` (default ``model.feeds``); ``opt`` None: plain SGD of ``lr``."""
    feeds = feeds or model.feeds
    step = md.TrainStep(model.loss, model.params, "data:1", "", md.SimulatedComm(md.Mesh.parse("data:1")),
                        lr=lr, optimizer=opt, clip_norm=clip)
    losses = []
    for t in range(steps):
        # cloned: on data:1 a full param is the live buffer, which the step updates in place
        before = {k: v.clone() for k, v in step.full_params(frozen=True).items()}
        load = md.run_dense({"load": model.outputs["moe/load"]}, {"ids": feeds(t)["ids"]}, params=before)["load"]
        losses.append(step(feeds(t), lr=None if opt is None else lr)[0])
        step.set_params({"bias": before["bias"] + model.config.gamma * torch.sign(load.mean(-1, keepdim=True) - load)})
    return losses, step.full_params(frozen=True)


@pytest.mark.parametrize("mesh,layout,kw", [
    ("model:2", "experts:model", {}),
    pytest.param("data:2", "batch:data; params.d_model:data", {}, marks=pytest.mark.slow),
    pytest.param("stage:2", "layer:stage", PIPE, marks=pytest.mark.slow),   # the load summed over micro-batches
    pytest.param("data:2; model:2", "batch:data; experts:model", {}, marks=pytest.mark.slow),
], ids=["experts", "fsdp", "pipeline", "dp-ep"])
def test_the_bias_update_tracks_a_dense_loop(mesh, layout, kw):
    """Four AdamW steps with the bias moved by ``md.Model(updates=)`` in the compiled step give the
    losses, params and bias of the dense step whose bias is moved by hand in torch."""
    model = md.load_model(DSV3, tiny=True)
    opt = md.AdamW(lr=0.01, weight_decay=0.1)
    want_losses, want = _dense_bias_loop(model, 4, opt)
    step = md.TrainStep(model.loss, model.params, mesh, layout, md.SimulatedComm(md.Mesh.parse(mesh)),
                        optimizer=opt, clip_norm=1.0, updates=model.updates, **kw)
    losses = [step(model.feeds(t), lr=0.01)[0] for t in range(4)]
    got = step.full_params(frozen=True)
    # fp32 sums in another order over four steps: ~1e-6 relative; a wrong update is O(1e-2)
    assert losses == pytest.approx(want_losses, rel=1e-5)
    for k, w in want.items():
        torch.testing.assert_close(got[k], w, rtol=1e-4, atol=1e-5, msg=f"{k} on {mesh} / {layout}")
    # the load counts are exact integers, so the bias is exact; and it moved
    assert torch.equal(got["bias"], want["bias"]) and got["bias"].abs().sum() > 0


def test_meshdsl_runs_training_job_applies_the_models_updates():
    """``meshdsl run``'s job (``train_job``: a warmup step, then the timed ones, plain SGD on one
    batch) sets the router bias in the step as ``meshdsl train`` does: its losses are those of the
    dense loop with the bias moved by hand. gamma=1 moves the bias far enough to change the routing,
    so a job that left the bias at its init (as it did) trains another model and fails here."""
    from meshdsl.train.jobs import train_job
    model = md.load_model(DSV3, tiny=True, gamma=1.0)
    want, _ = _dense_bias_loop(model, 4, clip=None, lr=0.5, feeds=lambda t: model.feeds(0))
    rows = train_job(md.SimulatedComm(md.Mesh.parse("model:2")), DSV3, True, "model:2", "experts:model", 3, 0.5,
                     config={"gamma": 1.0})
    # fp32 sums in another order over four steps: ~1e-6 relative; a bias left at zero is off by ~1e-2
    assert [r[0] for r in rows] == pytest.approx(want[1:], rel=1e-5)


def test_meshdsl_plan_shows_the_models_updates(capsys):
    """``meshdsl plan`` shows the step the trainer compiles, the bias update included: under
    ``batch:data`` the per-expert load is a sum over the split batch, one more allreduce (of the
    [layer, gate_experts] counts) besides the loss's, as in ``TrainStep(updates=)``'s plan."""
    import json
    model = md.load_model(DSV3, tiny=True)
    step = md.TrainStep(model.loss, model.params, "data:2", "batch:data", md.SimulatedComm(md.Mesh.parse("data:2")),
                        updates=model.updates)
    code, out, err = run_cli(capsys, ["plan", DSV3, "--tiny", "--mesh", "data:2", "--layout", "batch:data", "--json"])
    assert code == 0, out + err
    shown = json.loads(out)["totals"]
    assert shown["allreduce"] == step.plan.totals()["allreduce"] == {"count": 2, "bytes": 4 + 4 * 2 * 4}, shown


@pytest.mark.slow
@pytest.mark.parametrize("path,mesh,layout,extra", [
    (OLMO2, "model:2", "seq:model", ["--config", "form=sinks"]),
    (YOCO, "stage:2", BOTH, ["--microbatches", "2", "--schedule", "1f1b"]),
    (HYMBA, "model:2", "seq:model", []),
    (ZAMBA, "model:2", "seq:model", []),
    (DSV3, "model:2", "experts:model", []),
], ids=["olmo2", "yoco", "hymba", "zamba", "dsv3bias"])
def test_the_cli_checks_each_model_on_two_real_processes(path, mesh, layout, extra, capsys):
    """``meshdsl check ... --tiny --nproc 2``: the plan run on two gloo processes."""
    code, out, err = run_cli(capsys, ["check", path, "--tiny", "--mesh", mesh, "--layout", layout, "--nproc", "2", *extra])
    assert code == 0 and "OK:" in out, out + err


@pytest.mark.slow
def test_meshdsl_train_runs_the_bias_update_on_two_processes(capsys, tmp_path):
    """``meshdsl train`` on the MoE with the bias update, 2 gloo processes, expert parallel: it says
    it sets the bias in the step and trains."""
    code, out, err = run_cli(capsys, ["train", DSV3, "--tiny", "--mesh", "data:2", "--layout", "batch:data; experts:data",
                                      "--steps", "6", "--samples", "0", "--out", str(tmp_path / "run")])
    assert code == 0, out + err
    assert "updates: bias" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("path", [OLMO2, YOCO, HYMBA, ZAMBA, DSV3], ids=["olmo2", "yoco", "hymba", "zamba", "dsv3bias"])
def test_the_searchs_top_layouts_match_dense(path, monkeypatch, tmp_path):
    """``md.search_layouts`` on 4 processes (the default calibration): its three best candidates
    compile and give the dense program's loss and gradients."""
    assert_search_top_layouts_match_dense(path, monkeypatch, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("path,mesh,layout", [
    (OLMO2, "data:2; model:2", "params.d_model:data; seq:model"),
    (YOCO, "data:2; model:2", "batch:data; seq:model"),
    (HYMBA, "data:2; model:2", "batch:data; seq:model"),
    (ZAMBA, "data:2; model:2", "batch:data; d_inner:model"),
], ids=["olmo2", "yoco", "hymba", "zamba"])
def test_adamw_steps_track_dense(path, mesh, layout):
    """Three AdamW steps (clipped at 1) on the layout give the dense program's losses."""
    assert_adamw_steps_track_dense(path, mesh, layout)
