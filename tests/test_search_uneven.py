"""The layout search proposes uneven splits (meshdsl/search/dims.py, space.py, estimate.py).

A dim an axis does not divide (vocab 257 on ``model:2`` or ``model:4``, heads 6 on ``model:4``,
batch 10 on ``data:4``) is split unevenly (meshdsl/lowering/uneven.py): the search keeps or prunes
it by the same estimate as the others, which prices its largest part (the waste of the split),
``--explain`` says so, and ``--strict-splits`` leaves such splits out.  Calibrations are read
from a per-test cache folder, so these tests price with the uncalibrated defaults.
"""
from __future__ import annotations

import json
import re

import pytest

import meshdsl as md
from meshdsl.search.calibrate import Calibration
from meshdsl.search.dims import Splits
from meshdsl.search.estimate import Profile, Work, estimate
from meshdsl.search.search import search
from meshdsl.search.space import Candidate, indivisible

from conftest import run_cli


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHDSL_CACHE_DIR", str(tmp_path))


@pytest.fixture(scope="module")
def odd():
    """The tiny transformer with a vocab of 257 and 6 heads: neither divides by 4."""
    model = md.load_model("transformer", tiny=True, vocab=257, heads=6)
    return model, model.train_step(0.01)


def _rules(layout: str) -> set[str]:
    return set(filter(None, layout.split("; ")))


def test_an_odd_vocab_gets_candidates_splitting_it_and_strict_splits_leave_them_out(odd):
    model, outs = odd
    cal = Calibration.defaults()
    lax = search(model, outs, 2, cal, split_dims=("vocab",))
    split = [r.candidate for r in lax.ranked if "vocab:model" in _rules(r.candidate.layout)]
    assert any(c.mesh == "model:2" for c in split), [r.candidate.layout for r in lax.ranked]
    strict = search(model, outs, 2, cal, split_dims=("vocab",), strict_splits=True)
    assert strict.ranked and not any("vocab" in r.candidate.layout for r in strict.ranked)
    # strict: the vocab candidates are invalid, named so; lax: none is refused for its vocab
    assert any("vocab:model" in c.layout and "'vocab' of size 257 is not divisible by 2" in why
               for c, why in strict.invalid)
    assert not any("vocab" in str(why) for _, why in lax.invalid)


def test_the_verdicts_say_what_an_uneven_split_wastes(odd):
    model, outs = odd
    why = {v.split: v for v in Splits.of(model, outs, Calibration.defaults(), 4, False).verdicts("model", 4)}
    # 257 = 65 + 3 x 64: the largest part is 65 * 4 / 257 - 1 = 1.2% over an even share
    assert why["vocab"].why.startswith("kept (uneven split 257/4: parts of 65 and 64, the largest 1.2% over an "
                                       "even share): est.")
    assert "uneven split 6/4: parts of 2 and 1, the largest 33.3% over an even share" in why["heads"].why
    assert why["d_head"].why == "not divisible: size 2 by 4"     # a part would be empty: never split
    strict = {v.split: v for v in Splits.of(model, outs, Calibration.defaults(), 4, False,
                                            strict=True).verdicts("model", 4)}
    assert not strict["vocab"].kept
    assert strict["vocab"].why == "not divisible: size 257 by 4 (strict splits: no uneven split)"


def test_the_estimate_prices_the_largest_part():
    # one elementwise kernel over a dim of 5 split 4 ways: parts 2, 1, 1, 1, so every rank
    # takes as long as 2/5 of the whole, not 1/4
    work = Work(runs=1, dims=frozenset({"d"}), fixed=frozenset(), reduce=frozenset(), matmul=False, flops=0,
                ins=((frozenset({"d"}), 4000),), outs=((("d",), ("d",), 4000),))
    cal = Calibration.defaults()
    whole = estimate(Profile((work,), {"d": 5}, (), {}), (), 4, cal, 4).compute_s
    uneven = estimate(Profile((work,), {"d": 5}, (), {}), ("d",), 4, cal, 4).compute_s
    even = estimate(Profile((work,), {"d": 8}, (), {}), ("d",), 4, cal, 4).compute_s
    assert uneven == pytest.approx(whole * 2 / 5) and even == pytest.approx(whole / 4)


def test_which_uneven_splits_the_space_keeps():
    dims = {"batch": 10, "vocab": 257, "layer": 3, "d_head": 2}
    assert indivisible(Candidate("data:4", "batch:data"), dims) is None
    assert indivisible(Candidate("model:4", "vocab:model"), dims) is None
    assert "'vocab' of size 257" in indivisible(Candidate("model:4", "vocab:model"), dims, strict=True)
    # the micro-batches cut the batch evenly; a repeat's stages run whole layers; no part is empty
    assert "'batch' of size 10" in indivisible(Candidate("data:2", "batch:data", microbatches=2), dims)
    assert "'layer' of size 3" in indivisible(Candidate("pipe:2", "layer:pipe", 2), dims, layers=("layer",))
    assert "'d_head' of size 2" in indivisible(Candidate("model:4", "d_head:model"), dims)


def test_explain_names_the_uneven_split_and_the_proposed_one_checks_against_dense(capsys):
    argv = ["search", "transformer", "--tiny", "--config", "vocab=257", "--nproc", "2", "--split-dims", "vocab"]
    rc, out, _ = run_cli(capsys, argv + ["--explain"])
    assert rc == 0
    line = next(l for l in out.splitlines() if l.split()[:1] == ["vocab"])
    assert "uneven split 257/2: parts of 129 and 128, the largest 0.4% over an even share" in line
    # where it ended: in the winner, or the best candidate with it
    at = re.search(r"; best with it: #\d+ '([^']+)' '([^']+)'", line)
    if at is None:
        assert line.endswith("; in the winner"), line
        at = re.search(r"^best: --mesh '([^']+)' --layout '([^']+)'", out, re.M)
    mesh, layout = at.groups()
    assert "vocab:model" in _rules(layout)
    rc, _, err = run_cli(capsys, ["check", "transformer", "--tiny", "--config", "vocab=257", "--mesh", mesh,
                                  "--layout", layout])
    assert rc == 0, err
    rc, out, _ = run_cli(capsys, argv + ["--json", "--top", "1000", "--strict-splits"])
    assert rc == 0 and not any("vocab" in r["layout"] for r in json.loads(out))
