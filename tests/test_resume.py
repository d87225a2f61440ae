"""What a resume restores and what it may change (:mod:`meshdsl.train.resume`), on specs alone.

No training here: :func:`resolve_resume` is a pure function of the run asked for, the settings a
checkpoint saved (:func:`run_settings`) and the names of the settings given.  The runs themselves
(bit-identical resumes, the CLI's lines and exit codes) are in ``test_trainer.py`` and
``test_train_cli.py``.
"""
from __future__ import annotations

import json

import pytest

from meshdsl.train.resume import ResumeError, resolve_resume, run_settings, saved_run
from meshdsl.train.trainer import TrainSpec

#: The run the checkpoint was saved from (at step 600): AdamW, warmup and a cosine over 1000
#: steps, clipping, accumulation, its own seed and data.
SAVED = TrainSpec(steps=1000, optimizer="adamw", lr=3e-3, optimizer_args={"betas": (0.9, 0.99)}, clip_norm=1.0,
                  warmup_steps=50, microbatches=2, seed=7, data="corpus.txt", save_every=100, eval_every=100)
STEP = 600


def saved() -> dict:
    """The settings as a checkpoint holds them: through JSON, as checkpoint.json stores them."""
    return json.loads(json.dumps(run_settings(SAVED)))


def resolve(given: dict, **flags):
    """Resolve a resume that gives ``given`` (a new run's defaults, TrainSpec's, for the rest)."""
    return resolve_resume(TrainSpec(**given, **flags), saved(), set(given), STEP)


def test_a_resume_without_flags_is_the_saved_run():
    spec, lines = resolve({})
    assert lines == []
    for k in ("steps", "optimizer", "lr", "lr_schedule", "warmup_steps", "clip_norm", "microbatches", "seed", "data",
              "save_every", "eval_every", "precision", "schedule"):
        assert getattr(spec, k) == getattr(SAVED, k), k
    # Every hyperparameter, the optimizer's defaults included, and the schedule's length.
    assert spec.optimizer_args == {"betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.1}
    assert spec.decay_steps == 1000
    # The saved settings themselves say so, whatever a later default becomes.
    assert saved()["optimizer_args"]["weight_decay"] == 0.1 and saved()["decay_steps"] == 1000


def test_more_steps_keep_the_schedule_length_unless_decay_steps_is_given():
    spec, [line] = resolve({"steps": 1500})
    assert spec.steps == 1500 and spec.decay_steps == 1000
    assert line == ("resume: steps=1500 (saved 1000): the run goes on to step 1500; the cosine schedule keeps its "
                    "saved length, 1000 steps, so steps 1001-1500 run at its floor, lr 0.0003 (decay_steps=1500 "
                    "stretches it instead)")
    spec, lines = resolve({"steps": 1500, "decay_steps": 1500})
    assert spec.decay_steps == 1500 and lines[1] == "resume: steps=1500 (saved 1000): the run goes on to step 1500"
    assert lines[0].startswith("resume: decay_steps=1500 (saved 1000): the learning rate of step 601 goes from ")


def test_safe_changes_are_applied_with_one_line_each():
    spec, lines = resolve({"lr": 1e-3, "clip_norm": None, "precision": "bf16", "microbatches": 1, "eval_every": 10,
                           "optimizer_args": {"weight_decay": 0.0}})
    assert (spec.lr, spec.clip_norm, spec.precision, spec.microbatches, spec.eval_every) == (1e-3, None, "bf16", 1, 10)
    # The other hyperparameters stay the saved ones.
    assert spec.optimizer_args == {"betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.0}
    assert len(lines) == 6 and all(line.startswith("resume: ") for line in lines)
    text = "\n".join(lines)
    for words in ("lr=0.001 (saved 0.003): the learning rate of step 601 goes from", "clip_norm=none (saved 1): no "
                  "more clipping", "precision=bf16 (saved fp32)", "microbatches=1 (saved 2): each step is the same sum",
                  "weight_decay=0 (saved 0.1): applied from step 601; the optimizer state continues"):
        assert words in text, words


def test_a_given_value_equal_to_the_saved_one_says_nothing():
    spec, lines = resolve({"optimizer": "adamw", "lr": 3e-3, "seed": 7, "optimizer_args": {"betas": (0.9, 0.99)}})
    assert lines == [] and spec.optimizer_args["betas"] == [0.9, 0.99]


def test_another_optimizer_or_seed_is_refused_naming_both_values():
    with pytest.raises(ResumeError) as e:
        resolve({"optimizer": "sgd", "seed": 3})
    text = str(e.value)
    assert "2 setting(s) differ from the checkpoint's (step 600)" in text
    assert "optimizer=sgd: saved adamw; the saved optimizer state is adamw's" in text
    assert "seed=3: saved 7; another seed draws other batches" in text
    assert "reset_optimizer=True" in text and "another seed is a new run" in text


def test_reset_optimizer_starts_the_given_optimizer_afresh():
    spec, [line] = resolve({"optimizer": "sgd", "optimizer_args": {"momentum": 0.9}}, reset_optimizer=True)
    # The optimizer group is the new run's (TrainSpec's defaults: lr 0.1, constant, no clipping) ...
    assert (spec.optimizer, spec.optimizer_args, spec.lr, spec.lr_schedule, spec.clip_norm) == \
        ("sgd", {"momentum": 0.9}, 0.1, "constant", None)
    # ... and the rest of the run is the saved one.
    assert (spec.steps, spec.seed, spec.microbatches, spec.data) == (1000, 7, 2, "corpus.txt")
    assert line.startswith("resume: reset_optimizer=True: the params of step 600 load, and the optimizer starts "
                           "afresh as sgd lr 0.1 (momentum 0.9, weight_decay 0), constant schedule (saved: adamw")


def test_momentum_turned_on_is_refused_a_new_value_is_not():
    sgd = json.loads(json.dumps(run_settings(TrainSpec(steps=1000, optimizer="sgd", optimizer_args={"momentum": 0.9}))))
    spec, [line] = resolve_resume(TrainSpec(optimizer_args={"momentum": 0.5}), sgd, {"optimizer_args"}, STEP)
    assert spec.optimizer_args["momentum"] == 0.5 and line.startswith("resume: momentum=0.5 (saved 0.9): applied")
    with pytest.raises(ResumeError, match="momentum=0: saved 0.9; sgd would keep other state tensors"):
        resolve_resume(TrainSpec(optimizer_args={"momentum": 0.0}), sgd, {"optimizer_args"}, STEP)


def test_no_step_left_to_run():
    done = {**saved(), "steps": STEP}
    with pytest.raises(ResumeError, match=r"at step 600, and the run ends there \(steps=600\)"):
        resolve_resume(TrainSpec(), done, set(), STEP)


def test_a_checkpoint_from_before_the_settings_were_kept():
    # Such a checkpoint has the optimizer, its given hyperparameters and lr; the rest is as asked.
    old = saved_run({"optimizer": "adamw", "optimizer_args": {"betas": [0.9, 0.99]}, "lr": 3e-3, "data": {}})
    spec, lines = resolve_resume(TrainSpec(steps=700), old, {"steps"}, STEP)
    assert (spec.optimizer, spec.lr, spec.steps, lines) == ("adamw", 3e-3, 700, [])
    assert spec.optimizer_args["betas"] == [0.9, 0.99]
