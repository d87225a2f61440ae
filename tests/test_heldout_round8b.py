"""Held-out models of round 8b (written from the README and docs alone): vision and multimodal.

``tests/heldout_cait.py`` (a self-attention stack, then a class-attention stack whose class token
attends to the frozen patches, LayerScale); ``tests/heldout_llava.py`` (a vision tower, a projector
to the LM width, image tokens concatenated with the text's along ``seq``, a causal LM over both,
the loss on the text positions only; ``freeze_vision`` leaves the tower frozen);
``tests/heldout_maxvit.py`` (MBConv with a depthwise conv and a squeeze-excitation gate, block
attention in local windows and grid attention over a dilated grid, both by ``md.rearrange``);
``tests/heldout_segformer.py`` (two stages of different widths, spatial-reduction attention and a
Mix-FFN, patch merging by a strided reshape, an all-MLP decoder upsampling and concatenating the
stages, per-pixel cross-entropy); ``tests/heldout_ast.py`` (a spectrogram cut into overlapping
2-D patches by a strided conv, an encoder, mean pooling, multi-label BCE);
``tests/heldout_detr.py`` (fixed object queries cross-attending to an encoder's output, class and
box losses against matched targets, an auxiliary loss from every decoder layer as per-layer
outputs). Each under data, Megatron, FSDP, split spatial dims (uneven too), 1f1b / zbh1 /
interleaved pipelines with micro-batches, two stacks on one stage axis, forward and gradients
against the dense program; the layout search's top candidates on two; one gloo case.

What they led to: a block that divides by a whole-batch count of the inputs it sums itself (a
DETR layer's class-weight total, ``reduce_sum(weights)`` of a tensor read from outside) is refused
under micro-batches; the refusal named only the division's numerator. It now names the count, what
it is made from, and says to make it before the repeat, where it is made once per step
(``lowering/repeat.py``).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import (assert_heldout_case_matches_dense, assert_ranks_match_dense,
                      assert_search_top_layouts_match_dense, heldout_case_id, heldout_outputs,
                      held_outputs_on_this_rank)

HERE = Path(__file__).parent
CAIT, LLAVA, MAXVIT, SEG, AST, DETR = (str(HERE / f"heldout_{n}.py") for n in
                                       ("cait", "llava", "maxvit", "segformer", "ast", "detr"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}
INTER = {"microbatches": 2, "schedule": "interleaved:2"}
FROZEN = {"freeze_vision": True}

# (model, config overrides, mesh, layout, compile keywords)
CASES = [
    (CAIT, {}, "data:2; model:2", "batch:data; heads:model; d_ff:model"),
    (CAIT, {}, "data:3", "patches:data"),                                 # 16 patches on 3 ranks
    (CAIT, {}, "data:2", "tokens:data"),                                  # the class stack's concat split
    (CAIT, {}, "data:3", "batch:data; params.d_model:data"),              # FSDP, 4 rows on 3 ranks
    (CAIT, {}, "stage:2", "layer:stage; ca_layer:stage", PIPE),           # both stacks on one axis
    (CAIT, {}, "stage:2", "layer:stage; ca_layer:stage", INTER),
    (CAIT, {}, "stage:2; data:2", "layer:stage; ca_layer:stage; patches:data", PIPE),
    (LLAVA, {}, "data:2; model:2", "batch:data; heads:model; d_ff:model; v_heads:model"),
    (LLAVA, {}, "data:2; model:2", "batch:data; vocab:model; v_ff:model"),
    (LLAVA, {}, "data:3", "seq:data"),                                    # image and text rows cut
    (LLAVA, {}, "data:2", "tgt:data"),                                    # the text positions split
    (LLAVA, {}, "data:3", "batch:data; params.d_model:data; params.d_vis:data"),
    (LLAVA, {}, "stage:2", "layer:stage; v_layer:stage", PIPE),           # the tower then the LM
    (LLAVA, {}, "stage:2", "layer:stage; v_layer:stage", INTER),
    (LLAVA, FROZEN, "stage:2; model:2", "layer:stage; v_layer:stage; heads:model", PIPE),
    (LLAVA, FROZEN, "data:2", "batch:data; params.d_vis:data"),           # the frozen tower sharded
    (MAXVIT, {}, "data:2; model:2", "batch:data; heads:model; d_ff:model; d_exp:model"),
    (MAXVIT, {}, "data:2; model:2", "hp:data; wp:model"),                 # both grid dims split
    (MAXVIT, {}, "data:3", "hp:data"),                                    # 8 rows on 3 ranks
    (MAXVIT, {}, "model:2", "win:model"),
    (MAXVIT, {}, "data:3", "wp:data; params.d_exp:data"),
    (MAXVIT, {}, "stage:2; data:2", "layer:stage; hp:data", PIPE),
    (MAXVIT, {"layers": 4}, "stage:2", "layer:stage", INTER),
    (SEG, {}, "data:2; model:2", "batch:data; heads:model; f1:model; f2:model"),
    (SEG, {}, "data:2; model:2", "h1:data; w1:model"),
    (SEG, {}, "data:3", "h2:data"),                                       # stage 2's 4 rows on 3 ranks
    (SEG, {}, "model:2", "d_cat:model"),                                  # the decoder's concat split
    (SEG, {}, "data:2", "batch:data; params.d1:data; params.d2:data"),
    (SEG, {}, "stage:2", "layer1:stage; layer2:stage", PIPE),             # two stages' stacks on one axis
    (SEG, {}, "stage:2", "layer1:stage; layer2:stage", INTER),
    (SEG, {}, "stage:2; data:2", "layer1:stage; layer2:stage; h1:data", PIPE),
    (AST, {}, "data:2; model:2", "batch:data; heads:model; d_ff:model"),
    (AST, {}, "data:2; model:2", "freq:data; time:model"),                # the strided conv's phases split
    (AST, {}, "data:4", "time:data"),                                     # 11 columns on 4 ranks
    (AST, {}, "data:3", "patches:data"),
    (AST, {}, "model:3", "labels:model"),
    (AST, {}, "data:2", "batch:data; params.d_model:data"),
    (AST, {}, "stage:2; data:2", "layer:stage; time:data", PIPE),
    (DETR, {}, "data:2; model:2", "batch:data; heads:model; d_ff:model"),
    (DETR, {}, "data:2; model:2", "mem:data; queries:model"),
    (DETR, {}, "data:3", "queries:data"),
    (DETR, {}, "data:2", "batch:data; params.d_model:data"),
    (DETR, {}, "stage:2", "layer:stage", PIPE),                           # per-layer losses pipelined
    (DETR, {}, "stage:2; data:2", "layer:stage; enc_layer:stage; mem:data", PIPE),
    (DETR, {"layers": 4}, "stage:2", "layer:stage", INTER),
    (DETR, {}, "stage:2", "layer:stage; enc_layer:stage", INTER),        # two stacks, per-layer losses
    (DETR, {}, "stage:2", "layer:stage", {"microbatches": 2, "schedule": "zbh1"}),
]


@pytest.mark.parametrize("case", CASES, ids=[heldout_case_id(c) for c in CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


def _dense(path, names, **over):
    """The tiny model and its dense ``names`` outputs (with the loss)."""
    model = md.load_model(path, tiny=True, **over)
    return model, md.run_dense({"loss": model.loss, **{n: model.outputs[n] for n in names}}, model.feeds(0))


def test_cait_layer_scale_at_zero_makes_each_branch_the_identity():
    """LayerScale multiplies each branch: at 0 every layer is the identity, so no attention or MLP
    weight gets a gradient (nor the self-attention stack's scales: with the class stack's
    branches at 0 the patches do not reach the loss), while the class stack's scales do."""
    model = md.load_model(CAIT, tiny=True, layer_scale=0.0)
    grads = md.run_dense(heldout_outputs(model), model.feeds(0))
    for pre in ("sa_", "ca_"):
        for w in ("wq", "wk", "wv", "w_fc"):
            assert float(grads[f"grad/{pre}{w}"].abs().max()) == 0.0, pre + w
    assert float(grads["grad/sa_g1"].abs().max()) == 0.0
    assert float(grads["grad/ca_g1"].abs().max()) > 1e-4 and float(grads["grad/ca_g2"].abs().max()) > 1e-4


