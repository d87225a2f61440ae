"""Held-out models of round 9c (written from the README and docs alone): a new user's own dim names.

``tests/heldout_nanogpt.py`` (nanoGPT's letters: ``B T C nh hs F V L``);
``tests/heldout_hfbert.py`` (Hugging Face's config names: ``batch_size seq_len hidden_size
num_heads intermediate_size vocab_size num_layers``, a fed attention mask, a masked-LM loss);
``tests/heldout_nchw.py`` (a ResNet in ``n c h w`` with ``md.conv``, its stack over ``blocks``);
``tests/heldout_resmlp.py`` (a residual MLP regressor over ``examples``, its stack over ``depth``,
its own data by rows); ``tests/heldout_moe_e.py`` (a Mixtral-style MoE: ``bsz seqlen dim``, experts
``e``, ``experts_per_tok`` picks); ``tests/heldout_torchenc.py`` (``torch.nn.TransformerEncoder``'s
``N L E n_head ffn``, layers as a Python loop). Each under data, tensor, FSDP, sequence, spatial and
pipeline layouts on the user's names, loss and gradients against the dense program.

What the round led to: the search's data axis, its micro-batches and pipelines, ``meshdsl train
--nproc N``, ``auto`` meshes and a model's ``batches(seed, rows)`` all took the examples' dim to be
the one named ``batch`` (nanoGPT's ``B`` got no data parallelism, no FSDP, no pipeline from the
search, and micro-batches were refused); the sequence-parallel seed took ``seq`` by name, expert
parallelism ``experts``. The
examples' dim is now read off the graph (``core/examples.py``: ``batch`` where a tensor has it,
else the input dim no param holds), the sequence seed is the dim a rename makes the keys of, the
expert seed the dim a dispatch's rename makes where it renames the examples away:
the search ranks nanoGPT's letters exactly as the same model under the README's names.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import assert_heldout_case_matches_dense, assert_search_top_layouts_match_dense, heldout_case_id
from meshdsl.core.examples import examples_dim
from meshdsl.search.calibrate import Calibration
from meshdsl.search.dims import Splits

HERE = Path(__file__).parent
NANO, HF, NCHW, RES, MOE, TORCH = (str(HERE / f"heldout_{n}.py") for n in
                                   ("nanogpt", "hfbert", "nchw", "resmlp", "moe_e", "torchenc"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}

# (model, config overrides, mesh, layout[, compile keywords])
CASES = [
    (NANO, {}, "data:2; model:2", "B:data; nh:model; F:model"),
    (NANO, {}, "stage:2; data:2", "L:stage; B:data", {"microbatches": 2, "schedule": "zbh1"}),
    (HF, {}, "data:2; model:2", "batch_size:data; num_heads:model; intermediate_size:model"),
    (HF, {}, "model:2", "seq_len:model"),                                # the fed mask and the keys split
    (HF, {}, "stage:2", "num_layers:stage", PIPE),
    (NCHW, {}, "data:2", "h:data"),                                      # spatial: conv halos over h
    (NCHW, {}, "model:2", "c2:model"),
    (NCHW, {}, "stage:2", "blocks:stage", {"microbatches": 2, "schedule": "gpipe"}),
    (RES, {}, "data:2; model:2", "examples:data; expand:model"),
    (RES, {}, "stage:2", "depth:stage", {"microbatches": 2, "schedule": "interleaved:2"}),
    (MOE, {}, "data:2; model:2", "bsz:data; e:model"),                   # the experts split
    (MOE, {}, "stage:2; data:2", "n_layers:stage; bsz:data", PIPE),
    (TORCH, {}, "data:2", "N:data; params.E:data"),
    (RES, {"examples": 6}, "data:4", "examples:data"),                   # 6 on 4, uneven
    (TORCH, {}, "data:2", "N:data", {"microbatches": 2}),
]


@pytest.mark.parametrize("case", CASES, ids=[heldout_case_id(c) for c in CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


@pytest.mark.parametrize("path,want", [(NANO, "B"), (HF, "batch_size"), (NCHW, "n"), (RES, "examples"),
                                       (MOE, "bsz"), (TORCH, "N")], ids=lambda v: Path(str(v)).stem)
def test_the_examples_dim_is_read_off_the_graph(path, want):
    """The input dim that no param holds (the most inputs hold it; leftmost on a tie: ``[B, T]``
    where no param holds ``T`` either)."""
    assert examples_dim([md.load_model(path, tiny=True).loss]) == want


def test_the_search_offers_every_family_on_nanogpts_letters():
    """DP, FSDP on the largest param dim, Megatron's pair, sequence parallel and the pipeline,
    found from the graph on ``B T C nh hs F L``: none of them named ``batch``, ``seq``, ``heads``."""
    model = md.load_model(NANO, tiny=True)
    splits = Splits.of(model, model.train_step(0.01), Calibration.defaults(), 4, stateful=False)
    data = {o.rules for o in splits.options("data", 2)}
    assert {"B:data", "B:data; params.C:data"} <= data, data
    assert set(splits.megatron) == {"nh", "F"}
    model_axis = {o.rules: o.pruned for o in splits.options("model", 2)}
    assert model_axis["T:model"] is None, model_axis                    # the sequence-parallel seed
    assert "B:model" not in model_axis                                  # the examples stay on data
    pipe = {(o.rules, o.microbatches, o.schedule) for o in splits.options("pipe", 2, per_replica=4)}
    assert ("L:pipe", 2, "1f1b") in pipe and ("L:pipe", 4, "zbh1") in pipe


def _ranked(usual: bool, nproc: int) -> dict:
    model = md.load_model(NANO, tiny=True, usual_names=usual)
    names = {} if usual else __import__("heldout_nanogpt").USUAL
    out = {}
    for r in md.search_layouts(model, model.train_step(0.01), nproc, Calibration.defaults()).ranked:
        c = r.candidate
        layout = "; ".join(sorted(re.sub(r"\w+", lambda m: names.get(m.group(), m.group()), c.layout).split("; ")))
        out[(c.mesh, layout, c.microbatches, c.schedule)] = r.prediction.step_s
    return out


def test_the_search_ranks_nanogpts_letters_as_the_usual_names():
    """The same graph under ``B T C nh hs F V L`` and under ``batch seq d_model heads d_head d_ff
    vocab layer``: the same candidates, each with the same predicted step, on 2 processes."""
    letters, usual = _ranked(False, 2), _ranked(True, 2)
    assert letters.keys() == usual.keys(), (letters.keys() ^ usual.keys())
    for k, t in usual.items():
        assert letters[k] == pytest.approx(t, rel=1e-9), k           # one cost model, one graph
    assert min(usual, key=usual.get) == ("data:2", "batch:data", 1, "gpipe")


def test_the_search_cli_ranks_the_users_names(capsys, monkeypatch, tmp_path):
    """``meshdsl search --json`` on ``N L E``: data parallel on ``N`` first, and Megatron's pair
    ``n_head`` + ``ffn`` among the ranked layouts."""
    from meshdsl.tools import cli
    monkeypatch.setenv("MESHDSL_CACHE_DIR", str(tmp_path))
    assert cli.main(["search", TORCH, "--tiny", "--nproc", "2", "--json"]) == 0
    ranked = json.loads(capsys.readouterr().out)
    assert ranked[0]["layout"] == "N:data", ranked[:3]
    assert any(r["layout"] in ("n_head:model; ffn:model", "ffn:model; n_head:model") for r in ranked)


@pytest.mark.slow   # 4-8 s each: a search on 4 processes, then its top 3 checked
@pytest.mark.parametrize("path", [NANO, HF, NCHW, RES, MOE, TORCH], ids=lambda p: Path(p).stem)
def test_the_searchs_top_layouts_match_dense(path, monkeypatch, tmp_path):
    assert_search_top_layouts_match_dense(path, monkeypatch, tmp_path)


def test_micro_batches_that_do_not_divide_name_the_users_dim():
    model = md.load_model(NANO, tiny=True)
    with pytest.raises(md.LayoutError) as e:
        md.compile({"loss": model.loss}, "data:2", "B:data", microbatches=3)
    text = str(e.value)
    assert "the examples' dim 'B' 4 is not divisible by 3 micro-batches x 2" in text, text
    assert "Fix: use a B that is a multiple of 6" in text, text


def test_train_nproc_without_a_mesh_is_data_parallel_over_the_users_examples_dim():
    from meshdsl.tools import cli
    from meshdsl.tools.train_cli import make_spec
    args = cli.build_parser().parse_args(["train", NANO, "--tiny", "--nproc", "2", "--steps", "1"])
    spec, lines, _ = make_spec(args)
    assert (spec.mesh, spec.layout) == ("data:2", "B:data"), lines[0]


def test_fit_builds_each_ranks_rows_of_the_users_examples_dim(tmp_path):
    """A model's ``batches(seed, rows)`` is asked for each data rank's rows of ``examples`` (it was
    asked for every row on each rank), and the losses are the one-rank run's."""
    model = md.load_model(RES, tiny=True)
    asked = []

    def spy(seed, rows=None):
        asked.append(rows)
        return model.batches(seed, rows)

    two = md.fit(dataclasses.replace(model, batches=spy), mesh="data:2", layout="examples:data", steps=2,
                 lr=0.01, out=str(tmp_path / "two"), eval_every=0)
    assert {(r.start, r.stop) for r in asked if r is not None} == {(0, 4), (4, 8)} and None not in asked
    one = md.fit(model, mesh="data:1", layout="", steps=2, lr=0.01, out=str(tmp_path / "one"), eval_every=0)
    # the mean over 8 rows summed as two halves: fp32 rounding, ~1e-7 of the loss
    torch.testing.assert_close(torch.tensor([r["loss"] for r in two.rows]),
                               torch.tensor([r["loss"] for r in one.rows]), rtol=1e-5, atol=0)


