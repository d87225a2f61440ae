"""Training-step outputs (:mod:`meshdsl.train.step`): built once per loss and learning rate."""
from __future__ import annotations

import meshdsl as md
from meshdsl.collectives import COLLECTIVES
from meshdsl.train.step import COMM_KINDS, training_outputs


def _loss():
    with md.Graph() as g:
        x = md.input("x", [md.Dim("batch", 4), md.Dim("d_model", 2)])
        w = md.param("w", [md.Dim("d_model", 2)])
        return g, md.reduce_sum((x * w) ** 2), {"w": w}


def test_outputs_are_built_once_per_loss_and_lr():
    g, loss, params = _loss()
    first = training_outputs(loss, params, 0.1)
    n_nodes = len(g.nodes)
    assert training_outputs(loss, params, 0.1) is first
    assert len(g.nodes) == n_nodes  # no second gradient or update in the graph
    other = training_outputs(loss, params, 0.2)
    assert other is not first and other["new/w"] is not first["new/w"]
    assert "_train_outputs" not in vars(g)  # nothing stashed on the graph


def test_comm_kinds_are_the_table_and_wait():
    assert set(COMM_KINDS) == set(COLLECTIVES) | {"wait"}


def test_full_params_is_a_snapshot_the_next_step_does_not_change():
    """On one rank the full param is the rank's own buffer, which the next step updates in place
    (donated params): full_params hands back a copy, as it does where it gathers."""
    import torch
    with md.Graph() as g:
        x = md.input("x", [md.Dim("batch", 4), md.Dim("d", 3)])
        w = md.param("w", [md.Dim("d", 3)])
        loss = md.reduce_sum(x * w * w)
    step = md.TrainStep(loss, {"w": w}, "data:1", "", md.SimulatedComm(md.Mesh.parse("data:1")), lr=0.1)
    feeds = {"x": torch.ones(4, 3)}
    step(feeds)
    before = step.full_params()["w"]
    kept = before.clone()
    step(feeds)
    assert torch.equal(before, kept) and not torch.equal(step.full_params()["w"], kept)
    del g