def test_llava_loss_reads_the_text_positions_only():
    """Tokens past each row's text length change neither the loss nor its gradients (masked,
    causal), and the image does (the text attends to it)."""
    model = md.load_model(LLAVA, tiny=True)
    outs, feeds = heldout_outputs(model), model.feeds(0)
    base = md.run_dense(outs, feeds)
    padded = dict(feeds, tokens=feeds["tokens"].clone())
    for r, n in enumerate(feeds["text_len"].tolist()):
        padded["tokens"][r, n:] = (padded["tokens"][r, n:] + 1) % model.config.vocab
    assert not torch.equal(padded["tokens"], feeds["tokens"])
    for k, v in md.run_dense(outs, padded).items():     # the same kernels on the same kept values
        torch.testing.assert_close(v, base[k], rtol=1e-6, atol=1e-7, msg=k)
    moved = md.run_dense({"loss": model.loss}, dict(feeds, images=feeds["images"] + 1.0))["loss"]
    assert abs(float(moved - base["loss"])) > 1e-4


def test_ast_loss_is_torchs_multilabel_bce_on_its_logits():
    model, out = _dense(AST, ["logits"])
    want = torch.nn.functional.binary_cross_entropy_with_logits(out["logits"], model.feeds(0)["targets"])
    torch.testing.assert_close(out["loss"], want, rtol=1e-5, atol=0)     # fp32 rounding of the same terms


