"""TorchComm on real gloo processes against SimulatedComm on the same inputs.

One spawn per mesh shape runs every collective over every ordered tuple of axes
and sends the results back; the parent replays the same plan on SimulatedComm
and compares rank by rank.
"""
from __future__ import annotations

import itertools
import multiprocessing

import pytest
import torch
import torch.distributed as dist

from meshdsl.errors import DistributedError, MeshError
from meshdsl.comm import distributed
from meshdsl.processes import launcher as launch
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.layout.mesh import Mesh

MESHES = ["x:2", "x:4", "data:2; model:2", "a:2; b:2; c:2"]
# Every rank's tensors are 8x8 (divisible by every group size here) plus a 10x8 one
# that splits unevenly over groups of 2 and 4.
U = 2.0 ** -24  # unit roundoff of fp32


def _inputs(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return {
        "f": torch.randn(8, 8, generator=g),
        "i": torch.randint(-1000, 1000, (8, 8), generator=g),
        "u": torch.randn(10, 8, generator=g),
    }


def _view(inputs, name):
    """Input by name; 'fT' is the transpose, so the communicator sees a non-contiguous tensor."""
    return inputs["f"].t() if name == "fT" else inputs[name]


def _plan(mesh: Mesh) -> list[tuple[str, str, tuple[str, ...], dict]]:
    """(method, input, axes, kwargs) for every collective over every ordered axis tuple."""
    plan = []
    for k in range(1, len(mesh.names) + 1):
        for axes in itertools.permutations(mesh.names, k):
            n = mesh.axis_size(axes)
            for op in ("sum", "max", "min"):
                plan.append(("all_reduce", "f", axes, {"op": op}))
            plan.append(("all_reduce", "i", axes, {"op": "sum"}))
            plan.append(("all_gather", "f", axes, {"dim": 0}))
            plan.append(("all_gather", "fT", axes, {"dim": 1}))
            plan.append(("all_gather", "i", axes, {"dim": -1}))
            plan.append(("all_to_all", "f", axes, {"split_dim": 0, "concat_dim": 1}))
            plan.append(("all_to_all", "fT", axes, {"split_dim": 1, "concat_dim": 1}))
            plan.append(("reduce_scatter", "f", axes, {"dim": 0, "op": "sum"}))
            plan.append(("reduce_scatter", "f", axes, {"dim": 1, "op": "max"}))
            if n in (2, 4):
                plan.append(("all_to_all", "u", axes, {"split_dim": 0, "concat_dim": 1}))
                plan.append(("reduce_scatter", "u", axes, {"dim": 0, "op": "min"}))
            for offset, wrap in itertools.product((1, -1), (True, False)):
                plan.append(("permute", "f", axes, {"offset": offset, "wrap": wrap}))
            plan.append(("permute", "fT", axes, {"offset": n, "wrap": True}))
            plan.append(("permute", "f", axes, {"offset": 0, "wrap": False, "reverse": True}))   # md.flip's
            # Asynchronous starts, all in flight together, waited on in reverse order.
            plan.append(("start", "f", axes, {"kind": "allreduce", "op": "sum"}))
            plan.append(("start", "fT", axes, {"kind": "allreduce", "op": "max"}))
            plan.append(("start", "f", axes, {"kind": "allgather", "dim": 0}))
            plan.append(("start", "fT", axes, {"kind": "allgather", "dim": 1}))
    return plan


_SIM = {"allreduce": ("all_reduce", ("op",)), "allgather": ("all_gather", ("dim",))}


def _run_one(comm, method, x, axes, kw, sim=False):
    """One plan entry; a 'start' runs the kind it names (asynchronously, on TorchComm)."""
    if method != "start":
        out = getattr(comm, method)(x if sim else [x], axes, **kw)
        return out if sim else out[0]
    args = {k: v for k, v in kw.items() if k != "kind"}
    if sim:
        name, keys = _SIM[kw["kind"]]
        return getattr(comm, name)(x, axes, *[args[k] for k in keys])
    return comm.start(kw["kind"], [x], axes, args)


def _run_plan(comm, mesh_text):
    """Child side: run the whole plan, agree on tokens, and report stats."""
    mesh = Mesh.parse(mesh_text)
    inputs = _inputs(comm.rank)
    before = {k: v.clone() for k, v in inputs.items()}
    out, pending = [], []
    for method, name, axes, kw in _plan(mesh) + [("end", None, None, None)]:
        if method != "start":
            for i in reversed(pending):
                out[i] = out[i].wait()[0]
            pending = []
        if method == "end":
            break
        out.append(_run_one(comm, method, _view(inputs, name), axes, kw))
        if method == "start":
            pending.append(len(out) - 1)
    assert all(torch.equal(before[k], inputs[k]) for k in inputs), "a collective mutated its input"
    comm.barrier()
    token = "odd one out" if comm.rank == 1 else "plan-1234"
    long = "µ-" * 3000 if comm.rank == 0 else ""  # long, non-ASCII, and one empty
    return out, comm.agree(token), comm.agree(long), comm.stats


def _assert_no_children():
    assert multiprocessing.active_children() == []


@pytest.mark.timeout(90)
# By default 'a:2; b:2; c:2' alone: its plan runs every collective over every ordered tuple of its
# axes, so over groups of 2 and 4 ranks (the uneven tensor's), of one axis and of several, and over
# all 8 ranks: what each smaller mesh's does, which run with -m slow.
@pytest.mark.parametrize("mesh_text", [m if m == "a:2; b:2; c:2" else pytest.param(m, marks=pytest.mark.slow)
                                       for m in MESHES])
def test_matches_simulated(mesh_text):
    mesh = Mesh.parse(mesh_text)
    got = launch.spawn(_run_plan, mesh.size, args=(mesh_text,), mesh=mesh, timeout=80)
    _assert_no_children()

    sim = SimulatedComm(mesh)
    inputs = [_inputs(r) for r in range(mesh.size)]
    plan = _plan(mesh)
    for step, (method, name, axes, kw) in enumerate(plan):
        xs = [_view(x, name) for x in inputs]
        want = _run_one(sim, method, xs, axes, kw, sim=True)
        abs_sum = sim.all_reduce([x.abs() for x in xs], axes, "sum")
        for rank in range(mesh.size):
            g, w = got[rank][0][step], want[rank]
            where = f"rank {rank}: {method}{axes} {kw} on '{name}'"
            if w is None:
                assert g is None, where
                continue
            assert g.dtype == w.dtype and g.shape == w.shape, where
            n = mesh.axis_size(axes)
            if (method == "all_reduce" or kw.get("kind") == "allreduce") and kw["op"] == "sum" \
                    and w.is_floating_point():
                # gloo sums in its own order (ring/halving), not SimulatedComm's left fold, and
                # fp32 addition is not associative.  Any order of n terms is within
                # (n-1)*u*sum|x_i| of the exact sum, so two orders differ by at most twice that.
                bound = 2 * (n - 1) * U * abs_sum[rank].double() * (1 + 1e-6)
                assert ((g.double() - w.double()).abs() <= bound).all(), where
            else:
                # Gathers, all-to-all and permutes only move bytes; max/min are exact; int sums
                # are exact; reduce_scatter folds locally in group order, as SimulatedComm does.
                assert torch.equal(g, w), where

    tokens = ["plan-1234"] * mesh.size
    tokens[1] = "odd one out"
    for rank in range(mesh.size):
        _, agreed, long, stats = got[rank]
        assert agreed == tokens
        assert long == ["µ-" * 3000] + [""] * (mesh.size - 1)
        counts = {k: v["count"] for k, v in stats.items()}
        kinds = {"all_reduce": "allreduce", "all_gather": "allgather", "all_to_all": "alltoall",
                 "reduce_scatter": "reduce_scatter", "permute": "permute"}
        want_counts = {}
        for method, _, _, kw in plan:
            kind = kw["kind"] if method == "start" else kinds[method]
            want_counts[kind] = want_counts.get(kind, 0) + 1
        assert counts == want_counts


def test_torchcomm_needs_a_process_group():
    with pytest.raises(DistributedError, match="not initialised"):
        distributed.TorchComm("data:2")


def test_world_size_mismatch_message():
    with pytest.raises(MeshError) as e:
        distributed.check_world_size(Mesh.parse("data:2; model:2"), 2)
    text = str(e.value)
    assert "mesh 'data:2; model:2' has 4 devices but the job has 2 processes" in text
    assert "Rule:" in text and "Fix:" in text


def test_backend_auto_is_gloo_without_cuda():
    want = "nccl" if torch.cuda.is_available() else "gloo"
    assert distributed.resolve_backend("auto") == want
    assert distributed.resolve_backend("gloo") == "gloo"


@pytest.fixture
def one_process_group():
    """A world of one gloo rank in this process, torn down afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_verbose_env_logs_each_collective(one_process_group, monkeypatch, capsys):
    monkeypatch.setenv("MESHDSL_VERBOSE", "1")
    comm = distributed.TorchComm("data:1")
    assert comm.ranks == (0,) and comm.device == torch.device("cpu")
    x = torch.ones(4)
    assert comm.all_reduce([x], ("data",), "sum")[0] is x  # a group of one moves nothing
    assert "allreduce axes=('data',) group=(0,) bytes=16" in capsys.readouterr().err
    assert comm.stats["allreduce"]["count"] == 1 and comm.stats["allreduce"]["bytes"] == 16
    comm.stats.clear()
    assert comm.stats == {}
    assert comm.agree("µ") == ["µ"]


def test_unknown_axis_and_op(one_process_group):
    comm = distributed.TorchComm("data:1", verbose=False)
    with pytest.raises(MeshError, match="Did you mean 'data'"):
        comm.all_gather([torch.ones(2)], ("dat",), 0)
    with pytest.raises(DistributedError, match="unknown reduction 'mean'"):
        comm.all_reduce([torch.ones(2)], ("data",), "mean")
