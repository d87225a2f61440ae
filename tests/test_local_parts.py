"""Per-layer outputs of a pipelined repeat on unequal stages (lowering/local_parts.py).

A block returning ``(carry, {name: tensor})`` stacks its per-layer outputs over the layer dim;
with given stage layers (``stage_layers=(1, 3)``, per virtual stage under ``interleaved:v``)
each rank stores its own, unequal number of them, and what the loss makes of them (a mean over
the layers, an elementwise op, a sum to a scalar) runs on each rank's own layers, its local
steps cut at the stages' counts.  The loss (the per-layer terms included), the gradients, the
stacked per-layer outputs and an optimizer step give the dense program's numbers for gpipe, 1f1b,
zbh1 and interleaved:2, for the MoE model with a data axis and split experts under AdamW, and on
2 gloo processes; ``balance_stages`` (``--stage-layers auto``) now proposes unequal splits of
such models and the compiler runs them.
"""
from __future__ import annotations

import multiprocessing

import pytest
import torch

import meshdsl as md
from conftest import adamw_dense_curve, assert_matches_scaled, held_outputs_on_this_rank
from meshdsl.comm.distributed import TorchComm
from meshdsl.processes import launcher as launch
from meshdsl.search.calibrate import Calibration
from meshdsl.search.stage_balance import balance_stages
from meshdsl.train.step import training_outputs

# As tests/test_balanced_stages.py: micro-batches summed in another order than the dense
# program's, fp32 rounding only (a few ulp of each output's largest magnitude); a rank that
# takes another rank's layer count, or a mean divided by the local layers, is off by O(1).
REL = 1e-5


def _per_layer_graph(layers: int):
    """A repeat whose layers return a scalar and a per-row output; the loss takes the mean of
    the scalars over the layers, an elementwise function of the rows summed, and returns the
    stacked scalars; training outputs of one SGD step (params, gradients, new params)."""
    b, d, lay = md.Dim("batch", 8), md.Dim("d_model", 4), md.Dim("layer", layers)
    with md.Graph():
        x = md.input("x", [b, d])
        w = md.param("w", [lay, d, md.Dim("d_out", 4)], fan_out=["d_out"])

        def block(h, p):
            y = md.rename(md.einsum("batch d_model, d_model d_out -> batch d_out", h, p["w"]), {"d_out": "d_model"})
            return h + md.tanh(y), {"aux": md.reduce_mean(y ** 2), "row": md.reduce_sum(y, "d_model")}

        h, per = md.repeat(block, x, {"w": w}, "layer")
        # the mean over the layers divides by all of them, whichever rank holds how many
        loss = (md.reduce_mean(h ** 2) + md.reduce_mean(per["aux"], "layer")
                + 0.01 * md.reduce_sum(md.exp(per["row"])))
        return {**training_outputs(loss, {"w": w}, 0.1, with_grads=True), "aux": per["aux"]}


@pytest.mark.parametrize("schedule, counts", [
    ("gpipe", (3, 1)), ("1f1b", (1, 3)), ("zbh1", (1, 3)),
    ("interleaved:2", (1, 3, 2, 2)),   # rank 0 holds 3 layers, rank 1 holds 5
])
def test_per_layer_outputs_on_unequal_stages_match_dense(schedule, counts):
    outs = _per_layer_graph(sum(counts))
    feeds = {"x": torch.randn(8, 4, generator=torch.Generator().manual_seed(0))}
    plan = md.compile(outs, "stage:2", "layer:stage", microbatches=2, schedule=schedule, stage_layers=counts)
    got = md.run_simulated(plan, feeds)
    assert_matches_scaled(got, md.run_dense(outs, feeds), f"{schedule} {counts}", REL)


def _moe(layers: int) -> md.Model:
    return md.load_model("moe", tiny=True, layers=layers)


def _opt():
    return md.AdamW(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


@pytest.mark.parametrize("mesh, layout, schedule, counts", [
    ("stage:2; data:2", "layer:stage; batch:data; experts:data", "1f1b", (1, 3)),
    ("stage:2", "layer:stage", "interleaved:2", (1, 3, 2, 2)),
])
def test_moe_adamw_on_unequal_stages_is_the_dense_curve(mesh, layout, schedule, counts):
    """Two AdamW steps with clipping: the loss (the balance loss of every layer included) and
    the first global gradient norm of the dense program."""
    model = _moe(sum(counts))
    want_loss, want_norm = adamw_dense_curve(model, _opt(), 0.5, 2)
    step = md.TrainStep(model.loss, model.params, mesh, layout, md.SimulatedComm(md.Mesh.parse(mesh)),
                        optimizer=_opt(), clip_norm=0.5, microbatches=2, schedule=schedule, stage_layers=counts)
    losses = [step(model.feeds(i))[0] for i in range(2)]
    # as tests/test_moe_adamw.py: AdamW's normalised update carries the few-ulp differences of
    # another summation order into the next step's loss, a few 1e-6 relative
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_loss), rtol=REL, atol=0)
    assert step.grad_norm == pytest.approx(want_norm[1], rel=REL)


def test_balance_stages_proposes_unequal_splits_of_per_layer_outputs():
    # A vocabulary large enough that the head and the loss cost more than a layer: the last
    # stage takes fewer layers, which per-layer outputs no longer rule out.
    model = md.load_model("moe", tiny=True, layers=4, vocab=4096)
    outs = training_outputs(model.loss, model.params, 0.1, with_grads=True)
    counts = balance_stages(outs, "stage:2", "layer:stage", microbatches=2, schedule="1f1b",
                            cal=Calibration.defaults())
    assert sum(counts) == 4 and counts[1] < counts[0]
    plan = md.compile(outs, "stage:2", "layer:stage", microbatches=2, schedule="1f1b", stage_layers=counts)
    feeds = model.feeds(0)
    assert_matches_scaled(md.run_simulated(plan, feeds), md.run_dense(outs, feeds), f"auto {counts}", REL)


def _moe_outputs():
    model = _moe(4)
    return model, {**training_outputs(model.loss, model.params, 0.1, with_grads=True), **model.outputs}


def _gloo_case(rank):
    comm = TorchComm("stage:2")
    model, outs = _moe_outputs()
    plan = md.compile(outs, "stage:2", "layer:stage", microbatches=2, schedule="1f1b", stage_layers=(1, 3))
    return held_outputs_on_this_rank(comm, plan, model.feeds(0))


@pytest.mark.timeout(120)
def test_moe_on_unequal_stages_on_two_gloo_processes():
    results = launch.spawn(_gloo_case, 2, timeout=100)
    assert multiprocessing.active_children() == []
    model, outs = _moe_outputs()
    want = md.run_dense(outs, model.feeds(0))
    got = {}
    for r in results:
        got.update(r)
    ints = {k for k, v in want.items() if not v.is_floating_point()}   # dropped-routing counts: equal
    for k in ints:
        assert torch.equal(got.pop(k), want.pop(k)), k
    assert_matches_scaled(got, want, "gloo 1f1b (1, 3)", REL)
