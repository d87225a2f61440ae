"""The search does not rank first a layout whose model-axis rule splits a small side dim (every
rank of the model axis still doing the whole model's work), nor list one whose mesh has an axis
that splits nothing (a smaller mesh in disguise): the plain layout that leaves the axis replicated
is priced as the reference, a side-dim split that saves less than the cost model resolves over it
is not listed either, and a rule predicted to save less than that ranks after the simpler layout
without it."""
import pytest

import meshdsl as md
from meshdsl.search.calibrate import Calibration
from meshdsl.search.search import RESOLUTION, search
from meshdsl.search.space import idle_axes


def _rules(c):
    return frozenset(filter(None, c.layout.split("; ")))


@pytest.mark.slow   # (4 s: a whole search)
def test_a_side_dim_split_over_the_model_axis_ranks_after_the_plain_layout():
    # tiny DiT: d_cond, freq and classes are small side dims; on 4 processes splitting one of
    # them over 'model' beside 'batch:data' used to rank first.
    model = md.load_model("tests/heldout_dit.py", tiny=True)
    result = search(model, model.train_step(), 4, Calibration.defaults())
    best = result.ranked[0].candidate
    # (was 'data:2; model:2' with 'batch:data' alone, then with 'd_cond:model' beside it)
    assert (best.mesh, best.layout) == ("data:4", "batch:data"), best
    assert all(idle_axes(r.candidate) == [] for r in result.ranked), "an axis that splits nothing is listed"
    dropped = {(c.mesh, c.layout): why for c, why in result.invalid}
    assert "splits nothing" in dropped[("data:2; model:2", "batch:data")]
    for side in ("d_cond:model", "freq:model", "classes:model"):
        assert "smaller mesh in disguise" in dropped[("data:2; model:2", f"batch:data; {side}")], side
    # Where a side-dim split is all a mesh gets, the table says so: on 'model:4' splitting d_cond
    # leaves each rank about the whole model's compute; Megatron beside data parallel does not.
    by = {(r.candidate.mesh, r.candidate.layout): r for r in result.ranked if r.candidate.microbatches == 1}
    assert result.replicates(by[("model:4", "d_cond:model")])
    assert not result.replicates(by[("data:2; model:2", "batch:data; heads:model; d_ff:model")])
    assert not result.replicates(by[("data:4", "batch:data")])
    # No candidate ranks before a strict subset of its rules (same mesh and pipeline) that it is
    # not predicted faster than by more than the resolution.
    place = {id(r): i for i, r in enumerate(result.ranked)}
    for r in result.ranked:
        c = r.candidate
        for s in result.ranked:
            d = s.candidate
            if (d.mesh, d.microbatches, d.schedule) == (c.mesh, c.microbatches, c.schedule) and \
                    _rules(d) < _rules(c) and r.prediction.step_s * (1 + RESOLUTION) >= s.prediction.step_s:
                assert place[id(s)] < place[id(r)], (c, d)
