"""Held-out models of round 6c (a new user's, from README.md and docs/guide alone) against the dense program.

``tests/heldout_userllama.py`` (a Llama-style decoder in the user's own names: ``tokens``,
``hidden``, ``n_heads``, ``head_dim``, ``mlp``, ``depth``; pre-norm RMSNorm, SwiGLU, rotary from
``md.arange`` positions or fed ones, optional q/k/v biases, a tied or separate head, label smoothing
and a mean over the non-pad labels; 6 heads, so ``n_heads`` splits unevenly over 4) and
``tests/heldout_uservit.py`` (a ViT: a patchify by ``md.rearrange`` or by reshape-transpose-reshape, a class token by ``concat`` or
mean pooling, pre-norm blocks with biases, an MLP head to 10 classes, label smoothing, its own
``batches``), each written twice: blocks under ``md.repeat`` over ``depth`` (``scan=True``) and a plain
Python loop with one set of params per layer (``scan=False``), on a subset of the layouts they were
checked on by hand (``meshdsl check``, ``train`` with ``--resume``, ``search``, ``plan``, ``md.fit``).

Also what they led to: a layout naming a layer dim of a model with no ``md.repeat`` (a pipeline of
the Python-loop version) says that the layers of a Python loop have no dim, and how ``md.repeat``
makes one; ``meshdsl search`` seeds Megatron from the graph (the two dims a weight's matmul makes and
another's contracts), so it proposes ``n_heads:model; mlp:model`` for a model that does not name
them ``heads`` and ``d_ff``.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import assert_heldout_case_matches_dense, heldout_case_id, heldout_outputs, run_cli

HERE = Path(__file__).parent
LLAMA, VIT = (str(HERE / f"heldout_user{n}.py") for n in ("llama", "vit"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}
LOOP = {"scan": False}

# (model, config overrides, mesh, layout, compile keywords)
CASES = [
    (LLAMA, {}, "data:2; model:2", "batch:data; n_heads:model; mlp:model"),
    (LLAMA, {"vocab": 42}, "model:4", "n_heads:model; mlp:model; vocab:model"),     # 6 heads, 42 rows over 4
    (LLAMA, {}, "model:4", "tokens:model"),                                          # rotary of split positions
    (LLAMA, {"tied": False, "bias": True, "fed_positions": True}, "stage:2; model:2",
     "depth:stage; n_heads:model; mlp:model", PIPE),
    (LLAMA, {}, "stage:2", "depth:stage", {"microbatches": 2, "schedule": "interleaved:2"}),
    (LLAMA, LOOP, "data:2; model:2", "batch:data; params.hidden:data; n_heads:model; mlp:model"),
    (VIT, {}, "data:2; model:2", "batch:data; n_heads:model; mlp:model; classes:model"),  # 10 classes over 2
    (VIT, {}, "model:4", "patches:model"),                      # 4 patches + the class token over 4
    (VIT, {"pool": "mean"}, "data:2", "height:data"),
    (VIT, {"patchify": "reshape"}, "data:2; model:2", "width:data; patches:model"),  # view, permute, view
    (VIT, {}, "stage:2; data:2", "depth:stage; batch:data; params.embed:data", PIPE),
    (VIT, {**LOOP, "pool": "mean"}, "model:4", "n_heads:model; mlp:model; classes:model"),
]


@pytest.mark.parametrize("case", CASES, ids=[heldout_case_id(c) for c in CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


def test_the_two_patchifies_are_one_model():
    """md.rearrange's groups and torch's view-permute-view cut the same patches: the same loss,
    bitwise (the same pixels in the same order meet the same weights)."""
    feeds = md.load_model(VIT, tiny=True).feeds(0)
    losses = [md.run_dense({"l": md.load_model(VIT, tiny=True, patchify=p).loss}, feeds)["l"]
              for p in ("rearrange", "reshape")]
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)


@pytest.mark.parametrize("path", [LLAMA, VIT])
def test_pipelining_a_python_loop_of_layers_says_to_use_repeat(path):
    """The loop version has no layer dim: 'depth:stage' is refused at the rule, with the reason
    (a Python loop's layers have no dim) and md.repeat as the fix; the scanned one pipelines."""
    model = md.load_model(path, tiny=True, **LOOP)
    with pytest.raises(md.LayoutError) as e:
        md.compile(heldout_outputs(model), "stage:2", "depth:stage", **PIPE)
    text = str(e.value)
    assert "names dim 'depth', which no tensor of the model has" in text, text
    assert "    depth:stage\n    ^^^^^" in text, text
    assert "no md.repeat" in text and "Python loop" in text, text
    assert "md.repeat(block, x, stacked_params, 'depth')" in text.split("Fix:")[1], text


def test_a_typo_in_a_model_with_a_repeat_gets_no_loop_hint(capsys):
    """The hint is for models without a repeat: a typo in the scanned model is a plain
    did-you-mean, exit 2 from the CLI with a caret and no traceback."""
    rc, out, err = run_cli(capsys, ["check", LLAMA, "--tiny", "--mesh", "data:2; model:2",
                                    "--layout", "batch:data; n_haeds:model"])
    assert rc == 2, (rc, out, err)
    assert "Did you mean 'n_heads'?" in err and "                ^^^^^^^" in err, err
    assert "md.repeat" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("path, pair", [(VIT, ("n_heads", "mlp")), (LLAMA, ("n_heads", "mlp")),
                                        ("llama", ("d_ff", "kv_heads"))])
def test_search_finds_the_megatron_pair_in_the_graph(path, pair):
    """Not by name: the dims a weight's matmul makes and another's contracts, kept whole by
    nothing else (head_dim is attention's feature dim, hidden/embed are normed, vocab and
    classes feed the loss); the pair is a seed on the model axis, whatever its estimate."""
    from meshdsl.search.calibrate import Calibration
    from meshdsl.search.dims import Splits, megatron_dims
    model = md.load_model(path, tiny=True)
    splits = Splits.of(model, model.train_step(), Calibration.defaults(), 4, False)
    names = {d for p in model.params.values() for d in p.shape.names}
    by_bytes = {d: sum(p.shape.numel for p in model.params.values() if d in p.shape.names) for d in names}
    assert set(megatron_dims(model.loss, by_bytes, splits.prof)) == set(pair)
    rules = "; ".join(f"{d}:model" for d in splits.megatron)
    seeded = [o for o in splits.options("model", 2) if o.name == "TP(megatron)"]
    assert [o.rules for o in seeded] == [rules] and seeded[0].pruned is None, splits.options("model", 2)


def test_fit_resumes_the_vit_on_a_pipeline_with_the_losses_of_one_run(tmp_path):
    """md.fit as docs/guide/training.md shows, on the model's own batches: 2 steps on a 2x2 mesh,
    then step 3 resumed as a 2-stage pipeline, give the uninterrupted run's losses."""
    def fit(**kw):
        return md.fit(md.load_model(VIT, tiny=True), lr=0.5, eval_every=0, **kw)
    whole = fit(mesh="data:1", steps=3, out=str(tmp_path / "a"))
    fit(mesh="data:2; model:2", layout="batch:data; n_heads:model; mlp:model", steps=2,
        checkpoint=str(tmp_path / "ck"), save_every=2, out=str(tmp_path / "b"))
    rest = fit(mesh="stage:2", layout="depth:stage", microbatches=2, schedule="1f1b", steps=3,
               checkpoint=str(tmp_path / "ck"), resume=True, out=str(tmp_path / "c"))
    assert rest.start_step == 2 and [r["step"] for r in rest.rows] == [3], rest.rows
    # the same step on other layouts: fp32 sums in another order, ~1e-7 of a loss near 2.3
    torch.testing.assert_close(torch.tensor(rest.rows[0]["loss"]), torch.tensor(whole.rows[2]["loss"]),
                               rtol=1e-5, atol=0)
