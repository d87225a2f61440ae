"""Round 7c: the training features a new user drives, on three held-out models written from the
README and docs/ alone.

``tests/heldout_gpt2.py`` (learned positions, the input embedding tied to the LM head, a gelu
MLP, dropout on the embeddings, the attention probabilities and both residual branches; it
reads ``ids``/``labels``, so it trains on text), ``tests/heldout_bertcls.py`` (a post-LN encoder
whose attention masks the padding from fed per-row lengths, a [CLS] tanh pooler, a
label-smoothed cross-entropy, an accuracy metric, every input made by rows with ``batches=``)
and ``tests/heldout_moedec.py`` (a decoder of top-1 mixture-of-experts blocks under ``md.repeat``,
each returning its Switch balance loss as a per-layer output summed into the loss).

Each trained with ``md.fit`` (and ``meshdsl train``) on the layouts the docs list, every curve
(train loss and eval loss, the eval's metrics) against the dense run's: data, tensor, FSDP and
ZeRO, sequence and expert parallelism, an uneven split (a vocab of 50 on 4 ranks), gradient
accumulation, remat none/selective/full, 1f1b/zbh1/gpipe/interleaved:2 pipelines with equal,
given and balanced stages, bf16 against the documented band, the top layout of ``meshdsl search``;
a run saved on one mesh and resumed on two others (a pipeline last), once with its first half on
2 real processes; a damaged checkpoint; the errors a user is likely to type.

What the round led to: ``meshdsl train --steps 10 --decay-steps 20`` (the README's "20-step
schedule, stopped at 10") warmed up over 1 step, not the 20-step schedule's 2, so the resumed
run did not give the uninterrupted run's losses; a resume onto a changed Config said "another
model" naming the same model twice; ``md.fit(stage_layers="auto")`` failed inside the run (now
refused at the front door with the ``md.balance_stages`` recipe), and the ``mesh="auto"`` recipe
dropped a pipelined candidate's micro-batches and schedule; ``train --stage-layers auto`` did not
say what it picked; a misspelt Config override from Python blamed the model file for a
TypeError (and on ``nproc`` processes, every rank did); ``md.fit(built_model, nproc=2)`` ran
simulated without a word.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import run_cli

HERE = Path(__file__).parent
GPT2, BERT, MOE = (str(HERE / f"heldout_{n}.py") for n in ("gpt2", "bertcls", "moedec"))
ADAMW = dict(optimizer="adamw", lr=0.01, samples=0)


def _gpt2():
    return md.load_model(GPT2, tiny=True, vocab=256)    # text is byte tokens: vocab 256


def _moe():
    return md.load_model(MOE, tiny=True, vocab=256)


def _bert():
    return md.load_model(BERT, tiny=True)


def _curves(result_or_rows) -> dict[str, torch.Tensor]:
    """A run's train losses, and each eval figure (loss, metrics) at the steps that have one."""
    rows = getattr(result_or_rows, "rows", result_or_rows)
    out = {"loss": torch.tensor([r["loss"] for r in rows], dtype=torch.float64)}
    for key in sorted({k for r in rows for k in r if k.startswith("eval_")}):
        out[key] = torch.tensor([r[key] for r in rows if key in r], dtype=torch.float64)
    return out


