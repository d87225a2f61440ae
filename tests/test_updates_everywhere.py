"""A Model's ``updates=`` (frozen params set in the step) are part of every step meshdsl builds,
prices or measures: ``md.search_layouts`` / ``meshdsl search``, ``meshdsl run``'s memory figures,
``meshdsl train``'s plan and ``Model.train_step`` all build it with ``train.step.step_outputs``.

The model is ``tests/heldout_dsv3bias.py`` (DeepSeek-V3's router bias, set from the per-expert
token loads): under ``batch:data`` the load is a sum over the split batch, one small allreduce
that the step ``TrainStep(updates=)`` runs and a step without the update lacks.  The oracle is
that ``TrainStep``'s plan: the other paths must build, price and measure the same program.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

import meshdsl as md
from meshdsl.lowering.memory import memory_report
from meshdsl.search.calibrate import Calibration
from meshdsl.search.predict import predict
from meshdsl.train.step import training_outputs

DSV3 = str(Path(__file__).parent / "heldout_dsv3bias.py")
MESH, LAYOUT = "data:2", "batch:data"


@pytest.fixture(scope="module")
def model():
    return md.load_model(DSV3, tiny=True)


def _trained_step(model, **kw):
    """The step ``meshdsl train`` / ``md.fit`` / ``meshdsl run`` trains: the oracle."""
    return md.TrainStep(model.loss, model.params, MESH, LAYOUT, md.SimulatedComm(md.Mesh.parse(MESH)),
                        updates=model.updates, **kw)


def _args(**over):
    base = dict(lr=0.01, optimizer=None, momentum=None, betas=None, weight_decay=None, clip_norm=None,
                precision="fp32", remat=None)
    return argparse.Namespace(**{**base, **over})


def test_the_search_prices_the_step_with_the_models_updates(model):
    """Given the outputs of a step without the update (what ``model.train_step`` returned before),
    the search still prices the trained step: its data-parallel candidate's bytes are those of
    ``TrainStep``'s plan, the load's allreduce (32 B) included."""
    cal = Calibration.defaults()
    bare = training_outputs(model.loss, model.params, 0.01, with_grads=True)
    result = md.search_layouts(model, bare, 2, cal)
    dp = next(r for r in result.ranked if (r.candidate.mesh, r.candidate.layout) == (MESH, LAYOUT))
    trained = predict(_trained_step(model).plan, cal)
    without = predict(md.compile(bare, MESH, LAYOUT), cal)
    assert trained.comm_bytes > without.comm_bytes     # the update's allreduce is there to miss
    assert dp.prediction.comm_bytes == trained.comm_bytes


@pytest.mark.parametrize("opt", [None, "adamw"])
def test_run_memory_figures_are_those_of_the_trained_step(model, opt):
    """``meshdsl run`` sizes its memory check from ``train_outputs(with_grads=False)``: the same
    outputs, collectives and memory as the step each rank runs (``new/bias`` included)."""
    from meshdsl.tools.optim_args import optimizer_from_args, train_outputs

    args = _args(optimizer=opt)
    outputs = train_outputs(model, args, with_grads=False)[0]
    optimizer, clip = optimizer_from_args(args)
    step = _trained_step(model, optimizer=optimizer, clip_norm=clip, lr=args.lr)
    assert set(outputs) == set(step.outputs) and "new/bias" in outputs
    plan = md.compile(outputs, MESH, LAYOUT)
    assert plan.totals() == step.plan.totals()
    assert memory_report(plan) == memory_report(step.plan)


def test_meshdsl_train_plans_the_step_it_trains(model):
    """``meshdsl train``'s pre-flight plan (``train_run.step_outputs``) has the trainer's outputs."""
    from meshdsl.tools.train_run import step_outputs
    from meshdsl.train.trainer import TrainSpec, build_step

    spec = TrainSpec(model=DSV3, tiny=True, mesh=MESH, layout=LAYOUT, optimizer="adamw", lr=0.01)
    step = build_step(model, spec, md.SimulatedComm(md.Mesh.parse(MESH)))
    assert set(step_outputs(model, spec)) == set(step.outputs)


def test_model_train_step_has_the_updates_built_once(model):
    """``Model.train_step`` is the step ``md.fit`` trains (``new/bias`` among its outputs); a second
    call returns the same tensors and grows no graph, so the compile cache hits."""
    first = model.train_step(0.01)
    nodes = len(model.graph.nodes)
    again = model.train_step(0.01)
    assert "new/bias" in first and all(again[k] is t for k, t in first.items())
    assert len(model.graph.nodes) == nodes
    assert md.compile(first, MESH, LAYOUT) is md.compile(again, MESH, LAYOUT)
    trained = _trained_step(model).plan.totals()
    assert md.compile(first, MESH, LAYOUT).totals()["allreduce"] == trained["allreduce"]


@pytest.mark.slow
def test_check_compares_the_update_on_two_real_processes(capsys):
    """``meshdsl check --optimizer adamw --nproc 2`` checks one whole step, the bias's next value
    included, on gloo processes against the dense program (as the simulated check does)."""
    from conftest import run_cli

    code, out, err = run_cli(capsys, ["check", DSV3, "--tiny", "--mesh", MESH, "--layout", LAYOUT,
                                      "--optimizer", "adamw", "--nproc", "2"])
    assert code == 0 and "OK:" in out and "new/bias" in out, out + err
