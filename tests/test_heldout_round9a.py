"""Held-out models of round 9a (written from the README and docs alone): vision and point clouds.

``tests/heldout_resnet.py`` (3x3 convs, train-mode batch norm: each BN normalised by its input's
mean and variance over ``batch`` and the positions, basic residual blocks under ``md.repeat``, a
stride-2 conv, mean pooling; ``bn_stats=False`` normalises per example so the stack pipelines);
``tests/heldout_effnet.py`` (EfficientNet / MobileNetV2: a strided stem, a downsampling MBConv
with a *strided depthwise* conv, then inverted residuals with swish, a depthwise conv,
squeeze-and-excitation and a linear bottleneck); ``tests/heldout_dino.py`` (DINO: a student and a
frozen teacher ViT over ``views`` crops, the teacher's logits centred and sharpened, the
cross-entropy of each teacher view against every other student view); ``tests/heldout_pointnet.py``
(a T-net's 3x3 transform per cloud from a max pool over ``points``, a shared per-point MLP stack,
a max pool, the transform's orthogonality regulariser); ``tests/heldout_fcos.py`` (a dense
detection head: per-cell objectness BCE, a GIoU + L1 box loss on the positive cells normalised by
their whole-batch count). Each under data, Megatron splits of channel and hidden dims, split
spatial dims and points (uneven 3- and 4-way too), FSDP, 1f1b / zbh1 / interleaved pipelines with
micro-batches, remat, forward and gradients against the dense program; DINO's teacher loaded as
given weights and trained two AdamW steps pipelined; the layout search's top candidates on one;
one gloo case.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import (assert_heldout_case_matches_dense, assert_ranks_match_dense,
                      assert_search_top_layouts_match_dense, assert_steps_track_dense, heldout_case_id,
                      heldout_outputs, held_outputs_on_this_rank, pipeline_steps_by_segment)

HERE = Path(__file__).parent
RESNET, EFFNET, DINO, POINTNET, FCOS = (str(HERE / f"heldout_{n}.py") for n in
                                        ("resnet", "effnet", "dino", "pointnet", "fcos"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}
ZB = {"microbatches": 2, "schedule": "zbh1"}
INTER = {"microbatches": 2, "schedule": "interleaved:2"}
NO_BN = {"bn_stats": False}
BOTH = "layer:stage; t_layer:stage"

# (model, config overrides, mesh, layout, compile keywords)
CASES = [
    (RESNET, {}, "data:2; model:2", "batch:data; d_mid:model"),
    (RESNET, {}, "data:2; model:3", "height:data; d_model:model"),          # BN over split positions
    (RESNET, NO_BN, "stage:2; model:2", "layer:stage; d_mid:model", {"microbatches": 3, "schedule": "1f1b"}),
    (EFFNET, {}, "data:2; model:2", "height:data; width:model"),            # strided depthwise conv's phases split
    (EFFNET, {}, "stage:2; data:2", "layer:stage; height:data", PIPE),
    (EFFNET, {"layers": 3}, "stage:2", "layer:stage", {**PIPE, "stage_layers": (2, 1)}),
    (DINO, {}, "data:2; model:2", "batch:data; heads:model; d_ff:model"),
    (DINO, {}, "stage:2", BOTH, ZB),                                        # student and frozen teacher stacks
    (DINO, {"center_from_batch": True}, "data:2; model:2", "views:data; protos:model"),
    (POINTNET, {}, "data:3", "points:data"),                                # max pools over 10 points on 3 ranks
    (POINTNET, {}, "data:2; model:2", "points:data; xyz_out:model"),        # the T-net's matrix split
    (POINTNET, {}, "stage:2; data:2", "layer:stage; points:data", PIPE),
    (FCOS, {}, "data:3; model:2", "row:data; box:model"),                   # the GIoU's four sides split
    (FCOS, {}, "stage:2; data:2", "layer:stage; col:data", ZB),             # the positives' count pipelined
]
# more layouts of the same models, with -m slow (the suite's time): each passed when written
SLOW_CASES = [
    (RESNET, {}, "data:3", "batch:data"),                                   # BN statistics over 6 rows on 3 ranks
    (RESNET, {}, "data:4", "width:data"),                                   # 8 columns, then 4 after the stride
    (RESNET, {}, "data:3", "batch:data; params.d_mid:data"),
    (RESNET, {"bn_stats": False, "layers": 4}, "stage:2", "layer:stage", INTER),
    (EFFNET, {}, "data:2; model:2", "batch:data; ff:model; d_exp:model"),
    (EFFNET, {}, "model:2", "d_se:model"),                                  # the squeeze-excitation bottleneck
    (EFFNET, {}, "data:3", "width:data"),
    (EFFNET, {"layers": 4}, "stage:2", "layer:stage", INTER),
    (DINO, {}, "model:3", "protos:model"),                                  # the centred softmax over split prototypes
    (DINO, {}, "data:2; model:2", "views:data; params.d_ff:model"),         # the pairs of views split
    (DINO, {"layers": 4}, "stage:2; data:2", f"{BOTH}; views:data", {"microbatches": 4, "schedule": "interleaved:2"}),
    (POINTNET, {}, "data:3", "batch:data; params.d_model:data"),
    (POINTNET, {}, "data:4", "points:data"),
    (FCOS, {}, "data:2; model:2", "row:data; col:model"),
    (FCOS, {}, "data:2", "batch:data", {"microbatches": 2}),
    (FCOS, {"layers": 4}, "stage:2", "layer:stage", INTER),
]


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[heldout_case_id(c) for c in CASES + SLOW_CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


def _grads(model, remat: str) -> dict:
    return {"loss": model.loss, **{f"grad/{k}": g for k, g in md.grad(model.loss, model.params, remat=remat).items()}}


@pytest.mark.parametrize("path, remat, mesh, layout, kw", [
    pytest.param(EFFNET, "selective", "data:2; model:2", "height:data; ff:model", {}, marks=pytest.mark.slow),
    (POINTNET, "full", "stage:2; data:3", "layer:stage; points:data", ZB),
], ids=["effnet-selective", "pointnet-full-zbh1"])
def test_remat_gives_the_dense_numbers(path, remat, mesh, layout, kw):
    model = md.load_model(path, tiny=True)
    res = md.check(_grads(model, remat), mesh, layout, model.feeds(0), **kw)
    assert res.ok, str(res)


def test_batch_norm_statistics_under_micro_batches_are_refused_naming_the_fix():
    """Train-mode BN's mean and variance over the whole batch, made from params in every layer, have
    no micro-batched form: refused, and the fix names per-example norms or microbatches=1."""
    model = md.load_model(RESNET, tiny=True)
    with pytest.raises(md.LayoutError, match="sums over the micro-batches in every layer") as e:
        md.compile(heldout_outputs(model), "stage:2", "layer:stage", **PIPE)
    assert "batch norm" in str(e.value) and "microbatches=1" in str(e.value)


def test_resnet_batch_norm_is_torchs_train_mode_batch_norm():
    """The stem's BN is torch's training-mode ``batch_norm`` (biased variance) of the stem conv."""
    model = md.load_model(RESNET, tiny=True, layers=1)
    feeds = model.feeds(0)
    out = md.run_dense({"stem": model.outputs["stem"], **{k: model.params[k] for k in ("w_stem", "stem_g", "stem_b")}},
                       {"images": feeds["images"]})
    x = feeds["images"].permute(0, 3, 1, 2)
    conv = torch.nn.functional.conv2d(x, out["w_stem"].permute(3, 2, 0, 1), padding=1)
    want = torch.relu(torch.nn.functional.batch_norm(conv, None, None, out["stem_g"], out["stem_b"], training=True,
                                                     eps=model.config.eps))
    torch.testing.assert_close(out["stem"].permute(0, 3, 1, 2), want, rtol=1e-5, atol=1e-5)   # fp32, O(1) values


def test_pointnet_is_invariant_to_the_order_of_the_points():
    model = md.load_model(POINTNET, tiny=True)
    feeds = model.feeds(0)
    perm = torch.randperm(feeds["points"].shape[1], generator=torch.Generator().manual_seed(1))
    outs = heldout_outputs(model)
    a, b = md.run_dense(outs, feeds), md.run_dense(outs, dict(feeds, points=feeds["points"][:, perm]))
    for k in a:   # the same max pools of the same values, the sums over the points in another order
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)


def test_fcos_loss_is_torchs_bce_plus_giou_on_the_positive_cells():
    model = md.load_model(FCOS, tiny=True)
    f, cfg = model.feeds(0), model.config
    out = md.run_dense({"loss": model.loss, **model.outputs}, f)
    obj, z, p, t = f["obj"], out["objectness"], out["boxes"], f["target_box"]
    bce = torch.nn.functional.binary_cross_entropy_with_logits(z, obj)
    area = lambda b: (b[..., 0] + b[..., 2]) * (b[..., 1] + b[..., 3])     # noqa: E731
    lo, hi = torch.minimum(p, t), torch.maximum(p, t)
    inter, enc = area(lo), area(hi)
    union = area(p) + area(t) - inter
    giou = inter / union - (enc - union) / enc
    l1 = (p.log() - t.log()).abs().sum(-1)
    box = (((1 - giou) + cfg.l1_weight * l1) * obj).sum() / obj.sum().clamp(min=1)
    torch.testing.assert_close(out["obj_loss"], bce, rtol=1e-5, atol=0)      # fp32 rounding of the same terms
    torch.testing.assert_close(out["loss"], bce + cfg.box_weight * box, rtol=1e-5, atol=0)


def _step(model, mesh, layout, **kw):
    from meshdsl.comm.simulated import SimulatedComm
    mesh = md.Mesh.parse(mesh) if mesh else md.Mesh(())
    return md.TrainStep(model.loss, model.params, mesh, layout, SimulatedComm(mesh), optimizer=md.AdamW(lr=0.01), **kw)


@pytest.mark.parametrize("mesh, layout, kw", [("stage:2", BOTH, PIPE),
                                              pytest.param("data:2; model:2", "views:data; heads:model; protos:model",
                                                           {}, marks=pytest.mark.slow)],
                         ids=["pipeline", "views-megatron"])
def test_dino_teacher_given_as_weights_stays_frozen_while_the_student_trains(mesh, layout, kw, one_torch_thread):
    """DINO starts the teacher as a copy of the student: ``set_params`` loads it (frozen params by
    name); two AdamW steps give the dense program's losses and student params, and leave the
    teacher's weights as given."""
    model = md.load_model(DINO, tiny=True)
    dense = _step(model, "", None)
    teacher = {"t_" + k[2:]: v.clone() for k, v in dense.full_params().items()}
    step = _step(model, mesh, layout, **kw)
    assert sorted(dense.set_params(teacher)) == sorted(step.set_params(teacher)) == sorted(teacher)
    # fp32, O(1) values: stages, micro-batches and split sums add the same terms in another order
    assert_steps_track_dense(step, dense, model, 1e-5, f"DINO {mesh} {layout}")
    after = step.full_params(frozen=True)
    for k, v in teacher.items():
        assert torch.equal(after[k], v), k


