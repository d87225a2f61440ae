"""Gradient reductions that start inside the layer loop's backward (lowering/bucket.py
``stream_loop_grads``, runtime/layers.py).

The plan moves the reduction of a ``repeat``'s stacked gradients into the backward
block, one bucket per layer; the loop starts each layer's bucket right after that
layer and does not wait for it; the optimizer update does.  An FSDP gradient the
block reduce-scatters stays split: it is not gathered after the loop only to be
split again.  (Bitwise equality with ``bucket_mb=0`` for DP, ZeRO-2 and FSDP is
pinned in tests/test_bucket.py.)
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import meshdsl as md
from meshdsl.comm.communicator import Pending
from models.transformer import Config, build

CFG = dataclasses.replace(Config.tiny(), layers=3, batch=4)
DP = ("data:2", "batch:data")
FSDP = ("data:2", "batch:data; params.d_model:data")


@pytest.fixture(scope="module")
def model():
    return build(CFG)


def _loop(plan):
    return next(s for s in plan.steps if s.kind == "repeat" and s.args["backward"])


@pytest.mark.parametrize("mesh_layout,kind", [(DP, "bucket_allreduce"), (FSDP, "bucket_reduce_scatter")])
def test_the_backward_loop_reduces_each_layer_in_one_bucket(model, mesh_layout, kind):
    plan = md.compile(model.train_step(0.1), *mesh_layout)
    loop = _loop(plan)
    assert set(loop.args["streamed"]) == set(loop.args["names"])
    body = loop.subplans[0]
    (bucket,) = [s for s in body.steps if s.kind == kind]
    # the bucket's results are the block's gradient outputs, and nothing in the block reads them
    assert set(bucket.outs) == {body.outputs[f"d/{k}"] for k in loop.args["names"]}
    assert not any(set(bucket.outs) & set(s.ins) for s in body.steps)
    # counted once per layer; the stacked gradients go to the update with no collective between
    assert plan.totals()[kind]["count"] >= CFG.layers
    readers = [s for s in plan.steps if set(loop.outs[1:]) & set(s.ins)]
    assert readers and all(s.kind == "local" for s in readers)


def test_fsdp_gradients_are_not_gathered_after_the_loop(model):
    plan = md.compile(model.train_step(0.1), *FSDP)
    # the only collective of the top level's backward is the bucket of the gradients outside the loop
    top = [s.kind for s in plan.steps if s.is_collective and s.phase == "backward"]
    assert top == ["bucket_reduce_scatter"]


def test_bucket_mb_0_keeps_the_reductions_after_the_loop(model):
    plan = md.compile(model.train_step(0.1), *DP, bucket_mb=0)
    loop = _loop(plan)
    assert "streamed" not in loop.args
    assert not any(s.is_collective for s in loop.subplans[0].steps)


def _step_equals_unbucketed(model, comm) -> None:
    """One bucketed DP step on ``comm`` gives bitwise the loss and params of one unbucketed step."""
    step = md.TrainStep(model.loss, model.params, *DP, comm, lr=0.1)
    want = md.TrainStep(model.loss, model.params, *DP, md.SimulatedComm(md.Mesh.parse(DP[0])), lr=0.1,
                        bucket_mb=0)
    feeds = model.feeds(0)
    assert step(feeds)[0] == want(feeds)[0]
    for k, xs in want.params.items():
        torch.testing.assert_close(step.params[k][0], xs[0], rtol=0, atol=0)


class _Recording(md.SimulatedComm):
    """Logs each started collective and when its result is first waited for."""

    def __init__(self, mesh, log):
        super().__init__(md.Mesh.parse(mesh))
        self.log = log

    def start(self, kind, xs, axes, args):
        self.log.append(("start", kind))
        done, log = super().start(kind, xs, axes, args), self.log

        class Logged(Pending):
            def wait(self):
                log.append(("wait", kind))
                return done.wait()
        return Logged()


def test_the_loop_starts_each_layers_bucket_and_leaves_the_waiting_to_the_update(model):
    log: list = []
    _step_equals_unbucketed(model, _Recording(DP[0], log))
    buckets = [e for e in log if e[1] == "bucket_allreduce"]
    # one bucket per layer, started as the loop goes, then the one of the gradients made after it
    # (embeddings); every one is started before any is waited for
    assert buckets[:CFG.layers + 1] == [("start", "bucket_allreduce")] * (CFG.layers + 1)
    assert buckets[CFG.layers + 1:] == [("wait", "bucket_allreduce")] * (CFG.layers + 1)


class _Buffers(md.SimulatedComm):
    """Records where each started bucket allreduce's buffer lives: (storage, offset, numel)."""

    def __init__(self, mesh, log):
        super().__init__(md.Mesh.parse(mesh))
        self.buffers = log

    def start(self, kind, xs, axes, args):
        if kind == "bucket_allreduce":
            self.buffers.append((xs[0].untyped_storage().data_ptr(), xs[0].storage_offset(), xs[0].numel()))
        return super().start(kind, xs, axes, args)


def test_a_layers_bucket_is_its_row_of_the_stacked_gradients_no_packing_copy(model):
    # The loop's stacked gradients are views into one [layers, bucket] buffer: each layer's
    # bucket goes to the collective as that row (no copy), as DDP's gradients live in buckets.
    log: list = []
    _step_equals_unbucketed(model, _Buffers(DP[0], log))
    rows = log[:CFG.layers]  # started last layer first
    storage, _, numel = rows[0]
    assert [r[0] for r in rows] == [storage] * CFG.layers
    assert [r[1] for r in rows] == [l * numel for l in reversed(range(CFG.layers))]
    assert log[CFG.layers][0] != storage  # the gradients made after the loop are packed as before
