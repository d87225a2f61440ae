"""Starting a run from given weights (meshdsl/train/init_weights.py, ``TrainStep.set_params``,
``md.fit(init=)``, ``meshdsl train --init``, ``meshdsl export``).

The oracle is the dense program started from the same weights: a step on any mesh and layout,
given full tensors by param name, trains to the dense SGD's losses.  The model is the held-out
LoRA decoder (tests/heldout_lora.py): its base weights are frozen params (graph params left out
of ``Model.params``), which before this could only start from meshdsl's own init.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import meshdsl as md
from conftest import run_cli
from meshdsl.train.init_weights import WeightsError, export_params
from meshdsl.train.step import training_outputs

LORA = str(Path(__file__).parent / "heldout_lora.py")
LR = 0.05


def _lora():
    return md.load_model(LORA, tiny=True)


def _weights(model, seed: int = 7) -> dict[str, torch.Tensor]:
    """Every param (trainable and frozen) as a random full tensor: nothing like meshdsl's init."""
    gen = torch.Generator().manual_seed(seed)
    params = md.TrainStep(model.loss, model.params, "data:1", "", md.SimulatedComm(md.Mesh.parse("data:1")),
                          lr=LR).graph_params
    return {k: torch.randn(t.shape.sizes, generator=gen) * 0.3 for k, t in params.items()}


def _dense_losses(model, weights, steps: int) -> list[float]:
    """The dense program's SGD from ``weights``: the frozen ones fed as they are every step."""
    outs = training_outputs(model.loss, model.params, LR)
    params, losses = dict(weights), []
    for t in range(steps):
        got = md.run_dense(outs, model.feeds(t), params)
        losses.append(float(got["loss"]))
        params.update({k: got[f"new/{k}"] for k in model.params})
    return losses


CASES = [
    ("data:2", "batch:data", {}),
    ("model:2", "heads:model; d_ff:model", {}),                                 # Megatron
    ("stage:2", "layer:stage", {"microbatches": 2, "schedule": "1f1b"}),        # each stage its layers only
]


@pytest.mark.parametrize("mesh, layout, kw", CASES, ids=[c[0] for c in CASES])
def test_given_weights_train_as_the_dense_program_from_them(mesh, layout, kw):
    model = _lora()
    weights = _weights(model)
    step = md.TrainStep(model.loss, model.params, mesh, layout, md.SimulatedComm(md.Mesh.parse(mesh)), lr=LR, **kw)
    assert sorted(step.set_params(weights)) == sorted(weights)
    if mesh.startswith("stage"):     # the last stage: its layers' slices, None for the embedding it never reads
        assert step.params["wte"][-1] is None and step.params["lm_head"][0] is None
        assert torch.equal(step.params["wq"][-1], weights["wq"][2:])
    got = [step(model.feeds(t))[0] for t in range(3)]
    want = _dense_losses(model, weights, 3)
    # split contractions and micro-batches add the same fp32 terms in another order: ~1e-7 relative
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    assert abs(want[0] - _dense_losses(model, {}, 1)[0]) > 0.1     # the given weights are what ran
    frozen = step.full_params(frozen=True)
    for k in step.frozen:     # never updated, on every rank that holds them
        assert torch.equal(frozen[k], weights[k]), k


