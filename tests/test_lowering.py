"""What the compiler emits: collective counts, bytes and phases read from the plan,
and unit tests of :func:`meshdsl.lowering.relayout.plan_moves`.

The model is the MLP x[batch, d_model] -> w1[d_model, d_ff] -> relu -> w2[d_ff,
d_model] -> mean square loss, on the mesh "data:2; model:2" (fp32, 4 bytes).
Every plan is also run on the simulated mesh against the dense program, so a
count can never pass on a plan that computes the wrong thing.
"""
from __future__ import annotations

import itertools
import random

import pytest
import torch

import meshdsl as md
from meshdsl.runtime.executor import run_collective
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.layout.sharding import Sharding
from meshdsl.lowering.relayout import plan_moves

MESH = "data:2; model:2"
B, D, F = md.Dim("batch", 8), md.Dim("d_model", 4), md.Dim("d_ff", 8)
W_BYTES = 2 * D.size * F.size * 4  # w1 and w2, fp32


def _mlp(sgd: bool = False):
    with md.Graph():
        x = md.input("x", [B, D])
        w1, w2 = md.param("w1", [D, F]), md.param("w2", [F, D])
        h = md.relu(md.einsum("batch d_model, d_model d_ff -> batch d_ff", x, w1))
        loss = md.reduce_mean(md.einsum("batch d_ff, d_ff d_model -> batch d_model", h, w2) ** 2)
        gw1, gw2 = md.grad(loss, [w1, w2])
        outs = {"loss": loss, "gw1": gw1, "gw2": gw2}
        if sgd:
            new = md.sgd({"w1": w1, "w2": w2}, {"w1": gw1, "w2": gw2}, lr=0.1)
            outs.update({f"new_{k}": v for k, v in new.items()})
    return outs


FEEDS = {"x": torch.randn(8, 4, generator=torch.Generator().manual_seed(0))}


def _compile(layout, outs=None, mesh=MESH):
    outs = outs or _mlp()
    # bucket_mb=0: these tests pin the lowering's own collectives, one per gradient
    # (tests/test_bucket.py pins the buckets that replace them)
    plan = md.compile(outs, mesh, layout, bucket_mb=0)
    ref = md.run_dense(outs, FEEDS)
    got = md.run_simulated(plan, FEEDS)
    for k in ref:
        # fp32 values of O(1); shards sum in another order than the dense program.
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6)
    return plan


def _coll(plan, phase=None):
    return [s for s in plan.steps if s.is_collective and (phase is None or s.phase == phase)]


# ----------------------------------------------------------------------------- MLP collectives

def test_data_parallel():
    plan = _compile("batch:data")
    fwd = _coll(plan, "forward")
    assert [(s.kind, s.axes, s.bytes) for s in fwd] == [("allreduce", ("data",), 4)]
    bwd = _coll(plan, "backward")
    assert {(s.kind, s.axes) for s in bwd} == {("allreduce", ("data",))}
    assert {s.label for s in bwd} == {"grad/w1", "grad/w2"}
    assert sum(s.bytes for s in bwd) == W_BYTES
    assert len(_coll(plan)) == 3


def test_tensor_parallel():
    plan = _compile("d_ff:model")
    fwd = _coll(plan, "forward")
    assert [(s.kind, s.axes) for s in fwd] == [("allreduce", ("model",))]
    assert fwd[0].bytes == B.size * D.size * 4  # the second matmul's [batch, d_model] partial sum
    assert _coll(plan, "backward") == []  # both weight grads are local on their d_ff shard


