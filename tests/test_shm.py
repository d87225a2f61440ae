"""Collectives through shared memory (comm/shm.py) among the gloo ranks of one host.

The shared-memory path folds each chunk in group order, as the simulated mesh does, so
its results are bitwise the simulated mesh's for every kind, op and dtype, including
tensors larger than one slot (they go in pieces), and so are allreduces in flight together
(comm/shm_ring.py: started without waiting for the other ranks, more than its ring holds,
waited for in any order, by the caller or by a helper thread), and so are rows of the reduce
buffer (groups of 2 and 4, each member folding its chunk into the shared result rows; the
results kept through later allreduces).  A group whose ranks are on
different hosts keeps gloo; a rank that never arrives is named once the collective timeout passes;
nothing is left in /dev/shm, even when the member that makes a segment is killed the
moment it exists (a segment has no name: its descriptor is handed to the others).
"""
from __future__ import annotations

import glob
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import time_limit
from meshdsl.errors import DistributedError
from meshdsl.processes import launcher as launch
from meshdsl.comm import shm, shm_ring
from meshdsl.collectives import REDUCE
from meshdsl.comm.distributed import TorchComm
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.layout.mesh import Mesh

pytestmark = pytest.mark.skipif(not shm.supported(), reason="shared-memory collectives need x86-64 Linux")

MESH = "a:2; b:2"
AXES = [("a",), ("b",), ("a", "b"), ("b", "a")]
BIG = shm.SLOT_BYTES // 4 + 1000  # float32 elements: more than one slot, so two pieces


def _inputs(rank: int) -> list[tuple[torch.Tensor, str]]:
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(3, 5, generator=g), "sum"), (torch.randn(BIG, generator=g), "sum"),
            (torch.randn(7, generator=g).to(torch.bfloat16), "sum"), (torch.randn(6, generator=g), "max"),
            (torch.randn(6, generator=g), "min"), (torch.randint(-5, 5, (9,), generator=g), "sum")]


def _shm_files() -> set[str]:
    return set(glob.glob("/dev/shm/meshdsl-*"))


