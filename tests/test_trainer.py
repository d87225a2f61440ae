"""The training loop (:mod:`meshdsl.train.trainer`): outputs, the Python API on a user's own model
file and batches, resharding resume (4 -> 2 -> 1 processes), generation, and learning.

The dense single-device run is the oracle: a run resumed on another mesh, layout or process count
must give the losses and params of the uninterrupted run.
"""
from __future__ import annotations

import json
import shutil
import textwrap

import pytest
import torch

import meshdsl as md
from meshdsl.train.data import ByteTokenizer, TokenData, default_corpus_text
from meshdsl.train.generate import generate_many
from meshdsl.train.model import ModelError, load_model, load_module
from meshdsl.train.resume import ResumeError
from meshdsl.train.trainer import train_state
from meshdsl.train.run_outputs import METRIC_KEYS, read_metrics
from meshdsl.train.checkpoint import latest_checkpoint, load_checkpoint

MODEL = dict(tiny=True, config={"vocab": 256}, samples=0, eval_batches=1)
TINY = dict(MODEL, lr=0.5)
# Twenty optimizer steps on reordered fp32 sums (a sharded contraction adds its partial sums in another
# order) stay within ~1e-6 of the dense run; a wrong restore (a missing or mis-sliced param, the
# wrong step's batch) moves the loss by 1e-2 or more.
RTOL, ATOL = 1e-4, 1e-5
# The learning test: one block, 400 SGD steps of 16 x 32 bytes (a few seconds of CPU).
LEARN_CONFIG = dict(vocab=256, d_model=64, heads=4, d_head=16, d_ff=256, layers=1, seq=32, batch=16)
LEARN_STEPS, LEARN_LR = 400, 1.0



# Training runs in this process: one torch thread, as each spawned rank has (conftest).
pytestmark = pytest.mark.usefixtures("one_torch_thread")

@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(default_corpus_text(60_000), encoding="utf-8")
    return str(path)


def test_a_short_run_writes_every_output(tmp_path, text_file):
    r = md.fit("transformer", steps=4, data=text_file, out=str(tmp_path), eval_every=2,
                 **{**TINY, "samples": 2, "sample_tokens": 12})
    rows = read_metrics(tmp_path)
    assert [x["step"] for x in rows] == [1, 2, 3, 4] and all(set(METRIC_KEYS) <= set(x) for x in rows)
    assert rows[1]["eval_loss"] == pytest.approx(r.rows[1]["eval_loss"]) and r.final_eval_loss == rows[3]["eval_loss"]
    assert (tmp_path / "loss.png").stat().st_size > 1000
    samples = (tmp_path / "samples.txt").read_text()
    assert samples.count("--- sample") == 2 and len(r.samples) == 2
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["resolved_config"]["d_model"] == 8 and cfg["data"]["source"] == text_file
    assert r.unigram_entropy == pytest.approx(TokenData.load(text_file).unigram_entropy())
    assert r.collectives_per_step == {}


USER_MODEL = textwrap.dedent('''
    """A user's model file: linear regression, not one of meshdsl's models."""
    from dataclasses import dataclass
    import torch
    import meshdsl as md

    @dataclass(frozen=True)
    class Config:
        batch: int = 8
        features: int = 4

    def build(cfg=Config()):
        b, f = md.Dim("batch", cfg.batch), md.Dim("features", cfg.features)
        with md.Graph("linreg") as g:
            x, y = md.input("x", [b, f]), md.input("y", [b])
            w = md.param("w", [f], init="zeros")
            loss = md.reduce_mean((md.einsum("batch features, features -> batch", x, w) - y) ** 2)
        feeds = lambda seed=0: {"x": torch.randn(cfg.batch, cfg.features), "y": torch.zeros(cfg.batch)}
        return md.Model(g, loss, {"w": w}, feeds, cfg)
''')

TRUE_W = torch.tensor([1.0, -2.0, 0.5, 3.0])


def user_batch(step: int) -> dict:
    """The user's own batches: a pure function of the step."""
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
    return {"x": x, "y": x @ TRUE_W}


def test_python_api_trains_a_user_model_on_its_own_batches(tmp_path):
    path = tmp_path / "linreg.py"
    path.write_text(USER_MODEL)
    build, Config = load_module(path).build, load_module(path).Config
    ck = str(tmp_path / "ck")
    first = md.fit(build(Config()), mesh="data:2", layout="batch:data", steps=30, data=user_batch, lr=0.1,
                     checkpoint=ck, save_every=10, keep=2, eval_data=[user_batch(10**6)])
    assert first.rows[-1]["loss"] < 0.05 * first.rows[0]["loss"]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["latest", "step-00000020", "step-00000030"]
    # The resume takes lr, the optimizer and the save cadence from the checkpoint.
    more = md.fit(build(Config()), mesh="data:1", steps=60, data=user_batch, checkpoint=ck, resume=True)
    assert more.start_step == 30 and [r["step"] for r in more.rows] == list(range(31, 61))
    assert {r["lr"] for r in more.rows} == {0.1}
    torch.testing.assert_close(more.step.full_params()["w"], TRUE_W, rtol=0, atol=1e-3)
    with pytest.raises(ResumeError, match="optimizer=adamw: saved sgd"):
        md.fit(build(Config()), steps=70, data=user_batch, checkpoint=ck, resume=True, optimizer="adamw")
    # The CLI trains the same file on its own make_feeds.
    assert md.fit(str(path), steps=3, lr=0.1).rows[-1]["step"] == 3