def _assert_same_curves(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys() and all(len(got[k]) == len(want[k]) for k in want), (what, got, want)
    for k in want:
        # Another layout adds fp32 partial sums in another order (~1e-7 relative per step), which
        # AdamW carries through the steps: the curves agree to ~1e-6 of the loss (measured at most
        # 4e-6 absolute on losses of ~5; the MoE's top-1 router flips no near tie at these seeds,
        # which would move it far more). A wrong shard, mask, micro-batch or optimizer state moves
        # the loss by 1e-3 or more. Accuracy is a count over rows: it matches exactly.
        torch.testing.assert_close(got[k], want[k], rtol=2e-6, atol=2e-6,
                                   msg=lambda m, k=k: f"{what}: {k}: {m}")


_DENSE: dict = {}


def _dense(name: str, build, **kw) -> dict:
    """The dense (one rank) run's curves, computed once per model and settings."""
    key = (name, tuple(sorted(kw.items())))
    if key not in _DENSE:
        _DENSE[key] = _curves(md.fit(build(), mesh="data:1", **kw))
    return _DENSE[key]


# ----------------------------------------------------------------------------- GPT-2 on text

GPT2_RUN = dict(steps=8, eval_every=4, **ADAMW)
GPT2_CASES = [
    ("data:2", "batch:data", {}),                                                    # DP
    ("model:2", "heads:model; d_ff:model", {}),                                      # Megatron
    ("model:4", "vocab:model", {}),                                                  # tied table split
    ("data:2", "batch:data; params.d_model:data", {}),                               # FSDP / ZeRO-3
    ("data:2", "batch:data; opt.d_model:data; grads.d_model:data", {}),              # ZeRO-2
    ("data:2", "batch:data", {"microbatches": 2}),                                   # --accum 2
    ("model:2", "seq:model", {}),                                                    # sequence parallel
    ("stage:2", "layer:stage", {"microbatches": 2, "schedule": "1f1b", "remat": "full"}),
]


@pytest.mark.parametrize("mesh,layout,kw", GPT2_CASES, ids=[f"{m}-{lay}-{kw}" for m, lay, kw in GPT2_CASES])
def test_gpt2_trains_with_the_dense_curves_on_every_layout(mesh, layout, kw, one_torch_thread):
    got = _curves(md.fit(_gpt2(), mesh=mesh, layout=layout, **GPT2_RUN, **kw))
    _assert_same_curves(got, _dense("gpt2", _gpt2, **GPT2_RUN), f"gpt2 {mesh} {layout} {kw}")


def test_remat_is_bitwise_the_run_without_it(one_torch_thread):
    """The API guide: under remat "the numbers are bitwise those of none"."""
    want = _dense("gpt2", _gpt2, **GPT2_RUN)
    for remat in ("none", "selective", "full"):
        got = _curves(md.fit(_gpt2(), remat=remat, **GPT2_RUN))
        for k in want:
            assert torch.equal(got[k], want[k]), (remat, k, got[k], want[k])


def test_bf16_follows_the_fp32_curve_within_the_documented_band(one_torch_thread):
    """optimizers.md: a bf16 run's loss stays within 2% of the fp32 loss on average."""
    run = dict(GPT2_RUN, steps=12)
    want = _dense("gpt2", _gpt2, **run)["loss"]
    got = _curves(md.fit(_gpt2(), mesh="data:2; model:2", layout="batch:data; heads:model; d_ff:model",
                         precision="bf16", **run))["loss"]
    rel = ((got - want).abs() / want).mean()
    assert 0 < rel < 0.02, (rel, got, want)     # > 0: bf16 was really on


def test_an_uneven_vocab_of_50_on_4_ranks_trains_on_the_users_own_batches(one_torch_thread):
    """A vocab of 50 on model:4 is cut 13, 13, 12, 12 (as torch.tensor_split); the tied table is
    read by the gather and the head. Own data: text needs a vocab of 256."""
    model = md.load_model(GPT2, tiny=True)
    assert model.config.vocab == 50

    def run(mesh, layout):
        return _curves(md.fit(md.load_model(GPT2, tiny=True), mesh=mesh, layout=layout, data=model.feeds,
                              eval_data=[model.feeds(-1)], **GPT2_RUN))
    _assert_same_curves(run("data:2; model:4", "batch:data; vocab:model"), run("data:1", ""), "vocab 50 on 4")
    with pytest.raises(md.LayoutError, match="strict splits refuse an uneven split"):
        md.compile(model.train_step(), "model:4", "vocab:model", strict_splits=True)


def test_text_with_a_small_vocab_names_both_fixes(one_torch_thread):
    with pytest.raises(md.MeshDSLError, match="the model's vocab is 50, smaller than the 256 byte tokens") as e:
        md.fit(md.load_model(GPT2, tiny=True), steps=1, **ADAMW)
    assert "--config vocab=256" in str(e.value) and "md.load_model(..., vocab=256)" in str(e.value)


def test_python_mistakes_are_refused_before_anything_runs(no_spawn):
    """A misspelt Config override is the caller's mistake, named with the closest field (it was
    the model file blamed for a TypeError); ``nproc`` with a built Model (which trains in this
    process) asks for the file's path instead (it was silently simulated)."""
    for call in (lambda: md.load_model(BERT, tiny=True, d_modl=16),
                 lambda: md.fit(BERT, tiny=True, config={"d_modl": 16}, steps=1, nproc=2)):
        with pytest.raises(md.ModelError, match=r"has no field 'd_modl'\. Did you mean 'd_model'\?") as e:
            call()
        assert "fields: batch, seq, vocab, d_model" in str(e.value) and "raised TypeError" not in str(e.value)
    with pytest.raises(md.MeshDSLError, match=r"nproc=2 with a built md.Model, which trains in this process"):
        md.fit(_bert(), mesh="data:2", layout="batch:data", steps=1, nproc=2)


# ----------------------------------------------------------------------------- MoE decoder, pipelines

MOE_RUN = dict(steps=6, eval_every=3, **ADAMW)
PIPE = {"microbatches": 2}
MOE_CASES = [
    ("data:2", "batch:data; experts:data", {}),                                      # expert parallel
    ("stage:2", "layer:stage", {**PIPE, "schedule": "interleaved:2"}),
    ("stage:2", "layer:stage", {**PIPE, "schedule": "zbh1", "stage_layers": (3, 1)}),
    ("stage:2; data:2", "layer:stage; batch:data; experts:data", {**PIPE, "schedule": "1f1b", "remat": "selective"}),
]


@pytest.mark.parametrize("mesh,layout,kw", MOE_CASES, ids=[f"{m}-{lay}-{kw}" for m, lay, kw in MOE_CASES])
def test_moe_per_layer_balance_loss_trains_with_the_dense_curves(mesh, layout, kw, one_torch_thread):
    got = _curves(md.fit(_moe(), mesh=mesh, layout=layout, **MOE_RUN, **kw))
    _assert_same_curves(got, _dense("moe", _moe, **MOE_RUN), f"moe {mesh} {layout} {kw}")


def test_balanced_stages_from_python_and_the_front_door_for_auto(one_torch_thread):
    """``--stage-layers auto`` is the CLI's; md.fit refuses "auto" before the run, naming the
    Python recipe, and that recipe trains with the dense curves."""
    with pytest.raises(md.MeshDSLError, match=r"stage_layers='auto' is the command line's balancing") as e:
        md.fit(_moe(), mesh="stage:2", layout="layer:stage", stage_layers="auto", **PIPE, **MOE_RUN)
    assert "md.balance_stages(model.train_step(), mesh, layout, microbatches=M, schedule=S)" in str(e.value)
    model = _moe()
    counts = md.balance_stages(model.train_step(), "stage:2", "layer:stage", microbatches=2, schedule="1f1b")
    assert sum(counts) == 4 and len(counts) == 2, counts
    got = _curves(md.fit(model, mesh="stage:2", layout="layer:stage", schedule="1f1b", stage_layers=counts,
                         **PIPE, **MOE_RUN))
    _assert_same_curves(got, _dense("moe", _moe, **MOE_RUN), f"moe stage_layers={counts}")


@pytest.mark.slow  # 9 s: the search's top layouts are checked against dense in every held-out round; this trains one
def test_the_searchs_top_layout_trains_with_the_dense_curves(monkeypatch, tmp_path, capsys, one_torch_thread):
    """``meshdsl search`` on the model file, then its best candidate (a pipeline here, under the
    default cost figures) trained as the fit recipe says: mesh, layout, micro-batches and schedule."""
    monkeypatch.setenv("MESHDSL_CACHE_DIR", str(tmp_path / "no-calibration"))
    rc, out, err = run_cli(capsys, ["search", MOE, "--tiny", "--config", "vocab=256", "--nproc", "4", "--top", "3"])
    assert rc == 0, err
    best = next(line for line in out.splitlines() if line.startswith("best: "))
    flags = shlex.split(best.removeprefix("best: "))
    top = dict(zip((f.removeprefix("--") for f in flags[::2]), flags[1::2]))
    assert top.keys() == {"mesh", "layout", "microbatches", "schedule"}, best   # a pipeline, with its schedule
    with pytest.raises(md.MeshDSLError, match="microbatches=c.microbatches, schedule=c.schedule"):
        md.fit(_moe(), mesh="auto", steps=1)
    got = _curves(md.fit(_moe(), mesh=top["mesh"], layout=top["layout"], microbatches=int(top["microbatches"]),
                         schedule=top["schedule"], **MOE_RUN))
    _assert_same_curves(got, _dense("moe", _moe, **MOE_RUN), f"search's top {best}")


# ----------------------------------------------------------------------------- BERT classifier, own batches

BERT_RUN = dict(steps=6, eval_every=3, **ADAMW)
BERT_CASES = [
    ("data:2", "batch:data", {}),
    ("data:2; model:2", "batch:data; heads:model; d_ff:model", {"microbatches": 2}),
    ("stage:2", "layer:stage", {**PIPE, "schedule": "gpipe"}),
    ("data:4", "batch:data; params.d_model:data", {}),
    ("model:2", "key_seq:model", {}),                     # the padding mask's keys split
]


@pytest.mark.parametrize("mesh,layout,kw", BERT_CASES, ids=[f"{m}-{lay}-{kw}" for m, lay, kw in BERT_CASES])
def test_bert_classifier_trains_with_the_dense_curves_and_accuracy(mesh, layout, kw, one_torch_thread):
    got = _curves(md.fit(_bert(), mesh=mesh, layout=layout, **BERT_RUN, **kw))
    want = _dense("bert", _bert, **BERT_RUN)
    assert "eval_accuracy" in want and len(want["eval_loss"]) == 2, want    # steps 3 and 6
    _assert_same_curves(got, want, f"bert {mesh} {layout} {kw}")


# ----------------------------------------------------------------------------- checkpoints and resume

@pytest.mark.slow  # 7 s: resuming on another layout is in tests/test_checkpoint.py and this file's bert and moe cases
def test_gpt2_saved_on_dp_resumed_on_megatron_then_a_pipeline(tmp_path, one_torch_thread):
    """AdamW with warmup and cosine, dropout on: steps 1-4 on data:2, saved; 5-6 on model:2;
    7-8 on a 1f1b pipeline of 2 micro-batches: the uninterrupted run's losses, eval losses and
    final params (the optimizer state travels: a fresh AdamW would take another step)."""
    run = dict(warmup_steps=2, decay_steps=8, eval_every=2, **ADAMW)
    ck = str(tmp_path / "ck")
    whole = md.fit(_gpt2(), steps=8, **run)
    first = md.fit(_gpt2(), mesh="data:2", layout="batch:data", steps=4, checkpoint=ck, save_every=4, **run)
    second = md.fit(_gpt2(), mesh="model:2", layout="heads:model; d_ff:model", steps=6, checkpoint=ck,
                    resume=True, save_every=2)
    third = md.fit(_gpt2(), mesh="stage:2", layout="layer:stage", microbatches=2, schedule="1f1b", steps=8,
                   checkpoint=ck, resume=True, verify="sha256")
    assert (second.start_step, third.start_step) == (4, 6)
    _assert_same_curves(_curves(first.rows + second.rows + third.rows), _curves(whole), "resumed 4 -> 6 -> 8")
    want, got = whole.step.full_params(), third.step.full_params()
    for k in want:
        # as the losses: fp32 reassociation over 8 AdamW steps, ~1e-6 of a param's magnitude
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_moe_saved_on_an_interleaved_pipeline_resumes_on_unequal_stages_with_tensor_parallelism(
        tmp_path, one_torch_thread):
    """pipelines.md: each stage stores its layers, checkpoints stay in the global layer order and
    load on any mesh: saved from interleaved:2 (rank 0 holds layers 0 and 2), resumed on stages
    of 1 and 3 layers with the experts' MLP split over ``model``."""
    run = dict(MOE_RUN, decay_steps=6, warmup_steps=1)
    whole = md.fit(_moe(), **run)
    md.fit(_moe(), mesh="stage:2", layout="layer:stage", microbatches=2, schedule="interleaved:2",
           **dict(run, steps=3), checkpoint=str(tmp_path / "ck"), save_every=3)
    rest = md.fit(_moe(), mesh="stage:2; model:2", layout="layer:stage; heads:model; expert_ff:model",
                  microbatches=2, schedule="1f1b", stage_layers=(1, 3), steps=6, checkpoint=str(tmp_path / "ck"),
                  resume=True)
    assert rest.start_step == 3
    _assert_same_curves(_curves(rest.rows), _curves(whole.rows[3:]), "interleaved:2 -> stages 1,3 x model:2")


def test_a_damaged_checkpoint_is_refused_before_any_rank_starts(tmp_path, capsys, no_spawn):
    ck = tmp_path / "ck"
    md.fit(_bert(), steps=2, checkpoint=str(ck), save_every=1, **ADAMW)
    shard = next((ck / "step-00000002").glob("rank-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF                                     # one byte of a tensor, same size
    shard.write_bytes(bytes(data))
    rc, out, err = run_cli(capsys, ["train", BERT, "--tiny", "--steps", "4", "--mesh", "data:2", "--layout",
                                    "batch:data", "--checkpoint", str(ck), "--resume", "--samples", "0",
                                    "--out", str(tmp_path / "o")])
    assert rc == 2 and "Traceback" not in err, err
    assert shard.name in err and "sha256" in err, err
    # training.md: the message lists the older intact ones and the flag that resumes from one
    assert "older checkpoints intact" in err and "step 1 (" in err and "--resume-from 1" in err, err


def test_keep_and_resume_from_an_older_checkpoint_into_another_folder(tmp_path, one_torch_thread):
    """``keep=2`` leaves the last two steps; ``resume_from`` an older one's path (``verify="size"``)
    into a new folder, on another mesh, continues the uninterrupted run."""
    whole = md.fit(_bert(), steps=6, **ADAMW)
    ck = tmp_path / "ck"
    md.fit(_bert(), steps=6, checkpoint=str(ck), save_every=1, keep=2, **ADAMW)
    assert sorted(p.name for p in ck.glob("step-*")) == ["step-00000005", "step-00000006"]
    with pytest.raises(md.MeshDSLError, match="the run would save step 6 into .*, where it exists"):
        md.fit(_bert(), steps=6, checkpoint=str(ck), resume_from=5)
    rest = md.fit(_bert(), mesh="data:2; model:2", layout="batch:data; heads:model", steps=6,
                  checkpoint=str(tmp_path / "new"), resume_from=str(ck / "step-00000005"), verify="size")
    assert rest.start_step == 5
    _assert_same_curves(_curves(rest.rows), _curves(whole.rows[5:]), "resume_from step 5")


OPTIMIZERS = {"adamw": lambda: md.AdamW(lr=3e-3, weight_decay=0.1), "adafactor": lambda: md.Adafactor(lr=3e-3),
              "sgd-momentum": lambda: md.SGD(lr=3e-3, momentum=0.9)}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_train_step_with_each_optimizer_on_zero2_is_the_dense_step(name, one_torch_thread):
    """optimizers.md's loop: ``md.TrainStep`` with clipping and ``md.cosine_schedule``, gradients
    and optimizer state sharded over ``data`` (ZeRO-2): the dense losses and global norms."""
    def curve(mesh, layout):
        model = _bert()
        step = md.TrainStep(model.loss, model.params, mesh, layout, md.SimulatedComm(md.Mesh.parse(mesh)),
                            optimizer=OPTIMIZERS[name](), clip_norm=1.0)
        sched = md.cosine_schedule(3e-3, warmup_steps=2, total_steps=6)
        rows = []
        for i in range(6):
            loss, _ = step(model.feeds(i), lr=sched(i))
            rows.append((float(loss), float(step.grad_norm)))
        return torch.tensor(rows, dtype=torch.float64)
    # as the fit curves: fp32 reassociation over 6 steps (measured at most 5e-7)
    torch.testing.assert_close(curve("data:2", "batch:data; grads.d_model:data; opt.d_model:data"),
                               curve("data:1", ""), rtol=2e-6, atol=2e-6)


@pytest.mark.timeout(240)
def test_bert_saved_on_2_processes_resumes_in_process_on_a_pipeline(tmp_path, capsys):
    """Real processes: steps 1-3 of ``meshdsl train --mesh data:2`` on 2 gloo ranks, saved; steps
    4-6 resumed with md.fit on a 2-stage pipeline with tensor parallelism, simulated here: the
    dense run's losses, eval losses and accuracy."""
    ck = tmp_path / "ck"
    rc, out, err = run_cli(capsys, ["train", BERT, "--tiny", "--steps", "3", "--decay-steps", "6", "--optimizer",
                                    "adamw", "--lr", "0.01", "--eval-every", "3", "--mesh", "data:2", "--layout",
                                    "batch:data", "--checkpoint", str(ck), "--save-every", "3", "--samples", "0",
                                    "--out", str(tmp_path / "a")])
    assert rc == 0 and "on 2 process(es)" in out, (out, err)
    first = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    rest = md.fit(_bert(), mesh="stage:2; model:2", layout="layer:stage; heads:model", microbatches=2,
                  schedule="1f1b", steps=6, checkpoint=str(ck), resume=True, out=str(tmp_path / "b"))
    assert rest.start_step == 3
    want = _dense("bert", _bert, **dict(BERT_RUN, clip_norm=1.0, decay_steps=6, lr_schedule="cosine"))
    _assert_same_curves(_curves(first + rest.rows), want, "2 processes -> pipeline")


@pytest.mark.timeout(240)
def test_moe_on_a_2_process_pipeline_with_balanced_stages_from_the_command_line(tmp_path, capsys):
    """Real processes: ``meshdsl train --stage-layers auto`` on a zbh1 pipeline of 2 gloo ranks
    (the cost model gives the last stage, which also runs the head, fewer of the 4 layers): the
    dense run's losses and eval losses, under the CLI's AdamW recipe."""
    rc, out, err = run_cli(capsys, ["train", MOE, "--tiny", "--mesh", "stage:2", "--layout", "layer:stage",
                                    "--microbatches", "2", "--schedule", "zbh1", "--stage-layers", "auto",
                                    "--steps", "6", "--eval-every", "3", "--optimizer", "adamw", "--lr", "0.01",
                                    "--samples", "0", "--out", str(tmp_path / "o")])
    assert rc == 0 and "on 2 process(es)" in out, (out, err)
    config = json.loads((tmp_path / "o" / "config.json").read_text())
    assert sum(config["stage_layers"]) == 4 and len(config["stage_layers"]) == 2, config["stage_layers"]
    picked = ",".join(map(str, config["stage_layers"]))
    assert f"layers per stage: {picked} (--stage-layers auto: the cost model's balance)" in out, out
    assert "final train loss (mean of the last 6 steps)" in out, out     # it said 10 of a 6-step run
    rows = [json.loads(line) for line in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    want = _dense("moe", _moe, **dict(MOE_RUN, clip_norm=1.0, lr_schedule="cosine"))
    _assert_same_curves(_curves(rows), want, f"2 processes, stages {config['stage_layers']}")


# ----------------------------------------------------------------------------- the command line

def _train(capsys, *flags):
    return run_cli(capsys, ["train", GPT2, "--tiny", "--samples", "0", *flags])


def _losses(out_dir: Path) -> torch.Tensor:
    return torch.tensor([json.loads(line)["loss"] for line in (out_dir / "metrics.jsonl").read_text().splitlines()])


def test_a_schedule_stopped_early_warms_up_and_resumes_as_the_whole_run(tmp_path, capsys, one_torch_thread):
    """The README's "20-step schedule, stopped at 10" (here 8, stopped at 4): the default AdamW
    warmup is a tenth of the schedule, so both halves run the whole run's learning rates."""
    rc, out, err = _train(capsys, "--steps", "40", "--out", str(tmp_path / "whole"))
    assert rc == 0 and "(warmup 4, cosine to 0.001 at step 40, clip 1)" in out, (out, err)
    rc, out, err = _train(capsys, "--steps", "20", "--decay-steps", "40", "--checkpoint", str(tmp_path / "ck"),
                          "--save-every", "20", "--out", str(tmp_path / "a"))
    assert rc == 0 and "(warmup 4, cosine to 0.001 at step 40, clip 1)" in out, (out, err)
    rc, out, err = _train(capsys, "--steps", "40", "--checkpoint", str(tmp_path / "ck"), "--resume",
                          "--out", str(tmp_path / "b"))
    assert rc == 0, err
    got = torch.cat([_losses(tmp_path / "a"), _losses(tmp_path / "b")])
    # the same process, mesh and layout: the same kernels in the same order, bit for bit
    assert torch.equal(got, _losses(tmp_path / "whole")), (got, _losses(tmp_path / "whole"))


USER_ERRORS = [
    # (flags, what the message must say)
    (["--mesh", "data:2; model:2", "--layout", "batch:data; haeds:model"],
     ["names dim 'haeds'", "Did you mean 'heads'?", "                ^^^^^", "Rule:", "Fix:"]),
    (["--mesh", "data:2", "--layout", "batch:dta"],
     ["unknown mesh axis 'dta'. Did you mean 'data'?", "          ^^^", "Rule:", "Fix:"]),
    (["--mesh", "data:2", "--layout", "batch:data", "--nproc", "4"],
     ["mesh 'data:2' has 2 devices but the job has 4 processes", "Rule:", "Fix: launch 2 processes (--nproc 2)"]),
    (["--config", "d_modle=16"],
     ["Config has no field 'd_modle'. Did you mean 'd_model'?", "^^^^^^^^^^", "Rule:", "Fix:"]),
]


@pytest.mark.parametrize("flags,says", USER_ERRORS, ids=[" ".join(f) for f, _ in USER_ERRORS])
def test_what_a_user_mistypes_is_one_message_and_exit_2(flags, says, capsys, no_spawn):
    rc, out, err = _train(capsys, "--steps", "2", *flags)
    assert rc == 2 and "Traceback" not in out + err, (out, err)
    for s in says:
        assert s in err, (s, err)


def test_resume_on_another_text_is_refused_before_any_rank_starts(tmp_path, capsys, no_spawn):
    """training.md: everything is checked before any process starts. A resume on 2 processes with
    another --data was each rank's error after spawning; now one message, before."""
    for name, letters in (("a.txt", "abcdefgh \n"), ("b.txt", "ijklmnop \n")):
        gen = torch.Generator().manual_seed(0)
        (tmp_path / name).write_text("".join(letters[i] for i in torch.randint(len(letters), (4000,), generator=gen)))
    ck = str(tmp_path / "ck")
    rc, out, err = _train(capsys, "--steps", "2", "--data", str(tmp_path / "a.txt"), "--checkpoint", ck,
                          "--out", str(tmp_path / "o"))
    assert rc == 0, err
    rc, out, err = _train(capsys, "--steps", "4", "--data", str(tmp_path / "b.txt"), "--checkpoint", ck, "--resume",
                          "--mesh", "data:2", "--layout", "batch:data", "--out", str(tmp_path / "o2"))
    assert rc == 2 and "Traceback" not in err and "ranks 0, 1" not in err, err
    assert "resume: the training data differs from the checkpoint's" in err and "* sha256: saved" in err, err


def test_nproc_without_a_mesh_goes_data_parallel_over_the_processes(capsys, monkeypatch):
    """``meshdsl train my_model.py --nproc 3`` (no --mesh): data:3, as under torchrun. It picked
    data:1 for a small model, then refused that mesh against --nproc 3, naming a mesh the user
    never typed."""
    from meshdsl.tools import train_cli
    started = []
    monkeypatch.setattr(train_cli, "launch_job", lambda args, fn, fn_args: started.append(fn_args[0]) or [None])
    rc, out, err = _train(capsys, "--steps", "2", "--nproc", "3")
    assert rc == 0, err
    assert "mesh 'data:3', layout 'batch:data' on 3 process(es)" in out, out
    assert [(s.mesh, s.layout) for s in started] == [("data:3", "batch:data")]


def test_resume_onto_a_changed_config_says_which_fields_and_their_saved_values(tmp_path, capsys, one_torch_thread):
    ck = str(tmp_path / "ck")
    assert _train(capsys, "--steps", "2", "--checkpoint", ck, "--out", str(tmp_path / "a"))[0] == 0
    rc, out, err = _train(capsys, "--steps", "4", "--checkpoint", ck, "--resume", "--config", "d_model=16,layers=3")
    assert rc == 2 and "Traceback" not in err, err
    assert "is of this model with another Config" in err, err
    assert "d_model: saved 8, now 16" in err and "layers: saved 2, now 3" in err, err
    assert "(--config d_model=8,layers=2)" in err, err