def _collectives(comm):
    """Every kind the shared memory runs, over every axes tuple, on this rank's inputs."""
    out = []
    for axes in AXES:
        for x, op in _inputs(comm.rank):
            out.append(comm.all_reduce([x], axes, op)[0])
        for x, _ in _inputs(comm.rank)[:2]:  # the second exceeds a slot: it goes in pieces
            out.append(comm.all_gather([x.view(-1, 1)], axes, dim=1)[0])
            out.append(comm.reduce_scatter([x.reshape(-1)[:(x.numel() // 4) * 4]], axes, dim=0, op="sum")[0])
            out.append(comm.all_to_all([x.reshape(-1)[:(x.numel() // 4) * 4].view(4, -1)], axes, 0, 1)[0])
    for axes in AXES:   # rows in the reduce buffer, reduced where they lie (groups of 2 and of 4)
        rows = comm.reduce_buffer(axes, 2 * 1001, torch.float32, 2)[0].view(2, 1001)
        rows.copy_(_rows(comm.rank))
        handles = [comm.start("bucket_allreduce", [rows[l]], axes, {"op": op}) for l, op in ((1, "sum"), (0, "max"))]
        out += [h.wait()[0].clone() for h in handles]
    return out, [g is not None for g in comm._shm.values()], {k: v["count"] for k, v in comm.stats.items()}


def _rows(rank: int) -> torch.Tensor:
    return torch.randn(2, 1001, generator=torch.Generator().manual_seed(20 + rank))


def _same_on_the_simulated_mesh(sim, xs_of_rank, axes) -> list:
    """What :func:`_collectives` computes, per rank, for ``axes`` on the simulated mesh."""
    inputs = [xs_of_rank(r) for r in range(4)]
    per_step = [sim.all_reduce([inputs[r][j][0] for r in range(4)], axes, op) for j, (_, op) in enumerate(inputs[0])]
    for j in range(2):
        xs = [inputs[r][j][0] for r in range(4)]
        cut = [x.reshape(-1)[:(x.numel() // 4) * 4] for x in xs]
        per_step += [sim.all_gather([x.view(-1, 1) for x in xs], axes, dim=1),
                     sim.reduce_scatter(cut, axes, dim=0, op="sum"),
                     sim.all_to_all([c.view(4, -1) for c in cut], axes, 0, 1)]
    return per_step


@pytest.mark.timeout(120)
def test_shared_memory_collectives_are_bitwise_the_simulated_mesh():
    before = _shm_files()
    got = launch.spawn(_collectives, 4, mesh=MESH, timeout=100)
    sim = SimulatedComm(Mesh.parse(MESH))
    want = [w for axes in AXES for w in _same_on_the_simulated_mesh(sim, _inputs, axes)]
    want += [sim.all_reduce([_rows(r)[l] for r in range(4)], axes, op)
             for axes in AXES for l, op in ((1, "sum"), (0, "max"))]
    for r in range(4):
        assert len(got[r][0]) == len(want)
        for k, w in enumerate(want):
            assert torch.equal(got[r][0][k], w[r]), (r, k)
    for _, used, counts in got:
        assert used and all(used)  # every group of the mesh went through shared memory
        assert counts == {"allreduce": 24, "allgather": 8, "reduce_scatter": 8, "alltoall": 8, "bucket_allreduce": 8}
    assert _shm_files() == before  # unlinked as soon as every member had it mapped


RING_OPS = ["sum", "sum", "max", "sum", "min", "sum", "sum", "sum"]


def _split_phase(start, rank: int, started: Path):
    """Allreduces begun by ``start(x, op)`` together and waited for in reverse: rank 1 starts only
    once rank 0 has started the first three (so starting never waits for the others while the
    ring has room); the rest overflow the ring (rank 0 waits for rank 1 to read what it would
    overwrite).  Returns the results and the inputs."""
    g = torch.Generator().manual_seed(rank)
    sizes = (5, 700_000, shm_ring.PIECE_BYTES // 4 + 1000, *[1_400_000] * 4)  # the third goes in 2 pieces
    xs = [torch.randn(n, generator=g) for n in sizes] + [torch.randint(-5, 5, (9,), generator=g)]
    assert sum(x.numel() * 4 for x in xs) > shm_ring.RING_BYTES  # the ring wraps
    if rank == 1:
        deadline = time.monotonic() + 30
        while not started.exists():
            assert time.monotonic() < deadline, "rank 0's starts waited for rank 1"
            time.sleep(0.01)
    handles = []
    for k, (x, op) in enumerate(zip(xs, RING_OPS)):
        handles.append(start(x, op))
        if k == 2 and rank == 0:
            started.write_text("")
    return [h.wait() for h in reversed(handles)][::-1], xs


ROW = 1_000_003   # float32 elements of a reserved row: an odd count, cut into chunks off a line's end
ROW_OPS = ("sum", "max", "sum")


def _reserved_rounds(comm, rounds: int = 3):
    """Three rounds of a data-parallel step's pattern: gradient rows in the reduce buffer, rows
    started from the last (bucket allreduces, nothing copied in), an allreduce placed while they
    are not all started, all waited for in start order, then allreduces of more than the ring
    holds.  Each round's rows take the space of the last's.  Rank 1 starts all but the first
    row late, as a rank still in its backward would (rank 0 waits for it).  Returns per round
    the inputs, the results, whether each row's result is its span of the result rows and
    whether those kept the results through the later allreduces (which go after the
    reservation)."""
    g = torch.Generator().manual_seed(10 + comm.rank)
    out = []
    for _ in range(rounds):
        rows, reduced = (x.view(3, ROW) for x in comm.reduce_buffer(("x",), 3 * ROW, torch.float32, 3))
        xs, other = torch.randn(3, ROW, generator=g), torch.randn(700_000, generator=g)
        rows.copy_(xs)   # as the backward's matmuls write them
        handles = [comm.start("bucket_allreduce", [rows[2]], ("x",), {"op": ROW_OPS[2]})]
        if comm.rank == 1:
            time.sleep(0.2)
        handles += [comm.start("allreduce", [other], ("x",), {"op": "sum"}),
                    *[comm.start("bucket_allreduce", [rows[l]], ("x",), {"op": ROW_OPS[l]}) for l in (1, 0)]]
        ys = [h.wait()[0] for h in handles]
        in_place = [ys[k].data_ptr() == reduced[l].data_ptr() for k, l in ((0, 2), (2, 1), (3, 0))]
        ys = [y.clone() for y in ys]
        for _ in range(5):
            comm.all_reduce([torch.ones(1_400_000)], ("x",), "sum")
        kept = torch.equal(reduced, torch.stack([ys[3], ys[2], ys[0]]))
        out.append((xs, other, ys, in_place + [kept]))
    return out


def _in_flight_together(comm, tmp: Path):
    """:func:`_split_phase` through the communicator (its segment's allreduces run by the caller),
    then :func:`_reserved_rounds`, then :func:`_split_phase` through a second segment of the group
    whose helper thread runs them."""
    shm.helper_for = lambda local_procs: False
    comm.all_reduce([torch.ones(1)], ("x",), "sum")  # the group's segment is made here, by both
    by_caller = _split_phase(lambda x, op: comm.start("allreduce", [x], ("x",), {"op": op}), comm.rank,
                             tmp / "caller")
    reserved = _reserved_rounds(comm)
    shm.helper_for = lambda local_procs: True
    s = comm._slice(("x",))
    grp = shm.ShmGroup.open(s.pg, 2, 20.0, "test", 2)

    class Started:
        def __init__(self, x, op):
            self.y = x.clone()
            self.work = grp.start_allreduce(self.y, REDUCE[op], s.me, s.members)

        def wait(self):
            self.work.wait()
            return [self.y]
    by_helper = _split_phase(Started, comm.rank, tmp / "helper")
    return by_caller, by_helper, [t.name for t in threading.enumerate()], reserved


@pytest.mark.timeout(60)
def test_allreduces_in_flight_together_are_bitwise_the_simulated_mesh(tmp_path):
    got = launch.spawn(_in_flight_together, 2, args=(tmp_path,), mesh="x:2", collective_timeout=20, timeout=50)
    sim = SimulatedComm(Mesh.parse("x:2"))
    for run in range(2):   # by the caller, by a helper thread
        for k, op in enumerate(RING_OPS):
            want = sim.all_reduce([got[0][run][1][k], got[1][run][1][k]], ("x",), op)
            for r in range(2):
                assert torch.equal(got[r][run][0][k][0], want[r]), (run, r, k)
    assert all("meshdsl-shm-ring" in threads for _, _, threads, _ in got)
    # rows in the reduce buffer: each member folds its half into the result rows, bitwise the
    # simulated mesh's fold on both ranks
    for rnd, ((xs0, other0, _, _), (xs1, other1, _, _)) in enumerate(zip(got[0][3], got[1][3])):
        want = [sim.all_reduce([xs0[2], xs1[2]], ("x",), ROW_OPS[2]), sim.all_reduce([other0, other1], ("x",), "sum"),
                *[sim.all_reduce([xs0[l], xs1[l]], ("x",), ROW_OPS[l]) for l in (1, 0)]]
        for r in range(2):
            _, _, ys, in_place = got[r][3][rnd]
            assert all(in_place), (rnd, r)
            for k, w in enumerate(want):
                assert torch.equal(ys[k], w[r]), (rnd, r, k)


def _on_other_hosts(comm):
    shm._host_key = lambda: comm.rank  # as if each rank ran on a host of its own
    x = torch.full((5,), float(comm.rank + 1))
    return comm.all_reduce([x], ("x",), "sum")[0], list(comm._shm.values())


@pytest.mark.timeout(60)
def test_ranks_on_different_hosts_keep_gloo():
    for y, groups in launch.spawn(_on_other_hosts, 2, mesh="x:2", timeout=50):
        assert torch.equal(y, torch.full((5,), 3.0))
        assert groups == [None]


def _late_rank(comm):
    x = torch.ones(4)
    comm.all_reduce([x], ("x",), "sum")  # the group's segment is made here, by both
    if comm.rank == 1:
        time.sleep(6)
    return comm.all_reduce([x], ("x",), "sum")[0]


@pytest.mark.timeout(60)
def test_a_rank_that_does_not_arrive_is_named_after_the_collective_timeout():
    start = time.monotonic()
    with pytest.raises(DistributedError) as e:
        launch.spawn(_late_rank, 2, mesh="x:2", collective_timeout=2.0, timeout=50)
    text = str(e.value)
    assert "rank 0 of 2 raised an exception" in text
    assert "shared-memory collective: rank(s) [1] of group (0, 1) did not arrive within 2 s" in text
    assert time.monotonic() - start < time_limit(30.0)  # the collective timeout ended it, not the job's 50 s


def _flags(comm):
    return comm.shm, comm.all_reduce([torch.ones(2)], ("x",), "sum")[0], list(comm._shm.values())


def _off(rank):
    return TorchComm("x:2", shm=False).shm


def test_turned_off_by_argument_or_environment(monkeypatch):
    assert launch.spawn(_off, 2, timeout=50) == [False, False]
    monkeypatch.setenv("MESHDSL_SHM", "0")
    for on, y, groups in launch.spawn(_flags, 2, mesh="x:2", timeout=50):
        assert not on and groups == [] and torch.equal(y, torch.full((2,), 2.0))


def _verbose(comm, other_hosts):
    import contextlib
    import io
    if other_hosts:
        shm._host_key = lambda: comm.rank
    comm.verbose, err = True, io.StringIO()
    with contextlib.redirect_stderr(err):
        comm.all_reduce([torch.ones(3)], ("x",), "sum")
    return err.getvalue()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("other_hosts,how", [(False, "shared memory"), (True, "gloo (no shared segment")])
def test_verbose_says_which_transport_a_group_got(other_hosts, how):
    for rank, text in enumerate(launch.spawn(_verbose, 2, args=(other_hosts,), mesh="x:2", timeout=50)):
        assert f"[meshdsl rank {rank}] group (0, 1): collectives through {how}" in text


def _one_cannot_map(comm):
    if comm.rank == 1:
        def refuse(*args, **kwargs):
            raise OSError("no room")
        shm.mmap.mmap = refuse
    y = comm.all_reduce([torch.full((3,), float(comm.rank + 1))], ("x",), "sum")[0]
    return y, list(comm._shm.values())


@pytest.mark.timeout(60)
def test_a_member_that_cannot_map_the_segment_sends_the_whole_group_to_gloo():
    before = _shm_files()
    for y, groups in launch.spawn(_one_cannot_map, 2, mesh="x:2", timeout=50):
        assert torch.equal(y, torch.full((3,), 3.0)) and groups == [None]
    assert _shm_files() == before  # the creator unlinked it all the same


def _abstract_sockets(pid: int) -> list[str]:
    """The Unix sockets named in the abstract namespace for the segments of process ``pid``."""
    text = Path("/proc/net/unix").read_text()
    return [w for w in text.split() if w.startswith(f"@meshdsl-{pid}-")]


def _made_then_killed(comm, made: Path):
    """Rank 0 (the group's first member, which makes its segment) is SIGKILLed the moment
    its segment exists."""
    if comm.rank == 0:
        make = os.memfd_create

        def make_and_die(*args, **kwargs):
            make(*args, **kwargs)
            made.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        os.memfd_create = make_and_die
    return comm.all_reduce([torch.ones(4)], ("x",), "sum")[0]


@pytest.mark.timeout(60)
def test_a_creator_killed_the_moment_its_segment_exists_leaves_nothing(tmp_path):
    before = _shm_files()
    with pytest.raises(DistributedError) as e:
        launch.spawn(_made_then_killed, 2, args=(tmp_path / "made",), mesh="x:2", timeout=50)
    assert "rank 0 of 2 was killed by signal SIGKILL" in str(e.value)  # the peer did not wait for it
    pid = int((tmp_path / "made").read_text())
    assert _shm_files() == before and _abstract_sockets(pid) == []


@pytest.mark.timeout(30)
def test_ten_creators_killed_as_their_segments_appear_leave_nothing():
    # The 3-of-3 leak: a 12 MiB segment killed right after it appeared stayed in /dev/shm
    # for good.  Here each creator is killed the moment _make_segment returns, half of them
    # after a peer connected to take the descriptor.
    before = _shm_files()
    for attempt in range(10):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the creator: make the segment, say so, wait to be killed
            try:
                fd, listener, name = shm._make_segment(12 << 20, 2)
                os.write(w, name.encode() or b"-")
                time.sleep(30)
            finally:
                os._exit(1)
        os.close(w)
        name = os.read(r, 64).decode()
        os.close(r)
        peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if attempt % 2:
            peer.connect("\0" + name)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        peer.close()
        assert name.startswith(f"meshdsl-{pid}-"), name  # it was made
        assert _shm_files() == before, f"attempt {attempt}: left {_shm_files() - before}"
        assert _abstract_sockets(pid) == []
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as late, pytest.raises(ConnectionRefusedError):
            late.connect("\0" + name)  # its hand-over socket died with it
