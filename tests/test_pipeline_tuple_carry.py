"""Pipelining a repeat whose layers carry a tuple: each stage hands every carried tensor on.

Two stacks (tests/lstm_layer_stack.py: an LSTM-style cell per layer carrying ``(h, c)``
[batch, hidden] each; tests/two_track_stack.py: an MSA track [batch, res, c_m] and a pair
track [batch, res, res_j, c_z] that read each other every layer) pipelined over ``layer``.
Each stage boundary sends each carried tensor forward and its gradient back, one transfer per
tensor per micro-batch, each with its own tag (no packing: the tensors have their own shapes,
dtypes and layouts, and a packed buffer would cost a copy on each side for nothing the
communicator lacks).  The oracle is the dense program: the loss and every gradient, and AdamW
steps.  Covered: 1f1b, gpipe, zbh1, interleaved:2, unequal and balanced stages, data and
tensor splits of the carried tensors' own dims beside the stages, one tensor carried twice (and
one gradient read for two carried tensors), a tuple-carrying stack beside another on virtual
stages, and one gloo run.
"""
from __future__ import annotations

import os

import pytest
import torch

import meshdsl as md
from meshdsl.lowering.partition import program_of
from meshdsl.lowering.pipeline_program import Segment
from meshdsl.search.calibrate import Calibration
from meshdsl.search.stage_balance import balance_stages
from meshdsl.train.step import training_outputs

from conftest import adamw_dense_curve, run_cli

HERE = os.path.dirname(__file__)
LSTM, TRACKS = os.path.join(HERE, "lstm_layer_stack.py"), os.path.join(HERE, "two_track_stack.py")


def _case(path: str, **over):
    """The tiny model's loss and every param's gradient, its feeds, and the dense program's values."""
    model = md.load_model(path, tiny=True, **over)
    outs = {"loss": model.loss, **{f"d/{k}": g for k, g in md.grad(model.loss, model.params).items()}}
    params = md.DenseProgram(outs).init_params(0)
    feeds = model.feeds(0)
    return outs, feeds, params, md.run_dense(outs, feeds, params)


def _assert_matches_dense(path: str, mesh: str, layout: str, over=None, **kw):
    outs, feeds, params, want = _case(path, **(over or {}))
    plan = md.compile(outs, mesh, layout, microbatches=2, **kw)
    got = md.run_simulated(plan, feeds, params)
    for k in want:
        # fp32, values O(1): the same kernels, the batch summed over micro-batches (and data ranks)
        # in another order: rounding only; a lost carried tensor or gradient is O(1e-1)
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    return plan


def _carry_sends(plan, seg: Segment) -> list:
    """The carry sends of ``seg`` of the plan's pipeline, as (tag, bytes, stages)."""
    step = next(s for s in plan.steps if s.kind == "pipeline")
    prog = program_of(step)
    return [(t.tag, prog.segments[seg].steps[t.position].bytes, t.stages) for t in prog.transfers
            if t.carry and t.kind == "send" and t.segment == seg]


