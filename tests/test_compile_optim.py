"""The optimizer kernels (meshdsl/ops/optim.py) inside ``--compile``'s whole step.

Their hyperparameters are fed per step as scalar tensors (the scheduled lr, AdamW's step count,
the clip factor). Traced as one graph (meshdsl/runtime/whole.py) they are proxies whose value
``float()`` cannot read: AdamW, or any optimizer with clipping, fell back to segments, so
``meshdsl train --compile`` on a text model (AdamW, clip 1) never ran its step as one graph.
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md
from meshdsl.train.model import load_model


@pytest.mark.parametrize("optimizer", [md.AdamW(lr=0.01, weight_decay=0.1), md.SGD(lr=0.1, momentum=0.9)],
                         ids=["adamw", "sgd-momentum"])
def test_a_clipped_step_compiles_as_one_graph_with_the_eager_losses(optimizer):
    model = load_model("mlp", tiny=True)

    def step(compile):
        return md.TrainStep(model.loss, model.params, "data:1", "", md.SimulatedComm("data:1"),
                            optimizer=optimizer, clip_norm=0.5, seed=0, compile=compile)

    eager, compiled = step(False), step("aot_eager")
    for t, lr in enumerate((0.01, 0.005, 0.002)):      # a schedule: the lr changes every step
        want, _ = eager(model.feeds(t), lr=lr)
        got, _ = compiled(model.feeds(t), lr=lr)
        # the traced update is the same rule in separate kernels (the eager one is torch's fused
        # AdamW / add_ with alpha): fp32 rounding apart, far below a wrong step's O(lr) change
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    for name, p in eager.full_params().items():
        torch.testing.assert_close(compiled.full_params()[name], p, rtol=1e-5, atol=1e-6)
    stats = compiled.executor.compiling.stats
    assert (stats.whole, stats.segments, stats.fallbacks) == (1, 0, []), stats.summary()
