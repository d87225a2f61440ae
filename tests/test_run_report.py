"""``meshdsl run --report`` on a plan without a pipeline, and ``--bucket-mb`` on the command line.

The report has, per step, the compute / exposed-communication / overhead split, how long
collectives were in flight, and every rank's measured RSS high-water mark, beside the
plan's own memory figures; ``plan --bucket-mb`` changes the plan's collectives.
"""
from __future__ import annotations

import json
import multiprocessing

import pytest
import torch

import meshdsl as md
from conftest import sgd_dense_losses
from meshdsl.lowering.memory import memory_report
from meshdsl.tools import cli
from meshdsl.train.step import training_outputs

# The run's losses are the dense program's but for the order of fp32 sums (each rank sums its
# half of the batch, then the allreduce adds the halves): a few ulps after 4 SGD steps
# (measured 2 ulps, 5e-7 at a loss of 3); a lost or doubled gradient moves them by 1e-3 or more.
LOSS_RTOL = 1e-5


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
    assert r["bucket_mb"] == 25.0 and [x["rank"] for x in r["ranks"]] == [0, 1]
    # the three timed steps follow the warmup step on the dense program's curve (lr 0.01, seed 0)
    model = md.load_model("transformer", tiny=True)
    torch.testing.assert_close(torch.tensor(r["loss"]), torch.tensor(sgd_dense_losses(model, 0.01, 1 + 3)[1:]),
                               rtol=LOSS_RTOL, atol=0)
    # the plan's own figures: every param and gradient whole on each rank (data parallel), no
    # optimizer state (plain SGD), and the activation peak read off the same plan
    plan = md.compile(training_outputs(model.loss, model.params, 0.01), "data:2", "batch:data")
    full = sum(t.shape.numel * 4 for t in model.params.values())
    want = memory_report(plan)
    assert r["memory_plan"] == {"params": full, "grads": full, "optimizer": 0,
                                "activations_peak": want["activations_peak"],
                                "saved_per_layer": want["saved_per_layer"]}
    timed = ("step_ms", "compute_ms", "comm_ms", "exposed_comm_ms", "comm_in_flight_ms", "overhead_ms")
    assert all(r[k] == r["ranks"][0][k] for k in timed)  # the top-level lists are rank 0's
    for src in r["ranks"]:
        assert len(src["step_ms"]) == 3 and src["exposed_comm_ms"] == src["comm_ms"]
        # compute, exposed communication and overhead split the executor's time, which the
        # step's wall time contains; the tiny model computes something on every step
        for s, c, e, o in zip(src["step_ms"], src["compute_ms"], src["exposed_comm_ms"], src["overhead_ms"]):
            assert c > 0 and e >= 0 and o >= 0 and c + e + o <= s * (1 + 1e-9), (s, c, e, o)
    # the gradient bucket is the one collective of a DP step besides the loss: it was in flight
    assert all(x > 0 for x in r["comm_in_flight_ms"])
    for rank in r["ranks"]:
        # measured: a process with torch imported holds tens of MiB at least
        assert all(m > 20 for m in rank["peak_rss_mib"])
        assert rank["peak_rss_mib"] == sorted(rank["peak_rss_mib"])  # a high-water mark never falls
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
