"""Held-out models of round 6b (written from the README and docs alone) against the dense program.

``tests/heldout_conformer.py`` (a Conformer encoder: macaron half-step SiLU FFNs around fused
non-causal attention and a conv module of a GLU, a depthwise conv over ``seq``, a batch norm over
``batch`` and ``seq`` inside the stack and a pointwise einsum, a frame-level cross-entropy),
``tests/heldout_convnext.py`` (a ConvNeXt classifier: a patchify stem, a 3x3 depthwise conv over
``row`` and ``col``, LayerNorm over channels, an inverted-bottleneck MLP and a layer scale, a 2x2
patch-merge downsample into a second stack, mean pooling), ``tests/heldout_unet.py`` (a diffusion
U-Net: a fed timestep's sinusoidal features and cosine noise schedule computed in the graph,
``md.conv`` blocks with batch norms over a split batch, a rearrange down- and upsample, a skip
joined by ``md.concat``, the noise-prediction MSE), ``tests/heldout_deit.py`` (a distilled ViT: a
class and a distillation token joined by ``md.concat`` before the patches, register tokens after
them, layer scale, two heads on two token rows, the second on fed teacher labels),
``tests/heldout_vae.py`` (a VAE: a reparameterised sample from fed noise, residual decoder blocks
under ``md.repeat``, a hand-written stable Bernoulli NLL and a free-bits KL with ``md.maximum``),
``tests/heldout_gat.py`` (a graph attention network over fed per-graph adjacency matrices:
additive edge scores, a masked softmax over neighbours, ELU, a node loss over a fed labelled mask
divided by its whole-batch count), ``tests/heldout_ssm.py`` (a Mamba-style selective SSM: a
causal depthwise ``md.conv``, input-dependent decays summed by ``md.cumsum`` over ``seq``, the
scan in its masked quadratic form) and ``tests/heldout_sepconv_moe.py`` (a soft mixture of
depthwise-separable conv experts over audio frames: a depthwise ``md.conv`` with one filter per
expert and channel, pointwise einsums per expert, softmax gates),
each ``Config.tiny()``, on a subset of the layouts they were checked on by hand.

Also what they led to: ``md.conv`` takes a depthwise weight (``w [tap..., c_in]``, no ``c_out``;
or several dims of x, ``w [tap, experts, c_in]``),
as the shifted-copies form the models wrote by hand (``dw_op=True`` switches them to it); a
conv, shift, pad or slice over an unevenly split dim trades halos instead of gathering it
(``tests/test_halo.py``, ``tests/test_conv.py``); a slice of the class and distillation rows of a
split sequence is summed from the ranks that hold them, and tokens joined to split patches by
``md.concat`` are placed by pads that trade halos (``tests/test_concat.py``), instead of
gathering the sequence; and a batch norm inside a micro-batched stack is refused with a fix
that names it.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import assert_heldout_case_matches_dense, heldout_case_id, heldout_outputs

HERE = Path(__file__).parent
CONFORMER, CONVNEXT, UNET, DEIT, VAE, GAT, SSM, SEPCONV = (str(HERE / f"heldout_{n}.py") for n in (
    "conformer", "convnext", "unet", "deit", "vae", "gat", "ssm", "sepconv_moe"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}

# (model, config overrides, mesh, layout, compile keywords)
CASES = [
    (CONFORMER, {}, "data:2; model:2", "batch:data; heads:model; d_ff:model; ch:model"),
    (CONFORMER, {"dw_op": True}, "data:3", "seq:data"),             # uneven seq: halos, the batch norm's sums
    (CONFORMER, {}, "stage:2; model:2", "layer:stage; heads:model; seq:model"),   # one micro-batch: BN pipelines
    (CONVNEXT, {}, "data:2; model:2", "row:data; col:model"),       # 2-D halos of 9 shifted taps
    (CONVNEXT, {"dw_op": True}, "data:3", "row:data"),              # uneven rows, the downsample gathers
    (CONVNEXT, {"dw_op": True}, "stage:2; data:3", "layer:stage; row:data", PIPE),   # pipelined uneven halos
    (CONVNEXT, {}, "data:2", "batch:data; params.d_model:data; params.d2:data"),
    (UNET, {}, "data:3", "batch:data"),                             # batch norms over an uneven batch
    (UNET, {}, "data:2; model:2", "height:data; width:model"),      # halos, rearranges keep the splits
    (UNET, {}, "model:2", "c1:model; c2o:model"),
    (DEIT, {}, "data:2; model:2", "batch:data; seq:model; d_ff:model"),
    (DEIT, {}, "stage:2", "layer:stage", {"microbatches": 2, "schedule": "zbh1"}),
    (DEIT, {}, "model:3", "classes:model; d_ff:model"),
    (VAE, {}, "data:2; model:2", "batch:data; d_hidden:model"),
    (VAE, {}, "model:3", "pixels:model"),
    (VAE, {}, "stage:2", "layer:stage", PIPE),
    (GAT, {}, "a:3; b:2", "node:a; key_node:b"),                     # uneven nodes, softmax over split keys
    (GAT, {}, "data:2; model:2", "batch:data; node:model; heads:model"),
    (GAT, {}, "stage:2", "layer:stage", PIPE),                      # the labelled count: a whole-batch input stat
    (UNET, {"down_conv": True}, "data:3", "height:data"),          # a stride-2 conv over uneven rows
    (SSM, {}, "model:3", "seq:model"),                              # causal depthwise halos, cumsum, uneven
    (SSM, {}, "data:2; model:2", "batch:data; d_inner:model; vocab:model"),
    (SSM, {}, "stage:2; model:2", "layer:stage; seq:model", {"microbatches": 2, "schedule": "zbh1"}),
    (SEPCONV, {}, "model:3", "experts:model"),                      # conv experts split unevenly
    (SEPCONV, {}, "data:2; model:2", "frames:data; experts:model"), # halos per expert, gates' softmax split
]


@pytest.mark.parametrize("case", CASES, ids=[heldout_case_id(c) for c in CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


@pytest.mark.parametrize("path", [CONFORMER, CONVNEXT])
def test_the_depthwise_conv_op_is_the_hand_written_sum_of_shifts(path):
    """dw_op=True (md.conv with w [tap..., ch]) and the models' own sums of shifted taps: the same
    loss and gradients, dense (the same products, summed in another order)."""
    mine, op = md.load_model(path, tiny=True), md.load_model(path, tiny=True, dw_op=True)
    feeds = mine.feeds(0)
    a, b = md.run_dense(heldout_outputs(mine), feeds), md.run_dense(heldout_outputs(op), feeds)
    for k in a:
        # fp32, the 3 or 9 taps added in another order: rounding of values O(1)
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_a_batch_norm_in_a_micro_batched_stack_is_refused_naming_it():
    """The Conformer's batch norm sums over the batch inside its layers: micro-batches would
    normalise each by its own statistics, so a pipeline of 2 is refused, and the fix says so."""
    model = md.load_model(CONFORMER, tiny=True)
    with pytest.raises(md.LayoutError) as e:
        md.compile(heldout_outputs(model), "stage:2", "layer:stage", **PIPE)
    text = str(e.value)
    assert "sums over the micro-batches" in text and "batch norm" in text and "microbatches=1" in text, text


def test_the_token_rows_of_a_split_sequence_are_not_gathered():
    """DeiT under seq:model: the class and distillation rows are sliced where they lie (partial
    sums, reduced after the heads' einsums, 2 forward and 2 backward), the tokens are joined to
    the split patches by pads that trade halo rows; the allgathers left are attention's keys and
    values (and their gradient's)."""
    model = md.load_model(DEIT, tiny=True)
    plan = md.compile(heldout_outputs(model), "model:2", "seq:model")
    # (keys and values made back to back go in one bucket, its note naming them: lowering/coalesce.py)
    gathers = [label for s, _ in plan.collectives() if s.kind in ("allgather", "bucket_allgather")
               for label in ([s.label] if s.kind == "allgather" else s.note.split("): ")[1].split(" [")[0].split(", "))]
    assert gathers and all(label.startswith(("rename", "grad_rename")) for label in gathers), gathers
    assert sum("summed from the ranks that hold them" in n for n in plan.notes) == 4, plan.notes


def test_the_uneven_seq_split_moves_halos_not_the_sequence():
    """seq 8 over data:3 (3, 3, 2): the depthwise conv's forward and backward trade rows with the
    neighbours (permutes); the only gathers are attention's keys and values (4: 2 layers x k, v)."""
    model = md.load_model(CONFORMER, tiny=True, dw_op=True)
    totals = md.compile(heldout_outputs(model), "data:3", "seq:data").totals()
    assert totals["permute"]["count"] == 8 and totals["allgather"]["count"] == 4, totals