@pytest.mark.parametrize("path", [LSTM, TRACKS], ids=["lstm", "tracks"])
def test_a_tuple_carry_pipelines_under_1f1b(path):
    """Loss and every gradient as dense; each boundary sends each carried tensor (its own tag and
    bytes) forward and each one's gradient back, once per micro-batch."""
    plan = _assert_matches_dense(path, "stage:2", "layer:stage", schedule="1f1b")
    fwd, bwd = _carry_sends(plan, Segment.FORWARD), _carry_sends(plan, Segment.BACKWARD)
    # two carried tensors, one boundary (stage 0 -> 1 forward, 1 -> 0 backward): two sends each way,
    # each run once per micro-batch by the segment (sub_times)
    assert [st for _, _, st in fwd] == [(0,), (0,)] and [st for _, _, st in bwd] == [(1,), (1,)]
    assert len({t for t, _, _ in fwd + bwd}) == 4
    tiny = md.load_model(path, tiny=True).config
    if path == LSTM:   # h and c: [batch / 2 micro-batches, hidden] fp32 each
        assert [b for _, b, _ in fwd] == [tiny.batch // 2 * tiny.hidden * 4] * 2
    else:              # the MSA and the pair track: their own sizes
        per_mb = tiny.batch // 2
        assert [b for _, b, _ in fwd] == [per_mb * tiny.res * tiny.c_m * 4, per_mb * tiny.res ** 2 * tiny.c_z * 4]
    step = next(s for s in plan.steps if s.kind == "pipeline")
    assert step.sub_times == (1, 2, 2, 1)


@pytest.mark.slow
@pytest.mark.parametrize("path", [LSTM, TRACKS], ids=["lstm", "tracks"])
@pytest.mark.parametrize("mesh,layout,kw", [
    ("stage:2", "layer:stage", {"schedule": "gpipe"}),
    ("stage:2", "layer:stage", {"schedule": "zbh1"}),
    ("stage:2", "layer:stage", {"schedule": "interleaved:2"}),
    ("stage:2", "layer:stage", {"schedule": "1f1b", "stage_layers": (1, 3)}),
    ("stage:2", "layer:stage", {"schedule": "interleaved:2", "stage_layers": (2, 1, 1, 1), "over": {"layers": 5}}),
    ("stage:4", "layer:stage", {"schedule": "1f1b"}),
    ("stage:2; data:2", "layer:stage; batch:data", {"schedule": "1f1b"}),
], ids=["gpipe", "zbh1", "interleaved", "uneven", "interleaved-given", "four-stages", "data"])
def test_a_tuple_carry_pipelines_under_every_schedule(path, mesh, layout, kw):
    plan = _assert_matches_dense(path, mesh, layout, **kw)
    fwd = _carry_sends(plan, Segment.FORWARD)
    ranks = mesh.split(";")[0].split(":")[1]
    chunks = 2 if "interleaved" in kw["schedule"] else 1
    # one send per carried tensor per boundary between (virtual) stages
    assert sum(len(st) for _, _, st in fwd) == 2 * (int(ranks) * chunks - 1)


@pytest.mark.slow
@pytest.mark.parametrize("path,layout", [(LSTM, "layer:stage; hidden:model"), (TRACKS, "layer:stage; c_z:model")],
                         ids=["lstm", "tracks"])
def test_a_tuple_carry_pipelines_beside_a_split_of_its_own_dims(path, layout):
    """``hidden:model`` splits h and c (``c_z:model`` the pair track): each stage sends its shard."""
    plan = _assert_matches_dense(path, "stage:2; model:2", layout, schedule="1f1b")
    full = _carry_sends(_assert_matches_dense(path, "stage:2", "layer:stage", schedule="1f1b"), Segment.FORWARD)
    split = _carry_sends(plan, Segment.FORWARD)
    assert sum(b for _, b, _ in split) < sum(b for _, b, _ in full)


def _one_tensor_twice(two_stacks: bool):
    """A stack carrying ``(e, e)`` (one tensor twice) read after it as ``a + b``, whose gradient is
    one tensor for both carried tensors; ``two_stacks``: ``a + b`` starts a second stack over
    ``enc_layer`` (both on the stage axis)."""
    B, D, L, LE = md.Dim("batch", 4), md.Dim("d", 3), md.Dim("layer", 4), md.Dim("enc_layer", 4)
    with md.Graph("twice"):
        x, w, we = md.input("x", [B, D]), md.param("w", [L, D]), md.param("we", [LE, D])

        def block(ab, p):
            a, b = ab
            a = md.tanh(a * p["w"] + 0.3 * b)
            return a, 0.9 * b + a
        e = md.tanh(x)
        a, b = md.repeat(block, (e, e), {"w": w}, "layer")
        h = md.repeat(lambda h, p: md.tanh(h * p["we"]) + h, a + b, {"we": we}, "enc_layer") if two_stacks else a + b
        loss = md.reduce_sum(md.tanh(h))
        grads = md.grad(loss, {"x": x, "w": w, **({"we": we} if two_stacks else {})})
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 3, generator=gen), "we": torch.randn(4, 3, generator=gen) * 0.5}
    return ({"loss": loss, **{f"d/{k}": g for k, g in grads.items()}}, {"x": torch.randn(4, 3, generator=gen)},
            params if two_stacks else {"w": params["w"]})