@pytest.mark.parametrize("layout", [BOTH, "layer:stage"])
def test_dino_crops_are_cut_into_patches_on_each_stage_that_reads_them(layout):
    """Both towers read the crops cut into patches, a value made from the inputs alone: each
    stage that reads it makes it from the fed images (a free rearrange), as no collective; it
    was made on stage 0 and sent to stage 1 per micro-batch (3 KiB each, 3x the carry)."""
    model = md.load_model(DINO, tiny=True)
    outs = heldout_outputs(model)
    plan = md.compile(outs, "stage:2", layout, **PIPE)
    pipe = next(s for s in plan.steps if s.kind == "pipeline")
    seg = pipeline_steps_by_segment(plan)
    sent = [pipe.subplans[k].values[s.ins[0]].shape.names for k in (1, 2) for s, _ in seg[k] if s.kind == "send"]
    assert sent and not any("pix" in names or "height" in names for names in sent), sent
    assert [st for s, st in seg[1] if s.op == "rearrange"] == [(0, 1)]
    res = md.check(outs, "stage:2", layout, model.feeds(0), **PIPE)
    assert res.ok, str(res)


def test_dino_batch_centre_of_the_frozen_teacher_is_made_once_before_the_micro_batches():
    """The centre as this batch's mean of the teacher's logits is a whole-batch value of frozen
    params and the inputs, fixed when the step starts: the unpipelined teacher runs once, before the
    micro-batches, and the pipelined student gives the dense numbers (it was refused).  With the
    teacher's stack pipelined too, each micro-batch's teacher forward runs in turn: refused, and
    the fix given (leave 't_layer' out) is the layout that runs."""
    model = md.load_model(DINO, tiny=True, center_from_batch=True)
    outs, feeds = heldout_outputs(model), model.feeds(0)
    res = md.check(outs, "stage:2", "layer:stage", feeds, **PIPE)
    assert res.ok, str(res)
    with pytest.raises(md.LayoutError, match="reduces over the whole batch") as e:
        md.compile(outs, "stage:2", BOTH, **PIPE)
    assert "through the pipelined repeat over 't_layer'" in str(e.value)
    assert "Fix: leave 't_layer' out of the layout ('layer:stage')" in str(e.value)


