"""Calibration: the fit recovers known lines, the sweep runs on real processes and lands in the cache.

Every test points ``MESHDSL_CACHE_DIR`` at its own folder, so the user's cache
is never read or written.
"""
from __future__ import annotations

import json
import os

import pytest

from conftest import time_limit
from meshdsl.search import sweep
from meshdsl.search.calibrate import Calibration, cache_path, fit, fit_line, interpolate, load, monotone, save
from meshdsl.search.sweep import job_sizes
from meshdsl.tools.cli import main


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHDSL_CACHE_DIR", str(tmp_path))


def test_fit_recovers_an_exact_line():
    xs = [1e3, 1e4, 1e5, 1e6]
    line = fit_line(xs, [20e-6 + x / 2e9 for x in xs])
    assert line.fixed_s == pytest.approx(20e-6, rel=1e-9)
    assert line.rate == pytest.approx(2e9, rel=1e-9)


def test_fit_never_goes_negative():
    line = fit_line([1.0, 2.0, 3.0], [0.0, 1.0, 2.0])  # intercept -1: refit through the origin
    assert line.fixed_s == 0.0 and line.rate > 0


def test_fit_with_a_measured_intercept_fits_only_the_rate():
    xs = [1e3, 1e4, 1e5, 1e6]
    ys = [20e-6 + x / 2e9 for x in xs]
    line = fit_line(xs, ys, fixed=1e-6)   # the tiny kernel's time, not the large sizes' intercept
    assert line.fixed_s == 1e-6
    assert line.rate == pytest.approx(2e9, rel=0.05)


def test_no_cache_means_the_defaults():
    assert load().source == "defaults"


def test_the_cache_is_written_through_a_new_file_never_a_planted_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("mine")
    cal = Calibration.defaults()
    path = cache_path(cal.backend, cal.host)
    os.symlink(victim, path + ".tmp")      # the name the cache was once written through
    assert save(cal) == path
    assert victim.read_text() == "mine" and load().to_json() == cal.to_json()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([os.path.basename(path), "victim",
                                                                 os.path.basename(path) + ".tmp"])


def test_collective_price_uses_the_ring_factor():
    c = Calibration.defaults()
    line = c.collectives["allreduce"][2]
    # 4 ranks: 2 * 3/4 of the bytes on the wire, three ring steps of latency (one measured at n=2).
    assert c.collective("allreduce", 10**6, 4) == pytest.approx(3 * line.fixed_s + 1.5 * 10**6 / line.rate)
    assert c.collective("allreduce", 10**6, 1) == 0.0
    assert c.collective("recv", 1000, 2) == c.collective("send", 1000, 2)


def test_interpolate_is_piecewise_linear_and_continues_the_last_segment():
    pts = [(1000, 1e-4), (2000, 2e-4), (4000, 1e-3)]
    assert interpolate(pts, 10) == 1e-4                      # below the samples: the smallest's time
    assert interpolate(pts, 1500) == pytest.approx(1.5e-4)
    assert interpolate(pts, 3000) == pytest.approx(6e-4)
    assert interpolate(pts, 6000) == pytest.approx(1.8e-3)   # past them: the last segment's slope
    assert interpolate([(1000, 1e-4)], 10**6) == 1e-4


def test_monotone_drops_noise_spikes_but_keeps_the_curve():
    # a spike at 2000 (noise only ever adds) is lowered to the larger size's time
    assert monotone([(1000, 3e-4), (2000, 9e-4), (4000, 5e-4), (8000, 2e-3)]) == \
        [(1000, 3e-4), (2000, 5e-4), (4000, 5e-4), (8000, 2e-3)]


