"""A window op next to a gather of its split dim moves no halo (lowering/window.py).

CTC under ``time:model``: the alpha recursion reads the emissions from frame 1 on, renamed to
the steps the repeat scans (``tstep``, whole).  The slice kept ``time`` split, so a permute
re-aligned the uneven cut (1 row), and the rename then gathered it anyway: now the slice prices
that gather and gathers its input first.  In the backward, the slice's gradient (a pad) read the
renamed gradient's local cut of a value held whole: it pads that, no permute.
"""
from __future__ import annotations

from pathlib import Path

import meshdsl as md
from conftest import assert_heldout_case_matches_dense, heldout_outputs

CTC = Path(__file__).parent / "heldout_ctc.py"


def test_a_slice_renamed_to_a_scanned_dim_and_its_gradient_move_no_halo():
    case = (CTC, {}, "model:3", "time:model")
    plan = md.compile(heldout_outputs(md.load_model(CTC, tiny=True)), *case[2:])
    permutes = [s.label for s, _ in plan.collectives() if s.kind == "permute"]
    assert permutes == [], permutes   # was slice_7's and grad_slice/pad's (112 B each)
    assert_heldout_case_matches_dense(case)