def test_detr_loss_is_every_layers_class_and_box_loss():
    """The loss is the sum of the per-layer losses; the last layer's is the weighted
    cross-entropy plus the L1 over the matched boxes, written in torch from its outputs."""
    model, out = _dense(DETR, ["layer_losses", "boxes", "logits"])
    cfg, feeds = model.config, model.feeds(0)
    torch.testing.assert_close(out["loss"], out["layer_losses"].sum(), rtol=1e-6, atol=0)
    cls, box = feeds["target_class"], feeds["target_box"]
    weight = torch.where(cls < cfg.classes, 1.0, cfg.eos_coef)
    ce = torch.nn.functional.cross_entropy(out["logits"].permute(0, 2, 1), cls, reduction="none")
    obj = (cls < cfg.classes).float()
    l1 = ((out["boxes"] - box).abs() * obj[..., None]).sum() / obj.sum().clamp(min=1)
    want = (ce * weight).sum() / weight.sum() + cfg.box_weight * l1
    torch.testing.assert_close(out["layer_losses"][-1], want, rtol=1e-5, atol=0)   # fp32 rounding


def _count_in_block(hoisted: bool):
    """Per-layer losses, each divided by a whole-batch count of the inputs: made in the block
    (built before the stack by the tracer: loop-invariant) or before the repeat by hand."""
    b, d, layer = md.Dim("batch", 4), md.Dim("d_model", 3), md.Dim("layer", 2)
    with md.Graph():
        x, wts = md.input("x", [b, d]), md.input("wts", [b])
        w = md.param("w", [layer, d, md.Dim("d_out", 3)], fan_out=["layer", "d_out"])
        total = md.reduce_sum(wts) if hoisted else None

        def block(h, p):
            h = md.tanh(md.rename(md.einsum("batch d_model, d_model d_out -> batch d_out", h, p["w"]), d_out="d_model"))
            count = total if hoisted else md.reduce_sum(wts)
            return h, {"loss": md.reduce_sum(md.reduce_sum(h ** 2, "d_model") * wts) / count}

        _, per = md.repeat(block, x, {"w": w}, "layer")
        loss = md.reduce_sum(per["loss"], "layer")
        outs = {"loss": loss, **md.grad(loss, {"w": w})}
    gen = torch.Generator().manual_seed(0)
    return outs, {"x": torch.randn(4, 3, generator=gen), "wts": torch.tensor([1.0, 0.0, 1.0, 1.0])}


