"""What the communication audit (``bench/comm_audit.py``) found, and the audit's own rules.

* An MoE under pure data parallelism (``batch:data``) renames its dispatched tokens' ``batch`` to
  ``expert_batch`` for the experts.  No layout rule names ``expert_batch``, so the experts' input
  was gathered whole to every rank (an allgather forward and one backward per layer, and every
  rank ran every token through the experts); the rename now keeps the split on the dim it makes
  (``lowering/implied.py``), and the plan is textbook data parallelism: the loss's allreduce and
  the gradients' buckets.  Expert parallelism (``experts:data``, which takes the axis) still moves
  the tokens in one alltoall each way.
* The audit's rules: a Megatron transformer has the textbook 2 allreduces forward and 2 backward
  per layer and nothing flagged; a rename whose new dim meets the old one (CLIP's texts against its
  images) is still gathered, and flagged; so are a duplicate, an unused result and a gather cut
  back by a slice, on a plan edited to have them (no model's plan has one today).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import heldout_outputs, load_bench
from meshdsl.lowering.cost import CostModel
from meshdsl.train.step import training_outputs

audit = load_bench("comm_audit")
HERE = Path(__file__).parent


def _kinds(plan) -> dict:
    """``{(kind, axes): count}`` of the plan's collectives per step."""
    return {k: v["count"] for k, v in plan.totals_by_axis().items()}


def _assert_dense(model, outputs, plan) -> None:
    feeds = model.feeds(0)
    got, want = md.run_simulated(plan, feeds), md.run_dense(outputs, feeds)
    top = max(float(w.abs().max()) for k, w in want.items() if k.startswith("grad/"))
    for k, w in want.items():
        # fp32: the batch's sums split over 2 ranks add in another order (~1e-7 relative); a layout
        # bug is off by O(1).  A gradient is allowed 1e-4 of the largest one, as `meshdsl check`.
        scale = top if k.startswith("grad/") else float(w.abs().max())
        torch.testing.assert_close(got[k], w, rtol=0, atol=1e-4 * scale, msg=lambda m, k=k: f"{k}: {m}")


def test_moe_under_data_parallelism_moves_no_tokens():
    model = md.load_model("moe", tiny=True)
    step = md.compile(training_outputs(model.loss, model.params, 0.1), "data:2", "batch:data")
    # the loss's allreduce, the layers' gradients in one bucket per loop run, the rest's in one
    assert _kinds(step) == {("allreduce", ("data",)): 1, ("bucket_allreduce", ("data",)): 3}
    assert "implied by rename: expert_batch:data (from batch)" in step.notes
    outputs = heldout_outputs(model)
    plan = md.compile(outputs, "data:2", "batch:data")
    assert not [s for s, _ in plan.collectives() if s.kind in ("allgather", "alltoall")]
    _assert_dense(model, outputs, plan)


def test_expert_parallelism_still_moves_the_tokens_by_alltoall():
    model = md.load_model("moe", tiny=True)
    outputs = heldout_outputs(model)
    plan = md.compile(outputs, "data:2", "batch:data; experts:data")
    layers = model.config.layers
    # to the experts and back, forward and backward, per layer: the rename moves the split
    assert _kinds(plan)[("alltoall", ("data",))] == 4 * layers
    assert not [str(r) for r, _ in plan.layout.implied if str(r).startswith("expert_batch")]
    _assert_dense(model, outputs, plan)


def test_megatron_transformer_is_textbook_and_unflagged():
    (path,) = [p for p in audit.model_paths() if p.stem == "transformer"]
    dp, tp = audit.audit_model(path, {"dp", "megatron"})
    assert tp.rules == "heads:model; d_ff:model" and not tp.flagged and not dp.flagged
    layers = md.load_model("transformer", tiny=True).config.layers
    per_phase = {ph: sum(r.times for r in tp.rows if r.phase == ph) for ph in ("forward", "backward")}
    assert per_phase == {"forward": 2 * layers, "backward": 2 * layers}
    assert {r.kind for r in dp.rows} == {"allreduce", "bucket_allreduce"}


def _contrastive_plan():
    """Embeddings renamed ``batch -> text`` against the ``batch`` they came from, under ``batch:data``."""
    batch, d, e = md.Dim("batch", 4), md.Dim("d", 3), md.Dim("e", 3)
    with md.Graph():
        emb = md.einsum("batch d, d e -> batch e", md.input("x", [batch, d]), md.param("w", [d, e]))
        sim = md.einsum("batch e, text e -> batch text", emb, md.rename(emb, batch="text"))
        loss = md.reduce_sum(sim * sim)
    return md.compile({"loss": loss}, "data:2", "batch:data")


