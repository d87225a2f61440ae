"""Mixed precision: ``TrainStep(precision="bf16")`` against fp32.

Step-0 gradients in bf16 are the fp32 ones rounded, and 20 AdamW steps of the tiny
transformer in bf16 follow the fp32 curve (four data windows) within stated
tolerances (dense and DP+TP, on the simulated mesh); params and optimizer state stay
fp32; the plan shows bf16 activations with halved tensor-parallel allreduce bytes and
fp32 gradient reductions (allreduce and, under ZeRO-2, reduce-scatter); every op has a
precision rule; fp32 stays the default and its plans are untouched.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import meshdsl as md
from meshdsl.ir.precision import mixed_precision
from meshdsl.ops import OPS
from meshdsl.ops.precision import POLICY
from meshdsl.train.model import load_model
from models.transformer import Config, build

CFG = dataclasses.replace(Config.tiny(), layers=4, batch=8)
STEPS = 20
DP_TP = ("data:2; model:2", "batch:data; heads:model; d_ff:model")
ZERO2 = ("data:2", "batch:data; grads.d_model:data; opt.d_model:data")

# bf16 keeps 8 significant bits: each rounding is off by at most 2^-9 ~ 2e-3 relative.
# On the first step (same fp32 params in both runs) the losses differ only by the
# forward's roundings; some 25 of them lie on the path to the loss (four layers of
# einsums, residual adds, gelu), and independent errors add like a random walk,
# sqrt(25) * 2^-9 ~ 1e-2.  Measured: 1.3e-3 (dense), 1.6e-3 (DP+TP).
FIRST_REL = 1e-2
# After that the runs drift apart: AdamW divides each gradient by its own RMS, so a
# rounding that flips a near-zero gradient element moves that weight by 2 * lr in
# the other direction.  The curves stay together (same data, same steps) but no
# longer to 2^-9, and how far one 20-step curve strays depends on which elements
# flip: a change of kernel that only reorders fp32 sums (the fused layer norm's
# backward against normalize + mul + reduce_sum: the same step-0 bf16 gradients to
# 3e-4 relative) moved the worst step of the curve starting at batch 0 from 3.7e-2
# to 5.0e-2, and left the curves starting at batches 100, 200 and 300 at 0.2e-2,
# 1.9e-2 and 2.7e-2.  So the curve is checked over WINDOWS, four 20-step curves from
# different data: every window's mean within MEAN_REL, and, step by step, the
# median over the windows within STEP_REL (measured, dense and DP+TP: window means
# 0.05e-2 to 1.9e-2, window maxima 0.2e-2 to 5.0e-2, the median curve at most 1.1e-2).  A wrong gradient is caught directly on step 0:
# each param's bf16 gradient is its fp32 gradient rounded, within GRAD_REL in
# norm (measured at most 0.15 relative: wk's, through the 2-wide attention heads of
# the tiny model, 0.10 dense; the others 0.01 to 0.08); a gradient that is wrong
# rather than rounded (a dropped partial sum: half of it missing, a bf16-summed
# gradient that overflows, a missing cast) is off by far more, and leaves the fp32
# curve in every window within a few steps.
STEP_REL = 5e-2
MEAN_REL = 2e-2
GRAD_REL = 0.2
WINDOWS = (0, 100, 200, 300)


def _opt():
    return md.AdamW(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


@pytest.fixture(scope="module")
def model():
    return build(CFG)


def _step(model, mesh, layout, precision=None, bucket_mb=25.0):
    kw = {} if precision is None else {"precision": precision}
    return md.TrainStep(model.loss, model.params, mesh, layout, md.SimulatedComm(md.Mesh.parse(mesh)),
                        optimizer=_opt(), clip_norm=1.0, bucket_mb=bucket_mb, **kw)


def _curve(step, model, start=0):
    return [step(model.feeds(start + i))[0] for i in range(STEPS)]


@pytest.mark.parametrize("mesh,layout", [("data:1", ""), DP_TP], ids=["dense", "dp+tp"])
def test_bf16_gradients_are_the_fp32_gradients_rounded(model, mesh, layout):
    grads = {}
    for prec in ("fp32", "bf16"):
        loss = mixed_precision(model.loss, prec)
        outs = {"loss": loss, **md.grad(loss, model.params)}
        grads[prec] = md.run_simulated(md.compile(outs, mesh, layout), model.feeds(0))
    for k in model.params:
        want, got = grads["fp32"][k], grads["bf16"][k]
        assert got.dtype == torch.float32, k
        assert 0 < (got - want).norm() <= GRAD_REL * want.norm(), (k, ((got - want).norm() / want.norm()).item())


# dp+tp's curve runs with -m slow: its bf16 gradients are test_bf16_gradients_are_the_fp32_gradients_rounded's,
# and the fp32 master state on several ranks is test_bf16_other_models_and_a_pipeline's.
@pytest.mark.parametrize("mesh,layout", [("data:1", ""), pytest.param(*DP_TP, marks=pytest.mark.slow)],
                         ids=["dense", "dp+tp"])
def test_bf16_curve_follows_fp32(model, mesh, layout):
    rels = []
    for start in WINDOWS:
        want = torch.tensor(_curve(_step(model, mesh, layout), model, start))
        step = _step(model, mesh, layout, "bf16")
        got = torch.tensor(_curve(step, model, start))
        rel = (got - want).abs() / want.abs()
        assert rel[0] <= FIRST_REL, (start, rel[0])
        assert rel.mean() <= MEAN_REL, (start, rel)
        assert rel.max() > 0  # bf16 really computed something in bf16
        rels.append(rel)
    median = torch.stack(rels).median(0).values
    assert median.max() <= STEP_REL, median
    # master weights and optimizer state stay fp32 (every rank's slice)
    for k in step.carried:
        assert all(x.dtype == torch.float32 for x in step.params[k] if x is not None), k
    assert any(k.startswith("opt/") for k in step.carried)


@pytest.mark.parametrize("name,mesh,layout,mb", [("mlp", "data:2", "batch:data", 1),
                                                   ("moe", "data:2", "batch:data", 1),
                                                   ("transformer", "stage:2", "layer:stage", 2)],
                         ids=["mlp-dp", "moe-dp", "transformer-pipeline"])
def test_bf16_other_models_and_a_pipeline(name, mesh, layout, mb):
    # no repeat (mlp), routing with top_k (moe), a repeat cut into pipeline stages with
    # micro-batches: the first loss (same params) differs by forward rounding only
    m = load_model(name, tiny=True)
    first = {}
    for prec in ("fp32", "bf16"):
        step = md.TrainStep(m.loss, m.params, mesh, layout, md.SimulatedComm(md.Mesh.parse(mesh)),
                            optimizer=_opt(), precision=prec, microbatches=mb, schedule="1f1b")
        first[prec] = step(m.feeds(0))[0]
        assert all(x.dtype == torch.float32 for k in step.carried for x in step.params[k] if x is not None)
    assert first["bf16"] == pytest.approx(first["fp32"], rel=FIRST_REL)
    assert first["bf16"] != first["fp32"]


def _collectives(plan):
    """Every collective step, sub-plans included, with the plan whose values it reads."""
    out = []
    for s in plan.steps:
        for sub in s.subplans:
            out += _collectives(sub)
        if s.is_collective:
            out.append((s, plan))
    return out


def _values(plan):
    vals = list(plan.values.values())
    for s in plan.steps:
        for sub in s.subplans:
            vals += _values(sub)
    return vals


def test_bf16_plan_has_bf16_activations_and_fp32_gradient_sums(model):
    # bucket_mb=0: one reduction per gradient, so each one's dtype and bytes can be read
    fp32 = _step(model, *DP_TP, bucket_mb=0).plan
    bf16 = _step(model, *DP_TP, "bf16", bucket_mb=0).plan
    assert torch.bfloat16 in {v.dtype for v in _values(bf16)}
    assert torch.bfloat16 not in {v.dtype for v in _values(fp32)}

    def tp_reduces(plan):
        return [(s, p) for s, p in _collectives(plan) if s.kind == "allreduce" and s.axes == ("model",)
                and s.phase == "forward"]

    # the Megatron allreduce of each block's attention and MLP output: bf16, half the bytes
    tp32, tp16 = tp_reduces(fp32), tp_reduces(bf16)
    assert len(tp16) == len(tp32) == 2
    assert [s.bytes for s, _ in tp16] == [s.bytes // 2 for s, _ in tp32]
    assert all(p.values[s.ins[0]].dtype == torch.bfloat16 for s, p in tp16)
    # every gradient reduction (the update phase: gradients over data, their norm) sums fp32,
    # with the fp32 plan's bytes
    grads32 = [s for s, _ in _collectives(fp32) if s.phase == "update"]
    grads16 = [(s, p) for s, p in _collectives(bf16) if s.phase == "update"]
    assert len(grads16) == len(grads32) > 10
    assert all(p.values[s.ins[0]].dtype == torch.float32 for s, p in grads16)
    assert sorted(s.bytes for s, _ in grads16) == sorted(s.bytes for s in grads32)


def test_bf16_zero2_reduce_scatters_fp32_gradients(model):
    plan = md.TrainStep(model.loss, model.params, *ZERO2, md.SimulatedComm(md.Mesh.parse("data:2")),
                        optimizer=_opt(), precision="bf16", bucket_mb=0).plan
    scatter = [(s, p) for s, p in _collectives(plan) if s.kind == "reduce_scatter"]
    assert scatter and all(p.values[s.ins[0]].dtype == torch.float32 for s, p in scatter)


def test_every_op_has_a_precision_rule():
    missing = sorted(set(OPS) - set(POLICY))
    assert not missing, f"ops without a rule in meshdsl/ops/precision.py: {missing}"
    assert set(POLICY.values()) <= {"bf16", "fp32", "follow", "none"}


def test_fp32_is_the_default_and_untouched(model):
    assert mixed_precision(model.loss, "fp32") is model.loss
    default = _step(model, *DP_TP)
    explicit = _step(model, *DP_TP, "fp32")
    assert default.precision == "fp32"
    assert default.plan.signature() == explicit.plan.signature()
    assert _curve(default, model)[:3] == _curve(explicit, model)[:3]


def test_bf16_rebuild_is_cached(model):
    a = mixed_precision(model.loss, "bf16")
    n = len(model.loss.graph.nodes)
    assert mixed_precision(model.loss, "bf16") is a and len(model.loss.graph.nodes) == n
    assert a.dtype == torch.float32 and len(a.shape) == 0


def test_unknown_precision_lists_the_choices(model):
    with pytest.raises(md.GraphError, match="precision='fp16'.*\n.*fp32, bf16"):
        _step(model, "data:1", "", "fp16")
    with pytest.raises(md.GraphError, match="known: fp32, bf16"):
        mixed_precision(model.loss, "half")


def _cli(capsys, *argv):
    from meshdsl.tools import cli
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:  # argparse's choice errors exit from the parser
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_plan_and_run_take_precision(capsys):
    import json
    args = ["transformer", "--tiny", "--mesh", DP_TP[0], "--layout", DP_TP[1], "--optimizer", "adamw"]
    reports = {}
    for prec in ("fp32", "bf16"):
        rc, out, err = _cli(capsys, "plan", *args, "--json", "--precision", prec)
        assert rc == 0, err
        reports[prec] = json.loads(out)["totals"]["allreduce"]["bytes"]
    # the report is the plan's: bf16 shrinks the tensor-parallel activation allreduces (pinned above)
    fp32_plan, bf16_plan = _step(build(Config.tiny()), *DP_TP).plan, _step(build(Config.tiny()), *DP_TP, "bf16").plan
    assert reports["fp32"] == fp32_plan.totals()["allreduce"]["bytes"]
    assert reports["bf16"] == bf16_plan.totals()["allreduce"]["bytes"] < reports["fp32"]
    rc, out, err = _cli(capsys, "run", "transformer", "--tiny", "--mesh", "data:2", "--layout", "batch:data",
                        "--optimizer", "adamw", "--steps", "2", "--warmup", "0", "--precision", "bf16")
    assert rc == 0, err
    assert "loss" in out


def test_cli_check_refuses_bf16_and_unknown_precision(capsys):
    rc, out, err = _cli(capsys, "check", "transformer", "--tiny", "--mesh", "data:2", "--layout", "batch:data",
                        "--precision", "bf16")
    assert rc == 2 and "fp32 dense program" in err
    rc, out, err = _cli(capsys, "plan", "transformer", "--tiny", "--mesh", "data:2", "--precision", "fp16")
    assert rc == 2 and "'fp32', 'bf16'" in err
