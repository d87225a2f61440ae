"""``meshdsl train`` and ``--config``: clean user errors (exit 2) before any work, resume checks, a
kill in the middle of a checkpoint save, and the outputs of a short run through the CLI.

Most tests call :func:`meshdsl.tools.cli.main` in-process with ``--tiny`` on a one-device mesh.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from meshdsl import Mesh, SimulatedComm
from meshdsl.tools import cli
from meshdsl.tools.train_cli import DP_MIN_FLOPS, auto_mesh, make_spec
from meshdsl.train.checkpoint import KILL_ENV, latest_checkpoint, load_checkpoint, read_metadata
from meshdsl.train.config import ConfigError, parse_config
from meshdsl.train.model import load_model
from meshdsl.train.run_outputs import METRIC_KEYS, read_metrics
from meshdsl.train.trainer import TrainSpec, build_step, train_state

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--tiny", "--mesh", "data:1", "--samples", "0"]



# Training runs in this process: one torch thread, as each spawned rank has (conftest).
pytestmark = pytest.mark.usefixtures("one_torch_thread")

def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ----------------------------------------------------------------- --config

def test_parse_config_types_and_spaces():
    from models.transformer import Config
    got = parse_config(" d_model=16, tied=true ,norm=rms,dropout=0.5", Config)
    assert got == {"d_model": 16, "tied": True, "norm": "rms", "dropout": 0.5}
    assert isinstance(got["dropout"], float) and got["tied"] is True
    assert parse_config("", Config) == {}


@pytest.mark.parametrize("text, words", [
    ("d_modle=16", ["no field 'd_modle'", "Did you mean 'd_model'?", "^^^^^^^^^^"]),
    ("layers=two", ["layers='two': not a valid int", "Rule: layers is an int"]),
    ("d_model=8,tied=maybe", ["tied='maybe': not a boolean", "          ^^^^^^^^^^"]),
    ("layers", ["item 'layers' is not field=value"]),
    ("layers=2,layers=3", ["field 'layers' is given twice"]),
])
def test_parse_config_errors(text, words):
    from models.transformer import Config
    with pytest.raises(ConfigError) as e:
        parse_config(text, Config)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert "fields: vocab (int), d_model (int)" in str(e.value)


@pytest.mark.parametrize("command", ["plan", "check", "run", "train"])
def test_config_error_is_exit_2_in_every_command(capsys, command):
    extra = ["--mesh", "data:1"] if command != "train" else ["--mesh", "data:1"]
    rc, out, err = run(capsys, command, "transformer", "--tiny", *extra, "--config", "d_modle=16")
    assert rc == 2
    assert f"meshdsl {command}: error: --config: Config has no field 'd_modle'. Did you mean 'd_model'?" in err
    assert "Traceback" not in err


def test_config_changes_the_model_in_plan(capsys):
    rc, out, _ = run(capsys, "plan", "transformer", "--tiny", "--mesh", "data:1", "--json",
                     "--config", "d_ff=24")
    assert rc == 0
    shapes = json.dumps(json.loads(out)["ops"])
    assert '"d_ff": 24' in shapes and '"d_ff": 16' not in shapes


def test_auto_mesh_goes_data_parallel_only_for_a_big_step():
    big = DP_MIN_FLOPS
    assert auto_mesh(16, big, 2)[:2] == ("data:2", "batch:data")
    assert auto_mesh(16, big, 1)[:2] == ("data:1", "")
    assert auto_mesh(12, big, 16)[:2] == ("data:4", "batch:data")   # the largest power of two dividing the batch
    assert auto_mesh(7, big, 4)[:2] == ("data:1", "")
    mesh, layout, why = auto_mesh(32, 0.8e9, 2)
    assert (mesh, layout) == ("data:1", "") and "one process with one torch thread" in why


# ----------------------------------------------------------------- a run and its outputs

def test_train_writes_its_outputs(capsys, tmp_path):
    rc, out, err = run(capsys, "train", *TINY, "--steps", "4", "--eval-every", "2", "--out", str(tmp_path / "o"),
                       "--samples", "1")
    assert rc == 0, err
    assert "meshdsl train transformer: mesh 'data:1'" in out and "unigram entropy" in out
    assert "final eval loss" in out and "collectives per step" in out
    rows = read_metrics(tmp_path / "o")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(set(METRIC_KEYS) <= set(r) for r in rows)
    assert [("eval_loss" in r) for r in rows] == [False, True, False, True]
    assert (tmp_path / "o" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "o" / "samples.txt").read_text().strip()
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    assert cfg["resolved_config"]["vocab"] == 256 and cfg["mesh"] == "data:1" and cfg["steps"] == 4


def test_train_a_model_without_text_inputs_on_its_own_feeds(capsys, tmp_path):
    rc, out, err = run(capsys, "train", "mlp", *TINY, "--steps", "3", "--out", str(tmp_path / "o"))
    assert rc == 0, err
    assert "the model's own feeds" in out
    assert len(read_metrics(tmp_path / "o")) == 3


# ----------------------------------------------------------------- resume errors

def test_resume_without_a_checkpoint(capsys, tmp_path):
    rc, out, err = run(capsys, "train", *TINY, "--steps", "2", "--resume", "--checkpoint", str(tmp_path / "none"))
    assert rc == 2
    assert "--resume: no committed checkpoint in" in err and "Fix: drop --resume" in err
    rc, out, err = run(capsys, "train", *TINY, "--steps", "2", "--resume")
    assert rc == 2 and "--resume needs --checkpoint DIR" in err


def test_resume_from_another_model_or_config(capsys, tmp_path):
    ck = str(tmp_path / "ck")
    rc, _, err = run(capsys, "train", *TINY, "--steps", "2", "--checkpoint", ck, "--out", str(tmp_path / "o"))
    assert rc == 0, err
    rc, _, err = run(capsys, "train", *TINY, "--steps", "4", "--checkpoint", ck, "--resume",
                     "--config", "d_ff=24", "--out", str(tmp_path / "o2"))
    assert rc == 2
    assert "is of this model with another Config" in err and "d_ff: saved 16, now 24" in err
    assert "(--config d_ff=16)" in err
    rc, _, err = run(capsys, "train", "mlp", *TINY, "--steps", "4", "--checkpoint", ck, "--resume",
                     "--out", str(tmp_path / "o3"))
    assert rc == 2
    assert "saved model: 'transformer', this model: 'mlp'" in err
    rc, _, err = run(capsys, "train", *TINY, "--steps", "2", "--checkpoint", ck, "--resume")
    assert rc == 2 and "the checkpoint is at step 2, and the run ends there (--steps 2)" in err


def test_resume_continues_to_the_total_step_count(capsys, tmp_path):
    ck = str(tmp_path / "ck")
    assert run(capsys, "train", *TINY, "--steps", "2", "--checkpoint", ck, "--out", str(tmp_path / "a"))[0] == 0
    rc, out, err = run(capsys, "train", *TINY, "--steps", "4", "--checkpoint", ck, "--resume",
                       "--out", str(tmp_path / "b"))
    assert rc == 0, err
    assert "resuming from step-00000002" in out
    assert [r["step"] for r in read_metrics(tmp_path / "b")] == [3, 4]
    assert read_metadata(latest_checkpoint(ck)).step == 4


# ----------------------------------------------------------------- a resume restores the run

def steps_of(out_dir) -> list[tuple]:
    return [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in read_metrics(out_dir)]


@pytest.mark.parametrize("flags", [
    ["--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.5", "--lr-schedule", "cosine", "--clip-norm", "0.3"],
    ["--lr", "0.02", "--betas", "0.8,0.9", "--clip-norm", "0.5"],     # AdamW, the transformer's default
], ids=["sgd", "adamw"])
def test_a_resume_without_flags_continues_bit_identically(capsys, tmp_path, flags):
    # Every setting that shapes the steps is given once, at the start, none at a default: a warmup,
    # a cosine over 8 steps of a 6-step run, weight decay, accumulation, a seed.  Resumed from step 3
    # with no flag but --resume, steps 4-6 are the uninterrupted run's, bit for bit (same process,
    # same plan: no tolerance).
    ck = tmp_path / "ck"
    rc, _, err = run(capsys, "train", *TINY, "--steps", "6", "--warmup-steps", "2", "--decay-steps", "8",
                     "--weight-decay", "0.01", "--accum", "2", "--seed", "5", "--save-every", "3",
                     "--checkpoint", str(ck), "--out", str(tmp_path / "whole"), *flags)
    assert rc == 0, err
    shutil.copytree(ck / "step-00000003", tmp_path / "at3" / "step-00000003")
    rc, out, err = run(capsys, "train", *TINY, "--checkpoint", str(tmp_path / "at3"), "--resume",
                       "--out", str(tmp_path / "resumed"))
    assert rc == 0, err
    assert "resume:" not in out and "steps 6 (resuming from step-00000003)" in out
    assert steps_of(tmp_path / "resumed") == steps_of(tmp_path / "whole")[3:]


def test_a_changed_flag_on_resume_is_applied_with_a_line_or_refused(capsys, tmp_path):
    ck = tmp_path / "ck"
    assert run(capsys, "train", *TINY, "--steps", "4", "--checkpoint", str(ck), "--out", str(tmp_path / "o"))[0] == 0

    def resume(name, *flags):
        shutil.copytree(ck, tmp_path / name)
        rc, out, err = run(capsys, "train", *TINY, "--checkpoint", str(tmp_path / name), "--resume",
                           "--out", str(tmp_path / f"{name}-out"), *flags)
        return rc, " ".join(out.split()), " ".join(err.split())    # as one line: rich wraps long ones

    rc, out, err = resume("longer", "--steps", "6")
    assert rc == 0, err
    assert ("resume: --steps 6 (saved 4): the run goes on to step 6; the cosine schedule keeps its saved length, "
            "4 steps, so steps 5-6 run at its floor, lr 0.001 (--decay-steps 6 stretches it instead)") in out
    assert [r["lr"] for r in read_metrics(tmp_path / "longer-out")] == [1e-2 / 10] * 2
    rc, out, err = resume("sgd", "--steps", "6", "--optimizer", "sgd")
    assert rc == 2 and "Traceback" not in err
    assert "--optimizer sgd: saved adamw; the saved optimizer state is adamw's" in err and "--reset-optimizer" in err
    rc, out, err = resume("reset", "--steps", "6", "--optimizer", "sgd", "--reset-optimizer")
    assert rc == 0, err
    assert "resume: --reset-optimizer: the params of step 4 load, and the optimizer starts afresh as sgd lr 1" in out
    assert [r["lr"] for r in read_metrics(tmp_path / "reset-out")] == [1.0, 1.0]
    rc, out, err = resume("seed", "--steps", "6", "--seed", "3")
    assert rc == 2 and "--seed 3: saved 0; another seed draws other batches" in err
    rc, out, err = resume("momentum", "--steps", "6", "--momentum", "0.9")
    assert rc == 2 and "--momentum 0.9: adamw, the checkpoint's optimizer, does not read it" in err
    rc, _, err = run(capsys, "train", *TINY, "--reset-optimizer")
    assert rc == 2 and "--reset-optimizer needs --resume" in err


def test_the_default_run_is_adamw_with_warmup_cosine_and_clipping():
    """The transformer (a model that trains on text) gets nanoGPT's recipe, a model that does
    not plain SGD; ``--optimizer`` picks the other row of the recipes."""
    def header(*argv):
        args = cli.build_parser().parse_args(["train", *argv])
        return make_spec(args)[1][3]
    assert "adamw lr 0.01 (warmup 100, cosine to 0.001 at step 1200, clip 1)" in header("--tiny")
    assert "adamw lr 0.01 (warmup 2, cosine to 0.001 at step 20, clip 1)" in header("--tiny", "--steps", "20")
    assert ", sgd lr 1, out " in header("--tiny", "--optimizer", "sgd")    # the old default, whole
    assert ", sgd lr 1, out " in header("mlp", "--tiny")
    assert "(warmup 100, cosine to 0.001 at step 1200)" in header("--tiny", "--clip-norm", "0")


USER_MODEL = textwrap.dedent('''
    """A user's model with a vocab field that reads no text."""
    from dataclasses import dataclass
    import torch
    import meshdsl as md

    @dataclass(frozen=True)
    class Config:
        vocab: int = 50
        batch: int = 4

    def build(cfg=Config()):
        b, v = md.Dim("batch", cfg.batch), md.Dim("vocab", cfg.vocab)
        with md.Graph("user") as g:
            x = md.input("x", [b, v])
            w = md.param("w", [v], init="zeros")
            loss = md.reduce_mean((md.einsum("batch vocab, vocab -> batch", x, w) - 1.0) ** 2)
        return md.Model(g, loss, {"w": w}, lambda seed=0: {"x": torch.randn(cfg.batch, cfg.vocab) / 8}, cfg)
