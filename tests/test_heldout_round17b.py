"""Held-out models of round 17b (written from the README and docs alone): two-tower retrieval,
TransE/DistMult, a pointer-generator, a MusicGen-style multi-codebook LM and SE-ResNet/CoAtNet-lite.

``tests/heldout_twotower.py`` (a user tower over a masked embedding bag of the history, an item tower
over id embeddings and features; in-batch negatives with a temperature and logQ correction, or
sampled negatives fed as inputs); ``tests/heldout_transe.py`` (entity and relation tables, TransE's
-||h + r - t|| with a margin ranking loss against fed corrupted triples, or DistMult with a softplus
loss); ``tests/heldout_ptrgen.py`` (a transformer or bidirectional-GRU encoder, a decoder with cross
attention, and the copy mechanism: p_gen mixes the vocab softmax with the pointer attention scattered
onto the vocab by a one-hot einsum); ``tests/heldout_musicgen.py`` (K codebooks in the delay pattern
by slice_/pad/concat, summed codebook embeddings, a causal transformer, K heads, the CE summed over
codebooks ignoring the delayed padding); ``tests/heldout_seresnet.py`` (conv stem, residual blocks
with squeeze-and-excitation, and in the CoAtNet form a transformer stage over the flattened map with
a 2-D relative position bias). Each runs under data, Megatron, vocab/entity/item, sequence, spatial
and feature splits (2-way and uneven 3-way), FSDP, pipeline (1f1b, zbh1, interleaved:2) and remat
layouts against the dense program. Findings: /work/notes/heldout-17b.md.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import (assert_adamw_steps_track_dense, assert_heldout_case_matches_dense,
                      assert_search_top_layouts_match_dense, heldout_case_id,
                      heldout_outputs, run_cli)

HERE = Path(__file__).parent
TWOTOWER, TRANSE, PTRGEN, MUSICGEN, SERESNET = (
    str(HERE / f"heldout_{n}.py") for n in ("twotower", "transe", "ptrgen", "musicgen", "seresnet"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}
ZBH1 = {"microbatches": 2, "schedule": "zbh1"}
INTERLEAVED = {"microbatches": 2, "schedule": "interleaved:2"}
MB2 = {"microbatches": 2}
SAMPLED, DISTMULT, GRU = {"form": "sampled"}, {"form": "distmult"}, {"enc": "gru"}
BIAS, COATNET, SHIFT = {"form": "bias"}, {"form": "coatnet"}, {"delay": "shift"}

# (model, config overrides, mesh, layout[, compile keywords])
CASES = [
    (TRANSE, DISTMULT, "model:3", "dim:model"),               # the trilinear score over an uneven dim split
    (MUSICGEN, {}, "model:3", "seq:model"),                   # the delay pattern's pads over an uneven seq
    (TWOTOWER, {}, "data:1", "", MB2),                        # in-batch labels (arange) per micro-batch
]

SLOW_CASES = [
    (TWOTOWER, {}, "data:2", "batch:data"),
    (TWOTOWER, {}, "data:2", "batch:data; cand:data"),
    (TWOTOWER, {}, "model:2", "items:model"),
    (TWOTOWER, {}, "model:3", "items:model"),
    (TWOTOWER, {}, "model:2", "hidden:model"),
    (TWOTOWER, {}, "model:3", "hidden:model"),
    (TWOTOWER, {}, "model:2", "d_ff:model"),
    (TWOTOWER, {}, "model:2", "hist:model"),
    (TWOTOWER, {}, "model:3", "cand:model"),
    (TWOTOWER, {}, "data:2; model:2", "batch:data; items:model; d_ff:model"),
    (TWOTOWER, {}, "data:2", "batch:data; params.hidden:data"),
    (TWOTOWER, {}, "data:2", "batch:data", MB2),
    (TWOTOWER, SAMPLED, "data:2", "batch:data"),
    (TWOTOWER, SAMPLED, "model:3", "cand:model"),
    (TWOTOWER, SAMPLED, "data:2; model:2", "batch:data; items:model; d_out:model"),
    (TWOTOWER, SAMPLED, "data:1", "", MB2),
    (TRANSE, {}, "data:2", "batch:data"),
    (TRANSE, {}, "model:2", "entities:model"),
    (TRANSE, {}, "model:3", "dim:model"),
    (TRANSE, {}, "model:3", "batch:model"),
    (TRANSE, {}, "model:2", "negs:model"),
    (TRANSE, {}, "data:2; model:2", "batch:data; entities:model"),
    (TRANSE, {}, "data:2; model:2", "batch:(data,model); entities:model"),
    (TRANSE, {}, "data:2", "batch:data; params.entities:data"),
    (TRANSE, {}, "model:4", "relations:model"),
    (TRANSE, DISTMULT, "model:3", "entities:model"),
    (TRANSE, DISTMULT, "data:2; model:2", "batch:data; dim:model"),
    (TRANSE, DISTMULT, "data:2", "batch:data; params.dim:data"),
    (TRANSE, DISTMULT, "data:2", "batch:data", MB2),
    (PTRGEN, {}, "data:2", "batch:data"),
    (PTRGEN, {}, "model:2", "vocab:model"),
    (PTRGEN, {}, "model:3", "vocab:model"),                   # the copy scatter onto an uneven vocab split
    (PTRGEN, {}, "model:2", "heads:model; d_ff:model"),
    (PTRGEN, {}, "model:2", "d_model:model"),
    (PTRGEN, {}, "model:2", "tgt:model"),
    (PTRGEN, {}, "model:3", "src:model"),
    (PTRGEN, {}, "data:2; model:2", "batch:data; heads:model; d_ff:model; vocab:model"),
    (PTRGEN, {}, "data:2", "batch:data; params.d_model:data"),
    (PTRGEN, {}, "stage:2", "dec_layer:stage", PIPE),
    (PTRGEN, {}, "stage:2", "dec_layer:stage", ZBH1),
    (PTRGEN, {}, "stage:2", "enc_layer:stage", PIPE),
    (PTRGEN, {}, "stage:2", "enc_layer:stage; dec_layer:stage", PIPE),
    (PTRGEN, {}, "stage:2; model:2", "enc_layer:stage; dec_layer:stage; heads:model", ZBH1),
    (PTRGEN, {"dec_layers": 4}, "stage:2", "dec_layer:stage", INTERLEAVED),
    (PTRGEN, {"remat": "full"}, "stage:2; model:2", "dec_layer:stage; heads:model", PIPE),
    (PTRGEN, {"remat": "selective"}, "model:2", "tgt:model"),
    (PTRGEN, GRU, "data:2", "batch:data"),
    (PTRGEN, GRU, "model:2", "hid:model"),
    (PTRGEN, GRU, "model:2", "vocab:model"),
    (PTRGEN, GRU, "stage:2", "dec_layer:stage", PIPE),
    (PTRGEN, {**GRU, "remat": "full"}, "model:2", "hid:model"),
    (MUSICGEN, {}, "data:2", "batch:data"),
    (MUSICGEN, {}, "model:2", "codebooks:model"),
    (MUSICGEN, {}, "model:3", "codebooks:model"),
    (MUSICGEN, {}, "model:2", "seq:model"),
    (MUSICGEN, {}, "model:2", "heads:model; d_ff:model"),
    (MUSICGEN, {}, "model:3", "vocab:model"),
    (MUSICGEN, {}, "data:2; model:2", "batch:data; heads:model; vocab:model"),
    (MUSICGEN, {}, "data:2; model:2", "seq:(data,model)"),
    (MUSICGEN, {}, "data:2", "batch:data; params.d_model:data"),
    (MUSICGEN, {}, "stage:2", "layer:stage", PIPE),
    (MUSICGEN, {}, "stage:2", "layer:stage", ZBH1),
    (MUSICGEN, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (MUSICGEN, {}, "stage:2; model:2", "layer:stage; seq:model", PIPE),
    (MUSICGEN, {"remat": "full"}, "stage:2; model:2", "layer:stage; codebooks:model", ZBH1),
    (MUSICGEN, {"remat": "selective"}, "model:3", "seq:model"),
    (MUSICGEN, BIAS, "model:3", "seq:model"),
    (MUSICGEN, BIAS, "model:2", "codebooks:model"),
    (MUSICGEN, SHIFT, "model:3", "codebooks:model"),
    (MUSICGEN, SHIFT, "model:3", "seq:model"),
    (SERESNET, {}, "data:2", "batch:data"),
    (SERESNET, {}, "model:2", "height:model"),
    (SERESNET, {}, "model:4", "height:model"),
    (SERESNET, {}, "model:2", "width:model"),
    (SERESNET, {}, "model:2", "c_out:model"),
    (SERESNET, {}, "model:2", "se:model"),
    (SERESNET, {}, "model:3", "classes:model"),
    (SERESNET, {}, "data:2; model:2", "batch:data; height:model"),
    (SERESNET, {}, "data:2", "batch:data; params.c_out:data"),
    (SERESNET, {}, "stage:2", "layer:stage", PIPE),
    (SERESNET, {}, "stage:2", "layer:stage", ZBH1),
    (SERESNET, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (SERESNET, {"remat": "full"}, "stage:2; model:2", "layer:stage; height:model", PIPE),
    (SERESNET, COATNET, "model:3", "height:model"),
    (SERESNET, COATNET, "model:2", "heads:model; d_ff:model"),
    (SERESNET, COATNET, "model:2", "seq:model"),
    (SERESNET, COATNET, "model:2", "rel:model"),
    (SERESNET, COATNET, "stage:2", "tlayer:stage", PIPE),
    (SERESNET, {**COATNET, "remat": "selective"}, "model:2", "height:model"),
]


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[heldout_case_id(c) for c in CASES + SLOW_CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


def test_the_delay_pattern_is_musicgens():
    """The delayed labels the model builds: codebook k shifted right by k frames, the special id
    (card) before them; checked against the same shift written in torch."""
    m = md.load_model(MUSICGEN, tiny=True)
    cfg, codes = m.config, m.feeds(0)["codes"]
    labels = next(t for t in m.graph.nodes if t.op.name == "concat").outputs[0]
    got = md.run_dense({"labels": labels}, {"codes": codes})["labels"]
    want = torch.full_like(codes, cfg.card)
    for k in range(cfg.codebooks):
        want[:, k, k:] = codes[:, k, :cfg.seq - k]
    assert torch.equal(got, want)


def test_the_two_delay_forms_give_the_same_model():
    """The delay by slice_/pad/concat per codebook and by masked md.shifts of the whole grid are the
    same labels and inputs: the dense losses are bitwise equal."""
    a, b = (md.load_model(MUSICGEN, tiny=True, delay=d) for d in ("slice", "shift"))
    la, lb = (md.run_dense({"loss": m.loss}, m.feeds(0))["loss"] for m in (a, b))
    assert torch.equal(la, lb)


def test_two_recurrences_over_a_split_input_dim_get_the_nesting_fix():
    """A bi-GRU's two top-level repeats over 'src' under 'src:model': the refusal says the split makes
    'model' their pipeline axis and how to nest a recurrence for sequence parallelism, not 'give each
    stack a layer dim of its own name' (they are recurrences over the data, not layer stacks)."""
    m = md.load_model(PTRGEN, tiny=True, enc="gru")
    with pytest.raises(md.LayoutError) as e:
        md.compile(heldout_outputs(m), "model:2", "src:model")
    msg = str(e.value)
    assert "md.Dim('once', 1)" in msg and "not sequence parallelism" in msg, msg
    assert "layer dim of its own name (md.Dim('enc_layer'" not in msg, msg


