"""Prefetch in the repeat loop (runtime/prefetch.py): FSDP's gathers for layer l+1 start before layer l runs.

On a simulated mesh whose communicator starts all-gathers "asynchronously" (and
records when), every layer after the first of each loop receives gathers that
were started before the layer before it ran, the step's numbers equal those of
the plain simulated mesh bit for bit, and a data-parallel loop (no param
collective) prefetches nothing.  tests/test_zero.py runs FSDP on gloo processes.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import meshdsl as md
from meshdsl.comm.communicator import Done
from meshdsl.runtime.executor import Executor
from meshdsl.runtime.layers import _Body
from meshdsl.runtime.prefetch import prefetchable
from meshdsl.comm.simulated import SimulatedComm
from models.transformer import Config, build

CFG = dataclasses.replace(Config.tiny(), layers=3, batch=4)
FSDP = ("data:2", "batch:data; params.d_model:data")


class AsyncGathers(SimulatedComm):
    """Starts all-gathers, packed or not (a layer's param gathers: lowering/coalesce.py), through
    :meth:`start` (as TorchComm does) and numbers each start."""

    async_kinds = frozenset({"allgather", "bucket_allgather"})

    def __init__(self, mesh, events):
        super().__init__(mesh)
        self.events = events

    def start(self, kind, xs, axes, args):
        handle = Done(self.collective(kind, xs, axes, args))
        self.events.append(("start", handle))  # kept alive, so ids stay unique
        return handle


def _started_as(h):
    """The communicator's handle prefetched value ``h`` waits on (a packed gather's member: its
    bucket's, comm/bucket.py)."""
    whole = getattr(h, "whole", None)
    return h if whole is None else whole.pending


@pytest.fixture(scope="module")
def model():
    return build(CFG)


def _step(model, comm, layout=FSDP):
    return md.TrainStep(model.loss, model.params, *layout[:1], layout[1], comm, lr=0.1)


def test_next_layer_gathers_start_before_this_layer_runs(model, monkeypatch):
    events: list = []
    step = _step(model, AsyncGathers(md.Mesh.parse("data:2"), events))
    run = Executor.run

    def recording_run(self, *args, prefetched=None, **kw):
        if prefetched is not None:
            events.append(("run", [_started_as(h) for h in prefetched.values()]))
        return run(self, *args, prefetched=prefetched, **kw)

    monkeypatch.setattr(Executor, "run", recording_run)
    body = _Body.__call__   # an eager loop runs its layers through its body's program, not Executor.run

    def recording_body(self, salt, stats, prefetched, *args):
        if prefetched is not None:
            events.append(("run", [_started_as(h) for h in prefetched.values()]))
        return body(self, salt, stats, prefetched, *args)

    monkeypatch.setattr(_Body, "__call__", recording_body)
    step(model.feeds(0))
    started = {id(h): k for k, (what, h) in enumerate(events) if what == "start"}
    runs = [(k, hs) for k, (what, hs) in enumerate(events) if what == "run"]
    # forward and backward loops, CFG.layers layer runs each, every one with its gathers prefetched
    assert len(runs) == 2 * CFG.layers and all(hs for _, hs in runs)
    for loop in (runs[:CFG.layers], runs[CFG.layers:]):
        for (before, _), (_, hs) in zip(loop, loop[1:]):
            assert all(started[id(h)] < before for h in hs)


def test_prefetch_keeps_the_numbers(model):
    plain = _step(model, SimulatedComm(md.Mesh.parse("data:2")))
    fetched = _step(model, AsyncGathers(md.Mesh.parse("data:2"), []))
    for i in range(2):
        # the same collectives on the same tensors, started earlier: bitwise equal
        assert fetched(model.feeds(i))[0] == plain(model.feeds(i))[0]
    for k, xs in plain.params.items():
        for x, y in zip(xs, fetched.params[k]):
            torch.testing.assert_close(y, x, rtol=0, atol=0)


def test_data_parallel_loops_prefetch_nothing(model):
    step = _step(model, AsyncGathers(md.Mesh.parse("data:2"), []), ("data:2", "batch:data"))
    (rep,) = [s for s in step.plan.steps if s.kind == "repeat" and not s.args["backward"]]
    assert prefetchable(Executor(rep.subplans[0], step.executor.comm)) == ()
