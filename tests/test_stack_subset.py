"""A pipelined stack on some of the stages: an encoder-decoder on ``stage:3`` cut so that a stack
runs on two of the three stages (issue 35, item 5).

``layer:stage; enc_layer:stage`` with ``stage_layers`` over the stacks' joined layers (encoder
first) may put a stack on one stage, on some or on all.  A stack on some stages stores its
layer-split values at its per-stage counts, with an empty part on the stages outside its run:
its params, gradients and optimizer state are held there empty, so gathers (outputs, checks)
and checkpoints run over the whole stage axis (lowering/partition.py ``_everywhere``,
``_holders``).  Each case matches the dense program: forward and gradients, an AdamW step, a
checkpoint that a dense run loads, and one case on three gloo processes.
"""
from __future__ import annotations

import pathlib

import pytest
import torch

import meshdsl as md
from meshdsl.errors import LayoutError
from meshdsl.processes import launcher as launch

import t5_tiny as t5
from conftest import assert_matches_scaled, held_outputs_on_this_rank, assert_ranks_match_dense

BART = str(pathlib.Path(__file__).parent / "heldout_bart.py")
BOTH = "layer:stage; enc_layer:stage"
# fp32 with O(1) values: only rounding differs. The stages and the micro-batches add the layers'
# and the batch's parts in another order than the dense program (n * 2**-24 of the magnitudes
# for n terms), far below 1e-5. A lost stage's part, a doubled one or a layer on the wrong stage
# is off by O(1).
REL = 1e-5


def _bart(layers=3):
    """The held-out BART with ``layers`` encoder and as many decoder layers (3 + 3 joined: 2,2,2
    puts each stack on two of three stages; 2 + 2: fewer layers per stack than stages), a batch
    of 6 for 3 micro-batches."""
    return md.load_model(BART, tiny=True, enc_layer="enc_layer", layers=layers, batch=6)


def _with_grads(m):
    return {"loss": m.loss, **{f"grad/{k}": g for k, g in md.grad(m.loss, m.params).items()}}


def _model(layers):
    m = _bart(layers)
    outs = _with_grads(m)
    return m, outs, md.run_dense(outs, m.feeds(0))


@pytest.fixture(scope="module")
def bart():
    return _model(3)


@pytest.fixture(scope="module")
def bart2():
    return _model(2)


@pytest.mark.parametrize("model, mesh, layout, counts, schedule", [
    ("bart", "stage:3", BOTH, (2, 2, 2), "1f1b"),    # encoder on 0..1, decoder on 1..2
    # 2 + 2 layers on 3 stages: each stack splits its 2 layers over 3 stages, one empty part at least
    ("bart2", "stage:3", BOTH, (1, 2, 1), "1f1b"),   # encoder on 0..1, decoder on 1..2
    ("bart2", "stage:3", BOTH, (2, 1, 1), "zbh1"),   # encoder on 0 alone, decoder on 1..2
    ("bart2", "stage:3; data:2", BOTH + "; batch:data", (1, 1, 2), "gpipe"),   # encoder 0..1, decoder on 2
])
def test_bart_with_a_stack_on_some_stages_matches_dense(request, model, mesh, layout, counts, schedule):
    m, outs, want = request.getfixturevalue(model)
    plan = md.compile(outs, mesh, layout, microbatches=3, schedule=schedule, stage_layers=counts)
    assert_matches_scaled(md.run_simulated(plan, m.feeds(0)), want, f"{mesh} {counts} {schedule}", REL)


def test_the_values_of_a_stack_on_some_stages_are_held_on_every_stage_empty_outside_its_run(bart):
    m, outs, _ = bart
    plan = md.compile(outs, "stage:3", BOTH, microbatches=3, schedule="1f1b", stage_layers=(2, 2, 2))
    stages = lambda vid: {plan.mesh.coords(r)["stage"] for r in plan.holders[vid]}   # noqa: E731
    for name, layer, parts in (("enc_wq", "enc_layer", (2, 1, 0)), ("dec_self_wq", "layer", (0, 1, 2))):
        for vid in (plan.params[name], plan.outputs[f"grad/{name}"]):
            assert plan.values[vid].sharding.given_parts[layer] == parts, name
            assert stages(vid) == {0, 1, 2}, name
    assert "stack 'enc_layer' on 'stage': stage 0 layers 0..1, stage 1 layer 2" in plan.notes
    assert "stack 'layer' on 'stage': stage 1 layer 0, stage 2 layers 1..2" in plan.notes


def test_a_shared_param_read_by_a_stack_on_some_stages_and_the_gradient_norm():
    """t5's decoder reads a shared gate (not stacked): its gradient, each stage's sum over its own
    layers, is summed over every stage (zero outside the decoder's run); a global gradient norm
    counts each stage's part of each stack once."""
    cfg = t5.Config(batch=6)   # 2 encoder layers, 4 decoder layers
    outs, _ = t5.build(cfg)
    grads = [g for k, g in outs.items() if k.startswith("grad/")]
    norm2 = md.reduce_sum(grads[0] * grads[0])
    for g in grads[1:]:
        norm2 = norm2 + md.reduce_sum(g * g)
    outs = {**outs, "norm2": norm2}
    feeds = t5.feeds(cfg)
    want = md.run_dense(outs, feeds)
    # the encoder on 0..1, the decoder on 1..2
    plan = md.compile(outs, "stage:3", BOTH, microbatches=3, schedule="1f1b", stage_layers=(1, 2, 3))
    assert_matches_scaled(md.run_simulated(plan, feeds), want, "t5 1,2,3", REL)