def test_audit_flags_a_rename_that_gathers():
    """Embeddings renamed ``batch -> text`` against the ``batch`` they came from (a contrastive
    loss): the rename's dim meets the old one, so it stays whole as the layout says (every rank
    needs every text), and the audit flags the gather for a person to judge."""
    plan = _contrastive_plan()
    assert [str(r) for r, _ in plan.layout.implied] == []
    got = audit.audit_plan("contrastive", "dp", "data:2", "batch:data", plan, {"batch", "text"})
    assert [(r.kind, r.op) for r in got.flagged] == [("allgather", "rename")]
    assert "reshape: rename gathers its input" in got.flagged[0].flags


def test_audit_flags_a_duplicate_an_unused_result_and_a_gather_cut_back():
    """The rules no plan of the models triggers today, on a plan edited to have each: the
    contrastive plan's gather repeated into a value nothing reads, and its result cut back."""
    plan = _contrastive_plan()
    (gather,) = [s for s in plan.steps if s.kind == "allgather"]
    fresh = max(plan.values) + 1
    again = dataclasses.replace(gather, outs=(fresh,))
    cut = dataclasses.replace(gather, kind="split", outs=(fresh + 1,), ins=gather.outs, args={"dim": 0})
    edited = dataclasses.replace(plan, steps=(*plan.steps, again, cut))
    got = audit.audit_plan("contrastive", "seq", "data:2", "batch:data", edited, {"batch", "text"})
    flags = [r.flags for r in got.rows if r.kind == "allgather"]
    assert flags == [["gather+slice: gathered, then cut back", "reshape: rename gathers its input"],
                     ["reshape: rename gathers its input", "duplicate: the same value moved twice",
                      "unused: nothing reads the result"]]


def _body_collectives(plan) -> list:
    """``(kind, value shape names)`` of each collective of one layer's backward (the first backward loop)."""
    loop = next(s for s in plan.steps if s.kind == "repeat" and s.args["backward"])
    sub = loop.subplans[0]
    return [(s.kind, tuple(sub.values[s.ins[0]].shape.names)) for s in sub.steps if s.is_collective]


def test_mqa_key_and_value_gradients_reach_their_weights_partial():
    """StarCoder's multi-query attention under ``heads:model``: k and v have no ``heads`` dim and
    stay whole, so their gradients are partial sums over ``model`` (each rank's heads).  Each is
    read by its weight's gradient, its bias's and the input's (which joins the queries' partial
    sum): all linear in it, so it passes on to each partial and the layer reduces the small weight
    gradients (one bucket) instead of ``[batch, key_seq, d_head]`` twice
    (``lowering/repeat.py`` ``_lazy_through``, kept where the block's price is lower).  Before:
    4 allreduces in a layer's backward, 12 in the tiny training step."""
    model = md.load_model(str(HERE / "heldout_starcoder.py"), tiny=True)
    step = md.compile(training_outputs(model.loss, model.params, 0.1), "model:2", "heads:model; d_ff:model")
    assert sum(c for c in _kinds(step).values()) == 10
    body = _body_collectives(step)
    # the two layer norms' input gradients, and wk, bk, wv, bv's gradients in one bucket
    assert sorted(k for k, _ in body) == ["allreduce", "allreduce", "bucket_allreduce"]
    assert not [n for _, n in body if "key_seq" in n]
    outputs = heldout_outputs(model)
    plan = md.compile(outputs, "model:2", "heads:model; d_ff:model")
    assert not [n for _, n in _body_collectives(plan) if "key_seq" in n]
    _assert_dense(model, outputs, plan)


# (model, collectives per tiny training step and per layer's backward) under Megatron; before: TXL
# 10 and 3 with its concat gradient [batch, key_seq, d_model] in them, PaLM 8 and 3 with its keys'.
CONCATS = [("heldout_txl", 10, 3), ("heldout_palm", 6, 2)]