# each search takes 2-7 s (pipelined candidates among the top ones): with -m slow
@pytest.mark.slow
@pytest.mark.parametrize("path", [FCOS, POINTNET], ids=["fcos", "pointnet"])
def test_the_searchs_top_layouts_match_dense(path, monkeypatch, tmp_path):
    """``md.search_layouts`` on 4 processes (the default calibration): its three best candidates
    compile and give the dense program's loss and gradients."""
    assert_search_top_layouts_match_dense(path, monkeypatch, tmp_path)


def _pointnet_on_two_processes(comm):
    torch.set_num_threads(1)
    m = md.load_model(POINTNET, tiny=True)
    plan = md.compile(heldout_outputs(m), "stage:2", "layer:stage", **PIPE)
    return held_outputs_on_this_rank(comm, plan, m.feeds(0))


@pytest.mark.slow   # by default: PointNet's stack pipelined simulated (CASES' stage:2; data:2 PIPE row), pipelines on
# gloo in tests/test_pipeline_dist.py
@pytest.mark.timeout(200)
def test_pointnet_pipeline_on_two_gloo_processes():
    """PointNet's stack over 2 real processes, micro-batched: every output is the dense program's."""
    from meshdsl.processes import launcher
    m = md.load_model(POINTNET, tiny=True)
    want = md.run_dense(heldout_outputs(m), m.feeds(0))
    results = launcher.spawn(_pointnet_on_two_processes, 2, mesh="stage:2", timeout=180)
    # fp32, O(1) values: the stages and micro-batches add the same terms in another order (~1e-7)
    assert_ranks_match_dense(results, want, 1e-5)


