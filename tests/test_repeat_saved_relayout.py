"""A repeat's backward reads the forward's re-laid copy of a saved activation (lowering/repeat.py).

Soft MoE under expert parallelism: the forward moves its slots batch->experts for the experts'
MLP and back for the combine; the backward reads both saved activations in those moved layouts.
It takes the copies the forward saved (an alltoall's copy is no larger than the activation)
instead of repeating the two exchanges per layer.  The numbers are the dense program's.
"""
from __future__ import annotations

from pathlib import Path

import meshdsl as md
from conftest import assert_heldout_case_matches_dense, heldout_outputs

SOFTMOE = Path(__file__).parent / "heldout_softmoe.py"
EP = ("data:2", "batch:data; experts:data")


def _alltoalls(plan) -> int:
    return plan.totals()["alltoall"]["count"]


def _saved_names(plan) -> list[str]:
    return [n for s in plan.steps if s.kind == "repeat" and not s.args["backward"] for n in s.args["saved"]]


def test_the_backward_of_a_repeat_does_not_redo_the_forwards_alltoalls_of_saved_activations():
    m = md.load_model(SOFTMOE, tiny=True)
    plan = md.compile(heldout_outputs(m), *EP)
    # per layer: the forward's slots batch->experts and back; the backward's cotangents the same
    # two ways (2 layers).  Redoing the saved activations' moves made it 6 per layer.
    assert _alltoalls(plan) == 4 * m.config.layers
    assert any("@" in n for n in _saved_names(plan))   # the re-laid copies the forward saves
    assert_heldout_case_matches_dense((SOFTMOE, {}, *EP))


def test_under_full_remat_the_backward_recomputes_and_saves_no_copies():
    m = md.load_model(SOFTMOE, tiny=True, remat="full")
    plan = md.compile(heldout_outputs(m), *EP)
    assert not any("@" in n for n in _saved_names(plan))
    assert_heldout_case_matches_dense((SOFTMOE, {"remat": "full"}, *EP))


def test_a_pipelined_repeat_reads_its_stages_saved_copies():
    case = (SOFTMOE, {}, "stage:2; data:2", "batch:data; experts:data; layer:stage", {"microbatches": 2})
    m = md.load_model(SOFTMOE, tiny=True)
    plan = md.compile(heldout_outputs(m), *case[2:4], **case[4])
    assert _alltoalls(plan) == 4 * m.config.layers   # a stage's layer: 4 (6 when the backward redid two)
    assert_heldout_case_matches_dense(case)
