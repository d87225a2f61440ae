"""``meshdsl search``'s report (meshdsl/tools/search_cli.py)."""
from __future__ import annotations

import dataclasses

from meshdsl.search.calibrate import load
from meshdsl.tools.search_cli import _figures


def test_the_report_says_whether_the_cost_model_is_calibrated():
    cal = load()                                    # the tests run with no calibration cached
    assert cal.source == "defaults"
    # it said "defaults figures of vm", which read as this host's figures
    assert _figures(cal) == f"default figures ({cal.host} uncalibrated)"
    assert _figures(dataclasses.replace(cal, source="measured")) == f"measured figures of {cal.host}"
