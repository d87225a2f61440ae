"""The memory report (meshdsl/lowering/memory.py) of pipelined and accumulating plans.

A pipeline stage holds the activations of as many micro-batches as its schedule keeps in
flight: all m under GPipe, at most p under 1F1B, one under gradient accumulation; the
report's activation peak follows, where it once counted one micro-batch for every schedule.

The figures are exact.  A schedule changes only how many micro-batches a stage holds, not the
segments, so each peak is the same plan run one micro-batch at a time per stage (its own
peak) plus, for each further micro-batch held on the busiest stage, what one micro-batch's
forward keeps there for its backward (``saved_bytes``).
"""
from __future__ import annotations

import dataclasses

import pytest

import meshdsl as md
from meshdsl.lowering.memory import memory_report, saved_bytes
from meshdsl.lowering.plan import step_args
from meshdsl.lowering.schedule import Schedule, validate, with_transfers
from meshdsl.lowering.schedule_gen import make_schedule
from meshdsl.train.step import training_outputs
from models.transformer import Config, build


@pytest.fixture(scope="module")
def outs():
    model = build(Config())
    return training_outputs(model.loss, model.params, 0.1)


def _compile(outs, mesh, layout, m, schedule="gpipe"):
    return md.compile(outs, mesh, layout, microbatches=m, schedule=schedule)


def _peak(plan) -> int:
    return memory_report(plan)["activations_peak"]


def _micro_batch_step(plan):
    """The plan's one pipeline (or accumulate) step."""
    (step,) = [s for s in plan.steps if s.kind in ("pipeline", "accumulate")]
    return step


def _kept(plan) -> list[int]:
    """Per stage, the bytes one micro-batch's forward keeps there for its backward."""
    return saved_bytes(_micro_batch_step(plan), plan.mesh)


def _run_by(plan, schedule: Schedule):
    """``plan`` with its micro-batch step run by ``schedule`` (the segments stay as compiled)."""
    step = _micro_batch_step(plan)
    validate(schedule)
    program = step.args["program"].with_schedule(schedule)
    new = dataclasses.replace(step, args=step_args(step.kind, {**step.args, "program": program}))
    return dataclasses.replace(plan, steps=tuple(new if s is step else s for s in plan.steps))


def _one_at_a_time(p: int, m: int) -> Schedule:
    """Every stage runs F0 B0 F1 B1 ...: one micro-batch in flight on each."""
    orders = [[(kind, mb, r) for mb in range(m) for kind in "FB"] for r in range(p)]
    return Schedule("one-at-a-time", p, m, with_transfers(orders, p))


@pytest.mark.parametrize("m", [4, 8])
def test_gpipe_holds_every_micro_batch_and_1f1b_at_most_p(outs, m):
    one = _compile(outs, "stage:2", "layer:stage", 1)
    gpipe, f1b1 = (_compile(outs, "stage:2", "layer:stage", m, s) for s in ("gpipe", "1f1b"))
    kept = _kept(gpipe)
    # Every value a forward keeps for its backward is split by the batch: a micro-batch keeps
    # exactly 1/m of the whole batch's bytes on each stage, whatever the schedule.
    assert [b * m for b in kept] == _kept(one) and _kept(f1b1) == kept
    own = _peak(_run_by(gpipe, _one_at_a_time(2, m)))
    # GPipe: both stages hold all m; the busiest keeps m - 1 micro-batches beyond its own
    # peak's one, (m - 1)/m of the whole batch's saved activations.
    assert _peak(gpipe) == own + (m - 1) * max(kept)
    # 1F1B: stage r holds p - r, so stage 0 one micro-batch more and stage 1 none.
    assert _peak(f1b1) == own + kept[0]
    if m == 8:
        assert _peak(f1b1) < _peak(_compile(outs, "stage:2", "layer:stage", 4, "1f1b"))


def test_accumulation_holds_one_micro_batch(outs):
    one, four = _compile(outs, "data:1", "", 1), _compile(outs, "data:1", "", 4)
    kept = _kept(four)
    assert [2 * b for b in kept] == _kept(_compile(outs, "data:1", "", 2))  # a quarter of the batch: half of a half's
    # The same segments with every forward first (GPipe on one stage) hold all four micro-batches:
    # accumulation's F0 B0 F1 B1 ... holds exactly three fewer.
    all_four = _peak(_run_by(four, make_schedule("gpipe", 1, 4)))
    assert _peak(four) == all_four - 3 * kept[0]
    assert _peak(four) < 0.35 * _peak(one)
