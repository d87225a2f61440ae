"""A training step's update outputs (``Model.updates``: batch-norm running statistics, an EMA
target) laid out where their params are (``lowering/update_values.py``).

Under FSDP a frozen param is split like its trained siblings, and so is its ``new/<k>``; the
update feeding it was computed split and then gathered to an activation's whole layout that
nothing read (an allgather per update per step). The oracle for the numbers is the dense run
with the running statistics and the EMA done by hand in torch between steps.
"""
from __future__ import annotations

import torch

import meshdsl as md
from meshdsl.train.step import step_outputs

M = 0.9       # the running statistics' and the EMA's momentum
STEPS = 3
BATCH, D_IN, CH, D_OUT = 4, 3, 4, 2
FSDP = ("data:2", "batch:data; params.channels:data")


def _build():
    """``(loss, trained params, frozen params, updates)``: ``x @ w1`` batch-normed (its running
    mean and variance kept), read by ``w2`` and, through stop_gradient, by an EMA target ``t2``."""
    B, I, C, O = md.Dim("batch", BATCH), md.Dim("d_in", D_IN), md.Dim("channels", CH), md.Dim("d_out", D_OUT)
    with md.Graph("bn_ema"):
        x = md.input("x", [B, I])
        w1, w2 = md.param("w1", [I, C]), md.param("w2", [C, O])
        scale, bias = md.param("scale", [C], scale=0.0), md.param("bias", [C], scale=0.0)
        rm, rv, t2 = md.param("rm", [C], scale=0.0), md.param("rv", [C], scale=0.0), md.param("t2", [C, O])
        h = md.einsum("batch d_in, d_in channels -> batch channels", x, w1)
        y, mean, var = md.batch_norm(h, ["batch"], scale + 1.0, bias, stats=True)
        y = md.relu(y)
        out = md.einsum("batch channels, channels d_out -> batch d_out", y, w2)
        target = md.stop_gradient(md.einsum("batch channels, channels d_out -> batch d_out", y, t2))
        loss = md.reduce_mean((out - target) ** 2)
    params = {"w1": w1, "w2": w2, "scale": scale, "bias": bias}
    updates = {"rm": M * rm + (1 - M) * mean, "rv": M * rv + (1 - M) * var, "t2": M * t2 + (1 - M) * w2}
    return loss, params, updates


def _feeds(t: int) -> dict:
    return {"x": torch.randn(BATCH, D_IN, generator=torch.Generator().manual_seed(t))}


def _collectives(plan) -> list:
    return sorted((s.kind, s.axes, s.bytes) for s in plan.steps if s.is_collective)


def test_the_updates_send_nothing_beyond_the_losss_step_under_fsdp():
    loss, params, updates = _build()
    with_updates = md.compile(step_outputs(loss, params, 0.1, updates=updates), *FSDP)
    plain = md.compile(step_outputs(loss, params, 0.1), *FSDP)
    # each new/<k> is its param's slice: split as the param, made where it is (no gather of it)
    for k in updates:
        assert with_updates.values[with_updates.outputs[f"new/{k}"]].sharding == \
            with_updates.values[with_updates.params[k]].sharding, k
        assert with_updates.values[with_updates.params[k]].sharding.split == {"channels": ("data",)}, k
    assert _collectives(with_updates) == _collectives(plain)


#: running statistics to start from, not the zeros of their init (so ``M * rm`` counts)
START = {"rm": torch.linspace(-1.0, 1.0, CH), "rv": torch.linspace(0.5, 2.0, CH)}


def _dense_by_hand():
    """Losses and full params (frozen ones too) of the dense run, its updates done in torch (the
    running statistics held in torch: the dense step without updates reads none of them)."""
    loss, params, _ = _build()
    step = md.TrainStep(loss, params, "data:1", "", md.SimulatedComm(md.Mesh.parse("data:1")), lr=0.1)
    stats = dict(START)
    losses = []
    for t in range(STEPS):
        # cloned: on data:1 a full param is the live buffer, which the step updates in place
        p = {k: v.clone() for k, v in step.full_params(frozen=True).items()}
        losses.append(step(_feeds(t))[0])
        h = _feeds(t)["x"].double() @ p["w1"].double()   # (batch_norm's statistics are fp64 sums)
        stats = {"rm": (M * stats["rm"] + (1 - M) * h.mean(0)).float(),
                 "rv": (M * stats["rv"] + (1 - M) * h.var(0, unbiased=False)).float()}
        step.set_params({"t2": M * p["t2"] + (1 - M) * p["w2"]})
    return losses, {**step.full_params(frozen=True), **stats}


def test_the_fsdp_step_with_updates_tracks_the_dense_run_by_hand():
    want_losses, want = _dense_by_hand()
    loss, params, updates = _build()
    step = md.TrainStep(loss, params, *FSDP, md.SimulatedComm(md.Mesh.parse(FSDP[0])), lr=0.1, updates=updates)
    step.set_params(START)
    losses = [step(_feeds(t))[0] for t in range(STEPS)]
    got = step.full_params(frozen=True)
    # fp32 on sums of a few elements (the statistics in fp64): a layout only reorders partial
    # sums, so a few ulps of 1e-5
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-6)
    for k in ("w1", "w2", "scale", "bias", "rm", "rv", "t2"):
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    assert not torch.equal(got["rm"], START["rm"]) and not torch.equal(got["rv"], START["rv"])   # they moved
