"""Held-out models of round 19a (written from the README and docs alone, with the newest API:
md.batch_norm with running statistics kept by md.Model(updates=), `...` in md.einsum and
md.rearrange, md.logaddexp, md.constant(number, dims), g.params()).

``tests/heldout_densenet.py`` (DenseNet-lite: dense blocks concatenating each layer's output to its
input along `channels`, BN-ReLU-conv, transitions of a 1x1 conv and a 2x2 average pool as a stride-2
depthwise conv of a constant filter, running BN statistics updated in the step, `mode=eval` reading
them); ``tests/heldout_wrn.py`` (Wide ResNet-lite: pre-activation residual blocks with BN and dropout
under md.repeat, their running statistics per layer from the repeat's per-layer outputs, a stride-2
downsampling block); ``tests/heldout_simsiam.py`` (SimSiam: two fed augmented views, BN in the
projector and predictor over the whole batch, stop-gradient, symmetrised negative cosine);
``tests/heldout_gptx.py`` (a GPT of batch-agnostic `...` Linears, a hand-written label-smoothed
CE or a logaddexp label-noise mixture with a constant fill); ``tests/heldout_pointnet2.py``
(PointNet++-lite: strided centroids, a ball query as md.where over pairwise distances, BN, max
over neighbours). Each runs under data, Megatron, spatial/point/feature (2-way, uneven 3-way),
FSDP, pipeline (where a stack allows one), remat and search layouts against the dense program.
Findings: /work/notes/heldout-19a.md.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from meshdsl.ops.nn import step_salt
from conftest import (assert_adamw_steps_track_dense, assert_heldout_case_matches_dense,
                      assert_search_top_layouts_match_dense, heldout_case_id, run_cli)

HERE = Path(__file__).parent
DENSENET, WRN, SIMSIAM, GPTX, POINTNET2 = (
    str(HERE / f"heldout_{n}.py") for n in ("densenet", "wrn", "simsiam", "gptx", "pointnet2"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}
ZBH1 = {"microbatches": 2, "schedule": "zbh1"}
INTERLEAVED = {"microbatches": 2, "schedule": "interleaved:2"}
EVAL, MIXTURE = {"mode": "eval"}, {"loss": "mixture"}

# (model, config overrides, mesh, layout[, compile keywords])
CASES = [
    (DENSENET, {}, "model:3", "height:model"),                 # growing channels, pools over an uneven split
    (SIMSIAM, {}, "data:4", "batch:data"),                     # BN statistics over the whole split batch
    (POINTNET2, {}, "model:3", "points:model"),                # strided centroids of split points
]

SLOW_CASES = [
    (DENSENET, {}, "data:2", "batch:data"),
    (DENSENET, {}, "data:3", "batch:data"),
    (DENSENET, {}, "model:2", "channels:model"),
    (DENSENET, {}, "model:3", "channels:model"),
    (DENSENET, {}, "model:2", "height:model"),
    (DENSENET, {}, "model:3", "width:model"),
    (DENSENET, {}, "data:2; model:2", "batch:data; channels:model"),
    (DENSENET, {}, "data:2; model:2", "height:data; width:model"),
    (DENSENET, {}, "data:2; model:2", "batch:data; height:model"),
    (DENSENET, {}, "data:2", "batch:data; params.channels:data"),
    (DENSENET, {}, "data:3", "batch:data; params.channels:data"),
    (DENSENET, EVAL, "data:2; model:2", "batch:data; channels:model"),
    (DENSENET, EVAL, "model:3", "height:model"),
    (WRN, {}, "data:2", "batch:data"),
    (WRN, {}, "data:3", "batch:data"),
    (WRN, {}, "model:2", "channels:model"),
    (WRN, {}, "model:3", "channels:model"),
    (WRN, {}, "model:2", "height:model"),
    (WRN, {}, "model:3", "width:model"),
    (WRN, {}, "data:2; model:2", "batch:data; channels:model"),
    (WRN, {}, "data:2; model:2", "height:data; width:model"),
    (WRN, {}, "data:2", "batch:data; params.channels:data"),
    (WRN, {}, "model:2", "layer:model; layer2:model"),
    (WRN, {"remat": "full"}, "data:2", "batch:data"),
    (WRN, {"remat": "selective"}, "model:2", "height:model"),
    (WRN, EVAL, "stage:2", "layer:stage", PIPE),
    (WRN, EVAL, "stage:2", "layer:stage", ZBH1),
    (WRN, dict(EVAL, layers=4), "stage:2", "layer:stage", INTERLEAVED),
    (WRN, EVAL, "model:3", "height:model"),
    (SIMSIAM, {}, "data:2", "batch:data"),
    (SIMSIAM, {}, "data:3", "batch:data"),
    (SIMSIAM, {}, "model:2", "hidden:model"),
    (SIMSIAM, {}, "data:2; model:3", "hidden:data; proj_h:model"),
    (SIMSIAM, {}, "model:3", "hidden_out:model"),
    (SIMSIAM, {}, "data:2; model:2", "proj:data; pred_hidden:model"),
    (SIMSIAM, {}, "model:3", "proj:model; proj_out:model"),
    (SIMSIAM, {}, "data:2; model:2", "batch:data; hidden:model"),
    (SIMSIAM, {}, "data:2; model:2", "batch:data; proj_h:model; pred_hidden:model"),
    (SIMSIAM, {}, "data:2", "batch:data; params.hidden:data"),
    (SIMSIAM, {}, "data:3", "batch:data; params.d_in:data"),
    (SIMSIAM, {}, "data:2; model:2", "batch:(data, model)"),
    (GPTX, {}, "data:2", "batch:data"),
    (GPTX, {}, "model:2", "heads:model; d_ff:model"),
    (GPTX, MIXTURE, "model:2", "heads:model; d_ff:model"),
    (GPTX, {}, "model:2", "heads_d_head:model; d_ff:model"),
    (GPTX, {}, "model:3", "d_ff:model; vocab:model"),
    (GPTX, MIXTURE, "model:3", "vocab:model"),
    (GPTX, {}, "model:2", "seq:model"),
    (GPTX, MIXTURE, "model:4", "seq:model"),
    (GPTX, {}, "model:3", "d_model:model"),
    (GPTX, {}, "data:2; model:2", "batch:data; heads:model; d_ff:model"),
    (GPTX, {}, "data:2", "batch:data; params.d_model:data"),
    (GPTX, {}, "data:3", "batch:data; params.d_model:data"),
    (GPTX, {}, "stage:2", "layer:stage", PIPE),
    (GPTX, MIXTURE, "stage:2", "layer:stage", ZBH1),
    (GPTX, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (GPTX, {"remat": "full"}, "stage:2; model:2", "layer:stage; heads:model", PIPE),
    (GPTX, {"remat": "selective"}, "model:2", "heads:model; d_ff:model"),
    (POINTNET2, {}, "data:2", "batch:data"),
    (POINTNET2, {}, "data:3", "batch:data"),
    (POINTNET2, {}, "model:2", "points:model"),
    (POINTNET2, {}, "model:4", "points:model"),
    (POINTNET2, {}, "model:2", "centers:model"),
    (POINTNET2, {}, "model:3", "centers:model"),
    (POINTNET2, {}, "model:2", "hidden:model"),
    (POINTNET2, {}, "data:2; model:3", "feat:data; hidden:model"),
    (POINTNET2, {}, "data:2; model:2", "batch:data; points:model"),
    (POINTNET2, {}, "data:2; model:2", "batch:data; hidden:model"),
    (POINTNET2, {}, "data:2", "batch:data; params.hidden:data"),
    (POINTNET2, {}, "data:2; model:2", "points:data; centers:model"),
]


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[heldout_case_id(c) for c in CASES + SLOW_CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


def _tiny_bn_model():
    """A one-norm model whose eval graph reads running statistics only Model.updates set."""
    B, C = md.Dim("batch", 6), md.Dim("channels", 3)
    with md.Graph() as g:
        x = md.input("x", [B, C])
        w = md.param("w", [C], init="ones")
        rm, rv = md.param("rm", [C], init="zeros"), md.param("rv", [C], init="ones")
        y, mean, var = md.batch_norm(x * w, ["batch"], stats=True)
        loss = md.reduce_mean(md.tanh(y) * x)
        eval_loss = md.reduce_mean(md.tanh((x * w - rm) * md.rsqrt(rv + 1e-5)) * x)
    feeds = lambda seed=0: {"x": torch.randn(6, 3, generator=torch.Generator().manual_seed(seed)) + 2}  # noqa: E731
    train = md.Model(g, loss, {"w": w}, feeds, updates={"rm": 0.9 * rm + 0.1 * mean, "rv": 0.9 * rv + 0.1 * var})
    return train, md.Model(g, eval_loss, {"w": w}, feeds)


def test_evaluate_refuses_params_that_leave_out_a_param_the_model_reads():
    """md.evaluate on an eval graph reading running statistics, given params without them (what
    md.load_trained returned for them before), was silently run on the statistics' init: a wrong
    eval loss. It is a ModelError naming each missing param."""
    _, eval_model = _tiny_bn_model()
    with pytest.raises(md.ModelError, match=r"(?s)lacks.*'rm'.*'rv'.*Fix"):
        md.evaluate(eval_model, {"w": torch.ones(3)}, batches=1)
    got = md.evaluate(eval_model, {"w": torch.ones(3), "rm": torch.full((3,), 2.0), "rv": torch.ones(3)}, batches=1)
    assert got["batches"] == 1


@pytest.mark.slow
def test_load_trained_holds_the_frozen_params_only_updates_set(tmp_path):
    """A run's running statistics (frozen params only Model.updates read) come back from
    md.load_trained as the step left them, so an eval graph (DenseNet's `mode=eval`) reads the
    trained statistics; before, they were left out, and md.evaluate ran it on their init."""
    r = md.fit(DENSENET, tiny=True, mesh="data:1", steps=2, lr=0.1, checkpoint=str(tmp_path / "ck"),
               save_every=2, out=str(tmp_path / "run"))
    want = r.step.full_params(frozen=True)
    t = md.load_trained(tmp_path / "run")
    stats = [k for k in want if k.endswith(("_rm", "_rv"))]
    assert len(stats) == 12 and set(stats) <= set(t.params)
    for k in stats:
        torch.testing.assert_close(t.params[k], want[k], rtol=0, atol=0)    # saved and loaded: exact
    assert float(t.params["b0l0_bn_rm"].abs().max()) > 1e-3                # the steps moved them
    eval_model = md.load_model(DENSENET, tiny=True, mode="eval")
    got = md.evaluate(eval_model, t.params, batches=1, seed=t.seed)
    feeds = eval_model.feeds(2 ** 62 + t.seed)       # the run's first eval batch
    assert got["loss"] == pytest.approx(float(md.run_dense({"l": eval_model.loss}, feeds, t.params)["l"]), rel=1e-6)


@pytest.mark.slow
def test_a_wrn_pipeline_over_its_batch_norm_blocks_is_refused_clearly():
    """WRN's blocks normalise by whole-batch statistics: under micro-batches that has no form with
    the dense numbers, so `layer:stage` with 2 micro-batches is a LayoutError naming batch_norm and
    the ways out (its eval graph, normalising with running statistics, pipelines: SLOW_CASES)."""
    model = md.load_model(WRN, tiny=True)
    with pytest.raises(md.MeshDSLError, match=r"(?s)batch_norm.*Rule:.*batch norm.*microbatches=1"):
        md.compile(md.grad(model.loss, model.params), "stage:2", "layer:stage", microbatches=2, schedule="1f1b")


@pytest.mark.slow
@pytest.mark.parametrize("path,mesh,layout", [
    (DENSENET, "model:2", "height:model"),
    (WRN, "model:2", "channels:model"),
    (SIMSIAM, "data:2", "batch:data"),
    (GPTX, "model:2", "heads:model; d_ff:model"),
    (POINTNET2, "model:2", "points:model"),
], ids=["densenet", "wrn", "simsiam", "gptx", "pointnet2"])
def test_the_cli_checks_each_model_on_two_real_processes(path, mesh, layout, capsys):
    """``meshdsl check ... --tiny --nproc 2``: the plan run on two gloo processes."""
    code, out, err = run_cli(capsys, ["check", path, "--tiny", "--mesh", mesh, "--layout", layout, "--nproc", "2"])
    assert code == 0 and "OK:" in out, out + err


@pytest.mark.slow
@pytest.mark.parametrize("path", [DENSENET, WRN, SIMSIAM, GPTX, POINTNET2],
                         ids=["densenet", "wrn", "simsiam", "gptx", "pointnet2"])
def test_the_searchs_top_layouts_match_dense(path, monkeypatch, tmp_path):
    """``md.search_layouts`` on 4 processes (the default calibration): its three best candidates
    compile and give the dense program's loss and gradients."""
    assert_search_top_layouts_match_dense(path, monkeypatch, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("path,mesh,layout", [
    (SIMSIAM, "data:2; model:2", "batch:data; hidden:model"),
    (GPTX, "data:2; model:2", "params.d_model:data; heads:model"),
    (POINTNET2, "data:2; model:2", "batch:data; points:model"),
], ids=["simsiam", "gptx", "pointnet2"])
def test_adamw_steps_track_dense(path, mesh, layout):
    """Three AdamW steps (clipped at 1) on the layout give the dense program's losses."""
    assert_adamw_steps_track_dense(path, mesh, layout)


@pytest.mark.slow
@pytest.mark.parametrize("path,mesh,layout", [
    (DENSENET, "data:2; model:2", "batch:data; height:model"),
    (DENSENET, "data:3", "batch:data; params.channels:data"),
    (WRN, "data:2; model:2", "batch:data; channels:model"),
    (WRN, "model:3", "width:model"),
], ids=["densenet-dp-spatial", "densenet-fsdp3", "wrn-dp-megatron", "wrn-width3"])
def test_adamw_steps_with_running_statistics_track_the_dense_loop(path, mesh, layout):
    """Three AdamW steps with the running statistics set by Model.updates: the losses, and then every
    param and running statistic, are the dense program's (its step run by hand, state carried)."""
    model = md.load_model(path, tiny=True)
    opt = md.AdamW(lr=0.01, weight_decay=0.1)
    one = md.TrainStep(model.loss, model.params, "data:1", "", md.SimulatedComm(md.Mesh.parse("data:1")),
                       optimizer=opt, clip_norm=1.0, updates=model.updates)
    assert all(f"new/{k}" in one.outputs for k in model.updates)
    prog = md.DenseProgram(one.outputs)
    state = prog.init_params(0)
    step = md.TrainStep(model.loss, model.params, mesh, layout, md.SimulatedComm(md.Mesh.parse(mesh)),
                        optimizer=opt, clip_norm=1.0, updates=model.updates)
    for i in range(3):
        # step i's dropout masks (WRN's) are drawn with step i's salt, as TrainStep draws them
        out = prog({**model.feeds(i), **opt.feeds(i), "opt/clip_norm": torch.tensor(1.0)}, state, salt=step_salt(i))
        state = {k: out.get(f"new/{k}", v) for k, v in state.items()}
        # fp32 sums in another order over a few steps: ~1e-6 relative; a wrong update is O(1e-2)
        assert step(model.feeds(i), lr=0.01)[0] == pytest.approx(float(out["loss"]), rel=1e-5), f"step {i}"
    got = step.full_params(frozen=True)
    for k in [*model.updates, *model.params]:
        # a running statistic is an average of activations: its rounding is ~1e-6 of their scale
        torch.testing.assert_close(got[k], state[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.slow
def test_wrn_running_statistics_follow_torch_batch_norm():
    """The first running mean and variance after one step are torch's (F.batch_norm with momentum
    0.1 and the unbiased running variance) of the stem conv's output, computed in torch from the
    initial weights, under batch:data; spatial split (the statistics are the whole batch's)."""
    import torch.nn.functional as F
    model = md.load_model(WRN, tiny=True)
    step = md.TrainStep(model.loss, model.params, "data:2; model:2", "batch:data; height:model",
                        md.SimulatedComm(md.Mesh.parse("data:2; model:2")), optimizer=md.SGD(lr=0.1),
                        updates=model.updates)
    stem, feeds = step.full_params()["stem"], model.feeds(0)
    h = F.conv2d(feeds["images"].permute(0, 3, 1, 2), stem.permute(3, 2, 0, 1), padding=1)
    run_mean, run_var = torch.zeros(h.shape[1]), torch.ones(h.shape[1])
    F.batch_norm(h, run_mean, run_var, training=True, momentum=0.1)
    step(feeds)
    got = step.full_params(frozen=True)
    # one batch's mean and variance in fp32, summed in another order: ~1e-7 of their scale
    torch.testing.assert_close(got["layer_rm1"][0], run_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["layer_rv1"][0] + 1.0, run_var, rtol=1e-5, atol=1e-6)   # stored minus 1


@pytest.mark.slow
def test_wrn_trains_on_two_processes_and_evaluates_with_its_running_statistics(tmp_path, capsys):
    """`meshdsl train` (2 gloo processes, batch:data, dropout) for 3 steps, then `meshdsl eval`;
    md.load_trained's running statistics are those of the same steps run in this process on one
    rank, and the eval graph (`mode=eval`) evaluates with them."""
    out, ck = str(tmp_path / "run"), str(tmp_path / "ck")
    code, text, err = run_cli(capsys, ["train", WRN, "--tiny", "--steps", "3", "--lr", "0.1", "--nproc", "2",
                                       "--mesh", "data:2", "--layout", "batch:data", "--samples", "0",
                                       "--checkpoint", ck, "--save-every", "3", "--out", out])
    assert code == 0, text + err
    code, text, err = run_cli(capsys, ["eval", out])
    assert code == 0 and "eval loss" in text, text + err
    t = md.load_trained(out)
    r = md.fit(md.load_model(WRN, tiny=True), mesh="data:1", steps=3, lr=0.1)
    want = r.step.full_params(frozen=True)
    for k in want:
        torch.testing.assert_close(t.params[k], want[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    ev = md.load_model(WRN, tiny=True, mode="eval")
    loss = md.evaluate(ev, t.params, batches=2, seed=t.seed)["loss"]
    init = md.evaluate(ev, {**t.params, **{k: torch.zeros_like(v) for k, v in t.params.items() if "_r" in k}},
                       batches=2, seed=t.seed)["loss"]
    assert loss != pytest.approx(init, rel=1e-4)     # the trained statistics matter to the eval
