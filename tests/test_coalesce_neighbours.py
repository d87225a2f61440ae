"""Coalescing (lowering/coalesce.py): partial sums made by neighbouring kernels sent as one.

Two kernels of one input run back to back (an FNO layer's real and imaginary spectra under a
grid split, two parallel projections of one input under a split contraction): their partial
sums go in one ``bucket_allreduce`` where the cost model says the latency saved outweighs the
wait the first one is held for; a long kernel between them keeps them apart.  Numbers are the
dense program's (forward and gradients), plans stay topologically sound, and the executor's
issue order starts the coalesced step right after the second kernel.  Every plan here is on
the simulated mesh, tiny.

Legend: b batch, d model width (split), f / g the two projections' widths, l layer.
"""
from __future__ import annotations

from importlib.util import module_from_spec, spec_from_file_location
from pathlib import Path

import pytest
import torch

import meshdsl as md
from meshdsl.comm.distributed import TorchComm
from meshdsl.lowering.cost import CostModel
from meshdsl.runtime.executor import issue_order

MESH = "model:2"


def _coalesced(plan):
    return [s for s, _ in plan.collectives() if s.kind == "bucket_allreduce" and "independent allreduces" in s.note]


def _sound(plan) -> None:
    """Every step after the steps that make its inputs, sub-plans included."""
    made = {v: i for i, s in enumerate(plan.steps) for v in s.outs}
    for i, s in enumerate(plan.steps):
        assert all(made[v] < i for v in s.ins if v in made), s.label
        for sub in s.subplans:
            _sound(sub)


def _blocks(plan):
    """The forward and the backward repeat's block."""
    loops = {st.args["backward"]: st.subplans[0] for st in plan.steps if st.kind == "repeat"}
    return loops[False], loops[True]


def _fno():
    spec = spec_from_file_location("heldout_fno_coalesce", Path(__file__).parent / "heldout_fno.py")
    fno = module_from_spec(spec)
    spec.loader.exec_module(fno)
    model = fno.build(fno.Config.tiny())
    return {"loss": model.loss, **{f"d/{n}": g for n, g in md.grad(model.loss, model.params).items()}}, model.feeds()


def test_fno_sends_its_real_and_imaginary_spectra_in_one_allreduce_each_way():
    outs, feeds = _fno()
    plan = md.compile(outs, MESH, "grid:model")
    _sound(plan)
    for block in _blocks(plan):
        sent = [s for s in block.steps if s.is_collective and "gradient" not in s.note]
        # was 2 allreduces a layer each way: the two DFT einsums' (or their transposes') partial sums
        assert [s.kind for s in sent] == ["bucket_allreduce"], [s.kind for s in sent]
        assert len(sent[0].ins) == 2 and sent[0].axes == ("model",)
    # 1e-4: fp32 sums over the split grid added in another order (md.check's default)
    assert md.check(outs, MESH, "grid:model", feeds, tol=1e-4).ok


def _two_projections(num_layers: int = 0, between: int = 0):
    """tanh(x @ w1) * (x @ w2) under a split ``d``, in a repeat of ``num_layers`` layers (0: no
    repeat).  ``between``: the width of a square matmul, on ``y`` and of the first
    projection's input, that the plan runs between the two projections (0: none)."""
    b, d, f, g = md.Dim("batch", 4), md.Dim("d", 8), md.Dim("f", 3), md.Dim("g", 3)
    with md.Graph():
        x = md.input("x", [b, d])
        if num_layers:
            L = md.Dim("layer", num_layers)
            w = {"w1": md.param("w1", [L, d, f]), "w2": md.param("w2", [L, d, g]), "w3": md.param("w3", [L, f, d])}

            def block(h, p):
                y1 = md.einsum("batch d, d f -> batch f", h, p["w1"])
                y2 = md.einsum("batch d, d g -> batch g", h, p["w2"])
                z = md.tanh(y1) * md.rename(y2, g="f")
                return h + md.einsum("batch f, f d -> batch d", z, p["w3"])

            y = md.repeat(block, x, w, L)
            loss = md.reduce_sum(y * y)
        else:
            w = {"w1": md.param("w1", [d, f]), "w2": md.param("w2", [d, g])}
            y1 = md.einsum("batch d, d f -> batch f", x, w["w1"])
            h = x
            if between:
                n = md.Dim("n", between)
                m = md.input("m", [n, md.Dim("n2", between)])
                # a long kernel the second projection's input waits for (priced at the FLOP rate)
                big = md.einsum("n n2, n2 n3 -> n n3", m, md.rename(m, n="n2", n2="n3"))
                h = x * md.reduce_mean(big)
            y2 = md.einsum("batch d, d g -> batch g", h, w["w2"])
            loss = md.reduce_sum(md.tanh(y1) * md.rename(y2, g="f"))
        grads = md.grad(loss, w)
    gen = torch.Generator().manual_seed(3)
    feeds = {"x": torch.randn(4, 8, generator=gen)}
    if between:
        feeds["m"] = torch.randn(between, between, generator=gen) / between
    return {"loss": loss, **{f"d/{n}": t for n, t in grads.items()}}, feeds


