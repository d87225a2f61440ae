"""Held-out models of round 9b (written from the README and docs alone): sequence models of unusual structure.

``tests/heldout_hyena.py`` (a Hyena operator of order 2: implicit long filters made in the graph
from ``md.arange(tap)`` by a small MLP times a decay window, depthwise causal ``md.conv`` with as
many taps as positions, short convs, gating); ``tests/heldout_performer.py`` (softmax-free linear
attention: elu+1, relu or FAVOR+ random features, the causal form by ``md.cumsum`` over ``seq`` of
the key-value outer products, or chunked: a masked quadratic term in each chunk and an exclusive
cumsum over ``chunks`` across them); ``tests/heldout_funnel.py`` (a Funnel encoder: two stacks at
different lengths, the sequence pooled by 2 between them by a rearrange, pool-query-only attention
to the full length, an upsampled decoder residual, an MLM and a classification loss);
``tests/heldout_universal.py`` (one shared layer applied ``steps`` times by ``md.repeat``, the only
stacked tensor the per-step embedding, a param, a stacked constant or both; a soft mix of the
steps' states by a softmax over ``step``); ``tests/heldout_mtp.py`` (DeepSeek-V3 multi-token
prediction: a second stack over the prediction depths scanning depth-shifted embeddings, targets
and counts made before it, per-depth masked losses through the shared head). Each runs under data,
Megatron, sequence (through the cumsums, convolutions and pooling), FSDP, uneven, pipeline (1f1b,
zbh1, interleaved:2, two stacks) and remat layouts against the dense program.
Findings and fixes: /work/notes/heldout-9b.md.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import (assert_heldout_case_matches_dense, assert_search_top_layouts_match_dense, heldout_case_id,
                      run_cli)

HERE = Path(__file__).parent
HYENA, PERFORMER, FUNNEL, UNIVERSAL, MTP = (
    str(HERE / f"heldout_{n}.py") for n in ("hyena", "performer", "funnel", "universal", "mtp"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}
INTERLEAVED = {"microbatches": 4, "schedule": "interleaved:2"}
TP = "batch:data; heads:model; d_ff:model"
STACKS = "layer1:stage; layer2:stage"
DEPTHS = "layer:stage; mtp:stage"

# (model, config overrides, mesh, layout, compile keywords)
CASES = [
    (HYENA, {}, "data:2; model:2", "batch:data; seq:model; inner:model"),
    (HYENA, {}, "model:3", "seq:model"),                                          # 8 taps over slices of 3, 3, 2
    (HYENA, {}, "model:2", "tap:model"),                                          # the filter's taps split
    (HYENA, {"remat": "full"}, "stage:2; model:2", "layer:stage; seq:model", {**PIPE, "schedule": "zbh1"}),
    (PERFORMER, {}, "data:2; model:2", TP),
    (PERFORMER, {"feature": "favor"}, "model:3", "seq:model"),                    # the cumsums over a split seq
    (PERFORMER, {"causal": False}, "model:3", "seq:model"),
    (PERFORMER, {}, "model:3", "feats:model"),
    (PERFORMER, {"chunked": True}, "model:3", "chunks:model"),                    # the exclusive cumsum over chunks
    (PERFORMER, {"chunked": True, "feature": "favor"}, "model:2", "pos:model"),
    (PERFORMER, {"layers": 4, "remat": "selective"}, "stage:2", "layer:stage", INTERLEAVED),
    (FUNNEL, {}, "data:2; model:2", TP),
    (FUNNEL, {}, "model:4", "seq:model; pooled:model"),                           # pooled where it lies
    (FUNNEL, {"pool": "strided"}, "model:3", "seq:model"),
    (FUNNEL, {}, "data:3", "batch:data; params.d_model:data"),
    (FUNNEL, {"remat": "full"}, "stage:2", STACKS, PIPE),                         # the two lengths' stacks
    (FUNNEL, {"batch": 8}, "stage:2", STACKS, INTERLEAVED),
    (UNIVERSAL, {"mix": "soft"}, "data:2; model:2", TP),
    (UNIVERSAL, {}, "model:3", "seq:model"),
    (UNIVERSAL, {}, "stage:2", "step:stage", {**PIPE, "schedule": "zbh1"}),       # shared weights' sums per stage
    (UNIVERSAL, {"steps": 6, "step_emb": "constant"}, "stage:2", "step:stage",
     {**INTERLEAVED, "schedule": "interleaved:3"}),
    (MTP, {}, "data:2; model:2", TP),
    (MTP, {"shift": "shift"}, "model:3", "seq:model"),
    (MTP, {}, "model:2", "vocab:model"),
    (MTP, {}, "stage:2; data:2", f"{DEPTHS}; batch:data", PIPE),                  # a count per depth (was refused)
    (MTP, {"shift": "shift"}, "stage:2", DEPTHS, {**PIPE, "schedule": "zbh1"}),   # both stacks (was an IndexError)
]


# more of the same kinds, with -m slow (the file keeps under 10 s on a quiet machine)
SLOW_CASES = [
    (HYENA, {}, "model:2", "filter_ff:model; proj:model"),
    (HYENA, {}, "data:2", "batch:data; params.d_model:data"),
    (HYENA, {"layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (PERFORMER, {}, "model:2", "e2:model"),
    (FUNNEL, {}, "stage:2; model:2", f"{STACKS}; seq:model; pooled:model", PIPE),
    (UNIVERSAL, {"mix": "soft", "remat": "selective"}, "model:2", "heads:model"),
    (MTP, {"remat": "full"}, "stage:2; model:2", f"{DEPTHS}; heads:model", PIPE),
    (MTP, {"batch": 8}, "stage:2", DEPTHS, INTERLEAVED),                          # 4.5 s
]


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[heldout_case_id(c) for c in CASES + SLOW_CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


def _dense(model, outputs):
    return md.run_dense(outputs, model.feeds(0))


def test_the_models_other_forms_compute_the_same_thing():
    """The chunked linear attention is the cumsum form; the MTP's shifted inputs by ``md.shift`` are
    the one-hot shift matrix's; a longer Hyena filter and a per-step embedding change the loss."""
    def loss(path, **over):
        m = md.load_model(path, tiny=True, **over)
        return float(_dense(m, {"l": m.loss})["l"])

    # the same sums in another order (per chunk, then across): fp32 rounding, ~1e-7 relative
    assert loss(PERFORMER, chunked=True) == pytest.approx(loss(PERFORMER), rel=1e-5)
    assert loss(MTP, shift="shift") == pytest.approx(loss(MTP), rel=1e-5)
    assert abs(loss(HYENA) - loss(HYENA, filter_len=2)) > 1e-3
    assert abs(loss(UNIVERSAL) - loss(UNIVERSAL, step_emb="constant")) > 1e-3