def _dispatch_moe() -> md.Model:
    """A Mesh-TensorFlow-style expert layer in a user's names: the dispatch renames ``g -> ex``
    and the examples ``toks -> ex_toks`` in one go (the moves expert parallelism makes alltoalls)."""
    toks, g, width, hid, ex = (md.Dim(n, s) for n, s in (("toks", 8), ("g", 2), ("width", 4), ("hid", 6), ("ex", 2)))
    with md.Graph() as graph:
        x = md.input("x", [toks, width])
        w_gate = md.param("w_gate", [width, g], fan_out=["g"])
        w_in = md.param("w_in", [ex, width, hid], fan_out=["ex", "hid"])
        w_out = md.param("w_out", [ex, hid, width], fan_out=["ex", "width"])
        gates = md.softmax(md.einsum("toks width, width g -> toks g", x, w_gate), "g")
        xin = md.rename(md.einsum("toks width, toks g -> g toks width", x, gates), g="ex", toks="ex_toks")
        h = md.gelu(md.einsum("ex ex_toks width, ex width hid -> ex ex_toks hid", xin, w_in))
        y = md.rename(md.einsum("ex ex_toks hid, ex hid width -> ex ex_toks width", h, w_out), ex="g", ex_toks="toks")
        loss = md.reduce_mean(md.reduce_sum(y, "g") ** 2)
    return md.Model(graph, loss, {"w_gate": w_gate, "w_in": w_in, "w_out": w_out},
                    lambda seed: {"x": torch.randn(8, 4, generator=torch.Generator().manual_seed(seed))})