@pytest.mark.parametrize("two_stacks,schedule", [
    (False, "1f1b"),
    pytest.param(False, "interleaved:2", marks=pytest.mark.slow),
    pytest.param(True, "interleaved:2", marks=pytest.mark.slow),
], ids=["1f1b", "interleaved", "two-stacks-interleaved"])
def test_one_tensor_carried_twice_and_one_gradient_for_both(two_stacks, schedule):
    """Each carried tensor is received into a value of its own, even where the tuple holds one tensor
    twice or the backward reads one gradient for both (both were received into one buffer, the
    second overwriting the first: a wrong gradient of x and w)."""
    outs, feeds, params = _one_tensor_twice(two_stacks)
    want = md.run_dense(outs, feeds, params)
    layout = "layer:stage; enc_layer:stage" if two_stacks else "layer:stage"
    got = md.run_simulated(md.compile(outs, "stage:2", layout, microbatches=2, schedule=schedule), feeds, params)
    for k in want:
        # fp32, values O(1), micro-batch sums in another order: rounding only
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.slow
def test_balanced_stages_of_a_tuple_carry():
    model = md.load_model(LSTM, tiny=True)
    outs = training_outputs(model.loss, model.params, 0.1, with_grads=True)
    counts = balance_stages(outs, "stage:2", "layer:stage", microbatches=2, schedule="1f1b",
                            cal=Calibration.defaults())
    assert sum(counts) == model.config.layers
    _assert_matches_dense(LSTM, "stage:2", "layer:stage", schedule="1f1b", stage_layers=counts)


@pytest.mark.slow
@pytest.mark.parametrize("path", [LSTM, TRACKS], ids=["lstm", "tracks"])
@pytest.mark.parametrize("mesh,layout,schedule", [
    ("stage:2", "layer:stage", "1f1b"),
    ("stage:2", "layer:stage", "interleaved:2"),
    ("stage:2; data:2", "layer:stage; batch:data", "zbh1"),
], ids=["1f1b", "interleaved", "zbh1-data"])
def test_adamw_steps_track_dense(path, mesh, layout, schedule):
    """Three AdamW steps (clipped at 1) through the pipeline, 2 micro-batches, give the dense program's
    losses (:func:`conftest.assert_adamw_steps_track_dense`, pipelined)."""
    model = md.load_model(path, tiny=True)
    opt = md.AdamW(lr=0.01, weight_decay=0.1)
    want, _ = adamw_dense_curve(model, opt, 1.0, 3)
    step = md.TrainStep(model.loss, model.params, mesh, layout, md.SimulatedComm(md.Mesh.parse(mesh)),
                        optimizer=opt, clip_norm=1.0, microbatches=2, schedule=schedule)
    got = [step(model.feeds(i), lr=0.01)[0] for i in range(3)]
    # fp32 sums in another order over a few steps: ~1e-6 relative; a wrong update is O(1e-2)
    assert got == pytest.approx(want, rel=1e-5), (got, want)
    assert want[0] != pytest.approx(want[-1], rel=1e-4)     # the steps moved the model


@pytest.mark.slow
def test_a_tuple_carry_pipeline_on_two_gloo_processes(capsys):
    """``meshdsl check --nproc 2``: the stages' sends of h and c (and their gradients) on gloo."""
    code, out, err = run_cli(capsys, ["check", LSTM, "--tiny", "--nproc", "2", "--mesh", "stage:2", "--layout",
                                      "layer:stage", "--microbatches", "2", "--schedule", "1f1b"])
    assert code == 0 and "OK:" in out, out + err