def test_a_per_layer_mean_by_a_count_made_before_the_stack_runs_under_micro_batches():
    """A stacked per-layer count made from the inputs divides each layer's sum (the MTP's masked
    mean per depth). The count gets no gradient, but the repeat's backward differentiated every
    stacked tensor: the count's gradient read the layer's micro-batch-partial mean, so the layer
    saved it and micro-batches were refused. Now the backward leaves it out."""
    b, d, layer = md.Dim("batch", 4), md.Dim("d_model", 3), md.Dim("layer", 2)
    with md.Graph():
        x = md.input("x", [b, d])
        mask = md.input("mask", [layer, b])
        w = md.param("w", [layer, d, md.Dim("d_out", 3)], fan_out=["layer", "d_out"])

        def block(h, p):
            y = md.rename(md.einsum("batch d_model, d_model d_out -> batch d_out", h, p["w"]), d_out="d_model")
            h = h + md.tanh(y)
            return h, {"aux": md.reduce_sum(md.reduce_sum(h * h, "d_model") * p["mask"]) / p["count"]}

        _, per = md.repeat(block, x, {"w": w, "mask": mask, "count": md.reduce_sum(mask, "batch")}, "layer")
        loss = md.reduce_sum(per["aux"], "layer")
        outs = {"loss": loss, **md.grad(loss, {"w": w})}
    gen = torch.Generator().manual_seed(0)
    feeds = {"x": torch.randn(4, 3, generator=gen), "mask": (torch.rand(2, 4, generator=gen) > 0.3).float()}
    want = md.run_dense(outs, feeds)
    for mesh, layout, kw in (("data:1", "", {"microbatches": 2}), ("stage:2", "layer:stage", PIPE)):
        got = md.run_simulated(md.compile(outs, mesh, layout, **kw), feeds)
        for k in want:
            # the micro-batches' sums added in another order: fp32 rounding, ~1e-7 relative
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw", [{"stage_layers": (3, 1)}, {"stage_layers": (1, 3)}, INTERLEAVED, "two stacks", "mask"],
                         ids=["unequal-3-1", "unequal-1-3", "interleaved2", "two-stacks", "two-stacks-mask"])
