"""The memory report (meshdsl/lowering/memory.py) of pipelined and accumulating plans.

A pipeline stage holds the activations of as many micro-batches as its schedule keeps in
flight: all m under GPipe, at most p under 1F1B, one under gradient accumulation; the
report's activation peak follows, where it once counted one micro-batch for every schedule.
"""
from __future__ import annotations

import pytest

import meshdsl as md
from meshdsl.lowering.memory import memory_report
from meshdsl.train.step import training_outputs
from models.transformer import Config, build


@pytest.fixture(scope="module")
def outs():
    model = build(Config())
    return training_outputs(model.loss, model.params, 0.1)


def _peak(outs, mesh, layout, m, schedule="gpipe"):
    return memory_report(md.compile(outs, mesh, layout, microbatches=m, schedule=schedule))["activations_peak"]


@pytest.mark.parametrize("m", [4, 8])
def test_gpipe_holds_every_micro_batch_and_1f1b_at_most_p(outs, m):
    one = _peak(outs, "stage:2", "layer:stage", 1)
    gpipe, f1b1 = (_peak(outs, "stage:2", "layer:stage", m, s) for s in ("gpipe", "1f1b"))
    # GPipe keeps the whole batch's saved activations (m micro-batches of 1/m each).
    assert 0.75 * one <= gpipe <= 1.25 * one
    # 1F1B's first stage holds p = 2 micro-batches: far less, and less with more of them.
    assert f1b1 < 0.6 * gpipe
    if m == 8:
        assert f1b1 < _peak(outs, "stage:2", "layer:stage", 4, "1f1b")


def test_accumulation_holds_one_micro_batch(outs):
    one, four = _peak(outs, "data:1", "", 1), _peak(outs, "data:1", "", 4)
    assert four < 0.35 * one
