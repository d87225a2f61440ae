"""Held-out models of round 11c: training recipes and unusual losses (written from the README and
docs alone).

``tests/heldout_vitreg.py`` (a ViT with register tokens concatenated after the patches, LayerScale
on both residual branches and stochastic depth: a per-example drop-path mask made by
``md.dropout`` of a ``[batch]`` tensor of ones, or from a fed uniform against per-layer rates
stacked in the repeat); ``tests/heldout_byol.py`` (BYOL / MoCo v3 in the user's dim names: an
online encoder, projector and predictor, a frozen target encoder and projector behind
``md.stop_gradient``, the other view by ``md.roll``; a symmetric cosine loss, or InfoNCE over
the batch's keys); ``tests/heldout_ctc.py`` (a stride-2 conv + transformer encoder and the CTC
loss by its forward recursion in log space: an ``md.repeat`` over time steps whose stacked
tensors are the emissions and an ``active`` mask, the label sequence extended with blanks in the
graph); ``tests/heldout_softmoe.py`` (Soft MoE: dispatch softmax over the tokens, combine softmax
over every expert's slots, experts on an ``experts`` dim); ``tests/heldout_ssd.py`` (Mamba-2's
chunked SSD: an intra-chunk decay mask from ``md.cumsum``, chunk states passed on by an inner
``md.repeat`` over ``chunk`` or by a quadratic form over chunks). Each runs under data, tensor,
expert, sequence / time / label splits, FSDP, uneven 3-way splits, pipelines (1f1b, zbh1,
interleaved:2, one micro-batch, two stacks, the CTC recursion itself pipelined over its time
steps) and remat against the dense program. Findings and fixes: /work/notes/heldout-11c.md.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import (assert_heldout_case_matches_dense, assert_search_top_layouts_match_dense, heldout_case_id,
                      run_cli)

HERE = Path(__file__).parent
VITREG, BYOL, CTC, SOFTMOE, SSD = (
    str(HERE / f"heldout_{n}.py") for n in ("vitreg", "byol", "ctc", "softmoe", "ssd"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}
INTERLEAVED = {"microbatches": 4, "schedule": "interleaved:2"}

# (model, config overrides, mesh, layout, compile keywords)
CASES = [
    (VITREG, {}, "model:3", "tokens:model"),                                      # [cls; patches; registers] over 3
    (VITREG, {"drop": "input"}, "stage:2; data:2", "layer:stage; batch:data", {**PIPE, "schedule": "zbh1"}),
    (BYOL, {}, "data:2; model:2", "imgs:data; heads:model; hid:model"),
    (BYOL, {"loss": "moco"}, "stage:2", "layer:stage; t_layer:stage", {"microbatches": 1, "schedule": "1f1b"}),  # was a KeyError
    (CTC, {}, "model:3", "ext:model"),                                            # the recursion's shifts over 3, 2, 2
    (CTC, {}, "stage:2", "tstep:stage", {**PIPE, "stage_layers": (4, 3)}),        # the recursion pipelined
    (SOFTMOE, {}, "data:2", "batch:data; experts:data"),
    (SSD, {}, "model:2", "seq:model"),                                            # was refused: an implied chunk split
    (CTC, {"frames": 18}, "stage:2", "tstep:stage", INTERLEAVED),                 # was silently wrong
]

# more of the same kinds, with -m slow (the file keeps under 5 s on a quiet machine)
SLOW_CASES = [
    (SSD, {"inter": "quadratic"}, "model:3", "chunk:model"),
    (SOFTMOE, {"combine": "joint"}, "model:2", "slots:model"),
    (VITREG, {}, "data:2; model:2", "batch:data; heads:model; d_ff:model"),
    (VITREG, {}, "data:3", "batch:data; params.d_model:data"),
    (VITREG, {}, "model:2", "height:model"),
    (VITREG, {"layers": 4, "drop": "input"}, "stage:2", "layer:stage", INTERLEAVED),
    (VITREG, {"remat": "full"}, "stage:2; model:3", "layer:stage; tokens:model", PIPE),
    (VITREG, {"remat": "selective"}, "stage:2", "layer:stage", {"microbatches": 1, "schedule": "1f1b"}),
    (BYOL, {}, "model:2", "view:model"),                                          # the roll over a split view
    (BYOL, {"loss": "moco"}, "data:2; model:2", "imgs:data; keys:model"),
    (BYOL, {}, "model:3", "tok:model"),
    (BYOL, {"loss": "moco"}, "data:3", "imgs:data; params.emb:data"),           # the frozen target sharded too
    (BYOL, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (BYOL, {"remat": "full"}, "stage:2; data:2", "layer:stage; imgs:data", {**PIPE, "schedule": "zbh1"}),
    (CTC, {}, "data:2; model:2", "utt:data; heads:model; d_ff:model"),
    (CTC, {}, "model:3", "frames:model"),
    (CTC, {}, "model:3", "time:model"),
    (CTC, {}, "model:3", "sym:model"),
    (CTC, {}, "model:3", "lab:model"),
    (CTC, {}, "data:3", "utt:data; params.d_model:data"),
    (CTC, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (CTC, {"remat": "full"}, "stage:2; model:2", "layer:stage; time:model", PIPE),
    (CTC, {"frames": 18}, "stage:2; model:2", "tstep:stage; ext:model", {"microbatches": 1, "schedule": "1f1b"}),
    (SOFTMOE, {}, "model:3", "experts:model"),
    (SOFTMOE, {}, "model:3", "seq:model"),                                        # the dispatch softmax over split seq
    (SOFTMOE, {}, "data:3", "batch:data; params.d_model:data"),
    (SOFTMOE, {"combine": "logsumexp"}, "data:2; model:2", "batch:data; experts:data; slots:model"),
    (SOFTMOE, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (SOFTMOE, {"remat": "full"}, "stage:2; data:2", "layer:stage; batch:data; experts:data", PIPE),
    (SSD, {}, "model:2", "heads:model"),
    (SSD, {}, "model:2", "dstate:model"),
    (SSD, {"inter": "quadratic"}, "model:3", "hdim:model"),
    (SSD, {}, "data:3", "batch:data; params.d_model:data"),
    (SSD, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (SSD, {"remat": "full"}, "stage:2; model:2", "layer:stage; seq:model", PIPE),
]


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[heldout_case_id(c) for c in CASES + SLOW_CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


def _dense(path, outputs=("loss",), **over):
    m = md.load_model(path, tiny=True, **over)
    feeds = m.feeds(0)
    outs = {"loss": m.loss, **m.outputs}
    return md.run_dense({k: outs[k] for k in outputs}, feeds), feeds


def test_the_models_other_forms_compute_the_same_thing():
    """SSD's state passed on by a repeat or by the quadratic form over chunks, at any chunk length,
    and Soft MoE's combine softmax by a rearrange, over two dims, or by a logsumexp, give one loss;
    the CTC recursion gives torch's ``ctc_loss``."""
    def loss(path, **over):
        return float(_dense(path, **over)[0]["loss"])

    # the same sums in another order: fp32 rounding, ~1e-7 relative
    for over in ({"inter": "quadratic"}, {"chunk_len": 8}, {"chunk_len": 4, "inter": "quadratic"}):
        assert loss(SSD, **over) == pytest.approx(loss(SSD), rel=1e-5), over
    for form in ("joint", "logsumexp"):
        assert loss(SOFTMOE, combine=form) == pytest.approx(loss(SOFTMOE), rel=1e-5), form
    got, feeds = _dense(CTC, ("loss", "logprobs"))
    want = torch.nn.functional.ctc_loss(got["logprobs"].permute(1, 0, 2), feeds["labels"], feeds["in_len"],
                                        feeds["label_len"], blank=0, reduction="mean")
    # torch's recursion runs in another order (and in probability space per step): ~1e-6 relative
    assert float(got["loss"]) == pytest.approx(float(want), rel=1e-5)


