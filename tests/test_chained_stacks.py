"""Chained stacks on one stage axis: a second ``md.repeat`` whose first carry is made from the
first one's output, through ops outside any block (tests/heldout_chain.py: a pooling and a
projection; tests/heldout_electra.py: the generator's argmax replacing the masked ids, no
gradient through it; tests/heldout_mae.py: the encoder's kept patches among mask tokens), with ``layer:stage; enc_layer:stage`` pipelining both.

The stages cut the joined list of layers; the ops between the stacks (per micro-batch) and their
gradients run on the stage holding the first stack's last layer; the second stack's first carry
goes up from there to its first stage, its input gradient comes back down and is added to the
gradient the first stack's output gets from its own loss term (lowering/partition.py
``_meet``, ``_moves_into``).  Every output matches the dense program: the boundary between
the stacks inside a stage and at a stage boundary, gpipe/1f1b/zbh1 and interleaved:2,
``stage:2``, ``stage:3`` and ``stage:2; data:2``, AdamW steps, one case on two gloo processes.
"""
from __future__ import annotations

import pathlib

import pytest
import torch

import meshdsl as md
from meshdsl.processes import launcher as launch

from conftest import (assert_heldout_case_matches_dense, assert_matches_scaled, assert_ranks_match_dense,
                      held_outputs_on_this_rank, heldout_outputs, pipeline_steps_by_segment, run_cli)

HERE = pathlib.Path(__file__).parent
CHAIN, ELECTRA = str(HERE / "heldout_chain.py"), str(HERE / "heldout_electra.py")
BOTH = "layer:stage; enc_layer:stage"
# fp32 with O(1) values: the stages and micro-batches add the same terms in another order
# (n * 2**-24 of the magnitudes), far below 1e-5; a lost transfer or a gradient on the wrong
# stage is off by O(1)
REL = 1e-5


@pytest.mark.parametrize("mesh, layout, kw", [
    ("stage:2", BOTH, {"schedule": "gpipe"}),                                   # 2|2: the boundary between stages
    ("stage:2", BOTH, {"schedule": "1f1b", "stage_layers": (1, 3)}),            # the boundary inside stage 1
    ("stage:2", BOTH, {"schedule": "zbh1", "stage_layers": (3, 1), "microbatches": 4}),   # inside stage 0
    ("stage:3", BOTH, {"schedule": "1f1b", "stage_layers": (1, 2, 1)}),         # each stack on two of three
    ("stage:2; data:2", BOTH + "; batch:data", {"schedule": "1f1b"}),
    ("stage:2", BOTH, {"schedule": "interleaved:2", "microbatches": 4}),        # one layer per virtual stage
], ids=lambda c: str(c))
def test_chained_stacks_match_dense(mesh, layout, kw):
    assert_heldout_case_matches_dense((CHAIN, {}, mesh, layout, {"microbatches": 2, **kw}))


@pytest.mark.parametrize("mesh, layout, kw", [
    ("stage:2", "layer:stage; gen_layer:stage", {"schedule": "1f1b"}),          # generator on 0, discriminator on 1
    ("stage:2; data:2", "layer:stage; gen_layer:stage; batch:data", {"schedule": "zbh1", "stage_layers": (3, 1)}),
    ("stage:2", "layer:stage; gen_layer:stage", {"schedule": "interleaved:2", "microbatches": 4}),
], ids=lambda c: str(c))
def test_electra_pipelines_its_generator_and_discriminator(mesh, layout, kw):
    """No gradient flows through the argmax: the generator's backward gets its gradient from its
    own MLM loss only, the discriminator's input gradient reaches the shared embedding alone."""
    assert_heldout_case_matches_dense((ELECTRA, {}, mesh, layout, {"microbatches": 2, **kw}))


@pytest.mark.parametrize("mesh, stage_layers", [("stage:2", (3, 1)), ("stage:3", (1, 2, 1))])
def test_a_dense_stack_then_one_with_a_per_layer_loss(mesh, stage_layers):
    """A "dense" stack, then (through a tanh) a stack whose blocks also return a per-layer term the
    loss sums over its layers (an MoE stack's balance loss), on the stages of its cut."""
    b, d = md.Dim("batch", 4), md.Dim("d_model", 4)
    le, ld = md.Dim("enc_layer", 2), md.Dim("layer", 2)
    with md.Graph("dense_then_aux"):
        x, we, wd = md.input("x", [b, d]), md.param("we", [le, d]), md.param("wd", [ld, d])
        h = md.repeat(lambda c, p: md.tanh(c * p["w"]) + c, x, {"w": we}, "enc_layer")
        y, per = md.repeat(lambda c, p: (md.tanh(c * p["w"]) + c, {"aux": md.reduce_sum(c * c)}), md.tanh(h),
                           {"w": wd}, "layer")
        loss = md.reduce_sum(y * y) + 0.1 * md.reduce_sum(per["aux"])
    outs = {"loss": loss, **md.grad(loss, {"we": we, "wd": wd})}
    feeds = {"x": torch.randn(4, 4, generator=torch.Generator().manual_seed(0))}
    plan = md.compile(outs, mesh, BOTH, microbatches=2, schedule="1f1b", stage_layers=stage_layers)
    assert_matches_scaled(md.run_simulated(plan, feeds), md.run_dense(outs, feeds), f"{mesh} {stage_layers}", REL)


