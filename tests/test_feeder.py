"""Training on a model's own batches (:mod:`meshdsl.train.feeder`, ``Model.batches``/``metrics``).

The model is ``tests/tiny_classifier.py``: generated images of three shape classes, a patchify,
cross-entropy over classes and an accuracy metric.  The dense single-process run is the oracle:
on ``data:2`` (simulated or two gloo processes) each rank builds only its own rows, and the
losses, eval loss and eval accuracy are the dense run's; a resume on one process continues a
two-process run.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import meshdsl as md
from meshdsl.train.data import DataError
from meshdsl.train.feeder import EVAL_SEED, BatchFeeder
from meshdsl.train.model import ModelError, load_model
from meshdsl.train.run_outputs import read_metrics
from meshdsl.tools import cli

CLASSIFIER = str(Path(__file__).with_name("tiny_classifier.py"))
# A data-parallel step adds its ranks' partial gradient sums in another order than the dense
# run: over a few SGD steps the losses drift apart by ~1e-7; a wrong row, step or eval batch
# moves them by 1e-2 or more.
RTOL, ATOL = 1e-5, 1e-6

# Training runs in this process: one torch thread, as each spawned rank has (conftest).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def recording(model):
    """``model`` with its ``batches`` recording each ``(seed, rows)`` it is asked for."""
    calls, make = [], model.batches

    def batches(seed, rows=None):
        calls.append((seed, None if rows is None else (rows.start, rows.stop)))
        return make(seed, rows)

    model.batches = batches
    return model, calls


def test_each_rank_gets_its_slice_of_the_global_batch_built_from_its_rows_only():
    model, calls = recording(load_model(CLASSIFIER))
    whole = model.feeds(5)
    # rows a:b of a seed are rows a:b of the whole batch: each row draws from its own stream
    part = model.batches(5, slice(3, 7))
    torch.testing.assert_close(part["images"], whole["images"][3:7], rtol=0, atol=0)
    assert torch.equal(part["labels"], whole["labels"][3:7])
    mesh = "data:2; model:2"
    plan = md.compile({"loss": model.loss}, mesh, "batch:data; width:model")
    feeder = BatchFeeder(model.batches, plan, list(range(4)), seed=1)
    calls.clear()
    feeds = feeder.train(4)      # step 4 of a run with seed 1: data seed 5
    # one call per data rank's rows, shared by the model ranks beside it; never the whole batch
    assert calls == [(5, (0, 16)), (5, (16, 32))]
    for name, xs in feeds.items():
        v = plan.values[plan.inputs[name]]
        for r, x in enumerate(xs):
            assert torch.equal(x, whole[name][v.sharding.slice_index(v.shape, plan.mesh, r)]), (name, r)
    calls.clear()
    feeder.eval(2)
    assert sorted({s for s, _ in calls}) == [EVAL_SEED + 1, EVAL_SEED + 2]   # seeds no training step reads


def fit(model, mesh, layout, steps=4, eval_every=2):
    return md.fit(model, mesh=mesh, layout=layout, steps=steps, lr=2.0, eval_every=eval_every, samples=0)


def test_dense_and_data_parallel_runs_give_the_same_numbers_per_step():
    dense = fit(load_model(CLASSIFIER), "data:1", "")
    assert [r["step"] for r in dense.rows if {"eval_loss", "eval_accuracy"} <= set(r)] == [2, 4]
    assert dense.final_eval_metrics == {"accuracy": dense.rows[-1]["eval_accuracy"]}
    for mesh, layout in (("data:2", "batch:data"), ("data:2; model:2", "batch:data; d_model:model")):
        model, calls = recording(load_model(CLASSIFIER))
        split = fit(model, mesh, layout)
        assert all(rows is not None and rows[1] - rows[0] == 16 for _, rows in calls), calls
        for key in ("loss", "eval_loss", "eval_accuracy"):
            got = torch.tensor([r.get(key, 0.0) for r in split.rows], dtype=torch.float64)
            want = torch.tensor([r.get(key, 0.0) for r in dense.rows], dtype=torch.float64)
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=f"{mesh}: {key}")


def test_train_cli_on_two_gloo_processes_matches_one_process_and_resumes(capsys, tmp_path):
    ck, common = tmp_path / "ck", ["--lr", "2", "--eval-every", "3", "--samples", "0"]
    rc = cli.main(["train", CLASSIFIER, "--nproc", "2", "--mesh", "data:2", "--layout", "batch:data", "--steps", "6",
                   "--checkpoint", str(ck), "--save-every", "3", "--out", str(tmp_path / "two"), *common])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "data: the model's own batches" in out and "final eval accuracy" in out
    two = read_metrics(tmp_path / "two")
    one = fit(load_model(CLASSIFIER), "data:1", "", steps=6, eval_every=3).rows
    # Resumed on one process from the two-process run's step 3: steps 4-6 continue it.
    shutil.copytree(ck / "step-00000003", tmp_path / "at3" / "step-00000003")
    rc = cli.main(["train", CLASSIFIER, "--mesh", "data:1", "--checkpoint", str(tmp_path / "at3"), "--resume",
                   "--out", str(tmp_path / "resumed"), "--samples", "0"])
    assert rc == 0, capsys.readouterr().err
    resumed = read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    num_eval_rows = 4 * load_model(CLASSIFIER).config.batch
    for other in (one, [*two[:3], *resumed]):
        for key, atol in (("loss", ATOL), ("eval_loss", ATOL), ("eval_accuracy", 1 / num_eval_rows)):
            # accuracy: a reassociated logit may at most flip a row whose two top logits tie within ~1e-6
            got = torch.tensor([r.get(key) or 0.0 for r in other], dtype=torch.float64)
            want = torch.tensor([r.get(key) or 0.0 for r in two], dtype=torch.float64)
            torch.testing.assert_close(got, want, rtol=RTOL, atol=atol, msg=key)


def test_batches_that_ignore_rows_are_refused_naming_the_input_and_the_rows():
    model = load_model(CLASSIFIER)
    whole = model.batches
    model.batches = lambda seed, rows=None: whole(seed, None)
    with pytest.raises(DataError, match=r"batches\(seed=\d+, rows=slice\(0, 16\)\) of eval batch 0: input 'images' "
                                        r"is shape \(32, 8, 8, 1\), torch.float32; \(16, 8, 8, 1\)"):
        fit(model, "data:2", "batch:data")


RAISING = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import tiny_classifier
from tiny_classifier import Config

def build(cfg=Config()):
    model = tiny_classifier.build(cfg)
    model.batches = lambda seed, rows=None: {{"images": 1 / 0}}
    return model
"""


