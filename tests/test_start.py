"""How ranks start (meshdsl/processes/start.py): from the forkserver by default, with the
launcher's environment, working directory and stdout/stderr as they are at launch."""
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import time_limit
from meshdsl.errors import DistributedError
from meshdsl.processes import launcher as launch
from meshdsl.processes import start


def _what_the_rank_sees(rank, key):
    # One write each: two ranks' lines written in pieces could interleave.
    sys.stdout.write(f"out from rank {rank}\n")
    sys.stdout.flush()
    sys.stderr.write(f"err from rank {rank}\n")
    sys.stderr.flush()
    comm = Path(f"/proc/{os.getpid()}/comm").read_text().strip() if sys.platform == "linux" else ""
    return os.environ.get(key), os.getcwd(), comm


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["forkserver", "spawn"])
def test_a_rank_sees_the_launcher_as_it_is_at_launch(how, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv(start.ENV, how)
    # The forkserver may have started long before, in another directory and environment:
    # what counts is the launcher's state when it starts this job.
    launch.spawn(_what_the_rank_sees, 1, args=("MESHDSL_TEST_START",))
    capfd.readouterr()
    monkeypatch.setenv("MESHDSL_TEST_START", f"set-now-{how}")
    monkeypatch.chdir(tmp_path)
    got = launch.spawn(_what_the_rank_sees, 2, args=("MESHDSL_TEST_START",))
    for rank, (value, cwd, comm) in enumerate(got):
        assert value == f"set-now-{how}"
        assert Path(cwd) == tmp_path
        if sys.platform == "linux":
            assert comm == f"meshdsl-rank{rank}"
    out, err = capfd.readouterr()
    assert sorted(out.splitlines()) == ["out from rank 0", "out from rank 1"], out
    assert "err from rank 0" in err and "err from rank 1" in err, err
    assert multiprocessing.active_children() == []


def test_forkserver_is_the_default_where_the_platform_has_it(monkeypatch):
    monkeypatch.delenv(start.ENV, raising=False)
    want = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    assert start.method() == want
    assert start.context().get_start_method() == want


@pytest.mark.parametrize("bad", ["fork", "thread", "Spawn"])
def test_an_unknown_start_method_is_a_clear_error(bad, monkeypatch):
    monkeypatch.setenv(start.ENV, bad)
    with pytest.raises(DistributedError) as e:
        launch.spawn(_what_the_rank_sees, 1, args=("X",))
    text = str(e.value)
    assert f"MESHDSL_START_METHOD={bad!r}" in text
    assert "forkserver, spawn" in text and "Fix: unset MESHDSL_START_METHOD" in text
    assert multiprocessing.active_children() == []


def _parent_pid(rank):
    return os.getppid()


@pytest.mark.timeout(90)
def test_a_forkserver_killed_between_jobs_is_replaced(monkeypatch):
    monkeypatch.delenv(start.ENV, raising=False)
    if start.method() != "forkserver":
        pytest.skip("no forkserver on this platform")
    server = launch.spawn(_parent_pid, 2)
    assert server[0] == server[1] != os.getpid(), "ranks are forked off the forkserver"
    os.kill(server[0], signal.SIGKILL)
    again = launch.spawn(_parent_pid, 2)
    assert again[0] == again[1] not in (server[0], os.getpid())
    assert multiprocessing.active_children() == []


@pytest.mark.timeout(120)
def test_a_launcher_with_stdout_closed_still_runs_its_ranks():
    # A daemon or a `cmd >&-` has no stdout: its ranks write theirs to /dev/null.
    code = ("import os, sys, meshdsl as md\n"
            "os.close(1)\n"
            "sys.stderr.write(f'ranks returned {md.spawn(abs, 2)}')\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop(start.ENV, None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr
    assert r.stderr.endswith("ranks returned [0, 1]"), r.stderr


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
@pytest.mark.timeout(90)
def test_stop_forkserver_ends_it_and_the_next_job_starts_another(monkeypatch):
    # What the command line does once its command is done (a server it started early and
    # never used would go on importing torch after the command ended).
    monkeypatch.delenv(start.ENV, raising=False)
    if start.method() != "forkserver":
        pytest.skip("no forkserver on this platform")
    server = launch.spawn(_parent_pid, 1)[0]
    start.stop_forkserver()
    end = time.monotonic() + time_limit(5.0)
    while _state(server) not in ("Z", "gone") and time.monotonic() < end:
        time.sleep(0.05)
    assert _state(server) in ("Z", "gone")
    assert launch.spawn(_parent_pid, 1)[0] not in (server, os.getpid())
    assert multiprocessing.active_children() == []