def test_resume_reshards_from_4_to_2_and_1_processes(tmp_path, text_file):
    ck = tmp_path / "ck"
    # AdamW with warmup, a cosine over 20 steps and clipping: its moments, step count and schedule must
    # survive the reshard too, and the resumes give no optimizer setting: the checkpoint has them.
    opts = dict(MODEL, data=text_file, optimizer="adamw", lr=1e-2, clip_norm=1.0, warmup_steps=3, decay_steps=20)
    whole = md.fit("transformer", mesh="data:1", steps=20, **opts)
    first = md.fit("transformer", mesh="data:2; model:2", layout="batch:data; d_ff:model", nproc=4, steps=10,
                     checkpoint=str(ck), save_every=10, **opts)
    losses = lambda r: torch.tensor([x["loss"] for x in r.rows])
    torch.testing.assert_close(losses(first), losses(whole)[:10], rtol=RTOL, atol=ATOL)
    runs = {}
    for name, mesh, layout, nproc in (("two", "model:2", "d_ff:model", 2), ("one", "data:1", "", 1)):
        shutil.copytree(ck, tmp_path / name)
        runs[name] = md.fit("transformer", mesh=mesh, layout=layout, nproc=nproc, steps=20,
                              checkpoint=str(tmp_path / name), resume=True, **MODEL, data=text_file)
        assert [x["step"] for x in runs[name].rows] == list(range(11, 21))
        torch.testing.assert_close(losses(runs[name]), losses(whole)[10:], rtol=RTOL, atol=ATOL)
    # The whole training state at step 20 (params, AdamW moments, step count), saved from 2
    # processes, matches the uninterrupted run's.
    state = train_state(whole.step)
    assert any(k.startswith("opt/") and k != "opt/step" for k in state)
    got = load_checkpoint(latest_checkpoint(tmp_path / "two"), {k: s for k, (s, _) in state.items()}, "data:1",
                          model="transformer")
    assert set(got) == set(state) and int(got["opt/step"][0]) == 20
    for k, (_, xs) in state.items():
        torch.testing.assert_close(got[k][0], xs[0], rtol=RTOL, atol=ATOL, msg=k)


# With -m slow: test_train_cli.py's resume with no flags is bit-identical (AdamW, warmup, clipping) in
# one process, and the resumes of processes' runs are test_resume_reshards_from_4_to_2_and_1_processes
# and test_feeder.py's two-process run.
@pytest.mark.slow
def test_a_resume_on_2_processes_is_bit_identical(tmp_path, text_file):
    # AdamW with warmup, cosine and clipping on 2 gloo processes; resumed from step 4 with no
    # setting but the model's, the run's steps 5-8 come back bit for bit: the same plan on the same
    # mesh reads the same params, moments, step count, learning rates and batches.
    spec = dict(MODEL, mesh="data:2", layout="batch:data", nproc=2, data=text_file, timeout=30, job_timeout=240)
    whole = md.fit("transformer", steps=8, optimizer="adamw", lr=1e-2, clip_norm=0.5, warmup_steps=2,
                   checkpoint=str(tmp_path / "ck"), save_every=4, **spec)
    shutil.copytree(tmp_path / "ck" / "step-00000004", tmp_path / "at4" / "step-00000004")
    resumed = md.fit("transformer", checkpoint=str(tmp_path / "at4"), resume=True, **spec)
    keys = ("step", "loss", "lr", "grad_norm", "eval_loss")
    assert [[r.get(k) for k in keys] for r in resumed.rows] == [[r.get(k) for k in keys] for r in whole.rows[4:]]


def test_fit_runs_with_one_torch_thread_unless_told(capsys, tmp_path):
    path = tmp_path / "linreg.py"
    path.write_text(USER_MODEL)
    build, Config = load_module(path).build, load_module(path).Config
    seen = []

    def batch(step):
        seen.append(torch.get_num_threads())
        return user_batch(step)

    session_threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        md.fit(build(Config()), steps=2, data=batch, lr=0.1)
        assert "md.fit: 1 torch thread(s) in this process (as each spawned rank; threads=N sets another)" in \
            capsys.readouterr().out
        md.fit(build(Config()), steps=2, data=batch, lr=0.1, threads=2)
        assert seen == [1, 1, 2, 2] and torch.get_num_threads() == 3    # the count before, restored
    finally:
        torch.set_num_threads(session_threads)   # the later tests' count (conftest.py)


