"""The search sees every dim (meshdsl/search/dims.py, estimate.py): a dim no list names is split,
the costly ones are pruned with their figure, and users name dims it may or may not split.

The model is tests/gqa_tiny.py, a grouped-query attention whose key/value heads are
``kv_heads`` (with ``group`` query heads each).  Calibrations are read from a per-test cache
folder, so these tests price with the uncalibrated defaults.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import meshdsl as md
from meshdsl.errors import LayoutError
from meshdsl.lowering.compiler import compile as compile_plan
from meshdsl.search.calibrate import Calibration
from meshdsl.search.dims import Splits
from meshdsl.search.estimate import estimate, profile
from meshdsl.search.predict import process_totals
from meshdsl.search.search import search
from meshdsl.tools.cli import main

GQA = str(Path(__file__).parent / "gqa_tiny.py")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHDSL_CACHE_DIR", str(tmp_path))


def _rules(layout: str) -> set[str]:
    return set(filter(None, layout.split("; ")))


def test_kv_heads_is_split_on_four_processes_and_the_split_matches_dense(capsys):
    assert main(["search", GQA, "--nproc", "4", "--json", "--top", "1000"]) == 0
    rows = json.loads(capsys.readouterr().out)
    split = [r for r in rows if "kv_heads:model" in _rules(r["layout"])]
    assert split, [r["layout"] for r in rows]
    assert {r["mesh"] for r in split} >= {"model:4", "data:2; model:2"}
    best = split[0]   # the best-ranked kv_heads split runs and gives the dense program's numbers
    argv = ["check", GQA, "--mesh", best["mesh"], "--layout", best["layout"]]
    if "microbatches" in best:
        argv += ["--microbatches", str(best["microbatches"]), "--schedule", best["schedule"]]
    assert main(argv) == 0, capsys.readouterr()


@pytest.mark.slow  # 7 s: a whole llama search; the search on a small GQA model above lists the kv_heads splits and checks the best
def test_the_llama_search_lists_kv_heads_splits(capsys):
    """The issue's check as a user types it: --json lists every ranked candidate."""
    assert main(["search", "llama", "--nproc", "4", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) > 10 and any("kv_heads:model" in _rules(r["layout"]) for r in rows)


def test_the_dims_come_from_the_graph_and_its_repeat_blocks():
    model = md.load_model(GQA)
    prof = profile(model.train_step(0.01))
    # key_seq exists only inside the repeat block (a rename of seq), yet it is a dim of the space
    assert "key_seq" not in {d for p in model.params.values() for d in p.shape.names}
    assert set(prof.dims) == {"batch", "seq", "key_seq", "d_model", "kv_heads", "group", "d_head", "d_ff", "layer"}
    assert prof.layer_dims == ("layer",)
    splits = Splits.of(model, model.train_step(0.01), Calibration.defaults(), 4, False)
    why = {v.split: v for v in splits.verdicts("model", 4)}
    assert why["kv_heads"].kept and why["kv_heads"].why.startswith("kept: est.")
    assert why["group"].why == "not divisible: size 2 by 4" and not why["group"].kept
    pair = {v.split: v for v in splits.verdicts("model", 2)}["kv_heads+group"]   # q holds both
    assert not pair.kept and re.fullmatch(r"conflict: tensor '\w+' \[[\w ]*kv_heads group[\w ]*\] holds both", pair.why)
    assert "batch" not in why and "layer" not in why   # the data and pipe axes' dims


@pytest.mark.parametrize("dim", ["batch", "d_model", "d_ff"])
def test_on_an_mlp_the_estimate_moves_what_the_compiled_plan_moves(dim):
    """The estimate prices the generic rule's moves without compiling: on the MLP (no lazy
    sums to exploit, no fused rules) its bytes are exactly the plan's."""
    model = md.load_model("mlp", tiny=True)
    outs = model.train_step(0.01)
    est = estimate(profile(outs), (dim,), 2, Calibration.defaults(), 2)
    plan = compile_plan(outs, "model:2", f"{dim}:model")
    assert est.comm_bytes == sum(t["bytes"] for t in process_totals(plan).values()) > 0


def test_explain_shows_a_dim_pruned_by_cost_with_its_figure(capsys):
    assert main(["search", "transformer", "--tiny", "--nproc", "2", "--explain"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\d+ candidates \(exhaustive search, \d+ compiled, [1-9]\d* pruned by cost", out)
    line = next(l for l in out.splitlines() if re.match(r"\s+d_model\s", l) and "pruned by cost" in l)
    est, bar = map(float, re.search(r"pruned by cost: est\. ([\d.]+) ms: .*, over ([\d.]+) ms", line).groups())
    assert est > bar, line    # pruned because it costs more than the dims kept
    assert re.search(r"^\s+seq\+d_ff\s+conflict: tensor '[^']+' \[batch seq d_ff\] holds both$", out, re.M)
    assert re.search(r"^\s+\S+\s+(seed|kept)[^\n]*; in the winner$", out, re.M)


def test_split_dims_and_no_split_steer_the_search():
    model = md.load_model(GQA)
    outs, cal = model.train_step(0.01), Calibration.defaults()
    # Named: the GQA Megatron pair is kept whatever its estimate, and ranked
    named = search(model, outs, 2, cal, split_dims=("kv_heads", "d_ff"))
    pair = {"kv_heads:model", "d_ff:model"}
    assert any(pair <= _rules(r.candidate.layout) for r in named.ranked)
    (both,) = [v for v in named.splits.verdicts("model", 2) if set(v.split.split("+")) == {"kv_heads", "d_ff"}]
    # (the graph shows this pair is the Megatron one, search/dims.py megatron_dims: a seed already)
    assert both.kept and both.why.startswith(("named by split_dims: est.", "seed: Megatron, est."))
    # Excluded: no axis and no scope splits it
    none = search(model, outs, 2, cal, no_split=("kv_heads",))
    assert none.ranked and not any("kv_heads" in r.candidate.layout for r in none.ranked)
    assert not any("kv_heads" in c.layout for c, _ in none.invalid + none.by_cost)
    with pytest.raises(LayoutError, match="'kv_head' is not a dim of the model. Did you mean 'kv_heads'"):
        search(model, outs, 2, cal, no_split=("kv_head",))
    with pytest.raises(LayoutError, match="'d_ff' is both in split_dims and in no_split"):
        search(model, outs, 2, cal, split_dims=("d_ff",), no_split=("d_ff",))


def test_an_unknown_dim_on_the_command_line_is_a_clean_usage_error(capsys):
    assert main(["search", GQA, "--nproc", "2", "--split-dims", "kv_heads,d_f"]) == 2
    err = capsys.readouterr().err
    assert "'d_f' is not a dim of the model. Did you mean 'd_ff'?" in err and "Traceback" not in err
