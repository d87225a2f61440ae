"""A pipeline's carry sent without a copy (runtime/carry_out.py, PipeLink.reserve in comm/shm_pipe.py,
the runner's ``_sends_in_place`` in runtime/pipeline.py).

A layer loop asked to (``CarryOut.want``) writes its last layer's result, the residual add, straight
into a given tensor (a send's reserved slot) with the same kernel: the step's results are bitwise
those of the plain loop, forward and backward, and the tensor holds the loop's result.  A body whose
carry no plain add makes keeps its kernel (its send copies).  Only a sent value nothing else on its
rank reads may live in the slot.  On 2 gloo processes every schedule writes every carry it sends in
place and gives bitwise what the copying sends give.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import meshdsl as md
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.train.step import training_outputs
from models.transformer import Config, build


def _stack(residual: bool):
    """A stack of 3 MLP blocks over 'layer' (residual: ``h + mlp(h)``, else ``tanh(mlp(h))``); the
    outputs: the loss, the stack's result, the gradients of the params and of the input."""
    b, d, f, l = md.Dim("batch", 4), md.Dim("d_model", 4), md.Dim("d_ff", 8), md.Dim("layer", 3)
    with md.Graph("stack"):
        x = md.input("x", [b, d])
        ps = {"w1": md.param("w1", [l, d, f]), "w2": md.param("w2", [l, f, d])}

        def block(h, p):
            u = md.relu(md.einsum("batch d_model, d_model d_ff -> batch d_ff", h, p["w1"]))
            v = md.einsum("batch d_ff, d_ff d_model -> batch d_model", u, p["w2"])
            return h + v if residual else md.tanh(v)

        out = md.repeat(block, x, ps, "layer")
        loss = md.reduce_mean(out * out)
        grads = md.grad(loss, {**ps, "x": x})
    gen = torch.Generator().manual_seed(5)
    outs = {"loss": loss, "out": out, **{f"grad/{k}": g for k, g in grads.items()}}
    return outs, {"x": torch.randn(4, 4, generator=gen)}


def _loops(ex):
    """The executor's forward and backward loop calls."""
    steps = ex.plan.steps
    return [ex.calls[i] for i, s in enumerate(steps) if s.kind == "repeat" and not s.args["backward"]], \
        [ex.calls[i] for i, s in enumerate(steps) if s.kind == "repeat" and s.args["backward"]]


def test_a_loop_asked_writes_its_last_layer_s_result_where_asked_bitwise():
    outs, feeds = _stack(residual=True)
    plan = md.compile(outs, "data:1", "")
    plain_ex, ex = md.Executor(plan, SimulatedComm("data:1")), md.Executor(plan, SimulatedComm("data:1"))
    params = plain_ex.init_params(seed=1)
    want = plain_ex.run(feeds, params)
    (fwd,), (bwd,) = _loops(ex)
    carries = fwd.carry_out(), bwd.carry_out()   # installed before the first run builds the body's program
    assert None not in carries
    dsts = [torch.full((4, 4), float("nan")) for _ in carries]
    for carry, dst in zip(carries, dsts):
        carry.want = [dst]
    got = ex.run(feeds, params)
    assert all(c.want is None and c.dst is None for c in carries)   # used up by the run
    assert got.keys() == want.keys()
    for k in want:
        for x, y in zip(got[k], want[k]):
            assert torch.equal(x, y), k   # the same kernel into another tensor: the same bits
    assert got["out"][0] is dsts[0]       # the loop's result is the tensor it was handed
    assert not dsts[1].isnan().any()      # the backward's carry gradient went into its tensor
    again = ex.run(feeds, params)         # not asked: the loop's own kernel again
    assert again["out"][0] is not dsts[0] and torch.equal(again["out"][0], want["out"][0])


def test_a_carry_no_plain_add_makes_is_left_to_the_copying_send():
    outs, _ = _stack(residual=False)
    ex = md.Executor(md.compile(outs, "data:1", ""), SimulatedComm("data:1"))
    (fwd,), _ = _loops(ex)
    assert fwd.carry_out() is None


def test_only_a_value_its_rank_reads_in_sends_alone_may_live_in_the_slot():
    """1F1B on 2 stages: the first stage's loop result is only sent; on the last stage the head
    reads it (no send there); the backward loop's carry gradient is sent by the last stage and
    read by the first stage's embedding gradient."""
    model = build(dataclasses.replace(Config.tiny(), layers=2, batch=4))
    outs = training_outputs(model.loss, model.params, 0.1, with_grads=True)
    plan = md.compile(outs, "stage:2", "layer:stage", microbatches=2, schedule="1f1b")
    ex = md.Executor(plan, SimulatedComm(plan.mesh))
    i = next(i for i, s in enumerate(plan.steps) if s.kind == "pipeline")
    runner = ex.calls[i].__self__
    prog = plan.steps[i].args["program"]
    loops = {s.args["backward"]: s.outs[0] for seg in prog.segments for s in seg.steps if s.kind == "repeat"}
    carry, dcarry = loops[False], loops[True]
    assert runner._only_sent(carry, 0) and not runner._only_sent(carry, 1)
    assert runner._only_sent(dcarry, 1) and not runner._only_sent(dcarry, 0)


def _in_place_and_copied(rank, schedules, m):
    """Per schedule: this rank's outputs of one run with the carry sends written in place, and of
    one with every send copied (no slot reserved), and how many sends of the first run went in place
    out of how many."""
    from meshdsl.comm import shm_pipe
    from meshdsl.comm.distributed import TorchComm
    from meshdsl.comm.microbatch import for_plan
    torch.set_num_threads(1)
    comm = TorchComm("stage:2")
    model = build(dataclasses.replace(Config.tiny(), layers=4, batch=m))
    outs = training_outputs(model.loss, model.params, 0.1, with_grads=True)
    sends, reserve, send = [], shm_pipe.PipeLink.reserve, shm_pipe.PipeLink.send

    def counted(link, x):
        slot = link.views[link.pipe.written[link.k] % shm_pipe.NUM_SLOTS]
        sends.append(slot is not None and x.data_ptr() == slot.data_ptr())
        return send(link, x)
    shm_pipe.PipeLink.send = counted
    results = {}
    for schedule in schedules:
        plan = md.compile(outs, "stage:2", "layer:stage", microbatches=m, schedule=schedule)
        runs = []
        for in_place in (True, False):
            shm_pipe.PipeLink.reserve = reserve if in_place else (lambda link: None)
            sends.clear()
            runs.append(md.Executor(plan, for_plan(comm, plan)).run(model.feeds(0)))
            if in_place:
                counts = (sum(sends), len(sends))
        results[schedule] = (*runs, counts)
    comm.drain()
    return results


@pytest.mark.timeout(120)
def test_sends_written_in_place_give_bitwise_what_copied_ones_give_on_two_processes():
    from meshdsl.processes import launcher as launch
    schedules = ("gpipe", "1f1b", "zbh1", "interleaved:2", "interleaved-zb:2")
    results = launch.spawn(_in_place_and_copied, 2, args=(schedules, 2), timeout=100)
    for rank, by_schedule in enumerate(results):
        for schedule, (in_place, copied, (num_in_place, num_sends)) in by_schedule.items():
            # every carry this rank sends is a loop's result only the send reads: each goes in place
            assert num_sends > 0 and num_in_place == num_sends, (rank, schedule, num_in_place, num_sends)
            assert in_place.keys() == copied.keys()
            for k in in_place:
                for x, y in zip(in_place[k], copied[k]):
                    assert (x is None and y is None) or torch.equal(x, y), (rank, schedule, k)