def test_a_masked_autoencoder_pipelines_its_encoder_and_decoder():
    """tests/heldout_mae.py: the encoder's output over the kept patches, scattered back among mask
    tokens (ops between the stacks), starts the decoder stack."""
    assert_heldout_case_matches_dense((str(HERE / "heldout_mae.py"), {}, "stage:2", "layer:stage; dec_layer:stage",
                                       {"microbatches": 2, "schedule": "1f1b"}))


def test_the_ops_between_the_stacks_run_on_the_first_stacks_last_stage():
    m = md.load_model(CHAIN, tiny=True)
    plan = md.compile(heldout_outputs(m), "stage:2", BOTH, microbatches=2, schedule="1f1b")
    seg, proj = pipeline_steps_by_segment(plan), plan.params["proj"]
    # the projection between the stacks and both its gradients (input and param) on stage 0
    assert [st for s, st in seg[1] if proj in s.ins] == [(0,)]
    assert [st for s, st in seg[2] if proj in s.ins or s.op == "einsum"] == [(0,), (0,)]
    # the second stack's first carry goes up 0 -> 1 per micro-batch, its input gradient comes down 1 -> 0
    assert [(s.kind, st) for s, st in seg[1] if "its first carry to stage 1" in s.label] == [("send", (0,)),
                                                                                            ("recv", (1,))]
    down = [(s.kind, st) for s, st in seg[2] if s.kind in ("send", "recv")]
    assert down == [("send", (1,)), ("recv", (0,))]


def _step(m, mesh, layout, **kw):
    from meshdsl.comm.simulated import SimulatedComm
    mesh = md.Mesh.parse(mesh) if mesh else md.Mesh(())
    return md.TrainStep(m.loss, m.params, mesh, layout, SimulatedComm(mesh), optimizer=md.AdamW(lr=0.01), **kw)


def test_adamw_steps_on_chained_stacks_give_the_dense_params(one_torch_thread):
    m = md.load_model(CHAIN, tiny=True)
    pipe = _step(m, "stage:2", BOTH, microbatches=2, schedule="1f1b")
    dense = _step(m, "", None)
    for t in range(2):
        assert pipe(m.feeds(t))[0] == pytest.approx(dense(m.feeds(t))[0], rel=REL)
    for k in m.params:
        full = {k: pipe.executor.to_full_held(pipe.plan.params[k], pipe.params[k])}
        assert_matches_scaled(full, {k: dense.executor.to_full_held(dense.plan.params[k], dense.params[k])},
                              "after 2 AdamW steps", REL)


@pytest.mark.parametrize("path, layout", [(CHAIN, BOTH), (ELECTRA, "layer:stage; gen_layer:stage")],
                         ids=["chain", "electra"])
def test_clipped_adamw_steps_on_chained_stacks_give_the_dense_loss(path, layout, one_torch_thread):
    """A clipped gradient norm (its parts summed over the stages after the micro-batches) and ELECTRA's
    shared embedding (two gradients added once, after the micro-batches): both crashed (a value missing
    on a stage) when the steps between the stacks' ends were met per micro-batch (partition ``_meet``)."""
    m = md.load_model(path, tiny=True)
    pipe = _step(m, "stage:2", layout, microbatches=2, schedule="1f1b", clip_norm=0.5)
    dense = _step(m, "", None, clip_norm=0.5)
    for t in range(2):
        assert pipe(m.feeds(t))[0] == pytest.approx(dense(m.feeds(t))[0], rel=REL)


def test_cli_checks_chained_stacks_and_refuses_a_whole_batch_statistic_between_them(capsys):
    base = [CHAIN, "--tiny", "--mesh", "stage:2", "--layout", BOTH, "--microbatches", "2"]
    rc, out, err = run_cli(capsys, ["check", *base, "--stage-layers", "3,1"])
    assert rc == 0 and "outputs match the dense program" in out, err
    # the pooled features divided by their mean over the whole batch (made from params): every
    # micro-batch's forward before the second stack's first: refused with the reason, exit 2
    rc, out, err = run_cli(capsys, ["check", *base, "--config", "whole_batch_norm=True"])
    flat = " ".join(err.split())
    assert rc == 2 and "reduces over the whole batch" in flat and "before the pipelined repeat" in flat, err
    assert "Traceback" not in err


def _on_two_processes(comm):
    torch.set_num_threads(1)
    m = md.load_model(CHAIN, tiny=True)
    plan = md.compile(heldout_outputs(m), "stage:2", BOTH, microbatches=2, schedule="1f1b")
    return held_outputs_on_this_rank(comm, plan, m.feeds(0))


@pytest.mark.timeout(200)
def test_chained_stacks_on_two_gloo_processes():
    m = md.load_model(CHAIN, tiny=True)
    want = md.run_dense(heldout_outputs(m), m.feeds(0))
    results = launch.spawn(_on_two_processes, 2, mesh="stage:2", timeout=180)
    assert_ranks_match_dense(results, want, REL)
