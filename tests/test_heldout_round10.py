"""Held-out models of round 10 (written from the README and docs alone).

``tests/heldout_falcon.py`` (Falcon's parallel block: attention and the MLP read one shared layer
norm, or two, and add to the residual together; multi-query attention, rotary tables made once
before the stack); ``tests/heldout_ftt.py`` (an FT-Transformer for tabular data: a per-feature
tokenizer of numeric features and of categorical ones by per-feature tables, a [CLS] token
concatenated first or last, non-causal layers, a head on the sliced [CLS] row);
``tests/heldout_colbert.py`` (ColBERT late interaction: a query and a document encoder, separate
stacks or one shared, L2-normalised token embeddings, MaxSim over the unpadded document tokens
and an in-batch contrastive loss over ``docs``); ``tests/heldout_dt.py`` (a Decision Transformer:
return, state and action tokens interleaved into one causal sequence by a rearrange, actions
predicted from the state tokens' outputs); ``tests/heldout_wav2vec.py`` (a wav2vec 2.0-style
encoder: stride-2 conv feature extractor, masked spans, a depthwise positional conv, targets
quantised by ``md.top_k`` over a codebook, straight-through, a masked contrastive loss and a
codebook diversity term). Each runs under data, Megatron, sequence (through the convs, the
interleaving rearrange and the tokens' concat), FSDP, uneven 3-way, pipeline (1f1b, zbh1,
interleaved:2, two stacks) and remat layouts against the dense program.
Findings and fixes: /work/notes/heldout-10.md.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import (assert_heldout_case_matches_dense, assert_search_top_layouts_match_dense, heldout_case_id,
                      run_cli)

HERE = Path(__file__).parent
FALCON, FTT, COLBERT, DT, WAV2VEC = (
    str(HERE / f"heldout_{n}.py") for n in ("falcon", "ftt", "colbert", "dt", "wav2vec"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}
INTERLEAVED = {"microbatches": 4, "schedule": "interleaved:2"}
TP = "batch:data; heads:model; d_ff:model"

# (model, config overrides, mesh, layout, compile keywords)
CASES = [
    (FALCON, {}, "model:3", "heads:model; seq:model"),                            # MQA: k, v whole; 4 heads as 2, 1, 1
    (FALCON, {"norm": "two", "remat": "selective"}, "stage:2; model:3", "layer:stage; seq:model", PIPE),
    (FTT, {"cls": "last"}, "model:3", "tok:model"),                               # the tokens' concat over 3, 2, 2
    (FTT, {}, "data:2; model:3", "batch:data; tok:model"),
    (COLBERT, {}, "data:2; model:3", "batch:data; dseq:model"),                   # MaxSim over a split dseq
    (COLBERT, {"encoder": "shared"}, "data:2; model:2", TP),
    (DT, {}, "model:3", "kind:model"),                                            # the state tokens' kind sliced
    (DT, {}, "stage:2; model:3", "layer:stage; seq:model", {**PIPE, "schedule": "zbh1"}),
    (WAV2VEC, {}, "model:3", "frames:model"),                                     # stride-2 convs over 3, 3, 2 frames
    (WAV2VEC, {}, "stage:2; model:2", "layer:stage; frames:model; seq:model", PIPE),   # was a GraphError
]

# more of the same kinds, with -m slow (the file keeps under 6 s on a quiet machine)
SLOW_CASES = [
    (FALCON, {}, "data:2; model:2", TP),
    (FALCON, {}, "data:3", "batch:data; params.d_model:data"),
    (FALCON, {"layers": 4}, "stage:2", "layer:stage", {**PIPE, "stage_layers": (3, 1)}),
    (FALCON, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (FALCON, {"remat": "full"}, "stage:2", "layer:stage", {**PIPE, "schedule": "zbh1"}),
    (FTT, {}, "model:3", "card:model"),
    (FTT, {}, "data:4", "batch:data; params.d_model:data"),
    (FTT, {"layers": 4, "remat": "full"}, "stage:2", "layer:stage", {"microbatches": 2, "schedule": "interleaved:2"}),
    (FTT, {}, "stage:2; model:3", "layer:stage; tok:model", PIPE),
    (COLBERT, {}, "model:3", "qseq:model"),
    (COLBERT, {}, "model:3", "docs:model"),
    (COLBERT, {}, "data:2", "batch:data; params.d_model:data"),
    (COLBERT, {"layers": 3}, "stage:3", "layer:stage; dlayer:stage", {"microbatches": 1, "schedule": "1f1b"}),
    (DT, {}, "data:2; model:2", TP),
    (DT, {"interleave": "einsum"}, "model:3", "kind:model; src:model"),
    (DT, {}, "data:3", "batch:data; params.d_model:data"),
    (DT, {"layers": 4, "batch": 8}, "stage:2", "layer:stage", INTERLEAVED),
    (WAV2VEC, {}, "data:2; model:2", TP),
    (WAV2VEC, {}, "model:3", "time:model"),
    (WAV2VEC, {}, "model:2", "codes:model"),
    (WAV2VEC, {}, "data:3", "batch:data; params.d_model:data"),
    (WAV2VEC, {"remat": "selective"}, "stage:2", "layer:stage", {**PIPE, "schedule": "zbh1"}),
    (WAV2VEC, {"layers": 4, "batch": 8}, "stage:2; model:2", "layer:stage; frames:model", INTERLEAVED),
]


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[heldout_case_id(c) for c in CASES + SLOW_CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


def test_the_models_other_forms_compute_the_same_thing():
    """The [CLS] token first or last (no positions: attention is permutation-equivariant) and the
    Decision Transformer's interleaving by concat or by a one-hot placement give the same loss."""
    def loss(path, **over):
        m = md.load_model(path, tiny=True, **over)
        return float(md.run_dense({"l": m.loss}, m.feeds(0))["l"])

    # the same sums in another order: fp32 rounding, ~1e-7 relative
    assert loss(FTT, cls="last") == pytest.approx(loss(FTT), rel=1e-5)
    assert loss(DT, interleave="einsum") == pytest.approx(loss(DT), rel=1e-5)


