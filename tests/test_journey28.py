"""journey28: training state a user can trust, end to end, for two model files a user writes.

A user who read README.md and docs/guide/ wrote ``heldout_tiedllama.py`` (RMSNorm, RoPE, GQA,
SwiGLU, tied embeddings; trains on text) and ``heldout_clsvit.py`` (patch einsum, class token,
LayerNorm, MLP head; trains on its own ``batches``).  For each, with AdamW, clipping, a warmup and
cosine schedule and micro-batches, from Python (``md.fit``) and from the CLI (``meshdsl train``):

* a run stopped at a checkpoint and resumed on the saved mesh and layout repeats the uninterrupted
  run bit for bit (training.md: "a resume on the saved mesh and layout repeats the uninterrupted
  run bit for bit");
* resumed on another layout (DP -> TP, TP -> FSDP, pipeline -> DP) it continues the uninterrupted
  (and the dense) run within fp32 rounding;
* damage, a missing checkpoint, another model or optimizer: one clear error, nothing loaded;
  a rank killed mid-save leaves the last good checkpoint the latest;
* ``meshdsl export`` writes weights a plain torch twin of each model turns into the same logits.

The CLI trains a multi-device mesh on real processes (one per device), so its resharding and its
kill mid-save are gloo runs, under ``-m slow``; the default set runs the simulated mesh
(``md.fit`` of a Model object) and the CLI on one process.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import meshdsl as md
from meshdsl.tools import cli
from meshdsl.train.checkpoint import KILL_ENV
from meshdsl.train.run_outputs import read_metrics

ROOT = Path(__file__).resolve().parents[1]
LLAMA, VIT = str(ROOT / "tests" / "heldout_tiedllama.py"), str(ROOT / "tests" / "heldout_clsvit.py")
# AdamW + clipping + warmup and cosine over the 4-step run + 2 micro-batches, nothing at a default.
RECIPE = dict(optimizer="adamw", lr=0.01, warmup_steps=1, lr_schedule="cosine", decay_steps=4, clip_norm=0.5,
              microbatches=2, seed=3, eval_every=100, eval_batches=1, samples=0)
CLI_RECIPE = ["--tiny", "--samples", "0", "--optimizer", "adamw", "--lr", "0.01", "--warmup-steps", "1",
              "--decay-steps", "4", "--clip-norm", "0.5", "--seed", "3", "--eval-batches", "1"]
ACCUM = ["--accum", "2"]     # micro-batches, as --microbatches 2 in the pipeline's case
# A resume on another layout sums its gradients in another order: the docs give about 1e-6 relative
# in the loss per step, growing with training.  Over <= 4 AdamW steps of lr <= 0.01 a reassociation
# moves a param by well under 1e-5; a wrong resharding (a slice in the wrong place, a lost optimizer
# moment) moves a loss by 1e-3 or more and a param by the lr, 1e-2.
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
PARAM_TOL = dict(rtol=0.0, atol=1e-5)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def llama():
    return md.load_model(LLAMA, tiny=True, vocab=256)   # text is byte tokens: vocab 256


def vit():
    return md.load_model(VIT, tiny=True)


def fit(model, root: Path, name: str, **kw):
    return md.fit(model, out=str(root / name), **{**RECIPE, **kw})


def losses(result) -> list[float]:
    return [row["loss"] for row in result.rows]


def copy_step(ck: Path, step: int, dst: Path) -> Path:
    """A checkpoint folder holding only ``step`` of ``ck``: the run stopped there."""
    shutil.copytree(ck / f"step-{step:08d}", dst / f"step-{step:08d}")
    return dst


def assert_params_close(got: dict, want: dict, **tol):
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], **tol, msg=lambda m, k=k: f"param {k}: {m}")


# ----------------------------------------------------------------- from Python, the simulated mesh

@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """The Llama's uninterrupted 4-step run, data parallel on the simulated data:2, saved at 2 and 4."""
    root = tmp_path_factory.mktemp("llama")
    return root, fit(llama(), root, "whole", mesh="data:2", layout="batch:data", steps=4,
                     checkpoint=str(root / "ck"), save_every=2)


