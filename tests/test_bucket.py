"""Gradient bucketing (lowering/bucket.py, runtime/steps.py): fewer collectives, the same numbers.

The plan of a data-parallel step reduces its gradients in fewer collectives than
with bucketing off, and only gradients (never an activation's reduction) go into
a bucket; DP, ZeRO-2 and FSDP steps with buckets of every size give exactly the
unbucketed results, on the simulated mesh and on 2 gloo processes.
"""
from __future__ import annotations

import dataclasses
import multiprocessing

import pytest
import torch

import meshdsl as md
from meshdsl.errors import MeshDSLError
from meshdsl.processes import launcher as launch
from meshdsl.comm.distributed import TorchComm
from models.transformer import Config, build

CFG = dataclasses.replace(Config.tiny(), layers=2, batch=4)
LAYOUTS = {"dp": ("data:2", "batch:data"),
           "zero2": ("data:2", "batch:data; grads.d_model:data; opt.d_model:data"),
           "dp+tp": ("data:2; model:2", "batch:data; heads:model; d_ff:model"),
           "fsdp": ("data:2", "batch:data; params.d_model:data")}
# 0: off; 1e-3 MB (~1 KiB): many small buckets, some of one member; 25: everything in one
SIZES = (0, 1e-3, 25)


def _kinds(plan):
    return {k: t["count"] for k, t in plan.totals().items()}


def _walk(plan):
    """(plan, step) for every step, the layer loop's sub-plans included (each step once)."""
    for s in plan.steps:
        yield plan, s
        for sub in s.subplans:
            yield from _walk(sub)


@pytest.fixture(scope="module")
def model():
    return build(CFG)


def _step(model, name, comm=None, bucket_mb=25.0):
    mesh, layout = LAYOUTS[name]
    comm = comm or md.SimulatedComm(md.Mesh.parse(mesh))
    return md.TrainStep(model.loss, model.params, mesh, layout, comm, optimizer=md.AdamW(lr=1e-2),
                        bucket_mb=bucket_mb)


def test_buckets_replace_the_gradient_allreduces(model):
    off, on = _step(model, "dp", bucket_mb=0).plan, _step(model, "dp").plan
    grads = [s for s, _ in off.collectives() if s.kind == "allreduce" and s.phase != "forward"]
    assert len(grads) == len(model.params) and "bucket_allreduce" not in _kinds(off)
    # the tiny model's gradients (well under 25 MB) travel in one bucket per layer, started inside
    # the layer loop (lowering/bucket.py, stream_loop_grads), and one for the rest; the forward
    # loss allreduce stays
    assert _kinds(on)["bucket_allreduce"] == CFG.layers + 1
    assert _kinds(on)["allreduce"] == _kinds(off)["allreduce"] - len(grads)
    # the same bytes in all (a loop's collectives count once per layer)
    assert sum(s.bytes * n for s, n in on.collectives()) == sum(s.bytes * n for s, n in off.collectives())


def test_zero2_reduce_scatters_are_bucketed(model):
    off, on = _step(model, "zero2", bucket_mb=0).plan, _step(model, "zero2").plan
    # one bucket per layer in the layer loop, one for the rest
    assert _kinds(on)["bucket_reduce_scatter"] == CFG.layers + 1 and "reduce_scatter" not in _kinds(on)
    buckets = [s for _, s in _walk(on) if s.kind == "bucket_reduce_scatter"]
    assert len(buckets) == 2 and sum(len(b.ins) for b in buckets) == _kinds(off)["reduce_scatter"]


def test_small_buckets_close_at_the_size(model):
    plan = _step(model, "dp", bucket_mb=1e-3).plan
    buckets = [(p, s) for p, s in _walk(plan) if s.kind == "bucket_allreduce"]
    assert len(buckets) > 1
    # a bucket closes on the member that takes it to the size: all but its last member fit under it
    for p, s in buckets:
        sizes = [p.values[v].local_bytes(p.mesh) for v in s.ins]
        assert sum(sizes[:-1]) < 2 ** 10 * 1.024


def test_activation_reductions_stay_out_of_buckets(model):
    plan = _step(model, "dp+tp").plan
    for s in plan.steps:
        if s.kind == "allreduce" and s.phase == "backward":
            # a tensor-parallel activation gradient: the rest of the backward reads it
            assert any(u.phase == "backward" for u in plan.steps if s.outs[0] in u.ins)
    assert _kinds(plan)["bucket_allreduce"] >= 1


