"""``meshdsl run --report`` on a plan without a pipeline, and ``--bucket-mb`` on the command line.

The report has, per step, the compute / exposed-communication / overhead split, how long
collectives were in flight, and every rank's measured RSS high-water mark, beside the
plan's own memory figures; ``plan --bucket-mb`` changes the plan's collectives.
"""
from __future__ import annotations

import json
import multiprocessing

import pytest

from meshdsl.tools import cli


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.timeout(300)
def test_run_report_splits_every_step_and_measures_memory_per_rank(capsys, tmp_path):
    path = tmp_path / "run.json"
    rc, out, err = run(capsys, "run", "transformer", "--tiny", "--mesh", "data:2", "--layout", "batch:data",
                       "--steps", "3", "--warmup", "1", "--report", str(path))
    assert rc == 0, out + err
    assert multiprocessing.active_children() == []
    r = json.loads(path.read_text())
    assert r["bucket_mb"] == 25.0 and len(r["ranks"]) == 2
    for src in (r, *r["ranks"]):
        assert len(src["step_ms"]) == 3
        for k in ("compute_ms", "exposed_comm_ms", "comm_in_flight_ms", "overhead_ms"):
            assert len(src[k]) == 3 and all(x >= 0 for x in src[k]), k
        # the split never exceeds the step it splits
        for s, c, e in zip(src["step_ms"], src["compute_ms"], src["exposed_comm_ms"]):
            assert c + e <= s * (1 + 1e-9)
    assert r["exposed_comm_ms"] == r["comm_ms"]
    # the gradient bucket is the one collective of a DP step besides the loss: it was in flight
    assert all(x > 0 for x in r["comm_in_flight_ms"])
    for rank in r["ranks"]:
        # measured: a process with torch imported holds tens of MiB at least
        assert all(m > 20 for m in rank["peak_rss_mib"])
        assert rank["peak_rss_mib"] == sorted(rank["peak_rss_mib"])  # a high-water mark never falls
    assert set(r["memory_plan"]) == {"params", "grads", "optimizer", "activations_peak"}
    assert "peak RSS per rank" in out


def test_plan_bucket_mb_changes_the_collectives(capsys):
    args = ("plan", "transformer", "--tiny", "--mesh", "data:2", "--layout", "batch:data", "--json")
    _, on, _ = run(capsys, *args)
    _, off, _ = run(capsys, *args, "--bucket-mb", "0")
    on, off = json.loads(on)["totals"], json.loads(off)["totals"]
    # the tiny transformer (2 layers): one bucket per layer inside the layer loop, one for the rest
    assert on["bucket_allreduce"]["count"] == 2 + 1 and "bucket_allreduce" not in off
    assert on["allreduce"]["count"] < off["allreduce"]["count"]
    with pytest.raises(SystemExit) as e:
        cli.main(list(args) + ["--bucket-mb", "-1"])
    assert e.value.code == 2 and "--bucket-mb" in capsys.readouterr().err
