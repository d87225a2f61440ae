"""A recomputed step does not send again a collective the forward sent (meshdsl/lowering/saved_copies.py,
``saved_results``; meshdsl/ir/remat.py, ``recomputed``).

TokenFormer (``tests/heldout_tokenformer.py``) under ``ptok:model``: each Pattention layer's L2 norm
over the split param tokens is an allreduce in the forward.  Under ``remat="selective"`` the backward
recomputed the norm, allreduce included: 14 allreduces per step became 28.  The forward now also
saves the allreduced sums (``[batch, seq]``, 96 B a layer each, under ``RESULTS_SHARE`` of what
``selective`` saves) and the recompute starts from them:

* the plan sends what ``none``'s sends, and no recompute step communicates; in a 1F1B pipeline too;
* the numbers are bitwise ``none``'s on the simulated mesh (the backward reads the very sums the
  forward made) and the dense program's;
* the peak rises by the saved sums' bytes at most, and those stay within the share (smallest first);
* ``full`` saves only each layer's input, by definition: it recomputes the layer, collectives included;
* a transformer under Megatron's ``heads:model`` with ``selective`` sends no more than before.
"""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest
import torch

import meshdsl as md
import meshdsl.lowering.saved_copies as saved_copies
from meshdsl.lowering import compiler
from meshdsl.lowering.memory import memory_report
from models.transformer import Config, build
from conftest import assert_heldout_case_matches_dense

TOKENFORMER = str(Path(__file__).parent / "heldout_tokenformer.py")
PTOK = ("model:2", "ptok:model")


def _outputs(model, remat: str) -> dict:
    return {"loss": model.loss, **{f"grad/{k}": g for k, g in md.grad(model.loss, model.params, remat=remat).items()}}


def _counts(plan) -> dict:
    return {k: v["count"] for k, v in plan.totals().items()}


def _blocks(plan):
    """(forward step, backward step) of the plan's repeat (a pipeline's: in its stage programs)."""
    steps = [s for s in plan.steps if s.kind == "repeat"]
    steps += [s for p in plan.steps if p.kind == "pipeline" for sub in p.subplans for s in sub.steps if s.kind == "repeat"]
    return next(s for s in steps if not s.args["backward"]), next(s for s in steps if s.args["backward"])


def _results(step) -> list[str]:
    return [n for n in step.args["saved"] if n.startswith(saved_copies.RESULT)]


def _sent_again(plan) -> int:
    """The collectives a layer's backward sends in recomputing."""
    return sum(s.is_collective for s in _blocks(plan)[1].subplans[0].steps if s.phase == "recompute")


def _rule_off(monkeypatch) -> None:
    """Compile as before the rule (no share for results), in a fresh compile cache."""
    monkeypatch.setattr(saved_copies, "RESULTS_SHARE", 0)
    monkeypatch.setattr(compiler, "_CACHE", OrderedDict())


@pytest.fixture(scope="module")
def tokenformer():
    return md.load_model(TOKENFORMER, tiny=True)


def test_selective_sends_what_none_sends_and_recomputes_no_collective(tokenformer):
    plan = md.compile(_outputs(tokenformer, "selective"), *PTOK)
    want = _counts(md.compile(_outputs(tokenformer, "none"), *PTOK))
    assert _counts(plan) == want and want["allreduce"] == 14     # (28 when the recompute sent the norms again)
    fwd, _ = _blocks(plan)
    assert len(_results(fwd)) == 4                               # one sum per Pattention norm in the block
    assert any(s.phase == "recompute" for s in _blocks(plan)[1].subplans[0].steps) and _sent_again(plan) == 0


def test_the_numbers_are_bitwise_those_of_no_remat_and_the_dense_program(tokenformer):
    feeds = tokenformer.feeds(1)
    want = md.run_simulated(md.compile(_outputs(tokenformer, "none"), *PTOK), feeds)
    got = md.run_simulated(md.compile(_outputs(tokenformer, "selective"), *PTOK), feeds)
    for k in want:   # bitwise: the backward reads the sums the forward's allreduces made
        assert torch.equal(got[k], want[k]), f"{k}: max diff {(got[k] - want[k]).abs().max()}"
    assert_heldout_case_matches_dense((TOKENFORMER, {"remat": "selective"}, *PTOK))


def test_the_peak_rises_by_the_saved_sums_at_most_and_they_keep_to_the_share(tokenformer, monkeypatch):
    outputs = _outputs(tokenformer, "selective")
    on = md.compile(outputs, *PTOK)
    fwd, _ = _blocks(on)
    results = _results(fwd)
    per_layer = sum(fwd.subplans[0].values[fwd.subplans[0].outputs[n]].local_bytes(on.mesh) for n in results)
    own = sum(fwd.subplans[0].values[fwd.subplans[0].outputs[n]].local_bytes(on.mesh)
              for n in fwd.args["saved"] if n not in results and "@" not in n)
    assert per_layer == 4 * 4 * 6 * 4 and per_layer <= saved_copies.RESULTS_SHARE * own   # 4 norms [4, 6] fp32
    _rule_off(monkeypatch)
    off = md.compile(outputs, *PTOK)
    assert not _results(_blocks(off)[0])
    layers = tokenformer.config.layers
    got, was = memory_report(on), memory_report(off)
    assert got["saved_per_layer"] - was["saved_per_layer"] == per_layer
    assert was["activations_peak"] < got["activations_peak"] <= was["activations_peak"] + layers * per_layer
    # a share for two and a half of the sums keeps the two smallest (all four are 96 B: two of them)
    monkeypatch.setattr(saved_copies, "RESULTS_SHARE", 2.5 * 96 / own)
    monkeypatch.setattr(compiler, "_CACHE", OrderedDict())
    part = md.compile(outputs, *PTOK)
    assert len(_results(_blocks(part)[0])) == 2
    assert [_sent_again(p) for p in (on, part, off)] == [0, 2, 4]   # each norm's sum not saved is sent again


def test_full_remat_recomputes_the_layer_collectives_included(tokenformer):
    plan = md.compile(_outputs(tokenformer, "full"), *PTOK)
    fwd, _ = _blocks(plan)
    assert not _results(fwd)   # full keeps nothing but each layer's input, by definition
    assert _sent_again(plan) >= 4   # the 4 norms' sums among them


def test_a_pipeline_stage_recomputes_no_collective(tokenformer, monkeypatch):
    case = (TOKENFORMER, {"remat": "selective"}, "stage:2; model:2", "layer:stage; ptok:model",
            {"microbatches": 2, "schedule": "1f1b"})
    outputs = _outputs(tokenformer, "selective")
    plan = md.compile(outputs, *case[2:4], **case[4])
    _rule_off(monkeypatch)
    was = md.compile(outputs, *case[2:4], **case[4])
    assert _counts(plan)["allreduce"] < _counts(was)["allreduce"]
    assert _sent_again(plan) == 0
    monkeypatch.undo()
    assert_heldout_case_matches_dense(case)


def test_a_megatron_transformer_sends_no_more(monkeypatch):
    model = build(Config.tiny())
    outputs = _outputs(model, "selective")
    mesh, layout = "model:2", "heads:model"
    plan = md.compile(outputs, mesh, layout)
    _rule_off(monkeypatch)
    was = md.compile(outputs, mesh, layout)
    assert all(n <= _counts(was).get(k, 0) for k, n in _counts(plan).items())
    feeds = model.feeds(0)
    got, want = md.run_simulated(plan, feeds), md.run_dense(outputs, feeds)
    for k in want:
        # fp32 sums over the split heads add in another order: ~2**-20 of the magnitudes; a layout bug is O(1)
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
