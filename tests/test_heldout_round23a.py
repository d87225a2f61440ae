"""Held-out models of round 23a (written from the README and docs alone).

``tests/heldout_ncf.py`` (NeuMF: user and item embedding tables whose rows a layout may split, GMF
and MLP towers, BCE on fed positives and fed negatives); ``tests/heldout_stt.py`` (a space-time video
transformer: divided attention, temporal then spatial, in every block of an md.repeat);
``tests/heldout_pinn.py`` (a physics-informed net for Burgers: the residual's u_t, u_x and u_xx are
md.vjp's derivatives of the output w.r.t. the inputs, the second a derivative of a derivative);
``tests/heldout_dreamer2.py`` (a Dreamer-v2 world model: a GRU recurrence over time nested in a
one-layer block, straight-through one-hot categorical latents from fed gumbel noise, KL balancing with
md.stop_gradient on either side, reward and observation heads); ``tests/heldout_clap.py`` (CLAP: a
conv audio encoder, a text transformer, L2-normalised projections, symmetric InfoNCE with a learned
temperature). Each runs under data, Megatron, sequence/feature/spatial/table-row/latent-class splits
(2-way, uneven 3-way), FSDP, pipelines (where a layer stack allows one), remat and the search's
layouts against the dense program. Findings: /work/notes/heldout-23a.md.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import (assert_dense_is_its_torch_reference, assert_adamw_steps_track_dense, assert_heldout_case_matches_dense,
                      assert_search_top_layouts_match_dense, heldout_case_id, run_cli)

HERE = Path(__file__).parent
NCF, STT, PINN, DREAMER, CLAP = (str(HERE / f"heldout_{n}.py") for n in ("ncf", "stt", "pinn", "dreamer2", "clap"))
ALL, IDS = [NCF, STT, PINN, DREAMER, CLAP], ["ncf", "stt", "pinn", "dreamer2", "clap"]
PIPE = {"microbatches": 2, "schedule": "1f1b"}
ZBH1 = {"microbatches": 2, "schedule": "zbh1"}
INTERLEAVED = {"microbatches": 2, "schedule": "interleaved:2"}

# (model, config overrides, mesh, layout[, compile keywords])
CASES = [
    (PINN, {}, "data:2; model:2", "batch:data; hidden:model"),   # second input-derivatives under a split
    (DREAMER, {}, "model:3", "time:model"),                      # the recurrence over time split unevenly
    (NCF, {}, "model:3", "items:model"),                         # an embedding table's rows split unevenly
]

SLOW_CASES = [
    (NCF, {}, "data:2", "batch:data"),
    (NCF, {}, "data:3", "batch:data"),
    (NCF, {}, "model:2", "users:model"),
    (NCF, {}, "model:2", "users:model; items:model"),
    (NCF, {}, "model:2", "hidden:model"),
    (NCF, {}, "model:3", "hidden:model"),
    (NCF, {}, "model:2", "cand:model"),
    (NCF, {}, "model:2", "d_gmf:model; d_mlp:model"),
    (NCF, {}, "data:2; model:2", "batch:data; users:model; items:model"),
    (NCF, {}, "data:2; model:2", "batch:data; hidden:model"),
    (NCF, {}, "data:2", "batch:data; params.users:data; params.items:data"),
    (STT, {}, "data:2", "batch:data"),
    (STT, {}, "data:3", "time:data"),
    (STT, {}, "model:2", "heads:model; d_ff:model"),
    (STT, {}, "model:3", "d_ff:model"),
    (STT, {}, "model:2", "time:model"),
    (STT, {}, "model:2", "patches:model"),
    (STT, {}, "model:3", "patches:model"),
    (STT, {}, "data:2; model:2", "time:data; patches:model"),
    (STT, {}, "data:2; model:2", "batch:data; heads:model"),
    (STT, {}, "data:2", "batch:data; params.d_model:data"),
    (STT, {}, "stage:2", "layer:stage", PIPE),
    (STT, {"batch": 4}, "stage:2; data:2", "layer:stage; batch:data", ZBH1),
    (STT, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (STT, {"remat": "full"}, "model:2", "patches:model"),
    (STT, {"remat": "selective"}, "stage:2", "layer:stage", PIPE),
    (PINN, {}, "data:2", "batch:data"),
    (PINN, {}, "data:3", "batch:data"),
    (PINN, {}, "model:2", "hidden:model"),
    (PINN, {}, "model:3", "hidden:model"),
    (PINN, {}, "model:2", "h_out:model"),
    (PINN, {}, "model:2", "bnd:model"),
    (PINN, {}, "data:2; model:2", "batch:data; bnd:data; h_out:model"),
    (PINN, {}, "data:2", "batch:data; params.hidden:data"),
    (PINN, {}, "data:3", "batch:data; params.h_out:data"),
    (DREAMER, {}, "data:2", "batch:data"),
    (DREAMER, {"batch": 4}, "data:3", "batch:data"),
    (DREAMER, {}, "model:2", "time:model"),
    (DREAMER, {}, "model:2", "classes:model"),
    (DREAMER, {}, "model:3", "classes:model"),
    (DREAMER, {}, "model:2", "groups:model"),
    (DREAMER, {}, "model:2", "hidden:model"),
    (DREAMER, {}, "data:2; model:2", "batch:data; classes:model"),
    (DREAMER, {}, "data:2; model:2", "batch:data; time:model"),
    (DREAMER, {}, "data:2", "batch:data; params.hidden:data"),
    (DREAMER, {"remat": "full"}, "model:2", "time:model"),
    (DREAMER, {"remat": "selective"}, "model:2", "classes:model"),
    (CLAP, {}, "data:2", "batch:data"),
    (CLAP, {}, "data:3", "batch:data"),
    (CLAP, {}, "model:2", "heads:model; d_ff:model"),
    (CLAP, {}, "model:3", "d_ff:model"),
    (CLAP, {}, "model:2", "frames:model"),
    (CLAP, {}, "model:3", "frames:model"),
    (CLAP, {}, "model:2", "seq:model"),
    (CLAP, {}, "model:2", "d_emb:model"),
    (CLAP, {}, "data:2; model:2", "batch:data; heads:model"),
    (CLAP, {}, "data:2", "batch:data; params.d_model:data"),
    (CLAP, {}, "stage:2", "layer:stage", {"microbatches": 1, "schedule": "1f1b"}),
    (CLAP, {"remat": "full"}, "data:2", "batch:data"),
    (CLAP, {"remat": "selective"}, "model:2", "heads:model; d_ff:model"),
]


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[heldout_case_id(c) for c in CASES + SLOW_CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


@pytest.mark.parametrize("path", [pytest.param(p, marks=[] if p == PINN else pytest.mark.slow) for p in ALL], ids=IDS)
def test_the_model_is_its_torch_reference(path):
    """Each model written in plain torch (indexing + BCE-with-logits; sdpa over time, then over
    patches; autograd.grad with create_graph=True for u_t, u_x and u_xx; a Python loop over time with
    .detach() for the stop-gradients; F.conv1d + sdpa + cross-entropy both ways) gives the DSL
    model's loss, and torch autograd (float64) its gradients: PINN's are third derivatives of the MLP."""
    assert_dense_is_its_torch_reference(path)


@pytest.mark.slow
@pytest.mark.parametrize("path,mesh,layout", [
    (NCF, "model:2", "users:model; items:model"),
    (STT, "model:2", "time:model"),
    (PINN, "model:2", "hidden:model"),
    (DREAMER, "model:2", "time:model"),
    (CLAP, "data:2", "batch:data"),
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


@pytest.mark.slow
@pytest.mark.parametrize("path,mesh,layout", [
    (NCF, "data:2; model:2", "batch:data; users:model; items:model"),
    (STT, "data:2; model:2", "batch:data; heads:model"),
    (PINN, "data:2; model:2", "batch:data; hidden:model"),
    (DREAMER, "data:2; model:2", "batch:data; classes:model"),
    (CLAP, "data:2; model:2", "batch:data; heads:model"),
], ids=IDS)
def test_adamw_steps_track_dense(path, mesh, layout):
    """Three AdamW steps (clipped at 1) on the layout give the dense program's losses."""
    assert_adamw_steps_track_dense(path, mesh, layout)