@pytest.fixture(scope="module")
def vit_run(tmp_path_factory):
    """The ViT's uninterrupted 4-step run, Megatron on the simulated model:2, saved at 2 and 4."""
    root = tmp_path_factory.mktemp("vit")
    return root, fit(vit(), root, "whole", mesh="model:2", layout="heads:model; d_ff:model", steps=4,
                     checkpoint=str(root / "ck"), save_every=2)


def test_llama_resumes_bitwise_on_its_mesh_and_continues_under_tensor_parallel(tmp_path, llama_run):
    root, whole = llama_run
    dense = fit(llama(), tmp_path, "dense", mesh="data:1", steps=4)
    # The oracle: data parallel gives the dense program's losses and params.
    torch.testing.assert_close(losses(whole), losses(dense), **LOSS_TOL)
    assert_params_close(whole.step.full_params(), dense.step.full_params(), **PARAM_TOL)

    same = fit(llama(), tmp_path, "same", mesh="data:2", layout="batch:data", resume=True,
               checkpoint=str(copy_step(root / "ck", 2, tmp_path / "at2")))
    assert [r["step"] for r in same.rows] == [3, 4]
    assert losses(same) == losses(whole)[2:]      # bit for bit, as the docs promise
    assert all(torch.equal(v, whole.step.full_params()[k]) for k, v in same.step.full_params().items())

    tp = fit(llama(), tmp_path, "tp", mesh="model:2", layout="kv_heads:model; d_ff:model", resume=True,
             checkpoint=str(copy_step(root / "ck", 2, tmp_path / "at2b")))
    torch.testing.assert_close(losses(tp), losses(whole)[2:], **LOSS_TOL)
    assert_params_close(tp.step.full_params(), whole.step.full_params(), **PARAM_TOL)


def test_vit_checkpoint_of_tensor_parallel_continues_under_fsdp(tmp_path, vit_run):
    # The uninterrupted run is the oracle here (the Llama's case compares one with the dense run).
    root, whole = vit_run
    fsdp = fit(vit(), tmp_path, "fsdp", mesh="data:2", layout="batch:data; params.d_model:data", resume=True,
               checkpoint=str(copy_step(root / "ck", 2, tmp_path / "at2")))
    assert [r["step"] for r in fsdp.rows] == [3, 4]
    torch.testing.assert_close(losses(fsdp), losses(whole)[2:], **LOSS_TOL)
    assert_params_close(fsdp.step.full_params(), whole.step.full_params(), **PARAM_TOL)


# ----------------------------------------------------------------- the CLI on one process

