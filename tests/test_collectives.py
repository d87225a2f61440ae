"""The collective table (:mod:`meshdsl.collectives`): every kind is complete, and a
new kind is usable by plans, the cost model, reports and the simulated executor
once it is in the table, with no other change."""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

import meshdsl as md
from meshdsl.collectives import COLLECTIVES, Collective, register
from meshdsl.comm.distributed import TorchComm
from meshdsl.comm.torch_collectives import TORCH
from meshdsl.runtime.executor import Executor
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.layout.layout import Layout
from meshdsl.layout.mesh import Mesh
from meshdsl.lowering.compiler import Lowerer
from meshdsl.lowering.cost import DEFAULT
from meshdsl.lowering.plan import Plan
from meshdsl.tools.report import plan_report

# The kinds the compiler emits today (send/recv only inside pipeline steps).
KINDS = {"allreduce", "allgather", "alltoall", "reduce_scatter", "permute", "send", "recv"}


def test_table_holds_every_kind_the_compiler_emits():
    assert KINDS <= set(COLLECTIVES)


@pytest.mark.parametrize("kind", sorted(COLLECTIVES))
def test_every_kind_is_complete(kind):
    c = COLLECTIVES[kind]
    assert c.name == kind
    run, start = TORCH[kind]   # how it runs on torch.distributed
    assert callable(c.simulated) and callable(run) and (start is not None) == c.asynchronous
    assert list(inspect.signature(c.simulated).parameters) == ["xs", "groups", "args"]
    assert list(inspect.signature(run).parameters) == ["comm", "x", "group", "args"]
    for n in (2, 3, 4, 8):
        assert c.fraction(n) > 0, (kind, n)
        # Sending to more peers never gets cheaper per byte.
        assert c.fraction(n) >= c.fraction(2) - 1e-12
    assert DEFAULT.collective(kind, 1 << 20, 1) == 0.0  # a group of one moves nothing
    assert DEFAULT.collective(kind, 1 << 20, 4) > DEFAULT.collective(kind, 1 << 10, 4)


def test_async_kinds_come_from_the_table():
    assert TorchComm.async_kinds == {k for k, c in COLLECTIVES.items() if c.asynchronous}
    assert {"allreduce", "allgather"} <= TorchComm.async_kinds


def test_named_methods_and_table_agree():
    """The named communicator methods run the table's kinds with the same args."""
    mesh = Mesh.parse("a:2; b:2")
    comm = SimulatedComm(mesh)
    xs = [torch.arange(8.0).reshape(2, 4) + 10 * r for r in range(4)]
    calls = [(comm.all_reduce(xs, ("a",), "max"), "allreduce", ("a",), {"op": "max"}),
             (comm.all_gather(xs, ("b",), 1), "allgather", ("b",), {"dim": 1}),
             (comm.all_to_all(xs, ("a", "b"), 1, 0), "alltoall", ("a", "b"), {"split_dim": 1, "concat_dim": 0}),
             (comm.reduce_scatter(xs, ("b",), 1, "sum"), "reduce_scatter", ("b",), {"dim": 1, "op": "sum"}),
             (comm.permute(xs, ("a",), 1, False), "permute", ("a",), {"offset": 1, "wrap": False})]
    for got, kind, axes, args in calls:
        want = COLLECTIVES[kind].simulated(xs, mesh.groups(axes), args)
        for g, w in zip(got, want):
            assert (g is None and w is None) or torch.equal(g, w), kind
    assert [k for k, _, _ in comm.log] == [kind for _, kind, _, _ in calls]


# ----------------------------------------------------------------------------- a new kind

def _sim_broadcast(xs, groups, args):
    """Every member gets the tensor of member ``root`` of its group."""
    out = list(xs)
    for g in groups:
        for r in g:
            out[r] = xs[g[args["root"]]].clone()
    return out


def _dist_broadcast(comm, x, group, args):
    out = comm.prep(x).clone()
    dist.broadcast(out, src=group.members[args["root"]], group=group.pg)
    return out


