"""A reduction of a layer's params inside a repeat (BitNet's per-weight scale ``mean|w|``) is saved
by the forward, not recomputed by the backward: under a split weight its recompute was an
allreduce per weight per layer (meshdsl/ir/repeat_grad.py, ``_param_reductions``)."""
from __future__ import annotations

import torch

import meshdsl as md
from conftest import assert_matches_scaled


def _ternary_mlp():
    b, d, f, l = md.Dim("batch", 4), md.Dim("d_model", 4), md.Dim("d_ff", 6), md.Dim("layer", 2)
    with md.Graph():
        x = md.input("x", [b, d])
        w1 = md.param("w1", [l, d, f], fan_out=["layer", "d_ff"])
        w2 = md.param("w2", [l, f, d], fan_out=["layer", "d_model"])

        def ternary(w):
            scale = md.reduce_mean(md.abs(w)) + 1e-5                       # a scalar per layer
            return w + md.stop_gradient(md.clamp(md.round(w / scale), -1.0, 1.0) * scale - w)

        def block(h, p):
            u = md.relu(md.einsum("batch d_model, d_model d_ff -> batch d_ff", h, ternary(p["w1"])))
            return h + md.einsum("batch d_ff, d_ff d_model -> batch d_model", u, ternary(p["w2"]))

        loss = md.reduce_mean(md.repeat(block, x, {"w1": w1, "w2": w2}, "layer") ** 2)
        outs = {"loss": loss, **md.grad(loss, {"w1": w1, "w2": w2})}
    return outs, {"x": torch.randn(4, 4, generator=torch.Generator().manual_seed(0))}


def test_a_quantised_weights_scale_is_saved_not_reduced_again_in_the_backward():
    outs, feeds = _ternary_mlp()
    plan = md.compile(outs, "model:2", "d_ff:model")
    backward = [s for s in plan.steps if s.kind == "repeat" and s.phase == "backward"]
    assert len(backward) == 1, [(s.kind, s.phase) for s in plan.steps]
    # the backward block's own allreduces: the input gradient of the split first einsum only (the
    # two scales' allreduces, one per weight, were repeated there before)
    inner = [t for t in backward[0].subplans[0].steps if t.is_collective]
    assert [t.kind for t in inner] == ["allreduce"], [(t.kind, t.label, t.bytes) for t in inner]
    assert_matches_scaled(md.run_simulated(plan, feeds), md.run_dense(outs, feeds), "d_ff:model", 1e-5)
