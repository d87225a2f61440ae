"""Held-out models of round 6d (written from the README and docs alone), stressing training features.

``tests/heldout_dlrm.py`` (a DLRM-style recommender: a bottom MLP on dense features, two
same-size embedding tables stacked along ``tables`` and read by a bag sum of several ids per
sample under a fed mask (a per-sample one-hot einsum, as the docs say for ids and a table that
share a dim), a big table read by ``md.gather`` and bag-summed, a 7-row table (uneven on 2
ranks), the pairwise-dot interaction einsum, a top MLP and a BCE-with-logits loss, an accuracy
metric, every input made by rows with ``batches=``) sharded table-wise (``tables:model``),
row-wise (``user_rows:model``), column-wise and FSDP; and ``tests/heldout_txl.py`` (a
Transformer-XL-style decoder with attention-probability and residual dropout on: each layer
reads its own slice of the previous segment's memory, fed as a ``[layer, batch, mem, d_model]``
input through ``md.repeat``'s stacked dict and put under ``md.stop_gradient``, or one memory
shared by every layer with ``mem_mode="closure"``) under tensor, sequence, key-split, uneven
data and 1f1b pipeline layouts; and ``tests/heldout_echoice.py`` (an expert-choice mixture of
experts: each expert picks its top-c tokens of a sequence with ``md.top_k`` over ``seq``, a
router z-loss per layer as a per-layer output; with ``router_scale=0.0`` a zero router whose
scores all tie) under expert, sequence (top-k over a split dim, ties included) and pipeline
layouts; and ``tests/heldout_switch.py`` (a Switch Transformer MLP stack: top-1 routing over ONE
group of all ``batch x seq`` tokens flattened by ``md.reshape``, an exclusive ``cumsum`` of the
choices over ``tokens`` for the queue places, a capacity factor with dropped tokens passing
through, a router z-loss and a load-balancing loss) with ``tokens`` or ``batch`` split and
experts parallel; each ``Config.tiny()``. A micro-batched Switch (a pipeline or ``--accum``)
is refused (exit 2) naming the cumsum: its routing group is the whole batch.

Training, as a user runs it: ``md.fit`` with AdamW, dropout on, saved at step 2 on a 2x2 mesh
and resumed on a pipeline, gives the uninterrupted run's losses.

Also what they led to: a Config field typed ``float | None`` takes ``--config k=0.0`` (or
``k=none``) as a float (it was kept as the str '0.0', which crashed the init with a TypeError);
``md.param(scale=...)`` not a number is refused at the param; ``md.fit(accum=2)`` (the CLI's
``--accum``) names ``microbatches=`` as fit's spelling; ``md.fit(eval_data=...)`` without
``data=`` a function (it was silently not read: the eval ran on the model's own batches) is refused,
and so is ``md.fit(layout="auto")`` (the CLI's search; it was a layout ParseError), with the
``md.search_layouts`` recipe;
training on a model's own batches (``batches=``) on an interleaved pipeline, whose fed per-layer
memory is cut block-cyclic, runs (it was an internal AssertionError); the eval of a training run
is the model without dropout (as torch's ``model.eval()``; it was the
loss under one fixed set of masks).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import assert_heldout_case_matches_dense, heldout_case_id

HERE = Path(__file__).parent
DLRM, TXL, ECHOICE, SWITCH = (str(HERE / f"heldout_{n}.py") for n in ("dlrm", "txl", "echoice", "switch"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}

# (model, config overrides, mesh, layout, compile keywords)
CASES = [
    (DLRM, {}, "data:2; model:2", "batch:data; tables:model; user_rows:model"),  # table- and row-wise
    (DLRM, {}, "model:2", "cat_rows:model"),                              # 7 rows on 2 ranks
    (DLRM, {}, "data:2", "batch:data; params.d_emb:data"),                # FSDP
    (TXL, {}, "data:2; model:2", "batch:data; heads:model; d_ff:model"),  # dropout masks under TP
    (TXL, {}, "model:2", "key_seq:model"),                                # memory and segment keys split
    (TXL, {}, "data:3", "batch:data"),                                    # 4 rows on 3 ranks
    (TXL, {}, "stage:2", "layer:stage", PIPE),                            # the fed memory per stage
    (TXL, {"mem_mode": "closure"}, "stage:2; model:2", "layer:stage; heads:model", PIPE),
    (ECHOICE, {}, "data:2; model:2", "batch:data; experts:model"),       # expert parallel
    (ECHOICE, {"router_scale": 0.0}, "model:3", "seq:model"),            # top-k of tied scores, split 2,2,2
    (ECHOICE, {}, "stage:2", "layer:stage", PIPE),                         # the z-losses per layer
    (SWITCH, {}, "data:2", "tokens:data"),                                 # queue places over split tokens
    (SWITCH, {}, "data:2", "batch:data; experts:data"),                    # tokens made from a split batch
]


@pytest.mark.parametrize("case", CASES, ids=[heldout_case_id(c) for c in CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


def test_txl_dropout_is_on_and_the_memory_is_read():
    """The cases above check dropout's masks, not that there are any: dropout=0.1 changes the
    loss, and so does another memory (the keys read it)."""
    on, off = md.load_model(TXL, tiny=True), md.load_model(TXL, tiny=True, dropout=0.0)
    feeds = on.feeds(0)
    loss = lambda m, f: float(md.run_dense({"l": m.loss}, f)["l"])
    # another memory: the features permuted (the keys' layer norm ignores a shift or a scale)
    other = {**feeds, "memory": feeds["memory"].flip(-1)}
    assert loss(on, feeds) != loss(off, feeds) and loss(off, feeds) != loss(off, other)


def test_fit_with_dropout_resumes_on_another_layout_with_the_uninterrupted_losses(tmp_path):
    """AdamW, dropout on, the model's own batches: steps 1-2 on a 2x2 mesh, saved, then steps 3-4
    on a 1f1b pipeline; the dropout masks hash the step, so the resumed losses are the
    uninterrupted run's."""
    kw = dict(optimizer="adamw", lr=0.01, decay_steps=4, eval_every=0, samples=0)
    whole = md.fit(md.load_model(TXL, tiny=True), mesh="data:1", steps=4, out=str(tmp_path / "w"), **kw)
    md.fit(md.load_model(TXL, tiny=True), mesh="data:2; model:2", layout="batch:data; heads:model; d_ff:model",
           steps=2, checkpoint=str(tmp_path / "ck"), save_every=2, out=str(tmp_path / "a"), **kw)
    rest = md.fit(md.load_model(TXL, tiny=True), mesh="stage:2", layout="layer:stage", microbatches=2,
                  schedule="1f1b", steps=4, checkpoint=str(tmp_path / "ck"), resume=True, out=str(tmp_path / "b"))
    got = torch.tensor([r["loss"] for r in rest.rows])
    want = torch.tensor([r["loss"] for r in whole.rows][2:])
    assert len(got) == 2 and rest.start_step == 2, (rest.rows, rest.start_step)
    # other meshes sum fp32 partial products in another order: ~1e-7 relative per step, compounding
    # over 2 AdamW steps far below 1e-5; a wrong mask, step or state moves the loss by >1e-2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def test_switch_drops_tokens_and_a_micro_batched_switch_is_refused():
    """capacity_factor=1.0 drops some routings (the capacity is reached), and micro-batches would
    route each micro-batch as its own group: refused with the op and the rule, not other numbers."""
    model = md.load_model(SWITCH, tiny=True)
    ids = {"ids": model.feeds(0)["ids"]}              # the count reads no labels
    assert float(md.run_dense(model.outputs, ids)["dropped"]) > 0
    with pytest.raises(md.MeshDSLError, match=r"'cumsum' cannot be micro-batched") as e:
        md.compile(model.train_step(0.1), "stage:2", "layer:stage", microbatches=2)
    assert "Fix:" in str(e.value)