def _tanh_net(B, H):
    x = md.input("x", [B])
    w, v = md.param("w", [H], scale=1.0), md.param("v", [H])
    return x, w, md.einsum("batch hidden, hidden -> batch", md.tanh(md.einsum("batch, hidden -> batch hidden", x, w)), v)


def test_a_derivative_of_an_md_grad_result_is_refused_not_a_silent_zero():
    """A PINN's u_xx written as md.grad of md.grad's u_x (or its loss differentiated through md.grad's
    u_x) would be zero: md.grad's results are constants. md.grad says so and names md.vjp (it
    returned zeros); a loss that also reads the param directly (first-order MAML) still differentiates."""
    B, H = md.Dim("batch", 4), md.Dim("hidden", 3)
    with md.Graph():
        x, w, u = _tanh_net(B, H)
        u_x = md.grad(md.reduce_sum(u), {"x": x})["x"]
        with pytest.raises(md.GraphError, match=r"only through 'grad/x'(.|\n)*md\.vjp"):
            md.grad(md.reduce_sum(u_x), {"x": x})
        with pytest.raises(md.GraphError, match="gradient of 'w' would be zero"):
            md.grad(md.reduce_mean(u_x ** 2), {"w": w})
        fast = w - 0.1 * md.grad(md.reduce_sum(u ** 2), {"w": w})["w"]      # first-order MAML's inner step
        outer = md.reduce_sum(fast * fast)
        feeds = {"x": torch.randn(4, generator=torch.Generator().manual_seed(0))}
        got = md.run_dense({**md.grad(outer, {"w": w}), "want": 2 * fast}, feeds)
    # the inner gradient held constant: d outer / d w = 2 fast, the same fp32 ops, so equal to rounding
    torch.testing.assert_close(got["w"], got["want"])


def test_a_derivative_through_a_repeat_names_the_missing_second_order_rule():
    """A PINN whose hidden layers are an md.repeat: differentiating md.vjp's u_x again would pass
    through the scan's gradient, which has no second-order rule. The error says that and how to write
    it (the layers as a Python loop), not only 'wrap it in stop_gradient' (a silently wrong gradient)."""
    B, H, L = md.Dim("batch", 4), md.Dim("hidden", 3), md.Dim("layer", 2)
    with md.Graph():
        x, w, _ = _tanh_net(B, H)
        h = md.tanh(md.einsum("batch, hidden -> batch hidden", x, w))
        h = md.repeat(lambda c, p: md.tanh(c * p["s"]), h, {"s": md.param("s", [L, H])}, "layer")
        u = md.reduce_sum(h, "hidden")
        (u_x,) = md.vjp([u], [md.constant(1.0, [B])], [x])
        with pytest.raises(md.GraphError, match=r"'repeat_grad'(.|\n)*second-order(.|\n)*Python loop"):
            md.grad(md.reduce_mean(u_x ** 2), [w])
