"""Held-out models of round 13a (written from the README and docs alone): efficient attention,
recurrent memory and self-supervised losses over the examples.

``tests/heldout_linformer.py`` (a Linformer encoder: keys and values projected along ``seq`` by a
learned ``[seq, proj]`` matrix per layer, an einsum contracting ``seq``, then fused non-causal
attention over ``proj``); ``tests/heldout_lshattn.py`` (Reformer-style LSH attention: shared QK,
bucket ids by ``md.argmax`` of ``[xR, -xR]`` for a fixed random rotation, the scores masked to
equal buckets by ``md.equal`` in an ``md.where``, a relu FFN, a ``md.repeat`` stack);
``tests/heldout_xlstm.py`` (mLSTM blocks: an exponential input gate and a sigmoid forget gate over
a matrix memory, in the parallel form with cumulative log forget gates by ``md.cumsum``, or as the
recurrence itself, a ``md.repeat`` over ``seq`` nested in the block); ``tests/heldout_barlow.py``
(Barlow Twins: two noisy views, batch norm over the examples, the cross-correlation by an einsum
over the examples, on- and off-diagonal terms); ``tests/heldout_swav.py`` (SwAV: normalised
prototypes, 3 Sinkhorn-Knopp iterations over examples and prototypes under ``md.stop_gradient``,
the swapped-prediction cross entropy). Each runs under data, tensor, sequence/feature, uneven
3-way, 2x2, FSDP, micro-batched, pipeline (1f1b, zbh1, interleaved:2) and remat layouts against
the dense program. Findings: /work/notes/heldout-13a.md.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import meshdsl as md
from conftest import (assert_heldout_case_matches_dense, assert_search_top_layouts_match_dense, heldout_case_id,
                      heldout_outputs, run_cli)

HERE = Path(__file__).parent
LINFORMER, LSHATTN, XLSTM, BARLOW, SWAV = (
    str(HERE / f"heldout_{n}.py") for n in ("linformer", "lshattn", "xlstm", "barlow", "swav"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}
ZBH1 = {"microbatches": 2, "schedule": "zbh1"}
INTERLEAVED = {"microbatches": 2, "schedule": "interleaved:2"}
MB = {"microbatches": 2}
REC = {"form": "recurrent"}
STACKED = {"views": "stacked"}

# (model, config overrides, mesh, layout, compile keywords)
CASES = [
    (LINFORMER, {}, "model:3", "seq:model"),                                 # E contracts an uneven seq
    (LSHATTN, {}, "model:2", "seq:model"),                                   # bucket ids of the gathered keys
    (XLSTM, {}, "model:3", "seq:model"),                                     # cumsum of log gates over an uneven seq
    (XLSTM, REC, "stage:2", "layer:stage", PIPE),                            # a recurrence in a pipelined stack
    (BARLOW, {}, "data:3", "ex:data"),                                       # batch norm and correlation over uneven ex
    (SWAV, {}, "data:2; model:2", "ex:data; proto:model"),                   # Sinkhorn's sums over split ex and protos
]

# more of the same kinds, with -m slow
SLOW_CASES = [
    (LINFORMER, {}, "data:2", "batch:data"),
    (LINFORMER, {}, "model:2", "heads:model; ff:model"),
    (LINFORMER, {}, "model:2", "seq:model"),
    (LINFORMER, {}, "model:2", "proj:model"),
    (LINFORMER, {}, "model:2", "d:model"),
    (LINFORMER, {}, "model:3", "ff:model; proj:model"),
    (LINFORMER, {}, "model:2", "vocab:model; tag:model"),
    (LINFORMER, {}, "data:2; model:2", "batch:data; heads:model; ff:model"),
    (LINFORMER, {}, "data:2; model:2", "seq:(data,model)"),
    (LINFORMER, {}, "data:2", "batch:data; params.d:data"),
    (LINFORMER, {}, "stage:2", "layer:stage", PIPE),
    (LINFORMER, {}, "stage:2; model:2", "layer:stage; proj:model", ZBH1),
    (LINFORMER, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (LINFORMER, {"remat": "full"}, "stage:2; model:2", "layer:stage; seq:model", PIPE),
    (LINFORMER, {"remat": "selective"}, "model:2", "heads:model"),
    (LINFORMER, {}, "data:2", "batch:data", MB),
    (LSHATTN, {}, "data:2", "batch:data"),
    (LSHATTN, {}, "model:2", "heads:model; ff:model"),
    (LSHATTN, {}, "model:2", "key_seq:model"),
    (LSHATTN, {}, "model:2", "bucket:model"),                                # argmax over a split, concatenated dim
    (LSHATTN, {}, "model:3", "bucket:model"),
    (LSHATTN, {}, "model:2", "dh:model"),
    (LSHATTN, {}, "model:2", "d:model"),
    (LSHATTN, {}, "model:3", "seq:model"),
    (LSHATTN, {}, "model:4", "seq:model"),
    (LSHATTN, {}, "data:2; model:2", "batch:data; seq:model", MB),
    (LSHATTN, {}, "data:2", "batch:data; params.d:data"),
    (LSHATTN, {}, "stage:2", "layer:stage", PIPE),
    (LSHATTN, {}, "stage:2", "layer:stage", ZBH1),
    (LSHATTN, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (LSHATTN, {"remat": "full"}, "stage:2; model:2", "layer:stage; seq:model", PIPE),
    (LSHATTN, {"remat": "selective"}, "stage:2; model:3", "layer:stage; seq:model", ZBH1),
    (XLSTM, {}, "data:2", "batch:data"),
    (XLSTM, {}, "model:2", "heads:model"),
    (XLSTM, {}, "model:2", "seq:model"),
    (XLSTM, {}, "model:4", "seq:model"),
    (XLSTM, {}, "model:2", "key_seq:model"),
    (XLSTM, {}, "model:3", "out:model; dh:model"),
    (XLSTM, {}, "data:2; model:2", "seq:(data,model)"),
    (XLSTM, {}, "data:2", "batch:data; params.d:data"),
    (XLSTM, {}, "stage:2", "layer:stage", ZBH1),
    (XLSTM, {"layers": 4}, "stage:2; model:2", "layer:stage; seq:model", INTERLEAVED),
    (XLSTM, {"remat": "full"}, "stage:2; model:2", "layer:stage; seq:model", PIPE),
    (XLSTM, {"remat": "selective"}, "model:2", "seq:model"),
    (XLSTM, REC, "data:2", "batch:data", MB),
    (XLSTM, REC, "model:2", "heads:model"),
    (XLSTM, REC, "model:3", "dh:model"),
    (XLSTM, REC, "model:4", "cv:model"),                                     # the carry's C | n | m columns split
    (XLSTM, {**REC, "layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (XLSTM, {**REC, "remat": "full"}, "stage:2; model:2", "layer:stage; heads:model", ZBH1),
    (BARLOW, {}, "data:2", "ex:data"),
    (BARLOW, {}, "data:4", "ex:data"),
    (BARLOW, {}, "model:2", "hid:model"),
    (BARLOW, {}, "model:3", "emb:model; emb2:model"),
    (BARLOW, {}, "data:2; model:2", "ex:(data,model)"),
    (BARLOW, {}, "data:2; model:2", "ex:data; emb:model"),
    (BARLOW, {}, "data:2", "ex:data; params.d:data"),
    (BARLOW, {}, "data:2", "ex:data", MB),                                   # whole-batch stats under micro-batches
    (BARLOW, {}, "model:2", "emb:model", {"microbatches": 4}),
    (BARLOW, STACKED, "data:2", "view:data", MB),
    (BARLOW, {"remat": "full"}, "data:2", "ex:data"),
    (BARLOW, {"remat": "selective"}, "data:2; model:2", "ex:data; hid:model"),
    (SWAV, {}, "data:2", "ex:data"),
    (SWAV, {}, "data:3", "ex:data"),
    (SWAV, {}, "model:3", "proto:model"),
    (SWAV, {}, "model:2", "emb:model"),
    (SWAV, {}, "model:3", "ex:model; proto:model"),
    (SWAV, {}, "data:2; model:2", "ex:(data,model)"),
    (SWAV, {}, "data:2", "ex:data; params.d:data"),
    (SWAV, {}, "data:2; model:2", "ex:data; proto:model", MB),
    (SWAV, STACKED, "data:2", "view:data", MB),
    (SWAV, {"remat": "full"}, "data:2", "ex:data"),
    (SWAV, {"remat": "selective"}, "model:2", "hid:model"),
]


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[heldout_case_id(c) for c in CASES + SLOW_CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


def test_the_two_mlstm_forms_and_the_two_view_forms_compute_the_same_loss():
    """The xLSTM's parallel form and its recurrence, and Barlow Twins' and SwAV's encoder called
    once per view or once on both views stacked, give the same loss (dense)."""
    def loss(path, **over):
        m = md.load_model(path, tiny=True, **over)
        return float(md.run_dense({"l": m.loss}, m.feeds(0))["l"])

    # the same sums in another order (a quadratic form against a running state): fp32, ~1e-7 relative
    assert loss(XLSTM, form="recurrent") == pytest.approx(loss(XLSTM), rel=1e-5)
    for path in (BARLOW, SWAV):
        assert loss(path, views="stacked") == pytest.approx(loss(path), rel=1e-5)


@pytest.mark.parametrize("over, words", [({}, "more than one repeat is pipelined"),
                                         (STACKED, "reduces over the whole batch")],
                         ids=["two-repeats", "stacked"])
def test_swav_pipelined_is_refused_with_the_fix(over, words, capsys):
    """SwAV's codes are Sinkhorn sums over every example of the encoder's output: a pipeline's
    backward of one micro-batch would need every micro-batch's forward, so ``meshdsl check``
    refuses it (exit 2), saying why; with one encoder call per view it first refuses two repeats
    pipelined over one layer dim, naming the one-repeat fix."""
    argv = ["check", SWAV, "--tiny", "--mesh", "stage:2", "--layout", "layer:stage", "--microbatches", "2",
            "--schedule", "1f1b", *(["--config", "views=stacked"] if over else [])]
    code, out, err = run_cli(capsys, argv)
    assert code == 2 and words in err and "Fix:" in err, out + err


def test_the_recurrent_xlstm_gathers_an_uneven_split_seq():
    """The recurrent xLSTM's steps over ``seq`` are a repeat inside a block: under ``seq:model``
    over 3 ranks (8 over 3, uneven) it was refused, first as a pipeline's layer count, then with
    the inner-repeat rule; now the recurrence gathers ``seq``, and the plan notes the uneven split
    and the gather (the dense numbers: ``tests/test_inner_repeat_split.py``)."""
    model = md.load_model(XLSTM, tiny=True, form="recurrent")
    notes = md.compile(heldout_outputs(model), "model:3", "seq:model").notes
    assert any(n.startswith("uneven split: 'seq' (8) over model:3: parts 3, 3, 2") for n in notes), notes
    assert any("scans 'seq', split over model:3" in n and "gathered whole" in n for n in notes), notes


@pytest.mark.slow
def test_the_cli_checks_the_recurrent_xlstm_pipelined_on_two_processes(capsys):
    """``meshdsl check --nproc 2`` on the xLSTM's recurrence, its stack pipelined over 2 gloo processes."""
    code, out, err = run_cli(capsys, ["check", XLSTM, "--tiny", "--config", "form=recurrent", "--mesh", "stage:2",
                                      "--layout", "layer:stage", "--microbatches", "2", "--schedule", "1f1b",
                                      "--nproc", "2"])
    assert code == 0 and "OK:" in out, out + err


@pytest.mark.slow
@pytest.mark.parametrize("path", [LINFORMER, LSHATTN, XLSTM, BARLOW, SWAV],
                         ids=["linformer", "lshattn", "xlstm", "barlow", "swav"])
def test_the_searchs_top_layouts_match_dense(path, monkeypatch, tmp_path):
    """``md.search_layouts`` on 4 processes (the default calibration): its three best candidates
    compile and give the dense program's loss and gradients."""
    assert_search_top_layouts_match_dense(path, monkeypatch, tmp_path)