def test_lora_base_from_a_file_is_the_merged_weights_dense_model(tmp_path):
    """LoRA's frozen base loaded from a safetensors file, adapters from meshdsl's init: the loss
    on a Megatron x data mesh is the dense loss of the base with wq, wv merged (w + A B alpha/rank)
    and zero adapters."""
    model, cfg = _lora(), _lora().config
    base = {k: v for k, v in _weights(model).items() if k not in model.params}
    save_file(base, tmp_path / "base.safetensors")
    step = md.TrainStep(model.loss, model.params, "data:2; model:2", "batch:data; heads:model; d_ff:model",
                        md.SimulatedComm(md.Mesh.parse("data:2; model:2")), lr=LR)
    assert sorted(step.set_params(tmp_path / "base.safetensors")) == sorted(step.frozen)
    adapters = md.run_dense(dict(model.params))      # their seeded init, as the step has them
    merged = dict(base)
    for w, a, b in (("wq", "q_a", "q_b"), ("wv", "v_a", "v_b")):
        merged[w] = base[w] + torch.einsum("ldr,lrhe->ldhe", adapters[a], adapters[b]) * (cfg.alpha / cfg.rank)
    zero = {k: torch.zeros_like(v) if k.endswith("_b") else v for k, v in adapters.items()}
    want = float(md.run_dense({"l": model.loss}, model.feeds(0), {**merged, **zero})["l"])
    loss, _ = step(model.feeds(0))
    # x (A B) against (x A) B, and split sums: fp32 rounding, ~1e-7 relative
    torch.testing.assert_close(torch.tensor(loss), torch.tensor(want), rtol=1e-5, atol=0)
    assert abs(want - float(md.run_dense({"l": model.loss}, model.feeds(0))["l"])) > 0.1


def test_each_bad_item_is_named_in_one_message():
    model = _lora()
    step = md.TrainStep(model.loss, model.params, "data:1", "", md.SimulatedComm(md.Mesh.parse("data:1")), lr=LR)
    bad = {"w_gat": torch.zeros(4, 16, 20), "wq": torch.zeros(16, 4, 4), "wte": torch.zeros(24, 16, dtype=torch.int64),
           "opt/q_a/exp_avg": torch.zeros(4, 16, 2)}
    with pytest.raises(WeightsError) as e:
        step.set_params(bad)
    text = str(e.value)
    assert "4 of 4 given tensor(s)" in text
    assert "'w_gat': no param of the model has this name. Did you mean 'w_gate'?" in text
    assert "'wq': shape (16, 4, 4), the param is [layer:4, d_model:16, heads:4, d_head:4]" in text
    assert "'wte': dtype torch.int64, the param is torch.float32" in text
    assert "(optimizer state: a new run starts it at zero)" in text
    assert "a param not given keeps meshdsl's seeded init" in text
    before = step.full_params(frozen=True)      # a refused call changes nothing
    assert all(torch.equal(before[k], v) for k, v in step.full_params(frozen=True).items())
    # a float of another precision is cast (as torch's load_state_dict copies), never updated in place
    w = torch.randn(24, 16, dtype=torch.float64)
    step.set_params({"wte": w})
    assert step.full_params(frozen=True)["wte"].dtype == torch.float32
    assert torch.equal(step.full_params(frozen=True)["wte"], w.float())


def test_a_file_is_read_as_safetensors_only(tmp_path):
    model = _lora()
    step = md.TrainStep(model.loss, model.params, "data:1", "", md.SimulatedComm(md.Mesh.parse("data:1")), lr=LR)
    torch.save({"wte": torch.zeros(24, 16)}, tmp_path / "w.pt")
    with pytest.raises(WeightsError, match="is not a safetensors file") as e:
        step.set_params(tmp_path / "w.pt")
    assert "a torch.save (pickle) file is never read" in str(e.value)
    with pytest.raises(WeightsError, match="no such file"):
        step.set_params(tmp_path / "missing.safetensors")
    with pytest.raises(WeightsError, match="not a path or a dict"):
        step.set_params([torch.zeros(1)])