def test_the_search_offers_expert_parallelism_on_the_dim_the_dispatch_makes():
    """Not by the name ``experts``: the dim a rename makes where it renames the examples away."""
    model = _dispatch_moe()
    splits = Splits.of(model, model.train_step(0.01), Calibration.defaults(), 2, stateful=False)
    assert "toks:data; ex:data" in {o.rules for o in splits.options("data", 2)}
    outs = {"loss": model.loss, **md.grad(model.loss, model.params)}
    assert md.check(outs, "data:2", "toks:data; ex:data", model.feeds(0)).ok
    assert md.compile(outs, "data:2", "toks:data; ex:data").totals()["alltoall"]["count"] == 4


def test_layout_auto_takes_a_mesh_in_the_users_axis_names(capsys, monkeypatch, tmp_path):
    """``--mesh 'stage:2; data:2' --layout auto`` (the README's pipeline axis name): the search's
    ``pipe``/``data``/``model`` meshes matched onto the given axes by size (a role's own name keeps
    its role); it was 'no layout found'."""
    from meshdsl.tools import cli
    from meshdsl.tools.search_cli import _axes_onto
    mesh = md.Mesh.parse
    assert _axes_onto(mesh("pipe:2; data:2"), mesh("stage:2; data:2")) == {"pipe": "stage", "data": "data"}
    assert _axes_onto(mesh("pipe:2; data:2"), mesh("data:2; model:2")) is None     # data keeps its role
    assert _axes_onto(mesh("data:4"), mesh("stage:2; data:2")) is None
    monkeypatch.setenv("MESHDSL_CACHE_DIR", str(tmp_path))
    assert cli.main(["check", RES, "--tiny", "--mesh", "stage:2", "--layout", "auto"]) == 0
    out = capsys.readouterr().out
    assert "--layout auto: mesh 'stage:2', layout '" in out and "OK:" in out, out