@pytest.mark.parametrize("op", ["shift", "conv"])
def test_a_halo_of_an_input_made_before_the_stack_and_read_after_it_pipelines(op):
    """A shift (or conv) of a sequence-split input before the stack, read again after it (the
    loss reads the stack's output times it, as wav2vec's targets read the extractor's features):
    each stage that reads it makes it from the input, but its halo (a permute over ``model``,
    None on the edge ranks) was made on stage 0 and sent on: 'recv (tag 2): nothing was sent to
    rank 2'. Now each stage makes the halo too."""
    b, s, c, tap, layer = md.Dim("batch", 2), md.Dim("seq", 8), md.Dim("chan", 4), md.Dim("tap", 3), md.Dim("layer", 2)
    with md.Graph():
        x = md.input("x", [b, s, c])
        w = md.param("w", [tap, c], fan_out=["chan"])
        v = md.param("v", [layer, c, md.Dim("c2", 4)], fan_out=["layer", "c2"])
        h = md.conv(x, w, {"seq": "tap"}) if op == "conv" else md.shift(x, "seq", 1) * md.reduce_sum(w, "tap")

        def block(h, p):
            return h + md.tanh(md.rename(md.einsum("batch seq chan, chan c2 -> batch seq c2", h, p["v"]), c2="chan"))

        loss = md.reduce_mean(md.repeat(block, h, {"v": v}, "layer") * h)
        outs = {"loss": loss, **md.grad(loss, {"w": w, "v": v})}
    feeds = {"x": torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(0))}
    want = md.run_dense(outs, feeds)
    for mb in (1, 2):
        got = md.run_simulated(md.compile(outs, "stage:2; model:2", "layer:stage; seq:model", microbatches=mb), feeds)
        for k in want:
            # the micro-batches' sums added in another order: fp32 rounding, ~1e-7 relative
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mesh", ["model:2", "model:3"])
def test_a_constant_renamed_to_a_whole_dim_is_made_there_not_gathered(mesh):
    """Falcon's rotary tables ``[seq, d_head]`` (``md.constant``) are renamed to ``key_seq`` for
    the keys: under ``seq:model`` the table is split and its rename reads it whole. Each rank
    can make any part of a constant itself; it was allgathered (twice, cos and sin). Now the
    constant is made again whole, and the numbers are the dense program's (3 ranks: uneven)."""
    s, e = md.Dim("seq", 8), md.Dim("d_head", 4)
    with md.Graph():
        x = md.input("x", [md.Dim("batch", 2), s, e])
        w = md.param("w", [e])
        table = md.constant(torch.arange(32, dtype=torch.float32).reshape(8, 4) / 8, [s, e])
        pos = md.arange(s)   # an iota: the same holds
        k = md.rename(x * w, seq="key_seq") * md.rename(table, seq="key_seq")
        k = k * md.cast(md.rename(pos, seq="key_seq"), torch.float32)
        att = md.softmax(md.einsum("batch seq d_head, batch key_seq d_head -> batch seq key_seq", x * table, k),
                         "key_seq")
        loss = md.reduce_mean(att * att)
        outs = {"loss": loss, **md.grad(loss, {"w": w})}
    feeds = {"x": torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(0))}
    plan = md.compile(outs, mesh, "seq:model")
    gathered = [st.label for st in plan.steps if st.kind == "allgather"]
    assert gathered == ["rename"], gathered   # the activation's keys only
    want = md.run_dense(outs, feeds)
    got = md.run_simulated(plan, feeds)
    for k in want:
        # sums over the split seq in another order: fp32 rounding, ~1e-7 relative
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_an_in_batch_contrastive_loss_under_micro_batches_is_refused_with_the_reason():
    """ColBERT's [batch, docs] scores need every micro-batch's documents at once: refused, naming
    the rule and the fix (one micro-batch, or negatives within each micro-batch)."""
    model = md.load_model(COLBERT, tiny=True)
    outs = {"loss": model.loss, **md.grad(model.loss, model.params)}
    with pytest.raises(md.LayoutError, match=r"(?s)cannot be micro-batched.*contrastive loss"):
        md.compile(outs, "stage:2", "layer:stage; dlayer:stage", **PIPE)