def test_a_stacked_tensor_made_before_the_stack_is_cut_as_its_layers_are_stored(kw):
    """A stacked tensor made before the stack from the inputs (a concat of per-layer copies, as the
    MTP's shifted targets) reaches the stage axis by a split step. The pipeline passes store the
    layers at the stages' counts (unequal stages), block-cyclically (virtual stages) or whole on
    one stage (a stack on one stage of several) after lowering, but the split still cut evenly:
    an IndexError for unequal stages and two stacks, wrong numbers under interleaved:2. A stacked
    mask of positions broadcast over the batch (``mask``) is made by a local step that computed
    one layer's part where its stack is stored whole (an internal expand error)."""
    b, d, layer, depth = md.Dim("batch", 4), md.Dim("d_model", 3), md.Dim("layer", 4), md.Dim("depth", 2)
    two = kw in ("two stacks", "mask")
    with md.Graph():
        x = md.input("x", [b, d])
        w = md.param("w", [layer, d, md.Dim("d_out", 3)], fan_out=["layer", "d_out"])
        v = md.param("v", [depth, d, md.Dim("d_out", 3)], fan_out=["depth", "d_out"])

        def block(h, p):
            y = md.rename(md.einsum("batch d_model, d_model d_out -> batch d_out", h, p["w"]), d_out="d_model")
            return h + md.tanh(y) + p["e"] if "e" in p else h + md.tanh(y)

        def stacked(dim):
            if kw == "mask":   # [depth, d_model]: feature k + 1 on at depth k, broadcast over the batch
                rows = [md.unsqueeze(md.cast(md.less(md.arange(d), k + 2), torch.float32), dim.name, 0)
                        for k in range(dim.size)]
                return md.broadcast_to(md.concat(rows, dim.name), [dim, b, d])
            return md.concat([md.unsqueeze(x * float(k + 1), dim.name, 0) for k in range(dim.size)], dim.name)

        if two:
            h = md.repeat(block, md.repeat(block, x, {"w": w}, "layer"), {"w": v, "e": stacked(depth)}, "depth")
        else:
            h = md.repeat(block, x, {"w": w, "e": stacked(layer)}, "layer")
        loss = md.reduce_mean(h ** 2)
        outs = {"loss": loss, **md.grad(loss, {"w": w, "v": v} if two else {"w": w})}
    feeds = {"x": torch.randn(4, 3, generator=torch.Generator().manual_seed(0))}
    want = md.run_dense(outs, feeds)
    layout, kw = ("layer:stage; depth:stage", PIPE) if two else ("layer:stage", {**PIPE, **kw})
    got = md.run_simulated(md.compile(outs, "stage:2", layout, **kw), feeds)
    for k in want:
        # the micro-batches' gradients summed in another order: fp32 rounding, ~1e-7 relative
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_a_split_over_the_minor_axis_of_a_group_cuts_the_local_part_of_an_uneven_dim():
    """``{batch:data} -> {batch:(data, model)}`` is a split step over ``model`` of a tensor already
    cut over ``data``: the stored cut of the layout pipelines use is global, and was applied to the
    local part (batch 6 on 2x2: 'start (3) + length (2) exceeds dimension size (3)')."""
    b, h, d = md.Dim("batch", 6), md.Dim("height", 4), md.Dim("d", 2)
    with md.Graph():
        x, w = md.input("x", [b, h, d]), md.param("w", [d])
        y = md.rearrange(x * w, "batch (h p) d -> batch h p d", p=2)
        loss = md.reduce_sum(y * y)
        outs = {"loss": loss, **md.grad(loss, {"w": w})}
    feeds = {"x": torch.randn(6, 4, 2, generator=torch.Generator().manual_seed(0))}
    want = md.run_dense(outs, feeds)
    got = md.run_simulated(md.compile(outs, "data:2; model:2", "batch:(data, model)"), feeds)
    for k in want:
        # sums over the batch's parts in another order: fp32 rounding, ~1e-7 relative
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_a_soft_mix_over_the_steps_is_refused_in_a_pipeline_naming_the_outputs():
    """A softmax over ``step`` of the per-step halting logits needs every stage's steps at once:
    a pipeline refuses it, naming the per-layer outputs and the op that joins the stages."""
    model = md.load_model(UNIVERSAL, tiny=True, mix="soft")
    outs = {"loss": model.loss, **md.grad(model.loss, model.params)}
    with pytest.raises(md.LayoutError, match=r"(?s)\['halt', 'state'\].*softmax"):
        md.compile(outs, "stage:2", "step:stage", **PIPE)


def test_the_cli_checks_the_depth_stacks_pipelined(capsys):
    """``meshdsl check`` on the MTP model, its two stacks pipelined with data parallelism (zbh1)."""
    code, out, err = run_cli(capsys, ["check", MTP, "--tiny", "--mesh", "stage:2; data:2", "--layout",
                                 f"{DEPTHS}; batch:data", "--microbatches", "2", "--schedule", "zbh1"])
    assert code == 0 and "OK:" in out, out + err


# each search takes 3-10 s on a quiet machine: with -m slow
@pytest.mark.slow
@pytest.mark.parametrize("path", [HYENA, PERFORMER, FUNNEL, UNIVERSAL, MTP], ids=["hyena", "performer", "funnel",
                                                                                  "universal", "mtp"])
def test_the_searchs_top_layouts_match_dense(path, monkeypatch, tmp_path):
    """``md.search_layouts`` on 4 processes (the default calibration): its three best candidates
    compile and give the dense program's loss and gradients."""
    assert_search_top_layouts_match_dense(path, monkeypatch, tmp_path)