def test_a_batches_that_raises_stops_the_cli_before_any_process_starts(capsys, tmp_path, monkeypatch):
    def spawn(*a, **k):
        raise AssertionError("spawn was called for an invalid job")
    monkeypatch.setattr(md.processes.launcher, "spawn", spawn)
    (tmp_path / "raising.py").write_text(RAISING)
    rc = cli.main(["train", str(tmp_path / "raising.py"), "--nproc", "2", "--mesh", "data:2", "--layout", "batch:data"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "batches(seed=1, rows=slice(0, 16)) of step 1 raised ZeroDivisionError: division by zero" in err
    assert "raising.py, line 9" in err


def test_a_model_makes_its_inputs_one_way_and_its_metrics_are_scalars():
    model = load_model(CLASSIFIER)
    g, loss, params = model.graph, model.loss, model.params
    with pytest.raises(ModelError, match="neither make_feeds nor batches is given"):
        md.Model(g, loss, params)
    with pytest.raises(ModelError, match="both make_feeds and batches are given"):
        md.Model(g, loss, params, model.feeds, batches=model.batches)
    with pytest.raises(ModelError, match="metrics must be scalar tensors") as e:
        md.Model(g, loss, params, batches=model.batches, metrics={"logits": g.inputs["images"], "loss": loss})
    assert "logits:" in str(e.value) and "loss:" in str(e.value)