def _greedy(model, params, prompt: str, num_tokens: int) -> str:
    """Greedy decoding written out: each new token is the argmax of the dense program's logits
    at the context's last position, the context being the last ``seq`` tokens so far.  The
    positions after the context, and the other rows, hold random tokens: the model is causal and
    its rows independent, so they change nothing."""
    prog = md.DenseProgram({"logits": model.logits})
    (ids_name,) = prog.inputs
    batch, seq, _ = model.logits.shape.sizes
    toks, new = list(prompt.encode("utf-8")), []
    rng = torch.Generator().manual_seed(0)
    for _ in range(num_tokens):
        ctx = toks[-seq:]
        ids = torch.randint(0, 256, (batch, seq), generator=rng)
        ids[0, :len(ctx)] = torch.tensor(ctx)
        logits = prog({ids_name: ids}, params)["logits"]
        nxt = int(logits[0, len(ctx) - 1, :256].argmax())
        toks.append(nxt)
        new.append(nxt)
    return ByteTokenizer().decode(torch.tensor(new))


def test_generate_continues_with_the_dense_programs_tokens():
    # Freshly initialised params: their next tokens vary with the context (a few training
    # steps make the tiny model predict one frequent byte, which would pin little).
    model = load_model("transformer", tiny=True, vocab=256)
    params = md.DenseProgram({"logits": model.logits}).init_params(0)
    # Greedy: the argmax of the logits step by step; 16 tokens run past the 8-token context.
    greedy = md.generate(model, params, "def ", max_new_tokens=16, temperature=0)
    assert greedy == _greedy(model, params, "def ", 16)
    # Sampling: the seed fixes the text, another seed gives another.
    a = md.generate(model, params, "def ", max_new_tokens=16, seed=1)
    assert a == md.generate(model, params, "def ", max_new_tokens=16, seed=1)
    assert a != md.generate(model, params, "def ", max_new_tokens=16, seed=2)
    # Prompts in batches of the model's 4 rows: each row continues its own prompt alone.
    prompts = ["x", "def ", "import torch", "", "a = 1\n", "y"]
    many = generate_many(model, params, prompts, max_new_tokens=5, temperature=0)
    assert many == [md.generate(model, params, p, max_new_tokens=5, temperature=0) for p in prompts]
    assert many[0] == _greedy(model, params, "x", 5) and many[4] == _greedy(model, params, "a = 1\n", 5)
    with pytest.raises(ModelError, match="the model exposes no logits"):
        md.generate(load_model("mlp", tiny=True), {}, "x")
    with pytest.raises(ModelError, match="vocab is 16, smaller than the 256 byte tokens"):
        tiny = load_model("transformer", tiny=True)
        md.generate(tiny, {k: torch.zeros(1) for k in tiny.params}, "x")


# With -m slow (long repetition): test_models.py's llama learns below the unigram entropy in md.fit too.
@pytest.mark.slow
def test_learning_beats_the_unigram_entropy():
    # A small slice of the default corpus; a small transformer learns its bigram statistics in a few
    # hundred SGD steps, which a model of byte frequencies alone cannot.
    data = TokenData(ByteTokenizer().encode(default_corpus_text(300_000)), seed=0)
    r = md.fit("transformer", mesh="data:1", steps=LEARN_STEPS, data=data, lr=LEARN_LR, samples=0,
                 eval_batches=8, config=LEARN_CONFIG)
    assert r.final_eval_loss < data.unigram_entropy() - 0.2, (r.final_eval_loss, data.unigram_entropy())


def test_generate_samples_without_dropout():
    """A model trained with dropout samples as torch's ``model.eval()`` does: its greedy text is
    the one of the same model with no dropout (same params)."""
    on = load_model("transformer", tiny=True, vocab=256, dropout=0.5)
    off = load_model("transformer", tiny=True, vocab=256)
    params = md.DenseProgram({"logits": off.logits}).init_params(0)
    assert md.generate(on, params, "def ", max_new_tokens=8, temperature=0) == _greedy(off, params, "def ", 8)


def test_fit_hands_its_process_settings_to_the_launcher(monkeypatch):
    # backend=, timeout= and job_timeout= are the CLI's --backend, --timeout and --job-timeout of
    # a spawned run: they reach the launcher as its backend and its collective and job timeouts.
    import meshdsl.processes.launcher as launcher
    seen = {}
    monkeypatch.setattr(launcher, "launch", lambda fn, mesh, **kw: seen.update(kw) or ["result"])
    got = md.fit("mlp", tiny=True, mesh="data:2", layout="batch:data", steps=1, nproc=2, backend="gloo",
                 timeout=7.0, job_timeout=11.0)
    assert got == "result"
    assert (seen["backend"], seen["collective_timeout"], seen["timeout"], seen["nproc"]) == ("gloo", 7.0, 11.0, 2)