def test_drop_path_drops_whole_examples_and_is_what_the_dense_program_drops():
    """Stochastic depth by ``md.dropout`` of a ``[batch]`` tensor: a rate of 0 is no drop path,
    and under data parallelism (each rank its own examples) the masks are the dense program's."""
    none, drop0 = float(_dense(VITREG, drop="none")[0]["loss"]), float(_dense(VITREG, drop_rate=0.0)[0]["loss"])
    assert drop0 == none
    assert float(_dense(VITREG, drop_rate=0.5)[0]["loss"]) != pytest.approx(none, rel=1e-3)
    assert_heldout_case_matches_dense((VITREG, {"drop_rate": 0.5}, "data:3", "batch:data"))


def _scan_of_chunks(nested: bool):
    """A loss over ``x [batch, seq, d]`` cut into ``chunk`` x ``pos`` by a rearrange, the chunks
    scanned by a repeat (at the top, or inside a layer's block as in SSD)."""
    b, s, d, L = md.Dim("batch", 2), md.Dim("seq", 8), md.Dim("d", 3), md.Dim("layer", 2)
    with md.Graph():
        x = md.input("x", [b, s, d])
        w = md.param("w", [L, d], init="ones")

        def scan_chunks(h):
            hc = md.rearrange(h, "batch (chunk pos) d -> batch chunk pos d", pos=2)
            _, per = md.repeat(lambda c, q: (c * 0.5 + md.reduce_sum(q["h"], "pos"), {"c": c}),
                               md.reduce_sum(hc, ["chunk", "pos"]) * 0.0, {"h": hc}, "chunk")
            y = md.rearrange(md.transpose(per["c"], ["batch", "chunk", "d"]) + hc,
                             "batch chunk pos d -> batch (chunk pos) d")
            return md.rename(y, chunk_pos="seq")

        if nested:
            y = md.repeat(lambda h, q: md.tanh(scan_chunks(h) * q["w"]), x, {"w": w}, "layer")
        else:
            y = md.tanh(scan_chunks(x) * md.reduce_sum(w, "layer"))
        loss = md.reduce_mean(y * y)
        return {"loss": loss, **md.grad(loss, {"w": w})}