def test_a_shared_encoder_pipelined_twice_says_what_to_do_instead():
    """ColBERT's one encoder applied to the queries and to the documents: two repeats over one
    ``layer`` dim reading the same stacked params. The refusal's fix said to give each stack a
    layer dim of its own, which a shared stack cannot have; it now names the shared tensor and
    says what to do instead."""
    model = md.load_model(COLBERT, tiny=True, encoder="shared")
    with pytest.raises(md.LayoutError, match=r"(?s)more than one repeat.*same stacked tensor 'wq'.*one md.repeat"):
        md.compile({"loss": model.loss}, "stage:2", "layer:stage", microbatches=1)


def test_the_cli_checks_the_speech_encoder_pipelined_with_split_frames(capsys):
    """``meshdsl check`` on the wav2vec model, frames split and the layers pipelined."""
    code, out, err = run_cli(capsys, ["check", WAV2VEC, "--tiny", "--mesh", "stage:2; model:2", "--layout",
                                      "layer:stage; frames:model", "--microbatches", "2", "--schedule", "1f1b"])
    assert code == 0 and "OK:" in out, out + err


# each search takes 3-10 s on a quiet machine: with -m slow
@pytest.mark.slow
@pytest.mark.parametrize("path", [FALCON, FTT, COLBERT, DT, WAV2VEC], ids=["falcon", "ftt", "colbert", "dt", "wav2vec"])
def test_the_searchs_top_layouts_match_dense(path, monkeypatch, tmp_path):
    """``md.search_layouts`` on 4 processes (the default calibration): its three best candidates
    compile and give the dense program's loss and gradients."""
    assert_search_top_layouts_match_dense(path, monkeypatch, tmp_path)