@pytest.fixture
def broadcast_kind():
    """A 'broadcast' kind in the tables (the kinds' and torch.distributed's) for one test, removed afterwards."""
    assert "broadcast" not in COLLECTIVES
    register(Collective("broadcast", ("root",), lambda n: 1.0, _sim_broadcast))
    TORCH["broadcast"] = (_dist_broadcast, None)   # how torch.distributed runs it
    yield COLLECTIVES["broadcast"]
    del COLLECTIVES["broadcast"], TORCH["broadcast"]


def _broadcast_plan(mesh: Mesh):
    """x[batch] replicated, then a broadcast from member 1 over 'data'."""
    with md.Graph():
        x = md.input("x", [md.Dim("batch", 4)])
    lw = Lowerer(mesh, Layout.parse(""))
    lw.bind_leaf(x.node, "input")
    src = lw.value(x)
    out = lw.new_value(x.shape, x.dtype, lw.sharding(src))
    lw.emit("broadcast", x.node, [src], [out], ("data",), {"root": 1}, nbytes=16)
    return Plan(mesh, lw.layout, lw.steps, lw.values, {"y": out}, {}, lw.inputs)


def test_a_new_kind_needs_only_its_table_entry(broadcast_kind):
    mesh = Mesh.parse("data:2; model:2")
    plan = _broadcast_plan(mesh)
    (step,) = [s for s in plan.steps if s.is_collective]
    assert step.kind == "broadcast"
    # Plan figures, the report and the cost model see it.
    assert plan.totals() == {"broadcast": {"count": 1, "bytes": 16}}
    assert plan.totals_by_axis() == {("broadcast", ("data",)): {"count": 1, "bytes": 16}}
    report = plan_report(plan)
    assert report["totals"] == {"broadcast": {"count": 1, "bytes": 16}}
    assert [c["kind"] for e in report["ops"] for c in e["collectives"]] == ["broadcast"]
    assert DEFAULT.collective("broadcast", 1000, 2) == pytest.approx(DEFAULT.latency_s + 1000 / DEFAULT.bandwidth_Bps)
    # The simulated executor runs it: every rank holds the tensor fed on member 1 of its data group.
    comm = SimulatedComm(mesh)
    ex = Executor(plan, comm)
    per_rank = md.PerRank([torch.full((4,), float(r)) for r in range(mesh.size)])
    got = ex.run({"x": per_rank}, {})["y"]
    for r in range(mesh.size):
        group = next(g for g in mesh.groups(("data",)) if r in g)
        assert torch.equal(got[r], torch.full((4,), float(group[1]))), r
    assert comm.log == [("broadcast", ("data",), 16)]


def test_step_args_follow_the_kind_schema(broadcast_kind):
    mesh = Mesh.parse("data:2")
    with md.Graph():
        x = md.input("x", [md.Dim("batch", 4)])
    lw = Lowerer(mesh, Layout.parse(""))
    lw.bind_leaf(x.node, "input")
    src = lw.value(x)
    with pytest.raises(AssertionError, match="outside its schema"):
        lw.emit("broadcast", x.node, [src], [src], ("data",), {"root": 0, "rot": 1})
    step = lw.emit("broadcast", x.node, [src], [src], ("data",), {"root": 0})
    with pytest.raises(TypeError):
        step.args["root"] = 1  # plan steps are read-only


def test_a_new_kind_runs_on_torch_distributed(broadcast_kind):
    """TorchComm runs the new kind from its table entry (a world of one gloo rank here)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        comm = TorchComm("data:1", verbose=False)
        x = torch.arange(4.0)
        (got,) = comm.collective("broadcast", [x], ("data",), {"root": 0})
        assert torch.equal(got, x) and got is not x
        assert comm.stats["broadcast"]["count"] == 1 and comm.stats["broadcast"]["bytes"] == 16
    finally:
        dist.destroy_process_group()