@pytest.mark.parametrize("bad", [-1, float("nan"), "25", True])
def test_bucket_size_is_checked(model, bad):
    with pytest.raises(MeshDSLError, match="bucket_mb"):
        md.compile(model.loss, "data:2", "batch:data", bucket_mb=bad)


def _curve(step, model, steps=3):
    feeds = model.feeds(0)
    return [step(feeds)[0] for _ in range(steps)], {k: [x if x is None else x.clone() for x in v]
                                                     for k, v in step.params.items()}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_bucketed_steps_equal_unbucketed_on_the_simulated_mesh(model, name):
    want_loss, want_params = _curve(_step(model, name, bucket_mb=0), model)
    for size in SIZES[1:]:
        loss, params = _curve(_step(model, name, bucket_mb=size), model)
        # a bucket adds the same numbers in the same group order, one element at a time: bitwise equal
        assert loss == want_loss, (name, size)
        for k, xs in want_params.items():
            for x, y in zip(xs, params[k]):
                torch.testing.assert_close(y, x, rtol=0, atol=0)


def _gloo(rank, names):
    torch.set_num_threads(1)
    model = build(CFG)
    out, reserved = {}, {}
    for name in names:
        for size in SIZES:
            comm = TorchComm(LAYOUTS[name][0])
            out[(name, size)] = _curve(_step(model, name, comm, bucket_mb=size), model)
            # whether the layer loop's gradient rows went through the shared segment's reduce buffer
            reserved[(name, size)] = any(g is not None and g.ring.floor > 0 for g in comm._shm.values())
    return out, reserved


@pytest.mark.timeout(300)
def test_bucketed_steps_equal_unbucketed_on_gloo(model):
    names = ("dp", "zero2", "fsdp")
    results = launch.spawn(_gloo, 2, args=(names,), timeout=280)
    assert multiprocessing.active_children() == []
    for res, reserved in results:
        # the DP step's bucketed layer gradients are reduced from the reduce buffer (comm/shm_ring.py)
        assert reserved[("dp", 25)] and reserved[("dp", 1e-3)] and not reserved[("dp", 0)]
        for name in names:
            want_loss, want_params = res[(name, 0)]
            for size in SIZES[1:]:
                loss, params = res[(name, size)]
                # gloo sums two ranks' elements (a + b, commutative) and the reduce-scatter folds
                # locally in group order, whatever the buffer: bitwise equal to the unbucketed step
                assert loss == want_loss, (name, size)
                for k, xs in want_params.items():
                    torch.testing.assert_close(params[k][0], xs[0], rtol=0, atol=0)


def test_buckets_follow_the_backward(model):
    # plain SGD with gradient outputs: the LM head's gradient is made first, the embedding's last
    plan = md.compile(model.train_step(0.1), "data:2", "batch:data", bucket_mb=1e-3)
    buckets = [s for s in plan.steps if s.kind == "bucket_allreduce"]
    assert plan.outputs["grad/lm_head"] in buckets[0].outs and plan.outputs["grad/wte"] in buckets[-1].outs
    # each bucket comes right after the step that makes its last gradient, every step after its producers
    pos = {v: i for i, s in enumerate(plan.steps) for v in s.outs}
    for i, s in enumerate(plan.steps):
        assert all(pos[v] < i for v in s.ins), s.label
        if s in buckets:
            assert max(pos[v] for v in s.ins) == i - 1 or plan.steps[i - 1] in buckets


@pytest.mark.parametrize("size", [25, 1e-3])
def test_buckets_start_at_their_last_gradient_and_are_read_late(model, size):
    from meshdsl.runtime.executor import issue_order
    plan = md.compile(model.train_step(0.1), "data:2", "batch:data", bucket_mb=size)
    order = issue_order(plan, TorchComm.async_kinds)
    at = {i: k for k, i in enumerate(order)}
    made = {v: i for i, s in enumerate(plan.steps) for v in s.outs}
    buckets = {i for i, s in enumerate(plan.steps) if s.kind == "bucket_allreduce"}
    in_bucket = {v for i in buckets for v in plan.steps[i].outs}
    # every step that (transitively) reads a bucket's result
    after_bucket = set()
    for j in order:
        s = plan.steps[j]
        if set(s.ins) & in_bucket:
            in_bucket |= set(s.outs)
            after_bucket.add(j)
    for i in buckets:
        # started on torch.distributed as soon as its last gradient exists: only other
        # collectives being started (buckets made ready by the same step) come in between
        last = max(at[made[v]] for v in plan.steps[i].ins)
        assert all(plan.steps[order[k]].kind in TorchComm.async_kinds for k in range(last + 1, at[i]))
    # no bucket is waited on while work that needs none of them is left
    first_read = min(at[j] for j in after_bucket)
    assert all(at[j] < first_read for j in range(len(order)) if j not in after_bucket and j not in buckets)


