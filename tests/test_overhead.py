"""The runtime's own cost per step (meshdsl/search/overhead.py): measured, small, and the
pipeline runtime's at least the executor's."""
from __future__ import annotations

import pytest

from conftest import time_limit
from meshdsl.search import sweep
from meshdsl.search.calibrate import Calibration
from meshdsl.search.overhead import dispatch_seconds, pipeline_dispatch_seconds
from meshdsl.search.sweep import median_time


class _Clock:
    """A ``perf_counter`` that only moves when a timed call says how long it took."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.mark.parametrize("durations, middle", [
    # odd: the middle one (the mean is 3.8; with the untimed first call it would be 4)
    ([100.0, 9.0, 1.0, 4.0, 2.0, 3.0], 3.0),
    # even: the upper of the two middle ones (the lower is 2, the mean 3.5)
    ([100.0, 8.0, 1.0, 3.0, 2.0], 3.0),
])
def test_median_time_is_the_middle_call(monkeypatch, durations, middle):
    clock = _Clock()
    monkeypatch.setattr(sweep, "time", clock)
    calls = iter(durations)

    def call():
        clock.now += next(calls)

    assert median_time(call, len(durations) - 1) == middle
    assert next(calls, None) is None   # every call ran: one untimed, then reps timed


def test_runtime_cost_per_step_is_microseconds_and_a_pipeline_adds_to_it():
    cal = Calibration.defaults()
    d = dispatch_seconds(cal, 3)
    cal.dispatch_s = d
    p = pipeline_dispatch_seconds(cal, 2)
    # per step of the tiny transformer: microseconds on an idle machine (tens on a busy one)
    assert 0 <= d < time_limit(1e-3)
    assert d <= p < time_limit(1e-2)   # d <= p holds by construction: the pipeline's is at least the executor's
