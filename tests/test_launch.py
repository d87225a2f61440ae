"""The launcher: failures surface fast with the culprit's traceback, nothing is left running."""
from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from conftest import time_limit
from meshdsl.errors import DistributedError, MeshError
from meshdsl.processes import launcher as launch

COLLECTIVE_TIMEOUT_S = 60.0  # failures must be reported far sooner than this
NOTICE_S = 10.0  # from a rank failing to spawn raising (scaled); about 1 s on an idle machine


def _noticed_fast(pid_dir: Path) -> None:
    # Timed from the failure, not from spawn: starting torch in each child takes 1-2 s of CPU
    # and varies with machine load, the failure-to-report path should not.  The callers'
    # messages show the order: the failure itself was reported, not a survivor's collective
    # timeout (60 s) or the job's (50 s).
    delay = time.time() - float(Path(pid_dir, "failed_at").read_text())
    assert delay < time_limit(NOTICE_S), f"the failure took {delay:.1f} s to surface"


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _assert_all_gone(pid_dir: Path, expected: int | None, within_s: float = 5.0) -> None:
    """Every child that wrote a pid file is gone within ``within_s`` (scaled; ``expected``: how
    many must have written one)."""
    pids = [int(p.read_text()) for p in pid_dir.glob("*.pid")]
    assert expected is None or len(pids) == expected, f"expected {expected} pid files: {pids}"
    end = time.monotonic() + time_limit(within_s)
    while any(_alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "a child outlived the job"
    assert multiprocessing.active_children() == []


def _write_pid(pid_dir: str, rank: int) -> None:
    Path(pid_dir, f"{rank}.pid").write_text(str(os.getpid()))


def _raise_in_step(comm, pid_dir, bad_rank, bad_step):
    _write_pid(pid_dir, comm.rank)
    x = torch.ones(4)
    for step in range(6):
        if comm.rank == bad_rank and step == bad_step:
            Path(pid_dir, "failed_at").write_text(repr(time.time()))
            raise ValueError(f"boom in step {step}")
        x = comm.all_reduce([x], ("x",), "sum")[0]
    return x


def _sigkill_in_step(comm, pid_dir, bad_rank, bad_step):
    _write_pid(pid_dir, comm.rank)
    x = torch.ones(4)
    for step in range(6):
        if comm.rank == bad_rank and step == bad_step:
            Path(pid_dir, "failed_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        x = comm.all_reduce([x], ("x",), "sum")[0]
    return x


def _hang_on_rank_0(rank, pid_dir):
    _write_pid(pid_dir, rank)
    if rank == 0:
        time.sleep(1000)
    torch.distributed.barrier()


def _sleep_forever(rank, pid_dir):
    _write_pid(pid_dir, rank)
    time.sleep(1000)


def _port_and_rank(rank):
    return int(os.environ["MASTER_PORT"]), rank, torch.get_num_threads()


@pytest.mark.timeout(60)
def test_rank_that_raises_is_named_with_its_traceback(tmp_path):
    with pytest.raises(DistributedError) as e:
        launch.spawn(_raise_in_step, 3, args=(str(tmp_path), 2, 3), mesh="x:3",
                     collective_timeout=COLLECTIVE_TIMEOUT_S, timeout=50)
    text = str(e.value)
    assert "spawn: rank 2 of 3 raised an exception" in text
    assert "Traceback of rank 2:" in text
    assert "in _raise_in_step" in text and "ValueError: boom in step 3" in text
    assert "mesh: x:3" in text
    _noticed_fast(tmp_path)
    _assert_all_gone(tmp_path, 3)


@pytest.mark.timeout(60)
def test_rank_killed_by_a_signal_is_noticed_fast(tmp_path):
    with pytest.raises(DistributedError) as e:
        launch.spawn(_sigkill_in_step, 3, args=(str(tmp_path), 1, 2), mesh="x:3",
                     collective_timeout=COLLECTIVE_TIMEOUT_S, timeout=50)
    text = str(e.value)
    assert "spawn: rank 1 of 3 was killed by signal SIGKILL (exit code -9)" in text
    # The others were blocked in an all_reduce with a 60 s timeout.
    _noticed_fast(tmp_path)
    _assert_all_gone(tmp_path, 3)


@pytest.mark.timeout(60)
def test_hung_job_hits_the_hard_timeout(tmp_path):
    start = time.monotonic()
    # 3 s: rank 0 never finishes and rank 1 waits for it, so both are late whether or not
    # they have started by then (a longer timeout only waits longer).
    with pytest.raises(DistributedError) as e:
        launch.spawn(_hang_on_rank_0, 2, args=(str(tmp_path),), timeout=3,
                     collective_timeout=COLLECTIVE_TIMEOUT_S)
    took = time.monotonic() - start
    assert "spawn: ranks 0, 1 of 2 did not finish within 3 s" in str(e.value)
    # Not before the timeout (a lower bound no load can break), and soon after it.
    assert 3 <= took < 3 + time_limit(7.0), f"the job ended after {took:.1f} s"
    _assert_all_gone(tmp_path, None)  # on a loaded machine a rank may not have started yet


def _at_once(rank):
    return rank, os.environ.get("TORCH_DIST_INIT_BARRIER")


@pytest.mark.timeout(120)
def test_ranks_that_return_at_once_leave_no_peer_connecting():
    # A rank that returned at once could exit while its peer was still connecting gloo to it, and
    # the peer failed ("Connection closed by peer"): 20 of 200 such jobs beside one CPU hog on 2
    # cores.  Every group's creation now ends with a store barrier (0 of 200).
    for _ in range(20):
        assert launch.spawn(_at_once, 2, timeout=50) == [(0, "1"), (1, "1")]


def test_mesh_size_must_match_process_count():
    with pytest.raises(MeshError) as e:
        launch.spawn(_port_and_rank, 2, mesh="data:2; model:2")
    text = str(e.value)
    assert "mesh 'data:2; model:2' has 4 devices but the job has 2 processes" in text
    assert "Rule: a distributed run needs exactly one process per mesh device" in text
    assert "Fix: launch 4 processes" in text
    assert multiprocessing.active_children() == []


def _listening(pid: int) -> list[str]:
    """``addr:port`` of every TCP socket process ``pid`` listens on (from /proc, no psutil)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        for line in lines:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            hex_ip, hex_port = f[1].split(":")
            raw = bytes.fromhex(hex_ip)
            # /proc prints the address as host-order 32-bit words
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            ip = socket.inet_ntop(socket.AF_INET if width == 8 else socket.AF_INET6, raw)
            out.append(f"{ip}:{int(hex_port, 16)}")
    return out


def _sockets_while_running(comm, launcher_pid):
    comm.barrier()  # every rank has joined: the store and gloo are listening now
    mine = _listening(os.getpid())
    parent = _listening(launcher_pid) if comm.rank == 0 else []
    comm.barrier()  # nobody closes anything while another rank looks
    return mine, parent


@pytest.mark.timeout(60)
def test_every_listening_socket_is_on_loopback():
    got = launch.spawn(_sockets_while_running, 2, args=(os.getpid(),), mesh="x:2", timeout=50, collective_timeout=20)
    parent = got[0][1]
    children = [s for mine, _ in got for s in mine]
    assert parent, "the launcher hosts the rendezvous store: it must be listening"
    assert all(s.startswith(("127.0.0.1:", "::ffff:127.0.0.1:")) for s in parent + children), \
        f"launcher: {parent}; ranks: {children}"
    assert multiprocessing.active_children() == []


@pytest.mark.timeout(60)
def test_rdzv_host_opens_only_the_store():
    # The explicit opt-in: the store listens on every interface, gloo stays on loopback.
    got = launch.spawn(_sockets_while_running, 2, args=(os.getpid(),), mesh="x:2", timeout=50, collective_timeout=20,
                       rdzv_host="0.0.0.0")
    parent = got[0][1]
    children = [s for mine, _ in got for s in mine]
    assert any(s.startswith("0.0.0.0:") for s in parent), parent
    assert children and all(s.startswith("127.0.0.1:") for s in children), children


def test_rendezvous_host_that_is_not_ours_is_a_clean_error():
    with pytest.raises(DistributedError) as e:
        launch.spawn(_port_and_rank, 2, rdzv_host="192.0.2.1")  # TEST-NET-1: never local
    assert "cannot listen for the rendezvous on '192.0.2.1'" in str(e.value)
    assert multiprocessing.active_children() == []


def _stop_in_step(comm, pid_dir, bad_rank, bad_step):
    _write_pid(pid_dir, comm.rank)
    x = torch.ones(4)
    for step in range(6):
        if comm.rank == bad_rank and step == bad_step:
            Path(pid_dir, "failed_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)
        x = comm.all_reduce([x], ("x",), "sum")[0]
    return x


HANG_TIMEOUT_S = 3.0


@pytest.mark.timeout(60)
def test_stopped_rank_is_blamed_not_the_rank_that_timed_out(tmp_path):
    with pytest.raises(DistributedError) as e:
        launch.spawn(_stop_in_step, 2, args=(str(tmp_path), 1, 3), mesh="x:2",
                     collective_timeout=HANG_TIMEOUT_S, timeout=50)
    text = str(e.value)
    assert "spawn: rank 1 of 2 stopped making progress" in text, text
    assert "waited for it in collective #4" in text and "is stopped by a signal" in text
    assert "rank 0 failed while waiting for it" in text
    # Reported at the collective timeout, plus under 2 s (scaled), not at the job's 50 s.
    delay = time.time() - float(Path(tmp_path, "failed_at").read_text())
    assert delay < HANG_TIMEOUT_S + time_limit(2.0), f"the hang took {delay:.1f} s to surface"
    _assert_all_gone(tmp_path, 2)


def test_torchrun_env_detection(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    assert not launch.in_torchrun()
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(DistributedError) as e:
        launch.init_from_env("gloo")
    assert "WORLD_SIZE is not set" in str(e.value) and "torchrun" in str(e.value)
    for k, v in dict(WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(_free_port())).items():
        monkeypatch.setenv(k, v)
    assert launch.in_torchrun()
    try:
        assert launch.init_from_env("gloo", timeout=10) == 0
        assert launch.launch(_comm_summary, "data:1") == [("data:1", (0,))]
    finally:
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _comm_summary(comm):
    return str(comm.mesh), comm.ranks


@pytest.mark.timeout(60)
def test_children_die_with_the_launcher(tmp_path):
    # A launcher process that gets SIGKILLed cannot clean up; its children must still go.
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from meshdsl.processes.launcher import spawn
        import test_launch
        if __name__ == "__main__":
            spawn(test_launch._sleep_forever, 2, args=({str(tmp_path)!r},))
    """)
    proxy = subprocess.Popen([sys.executable, "-c", script])
    try:
        end = time.monotonic() + 40
        while len(list(tmp_path.glob("*.pid"))) < 2 and time.monotonic() < end:
            time.sleep(0.1)
            assert proxy.poll() is None, "the launcher exited early"
        time.sleep(0.2)  # let the second pid file be fully written
    finally:
        proxy.kill()
        proxy.wait()
    _assert_all_gone(tmp_path, 2, within_s=5.0)