def test_a_constant_given_its_name_first_says_the_name_is_a_keyword():
    """``md.constant("eye", t, dims)`` (the name first, as ``md.param`` takes it) was refused as
    "argument 'like' is [..] (list)": now the str value is named, with the call to write."""
    xyz, out = md.Dim("xyz", 3), md.Dim("xyz_out", 3)
    with md.Graph():
        with pytest.raises(md.ShapeError, match="the value is the str 'eye', then Tensor dims") as e:
            md.constant("eye", torch.eye(3), [xyz, out])
        assert "name='eye'" in str(e.value)
        with pytest.raises(md.ShapeError, match="argument 'like' is"):
            md.constant(torch.eye(3), [xyz, out], [1])
        eye = md.constant(torch.eye(3), [xyz, out], name="eye")
    assert md.run_dense({"eye": eye}, {})["eye"].equal(torch.eye(3))


def test_check_given_remat_says_where_remat_goes():
    """``md.check(..., remat="full")`` was a raw TypeError from inside ``compile``; an option check
    lacks is a user error naming it (and the close one: ``microbatch=``)."""
    model = md.load_model(POINTNET, tiny=True)
    outs, feeds = heldout_outputs(model), model.feeds(0)
    with pytest.raises(md.GraphError, match="remat= is no option") as e:
        md.check(outs, "data:2", "points:data", feeds, remat="full")
    assert "md.grad(loss, params, remat=...)" in str(e.value)
    with pytest.raises(md.GraphError, match="Did you mean 'microbatches'"):
        md.check(outs, "data:2", "points:data", feeds, microbatch=2)
