"""A loss divided by a count over the whole batch, under a pipeline (lowering/batch_stats.py).

A value made from the inputs only that sums over the batch (an MLM loss's masked-token count, a
padded language model's real-token count) is made once per step, in the pipeline's prologue, on
the stages that read it; each micro-batch's forward and backward read it as a constant.  Pinned:
the loss and every gradient equal the dense program's on ``stage:2`` (simulated) for gpipe, 1F1B,
ZB-H1 and ``interleaved:2`` (tests/heldout_bert.py with ``mlm_norm=batch``; a tiny padded LM whose
count, ``maximum(count, 1)``, every stage's layers read too, also with a data axis; inputs centred
by their batch mean before the layers), and with plain gradient accumulation, whose backward then
runs per micro-batch too; the count is made in the prologue, on each stage that reads it; so is
a batch mean of params and inputs before the layers (its gradient after the micro-batches); a
whole-batch value made through the pipelined stack is still refused, saying why.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import assert_matches_scaled
from meshdsl.errors import LayoutError
from meshdsl.lowering.pipeline import MB_AXIS
from meshdsl.lowering.pipeline_program import Segment

# As tests/test_pipeline_exec.py: micro-batch sums add in another order than the dense program's,
# a few ulps of each output's largest magnitude; a count of one micro-batch instead of the whole
# batch is off by a factor of about m, a lost or doubled micro-batch by O(1).
REL = 1e-5
BERT = Path(__file__).parent / "heldout_bert.py"
PIPE = ("stage:2", "layer:stage")
B, S, V, D, L = md.Dim("batch", 4), md.Dim("seq", 5), md.Dim("vocab", 7), md.Dim("d_model", 4), md.Dim("layer", 4)
_BUILT: dict = {}


def _bert():
    if "bert" not in _BUILT:
        model = md.load_model(str(BERT), tiny=True, layers=4)   # mlm_norm="batch": the count summed in the graph
        outs = {"loss": model.loss, **{f"d/{k}": g for k, g in md.grad(model.loss, model.params).items()}}
        feeds = model.feeds(0)
        _BUILT["bert"] = (outs, feeds, md.run_dense(outs, feeds))
    return _BUILT["bert"]


def _padded_lm(count_from_params: bool = False):
    """A tiny LM over padded rows: cross-entropy summed over the real tokens (``mask``) and divided
    by their count over the whole batch; the layers (every stage) read a scale made of it too."""
    ff = md.Dim("d_ff", 6)
    with md.Graph("padded_lm"):
        tokens, targets = md.input("tokens", [B, S], torch.int64), md.input("targets", [B, S], torch.int64)
        mask = md.input("mask", [B, S])
        params = {"wte": md.param("wte", [V, D]), "w1": md.param("w1", [L, D, ff]),
                  "w2": md.param("w2", [L, ff, D]), "w_out": md.param("w_out", [D, V])}
        count = md.maximum(md.reduce_sum(mask), 1.0)
        scale = 4.0 / count

        def block(h, w):
            u = md.tanh(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, w["w1"]))
            return h + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", u, w["w2"]) * scale

        h = md.repeat(block, md.gather(params["wte"], tokens, "vocab"), {k: params[k] for k in ("w1", "w2")}, "layer")
        ce = md.cross_entropy(md.einsum("batch seq d_model, d_model vocab -> batch seq vocab", h, params["w_out"]),
                              targets, "vocab")
        if count_from_params:   # a whole-batch value of the model's own output: no statistic of the inputs
            count = md.reduce_sum(md.exp(-ce))
        loss = md.reduce_sum(ce * mask) / count
        grads = md.grad(loss, params)
    return {"loss": loss, **{f"d/{k}": g for k, g in grads.items()}}


def _lm_feeds():
    gen = torch.Generator().manual_seed(5)
    lengths = torch.tensor([5, 2, 4, 1])   # rows of 5, 2, 4 and 1 real tokens: micro-batch counts differ
    return {"tokens": torch.randint(0, V.size, (B.size, S.size), generator=gen),
            "targets": torch.randint(0, V.size, (B.size, S.size), generator=gen),
            "mask": (torch.arange(S.size)[None, :] < lengths[:, None]).float()}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zbh1", "interleaved:2"])
def test_bert_divided_by_the_masked_count_pipelines_with_the_dense_numbers(schedule):
    outs, feeds, want = _bert()
    plan = md.compile(outs, *PIPE, microbatches=2, schedule=schedule)
    assert_matches_scaled(md.run_simulated(plan, feeds), want, f"bert {schedule}", REL)


@pytest.mark.parametrize("mesh, layout, microbatches, schedule", [
    (*PIPE, 2, "1f1b"),
    (*PIPE, 4, "interleaved:2"),
    ("stage:2; data:2", "layer:stage; batch:data", 2, "zbh1"),
    ("data:2", "batch:data", 2, None),            # plain gradient accumulation
])
def test_a_padded_lm_divided_by_its_token_count_matches_dense(mesh, layout, microbatches, schedule):
    outs, feeds = _padded_lm(), _lm_feeds()
    params = {k: torch.randn(t.shape.sizes, generator=torch.Generator().manual_seed(1))
              for k, t in outs["loss"].graph.params.items()}
    want = md.run_dense(outs, feeds, params)
    plan = md.compile(outs, mesh, layout, microbatches=microbatches, **({"schedule": schedule} if schedule else {}))
    assert_matches_scaled(md.run_simulated(plan, feeds, params), want, f"padded lm '{mesh}' {schedule}", REL)


def test_inputs_centred_by_their_batch_mean_before_the_layers_match_dense():
    """A whole-batch statistic the forward reads before the pipelined layers (stage 0)."""
    d, layer = md.Dim("d_model", 4), md.Dim("layer", 2)
    with md.Graph():
        x = md.input("x", [md.Dim("batch", 8), d])
        w = md.param("w", [layer, d])
        y = md.repeat(lambda c, p: md.tanh(c * p["w"]), x - md.reduce_mean(x, "batch"), {"w": w}, "layer")
        loss = md.reduce_sum(y * y)
        outs = {"loss": loss, "d/w": md.grad(loss, {"w": w})["w"]}
    gen = torch.Generator().manual_seed(2)
    feeds, params = {"x": torch.randn(8, 4, generator=gen) + 3.0}, {"w": torch.randn(2, 4, generator=gen)}
    want = md.run_dense(outs, feeds, params)
    plan = md.compile(outs, *PIPE, microbatches=4, schedule="1f1b")
    assert_matches_scaled(md.run_simulated(plan, feeds, params), want, "centred inputs", REL)


@pytest.mark.parametrize("stem_trained", [False, True], ids=["frozen-stem", "trained-stem"])
def test_a_stem_centred_by_its_batch_mean_before_the_layers_matches_dense(stem_trained):
    """A whole-batch statistic of params and inputs (a stem's output centred by its batch mean, a
    frozen teacher's centre) is fixed when the step starts: made once, before the micro-batches.
    Trained, its gradient (a sum over the batch) runs after them. Both were refused."""
    d, e, layer = md.Dim("d_model", 4), md.Dim("e", 3), md.Dim("layer", 2)
    with md.Graph():
        x = md.input("x", [md.Dim("batch", 8), d])
        params = {"ws": md.param("ws", [d, e]), "w": md.param("w", [layer, e])}
        h = md.tanh(md.einsum("batch d_model, d_model e -> batch e", x, params["ws"]))
        y = md.repeat(lambda c, p: md.tanh(c * p["w"]), h - md.reduce_mean(h, "batch"), {"w": params["w"]}, "layer")
        loss = md.reduce_sum(y * y)
        wrt = params if stem_trained else {"w": params["w"]}
        outs = {"loss": loss, **{f"d/{k}": g for k, g in md.grad(loss, wrt).items()}}
    gen = torch.Generator().manual_seed(3)
    feeds = {"x": torch.randn(8, 4, generator=gen) + 1.0}
    params = {"ws": torch.randn(4, 3, generator=gen), "w": torch.randn(2, 3, generator=gen)}
    want = md.run_dense(outs, feeds, params)
    plan = md.compile(outs, *PIPE, microbatches=4, schedule="1f1b")
    assert_matches_scaled(md.run_simulated(plan, feeds, params), want, f"stem trained={stem_trained}", REL)
    prologue = _program(plan).steps(Segment.PROLOGUE)
    assert any(s.is_collective and MB_AXIS in s.axes for s, _ in prologue), "the batch mean is made once"


def _program(plan):
    (step,) = [s for s in plan.steps if s.kind in ("pipeline", "accumulate")]
    return step.args["program"]


def test_the_count_is_made_once_before_the_micro_batches_where_it_is_read():
    prog = _program(md.compile(_padded_lm(), *PIPE, microbatches=2, schedule="1f1b"))
    joins = [(s, st) for s, st in prog.steps(Segment.PROLOGUE) if s.is_collective and MB_AXIS in s.axes]
    # One allreduce over the micro-batches, on both stages: the loss reads the count on stage 1, the
    # layers of every stage its scale (no transfer: each stage makes its own from its inputs).
    assert [(s.kind, tuple(sorted(st))) for s, st in joins] == [("allreduce", (0, 1))]
    for seg in (Segment.FORWARD, Segment.BACKWARD):
        assert not any(s.is_collective and MB_AXIS in s.axes for s, _ in prog.steps(seg))
    # Without a pipeline the backward now runs per micro-batch too (not after all of them).
    acc = _program(md.compile(_padded_lm(), "data:2", "batch:data", microbatches=2))
    assert any(s.op == "repeat_grad" for s, _ in acc.steps(Segment.BACKWARD))


def test_a_whole_batch_value_made_from_params_is_still_refused():
    with pytest.raises(LayoutError) as e:
        md.compile(_padded_lm(count_from_params=True), *PIPE, microbatches=2, schedule="1f1b")
    text = str(e.value)
    assert "reduces over the whole batch" in text and "the pipelined backward" in text
    assert "allreduce over micro-batches" in text
    assert "through the pipelined repeat over 'layer'" in text
    assert "Fix: divide by a whole-batch value made from the inputs only" in text

