"""Pipelined plans: 'layer:<axis>' makes a repeat a pipeline over <axis> (plan level).

What the plan pins: the stage-to-stage traffic is send/recv over the stage axis only
(m per direction and micro-batch chain, with the carry's bytes), nothing is gathered
or reduced over it (a tied embedding's two gradients travel by one send/recv pair
each way), each param is stored only on the stages that read it, and bad
configurations are clear errors.  Execution is in tests/test_pipeline_exec.py.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import meshdsl as md
from meshdsl.lowering.schedule import ScheduleError
from meshdsl.train.step import training_outputs
from models.transformer import Config, build

CFG = dataclasses.replace(Config.tiny(), layers=4, batch=8)


def _outputs(cfg=CFG):
    m = build(cfg)
    return m, training_outputs(m.loss, m.params, 0.1, with_grads=True)


def _stage_coord(plan, rank, axis="stage"):
    return plan.mesh.coords(rank)[axis]


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 2), (4, 8)])
def test_stage_traffic_is_send_recv_only(p, m):
    _, outs = _outputs()
    plan = md.compile(outs, f"stage:{p}", "layer:stage", microbatches=m, schedule="1f1b")
    by_axis = plan.totals_by_axis()
    over_stage = {k: v for k, v in by_axis.items() if "stage" in k[1]}
    assert set(over_stage) == {("send", ("stage",)), ("recv", ("stage",))}
    # One carry send per micro-batch forward and one gradient send back; each carries
    # one micro-batch's [batch/m, seq, d_model] fp32 activation.
    carry = CFG.batch // m * CFG.seq * CFG.d_model * 4
    for kind in ("send", "recv"):
        assert over_stage[(kind, ("stage",))] == {"count": 2 * m, "bytes": 2 * m * carry}
    pipe = plan.steps[-1]
    assert pipe.kind == "pipeline" and pipe.args["num_stages"] == p and pipe.args["microbatches"] == m
    assert pipe.sub_times == (1, m, m, 1)


def test_params_live_on_the_stages_that_read_them():
    _, outs = _outputs()
    plan = md.compile(outs, "stage:4", "layer:stage", microbatches=2)
    stages = {name: {_stage_coord(plan, r) for r in plan.holders[vid]} for name, vid in plan.params.items()}
    assert stages["wte"] == stages["wpe"] == {0}
    assert stages["lnf"] == stages["lm_head"] == {3}
    for k in ("wq", "w_fc", "ln1"):
        assert stages[k] == {0, 1, 2, 3}
        # ... each holding its own layers only: the layer dim is split over the stage axis
        assert plan.values[plan.params[k]].sharding.axes_of("layer") == ("stage",)
        assert plan.values[plan.params[k]].local_shape(plan.mesh)[0] == CFG.layers // 4


def test_tied_embedding_gradient_crosses_by_one_send_recv_pair_each_way():
    _, outs = _outputs(dataclasses.replace(CFG, tied=True))
    plan = md.compile(outs, "stage:2", "layer:stage", microbatches=2)
    stages = {_stage_coord(plan, r) for r in plan.holders[plan.params["wte"]]}
    assert stages == {0, 1}
    final = plan.steps[-1].subplans[3]
    sends = [s for s in final.steps if s.kind == "send"]
    recvs = [s for s in final.steps if s.kind == "recv"]
    assert len(sends) == len(recvs) == 2  # stage 0's part to stage 1 and back
    assert {s.args["offset"] for s in sends} == {1, -1}
    wte_bytes = CFG.vocab * CFG.d_model * 4
    assert all(s.bytes == wte_bytes for s in sends + recvs)
    assert not [k for k in plan.totals_by_axis() if "stage" in k[1] and k[0] not in ("send", "recv")]


def test_stage_axis_of_size_one_is_a_plain_program():
    _, outs = _outputs()
    plan = md.compile(outs, "stage:1; data:2", "layer:stage; batch:data")
    assert "pipeline" not in {s.kind for s in plan.steps}
    plain = md.compile(outs, "stage:1; data:2", "batch:data")
    assert plan.totals() == plain.totals()


def test_3d_parallel_from_one_layout_string():
    _, outs = _outputs()
    plan = md.compile(outs, "stage:2; data:2; model:2", "layer:stage; batch:data; heads:model; d_ff:model",
                      microbatches=2, schedule="1f1b")
    axes = {k[1] for k in plan.totals_by_axis()}
    assert ("model",) in axes and any("data" in a for a in axes) and ("stage",) in axes


# ----------------------------------------------------------------------------- errors

def _mlp_with_unscanned_layer():
    with md.Graph():
        x = md.input("x", [md.Dim("batch", 4), md.Dim("d_model", 4)])
        w = md.param("w", [md.Dim("layer", 2), md.Dim("d_model", 4)])
        return md.reduce_sum(md.einsum("batch d_model, layer d_model -> batch", x, w))


@pytest.mark.parametrize("make,mesh,layout,kw,err,parts", [
    (lambda: _outputs()[1], "stage:8", "layer:stage", {}, md.LayoutError,
     ["dim 'layer' of size 4 is not divisible by mesh axes stage:8"]),
    (lambda: _outputs()[1], "stage:2", "layer:stage", {"microbatches": 3}, md.LayoutError,
     ["batch 8 is not divisible by 3 micro-batches", "Rule:", "Fix:"]),
    (lambda: _outputs()[1], "stage:2; data:2", "layer:stage; batch:data", {"microbatches": 8}, md.LayoutError,
     ["batch 8 is not divisible by 8 micro-batches x 2", "multiple of 16"]),
    (lambda: _outputs()[1], "stage:2; data:2", "layer:(stage,data)", {}, md.LayoutError,
     ["dim 'layer' is split over 2 mesh axes", "a pipeline runs over one mesh axis", "Fix:"]),
    (_mlp_with_unscanned_layer, "stage:2", "layer:stage", {}, md.LayoutError,
     ["splits dim 'layer', which no repeat scans over", "Fix:"]),
    (lambda: _outputs()[1], "stage:2", "layer:stage", {"schedule": "1f1c"}, ScheduleError,
     ["unknown schedule", "1f1b"]),
    (lambda: _outputs()[1], "stage:2", "layer:stage", {"schedule": "interleaved"}, ScheduleError,
     ["name its virtual stages per rank", "interleaved:2"]),
    (lambda: _outputs()[1], "stage:2", "layer:stage", {"schedule": "1f1b:2"}, ScheduleError,
     ["it has no virtual stages", "interleaved:2"]),
    (lambda: _outputs()[1], "stage:2", "layer:stage", {"schedule": "interleaved:4", "microbatches": 2}, ScheduleError,
     ["4 virtual stages per rank do not divide the 2 layers of each of the 2 ranks", "Rule:", "Fix:"]),
    (lambda: _outputs()[1], "stage:2", "layer:stage", {"microbatches": 0}, md.MeshError,
     ["microbatches = 0", "positive integer"]),
    (lambda: _outputs()[1], "stage:2", "layer:stage; batch:stage", {}, md.LayoutError,
     ["uses the pipeline axis 'stage'"]),
])
def test_bad_configurations(make, mesh, layout, kw, err, parts):
    with pytest.raises(err) as info:
        md.compile(make(), mesh, layout, **kw)
    for part in parts:
        assert part in str(info.value), str(info.value)


def test_whole_batch_op_before_the_pipeline_is_made_once():
    """Centring a value made from params by its batch mean before the layers: the params hold their
    starting values for the whole step, so the mean is made once before the micro-batches, and its
    gradient (a sum over the batch) after them (lowering/batch_stats.py); it was refused."""
    b, d, l = md.Dim("batch", 8), md.Dim("d_model", 4), md.Dim("layer", 2)
    with md.Graph():
        x = md.input("x", [b, d])
        w, w0 = md.param("w", [l, d]), md.param("w0", [d])
        u = x * w0
        h = u - md.reduce_mean(u, "batch")
        y = md.repeat(lambda c, p: md.tanh(c * p["w"]), h, {"w": w}, "layer")
        loss = md.reduce_sum(y)
        outs = {"loss": loss, **{f"grad/{k}": g for k, g in md.grad(loss, {"w": w, "w0": w0}).items()}}
    feeds = {"x": torch.randn(8, 4, generator=torch.Generator().manual_seed(0)) + 1.0}
    res = md.check(outs, "stage:2", "layer:stage", feeds, microbatches=2, schedule="1f1b")
    assert res.ok, str(res)


def test_plan_signature_covers_schedule_and_microbatches():
    """Ranks that disagree on the schedule or the micro-batch count fail the plan agreement."""
    _, outs = _outputs()
    sigs = {md.compile(outs, "stage:2", "layer:stage", microbatches=m, schedule=s).signature()
            for m in (1, 2) for s in ("gpipe", "1f1b")}
    assert len(sigs) == 4
