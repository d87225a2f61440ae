"""Every user error of the command line, as the user sees it.

Each case asserts the exit code, that no traceback is printed, and a key phrase
of the message.  Most run in-process through :func:`meshdsl.tools.cli.main`
(fast); a few run ``python -m meshdsl`` (and torchrun) as a real subprocess.
Cases that would start processes spy on :func:`meshdsl.processes.launcher.spawn` to
show that an invalid job never starts one, and are timed.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import run_cli, time_limit
from meshdsl.tools import cli, preflight

ROOT = Path(__file__).resolve().parents[1]
# A user error surfaces within this (scaled by time_limit); that it comes before any process
# starts is pinned by the no_spawn fixture, not by the clock.
FAST_S = 3.0

MLP = ["mlp", "--tiny", "--mesh", "data:2", "--layout", "batch:data"]
PIPE = ["transformer", "--tiny", "--mesh", "stage:2", "--layout", "layer:stage"]  # tiny batch: 4




def _syntax_error(tmp: Path) -> str:
    f = tmp / "broken.py"
    f.write_text("import meshdsl as md\n\ndef build(cfg)\n    return 1\n")
    return str(f)


def _raises_on_import(tmp: Path) -> str:
    f = tmp / "raising.py"
    f.write_text("import meshdsl as md\n\ndef helper():\n    return {}['missing']\n\nhelper()\n")
    return str(f)


def _raises_in_build(tmp: Path) -> str:
    f = tmp / "bad_build.py"
    f.write_text("from dataclasses import dataclass\n\n@dataclass\nclass Config:\n    n: int = 2\n"
                 "    @classmethod\n    def tiny(cls):\n        return cls()\n\n"
                 "def build(cfg):\n    return 1 / 0\n")
    return str(f)


def _meshdsl_error_in_build(tmp: Path) -> str:
    f = tmp / "dup_dim.py"
    f.write_text("from dataclasses import dataclass\n\nimport meshdsl as md\n\n\n@dataclass\nclass Config:\n"
                 "    d: int = 4\n\n\ndef build(cfg):\n    d = md.Dim('d', cfg.d)\n    with md.Graph():\n"
                 "        md.param('w', [d, d])\n")
    return str(f)


def _directory(tmp: Path) -> str:
    (tmp / "mymodels").mkdir()
    (tmp / "mymodels" / "a.py").write_text("x = 1\n")
    return str(tmp / "mymodels")


# (id, argv, exit code, key phrases); "{tmp:maker}" is replaced by maker(tmp_path).
CASES = [
    # Validation before spawning: no process starts (see the no_spawn fixture).
    ("run bad layout --nproc 2", ["run", "mlp", "--tiny", "--mesh", "data:2", "--layout", "bach:data",
                                  "--nproc", "2"], 2, ["dim 'bach'", "Did you mean 'batch'"]),
    ("run bad mesh --nproc 2", ["run", "mlp", "--tiny", "--mesh", "data:two", "--layout", "batch:data",
                                "--nproc", "2"], 2, ["Invalid mesh string"]),
    ("run unknown model --nproc 2", ["run", "mlpp", "--tiny", "--mesh", "data:2", "--nproc", "2"], 2,
     ["no model named 'mlpp'", "Did you mean 'mlp'"]),
    ("check bad layout --nproc 2", ["check", "mlp", "--tiny", "--mesh", "data:2", "--layout",
                                    "batch:dta", "--nproc", "2"], 2, ["unknown mesh axis 'dta'"]),
    ("check unknown model --nproc 2", ["check", "transformr", "--mesh", "data:2", "--nproc", "2"], 2,
     ["no model named 'transformr'"]),
    ("run nproc not the mesh size", ["run", *MLP, "--nproc", "3"], 2,
     ["has 2 devices but the job has 3 processes"]),
    ("plan bad mesh", ["plan", "mlp", "--mesh", "data:2;; model:"], 2, ["Invalid mesh string"]),
    ("check bad layout", ["check", "mlp", "--tiny", "--mesh", "data:2", "--layout", "batch:modle"], 2,
     ["unknown mesh axis 'modle'"]),
    # Numeric flags: name the flag, the range and the fix.
    ("steps 0", ["run", *MLP, "--steps", "0"], 2, ["--steps", "1 <= N", "fix:"]),
    ("steps -1", ["run", *MLP, "--steps", "-1"], 2, ["--steps", "1 <= N"]),
    ("timeout 0", ["run", *MLP, "--timeout", "0"], 2, ["--timeout", "> 0"]),
    ("timeout -1", ["check", *MLP, "--timeout", "-1"], 2, ["--timeout", "> 0"]),
    ("timeout nan", ["run", *MLP, "--timeout", "nan"], 2, ["--timeout", "finite number > 0"]),
    ("seed 2**70", ["check", *MLP, "--seed", str(2**70)], 2, ["--seed", "0 <= N <= 9223372036854775807"]),
    ("seed -1", ["run", *MLP, "--seed", "-1"], 2, ["--seed", "0 <= N"]),
    ("job-timeout 0", ["run", *MLP, "--job-timeout", "0"], 2, ["--job-timeout", "> 0"]),
    ("job-timeout -1", ["check", *MLP, "--nproc", "2", "--job-timeout", "-1"], 2, ["--job-timeout"]),
    ("warmup -5", ["run", *MLP, "--warmup", "-5"], 2, ["--warmup", "0 <= N"]),
    ("lr inf", ["run", *MLP, "--lr", "inf"], 2, ["--lr", "finite number"]),
    ("lr nan", ["plan", *MLP, "--lr", "nan"], 2, ["--lr", "finite number"]),
    ("tol -1", ["check", *MLP, "--tol", "-1"], 2, ["--tol", ">= 0"]),
    ("tol nan", ["check", *MLP, "--tol", "nan"], 2, ["--tol", ">= 0"]),
    ("nproc 0", ["run", *MLP, "--nproc", "0"], 2, ["--nproc", "1 <= N"]),
    ("steps not a number", ["run", *MLP, "--steps", "ten"], 2, ["--steps", "not an integer"]),
    ("plan --json --totals", ["plan", *MLP, "--json", "--totals"], 2,
     ["--totals: not allowed with argument --json"]),
    ("unknown flag", ["plan", *MLP, "--mesh-size", "2"], 2, ["unrecognized arguments", "--help"]),
    # Other bad input.
    ("model syntax error", ["plan", "{tmp:syntax}", "--mesh", "data:2"], 2,
     ["broken.py', line 3: SyntaxError", "def build(cfg)"]),
    ("model raises on import", ["plan", "{tmp:import}", "--mesh", "data:2"], 2,
     ["raising.py' raised KeyError while being imported", "in helper", "{}['missing']"]),
    ("model raises in build", ["check", "{tmp:build}", "--tiny", "--mesh", "data:2"], 2,
     ["bad_build.py' raised ZeroDivisionError while building the model", "return 1 / 0"]),
    ("model build raises a meshdsl error", ["plan", "{tmp:mderr}", "--mesh", "data:2"], 2,
     ["while building model file", "dup_dim.py\", line 14, in build", "appear twice"]),
    ("model is a directory", ["plan", "{tmp:dir}", "--mesh", "data:2"], 2,
     ["is a directory, not a model file", "a.py"]),
    ("model file missing", ["plan", "nowhere/model.py", "--mesh", "data:2"], 2, ["does not exist"]),
    ("too many processes", ["run", "mlp", "--tiny", "--mesh", "data:1000"], 2,
     ["1000 local processes, more than the limit of", "--max-procs 1000"]),
    ("too many processes, check", ["check", "mlp", "--tiny", "--mesh", "data:1000", "--nproc", "1000"], 2,
     ["more than the limit"]),
    # Pipelines (--microbatches, --schedule): refused before any process starts.
    ("run batch not divisible by micro-batches",
     ["run", *PIPE, "--microbatches", "3"], 2,
     ["batch 4 is not divisible by 3 micro-batches", "Fix: use a batch that is a multiple of 3"]),
    ("check --nproc batch not divisible by micro-batches",
     ["check", *PIPE, "--microbatches", "8", "--nproc", "2"], 2, ["batch 4 is not divisible by 8 micro-batches"]),
    ("plan unknown schedule", ["plan", *PIPE, "--schedule", "1f1bb"], 2,
     ["--schedule: invalid choice: '1f1bb'", "'gpipe', '1f1b'"]),
    ("run virtual-stage schedule", ["run", *PIPE, "--schedule", "interleaved"], 2,
     ["--schedule: invalid choice: 'interleaved'"]),
    ("microbatches 0", ["run", *PIPE, "--microbatches", "0"], 2, ["--microbatches", "1 <= N", "fix:"]),
    ("microbatches not a number", ["plan", *PIPE, "--microbatches", "four"], 2,
     ["--microbatches", "not an integer"]),
    ("run --report in a missing folder", ["run", *PIPE, "--report", "{tmp:missing_dir}"], 2,
     ["--report", "does not exist", "Fix: pass a file in an existing, writable folder"]),
    ("run --report is a folder", ["run", *PIPE, "--report", "{tmp:dir}"], 2, ["--report", "is a folder"]),
    ("simulated mesh too big for memory", ["check", "transformer", "--mesh", "a:64; b:64"], 2,
     ["needs up to", "GiB", "of memory available", "--tiny, a smaller mesh, or --nproc"]),
]
if not torch.cuda.is_available():
    CASES.append(("nccl without CUDA", ["run", *MLP, "--backend", "nccl"], 2,
                  ["CUDA is not available", "--backend gloo"]))

_MAKERS = {"syntax": _syntax_error, "import": _raises_on_import, "build": _raises_in_build, "mderr": _meshdsl_error_in_build,
           "dir": _directory, "missing_dir": lambda tmp: str(tmp / "no" / "such" / "run.json")}


@pytest.mark.parametrize("argv,code,phrases", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_cli_user_error(capsys, tmp_path, no_spawn, argv, code, phrases):
    argv = [_MAKERS[a[5:-1]](tmp_path) if a.startswith("{tmp:") else a for a in argv]
    start = time.monotonic()
    rc, out, err = run_cli(capsys, argv)
    took = time.monotonic() - start
    assert rc == code, err
    assert "Traceback" not in err and "Traceback" not in out
    for p in phrases:
        assert p in err, f"{p!r} not in:\n{err}"
    assert took < time_limit(FAST_S), f"the error took {took:.1f} s"
    assert multiprocessing.active_children() == []


def test_memory_estimate_refuses_what_does_not_fit(capsys, monkeypatch):
    # A small run, against a machine with 1 KiB free: the estimate, not the mesh size, decides.
    monkeypatch.setattr(preflight, "available_bytes", lambda: 2**10)
    rc, _, err = run_cli(capsys, ["check", "transformer", "--tiny", "--mesh", "data:2", "--layout",
                                  "batch:data"])
    assert rc == 2 and "more than the 1.0 KiB of memory available" in err
    monkeypatch.setattr(preflight, "available_bytes", lambda: 2**40)
    rc, out, _ = run_cli(capsys, ["check", "transformer", "--tiny", "--mesh", "data:2", "--layout",
                                  "batch:data"])
    assert rc == 0 and "OK" in out


def test_bare_name_never_runs_a_file_from_the_current_directory(capsys, tmp_path, monkeypatch):
    marker = tmp_path / "executed"
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "mlp.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (tmp_path / "mymodel.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_cli(capsys, ["plan", "mlp", "--tiny", "--mesh", "data:2", "--totals"])
    assert rc == 0, err
    assert not marker.exists(), "a bare name executed ./models/mlp.py"
    rc, _, err = run_cli(capsys, ["plan", "mymodel", "--mesh", "data:2"])
    assert rc == 2 and "no model named 'mymodel'" in err and "./mymodel.py" in err
    assert not marker.exists()
    # Given as a path, the local file is the model (and runs).
    rc, _, err = run_cli(capsys, ["plan", "./models/mlp.py", "--mesh", "data:2"])
    assert marker.exists() and rc == 2 and "has no 'Config'" in err


def test_internal_error_exits_3_with_traceback(capsys, monkeypatch):
    def broken(plan):
        raise RuntimeError("a bug")
    monkeypatch.setattr(cli, "plan_report", broken)
    rc, _, err = run_cli(capsys, ["plan", *MLP])
    assert rc == 3
    assert "internal error, please report" in err and "Traceback" in err and "RuntimeError: a bug" in err


def test_help_lists_exit_codes(capsys):
    rc, out, _ = run_cli(capsys, ["run", "--help"])
    assert rc == 0
    assert "exit codes:" in out and "130" in out and "internal error" in out


# ------------------------------------------------------------------ subprocess

def _python_m(*argv, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "meshdsl", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)


# "steps 0" with -m slow: by default its argparse error is said once by processes running `python -m meshdsl` in
# tests/test_torchrun.py::test_every_torchrun_rank_exits_2_on_a_user_error[bad flag], and in process in CASES above
@pytest.mark.parametrize("argv,phrase", [
    (["run", "mlp", "--tiny", "--mesh", "data:2", "--layout", "bach:data", "--nproc", "2"], "dim 'bach'"),
    pytest.param(["run", *MLP, "--steps", "0"], "argument --steps: 0 is out of range", marks=pytest.mark.slow),
], ids=["bad layout --nproc 2", "steps 0"])
def test_python_m_user_error(argv, phrase):
    r = _python_m(*argv)
    assert r.returncode == 2, r.stderr
    assert phrase in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.count("error:") == 1  # one message, not one per rank


def test_torchrun_rank_with_busy_master_port_is_a_clean_error():
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(busy.getsockname()[1]))
    try:
        r = _python_m("run", "mlp", "--tiny", "--mesh", "data:1", "--steps", "1", "--timeout", "5",
                      env=env)
    finally:
        busy.close()
    assert r.returncode == 2, r.stderr
    assert "is already in use" in r.stderr and "--master-port" in r.stderr
    assert "Traceback" not in r.stderr


def _ranks_under(pid: int) -> list[int]:
    """The rank processes among ``pid``'s descendants (ranks name themselves meshdsl-rankN)."""
    parent = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass

    def under(p: int) -> bool:
        while p in parent and p != pid:
            p = parent[p]
        return p == pid

    out = []
    for p in parent:
        try:
            if under(p) and Path(f"/proc/{p}/comm").read_text().startswith("meshdsl-rank"):
                out.append(p)
        except OSError:
            pass
    return out


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.timeout(90)
def test_ctrl_c_stops_every_rank_with_one_line():
    # SIGINT to the whole process group, as a terminal's Ctrl-C sends it.
    p = subprocess.Popen([sys.executable, "-m", "meshdsl", "run", *MLP, "--steps", "1000000"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        end = time.monotonic() + 60
        ranks: list[int] = []
        while time.monotonic() < end:
            ranks = _ranks_under(p.pid)
            if len(ranks) == 2:
                break
            assert p.poll() is None, p.communicate()
            time.sleep(0.1)
        assert len(ranks) == 2, "the ranks did not start"
        time.sleep(3.0)  # let them get into training
        os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 130, err
    assert err.strip() == "meshdsl run: interrupted; all 2 ranks stopped"
    end = time.monotonic() + time_limit(5.0)
    while not all(_gone(r) for r in ranks) and time.monotonic() < end:
        time.sleep(0.1)
    assert all(_gone(r) for r in ranks), "a rank outlived Ctrl-C"
