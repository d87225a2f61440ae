"""Checks the command line runs before any work starts (tools/preflight.py, train/run_outputs.py).

A job whose predicted memory (the plan's params, gradients, optimizer state and peak
activations) exceeds this machine's is refused by ``run``, ``check`` and ``train`` before
anything is allocated or any process starts, and ``plan`` warns with the figure;
``MESHDSL_MEMORY_CHECK=0`` turns the refusal into that warning.  An ``--out`` that is a
file (or goes through one) is a clean exit 2.
"""
from __future__ import annotations

import multiprocessing
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import meshdsl as md
from conftest import run_cli, time_limit
from meshdsl.lowering.memory import memory_report
from meshdsl.tools import cli, preflight
from meshdsl.train.model import load_model
from meshdsl.train.run_outputs import MetricsWriter, OutputError

# An MLP whose two params are 2 * 1e5 * 1e7 * 4 B = 7.3 TiB (as many again for grads): far beyond any machine,
# yet it compiles in a blink (a plan holds shapes, never tensors).
BIG = "d_model=100000,d_ff=10000000"
FAST_S = 3.0  # a refusal comes before any process or tensor: well under a second on an idle machine




def test_plan_warns_with_the_figure_and_still_prints_the_plan(capsys):
    rc, out, err = run_cli(capsys, ["plan", "mlp", "--mesh", "data:1", "--config", BIG, "--totals"])
    assert rc == 0 and "FLOPs per rank per step" in out
    assert err.startswith("meshdsl plan: warning: predicted memory ") and "TiB per rank exceeds" in err
    assert "(MemTotal)" in err or "(cgroup memory.max)" in err


@pytest.mark.parametrize("argv,words", [
    (["run", "mlp", "--mesh", "data:2", "--layout", "batch:data"], "for the 2 ranks on this machine"),
    (["check", "mlp", "--mesh", "data:1", "--nproc", "1"], "TiB per rank"),
    (["train", "mlp"], "TiB per rank"),
], ids=["run", "check --nproc", "train"])
def test_a_config_beyond_memory_is_refused_before_anything_runs(capsys, no_spawn, argv, words):
    start = time.monotonic()
    rc, _, err = run_cli(capsys, [*argv, "--config", BIG])
    assert rc == cli.EXIT_USAGE, err
    assert "Traceback" not in err
    assert "error: the predicted memory, " in err and words in err and "exceeds this machine's memory" in err
    assert "the largest rank: params 7.3 TiB, " in err  # 2 * 1e12 fp32
    assert "Fix: use a smaller --config" in err and "MESHDSL_MEMORY_CHECK=0 runs it anyway" in err
    assert time.monotonic() - start < time_limit(FAST_S)
    assert multiprocessing.active_children() == []


def test_the_escape_hatch_runs_it_with_a_warning(capsys, monkeypatch):
    monkeypatch.setattr(preflight, "total_memory_bytes", lambda: (2**10, "MemTotal"))  # a 1 KiB machine
    argv = ["check", "mlp", "--tiny", "--mesh", "data:2", "--layout", "batch:data"]
    rc, _, err = run_cli(capsys, argv)
    assert rc == cli.EXIT_USAGE and "exceeds this machine's memory, 1.0 KiB (MemTotal)" in err
    monkeypatch.setenv(preflight.MEMORY_CHECK_ENV, "0")
    rc, out, err = run_cli(capsys, argv)
    assert rc == 0 and "OK" in out
    assert "meshdsl check: warning: predicted memory" in err and "MESHDSL_MEMORY_CHECK=0: running anyway" in err


def test_a_process_holds_its_micro_batches_once():
    # With micro-batches the plan has a virtual rank per (process, micro-batch); a process's
    # memory is its largest, not their sum, and data-parallel processes all need the same.
    model = load_model("mlp", tiny=True)
    plan = md.compile(model.train_step(), "data:2", "batch:data", microbatches=2)
    assert plan.mesh.size == 4
    per_process = sum(memory_report(plan).values())
    here, per_rank, _ = preflight.predicted_bytes(plan, ranks_here=2)
    assert per_rank == per_process and here == 2 * per_process
    assert preflight.predicted_bytes(plan, ranks_here=1)[0] == per_process  # one local rank of a torchrun job


def test_on_gpus_the_limit_is_a_gpu_memory(monkeypatch):
    # This machine may have no GPU: torch.cuda answers as for two 80 GiB cards.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=80 * 2**30))
    model = load_model("mlp", tiny=True)
    preflight.check_memory(md.compile(model.train_step(), "data:2", "batch:data"), "run", gpu=True)
    big = load_model("mlp", d_model=100000, d_ff=10000000)
    with pytest.raises(preflight.UsageError, match=r"per rank, exceeds the GPU's memory, 80.0 GiB \(torch.cuda\)"):
        preflight.check_memory(md.compile(big.train_step(), "data:2", "batch:data"), "run", gpu=True)


def test_out_naming_a_file_is_a_clean_error(capsys, no_spawn, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    rc, _, err = run_cli(capsys, ["train", "mlp", "--tiny", "--steps", "1", "--out", str(afile)])
    assert rc == cli.EXIT_USAGE and "Traceback" not in err
    assert f"--out {afile}: the run cannot write its outputs there: it is a file, not a folder." in err
    rc, _, err = run_cli(capsys, ["train", "mlp", "--tiny", "--steps", "1", "--out", str(afile / "run")])
    assert rc == cli.EXIT_USAGE and f"'{afile}' on its path is a file, not a folder" in err


def test_fit_out_naming_a_file_is_an_output_error(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(OutputError, match="it is a file, not a folder") as e:
        MetricsWriter(afile)  # what md.fit's rank 0 opens first in out=
    assert "Fix: name a new folder, e.g. out='runs/my-run'" in str(e.value)
    MetricsWriter(tmp_path / "new" / "run").close()  # a new folder, parents and all, is made
    assert Path(tmp_path / "new" / "run" / "metrics.jsonl").exists()


def test_the_simulated_memory_refusal_names_the_users_mesh():
    """A plan with micro-batches runs on the mesh plus a virtual axis: the refusal says the mesh the
    user gave, its ranks, and the micro-batch count (lowering/users_terms.py), not the virtual axis."""
    m = load_model("mlp", tiny=True)
    plan = md.compile({"loss": m.loss}, "data:2", "batch:data", microbatches=2)
    with pytest.raises(preflight.UsageError) as e:
        preflight.check_simulated_memory(plan, available=1)
    text = str(e.value)
    assert "_mb" not in text, text
    assert text.startswith("the simulated run of mesh 'data:2' needs up to"), text
    assert "  mesh: data:2\n  micro-batches: 2\n  ranks: 2, all simulated in this process\n" in text, text