def test_a_head_reading_the_encoder_and_decoder_pipelines_per_micro_batch():
    """Both stacks of an encoder-decoder on the stage axis, the decoder's layers reading the encoder's
    output and the head reading it too (a pointer-generator's copy attention over the source): the
    head is per row, so it runs per micro-batch on the decoder's last stage, the encoder's output sent
    up once. It was refused as 'reads the outputs of 2 pipelined stacks ... after the micro-batches'
    (the stacks were chained only through the decoder's first carry)."""
    B, S, D, F = md.Dim("batch", 4), md.Dim("seq", 3), md.Dim("d_model", 4), md.Dim("d_ff", 6)
    E, L = md.Dim("enc_layer", 2), md.Dim("dec_layer", 2)

    def enc_block(h, p):
        z = md.tanh(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w1"]))
        return h + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", z, p["w2"])

    with md.Graph():
        x = md.input("x", [B, S, D])
        w1 = md.param("w1", [E, D, F], fan_out=["enc_layer", "d_ff"])
        w2 = md.param("w2", [E, F, D], fan_out=["enc_layer", "d_model"])
        wd = md.param("wd", [L, md.Dim("d_in", 4), D], fan_out=["dec_layer", "d_model"])
        enc = md.repeat(enc_block, x, {"w1": w1, "w2": w2}, E)
        y = md.repeat(lambda h, p: h + md.tanh(md.einsum("batch seq d_in, d_in d_model -> batch seq d_model",
                                                         md.rename(h + enc, d_model="d_in"), p["wd"])),
                      x, {"wd": wd}, L)
        loss = md.reduce_mean((y * enc) ** 2)
        outs = {"loss": loss, **md.grad(loss, {"w1": w1, "w2": w2, "wd": wd})}
    res = md.check(outs, "stage:2", "enc_layer:stage; dec_layer:stage", {"x": torch.randn(4, 3, 4)},
                   microbatches=2, schedule="1f1b")
    assert res.ok, str(res)


@pytest.mark.slow
def test_the_copy_distribution_sums_to_one():
    """p_gen * softmax + (1 - p_gen) * attention scattered by one_hot is a distribution over the vocab:
    its probabilities sum to 1 at every target position (dense)."""
    m = md.load_model(PTRGEN, tiny=True)
    final = next(n for n in m.graph.nodes if n.op.name == "add" and "vocab" in n.outputs[0].shape.names
                 and "tgt" in n.outputs[0].shape.names).outputs[0]
    feeds = {k: v for k, v in m.feeds(0).items() if k != "labels"}
    got = md.run_dense({"final": final}, feeds)["final"]
    torch.testing.assert_close(got.sum(-1), torch.ones(got.shape[:-1]), rtol=0, atol=1e-6)   # fp32 sums of 16


@pytest.mark.slow
@pytest.mark.parametrize("path,over,mesh,layout", [
    (TWOTOWER, {}, "model:2", "items:model"),
    (TRANSE, {}, "model:2", "entities:model"),
    (PTRGEN, {}, "model:2", "vocab:model"),
    (MUSICGEN, {}, "model:2", "seq:model"),
    (SERESNET, {}, "model:2", "height:model"),
], ids=["twotower", "transe", "ptrgen", "musicgen", "seresnet"])
def test_the_cli_checks_each_model_on_two_real_processes(path, over, mesh, layout, capsys):
    """``meshdsl check ... --tiny --nproc 2``: the plan run on two gloo processes."""
    code, out, err = run_cli(capsys, ["check", path, "--tiny", "--mesh", mesh, "--layout", layout, "--nproc", "2"])
    assert code == 0 and "OK:" in out, out + err


@pytest.mark.slow
@pytest.mark.parametrize("path", [TWOTOWER, TRANSE, PTRGEN, MUSICGEN, SERESNET],
                         ids=["twotower", "transe", "ptrgen", "musicgen", "seresnet"])
def test_the_searchs_top_layouts_match_dense(path, monkeypatch, tmp_path):
    """``md.search_layouts`` on 4 processes (the default calibration): its three best candidates
    compile and give the dense program's loss and gradients."""
    assert_search_top_layouts_match_dense(path, monkeypatch, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("path,mesh,layout", [
    (TWOTOWER, "data:2; model:2", "batch:data; items:model"),
    (TRANSE, "data:2; model:2", "batch:data; entities:model"),
    (PTRGEN, "data:2; model:2", "batch:data; heads:model; vocab:model"),
    (MUSICGEN, "data:2; model:2", "batch:data; seq:model"),
    (SERESNET, "data:2; model:2", "batch:data; height:model"),
], ids=["twotower", "transe", "ptrgen", "musicgen", "seresnet"])
def test_adamw_steps_track_dense(path, mesh, layout):
    """Three AdamW steps (clipped at 1) on the layout give the dense program's losses."""
    assert_adamw_steps_track_dense(path, mesh, layout)