def test_an_optional_config_field_takes_a_number_or_none():
    """``router_scale: float | None``: ``--config router_scale=0.0`` is the float 0.0 (the model
    builds and runs), ``none`` is None, and a word is refused naming the type."""
    from meshdsl.train.config import ConfigError, parse_config
    cls = type(md.load_model(ECHOICE, tiny=True).config)
    assert parse_config("router_scale=0.0", cls) == {"router_scale": 0.0}
    assert parse_config("router_scale=none", cls) == {"router_scale": None}
    with pytest.raises(ConfigError, match="router_scale is a float"):
        parse_config("router_scale=big", cls)
    model = md.load_model(ECHOICE, tiny=True, **parse_config("router_scale=0.0", cls))
    router = md.run_dense({"w": model.params["w_router"]})["w"]
    assert router.abs().max() == 0


def test_a_param_scale_that_is_not_a_number_is_refused_at_the_param():
    d = md.Dim("d", 2)
    with md.Graph(), pytest.raises(md.GraphError, match=r"scale='0.5' \(str\) is not a number"):
        md.param("w", [d], scale="0.5")


def test_fit_names_microbatches_for_the_clis_accum():
    with pytest.raises(md.MeshDSLError) as e:
        md.fit(md.load_model(DLRM, tiny=True), steps=1, accum=2)
    assert "md.fit spells it microbatches=k" in str(e.value) and "Fix: pass microbatches=k" in str(e.value)


