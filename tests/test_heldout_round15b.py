"""Held-out models of round 15b (written from the README and docs alone): a tabular attention
network, a memory-augmented recurrent net, a decomposition forecaster, a token-merging ViT and a
video transformer.

``tests/heldout_tabnet.py`` (TabNet: 2 decision steps, GLU feature transformers, sparsemax masks
from ``md.top_k`` over every feature and ``md.cumsum``, prior scales, an entropy regulariser; the
steps under ``md.repeat`` with the state joined by ``md.concat``, or unrolled);
``tests/heldout_ntm.py`` (an NTM-lite: an MLP controller stepping over ``time`` as ``md.repeat``
with per-step inputs, cosine content addressing with a sharpness, erase/add writes to a memory
carried with the controller state by ``md.concat``; or unrolled); ``tests/heldout_autoformer.py``
(Autoformer: moving-average decomposition by a constant depthwise ``md.conv`` or ``md.shift``s,
auto-correlation over every lag by ``md.roll`` with the ``md.top_k`` lags' softmax, encoder layers
under ``md.repeat``); ``tests/heldout_tome.py`` (ToMe: bipartite soft matching by ``md.argmax`` and
``md.top_k``, size-weighted merges by one-hot contractions, proportional attention, the class token
kept; or a plain ViT under ``md.repeat``); ``tests/heldout_timesformer.py`` (TimeSformer: divided
space-time attention over frames, then over each frame's patches; or joint). Each runs under data,
Megatron, sequence/feature/spatial (2-way, uneven 3-way), FSDP, pipeline (1f1b, zbh1,
interleaved:2) and remat layouts against the dense program. Findings: /work/notes/heldout-15b.md.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import (assert_heldout_case_matches_dense, assert_search_top_layouts_match_dense,
                      assert_steps_track_dense, heldout_case_id, run_cli)

HERE = Path(__file__).parent
TABNET, NTM, AUTOFORMER, TOME, TIMESFORMER = (
    str(HERE / f"heldout_{n}.py") for n in ("tabnet", "ntm", "autoformer", "tome", "timesformer"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}
ZBH1 = {"microbatches": 2, "schedule": "zbh1"}
INTERLEAVED = {"microbatches": 2, "schedule": "interleaved:2"}
UNROLLED, SHIFT, VIT, JOINT = {"form": "unrolled"}, {"form": "shift"}, {"form": "vit"}, {"form": "joint"}

# (model, config overrides, mesh, layout, compile keywords)
CASES = [
    (TABNET, {}, "model:3", "features:model"),               # sparsemax's sort over an uneven split
    (NTM, {}, "stage:2", "time:stage", PIPE),                 # time steps pipelined, per-step inputs
    (AUTOFORMER, {}, "model:2", "seq:model"),                 # rolls over every lag of a split seq
]

# more of the same kinds, with -m slow
SLOW_CASES = [
    (TABNET, {}, "data:2", "batch:data"),
    (TABNET, {}, "model:2", "features:model"),
    (TABNET, {}, "model:2", "hid:model; d_att:model"),
    (TABNET, {}, "model:2", "state:model"),
    (TABNET, {}, "data:2; model:2", "batch:data; features:model"),
    (TABNET, {}, "data:2", "batch:data; params.features:data"),
    (TABNET, {}, "stage:2", "step:stage", PIPE),
    (TABNET, {}, "stage:2", "step:stage", ZBH1),
    (TABNET, {"steps": 4}, "stage:2", "step:stage", INTERLEAVED),
    (TABNET, {"remat": "full"}, "stage:2; model:2", "step:stage; features:model", PIPE),
    (TABNET, UNROLLED, "model:3", "hid:model"),
    (TABNET, {}, "data:3", "batch:data"),
    (NTM, {}, "data:2", "batch:data"),
    (NTM, {}, "model:2", "hidden:model"),
    (NTM, {}, "model:3", "hidden:model"),
    (NTM, {}, "model:2", "slots:model"),
    (NTM, {}, "model:2", "width:model"),
    (NTM, UNROLLED, "model:3", "width:model"),
    (NTM, {}, "data:2; model:2", "batch:data; hidden:model"),
    (NTM, {}, "data:2", "batch:data; params.hidden:data"),
    (NTM, {}, "stage:2", "time:stage", ZBH1),
    (NTM, {}, "stage:2", "time:stage", INTERLEAVED),
    (NTM, {"remat": "full"}, "stage:2", "time:stage", PIPE),
    (AUTOFORMER, {}, "data:2", "batch:data"),
    (AUTOFORMER, {}, "model:2", "heads:model; d_ff:model"),
    (AUTOFORMER, {}, "model:3", "seq:model"),
    (AUTOFORMER, SHIFT, "model:2", "seq:model"),
    (AUTOFORMER, {}, "model:2", "d_model:model"),
    (AUTOFORMER, {}, "model:3", "d_ff:model"),
    (AUTOFORMER, {}, "model:2", "lag:model"),
    (AUTOFORMER, {}, "data:2", "batch:data; params.d_model:data"),
    (AUTOFORMER, {}, "stage:2", "layer:stage", PIPE),
    (AUTOFORMER, SHIFT, "stage:2", "layer:stage", ZBH1),
    (AUTOFORMER, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (AUTOFORMER, {"remat": "full"}, "stage:2; model:2", "layer:stage; seq:model", PIPE),
    (AUTOFORMER, {"remat": "selective"}, "model:2", "seq:model"),
    (TOME, {}, "data:2", "batch:data"),
    (TOME, {}, "data:3", "batch:data"),
    (TOME, {}, "model:2", "heads:model; d_ff:model"),
    (TOME, {}, "model:2", "tok:model"),
    (TOME, {}, "model:3", "tok:model"),
    (TOME, {}, "model:2", "a:model; b:model"),
    (TOME, {}, "model:2", "height:model"),
    (TOME, {}, "data:2", "batch:data; params.d_model:data"),
    (TOME, VIT, "stage:2", "layer:stage", PIPE),
    (TOME, VIT, "stage:2", "layer:stage", ZBH1),
    (TOME, {"form": "vit", "layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (TOME, {"form": "vit", "remat": "full"}, "stage:2; model:2", "layer:stage; tok:model", PIPE),
    (TIMESFORMER, {}, "data:2", "batch:data"),
    (TIMESFORMER, {}, "model:2", "heads:model; d_ff:model"),
    (TIMESFORMER, {}, "model:2", "frames:model"),
    (TIMESFORMER, {}, "model:3", "frames:model"),
    (TIMESFORMER, {}, "model:2", "prow:model"),
    (TIMESFORMER, {}, "model:3", "prow:model"),
    (TIMESFORMER, {}, "data:2; model:2", "frames:data; prow:model"),
    (TIMESFORMER, {}, "data:2", "batch:data; params.d_model:data"),
    (TIMESFORMER, JOINT, "model:2", "frames:model"),
    (TIMESFORMER, {}, "stage:2", "layer:stage", PIPE),
    (TIMESFORMER, JOINT, "stage:2", "layer:stage", ZBH1),
    (TIMESFORMER, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (TIMESFORMER, {"remat": "selective"}, "stage:2; model:2", "layer:stage; prow:model", ZBH1),
]


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[heldout_case_id(c) for c in CASES + SLOW_CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


def test_tabnet_sparsemax_matches_a_sorting_reference():
    """TabNet's sparsemax, written from ``md.top_k`` over every feature and ``md.cumsum``, is the
    projection onto the simplex (a torch reference that sorts), with its gradient."""
    spec = importlib.util.spec_from_file_location("heldout_tabnet", TABNET)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    z_t = torch.randn(5, 7, generator=torch.Generator().manual_seed(0)) * 2
    with md.Graph():
        z = md.input("z", [md.Dim("batch", 5), md.Dim("features", 7)])
        p = mod.sparsemax(z, "features")
        out = md.run_dense({"p": p, **md.grad(md.reduce_sum(p * md.constant(torch.arange(7.0), ["features"])), {"z": z})},
                           {"z": z_t})
    zr = z_t.clone().requires_grad_(True)
    srt, _ = torch.sort(zr, dim=-1, descending=True)
    k = torch.arange(1, 8, dtype=torch.float32)
    support = (1 + k * srt > srt.cumsum(-1)).float()
    tau = ((srt * support).sum(-1, keepdim=True) - 1) / support.sum(-1, keepdim=True)
    ref = torch.relu(zr - tau)
    (ref * torch.arange(7.0)).sum().backward()
    # fp32: the same few terms summed in the same order; the sums of the masks are 1 to rounding
    torch.testing.assert_close(out["p"], ref.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out["p"].sum(-1), torch.ones(5), rtol=0, atol=1e-6)
    torch.testing.assert_close(out["z"], zr.grad, rtol=1e-6, atol=1e-6)
    assert (out["p"] == 0).any()                                  # sparse, unlike a softmax


def test_a_slice_of_a_pad_compiles():
    """A pad read only by slices is not materialised (its slices read through it). ToMe's merge,
    a concat whose gradient pads feed the slices of the next block, met the block-cyclic slice
    rule first, which read the pad's value: 'used before it is defined in this plan' on every
    mesh, ``data:1`` included."""
    t, d = md.Dim("tok", 6), md.Dim("d", 4)
    with md.Graph():
        x = md.param("x", [t, d])
        z = md.slice_(md.pad(x, "tok", 2, 0), "tok", 1, 8)
        loss = md.reduce_sum(z * z)
        outputs = {"loss": loss, **md.grad(loss, {"x": x})}
    for mesh, layout in [("data:1", ""), ("model:2", "tok:model")]:
        assert md.check(outputs, mesh, layout, {}).ok, (mesh, layout)


@pytest.mark.slow
@pytest.mark.parametrize("path,over,mesh,layout,kw", [
    (TABNET, {}, "data:2; model:2", "batch:data; features:model", {}),
    (NTM, {}, "stage:2", "time:stage", PIPE),
    (AUTOFORMER, {}, "data:2", "batch:data; params.d_model:data", {}),
    (TOME, {}, "model:2", "tok:model", {}),
    (TIMESFORMER, {}, "data:2; model:2", "frames:data; prow:model", {}),
], ids=["tabnet", "ntm", "autoformer", "tome", "timesformer"])
def test_adamw_steps_track_dense(path, over, mesh, layout, kw, one_torch_thread):
    """Two AdamW steps on the layout give the dense program's losses, then its params."""
    from meshdsl.comm.simulated import SimulatedComm
    model = md.load_model(path, tiny=True, **over)

    def step(mesh, layout, **kw):
        m = md.Mesh.parse(mesh) if mesh else md.Mesh(())
        return md.TrainStep(model.loss, model.params, m, layout, SimulatedComm(m), optimizer=md.AdamW(lr=0.01), **kw)
    # fp32, O(1) values: split sums and micro-batches add the same terms in another order
    assert_steps_track_dense(step(mesh, layout, **kw), step("", None), model, 1e-5, f"{path} {mesh} {layout}")