def test_data_and_tensor_parallel():
    plan = _compile("batch:data; d_ff:model")
    fwd = _coll(plan, "forward")
    assert sorted((s.kind, s.axes, s.bytes) for s in fwd) == [
        ("allreduce", ("data",), 4), ("allreduce", ("model",), B.size // 2 * D.size * 4)]
    bwd = _coll(plan, "backward")
    assert {(s.kind, s.axes) for s in bwd} == {("allreduce", ("data",))}
    assert sum(s.bytes for s in bwd) == W_BYTES // 2  # each rank holds half of each weight


def test_fsdp_reduce_scatters_weight_grads():
    plan = _compile("params.d_model:data; batch:data")
    bwd = _coll(plan, "backward")
    assert [(s.kind, s.axes) for s in bwd] == [("reduce_scatter", ("data",))] * 2
    assert {s.label for s in bwd} == {"grad/w1", "grad/w2"}
    assert sum(s.bytes for s in bwd) == W_BYTES  # each rank sends its full partial gradient
    fwd = _coll(plan, "forward")
    # the two params' gathers, both ready at the start, in one buffer (lowering/coalesce.py)
    assert sorted((s.kind, s.axes, len(s.ins)) for s in fwd) == [("allreduce", ("data",), 1),
                                                                 ("bucket_allgather", ("data",), 2)]
    assert plan.totals()["reduce_scatter"] == {"count": 2, "bytes": W_BYTES}


def test_fsdp_over_two_axes_is_one_reduce_scatter_per_grad():
    # A gradient partial over (data, model) that becomes split over (data, model) is
    # one reduce_scatter over both axes, not an allreduce followed by a local split.
    plan = _compile("params.d_model:(data,model); batch:(data,model)")
    bwd = _coll(plan, "backward")
    assert [(s.kind, s.axes) for s in bwd] == [("reduce_scatter", ("data", "model"))] * 2
    assert "allreduce" not in {s.kind for s in bwd}


def test_moe_rename_is_one_alltoall():
    b, e, d = md.Dim("batch", 4), md.Dim("experts_in", 4), md.Dim("d", 2)
    with md.Graph():
        x = md.input("x", [b, e, d])
        y = md.rename(x, batch="batch_x", experts_in="experts")
    plan = md.compile({"y": y}, "data:2", "batch:data; experts:data")
    assert [s.kind for s in _coll(plan)] == ["alltoall"]
    assert plan.totals() == {"alltoall": {"count": 1, "bytes": 2 * 4 * 2 * 4}}
    assert _coll(plan)[0].axes == ("data",)
    feed = torch.randn(4, 4, 2)
    torch.testing.assert_close(md.run_simulated(plan, {"x": feed})["y"], feed, rtol=0, atol=0)


def test_totals_and_axes_agree_with_steps():
    plan = _compile("batch:data; d_ff:model")
    by_axis = plan.totals_by_axis()
    assert by_axis[("allreduce", ("model",))]["count"] == 1
    assert sum(v["count"] for v in by_axis.values()) == len(_coll(plan))
    assert sum(v["bytes"] for v in plan.totals().values()) == sum(s.bytes for s in _coll(plan))


@pytest.mark.parametrize("offset, wrap, want", [
    (1, False, [("permute", ("data", "model"), 2 * 1 * 4)]),
    (-1, True, [("permute", ("data", "model"), 2 * 1 * 4)]),
    (2, False, [("permute", ("data", "model"), 2 * 2 * 4)]),  # the whole local slice moves
    (3, True, [("allgather", ("data", "model"), 2 * 2 * 4)]),  # longer than a slice: gathered
])
def test_shift_on_a_split_dim_is_a_neighbour_exchange(offset, wrap, want):
    s, b = md.Dim("seq", 8), md.Dim("batch", 2)
    with md.Graph():
        x = md.input("x", [b, s])
        y = md.shift(x, "seq", offset, wrap=wrap)
    plan = md.compile({"y": y}, MESH, "seq:(data,model)")
    assert [(c.kind, c.axes, c.bytes) for c in _coll(plan)] == want
    if want[0][0] == "permute":
        assert _coll(plan)[0].args["offset"] == (1 if offset > 0 else -1)
    else:
        assert any("exceeds the local slice" in n for n in plan.notes)
    feed = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(md.run_simulated(plan, {"x": feed})["y"], md.run_dense({"y": y}, {"x": feed})["y"],
                               rtol=0, atol=0)


# ----------------------------------------------------------------------------- phases

@pytest.mark.parametrize("layout", ["batch:data", "d_ff:model", "batch:data; d_ff:model",
                                    "params.d_model:data; batch:data", "params.d_ff:(data,model); batch:model",
                                    "batch:(data,model); d_ff:(model,data)"])
def test_phases_of_output_relayouts(layout):
    outs = _mlp(sgd=True)
    plan = _compile(layout, outs)
    want = {"loss": "forward", "gw1": "backward", "gw2": "backward", "new_w1": "update", "new_w2": "update"}
    nodes = {t.node.id: k for k, t in outs.items()}
    for s in plan.steps:
        if s.node in nodes and s.kind != "local":
            assert s.phase == want[nodes[s.node]], (s.kind, s.label, s.phase, s.note)
        if s.note.startswith("re-layout output '"):
            name = s.note.split("'")[1]
            assert s.phase == want[name], (s.kind, s.label, s.phase, s.note)
    # Every step of a backward node is tagged backward, and so on.
    for s in plan.steps:
        if s.label.startswith("grad"):
            assert s.phase == "backward", (s.kind, s.label, s.phase)
        if s.label.startswith(("update/", "new/")):
            assert s.phase == "update", (s.kind, s.label, s.phase)


def test_repeat_block_steps_carry_the_repeat_phase():
    l, d, f = md.Dim("layer", 2), md.Dim("d_model", 4), md.Dim("d_ff", 8)
    with md.Graph():
        x = md.input("x", [B, d])
        w1, w2 = md.param("w1", [l, d, f]), md.param("w2", [l, f, d])
        y = md.repeat(lambda h, p: h + md.einsum("batch d_ff, d_ff d_model -> batch d_model", md.relu(
            md.einsum("batch d_model, d_model d_ff -> batch d_ff", h, p["w1"])), p["w2"]), x,
            {"w1": w1, "w2": w2}, "layer")
        loss = md.reduce_sum(y * y)
        g1, g2 = md.grad(loss, [w1, w2])
    plan = _compile("batch:data; d_ff:model", {"loss": loss, "g1": g1, "g2": g2})
    reps = [s for s in plan.steps if s.kind == "repeat"]
    assert [s.phase for s in reps] == ["forward", "backward"]
    for s in reps:
        assert {t.phase for t in s.subplans[0].steps} == {s.phase}
    # Per layer: one forward allreduce over model (the block's second matmul).
    fwd = [(c.kind, c.axes, m) for c, m in plan.collectives() if c.phase == "forward"]
    assert ("allreduce", ("model",), 2) in fwd


# ----------------------------------------------------------------------------- plan_moves

SH = md.Shape([md.Dim("b", 8), md.Dim("d", 8)])
M22 = md.Mesh.parse("x:2; y:2")


def _moves(a, b, mesh=M22, shape=SH):
    return [(m.kind, m.axes, m.dim, m.dim2) for m in plan_moves(shape, a, b, mesh)]


def S(split=None, partial=()):
    return Sharding.of(SH, split or {}, partial)


@pytest.mark.parametrize("a, b, want", [
    (S(), S(), []),
    (S(), S({"b": ("x",)}), [("split", ("x",), "b", None)]),
    (S({"b": ("x",)}), S(), [("allgather", ("x",), "b", None)]),
    (S({"b": ("x",)}), S({"d": ("x",)}), [("alltoall", ("x",), "b", "d")]),
    (S(partial=("x",)), S(), [("allreduce", ("x",), None, None)]),
    (S(partial=("x",)), S({"d": ("x",)}), [("reduce_scatter", ("x",), "d", None)]),
    (S(partial=("x", "y")), S(partial=("y",)), [("allreduce", ("x",), None, None)]),
    # multi-axis
    (S({"b": ("x",)}), S({"b": ("x", "y")}), [("split", ("y",), "b", None)]),
    (S({"b": ("x", "y")}), S({"b": ("x",)}), [("allgather", ("y",), "b", None)]),
    (S({"b": ("x", "y")}), S(), [("allgather", ("x", "y"), "b", None)]),
    (S({"b": ("x", "y")}), S({"d": ("x", "y")}), [("alltoall", ("x", "y"), "b", "d")]),
    (S({"b": ("x", "y")}), S({"d": ("y", "x")}), [("alltoall", ("y",), "b", "d"), ("alltoall", ("x",), "b", "d")]),
    (S({"b": ("x", "y")}), S({"b": ("x",), "d": ("y",)}), [("alltoall", ("y",), "b", "d")]),
    (S({"b": ("x",), "d": ("y",)}), S({"b": ("x", "y")}), [("alltoall", ("y",), "d", "b")]),
    (S(partial=("x", "y")), S({"b": ("x", "y")}), [("reduce_scatter", ("x", "y"), "b", None)]),
    (S(partial=("y", "x")), S({"b": ("x", "y")}), [("reduce_scatter", ("x", "y"), "b", None)]),
    (S(partial=("x", "y")), S({"b": ("x",), "d": ("y",)}),
     [("reduce_scatter", ("x",), "b", None), ("reduce_scatter", ("y",), "d", None)]),
    (S({"b": ("x",)}, ("y",)), S({"b": ("x", "y")}), [("reduce_scatter", ("y",), "b", None)]),
    (S({"d": ("y",)}, ("x",)), S({"b": ("x",)}), [("reduce_scatter", ("x",), "b", None),
                                                  ("allgather", ("y",), "d", None)]),
])
def test_plan_moves_kinds(a, b, want):
    assert _moves(a, b) == want
    # and the moves are exact (checked numerically below for every pair)
    _check_moves_numerically(a, b, M22, SH, seed=1)


def _contributions(full, a: Sharding, mesh, shape, gen):
    """Per-rank local tensors of ``full`` in sharding ``a``: partial axes hold random parts."""
    n = mesh.axis_size(a.partial)
    parts = [torch.randint(-8, 8, full.shape, generator=gen).to(full.dtype) for _ in range(n - 1)]
    parts.append(full - sum(parts) if parts else full)
    out = []
    for r in range(mesh.size):
        c = mesh.index_along(r, a.partial) if a.partial else 0
        out.append(parts[c][a.slice_index(shape, mesh, r)].contiguous())
    return out


def _check_moves_numerically(a, b, mesh, shape, seed):
    gen = torch.Generator().manual_seed(seed)
    # Integer-valued floats: every sum is exact, whatever the order.
    full = torch.randint(-100, 100, shape.sizes, generator=gen).to(torch.float32)
    xs = _contributions(full, a, mesh, shape, gen)
    comm = SimulatedComm(mesh)
    for m in plan_moves(shape, a, b, mesh):
        args = {"dim": shape.index(m.dim) if m.dim else None, "op": "sum"}
        if m.kind == "alltoall":
            args.update(concat_dim=shape.index(m.dim), split_dim=shape.index(m.dim2))
        xs = run_collective(comm, m.kind, xs, m.axes, args)
    if b.partial:  # still partial sums there: their total must be b's slice
        xs = comm.all_reduce(xs, b.partial, "sum")
    for r in range(mesh.size):
        torch.testing.assert_close(xs[r], full[b.slice_index(shape, mesh, r)], rtol=0, atol=0)


def _all_shardings(mesh, shape, partial=True):
    axes = list(mesh.names)
    tuples = [t for k in range(len(axes) + 1) for t in itertools.permutations(axes, k)]
    out = []
    for combo in itertools.product(tuples, repeat=len(shape)):
        used = [a for t in combo for a in t]
        if len(used) != len(set(used)):
            continue
        if any(d.size % mesh.axis_size(t) for d, t in zip(shape, combo)):
            continue
        free = [a for a in axes if a not in used]
        subsets = [()] if not partial else [p for k in range(len(free) + 1) for p in itertools.permutations(free, k)]
        for p in subsets:
            out.append(Sharding.of(shape, dict(zip(shape.names, combo)), p))
    return out


@pytest.mark.parametrize("mesh", ["x:2; y:2", "x:2; y:2; z:2", "x:4; y:2"])
def test_plan_moves_every_pair_is_exact(mesh):
    """For every pair (a, b) -- b not partial -- executing the moves gives b's slices."""
    mesh = md.Mesh.parse(mesh)
    srcs = _all_shardings(mesh, SH)
    dsts = _all_shardings(mesh, SH, partial=False)
    pairs = list(itertools.product(srcs, dsts))
    if len(pairs) > 600:  # (2,2,2): a fixed sample keeps this under a few seconds
        pairs = random.Random(0).sample(pairs, 600)
    for k, (a, b) in enumerate(pairs):
        _check_moves_numerically(a, b, mesh, SH, seed=k)
        moves = plan_moves(SH, a, b, mesh)
        if moves:
            assert moves[0].before == a and moves[-1].after == b
        assert all(m1.after == m2.before for m1, m2 in zip(moves, moves[1:]))


def test_plan_moves_keeps_partial_axes_b_keeps():
    a = S({"b": ("x",)}, ("y",))
    b = S({"d": ("x",)}, ("y",))
    assert _moves(a, b) == [("alltoall", ("x",), "b", "d")]
    assert plan_moves(SH, a, b, M22)[-1].after == b


def test_plan_moves_after_chain():
    a, b = S({"b": ("x",), "d": ("y",)}), S({"b": ("y",), "d": ("x",)})
    moves = plan_moves(SH, a, b, M22)
    assert moves[0].before == a and moves[-1].after == b
    for m1, m2 in zip(moves, moves[1:]):
        assert m1.after == m2.before


def test_fsdp_sgd_update_is_local():
    # optim.py promises "the update runs in the layout of the params": with weights and
    # their grads sharded by 'params.d_model:data', p - lr*g needs no communication.
    plan = _compile("params.d_model:data; batch:data", _mlp(sgd=True))
    assert _coll(plan, "update") == []
