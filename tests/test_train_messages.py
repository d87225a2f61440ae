"""What a training run says about its state, in the words of whoever started it.

``md.fit`` names its settings as keywords (``resume=True``, ``resume_from=2``), ``meshdsl train``
as flags (``--resume``, ``--resume-from 2``); a checkpoint of another model is refused before any
line on how its settings would resume; a pipeline's saved schedule, unused by a resume that
pipelines nothing, is said to be the checkpoint's; checkpoint.json and its messages show the
user's mesh (no micro-batch axis) and a damaged step's fix lists the intact ones; a new run does
not add its rows to another run's metrics.jsonl.  Tiny Llama (tests/heldout_tiedllama.py) on
the simulated mesh, or the CLI in this process.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import meshdsl as md
from meshdsl.tools import cli
from meshdsl.train.run_outputs import read_metrics

ROOT = Path(__file__).resolve().parents[1]
LLAMA, VIT = str(ROOT / "tests" / "heldout_tiedllama.py"), str(ROOT / "tests" / "heldout_clsvit.py")
SMALL = dict(optimizer="adamw", lr=0.01, eval_every=100, eval_batches=1, samples=0)
CLI_SMALL = ["--tiny", "--samples", "0", "--mesh", "data:1", "--eval-batches", "1"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def llama():
    return md.load_model(LLAMA, tiny=True, vocab=256)   # text is byte tokens: vocab 256


def run(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out + err


@pytest.fixture(scope="module")
def accum_run(tmp_path_factory):
    """4 steps of 2 micro-batches each, data parallel on the simulated data:2, saved at 2 and 4."""
    root = tmp_path_factory.mktemp("accum")
    md.fit(llama(), mesh="data:2", layout="batch:data", steps=4, microbatches=2, checkpoint=str(root / "ck"),
           save_every=2, out=str(root / "o"), **SMALL)
    return root


def error_of(call) -> str:
    with pytest.raises(md.MeshDSLError) as e:
        call()
    return str(e.value)


def test_fit_names_its_keywords_and_the_cli_its_flags(capsys, accum_run, tmp_path):
    ck = str(accum_run / "ck")
    nowhere = error_of(lambda: md.fit(llama(), steps=6, checkpoint=str(tmp_path / "nowhere"), resume=True))
    assert "resume=True: no committed checkpoint" in nowhere and "drop resume=True" in nowhere, nowhere
    missing = error_of(lambda: md.fit(llama(), steps=6, checkpoint=ck, resume_from=3))
    assert "resume_from=3: no checkpoint" in missing and "e.g. resume_from=4" in missing, missing
    no_root = error_of(lambda: md.fit(llama(), steps=6, resume_from=3))
    assert "needs checkpoint=DIR" in no_root, no_root
    for text in (nowhere, missing, no_root):
        assert "--resume" not in text and "--checkpoint" not in text, text
    rc, out = run(capsys, "train", LLAMA, *CLI_SMALL, "--steps", "6", "--checkpoint", ck, "--resume-from", "3")
    assert rc == 2 and "--resume-from 3: no checkpoint" in out and "e.g. --resume-from 4" in out, out
    assert "resume_from=" not in out, out


def test_fit_a_damaged_latest_checkpoint_fix_names_resume_from(accum_run, tmp_path):
    ck = shutil.copytree(accum_run / "ck", tmp_path / "ck")
    shard = ck / "step-00000004" / "rank-00000.safetensors"
    os.truncate(shard, shard.stat().st_size - 64)
    text = error_of(lambda: md.fit(llama(), steps=6, checkpoint=str(ck), resume=True))
    assert "resume=True: the latest checkpoint" in text and "resume_from=2 once the damaged" in text, text
    assert "checkpoint=NEW_DIR" in text and "--resume" not in text, text


def test_fit_refuses_another_models_checkpoint_before_any_resume_line(capsys, accum_run):
    capsys.readouterr()
    text = error_of(lambda: md.fit(md.load_model(VIT, tiny=True), steps=8, checkpoint=str(accum_run / "ck"),
                                   resume=True))
    assert "resume=True: checkpoint" in text and "another model" in text and "--" not in text, text
    out = capsys.readouterr().out
    assert "resume:" not in out, out      # no "steps=8 (saved 4) ..." line for a run that never starts


def test_accumulation_records_the_users_mesh_and_a_damaged_load_lists_the_intact_steps(accum_run, tmp_path):
    ck = shutil.copytree(accum_run / "ck", tmp_path / "ck")
    doc = json.loads((ck / "step-00000004" / "checkpoint.json").read_text())
    assert doc["mesh"] == "data:2", doc["mesh"]       # not "data:2; _mb:2", the micro-batches' axis
    shard = ck / "step-00000004" / "rank-00000.safetensors"
    os.truncate(shard, shard.stat().st_size - 64)
    text = error_of(lambda: md.load_trained(str(ck / "step-00000004")))   # as `meshdsl export` loads it
    assert f"older intact checkpoint (sizes and headers checked; using it hashes its files): step 2 " \
           f"('{ck / 'step-00000002'}')" in text and "--resume-from STEP" not in text, text


def test_a_pipeline_checkpoint_resumed_data_parallel_says_whose_schedule_it_is(capsys, tmp_path):
    ck = str(tmp_path / "ck")
    md.fit(llama(), mesh="stage:2", layout="layer:stage", steps=2, microbatches=2, schedule="1f1b",
           checkpoint=ck, **SMALL)
    capsys.readouterr()
    md.fit(llama(), mesh="data:1", steps=3, microbatches=1, checkpoint=ck, resume=True)
    out = capsys.readouterr().out
    assert "note: schedule '1f1b' (the checkpoint's: a resume keeps the saved run's settings) has no effect" \
        in out, out


def test_a_new_run_into_another_runs_out_is_refused_and_a_resume_appends(capsys, accum_run, tmp_path):
    out_dir = tmp_path / "o"
    shutil.copytree(accum_run / "o", out_dir)
    before = (out_dir / "metrics.jsonl").read_bytes()
    text = error_of(lambda: md.fit(llama(), steps=2, out=str(out_dir), **SMALL))
    assert "holds another run's metrics (metrics.jsonl: 4 rows, steps 1-4)" in text, text
    assert "out='runs/my-run-2'" in text and "resume=True" in text, text
    rc, said = run(capsys, "train", LLAMA, *CLI_SMALL, "--steps", "2", "--out", out_dir)
    assert rc == 2 and "--out runs/my-run-2" in said and "--resume" in said and "Traceback" not in said, said
    assert (out_dir / "metrics.jsonl").read_bytes() == before      # nothing written by either
    ck = shutil.copytree(accum_run / "ck", tmp_path / "ck")
    md.fit(llama(), steps=5, checkpoint=str(ck), resume=True, out=str(out_dir))
    assert [r["step"] for r in read_metrics(out_dir)] == [1, 2, 3, 4, 5]
