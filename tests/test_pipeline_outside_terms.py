"""A loss term that reduces a pipelined stack's params outside the stack (an L2 penalty written as
``reduce_sum(w * w)`` of the stacked ``w``): each stage holds its own layers of ``w``, so the term is
a sum over the stage axis that only the loss's stage would run.  It is refused when compiled, with
the fix (:func:`meshdsl.lowering.partition._check_stage_collectives`); before, it failed inside the
runtime (an assertion of the simulated mesh; a hang on real processes).  The fix, the term made per
layer in the block and summed as a per-layer output, pipelines and matches the dense program.

Legend: batch 4, d 3, layer 4.
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md

B, D, L = md.Dim("batch", 4), md.Dim("d", 3), md.Dim("layer", 4)


def _model(per_layer: bool):
    x, w = md.input("x", [B, D]), md.param("w", [L, D])

    def block(a, p):
        y = md.tanh(a * md.reduce_sum(p["w"]))
        return (y, {"l2": md.reduce_sum(p["w"] * p["w"])}) if per_layer else y
    out = md.repeat(block, x, {"w": w}, "layer")
    a, l2 = (out[0], md.reduce_sum(out[1]["l2"])) if per_layer else (out, md.reduce_sum(w * w))
    loss = md.reduce_mean(a * a) + 0.1 * l2
    return {"loss": loss, "d/w": md.grad(loss, {"w": w})["w"]}


def test_an_l2_term_of_stacked_params_outside_the_stack_is_refused_with_the_fix():
    with md.Graph():
        outs = _model(per_layer=False)
        with pytest.raises(md.LayoutError, match=r"(?s)allreduce over the pipeline axis 'stage' on stage\(s\) \[1\] "
                                                 r"only.*Fix: make the term in the block, per layer"):
            md.compile(outs, "stage:2", "layer:stage", microbatches=2)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zbh1"])
def test_the_fix_pipelines_and_matches_dense(schedule):
    with md.Graph():
        outs = _model(per_layer=True)
        feeds = {"x": torch.randn(4, 3, generator=torch.Generator().manual_seed(0))}
        want = md.run_dense(outs, feeds)
        got = md.run_simulated(md.compile(outs, "stage:2", "layer:stage", microbatches=2, schedule=schedule), feeds)
    for k in want:
        # the layers' terms summed over the stages in another order: fp32 rounding of values O(1)
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
