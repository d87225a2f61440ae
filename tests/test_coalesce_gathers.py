"""Coalescing allgathers and reduce-scatters (lowering/coalesce.py): neighbours sent as one.

A GRU's three gates ``rename(h @ w_k, h_out="hidden")`` under ``hidden:model`` each reduce-scatter
their partial sum into the split ``hidden`` in the forward and gather their gradient back in the
backward, a few dozen bytes apiece.  Made back to back and independent, they go as one
``bucket_reduce_scatter`` and one ``bucket_allgather``: outside and inside ``md.repeat``, in
held-out Dreamer's recurrence, with the dense program's numbers and bit for bit the numbers of the
separate collectives (the same elements moved, folded in the same group order), on the simulated
mesh and on two gloo processes.  Parts of unequal length (an uneven split) are not packed.

Legend: b batch, H hidden (split), HO h_out (the gates' output dim before the rename), L layer.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

import meshdsl as md
from meshdsl.comm.bucket import pack, unpack_gathered
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.layout.mesh import Mesh
from meshdsl.lowering.plan import step_args
from meshdsl.processes import launcher as launch
from meshdsl.runtime.executor import Executor

MESH, LAYOUT = "model:2", "hidden:model"
DREAMER = str(Path(__file__).parent / "heldout_dreamer2.py")
PACKED = ("bucket_allgather", "bucket_reduce_scatter")


def _gates(hidden: int = 6, num_layers: int = 0) -> dict:
    """Loss and gradients of ``sigmoid(u) * h + tanh(n) * sigmoid(r)``, the three gates renamed
    from ``h_out`` into ``hidden`` (the middle one made ``[hidden, batch]``: a member gathered along
    another dim), once or as the block of ``num_layers`` layers."""
    b, H, HO = md.Dim("batch", 2), md.Dim("hidden", hidden), md.Dim("h_out", hidden)
    with md.Graph():
        x = md.input("x", [b, H])
        lead = [md.Dim("layer", num_layers)] if num_layers else []
        w = {f"w{k}": md.param(f"w{k}", [*lead, H, HO]) for k in range(3)}

        def block(h, p):
            r, n = (md.rename(md.einsum("batch hidden, hidden h_out -> batch h_out", h, p[f"w{k}"]), h_out="hidden")
                    for k in (0, 2))
            u = md.rename(md.einsum("batch hidden, hidden h_out -> h_out batch", h, p["w1"]), h_out="hidden")
            return md.sigmoid(md.transpose(u, ["batch", "hidden"])) * h + md.tanh(n) * md.sigmoid(r)

        y = md.repeat(block, x, w, lead[0]) if num_layers else block(x, w)
        loss = md.reduce_sum(y * y)
        grads = md.grad(loss, w)
    return {"loss": loss, **{f"d/{k}": g for k, g in grads.items()}}


def _feeds() -> dict:
    return {"x": torch.randn(2, 6, generator=torch.Generator().manual_seed(5))}


def _sent(plan) -> list[tuple[str, str, int]]:
    """(kind, phase, members) of every allgather and reduce-scatter, packed or not, once each."""
    kinds = ("allgather", "reduce_scatter", *PACKED)
    return sorted((s.kind, s.phase, len(s.ins)) for s, _ in plan.walk() if s.kind in kinds)


def _separate(plan):
    """``plan`` with each packed allgather and reduce-scatter sent as its members again (the
    plan coalescing was given), sub-plans included."""
    steps = []
    for s in plan.steps:
        if s.kind in PACKED:
            kind = s.kind.removeprefix("bucket_")
            for i, o, dim in zip(s.ins, s.outs, s.args["dims"]):
                args = {"dim": dim, **({"op": s.args["op"]} if kind == "reduce_scatter" else {})}
                steps.append(replace(s, kind=kind, ins=(i,), outs=(o,), args=step_args(kind, args),
                                     bytes=plan.values[i].local_bytes(plan.mesh)))
        else:
            steps.append(replace(s, subplans=tuple(_separate(sub) for sub in s.subplans)))
    return replace(plan, steps=tuple(steps))


def _assert_dense(got: dict, want: dict) -> None:
    for k in want:
        # fp32 sums over the split hidden added in another order than the dense einsum: ~1e-7
        # relative; a member's parts joined in the wrong place or order are O(1) off
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5 * max(1.0, float(want[k].abs().max())),
                                   msg=lambda m, k=k: f"{k}: {m}")


def _assert_bitwise(got: dict, want: dict) -> None:
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k}: packed and separate collectives differ"


@pytest.mark.parametrize("num_layers", [0, 2])
def test_three_gates_send_one_reduce_scatter_forward_and_one_allgather_backward(num_layers):
    outs = _gates(num_layers=num_layers)
    plan = md.compile(outs, MESH, LAYOUT)
    # was 3 reduce-scatters forward and 3 allgathers backward (a layer, inside the repeat)
    assert _sent(plan) == [("bucket_allgather", "backward", 3), ("bucket_reduce_scatter", "forward", 3)]
    [gather] = [s for s, _ in plan.walk() if s.kind == "bucket_allgather"]
    assert sorted(gather.args["dims"]) == [0, 1, 1]   # the [hidden, batch] gate's gradient along dim 0
    feeds = _feeds()
    got = md.run_simulated(plan, feeds)
    _assert_dense(got, md.run_dense(outs, feeds))
    _assert_bitwise(got, md.run_simulated(_separate(plan), feeds))


def test_dreamer_sends_a_third_of_its_gathers_and_reduce_scatters():
    """Held-out Dreamer's GRU gates, in its recurrence over time: 4 allgathers and 4 reduce-scatters
    a step instead of 12 and 12, the dense program's numbers (the outer backward saves the recurrence's
    activations and does not run it again: 8 reduce-scatters when its recompute sent them again)."""
    model = md.load_model(DREAMER, tiny=True)
    outs = {"loss": model.loss, **{f"d/{n}": g for n, g in md.grad(model.loss, model.params).items()}}
    plan = md.compile(outs, MESH, LAYOUT)
    totals = plan.totals()
    assert totals["bucket_allgather"]["count"] == 4 and totals["bucket_reduce_scatter"]["count"] == 4, totals
    assert "allgather" not in totals and "reduce_scatter" not in totals, totals
    feeds = model.feeds(0)
    got = md.run_simulated(plan, feeds)
    _assert_dense(got, md.run_dense(outs, feeds))
    _assert_bitwise(got, md.run_simulated(_separate(plan), feeds))


def test_parts_of_unequal_length_are_not_packed():
    """hidden 5 over 2 ranks: each gate's parts are 3 and 2 rows; the collectives stay apart,
    with the dense program's numbers."""
    outs = _gates(hidden=5)
    plan = md.compile(outs, MESH, LAYOUT)
    assert _sent(plan) == [("allgather", "backward", 1)] * 3 + [("reduce_scatter", "forward", 1)] * 3
    feeds = {"x": torch.randn(2, 5, generator=torch.Generator().manual_seed(5))}
    _assert_dense(md.run_simulated(plan, feeds), md.run_dense(outs, feeds))