def test_per_layer_outputs_of_a_stack_on_some_stages():
    """A decoder whose layers return a per-layer auxiliary term (MoE-style), summed into the loss:
    the stages outside the decoder's run hold an empty part of it, and the sum over the layers
    adds each stage's own part once."""
    b, d, le, ld = md.Dim("batch", 6), md.Dim("d_model", 4), md.Dim("enc_layer", 3), md.Dim("layer", 3)
    with md.Graph("aux_terms"):
        x, we, wd = md.input("x", [b, d]), md.param("we", [le, d]), md.param("wd", [ld, d])
        enc = md.repeat(lambda h, p: md.tanh(h * p["w"]), x, {"w": we}, "enc_layer")

        def block(h, p):
            h = md.tanh(h * p["w"] + enc)
            return h, {"aux": md.reduce_sum(h * h)}
        y, ys = md.repeat(block, x, {"w": wd}, "layer")
        loss = md.reduce_sum(y) + 0.1 * md.reduce_sum(ys["aux"])
        outs = {"loss": loss, **md.grad(loss, {"we": we, "wd": wd})}
    feeds = {"x": torch.randn(6, 4, generator=torch.Generator().manual_seed(1))}
    want = md.run_dense(outs, feeds)
    for counts in ((2, 2, 2), (2, 3, 1)):   # the decoder on stages 1..2 (its first layer with the encoder's last)
        plan = md.compile(outs, "stage:3", BOTH, microbatches=3, schedule="1f1b", stage_layers=counts)
        assert_matches_scaled(md.run_simulated(plan, feeds), want, f"{counts}", REL)


def _step(m, mesh, layout, **kw):
    from meshdsl.comm.simulated import SimulatedComm
    mesh = md.Mesh.parse(mesh) if mesh else md.Mesh(())
    return md.TrainStep(m.loss, m.params, mesh, layout, SimulatedComm(mesh), optimizer=md.AdamW(lr=0.01), **kw)


def _full(step, k):
    return step.executor.to_full_held(step.plan.params[k], step.params[k])


def test_adamw_steps_and_a_checkpoint_that_loads_dense(tmp_path, one_torch_thread):
    """Two AdamW steps with each stack on two of three stages give the dense params; each stage
    writes its layers of both stacks (and their optimizer state; none on the stages outside a
    stack's run); a dense step, and a pipeline of another cut, load them in global layer order
    and take the next step."""
    from meshdsl.train.checkpoint import load_checkpoint, save_checkpoint

    m = _bart()
    pipe = _step(m, "stage:3", BOTH, microbatches=3, schedule="1f1b", stage_layers=(2, 2, 2))
    dense = _step(m, "", None)
    for t in range(2):
        assert pipe(m.feeds(t))[0] == pytest.approx(dense(m.feeds(t))[0], rel=REL)
    for k in m.params:
        assert_matches_scaled({k: _full(pipe, k)}, {k: _full(dense, k)}, "after 2 AdamW steps", REL)
    path = save_checkpoint(tmp_path, 2, pipe.state(), pipe.executor.comm)
    loaded = _step(m, "", None)
    state = loaded.state()
    loaded.load_state(load_checkpoint(path, {k: spec for k, (spec, _) in state.items()}, loaded.plan.mesh,
                                      loaded.executor.comm.ranks))
    assert loaded.step_count == 2
    for k in pipe.carried:
        held = pipe.executor.to_full_held(pipe.plan.params[k], pipe.params[k])
        assert torch.equal(loaded.executor.to_full_held(loaded.plan.params[k], loaded.params[k]), held), k
    # and a pipeline of another cut (the decoder on 1..2 from 3..1) loads it at its own parts
    other = _step(m, "stage:3", BOTH, microbatches=3, schedule="1f1b", stage_layers=(1, 4, 1))
    state = other.state()
    other.load_state(load_checkpoint(path, {k: spec for k, (spec, _) in state.items()}, other.plan.mesh,
                                     other.executor.comm.ranks))
    for k in pipe.carried:
        held = pipe.executor.to_full_held(pipe.plan.params[k], pipe.params[k])
        assert torch.equal(other.executor.to_full_held(other.plan.params[k], other.params[k]), held), k
    want = pipe(m.feeds(2))[0]
    assert loaded(m.feeds(2))[0] == pytest.approx(want, rel=REL)
    assert other(m.feeds(2))[0] == pytest.approx(want, rel=REL)


def _on_three_processes(comm):
    m = _bart(2)
    outs = _with_grads(m)
    plan = md.compile(outs, "stage:3", BOTH, microbatches=3, schedule="1f1b", stage_layers=(1, 2, 1))
    return held_outputs_on_this_rank(comm, plan, m.feeds(0))


@pytest.mark.timeout(200)
def test_a_stack_on_some_stages_on_three_gloo_processes(bart2):
    _, _, want = bart2
    results = launch.spawn(_on_three_processes, 3, mesh="stage:3", timeout=180)
    assert_ranks_match_dense(results, want, REL)


def test_one_stack_of_fewer_layers_than_stages_is_still_refused():
    """Only stacks sharing a stage axis may leave a stage none of their layers: one pipelined repeat
    of 2 layers on 3 stages would leave a stage with nothing to run."""
    b, d, ld = md.Dim("batch", 6), md.Dim("d_model", 4), md.Dim("layer", 2)
    with md.Graph("one_small"):
        x, w = md.input("x", [b, d]), md.param("w", [ld, d])
        loss = md.reduce_sum(md.repeat(lambda h, p: md.tanh(h * p["w"]), x, {"w": w}, "layer"))
    with pytest.raises(LayoutError, match=r"(?s)dim 'layer' of size 2 is not divisible by mesh axes stage:3.*"
                                          r"too small to split unevenly"):
        md.compile(loss, "stage:3", "layer:stage", microbatches=3)