''')


def test_a_user_model_keeps_its_config_and_the_summary_names_its_data(capsys, tmp_path):
    path = tmp_path / "user.py"
    path.write_text(USER_MODEL)
    rc, out, err = run(capsys, "train", str(path), "--mesh", "data:1", "--steps", "3", "--out", str(tmp_path / "o"))
    assert rc == 0, err
    assert "config: vocab=50, batch=4" in out and "sgd lr 1, out" in out
    assert "final eval loss (the model's own feeds, seeds no step uses)" in out and "held-out text" not in out
    assert json.loads((tmp_path / "o" / "config.json").read_text())["resolved_config"]["vocab"] == 50


# ----------------------------------------------------------------- a kill mid-save

# With -m slow: test_checkpoint.py kills a save at every point of the protocol (each leaves a
# loadable checkpoint, the next save cleans up), and test_resume_continues_to_the_total_step_count
# resumes the CLI's run.
@pytest.mark.slow
def test_a_kill_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path, capsys):
    root = tmp_path / "ck"
    # The save of step 4 SIGKILLs its process once its shard is on disk (train/checkpoint.py, KILL_POINTS).
    run_ = subprocess.run([sys.executable, "-m", "meshdsl", "train", "--tiny", "--mesh", "data:1", "--samples", "0",
                           "--steps", "4", "--optimizer", "sgd", "--save-every", "2", "--checkpoint", str(root),
                           "--out", str(tmp_path / "o")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, KILL_ENV: "after-shard:0@4"})
    assert run_.returncode == -signal.SIGKILL, run_.stderr
    assert (root / ".tmp-step-00000004" / "rank-00000.safetensors").is_file()
    assert latest_checkpoint(root) == root / "step-00000002"
    assert not (root / "step-00000004").exists()
    info = read_metadata(root / "step-00000002")
    model = load_model("transformer", tiny=True, vocab=256)
    step = build_step(model, TrainSpec(mesh="data:1"), SimulatedComm(Mesh.parse("data:1")))
    want = {k: spec for k, (spec, _) in train_state(step).items()}
    got = load_checkpoint(root / "step-00000002", want, "data:1", model="transformer")
    assert set(got) == set(info.tensors) and info.step == 2
    # The CLI resumes from it and finishes the run.
    rc, out, err = run(capsys, "train", *TINY, "--steps", "4", "--checkpoint", str(root), "--resume",
                       "--out", str(tmp_path / "o2"))
    assert rc == 0, err
    assert [r["step"] for r in read_metrics(tmp_path / "o2")] == [3, 4]
    assert latest_checkpoint(root) == root / "step-00000004"


def test_train_with_adamw_warmup_and_clipping(capsys, tmp_path):
    rc, out, err = run(capsys, "train", *TINY, "--steps", "4", "--optimizer", "adamw", "--lr", "1e-2",
                       "--warmup-steps", "2", "--clip-norm", "1", "--out", str(tmp_path / "o"))
    assert rc == 0, err
    assert "adamw lr 0.01 (warmup 2, cosine to 0.001 at step 4, clip 1)" in out
    rows = read_metrics(tmp_path / "o")
    assert [r["lr"] for r in rows[:2]] == pytest.approx([5e-3, 1e-2])     # linear warmup
    assert rows[3]["lr"] < rows[2]["lr"] and all(r["grad_norm"] > 0 for r in rows)
    rc, _, err = run(capsys, "train", *TINY, "--optimizer", "adamw", "--momentum", "0.9")
    assert rc == 2 and "--momentum given with --optimizer adamw" in err
    rc, _, err = run(capsys, "train", *TINY, "--steps", "4", "--warmup-steps", "5")
    assert rc == 2 and "--warmup-steps 5 is more than --steps 4" in err


# With -m slow: test_moe_adamw.py trains the MoE's experts split over 2 gloo processes (AdamW,
# clipping) against dense, and test_feeder.py runs `meshdsl train` on 2 gloo processes.
@pytest.mark.slow
def test_train_moe_with_expert_parallelism_on_two_processes(capsys, tmp_path):
    # `meshdsl train moe`: the routed MoE on text, its experts split over 2 gloo processes
    # (dispatch and combine are alltoalls), AdamW with clipping.
    rc, out, err = run(capsys, "train", "moe", "--tiny", "--mesh", "data:2", "--layout", "batch:data; experts:data",
                       "--optimizer", "adamw", "--lr", "0.01", "--clip-norm", "1", "--steps", "3",
                       "--samples", "1", "--out", str(tmp_path / "o"))
    assert rc == 0, err
    assert "meshdsl train moe: mesh 'data:2', layout 'batch:data; experts:data' on 2 process(es)" in out
    assert "experts=4" in out and "alltoall" in out
    rows = read_metrics(tmp_path / "o")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["loss"] > 0 and r["grad_norm"] > 0 for r in rows)
    assert (tmp_path / "o" / "samples.txt").read_text().strip()


def test_train_bucket_mb_reaches_the_training_step(capsys, tmp_path):
    # --bucket-mb flows into TrainSpec and from it into TrainStep's plan: the default packs the
    # data-parallel gradient allreduces into buckets, 0 leaves one allreduce per gradient.
    rc, out, err = run(capsys, "train", *TINY, "--steps", "1", "--bucket-mb", "0", "--out", str(tmp_path / "o"))
    assert rc == 0, err
    assert json.loads((tmp_path / "o" / "config.json").read_text())["bucket_mb"] == 0
    with pytest.raises(SystemExit) as e:
        run(capsys, "train", *TINY, "--bucket-mb", "-1")
    assert e.value.code == 2 and "--bucket-mb: -1 is out of range" in capsys.readouterr().err
    model = load_model("transformer", tiny=True)
    kinds = {}
    for mb in (0.0, 25.0):
        spec = TrainSpec(mesh="data:2", layout="batch:data", bucket_mb=mb)
        step = build_step(model, spec, SimulatedComm(Mesh.parse("data:2")))
        kinds[mb] = step.plan.totals()
    assert "bucket_allreduce" not in kinds[0.0] and kinds[0.0]["allreduce"]["count"] > 1
    assert kinds[25.0]["bucket_allreduce"]["count"] >= 1
    assert kinds[25.0].get("allreduce", {"count": 0})["count"] < kinds[0.0]["allreduce"]["count"]


def test_train_accum_takes_the_same_steps_one_micro_batch_at_a_time(capsys, tmp_path):
    """--accum 2 gives the losses of the whole-batch run, and its step is an accumulate step
    (lowering/accumulate.py: a process holds one micro-batch's activations at a time)."""
    losses = {}
    for accum in (1, 2):
        out_dir = tmp_path / f"a{accum}"
        rc, out, err = run(capsys, "train", *TINY, "--steps", "3", "--accum", str(accum), "--out", str(out_dir))
        assert rc == 0, err
        losses[accum] = [r["loss"] for r in read_metrics(out_dir)]
    assert losses[2] == pytest.approx(losses[1], rel=1e-5)
    step = build_step(load_model("transformer", tiny=True), TrainSpec(mesh="data:1", microbatches=2),
                      SimulatedComm(Mesh.parse("data:1")))
    assert [s.kind for s in step.plan.steps if s.kind not in ("param", "input")] == ["accumulate"]


def test_train_notes_a_schedule_that_has_no_effect(capsys, tmp_path):
    """As `meshdsl plan` notes it (and md.fit, which runs the same rank code): --schedule on a layout
    that pipelines nothing is said in one line, and the run goes on."""
    rc, out, err = run(capsys, "train", "mlp", *TINY, "--steps", "1", "--schedule", "zbh1", "--out", str(tmp_path / "o"))
    assert rc == 0, err
    assert out.count("note: schedule 'zbh1' has no effect: the layout pipelines no repeat") == 1, out