def test_two_projections_of_one_input_send_their_partial_sums_as_one():
    outs, feeds = _two_projections()
    plan = md.compile(outs, MESH, "d:model")
    _sound(plan)
    [step] = _coalesced(plan)
    assert step.phase == "forward" and len(step.ins) == 2 and step.bytes == 2 * 4 * 3 * 4
    assert not [s for s, _ in plan.collectives() if s.kind == "allreduce" and s.phase == "forward"]
    # the executor starts it right after the second projection: only kernels ran since the first
    order = issue_order(plan, TorchComm.async_kinds)
    made = {v: i for i, s in enumerate(plan.steps) for v in s.outs}
    at = {i: k for k, i in enumerate(order)}
    first, last = sorted(at[made[v]] for v in step.ins)
    here = at[plan.steps.index(step)]
    assert here == last + 1
    assert not any(plan.steps[order[k]].is_collective for k in range(first, here))
    # 1e-4: fp32 sums over the split d added in another order (md.check's default)
    assert md.check(outs, MESH, "d:model", feeds, tol=1e-4).ok


def test_two_projections_in_a_repeat_send_one_allreduce_a_layer_forward():
    outs, feeds = _two_projections(num_layers=2)
    plan = md.compile(outs, MESH, "d:model")
    _sound(plan)
    forward, _ = _blocks(plan)
    assert [s.kind for s in forward.steps if s.is_collective] == ["bucket_allreduce"]
    # 1e-4: fp32 sums over the split d added in another order (md.check's default)
    assert md.check(outs, MESH, "d:model", feeds, tol=1e-4).ok


def test_a_long_kernel_between_keeps_the_partial_sums_apart():
    """A 128-wide matmul (4.2 MFLOP, ~84 us at the default 50 GFLOP/s) between the two
    projections costs the first one's allreduce more than the 50 us latency coalescing saves."""
    outs, feeds = _two_projections(between=128)
    plan = md.compile(outs, MESH, "d:model")
    assert not _coalesced(plan)
    assert sum(1 for s, _ in plan.collectives() if s.kind == "allreduce" and s.phase == "forward") == 2
    # a machine 100x faster at compute: the same kernel takes under a latency, and they join
    fast = CostModel(flops_per_s=5.0e12)
    assert len(_coalesced(md.compile(outs, MESH, "d:model", cost=fast))) == 1
    # 1e-4: fp32 sums over the split d added in another order (md.check's default)
    assert md.check(outs, MESH, "d:model", feeds, tol=1e-4).ok


@pytest.mark.parametrize("flops_per_s,joined", [(5.0e10, True), (1.0e5, False)])
def test_the_cost_model_prices_the_kernels_between(flops_per_s, joined):
    """The few hundred FLOPs between the two projections: free at 50 GFLOP/s, over a 50 us
    latency at 100 kFLOP/s."""
    outs, _ = _two_projections(between=4)
    plan = md.compile(outs, MESH, "d:model", cost=CostModel(flops_per_s=flops_per_s))
    _sound(plan)
    assert bool(_coalesced(plan)) == joined