def test_fit_starts_from_init_and_a_resume_reads_the_checkpoint_frozen_params_too(tmp_path, capsys):
    """fit(init=) on a new run equals set_params; its checkpoint holds the frozen params, so a
    resume on another layout (init= given again, and not read) continues the uninterrupted run."""
    weights = _weights(_lora())
    kw = dict(steps=3, lr=LR, samples=0, eval_every=0)
    m1 = _lora()
    whole = md.fit(m1, mesh="stage:2", layout="layer:stage", microbatches=2, data=lambda t: m1.feeds(t - 1),
                   init=weights, **kw)
    torch.testing.assert_close(torch.tensor([r["loss"] for r in whole.rows]),
                               torch.tensor(_dense_losses(m1, weights, 3)), rtol=1e-5, atol=0)  # as above
    m2 = _lora()
    md.fit(m2, mesh="data:2", layout="batch:data", data=lambda t: m2.feeds(t - 1), init=weights,
           checkpoint=str(tmp_path / "ck"), **{**kw, "steps": 2})
    capsys.readouterr()
    m3 = _lora()
    rest = md.fit(m3, mesh="model:2", layout="heads:model; d_ff:model", data=lambda t: m3.feeds(t - 1),
                  init={"wq": torch.zeros(4, 16, 4, 4)}, checkpoint=str(tmp_path / "ck"), resume=True, **kw)
    assert "resume: the weights of init= are not read: checkpoint step 2 holds every param" in capsys.readouterr().out
    # the same fp32 terms, summed on other ranks: ~1e-7 relative
    torch.testing.assert_close(torch.tensor(rest.rows[0]["loss"]), torch.tensor(whole.rows[2]["loss"]),
                               rtol=1e-5, atol=0)
    # meshdsl export writes every param of the checkpoint, the frozen ones as given
    shapes = export_params(tmp_path / "ck", tmp_path / "w.safetensors")
    saved = load_file(tmp_path / "w.safetensors")
    assert set(shapes) == set(saved) == set(weights)
    assert all(torch.equal(saved[k], weights[k]) for k in rest.step.frozen)


def test_train_init_flag_and_export(tmp_path, capsys):
    """meshdsl train --checkpoint, meshdsl export, meshdsl train --init: the second run starts from
    the first one's weights (its first loss is not a fresh run's); a bad file is exit 2."""
    base = ["train", "--tiny", "--steps", "2", "--samples", "0", "--eval-batches", "1"]
    rc, _, err = run_cli(capsys, base + ["--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "a")])
    assert rc == 0, err
    rc, out, err = run_cli(capsys, ["export", str(tmp_path / "ck"), "--out", str(tmp_path / "w.safetensors")])
    assert rc == 0 and "meshdsl export: 15 params" in out, err
    # the run's --out folder names its checkpoint, as for eval and generate: the same file
    rc, out, err = run_cli(capsys, ["export", str(tmp_path / "a"), "--out", str(tmp_path / "w2.safetensors")])
    assert rc == 0 and "meshdsl export: 15 params" in out, err
    assert load_file(tmp_path / "w2.safetensors").keys() == load_file(tmp_path / "w.safetensors").keys()
    rc, out, err = run_cli(capsys, base + ["--init", str(tmp_path / "w.safetensors"), "--out", str(tmp_path / "b")])
    assert rc == 0, err
    assert f"init: {tmp_path / 'w.safetensors'} (15 of 15 params)" in out
    first = [json.loads((tmp_path / d / "metrics.jsonl").read_text().splitlines()[0])["loss"] for d in ("a", "b")]
    assert first[0] - first[1] > 0.05, first    # the same batch, trained weights: a lower loss
    save_file({"wte": torch.zeros(3, 3)}, tmp_path / "bad.safetensors")
    rc, _, err = run_cli(capsys, base + ["--init", str(tmp_path / "bad.safetensors"), "--out", str(tmp_path / "c")])
    assert rc == 2 and "'wte': shape (3, 3), the param is [vocab:256, d_model:8]" in err and "Traceback" not in err


def test_a_directory_given_as_weights_points_at_meshdsl_export(tmp_path):
    """--init DIR (a checkpoint's folder, most likely): said to be a directory, with the export
    command that makes the file; it was 'no such file' of a folder that exists."""
    from meshdsl.train.init_weights import read_weights
    with pytest.raises(WeightsError) as e:
        read_weights(tmp_path, "--init")
    text = str(e.value)
    assert f"--init: '{tmp_path}' is a directory, not a safetensors file." in text, text
    assert f"`meshdsl export {tmp_path} --out FILE`" in text and "Rule: " in text, text
