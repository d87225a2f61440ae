"""``meshdsl calibrate``'s run: both sweeps, the fit, the runtime's own cost, saved.

The sweeps are :mod:`.sweep`'s, the fit and the cache file :mod:`.calibrate`'s, the
runtime's cost per step :mod:`.overhead`'s; this module runs them in order and reports
progress while the collective sweep's processes run.
"""
from __future__ import annotations

import os
import tempfile
import threading

from .calibrate import Calibration, fit, save
from .overhead import dispatch_seconds, pipeline_dispatch_seconds
from .sweep import sweep_collectives, sweep_kernels


def calibrate(nproc: int = 2, backend: str = "gloo", quick: bool = False, advance=lambda k: None,
              timeout: float = 120.0) -> Calibration:
    """Run both sweeps on this machine, fit them, save the result and return it.

    Args:
      nproc: processes of the collective sweep; a power of two measures groups of 2, 4, ... nproc.
      backend: the torch.distributed backend to measure.
      quick: fewer sizes and repetitions (a few seconds; for tests).
      advance: called with the number of samples just finished (drives a progress bar).
      timeout: seconds the collective sweep may take before its processes are killed.

    Returns:
      The saved :class:`~.calibrate.Calibration` (see :func:`~.calibrate.cache_path`).
    """
    kernels = sweep_kernels(quick, tick=lambda: advance(1))
    with tempfile.TemporaryDirectory() as tmp:
        progress = os.path.join(tmp, "done")
        box: dict = {}

        def work():
            try:
                box["samples"] = sweep_collectives(nproc, backend, quick, progress, timeout)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread below
                box["error"] = e

        t = threading.Thread(target=work, daemon=True)
        t.start()
        seen = 0
        while t.is_alive():
            t.join(0.2)
            try:
                with open(progress) as f:
                    now = int(f.read() or 0)
            except (OSError, ValueError):
                continue
            if now > seen:
                advance(now - seen)
                seen = now
        if "error" in box:
            raise box["error"]
    samples, after = box["samples"]
    cal = fit(samples, kernels, backend, after)
    cal.dispatch_s = dispatch_seconds(cal, 5 if quick else 20)
    cal.pipeline_dispatch_s = pipeline_dispatch_seconds(cal, 3 if quick else 10)
    advance(1)
    save(cal)
    return cal