@pytest.mark.parametrize("name, total, per_layer", CONCATS, ids=[c[0] for c in CONCATS])
def test_a_concat_gradient_passes_partial_to_its_slices(name, total, per_layer):
    """Transformer-XL's keys read ``concat(LN(memory), LN(h))`` and PaLM's rotary keys
    ``concat(turned, kept)``: the concat's gradient, partial over ``model`` (the heads' shares),
    is read by one slice per part.  It was reduced whole at the first slice; now (a backward
    block's partial sum passed on to every linear reader where the loop's price is lower,
    ``lowering/repeat.py`` ``_lazy_through``, slices in ``lowering/window.py``) each slice's share
    goes on partial: TXL's ``h`` part joins the queries' partial sum (reduced once, as before) and
    its memory part reaches only ``ln1``'s gradient, reduced per layer at ``[d_model]``; PaLM's
    both parts reach the key weight's gradient (one bucket) and the input's."""
    model = md.load_model(str(HERE / f"{name}.py"), tiny=True)
    step = md.compile(training_outputs(model.loss, model.params, 0.1), "model:2", "heads:model; d_ff:model")
    body = _body_collectives(step)
    assert sum(_kinds(step).values()) == total and len(body) == per_layer
    assert not [n for _, n in body if "key_seq" in n]
    outputs = heldout_outputs(model)
    plan = md.compile(outputs, "model:2", "heads:model; d_ff:model")
    assert not [n for _, n in _body_collectives(plan) if "key_seq" in n]
    _assert_dense(model, outputs, plan)


def test_the_audit_builds_retro_and_reports_a_model_that_does_not_build(tmp_path, capsys):
    # RETRO (tests/heldout_retro.py) normalises its chunked cross-attention over two dims at once
    # (md.softmax(s, ["nbrs", "nlen"])): refused before, it stopped the whole audit with a traceback.
    audits = audit.audit_model(HERE / "heldout_retro.py")
    assert [a.layout for a in audits] == ["dp", "megatron", "seq", "fsdp"]
    assert not [a.error for a in audits if a.error]
    assert all(a.count > 0 for a in audits)
    broken = tmp_path / "broken.py"
    broken.write_text("from dataclasses import dataclass\nimport meshdsl as md\n\n"
                      "@dataclass(frozen=True)\nclass Config:\n    batch: int = 2\n\n    @classmethod\n"
                      "    def tiny(cls):\n        return cls()\n\n"
                      "def build(cfg=Config()):\n"
                      "    with md.Graph():\n        x = md.input('x', [md.Dim('batch', cfg.batch)])\n"
                      "        md.softmax(x, 'seq')\n")
    (row,) = audit.audit_model(broken)
    assert (row.model, row.layout) == ("broken", "build") and "softmax" in row.error
    audit.print_summary([row, *audits])
    assert "broken                 build" in capsys.readouterr().out


def _weight_norm_plan():
    """FSDP (``params.d_model:data``) of a weight-normed matmul on centred inputs: the norm's
    row sums over the split ``d_model`` come from the param alone; the batch's mean reads ``x``."""
    batch, d, e = md.Dim("batch", 4), md.Dim("d_model", 8), md.Dim("e", 6)
    with md.Graph():
        x, w = md.input("x", [batch, d]), md.param("w", [d, e])
        norm = md.sqrt(md.reduce_sum(w * w, "d_model"))
        y = md.einsum("batch d_model, d_model e -> batch e", x - md.reduce_mean(x, "batch"), w) / norm
        loss = md.reduce_mean(y * y)
    # a slow machine's compute keeps the norm's and the mean's neighbouring allreduces apart
    # (lowering/coalesce.py would send them in one buffer), so each is audited on its own
    return md.compile(training_outputs(loss, {"w": w}, 0.1), "data:2", "batch:data; params.d_model:data",
                      cost=CostModel(flops_per_s=1e5))


def test_fsdp_reduction_of_a_param_only_value_is_not_flagged():
    """Under FSDP a sum over the split param dim of a value made from params alone (a weight
    norm) is partial on each rank: its small allreduce is what the layout asks for, not flagged.
    The batch mean's allreduce (it reads an input) still is, and plain data parallelism, which
    splits no param, still flags the norm's.  heldout_ngpt (weight norms everywhere, in and out
    of its layer loop) had 9 such flags under FSDP."""
    plan, rules = _weight_norm_plan(), "batch:data; params.d_model:data"
    got = audit.audit_plan("wn", "fsdp", "data:2", rules, plan, {"batch"})
    assert [(r.kind, r.op, r.phase) for r in got.rows if r.kind == "allreduce" and r.phase == "forward"] == \
        [("allreduce", "sqrt", "forward"), ("allreduce", "sub", "forward"), ("allreduce", "mul", "forward")]
    assert [r.op for r in got.flagged] == ["sub"]
    dp = audit.audit_plan("wn", "dp", "data:2", rules, plan, {"batch"})
    assert "sqrt" in [r.op for r in dp.flagged]
    (path,) = [p for p in audit.model_paths() if p.stem == "heldout_ngpt"]
    (fsdp,) = audit.audit_model(path, {"fsdp"})
    assert not fsdp.error and not fsdp.flagged, [(r.label, r.flags) for r in fsdp.flagged]