def test_fit_refuses_eval_data_it_would_not_read():
    model = md.load_model(TXL, tiny=True)
    with pytest.raises(md.MeshDSLError, match="eval_data is given without data= a function") as e:
        md.fit(model, steps=1, eval_data=[model.feeds(0)])
    assert "Fix: pass data=lambda step" in str(e.value)


def test_the_eval_runs_without_dropout_on_any_layout(tmp_path):
    """A run with dropout 0.3 on a 1f1b pipeline: its eval loss is the dense loss of the same
    params with dropout=0 (the training losses keep their masks: they differ from it)."""
    model, off = md.load_model(TXL, tiny=True, dropout=0.3), md.load_model(TXL, tiny=True, dropout=0.0)
    evals = [model.batches(10**6 + i) for i in range(2)]
    r = md.fit(model, mesh="stage:2", layout="layer:stage", microbatches=2, schedule="1f1b", steps=1,
               data=lambda t: model.batches(t), eval_data=evals, eval_every=1, samples=0, out=str(tmp_path))
    params = r.step.full_params()
    want = sum(float(md.run_dense({"l": off.loss}, f, params)["l"]) for f in evals) / len(evals)
    masked = sum(float(md.run_dense({"l": model.loss}, f, params)["l"]) for f in evals) / len(evals)
    # the pipeline sums the same fp32 terms per micro-batch: ~1e-7 relative; dropout 0.3 moves it ~1e-1
    assert abs(r.final_eval_loss - want) < 1e-5 * want and abs(masked - want) > 1e-2, (r.final_eval_loss, want, masked)


def test_own_batches_with_a_fed_per_layer_input_train_on_an_interleaved_pipeline(tmp_path):
    """The memory input [layer, batch, mem, d_model] under interleaved:2 is cut block-cyclic over
    'layer': the feeder hands a pipeline its inputs whole, and the losses are one process's."""
    kw = dict(steps=2, optimizer="adamw", lr=0.01, eval_every=0, samples=0)
    one = md.fit(md.load_model(TXL, tiny=True, layers=4), mesh="data:1", out=str(tmp_path / "a"), **kw)
    pipe = md.fit(md.load_model(TXL, tiny=True, layers=4), mesh="stage:2", layout="layer:stage", microbatches=4,
                  schedule="interleaved:2", out=str(tmp_path / "b"), **kw)
    # micro-batches and stages add the same fp32 terms in another order: ~1e-7 relative
    torch.testing.assert_close(torch.tensor([r["loss"] for r in pipe.rows]),
                               torch.tensor([r["loss"] for r in one.rows]), rtol=1e-5, atol=0)


def test_fit_refuses_the_clis_auto_layout_with_the_search_recipe():
    with pytest.raises(md.MeshDSLError, match=r"layout='auto' is the command line's search") as e:
        md.fit(md.load_model(DLRM, tiny=True), mesh="data:2", layout="auto", steps=1)
    assert "md.search_layouts(model, model.train_step(0.01), NPROC" in str(e.value)


def test_without_dropout_is_the_model_with_no_dropout():
    """The eval's transform on the shipped GPT (dropout in and around its repeat's block): the
    loss of dropout=0 at the same params; a model without dropout comes back as it was."""
    from meshdsl.ir.eval_mode import eval_mode
    on, off = md.load_model("transformer", tiny=True, dropout=0.3), md.load_model("transformer", tiny=True)
    feeds = on.feeds(0)
    got = md.run_dense(eval_mode({"l": on.loss}), feeds)["l"]
    # dropout=0 takes the fused attention kernel, the transform the composite softmax: fp32 rounding
    torch.testing.assert_close(got, md.run_dense({"l": off.loss}, feeds)["l"], rtol=1e-5, atol=0)
    assert abs(float(md.run_dense({"l": on.loss}, feeds)["l"] - got)) > 1e-2
    outs = {"l": off.loss}
    assert eval_mode(outs) is outs
