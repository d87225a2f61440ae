"""``meshdsl generate`` / ``meshdsl eval`` and ``md.load_trained`` / ``md.evaluate``: a run's
checkpoint, saved split over a model axis, read back whole; its eval loss is the run's final one,
its text what ``md.generate`` samples from the trained step's params; errors are clean."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import meshdsl as md
from meshdsl.tools import cli
from meshdsl.train.model import shipped_models_dir
from meshdsl.tools.trained_cli import shown

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny transformer trained 2 steps with its heads split over 2 simulated ranks."""
    root = tmp_path_factory.mktemp("gen")
    before = torch.get_num_threads()
    res = md.fit("transformer", tiny=True, config={"vocab": 256}, mesh="model:2", layout="heads:model", steps=2, lr=0.01,
                 optimizer="adamw", checkpoint=str(root / "ck"), out=str(root / "out"), samples=0)
    torch.set_num_threads(before)
    return root, res


def test_eval_of_a_resharded_checkpoint_is_the_runs_final_eval_loss(capsys, trained):
    root, res = trained
    for path in (root / "out", root / "ck", root / "ck" / "step-00000002"):
        rc, out, err = run(capsys, "eval", path)
        assert rc == 0, err
        assert f"{res.final_eval_loss:.4f} nats/token" in out and "held-out text; 4 batches" in out
    t = md.load_trained(root / "ck")
    got = md.evaluate(t.model, t.params, seed=t.seed)
    assert got["batches"] == 4
    # the run evaluated on its 2-rank plan, this on the dense program: fp32 rounding apart
    assert got["loss"] == pytest.approx(res.final_eval_loss, rel=1e-5)
    full = res.step.full_params(frozen=True)
    assert t.params.keys() == full.keys() and all(torch.equal(t.params[k], full[k]) for k in full)


def test_generate_samples_what_md_generate_samples_from_the_trained_params(capsys, trained):
    root, res = trained
    rc, out, err = run(capsys, "generate", root / "out", "--prompt", "def ", "--tokens", "40", "--seed", "3",
                       "--top-k", "5", "--raw")
    assert rc == 0, err
    want = md.generate(res.model, res.step.full_params(frozen=True), "def ", 40, seed=3, top_k=5)
    assert out == "def " + want + "\n"
    assert "40 tokens in" in err and "step 2 of" in err
    rc, out, _ = run(capsys, "generate", root / "out", "--prompt", "def ", "--tokens", "40", "--seed", "3",
                     "--top-k", "5")
    assert rc == 0 and out == "def " + shown(want) + "\n"
    assert not any(ord(c) < 32 and c not in "\n\t" for c in out)


def test_shown_escapes_control_characters_only():
    assert shown("a\x19b\n\tc\x1b[0m\u00e9\x7f\x85") == "a\\x19b\n\tc\\x1b[0m\u00e9\\x7f\\x85"


def test_top_k_1_is_greedy_and_the_thread_count_is_restored(trained):
    _, res = trained
    params = res.step.full_params(frozen=True)
    torch.set_num_threads(2)
    try:
        hot = md.generate(res.model, params, "import ", 10, temperature=0.8, seed=5, top_k=1)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
    assert hot == md.generate(res.model, params, "import ", 10, temperature=0)
    with pytest.raises(md.ModelError, match="top_k 0 is not a positive int"):
        md.generate(res.model, params, "x", 1, top_k=0)


def test_clean_errors(capsys, trained, tmp_path):
    root, _ = trained
    rc, _, err = run(capsys, "generate", tmp_path / "nope")
    assert rc == 2 and "generate: no such run or checkpoint" in err and "Traceback" not in err
    rc, _, err = run(capsys, "eval", root / "out" / "config.json")
    assert rc == 2 and "is a file, not a run or checkpoint folder" in err
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = json.loads((root / "out" / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps({**config, "checkpoint": None}))
    rc, _, err = run(capsys, "generate", run_dir)
    assert rc == 2 and "saved no checkpoint" in err and "--checkpoint DIR" in err
    rc, _, err = run(capsys, "eval", root / "ck", "--model", "mlp")
    assert rc == 2 and "is of model 'transformer', whose Config does not fit" in err and "vocab" in err
    other = tmp_path / "mygpt.py"     # the transformer's file, its graph named otherwise
    text = (shipped_models_dir() / "transformer.py").read_text()
    other.write_text(text.replace('md.Graph("transformer")', 'md.Graph("mygpt")'))
    rc, _, err = run(capsys, "generate", root / "ck", "--model", other)
    assert rc == 2 and "is of model 'transformer', not of 'mygpt'" in err
    bad = tmp_path / "bad"
    shutil.copytree(root / "ck", bad)
    shard = next((bad / "step-00000002").glob("rank-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    rc, _, err = run(capsys, "generate", bad)
    assert rc == 2 and "is damaged; nothing was loaded" in err and "sha256" in err
    # Its fix speaks to any caller (no train-only --resume-from): here no older step is there to use.
    assert "no older checkpoint in" in err and "is intact: save this step again" in err and "--resume" not in err


def test_a_model_on_its_own_data_evaluates_but_does_not_generate(capsys, tmp_path):
    res = md.fit("mlp", tiny=True, steps=1, checkpoint=str(tmp_path / "ck"), samples=0)
    rc, out, err = run(capsys, "eval", tmp_path / "ck")
    assert rc == 0, err
    assert "the model's own feeds" in out and f"{res.final_eval_loss:.4f}" in out
    rc, _, err = run(capsys, "generate", tmp_path / "ck")
    assert rc == 2 and "is not a text model" in err and "meshdsl eval" in err


def test_eval_with_config_evaluates_the_eval_graph_on_the_runs_params(capsys, tmp_path):
    """`meshdsl eval RUN --config mode=eval` (Python: md.load_trained(run, config=...)) rebuilds the
    run's model file with Config fields over the saved ones: here DenseNet's eval graph, which
    normalises with the running statistics the run saved, not the batch's."""
    from pathlib import Path
    densenet = str(Path(__file__).parent / "heldout_densenet.py")
    md.fit(densenet, tiny=True, mesh="data:1", steps=2, lr=0.1, checkpoint=str(tmp_path / "ck"), samples=0,
           out=str(tmp_path / "run"))
    t = md.load_trained(tmp_path / "run", config={"mode": "eval"})
    assert t.model.config.mode == "eval"
    want = md.evaluate(md.load_model(densenet, tiny=True, mode="eval"), t.params, seed=t.seed)["loss"]
    train_graph = md.evaluate(md.load_trained(tmp_path / "run").model, t.params, seed=t.seed)["loss"]
    assert want != pytest.approx(train_graph, rel=1e-4)       # batch statistics differ from running ones
    rc, out, err = run(capsys, "eval", tmp_path / "run", "--config", "mode=eval")
    assert rc == 0, err
    assert f"{want:.4f}" in out
    rc, _, err = run(capsys, "eval", tmp_path / "run", "--config", "mdoe=eval")
    assert rc == 2 and "has no field 'mdoe'" in err and "Did you mean 'mode'?" in err and "Traceback" not in err
