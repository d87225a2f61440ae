"""The ``meshdsl`` command line: plan tables and JSON, check exit codes, clean
user errors, and model loading by name and by path.

Most tests call :func:`meshdsl.tools.cli.main` in-process (fast); two run
``python -m meshdsl`` as a subprocess to cover the real entry point.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import run_cli
from meshdsl.tools import cli
from meshdsl.train.model import ModelError, find_model_file, load_model

ROOT = Path(__file__).resolve().parents[1]
TP = ["--mesh", "data:2; model:2", "--layout", "batch:data; heads:model; d_ff:model"]


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_plan_table(capsys):
    rc, out, err = run(capsys, "plan", "mlp", "--tiny", "--mesh", "data:2; model:2",
                       "--layout", "batch:data; d_ff:model")
    assert rc == 0, err
    for word in ("w1", "einsum", "forward", "backward", "update", "allreduce(data)", "allreduce(model)",
                 "d_ff:8", "{d_ff:model}", "collectives per training step"):
        assert word in out, word


def test_plan_only_comm_and_totals(capsys):
    args = ["plan", "transformer", "--tiny", *TP]
    _, full, _ = run(capsys, *args)
    _, comm, _ = run(capsys, *args, "--only-comm")
    rc, totals, _ = run(capsys, *args, "--totals")
    assert rc == 0
    assert "repeat/attn/add (add) x2" in comm and "gather" not in comm  # gather does not communicate
    assert "gather" in full and len(comm) < len(full)
    assert "plan  mesh" not in totals and "collectives per training step" in totals


def test_plan_json_keys_phases_and_totals(capsys):
    rc, out, _ = run(capsys, "plan", "transformer", "--tiny", "--json", *TP)
    assert rc == 0
    report = json.loads(out)
    assert {"ops", "totals"} <= set(report)
    for e in report["ops"]:
        assert {"op", "phase", "local_shapes", "collectives", "flops"} <= set(e)
        assert e["phase"] in ("forward", "backward", "update")
        for c in e["collectives"]:
            assert set(c) == {"kind", "axes", "bytes"}
    assert {e["phase"] for e in report["ops"]} == {"forward", "backward", "update"}
    # The per-op collectives, each counted `times` over, add up to the totals.
    sums: dict = {}
    for e in report["ops"]:
        for c in e["collectives"]:
            t = sums.setdefault(c["kind"], {"count": 0, "bytes": 0})
            t["count"] += e["times"]
            t["bytes"] += e["times"] * c["bytes"]
    assert sums == report["totals"] and report["totals"]["allreduce"]["count"] > 0
    # The layers' ops are listed under the repeat, run once per layer (tiny: 2 layers).
    layer_ops = [e for e in report["ops"] if e["label"].startswith("repeat/")]
    assert layer_ops and all(e["times"] == 2 for e in layer_ops)
    wq = next(e for e in report["ops"] if e["label"] == "wq")
    assert wq["local_shapes"] == [{"layer": 2, "d_model": 8, "heads": 2, "d_head": 2}]


def test_plan_json_matches_the_plan(capsys):
    rc, out, _ = run(capsys, "plan", "mlp", "--tiny", "--json", "--mesh", "data:2", "--layout", "batch:data")
    model = load_model("mlp", tiny=True)
    plan = md.compile(model.train_step(), "data:2", "batch:data")
    assert json.loads(out)["totals"] == plan.totals()


def test_check_passes(capsys):
    rc, out, _ = run(capsys, "check", "transformer", "--tiny", *TP)
    assert rc == 0
    assert "OK" in out and "grad/wq" in out


def test_check_fails_over_tolerance(capsys):
    # Tensor parallelism re-orders fp32 sums, so some outputs differ by rounding:
    # a zero tolerance must fail (exit 1), which shows the comparison is live.
    rc, out, _ = run(capsys, "check", "transformer", "--tiny", "--tol", "0", *TP)
    assert rc == 1
    assert "FAIL" in out


def test_bad_layout_is_a_clean_error(capsys):
    rc, out, err = run(capsys, "check", "transformer", "--tiny", "--mesh", "data:2",
                       "--layout", "batch:data; heads:modle")
    assert rc == 2
    assert "unknown mesh axis 'modle'" in err and "^^^^^" in err
    assert "Traceback" not in err and out == ""


def test_indivisible_layout_is_a_clean_error(capsys):
    rc, _, err = run(capsys, "plan", "mlp", "--tiny", "--mesh", "data:3", "--layout", "batch:data", "--strict-splits")
    assert rc == 2
    assert "not divisible" in err and "Traceback" not in err


def test_missing_model(capsys):
    rc, _, err = run(capsys, "plan", "transformr", "--tiny", "--mesh", "data:2")
    assert rc == 2
    assert "no model named 'transformr'" in err and "Did you mean 'transformer'" in err
    rc, _, err = run(capsys, "plan", "nowhere/model.py", "--mesh", "data:2")
    assert rc == 2 and "does not exist" in err


def test_model_by_path(capsys, tmp_path, monkeypatch):
    src = (ROOT / "models" / "mlp.py").read_text()
    path = tmp_path / "my_mlp.py"
    path.write_text(src)
    monkeypatch.chdir(tmp_path)  # names still resolve via models/ beside the package
    # --bucket-mb 0: one allreduce per gradient (2) and the loss's
    rc, out, _ = run(capsys, "plan", str(path), "--tiny", "--json", "--mesh", "data:2", "--layout", "batch:data",
                     "--bucket-mb", "0")
    assert rc == 0 and json.loads(out)["totals"]["allreduce"]["count"] == 3
    assert find_model_file("transformer") == (ROOT / "models" / "transformer.py").resolve()


def test_model_file_without_protocol(capsys, tmp_path):
    path = tmp_path / "empty.py"
    path.write_text("x = 1\n")
    rc, _, err = run(capsys, "plan", str(path), "--mesh", "data:2")
    assert rc == 2 and "has no 'Config'" in err
    with pytest.raises(ModelError):
        load_model(str(path))


def _python_m(*argv):
    return subprocess.run([sys.executable, "-m", "meshdsl", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow   # by default `python -m meshdsl plan mlp --tiny --json` runs (its totals checked) in
# test_installed_package_ships_the_models, from the built wheel, and in test_a_reader_that_stops_early_gets_no_traceback
def test_python_m_meshdsl():
    r = _python_m("plan", "mlp", "--tiny", "--json", "--mesh", "data:2", "--layout", "batch:data", "--bucket-mb", "0")
    assert r.returncode == 0, r.stderr
    assert set(json.loads(r.stdout)["totals"]) == {"allreduce"}


@pytest.mark.slow   # by default: a user error under `python -m meshdsl` exits 2 with one message and no traceback in
# tests/test_catalogue.py::test_python_m_user_error[bad layout --nproc 2]; this layout string's caret in process
# (test_parse.py's bad layouts; this file's in-process user errors)
def test_python_m_meshdsl_user_error():
    r = _python_m("plan", "mlp", "--tiny", "--mesh", "data:2", "--layout", "batch:(data")
    assert r.returncode == 2
    assert "Invalid layout string" in r.stderr and "^" in r.stderr and "Traceback" not in r.stderr


ZERO_GRAD_MODEL = '''
"""A per-seq bias cancelled by a layer norm: its gradient is zero in exact math."""
from dataclasses import dataclass

import torch

import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 8
    seq: int = 8
    d: int = 16

    @classmethod
    def tiny(cls):
        return cls()


def build(cfg=Config()):
    b, s, d, e = md.Dim("batch", cfg.batch), md.Dim("seq", cfg.seq), md.Dim("d", cfg.d), md.Dim("e", cfg.d)
    with md.Graph("zero_grad") as g:
        x = md.input("x", [b, s, d])
        w = md.param("w", [d, e], fan_out=[e])
        b_t = md.param("b_t", [s], scale=1.0)
        y = md.layer_norm(md.einsum("batch seq d, d e -> batch seq e", x, w) + b_t, e)
        loss = md.reduce_mean(y * y * y)

    def feeds(seed=0):
        return {"x": torch.randn(cfg.batch, cfg.seq, cfg.d, generator=torch.Generator().manual_seed(seed))}

    return md.Model(g, loss, {"w": w, "b_t": b_t}, feeds, cfg)
'''


def test_check_passes_a_gradient_that_is_zero_in_exact_math(capsys, tmp_path):
    path = tmp_path / "zero_grad.py"
    path.write_text(ZERO_GRAD_MODEL)
    # Splitting the normalised dim re-orders the layer norm's sums: grad/b_t is rounding
    # noise (~1e-8) on both sides, which a tolerance relative to its own size fails.
    rc, out, _ = run(capsys, "check", str(path), "--mesh", "data:2", "--layout", "e:data")
    assert rc == 0, out
    assert "grad/b_t" in out and "OK" in out


def test_check_still_fails_a_real_mismatch(capsys):
    want = {"loss": torch.tensor(2.0), "grad/w": torch.full((4,), 0.5), "grad/b": torch.zeros(3)}
    ok = {k: v.clone() for k, v in want.items()}
    ok["grad/b"] += 1e-8  # rounding noise on a zero gradient
    assert cli.report_check(want, ok, 1e-4, "test") == 0
    for name, delta in (("grad/w", 0.05), ("grad/b", 1e-3), ("loss", 1e-2)):
        bad = {k: v.clone() for k, v in want.items()}
        bad[name] = bad[name] + delta  # off by O(the magnitudes involved): a layout bug
        assert cli.report_check(want, bad, 1e-4, "test") == 1, name
    nan = {k: v.clone() for k, v in want.items()}
    nan["grad/w"][0] = float("nan")
    assert cli.report_check(want, nan, 1e-4, "test") == 1
    capsys.readouterr()


@pytest.mark.timeout(240)
def test_installed_package_ships_the_models(tmp_path):
    # A non-editable install must resolve `mlp` without the repository: build the wheel,
    # unpack it (a wheel is a zip), and run from a directory that is not the repository.
    import zipfile

    wheel = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "-q", "-w", str(tmp_path / "dist"), str(ROOT)], capture_output=True,
                           text=True, timeout=200)
    assert wheel.returncode == 0, wheel.stderr
    (whl,) = (tmp_path / "dist").glob("meshdsl-*.whl")
    site = tmp_path / "site"
    zipfile.ZipFile(whl).extractall(site)
    assert (site / "meshdsl" / "models" / "mlp.py").is_file()
    r = subprocess.run([sys.executable, "-m", "meshdsl", "plan", "mlp", "--tiny", "--json", "--mesh", "data:2",
                        "--layout", "batch:data", "--bucket-mb", "0"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(site)})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["totals"]["allreduce"]["count"] == 3


def test_shipped_models_use_only_the_public_api():
    # A model file is an example users copy: it imports `meshdsl` itself, never internals.
    import ast

    for path in sorted((ROOT / "models").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("meshdsl."):
                pytest.fail(f"{path.name} imports from {node.module}")
            if isinstance(node, ast.Import):
                assert all(not a.name.startswith("meshdsl.") for a in node.names), path.name
    assert md.Model is load_model("mlp", tiny=True).__class__
    for name in ("Model", "TrainStep", "SimulatedComm", "TorchComm", "launch", "spawn", "load_model"):
        assert hasattr(md, name), name


def test_a_reader_that_stops_early_gets_no_traceback():
    """``meshdsl plan --json | true``: the pipe closes under the writer; the command ends quietly."""
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "meshdsl", "plan", "transformer", "--tiny", "--mesh", "data:2",
                             "--layout", "batch:data", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()   # the reader goes away before the writer starts: its first write finds the pipe closed
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and b"Traceback" not in err and b"internal error" not in err, err.decode()


def test_check_notes_a_schedule_that_has_no_effect(capsys):
    """As `meshdsl plan` notes it: --schedule on a layout that pipelines nothing is said, once."""
    rc, out, err = run(capsys, "check", "mlp", "--tiny", "--mesh", "data:2", "--layout", "batch:data",
                       "--schedule", "1f1b")
    assert rc == 0, err
    assert out.count("note: schedule '1f1b' has no effect: the layout pipelines no repeat") == 1, out


def test_an_unknown_flag_is_the_commands_error_with_the_closest_flag(capsys):
    """It was the top parser's 'meshdsl: error' and `meshdsl --help`; a misspelt flag is named by
    name only ('--mesh' given to search is not a misspelt '--measure')."""
    rc, out, err = run_cli(capsys, ["plan", "mlp", "--tiny", "--mesh", "data:1", "--lyout", "batch:data"])
    assert rc == 2 and out == "", err
    assert err == ("meshdsl plan: error: unrecognized arguments: --lyout batch:data. Did you mean '--layout'? "
                   "(see `meshdsl plan --help`)\n"), err
    rc, _, err = run_cli(capsys, ["search", "mlp", "--tiny", "--nproc", "2", "--mesh", "data:2"])
    assert rc == 2 and err.startswith("meshdsl search: error: unrecognized arguments: --mesh data:2.") \
        and "Did you mean" not in err, err


_BAD_FILES = {"syntax.py": "def build(cfg)\n", "raises.py": "import meshdsl\nraise RuntimeError('boom')\n",
              "noconfig.py": "def build(cfg):\n    return None\n"}


@pytest.mark.parametrize("argv, words", [
    (["plan", "mlp", "--tiny", "--mesh", "data:2", "--layout", "bach:data"], ["dim 'bach'", "^^^^", "Did you mean 'batch'"]),
    (["plan", "mlp", "--tiny", "--mesh", "data:2; data:2", "--layout", "batch:data"], ["named twice", "^^^^"]),
    (["check", "mlp", "--tiny", "--mesh", "data:2", "--nproc", "3"], ["2 devices but the job has 3 processes"]),
    (["plan", "{tmp}/missing.py", "--mesh", "data:1"], ["does not exist"]),
    (["plan", "{tmp}/syntax.py", "--mesh", "data:1"], ["line 1: SyntaxError", "^"]),
    (["plan", "{tmp}/raises.py", "--mesh", "data:1"], ["raised RuntimeError while being imported: boom", "line 2"]),
    (["plan", "{tmp}/noconfig.py", "--mesh", "data:1"], ["has no 'Config'"]),
    (["train", "mlp", "--tiny", "--mesh", "data:1", "--steps", "0"], ["--steps: 0 is out of range"]),
    (["train", "mlp", "--tiny", "--mesh", "data:1", "--lr", "abc"], ["--lr: 'abc' is not a number"]),
    (["check", "mlp", "--tiny", "--mesh", "data:1", "--microbatches", "0"], ["--microbatches: 0 is out of range"]),
    (["train", "mlp", "--tiny", "--mesh", "data:1", "--config", "bacth=8"], ["no field 'bacth'", "^^^^"]),
    (["train", "mlp", "--tiny", "--mesh", "data:1", "--init", "{tmp}"], ["is a directory", "meshdsl export"]),
    (["train", "mlp", "--tiny", "--mesh", "data:1", "--resume-from", "{tmp}/step-00000001"],
     ["no such checkpoint directory"]),
])
def test_a_plausible_mistake_is_exit_2_with_a_clear_message(capsys, tmp_path, no_spawn, argv, words):
    for name, text in _BAD_FILES.items():
        (tmp_path / name).write_text(text)
    rc, _, err = run_cli(capsys, [a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert rc == 2 and "Traceback" not in err, err
    assert ("Fix: " in err or "fix: " in err) and all(w in err for w in words), err