def test_a_gather_that_reads_another_is_not_packed_with_it():
    """The second gather's input is made from the first one's result: they cannot go together."""
    b, H = md.Dim("batch", 2), md.Dim("hidden", 6)
    with md.Graph():
        x = md.input("x", [b, H])
        w = md.param("w", [H, md.Dim("h_out", 6)])
        y1 = md.rename(md.einsum("batch hidden, hidden h_out -> batch h_out", x, w), h_out="hidden")
        y2 = md.rename(md.einsum("batch hidden, hidden h_out -> batch h_out", md.tanh(y1), w), h_out="hidden")
        loss = md.reduce_sum(y2 * x)
        outs = {"loss": loss, **md.grad(loss, {"d/w": w})}
    plan = md.compile(outs, MESH, LAYOUT)
    # each way a chain of two: y2's reduce-scatter reads y1's, y1's gradient's gather y2's
    assert _sent(plan) == [("allgather", "backward", 1)] * 2 + [("reduce_scatter", "forward", 1)] * 2
    feeds = _feeds()
    _assert_dense(md.run_simulated(plan, feeds), md.run_dense(outs, feeds))


def test_unpack_gathered_joins_each_member_as_its_own_allgather_does():
    """Three ranks, members gathered along dims 0, 1 and 2: the flat buffers' gather, cut up,
    is each member's allgather, exactly (a copy)."""
    mesh = Mesh.parse("x:3")
    comm = SimulatedComm(mesh)
    gen = torch.Generator().manual_seed(0)
    shapes, dims = [(2, 3), (4, 1), (2, 2, 5)], (0, 1, 2)
    xs = [[torch.randn(*s, generator=gen) for s in shapes] for _ in range(3)]
    flat = comm.collective("bucket_allgather", [pack(x) for x in xs], ("x",), {"dims": dims})
    for r in range(3):
        want = [comm.all_gather([x[k] for x in xs], ("x",), d)[r] for k, d in enumerate(dims)]
        got = unpack_gathered(flat[r], [w.numel() for w in want], [w.shape for w in want], 3, dims)
        for g, w in zip(got, want):
            assert torch.equal(g, w)


def _on_ranks(comm):
    """Child side: the gates' plan (one layer in a repeat) run packed and separate on real ranks."""
    outs = _gates(num_layers=1)
    plan = md.compile(outs, MESH, LAYOUT)
    got = []
    for p in (plan, _separate(plan)):
        ex = Executor(p, comm)
        got.append(ex.full_outputs(ex.run(_feeds(), ex.init_params(0))))
    return got, _sent(plan)


@pytest.mark.timeout(120)
def test_packed_gathers_on_two_gloo_processes_are_the_separate_ones_bitwise():
    results = launch.spawn(_on_ranks, 2, mesh=Mesh.parse(MESH), timeout=100)
    outs = _gates(num_layers=1)
    want = md.run_dense(outs, _feeds())
    for (packed, separate), sent in results:
        assert sent == [("bucket_allgather", "backward", 3), ("bucket_reduce_scatter", "forward", 3)]
        _assert_bitwise(packed, separate)
        _assert_dense(packed, want)
