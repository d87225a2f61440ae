"""A plan's totals (:meth:`meshdsl.lowering.plan.Plan.totals`) against the traffic the runtime
really sends: a pipelined step run on the simulated mesh, each collective call counted as real
processes would make it.

Under micro-batches a process holds the ``m`` micro-batch ranks of its real rank
(:mod:`meshdsl.comm.microbatch`).  A call over axes without the micro-batch axis is one real
message per held micro-batch rank; one over the micro-batch axis too is folded locally first,
then one message; one over the micro-batch axis alone moves nothing between processes.  A step
of a segment run once per step (the prologue, the final segment) that still holds one value per
micro-batch (a tied embedding's gradient, partial over the micro-batches, sent from the last
stage to the first) runs on all ``m`` at once: ``m`` messages per process, not one.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import meshdsl as md
from meshdsl.comm.microbatch import real_rank
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.lowering.pipeline import MB_AXIS
from meshdsl.search.predict import process_totals
from meshdsl.tools.report import plan_report
from meshdsl.train.step import training_outputs
from models.transformer import Config, build

CFG = dataclasses.replace(Config.tiny(), layers=4, tied=True)


class _Counting(SimulatedComm):
    """The simulated mesh, counting each call's messages and bytes on its busiest real rank."""

    def __init__(self, mesh, ranks=None, counts=None, **kw):
        super().__init__(mesh, ranks, **kw)
        self.counts = {} if counts is None else counts

    def view(self, ranks):
        return _Counting(self.mesh, ranks, self.counts, mailbox=self.mailbox, log=self.log, device=self.device)

    def collective(self, kind, xs, axes, args):
        held: dict[int, list[int]] = {}
        for r, x in zip(self.ranks, xs):
            if x is not None:
                held.setdefault(real_rank(self.mesh, r), []).append(x.numel() * x.element_size())
        if held and set(axes) - {MB_AXIS}:   # over the micro-batch axis alone: a local sum
            parts = max(held.values(), key=sum)
            n, nbytes = (1, parts[0]) if MB_AXIS in axes else (len(parts), sum(parts))   # folded first
            t = self.counts.setdefault((kind, tuple(a for a in axes if a != MB_AXIS)), {"count": 0, "bytes": 0})
            t["count"] += n
            t["bytes"] += nbytes
        return super().collective(kind, xs, axes, args)


def _model():
    torch.manual_seed(0)
    model = build(CFG)
    return model, training_outputs(model.loss, model.params, 0.1)


def _sent(plan, feeds) -> dict:
    comm = _Counting(plan.mesh)
    ex = md.Executor(plan, comm)
    ex.run(feeds, ex.init_params(0))
    return comm.counts


@pytest.mark.parametrize("m,schedule", [(4, "1f1b"), (2, "gpipe"), (4, "interleaved:2")])
def test_sends_of_a_value_held_per_micro_batch_after_the_schedule_count_once_per_micro_batch(m, schedule):
    """The tied embedding's gradient (partial over the micro-batches) goes from the last stage to
    the first in the final segment, one message per micro-batch: the plan's totals count them all,
    as the carry's sends and receives are counted, one per micro-batch."""
    model, outs = _model()
    plan = md.compile(outs, "stage:2", "layer:stage", microbatches=m, schedule=schedule)
    sent = _sent(plan, model.feeds(0))
    totals = plan.totals_by_axis()
    for kind in ("send", "recv"):
        assert totals[(kind, ("stage",))] == sent[(kind, ("stage",))], kind
    # `meshdsl plan`'s rows (a send per micro-batch: "x m") add up to the same totals, FLOPs too
    rep = plan_report(plan)
    rows: dict = {}
    for e in rep["ops"]:
        for c in e["collectives"]:
            t = rows.setdefault(c["kind"], {"count": 0, "bytes": 0})
            t["count"] += e["times"]
            t["bytes"] += e["times"] * c["bytes"]
    assert rows == rep["totals"] == plan.totals()
    assert sum(e["flops"] * e["times"] for e in rep["ops"]) == rep["flops"] == plan.flops()


@pytest.mark.parametrize("model_path,layout", [
    (None, "layer:stage; batch:data"),
    # two stacks, each on one stage and held whole there: their gradients' sums move all their layers
    ("tests/heldout_ptrgen.py", "enc_layer:stage; dec_layer:stage; batch:data"),
])
def test_the_step_s_bytes_between_processes_are_what_it_sends(model_path, layout):
    """With the data axis beside the stage axis: every collective between processes, the final
    segment's included, counted as the runtime runs it."""
    if model_path is None:
        model, outs = _model()
    else:
        model = md.load_model(model_path, tiny=True)
        outs = training_outputs(model.loss, model.params, 0.1)
    plan = md.compile(outs, "stage:2; data:2", layout, microbatches=2, schedule="1f1b")
    sent = _sent(plan, model.feeds(0))
    by_kind: dict = {}
    for (kind, _), t in sent.items():
        mine = by_kind.setdefault(kind, {"count": 0, "bytes": 0})
        mine["count"] += t["count"]
        mine["bytes"] += t["bytes"]
    assert process_totals(plan) == by_kind