@pytest.mark.parametrize("mesh, layout, kw", [("stage:2", "layer:stage", PIPE), ("data:1", "", {"microbatches": 2})])
def test_a_whole_batch_count_made_in_a_block_runs_under_micro_batches(mesh, layout, kw):
    """Once refused ('sums over the micro-batches in every layer'): the count reads only a tensor
    from outside the block, so it is built once before the stack (ir/closure.py, loop-invariant)."""
    outs, feeds = _count_in_block(hoisted=False)
    res = md.check(outs, mesh, layout, feeds, **kw)
    assert res.ok, str(res)


@pytest.mark.parametrize("mesh, layout, kw", [("stage:2", "layer:stage", PIPE), ("data:1", "", {"microbatches": 2})])
def test_the_count_made_before_the_repeat_pipelines(mesh, layout, kw):
    outs, feeds = _count_in_block(hoisted=True)
    res = md.check(outs, mesh, layout, feeds, **kw)
    assert res.ok, str(res)


def test_generate_on_a_vision_language_model_is_refused_naming_the_image_input():
    """``md.generate`` samples a text-only LM: logits that also read the images are refused
    (``meshdsl train`` then skips its samples), naming the inputs they read."""
    model = md.load_model(LLAVA, tiny=True)
    with pytest.raises(md.ModelError, match="read one integer input of token ids") as e:
        md.generate(model, {}, "ab", 3, 0.0, 0)
    assert "inputs the logits read: ['images', 'tokens']" in str(e.value)


# Both searches (segformer 6 s, pipelined candidates; ast 3 s) run with -m slow: the suite checks the
# search's top layouts against dense on round 7b's models (the same helper), and ast's layouts above
@pytest.mark.parametrize("path", [pytest.param(AST, marks=pytest.mark.slow), pytest.param(SEG, marks=pytest.mark.slow)],
                         ids=["ast", "segformer"])
def test_the_searchs_top_layouts_match_dense(path, monkeypatch, tmp_path):
    """``md.search_layouts`` on 4 processes (the default calibration): its three best candidates
    compile and give the dense program's loss and gradients."""
    assert_search_top_layouts_match_dense(path, monkeypatch, tmp_path)


def _llava_pipeline_on_two_processes(comm):
    torch.set_num_threads(1)
    m = md.load_model(LLAVA, tiny=True)
    plan = md.compile(heldout_outputs(m), "stage:2", "layer:stage; v_layer:stage", **PIPE)
    return held_outputs_on_this_rank(comm, plan, m.feeds(0))


@pytest.mark.slow   # by default: this plan simulated (CASES' LLAVA stage:2 PIPE row), two stacks pipelined on gloo
# in tests/test_two_stacks.py::test_two_stacks_on_gloo_processes
@pytest.mark.timeout(200)
def test_llava_two_stacks_pipeline_on_two_gloo_processes():
    """The vision tower and the LM cut as one list of layers over 2 real processes, micro-batched:
    every output is the dense program's."""
    from meshdsl.processes import launcher
    m = md.load_model(LLAVA, tiny=True)
    want = md.run_dense(heldout_outputs(m), m.feeds(0))
    results = launcher.spawn(_llava_pipeline_on_two_processes, 2, mesh="stage:2", timeout=180)
    # fp32, O(1) values: the stages and micro-batches add the same terms in another order (~1e-7)
    assert_ranks_match_dense(results, want, 1e-5)
