"""Optimizer flags of the command line (:mod:`meshdsl.tools.optim_args`): the same in
``plan``, ``check`` and ``run``; ``plan`` reports the optimizer's collectives and the memory per rank."""
from __future__ import annotations

import json

import pytest

import meshdsl as md
from meshdsl.tools import cli
from meshdsl.train.model import load_model
from meshdsl.train.step import optimizer_outputs

ZERO2 = ["--mesh", "data:2", "--layout", "batch:data; grads.d_model:data; opt.d_model:data"]


def run(capsys, *argv):
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:  # argparse's flag-type errors exit from the parser
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_plan_json_shows_the_optimizer_collectives_and_memory(capsys):
    rc, out, err = run(capsys, "plan", "transformer", "--tiny", "--json", "--optimizer", "adamw",
                       "--betas", "0.9,0.99", "--weight-decay", "0.05", "--clip-norm", "1", *ZERO2, "--bucket-mb", "0")
    assert rc == 0, err
    report = json.loads(out)
    model = load_model("transformer", tiny=True)
    plan = md.compile(optimizer_outputs(model.loss, model.params, md.AdamW(), True), "data:2",
                      "batch:data; grads.d_model:data; opt.d_model:data", bucket_mb=0)
    assert report["totals"] == plan.totals() and report["memory"] == md.memory_report(plan)
    update = [c for e in report["ops"] if e["phase"] == "update" for c in e["collectives"]]
    assert {c["kind"] for c in update} >= {"allgather", "allreduce"}  # new params; the global norm
    assert "reduce_scatter" in report["totals"] and report["memory"]["optimizer"] > 0
    assert "AdamW" in report["optimizer"] and "0.99" in report["optimizer"]


def test_plan_table_prints_memory_per_rank(capsys):
    rc, out, _ = run(capsys, "plan", "mlp", "--tiny", "--totals", "--optimizer", "sgd", "--momentum", "0.9",
                     "--mesh", "data:2", "--layout", "batch:data; opt.d_ff:data")
    assert rc == 0
    assert "memory per rank: params" in out and "optimizer state" in out and "momentum=0.9" in out


@pytest.mark.parametrize("flags,words", [
    (["--betas", "0.9"], ["--betas", "0.9,0.95"]),
    (["--betas", "0.9,1.5"], ["[0, 1)"]),
    (["--clip-norm", "-1"], ["--clip-norm", "out of range"]),     # 0 is no clipping
    (["--weight-decay", "-1"], ["--weight-decay"]),
    (["--optimizer", "adamw", "--momentum", "0.9"], ["--momentum", "does not read it"]),
    (["--optimizer", "sgd", "--betas", "0.9,0.9"], ["--betas", "does not read it"]),
    (["--optimizer", "lion"], ["invalid choice"]),
])
@pytest.mark.parametrize("command", ["plan", "check", "run"])
def test_bad_optimizer_flags_are_usage_errors(capsys, command, flags, words):
    rc, _, err = run(capsys, command, "mlp", "--tiny", "--mesh", "data:2", *flags)
    assert rc == cli.EXIT_USAGE
    for w in words:
        assert w in err, (w, err)


def test_check_one_optimizer_step_matches_dense(capsys):
    rc, out, err = run(capsys, "check", "transformer", "--tiny", "--optimizer", "adamw", "--lr", "0.01",
                       "--clip-norm", "0.5", *ZERO2)
    assert rc == 0, err
    assert "grad_norm" in out and "new/opt/wq/exp_avg" in out and "OK" in out


@pytest.mark.timeout(120)
def test_check_and_run_on_processes_take_the_optimizer(capsys):
    fsdp = ["--mesh", "data:2", "--layout", "batch:data; params.d_model:data"]
    rc, out, err = run(capsys, "check", "transformer", "--tiny", "--optimizer", "adamw", "--lr", "0.01",
                       "--clip-norm", "0.5", "--nproc", "2", *fsdp)
    assert rc == 0, err
    assert "2 processes" in out and "new/opt/wq/exp_avg_sq" in out
    rc, out, err = run(capsys, "run", "transformer", "--tiny", "--optimizer", "sgd", "--momentum", "0.9",
                       "--steps", "2", "--warmup", "0", *fsdp)
    assert rc == 0, err
    assert "loss" in out
