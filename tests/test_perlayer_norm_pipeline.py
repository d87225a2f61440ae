"""A fused norm with a scale on a pipelined repeat's per-layer outputs, read after the stack
(lowering/partition.py ``_own_parts``).

``layer_norm(y, d, scale=g, bias=b)`` and ``rms_norm(y, d, g)`` of the per-layer outputs ``y``
are per-layer functions, but their backward is one step that also makes the scale's (and bias's)
gradient, a sum over the layers: each stage makes its own layers' term of it in its forward
actions, partial over the stage axis as a param's gradient is, summed after the micro-batches (as
the unfused ``layer_norm(y) * g`` sums its separate product).  This was refused as reading the
per-layer outputs across layers; now the loss and every gradient match the dense program on
``stage:2`` (simulated) for 1F1B, ZB-H1 and interleaved virtual stages, with a data axis, and with
``d_model`` split over a model axis.
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md

B, D, L = md.Dim("batch", 8), md.Dim("d_model", 4), md.Dim("layer", 4)


def _model(norm: str):
    """A 4-layer repeat whose per-layer outputs ``y`` [layer, batch, d_model] go through ``norm``
    (with its affine params) after the stack, into the loss beside the output carry."""
    with md.Graph("perlayer_norm"):
        x = md.input("x", [B, D])
        w = md.param("w", [L, D, md.Dim("d_out", 4)], fan_out=["d_out"])

        def block(h, p):
            y = md.rename(md.einsum("batch d_model, d_model d_out -> batch d_out", h, p["w"]), {"d_out": "d_model"})
            return h + md.tanh(y), {"y": y}
        h, per = md.repeat(block, x, {"w": w}, "layer")
        ps = {"w": w, "g": md.param("g", [D])}
        if norm == "ln":
            ps["b"] = md.param("b", [D])
            n = md.layer_norm(per["y"], "d_model", ps["g"], ps["b"])
        else:
            n = md.rms_norm(per["y"], "d_model", ps["g"])
        loss = md.reduce_mean(h * h) + 0.1 * md.reduce_sum(md.tanh(n) * n)
        grads = md.grad(loss, ps)
    return {"loss": loss, **{f"d/{k}": v for k, v in grads.items()}}


@pytest.mark.parametrize("norm, mesh, layout, schedule", [
    ("ln", "stage:2", "layer:stage", "1f1b"),
    ("ln", "stage:2", "layer:stage", "zbh1"),
    ("rms", "stage:2", "layer:stage", "1f1b"),
    ("rms", "stage:2", "layer:stage", "zbh1"),
    ("ln", "stage:2", "layer:stage", "interleaved:2"),
    ("rms", "stage:2; data:2", "layer:stage; batch:data", "1f1b"),
    # d_model split: the norm arrives split along its dim and lowers as its composite (lowering/norms.py),
    # whose scale's gradient is a separate sum; this one pipelined before the fix too
    ("ln", "stage:2; model:2", "layer:stage; d_model:model", "zbh1"),
])
def test_a_fused_norm_of_the_per_layer_outputs_pipelines_as_dense(norm, mesh, layout, schedule):
    gen = torch.Generator().manual_seed(0)
    feeds = {"x": torch.randn(8, 4, generator=gen)}
    # a scale and bias away from 1 and 0, so that a lost or doubled stage's term shows in every gradient
    params = {"w": torch.randn(4, 4, 4, generator=gen) * 0.5, "g": 1 + 0.3 * torch.randn(4, generator=gen),
              "b": 0.3 * torch.randn(4, generator=gen)}
    outs = _model(norm)
    params = {k: v for k, v in params.items() if f"d/{k}" in outs}
    want = md.run_dense(outs, feeds, params)
    plan = md.compile(outs, mesh, layout, microbatches=2, schedule=schedule)
    got = md.run_simulated(plan, feeds, params)
    assert set(got) == set(want)
    for k in want:
        # fp32, values of order 1-10: the same kernels summing the layers and micro-batches in
        # another order, rounding only
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5,
                                   msg=lambda m, k=k: f"{norm} '{mesh}' {schedule} {k}: {m}")
