"""The runtime's own cost per step (meshdsl/search/overhead.py): measured, small, and the
pipeline runtime's at least the executor's."""
from __future__ import annotations

from meshdsl.search.calibrate import Calibration
from meshdsl.search.overhead import dispatch_seconds, median_time, pipeline_dispatch_seconds


def test_median_time_is_the_middle_call():
    calls = []
    assert median_time(lambda: calls.append(1), 5) >= 0
    assert len(calls) == 6   # one untimed call first


def test_runtime_cost_per_step_is_microseconds_and_a_pipeline_adds_to_it():
    cal = Calibration.defaults()
    d = dispatch_seconds(cal, 3)
    cal.dispatch_s = d
    p = pipeline_dispatch_seconds(cal, 2)
    assert 0 <= d < 1e-3          # per step of the tiny transformer, on any machine this runs on
    assert d <= p < 1e-2
