"""send / recv (pipeline transfers): the simulated mailbox against TorchComm on gloo processes.

Stage s sends to s + offset; a recv returns what the member ``offset`` back along the
axis sent with the same tag.  Sends never block the sender (two stages exchanging at
once must not deadlock), and a recv before its send is a clear error on the simulated mesh.
"""
from __future__ import annotations

import multiprocessing

import pytest
import torch

from meshdsl.collectives import COLLECTIVES
from meshdsl.errors import GraphError
from meshdsl.processes import launcher as launch
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.layout.mesh import Mesh


def _x(rank: int) -> torch.Tensor:
    return torch.randn(3, 5, generator=torch.Generator().manual_seed(rank))


def test_kinds_are_point_to_point():
    for kind in ("send", "recv"):
        assert COLLECTIVES[kind].point_to_point
        assert set(COLLECTIVES[kind].args) == {"offset", "tag"}


@pytest.mark.parametrize("offset", [1, -1, 2])
def test_simulated_send_then_recv_moves_along_the_axis(offset):
    mesh = Mesh.parse("stage:4; data:2")
    comm = SimulatedComm(mesh)
    xs = [_x(r) for r in range(mesh.size)]
    assert comm.send(xs, ("stage",), offset, tag=7) == [None] * mesh.size
    got = comm.recv([torch.empty(3, 5)] * mesh.size, ("stage",), offset, tag=7)
    for r in range(mesh.size):
        c = mesh.coords(r)
        src = c["stage"] - offset
        if 0 <= src < 4:
            assert torch.equal(got[r], xs[mesh.rank({**c, "stage": src})])
        else:
            assert got[r] is None
    assert comm.mailbox == {}


def test_views_hand_off_between_stages():
    mesh = Mesh.parse("stage:2; data:2")
    comm = SimulatedComm(mesh)
    s0 = comm.view([r for r in comm.ranks if mesh.coords(r)["stage"] == 0])
    s1 = comm.view([r for r in comm.ranks if mesh.coords(r)["stage"] == 1])
    xs = [_x(r) for r in s0.ranks]
    s0.send(xs, ("stage",), 1, tag=3)
    got = s1.recv([torch.empty(3, 5)] * 2, ("stage",), 1, tag=3)
    assert all(torch.equal(g, x) for g, x in zip(got, xs))
    # a view runs ordinary collectives over the axes it holds whole
    summed = s1.all_reduce(got, ("data",), "sum")
    assert torch.equal(summed[0], xs[0] + xs[1])


def test_simulated_recv_before_send_is_an_error():
    comm = SimulatedComm(Mesh.parse("stage:2"))
    with pytest.raises(GraphError, match="nothing was sent"):
        comm.recv([torch.empty(1)] * 2, ("stage",), 1, tag=0)


def _exchange(comm, mesh_text):
    """Child: every stage sends to both neighbours before receiving (sends must not block)."""
    mesh = Mesh.parse(mesh_text)
    x = _x(comm.rank)
    comm.send([x], ("stage",), 1, tag=1)
    comm.send([x * 2], ("stage",), -1, tag=2)
    up = comm.recv([torch.empty(3, 5)], ("stage",), 1, tag=1)[0]
    down = comm.recv([torch.empty(3, 5)], ("stage",), -1, tag=2)[0]
    comm.drain()
    return up, down, {k: v["count"] for k, v in comm.stats.items()}, mesh.size


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mesh_text", ["stage:2", "stage:2; data:2"])
def test_torchcomm_matches_simulated(mesh_text):
    mesh = Mesh.parse(mesh_text)
    got = launch.spawn(_exchange, mesh.size, args=(mesh_text,), mesh=mesh, timeout=50)
    assert multiprocessing.active_children() == []
    sim = SimulatedComm(mesh)
    xs = [_x(r) for r in range(mesh.size)]
    sim.send(xs, ("stage",), 1, tag=1)
    sim.send([x * 2 for x in xs], ("stage",), -1, tag=2)
    up = sim.recv([torch.empty(3, 5)] * mesh.size, ("stage",), 1, tag=1)
    down = sim.recv([torch.empty(3, 5)] * mesh.size, ("stage",), -1, tag=2)
    for r in range(mesh.size):
        for g, w in ((got[r][0], up[r]), (got[r][1], down[r])):
            assert (g is None) == (w is None)
            if w is not None:
                assert torch.equal(g, w)  # a transfer only moves bytes
        assert got[r][2] == {"send": 2, "recv": 2}