@pytest.mark.parametrize("nested", [False, True], ids=["top", "nested"])
def test_a_split_carried_by_a_reshape_onto_a_scanned_dim_is_not_implied(nested):
    """``seq:model`` and a rearrange ``seq -> (chunk pos)`` implied ``chunk:model``, the dim a repeat
    scans: nested (SSD's chunk scan in a layer), the repeat was refused naming a 'chunk:' rule the
    user never wrote; at the top, ``model`` became a pipeline axis and ``seq:model`` was refused.
    A scanned dim now stays whole unless a written rule splits it (the rearrange gathers)."""
    feeds = {"x": torch.randn(2, 8, 3, generator=torch.Generator().manual_seed(0))}
    res = md.check(_scan_of_chunks(nested), "model:2", "seq:model", feeds)
    assert res.ok, str(res)


def test_a_pipeline_of_one_micro_batch_runs_a_model_whose_examples_dim_is_not_batch():
    """A pipeline with ``microbatches=1`` took the examples' dim to be ``batch`` whatever the model
    called it: with ``imgs`` nothing varied per micro-batch, every step ran once before the schedule,
    and the run failed reading the stack's output before it was made (KeyError)."""
    n, d, L = md.Dim("imgs", 4), md.Dim("d", 3), md.Dim("layer", 2)
    with md.Graph():
        x = md.input("x", [n, d])
        w = md.param("w", [L, d, md.Dim("e", 3)], fan_out=["layer", "e"])
        y = md.repeat(lambda h, q: h + md.tanh(md.rename(md.einsum("imgs d, d e -> imgs e", h, q["w"]), e="d")),
                      x, {"w": w}, "layer")
        loss = md.reduce_mean(md.reduce_sum(y, "d") ** 2)
        outs = {"loss": loss, **md.grad(loss, {"w": w})}
    feeds = {"x": torch.randn(4, 3, generator=torch.Generator().manual_seed(0))}
    res = md.check(outs, "stage:2", "layer:stage", feeds, microbatches=1, schedule="1f1b")
    assert res.ok, str(res)


@pytest.mark.parametrize("made", ["slice", "rename"])
def test_an_interleaved_pipeline_over_a_stacked_activation_gives_its_gradient(made):
    """The CTC recursion's emissions, an activation made from params, are the repeat's stacked
    tensor (a slice of time steps renamed ``step``). Under ``interleaved:2`` each rank stores its
    chunks' layers block-cyclically, but the stacked gradient's allgather (the rename's backward)
    joined them in rank order: the loss was right and ``w``'s gradient wrong (by ~10%, silently).
    ``rename``: the activation is renamed whole to the layer dim, and the layer dim's stage split
    was passed back to ``t`` as an implied rule, so the rename cut block parts where the stack
    reads cyclic ones."""
    b, d = md.Dim("batch", 4), md.Dim("d", 3)
    with md.Graph():
        x = md.input("x", [b, d])
        w = md.param("w", [d, md.Dim("t", 5 if made == "slice" else 4)], scale=1.0)
        em = md.einsum("batch d, d t -> batch t", x, w)
        em = md.slice_(em, "t", 1, 5) if made == "slice" else em
        y = md.repeat(lambda h, q: md.tanh(h * 0.9 + q["em"]), md.reduce_sum(x, "d"), {"em": md.rename(em, t="step")},
                      "step")
        loss = md.reduce_mean(y * y)
        outs = {"loss": loss, **md.grad(loss, {"w": w})}
    feeds = {"x": torch.randn(4, 3, generator=torch.Generator().manual_seed(0))}
    for sched in ("interleaved:2", "interleaved-zb:2"):
        res = md.check(outs, "stage:2", "step:stage", feeds, microbatches=2, schedule=sched)
        assert res.ok, str(res)


def test_the_cli_checks_the_ctc_recursion_pipelined_over_its_time_steps(capsys):
    """``meshdsl check`` on the CTC model, the alpha recursion's 7 time steps on 2 stages (4, 3)."""
    code, out, err = run_cli(capsys, ["check", CTC, "--tiny", "--mesh", "stage:2", "--layout", "tstep:stage",
                                      "--microbatches", "2", "--schedule", "1f1b", "--stage-layers", "4,3"])
    assert code == 0 and "OK:" in out, out + err


# each search takes 3-20 s on a quiet machine: with -m slow
@pytest.mark.slow
@pytest.mark.parametrize("path", [VITREG, BYOL, CTC, SOFTMOE, SSD], ids=["vitreg", "byol", "ctc", "softmoe", "ssd"])
def test_the_searchs_top_layouts_match_dense(path, monkeypatch, tmp_path):
    """``md.search_layouts`` on 4 processes (the default calibration): its three best candidates
    compile and give the dense program's loss and gradients."""
    assert_search_top_layouts_match_dense(path, monkeypatch, tmp_path)