@pytest.mark.slow
@pytest.mark.parametrize("path,mesh,layout", [
    (TABNET, "data:2", "batch:data"),
    (NTM, "model:2", "slots:model"),
    (AUTOFORMER, "model:2", "seq:model"),
    (TOME, "model:2", "tok:model"),
    (TIMESFORMER, "model:2", "prow:model"),
], ids=["tabnet", "ntm", "autoformer", "tome", "timesformer"])
def test_the_cli_checks_each_model_on_two_real_processes(path, mesh, layout, capsys):
    """``meshdsl check ... --tiny --nproc 2``: the plan run on two gloo processes."""
    code, out, err = run_cli(capsys, ["check", path, "--tiny", "--mesh", mesh, "--layout", layout, "--nproc", "2"])
    assert code == 0 and "OK:" in out, out + err


@pytest.mark.slow
@pytest.mark.parametrize("path", [TABNET, NTM, AUTOFORMER, TOME, TIMESFORMER],
                         ids=["tabnet", "ntm", "autoformer", "tome", "timesformer"])
def test_the_searchs_top_layouts_match_dense(path, monkeypatch, tmp_path):
    """``md.search_layouts`` on 4 processes (the default calibration): its three best candidates
    compile and give the dense program's loss and gradients."""
    assert_search_top_layouts_match_dense(path, monkeypatch, tmp_path)