def run(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out + err


def curve(out_dir) -> list[tuple]:
    return [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in read_metrics(out_dir)]


@pytest.fixture(scope="module")
def llama_ck(tmp_path_factory):
    """A CLI run of the Llama, 4 steps saved at 2 and 4 (one process)."""
    root = tmp_path_factory.mktemp("llama_cli")
    rc = cli.main(["train", LLAMA, *CLI_RECIPE, *ACCUM, "--mesh", "data:1", "--steps", "4", "--save-every", "2",
                   "--checkpoint", str(root / "ck"), "--out", str(root / "whole")])
    assert rc == 0
    return root


def test_cli_resume_without_flags_repeats_the_run_bit_for_bit(capsys, llama_ck, tmp_path):
    rc, out = run(capsys, "train", LLAMA, "--tiny", "--samples", "0", "--mesh", "data:1", "--resume",
                  "--checkpoint", copy_step(llama_ck / "ck", 2, tmp_path / "at2"), "--out", tmp_path / "resumed")
    assert rc == 0, out
    assert "steps 4 (resuming from step-00000002)" in out and "resume:" not in out
    assert curve(tmp_path / "resumed") == curve(llama_ck / "whole")[2:]


def damaged(ck: Path, dst: Path, how: str) -> Path:
    """A copy of ``ck`` whose latest step (4) is damaged ``how``."""
    shutil.copytree(ck, dst)
    step = dst / "step-00000004"
    shard = step / "rank-00000.safetensors"
    if how == "truncated":
        os.truncate(shard, shard.stat().st_size - 64)
    elif how == "flipped":
        data = bytearray(shard.read_bytes())
        data[-5] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif how == "deleted":
        shard.unlink()
    elif how == "json":
        meta = json.loads((step / "checkpoint.json").read_text())
        meta["meta"]["run"]["lr"] = 0.5
        (step / "checkpoint.json").write_text(json.dumps(meta))
    return dst


@pytest.mark.parametrize("how, words", [
    ("truncated", ["truncated or replaced"]),
    ("flipped", ["sha256", "its bytes changed after the save"]),
    ("deleted", ["rank-00000.safetensors: missing"]),
    ("json", ["checkpoint.json was changed after the save"]),
])
def test_cli_a_damaged_latest_checkpoint_is_named_and_nothing_loads(capsys, llama_ck, tmp_path, how, words):
    ck = damaged(llama_ck / "ck", tmp_path / "ck", how)
    rc, out = run(capsys, "train", LLAMA, "--tiny", "--samples", "0", "--mesh", "data:1", "--resume",
                  "--checkpoint", ck, "--steps", "6", "--out", tmp_path / "o")
    assert rc == 2 and "Traceback" not in out
    assert "step-00000004' is damaged; nothing was loaded" in out and all(w in out for w in words), out
    assert "--resume-from 2" in out                 # the fix names the older intact one
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


def test_cli_resume_refusals_say_what_where_and_the_fix(capsys, llama_ck, tmp_path):
    ck = llama_ck / "ck"
    base = ["--tiny", "--samples", "0", "--mesh", "data:1", "--steps", "6", "--out", tmp_path / "o"]
    cases = [
        ([LLAMA, "--resume", "--checkpoint", tmp_path / "nowhere"], ["no committed checkpoint", "drop --resume"]),
        ([LLAMA, "--resume-from", "3", "--checkpoint", ck], ["no checkpoint", "steps in", "2, 4"]),
        ([VIT, "--resume", "--checkpoint", ck], ["is of another model", "'tiedllama'", "'clsvit'"]),
        ([LLAMA, "--resume", "--checkpoint", ck, "--optimizer", "sgd"], ["--optimizer sgd: saved adamw",
                                                                        "--reset-optimizer"]),
        ([LLAMA, "--resume", "--checkpoint", ck, "--config", "d_ff=16"], ["d_ff: saved 12, now 16",
                                                                         "--config d_ff=12"]),
    ]
    for args, words in cases:
        rc, out = run(capsys, "train", *args, *base)
        assert rc == 2 and "Traceback" not in out and "Fix:" in out, out
        assert all(w in out for w in words), out
        # Another model's Config is not compared field by field (no 'saved None' for its fields).
        assert "saved None" not in out, out
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


def test_fit_resume_refusals_are_meshdsl_errors(tmp_path, llama_ck):
    ck = str(llama_ck / "ck")
    with pytest.raises(md.MeshDSLError, match="no committed checkpoint"):
        md.fit(llama(), steps=6, checkpoint=str(tmp_path / "nowhere"), resume=True)
    with pytest.raises(md.MeshDSLError, match="another model"):
        md.fit(vit(), steps=6, checkpoint=ck, resume=True)
    with pytest.raises(md.MeshDSLError, match="reset_optimizer=True"):
        md.fit(llama(), steps=6, checkpoint=ck, resume=True, optimizer="sgd")
    with pytest.raises(md.MeshDSLError, match="damaged; nothing was loaded"):
        md.load_trained(str(damaged(llama_ck / "ck", tmp_path / "bad", "truncated")))


# ----------------------------------------------------------------- export and the torch twins

def llama_twin(w: dict, ids: torch.Tensor, cfg) -> torch.Tensor:
    """The tied Llama in plain torch, from full weights by param name: logits [batch, seq, vocab]."""
    s, e, h = ids.shape[1], cfg.d_head, cfg.d_head // 2
    angles = torch.arange(s, dtype=torch.float32)[:, None] * (cfg.theta ** (
        -torch.arange(0, e, 2, dtype=torch.float64) / e)).float()
    cos, sin = angles.cos(), angles.sin()     # [seq, half]

    def rope(t):                               # t [batch, seq, heads..., d_head]
        shape = (1, s) + (1,) * (t.dim() - 3) + (h,)
        c, sn = cos.view(shape), sin.view(shape)
        return torch.cat([t[..., :h] * c - t[..., h:] * sn, t[..., h:] * c + t[..., :h] * sn], -1)

    def rms(x, g):
        return F.rms_norm(x, (x.shape[-1],), g, eps=1e-6)   # md.rms_norm's default eps

    x = w["emb"][ids]
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    for i in range(cfg.layers):
        z = rms(x, w["norm1"][i])
        q = rope(torch.einsum("bsd,dnge->bsnge", z, w["wq"][i]))
        k = rope(torch.einsum("bsd,dne->bsne", z, w["wk"][i]))
        v = torch.einsum("bsd,dne->bsne", z, w["wv"][i])
        scores = torch.einsum("bsnge,btne->bngst", q, k) / math.sqrt(e)
        p = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + torch.einsum("bsnge,nged->bsd", torch.einsum("bngst,btne->bsnge", p, v), w["wo"][i])
        z = rms(x, w["norm2"][i])
        x = x + (F.silu(z @ w["w_gate"][i]) * (z @ w["w_up"][i])) @ w["w_down"][i]
    return rms(x, w["norm"]) @ w["emb"].T


def vit_twin(w: dict, images: torch.Tensor, cfg) -> torch.Tensor:
    """The class-token ViT in plain torch: logits [batch, classes]."""
    b, p, hp = images.shape[0], cfg.patch, cfg.size // cfg.patch
    grid = images.reshape(b, hp, p, hp, p, cfg.channels).permute(0, 1, 3, 2, 4, 5).reshape(b, hp * hp, p, p, -1)
    x = torch.einsum("bpijc,ijcd->bpd", grid, w["w_patch"])
    x = torch.cat([w["cls"].expand(b, 1, -1), x], 1) + w["pos"]
    for i in range(cfg.layers):
        z = F.layer_norm(x, (cfg.d_model,), w["ln1"][i], w["ln1_b"][i])
        q, k, v = (torch.einsum("btd,dme->bmte", z, w[n][i]) for n in ("wq", "wk", "wv"))
        y = F.scaled_dot_product_attention(q, k, v)                      # not causal
        x = x + torch.einsum("bmte,med->btd", y, w["wo"][i])
        z = F.layer_norm(x, (cfg.d_model,), w["ln2"][i], w["ln2_b"][i])
        x = x + F.gelu(z @ w["w1"][i] + w["b1"][i]) @ w["w2"][i]
    z = F.layer_norm(x, (cfg.d_model,), w["lnf"], w["lnf_b"])[:, 0]
    return F.gelu(z @ w["w_h1"]) @ w["w_h2"]


@pytest.mark.parametrize("which", ["llama", "vit"])
def test_export_gives_weights_a_torch_twin_turns_into_the_same_logits(capsys, tmp_path, request, which):
    model, twin = (llama(), llama_twin) if which == "llama" else (vit(), vit_twin)
    root, r = request.getfixturevalue(f"{which}_run")
    rc, out = run(capsys, "export", root / "whole", "--out", tmp_path / "w.safetensors")   # a run's --out
    assert rc == 0, out
    weights = load_file(str(tmp_path / "w.safetensors"))
    trained = r.step.full_params()
    assert set(weights) == set(trained) and all(torch.equal(weights[k], trained[k]) for k in trained)
    name = "ids" if which == "llama" else "images"
    feeds = {name: model.feeds(11)[name]}
    logits = model.logits if which == "llama" else model.outputs["logits"]
    got = md.run_dense({"logits": logits}, feeds, params=weights)["logits"]
    want = twin(weights, feeds[name], model.config)
    # fp32 both sides, other kernels and summation orders through ~30 ops on O(1) values: a few
    # ulps each; a misplaced weight, a wrong rotation or mask is off by O(0.1).
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------- the CLI on gloo processes (slow)

def cli_train(model, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshdsl", "train", model, *CLI_RECIPE, *map(str, args)],
                          cwd=ROOT, capture_output=True, text=True, timeout=400)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("model, tp", [(LLAMA, "kv_heads:model; d_ff:model"), (VIT, "heads:model; d_ff:model")],
                         ids=["llama", "vit"])
def test_cli_gloo_resume_bitwise_and_resharded(tmp_path, model, tp):
    # Twin of the default set's md.fit cases, on 2 gloo processes through the CLI.
    ck = tmp_path / "ck"
    whole = cli_train(model, *ACCUM, "--mesh", "data:2", "--layout", "batch:data", "--steps", "4", "--save-every", "2",
                      "--checkpoint", ck, "--out", tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr + whole.stdout
    same = cli_train(model, "--mesh", "data:2", "--layout", "batch:data", "--resume",
                     "--checkpoint", copy_step(ck, 2, tmp_path / "a"), "--out", tmp_path / "same")
    assert same.returncode == 0, same.stderr + same.stdout
    assert curve(tmp_path / "same") == curve(tmp_path / "whole")[2:]
    for name, mesh, layout in [("tp", "model:2", tp), ("fsdp", "data:2", "batch:data; params.d_model:data")]:
        resumed = cli_train(model, "--mesh", mesh, "--layout", layout, "--resume",
                            "--checkpoint", copy_step(ck, 2, tmp_path / f"at2-{name}"), "--out", tmp_path / name)
        assert resumed.returncode == 0, resumed.stderr + resumed.stdout
        got, want = curve(tmp_path / name), curve(tmp_path / "whole")[2:]
        assert [g[0] for g in got] == [3, 4]
        torch.testing.assert_close([g[1] for g in got], [w_[1] for w_ in want], **LOSS_TOL)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cli_gloo_pipeline_checkpoint_resumes_data_parallel(tmp_path):
    ck = tmp_path / "ck"
    pipe = cli_train(LLAMA, "--mesh", "stage:2", "--layout", "layer:stage", "--microbatches", "2",
                     "--schedule", "1f1b", "--steps", "4", "--save-every", "2", "--checkpoint", ck,
                     "--out", tmp_path / "pipe")
    assert pipe.returncode == 0, pipe.stderr + pipe.stdout
    dp = cli_train(LLAMA, "--mesh", "data:2", "--layout", "batch:data", "--microbatches", "1", "--resume",
                   "--checkpoint", copy_step(ck, 2, tmp_path / "a"), "--out", tmp_path / "dp")
    assert dp.returncode == 0, dp.stderr + dp.stdout
    got, want = curve(tmp_path / "dp"), curve(tmp_path / "pipe")[2:]
    torch.testing.assert_close([g[1] for g in got], [w_[1] for w_ in want], **LOSS_TOL)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cli_gloo_a_rank_killed_mid_save_keeps_the_last_good_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    args = ["--mesh", "model:2", "--layout", "kv_heads:model; d_ff:model", "--steps", "4",
            "--save-every", "2", "--checkpoint", ck]
    # Rank 1 SIGKILLs itself with half of its shard of step 4 written (train/checkpoint.py, KILL_POINTS).
    killed = subprocess.run([sys.executable, "-m", "meshdsl", "train", LLAMA, *CLI_RECIPE, *map(str, args),
                             "--out", str(tmp_path / "o")], cwd=ROOT, capture_output=True, text=True, timeout=400,
                            env={**os.environ, KILL_ENV: "mid-shard:1@4"})
    assert killed.returncode == 2 and "rank 1 of 2 was killed by signal SIGKILL" in killed.stderr, killed.stderr
    assert "Traceback" not in killed.stderr
    assert md.latest_checkpoint(ck) == ck / "step-00000002" and not (ck / "step-00000004").exists()
    whole = cli_train(LLAMA, *args[:-4], "--out", tmp_path / "whole")      # uninterrupted, nothing saved
    resumed = cli_train(LLAMA, *args, "--resume", "--out", tmp_path / "resumed")
    assert whole.returncode == 0 and resumed.returncode == 0, resumed.stderr
    assert curve(tmp_path / "resumed") == curve(tmp_path / "whole")[2:]
    assert md.latest_checkpoint(ck) == ck / "step-00000004"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fit_of_a_model_file_on_two_gloo_processes_gives_the_simulated_losses(tmp_path):
    spawned = md.fit(VIT, nproc=2, mesh="data:2", layout="batch:data", steps=4, tiny=True, timeout=120,
                     job_timeout=400, **RECIPE)
    simulated = fit(vit(), tmp_path, "sim", mesh="data:2", layout="batch:data", steps=4)
    torch.testing.assert_close(losses(spawned), losses(simulated), **LOSS_TOL)