def _pipe_step(model, bucket_mb, microbatches=2):
    mesh, layout = "pipe:2; data:2", "layer:pipe; batch:data"
    return md.TrainStep(model.loss, model.params, mesh, layout, md.SimulatedComm(md.Mesh.parse(mesh)),
                        optimizer=md.AdamW(lr=1e-2), microbatches=microbatches, schedule="1f1b",
                        bucket_mb=bucket_mb)


def _final(plan):
    pipe = next(s for s in plan.steps if s.kind == "pipeline")
    return list(zip(pipe.subplans[3].steps, pipe.args["program"].stages[3]))


def test_a_pipelines_final_gradient_reductions_are_bucketed_per_stage(model):
    """The final segment reduces the micro-batch sums over the data axis: one bucket per
    set of stages instead of one allreduce per gradient, the same bytes in all."""
    off, on = _final(_pipe_step(model, 0).plan), _final(_pipe_step(model, 25).plan)
    made = {v for s, _ in off for v in s.outs}   # reduced alone: a gradient norm's partial sums
    grads = [(s, st) for s, st in off if s.kind == "allreduce" and s.phase != "forward" and s.ins[0] not in made]
    buckets = [(s, st) for s, st in on if s.kind == "bucket_allreduce"]
    assert len(grads) > len(buckets) >= 2
    assert len({st for _, st in buckets}) == len(buckets)            # one per set of stages
    assert sorted(v for s, _ in buckets for v in s.ins) == sorted(s.ins[0] for s, _ in grads)
    assert sum(s.bytes for s, _ in buckets) == sum(s.bytes for s, _ in grads)
    for s, st in buckets:   # members share their stages
        assert all(dict((g.ins[0], t) for g, t in grads)[v] == st for v in s.ins)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_bucketed_pipeline_steps_equal_unbucketed(model, microbatches):
    want_loss, want_params = _curve(_pipe_step(model, 0, microbatches), model)
    for size in SIZES[1:]:
        loss, params = _curve(_pipe_step(model, size, microbatches), model)
        assert loss == want_loss, size
        for k, xs in want_params.items():
            for x, y in zip(xs, params[k]):
                torch.testing.assert_close(y, x, rtol=0, atol=0)


def test_a_tied_embeddings_sum_made_in_the_final_segment_is_reduced_on_its_own():
    tied = build(dataclasses.replace(CFG, tied=True))
    final = _final(_pipe_step(tied, 25).plan)
    made = {v for s, _ in final for v in s.outs}
    for s, _ in final:
        if s.kind == "bucket_allreduce":
            assert not made & set(s.ins)
    assert any(s.kind == "allreduce" and s.ins[0] in made for s, _ in final)


def test_shared_weights_gradients_summed_over_the_stages_and_data_are_one_bucket():
    """The Neural ODE's RK4 steps pipelined over ``stage`` and its examples split over ``data``:
    the gradients of the weights every step reads from outside the repeat are summed over the
    stages, micro-batches and data at once, in one bucket (not one allreduce per tensor over
    the stages, then another over data), and loss and gradients stay the dense program's."""
    from pathlib import Path

    from conftest import assert_heldout_case_matches_dense, heldout_outputs
    case = (str(Path(__file__).parent / "heldout_neuralode.py"), {}, "stage:2; data:2", "step:stage; ex:data",
            {"microbatches": 2, "schedule": "1f1b"})
    m = md.load_model(case[0], tiny=True)
    plan = md.compile(heldout_outputs(m), *case[2:4], **case[4])
    grads = [s for s, _ in _final(plan) if s.is_collective and s.phase == "backward"]
    assert all(s.kind == "bucket_allreduce" for s in grads), [(s.kind, s.axes, s.label) for s in grads]
    shared = [s for s in grads if "stage" in s.axes]
    assert len(shared) == 1 and set(shared[0].axes) == {"stage", "data", "_mb"} and len(shared[0].ins) == 4
    assert_heldout_case_matches_dense(case)