def test_measured_samples_price_collectives_per_job_size():
    """A collective is priced from the samples of its own job size (4 processes on a 2-core
    host are slower than 2), interpolated; an unmeasured group size falls back to the line."""
    two = {"allreduce": {2: [(1000, 1e-4), (10**6, 1e-3)]}}
    four = {"allreduce": {2: [(1000, 4e-4), (10**6, 4e-3)], 4: [(1000, 8e-4), (10**6, 8e-3)]}}
    kernels = {"matmul": [(1e6, 1e-4), (1e8, 1e-3)], "elementwise": [(1e3, 1e-6), (1e6, 1e-4)]}
    c = fit({2: two, 4: four}, kernels)
    assert c.collective("allreduce", 10**6, 2, job=2) == pytest.approx(1e-3)
    assert c.collective("allreduce", 10**6, 2, job=4) == pytest.approx(4e-3)
    assert c.collective("allreduce", 500500, 4, job=4) == pytest.approx(4.4e-3)
    assert c.collective("allreduce", 10**6, 2, job=3) == pytest.approx(4e-3)   # the next larger job's
    assert c.collective("allreduce", 10**6, 4, job=64) == pytest.approx(8e-3)  # past them: the largest
    line = c.collectives["allreduce"][4]
    assert line.fixed_s == 8e-4                      # the summary's latency: the smallest message's time
    assert c.collective("allreduce", 10**6, 8, job=8) == pytest.approx(
        7 / 3 * line.fixed_s + 2 * 7 / 8 * 10**6 / line.rate)
    # a bucket is priced as its members' kind over one buffer; a receive as its send
    assert c.collective("bucket_allreduce", 10**6, 2, job=2) == c.collective("allreduce", 10**6, 2, job=2)
    back = Calibration.from_json(json.loads(json.dumps(c.to_json())))
    assert back.samples == c.samples


def test_job_sizes():
    assert job_sizes(2) == [2] and job_sizes(4) == [2, 4] and job_sizes(6) == [2, 4, 6] and job_sizes(8) == [2, 4, 8]


def test_a_large_job_sweeps_fewer_sizes():
    # 16 MiB per rank gathered on 16 ranks would be 256 MiB each: a large job stops earlier
    assert sweep.sizes_for(2, False) == sweep.SIZES and sweep.sizes_for(4, False) == sweep.SIZES
    big = sweep.sizes_for(16, False)
    assert big == sweep.SIZES[:len(big)] and max(big) * 16 <= sweep.MAX_GATHERED and len(big) >= 2


def test_kernel_price_slows_down_past_the_cores():
    c = Calibration.defaults()
    one = c.kernel(True, 10**9, 0, num_ranks=c.cores)
    assert c.kernel(True, 10**9, 0, num_ranks=2 * c.cores) == pytest.approx(2 * one)


def test_calibrate_quick_measures_saves_and_prints(tmp_path, capsys):
    assert main(["calibrate", "--quick", "--nproc", "2"]) == 0
    out = capsys.readouterr().out
    assert "allreduce" in out and "send/recv" in out and "GFLOP/s" in out
    path = cache_path("gloo")
    assert os.path.dirname(path) == str(tmp_path)
    with open(path) as f:
        d = json.load(f)
    assert set(d["collectives"]) == set(sweep.KINDS)
    loaded = load()
    assert loaded.source == "measured"
    for kind in sweep.KINDS:
        line = loaded.collectives[kind][2]
        assert line.fixed_s >= 0 and line.rate > 0
    # measured rates: 1e8 FLOPs and 1e7 bytes each take under a second (scaled), on any machine
    assert 1e8 / loaded.matmul.rate < time_limit(1.0) and 1e7 / loaded.elementwise.rate < time_limit(1.0)
    # per-kernel costs timed on kernels with almost no work: microseconds, not zero
    assert 0 < loaded.matmul.fixed_s < time_limit(1e-3) and 0 < loaded.elementwise.fixed_s < time_limit(1e-3)
    assert loaded.pipeline_dispatch_s >= loaded.dispatch_s >= 0
    assert d["pipeline_dispatch_s"] == loaded.pipeline_dispatch_s
    # the measured samples are kept, by job size, and price the collectives
    pts = loaded.samples[2]["allgather"][2]
    assert [b for b, _ in pts] == sorted(b for b, _ in pts) and len(pts) == len(sweep.QUICK_SIZES)
    assert loaded.collective("allgather", pts[-1][0], 2, job=2) == pytest.approx(pts[-1][1])
    assert set(loaded.after_compute_s) == {2} and loaded.after_compute_s[2][2] >= 0
    assert "reached from compute" in out


def test_search_measure_writes_the_scatter_plot(tmp_path, capsys):
    png = tmp_path / "scatter.png"
    assert main(["search", "mlp", "--tiny", "--nproc", "2", "--measure", "--top", "2", "--steps", "1",
                 "--plot", str(png), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 2 and all(r["measured_ms"] > 0 for r in rows)
    assert [r["measured_ms"] for r in rows] == sorted(r["measured_ms"] for r in rows)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
