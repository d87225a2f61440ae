"""Held-out models of round 8a (written from the README and docs alone): modern LLM architectures.

``tests/heldout_qwen2.py`` (q/k/v biases, grouped-query attention with the query heads as
``[kv_heads, group]`` in the weights, RoPE theta 1e6, tied embeddings, RMSNorm);
``tests/heldout_gemma2.py`` (local and global attention alternating inside ONE ``md.repeat``,
each layer's window a stacked ``[layer]`` constant or fed input, pre- and post-norms, tanh
soft-capped attention and final logits, GeGLU, embeddings times sqrt(d_model));
``tests/heldout_mla.py`` (DeepSeek-V2 multi-head latent attention: a normed low-rank kv latent
up-projected to per-head keys and values, a decoupled rotary key shared by every head and
concatenated to the non-rotary part along ``d_head``, a low-rank query);
``tests/heldout_phi3.py`` (a fused qkv weight ``[d_model, qkv, heads, d_head]`` and gate_up
weight sliced apart, or their flat checkpoint form rearranged to heads, or unfused);
``tests/heldout_starcoder.py`` (multi-query attention: one key/value head, k and v with no
``heads`` dim); ``tests/heldout_mixtral_gqa.py`` (top-2 MoE with GQA and RoPE under one repeat,
a balance loss and a router z-loss per layer, expert parallel and pipelined). Each runs under
data, Megatron, sequence/key, FSDP, uneven, pipeline (1f1b, zbh1, interleaved:2) and remat
layouts against the dense program. Findings: /work/notes/heldout-8a.md.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import (assert_heldout_case_matches_dense, assert_search_top_layouts_match_dense, heldout_case_id,
                      heldout_outputs)

HERE = Path(__file__).parent
QWEN2, GEMMA2, MLA, PHI3, STARCODER, MIXTRAL = (
    str(HERE / f"heldout_{n}.py") for n in ("qwen2", "gemma2", "mla", "phi3", "starcoder", "mixtral_gqa"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}
INTERLEAVED = {"microbatches": 4, "schedule": "interleaved:2"}
TP = "batch:data; heads:model; d_ff:model"
GQA_TP = "batch:data; kv_heads:model; d_ff:model"
EP = "layer:stage; batch:data; experts:data"

# (model, config overrides, mesh, layout, compile keywords)
CASES = [
    (QWEN2, {}, "data:2; model:2", GQA_TP),                                      # the biases split with their heads
    (QWEN2, {}, "model:2", "group:model; d_ff:model"),                           # the query heads within a group
    (QWEN2, {}, "model:3", "seq:model"),                                         # 8 positions on 3 ranks
    (QWEN2, {}, "data:3", "batch:data; params.d_model:data"),
    (QWEN2, {}, "stage:2", "layer:stage", PIPE),
    (QWEN2, {"remat": "selective"}, "stage:2; model:2", "layer:stage; kv_heads:model", {**PIPE, "schedule": "zbh1"}),
    (GEMMA2, {}, "data:2; model:2", GQA_TP),
    (GEMMA2, {}, "model:2", "seq:model"),                                        # the per-layer mask split by query
    (GEMMA2, {}, "model:3", "key_seq:model"),                                    # ... and by key, unevenly
    (GEMMA2, {"window_from": "input"}, "data:2", "batch:data; params.d_model:data"),
    (GEMMA2, {}, "stage:2", "layer:stage", PIPE),                                # a local and a global layer per stage
    (GEMMA2, {"window_from": "input"}, "stage:2", "layer:stage", INTERLEAVED),  # the fed windows block-cyclic
    (GEMMA2, {}, "stage:2", "layer:stage", INTERLEAVED),                         # the constant windows too (was wrong)
    (GEMMA2, {"remat": "full"}, "stage:2", "layer:stage", {**INTERLEAVED, "schedule": "interleaved-zb:2"}),
    (GEMMA2, {"window_from": "input"}, "stage:2", "layer:stage", {**PIPE, "stage_layers": (3, 1)}),
    (GEMMA2, {"remat": "selective"}, "model:2", "kv_heads:model"),
    (GEMMA2, {}, "model:3", "d_model:model"),                                    # four norms a layer over a split dim
    (MLA, {}, "data:2; model:2", TP),                                            # the shared rotary key whole
    (MLA, {}, "model:2", "kv_latent:model"),                                     # the latent's norm over a split dim
    (MLA, {}, "model:3", "heads:model; d_ff:model"),                             # 4 heads on 3 ranks
    (MLA, {}, "model:2", "seq:model"),
    (MLA, {}, "model:3", "key_seq:model"),
    (MLA, {}, "model:2", "d_head:model"),                                        # the concat of nope and rope split
    (MLA, {}, "data:3", "batch:data; params.d_model:data"),
    (MLA, {}, "stage:2", "layer:stage", PIPE),
    (MLA, {"layers": 4, "remat": "selective"}, "stage:2", "layer:stage", INTERLEAVED),
    (MLA, {"absorb": True}, "data:2; model:2", TP),                              # scores against the latent
    (MLA, {"absorb": True}, "model:2", "kv_latent:model"),                       # ... as partial sums
    (MLA, {"absorb": True}, "model:3", "key_seq:model"),
    (MLA, {"remat": "selective"}, "stage:2; model:2", "layer:stage; kv_latent:model", PIPE),
    (MLA, {"absorb": True}, "stage:2", "layer:stage", {**PIPE, "schedule": "zbh1"}),
    (PHI3, {}, "data:2; model:2", TP),
    (PHI3, {"fused": "flat"}, "data:2; model:2", TP),
    (PHI3, {"fused": "flat"}, "model:2", "qkv_flat:model; gate_up_flat:model"),  # cut at the q|k|v borders
    (PHI3, {}, "model:3", "qkv:model"),                                          # q, k, v one per rank
    (PHI3, {}, "model:2", "gate_up:model"),                                      # gate and up on other ranks
    (PHI3, {}, "model:2", "seq:model"),
    (PHI3, {"fused": "flat"}, "data:3", "batch:data; params.d_model:data"),
    (PHI3, {"fused": "flat"}, "stage:2", "layer:stage", PIPE),
    (PHI3, {"fused": "reshape"}, "data:2; model:2", TP),                         # md.reshape instead of rearrange
    (PHI3, {"fused": "reshape"}, "model:3", "qkv:model; gate_up:model"),
    (PHI3, {"fused": "dims", "layers": 4}, "stage:2", "layer:stage", INTERLEAVED),
    (STARCODER, {}, "data:2; model:2", TP),                                      # k, v whole on every rank
    (STARCODER, {"attention": "composite"}, "data:2; model:2", TP),
    (STARCODER, {}, "model:3", "heads:model"),
    (STARCODER, {}, "model:2", "seq:model"),
    (STARCODER, {}, "model:2", "key_seq:model"),
    (STARCODER, {"attention": "composite"}, "model:3", "key_seq:model"),
    (STARCODER, {}, "data:2; model:2", "seq:data; heads:model"),                 # sequence and heads together
    (STARCODER, {}, "data:2", "batch:data; params.d_model:data"),
    (STARCODER, {}, "model:2", "d_model:model"),                                 # layer norms over a split dim
    (STARCODER, {}, "stage:2; model:2", "layer:stage; heads:model", PIPE),
    (STARCODER, {"remat": "selective"}, "model:2", "heads:model; d_ff:model"),
    (MIXTRAL, {}, "data:2", "batch:data; experts:data"),
    (MIXTRAL, {"capacity_factor": 1.0}, "data:2; model:2", "batch:data; experts:data; d_ff:model; kv_heads:model"),
    (MIXTRAL, {}, "stage:2; data:2", EP, PIPE),                                  # the brief's layout
    (MIXTRAL, {"capacity_factor": 1.0}, "stage:2; data:2", EP, {**PIPE, "schedule": "zbh1"}),
    (MIXTRAL, {"layers": 4, "batch": 8}, "stage:2; data:2", EP, INTERLEAVED),
    (MIXTRAL, {}, "model:3", "seq:model"),                                       # the queues' cumsum over a split seq
    (MIXTRAL, {}, "data:3", "batch:data; params.d_model:data"),
    (MIXTRAL, {"remat": "selective"}, "data:2", "batch:data; experts:data"),
]


@pytest.mark.parametrize("case", CASES, ids=[heldout_case_id(c) for c in CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


def _dense(model, outputs):
    return md.run_dense(outputs, model.feeds(0))


def test_gemma2_local_layers_see_only_their_window():
    """The even layers' window matters (a wider one changes the loss), the odd layers are global
    (their window is the whole sequence), and a fed ``windows`` gives the constant's numbers."""
    base = md.load_model(GEMMA2, tiny=True)
    wide = md.load_model(GEMMA2, tiny=True, window=base.config.seq)
    fed = md.load_model(GEMMA2, tiny=True, window_from="input")
    a, b, c = (float(_dense(m, {"l": m.loss})["l"]) for m in (base, wide, fed))
    assert abs(a - b) > 1e-4 and a == c


def test_phi3_fused_weights_are_the_unfused_model_and_plan_the_same_collectives():
    """The fused qkv and gate_up weights, cut apart, give the unfused model's loss when they hold
    its weights; under Megatron the fused-by-dims plan moves exactly what the unfused one does, and
    so does the flat checkpoint form: ``heads`` is an inner part of ``(qkv heads d_head)`` (and
    ``d_ff`` of ``(gate_up d_ff)``), so the flat dims are split block-cyclically
    (lowering/cyclic_dims.py), where their projections ran whole and their gradients were
    allgathered."""
    fused, plain = md.load_model(PHI3, tiny=True), md.load_model(PHI3, tiny=True, fused="none")
    w = md.run_dense(dict(fused.params))
    unfused = {**{k: t for k, t in w.items() if k not in ("wqkv", "w_gate_up")},
               "wq": w["wqkv"][:, :, 0], "wk": w["wqkv"][:, :, 1], "wv": w["wqkv"][:, :, 2],
               "w_gate": w["w_gate_up"][:, :, 0], "w_up": w["w_gate_up"][:, :, 1]}
    a = md.run_dense({"l": fused.loss}, fused.feeds(0), w)["l"]
    b = md.run_dense({"l": plain.loss}, plain.feeds(0), unfused)["l"]
    torch.testing.assert_close(a, b, rtol=0, atol=0)      # the same kernels on the same numbers
    totals = {f: md.compile(heldout_outputs(md.load_model(PHI3, tiny=True, fused=f)), "data:2; model:2", TP).totals()
              for f in ("none", "dims", "flat")}
    assert totals["dims"] == totals["none"] == totals["flat"] and "allgather" not in totals["none"], totals


def test_mla_absorbed_form_is_the_same_attention():
    """DeepSeek's inference form (w_uk folded into the query, w_uv after the weighted sum of
    latents) gives the explicit per-head keys' and values' loss and gradients."""
    a, b = md.load_model(MLA, tiny=True), md.load_model(MLA, tiny=True, absorb=True)
    ga, gb = _dense(a, heldout_outputs(a)), _dense(b, heldout_outputs(b))
    for k in ga:
        # the same products contracted in another order: fp32 rounding, ~1e-7 relative
        torch.testing.assert_close(gb[k], ga[k], rtol=1e-4, atol=1e-6)


def test_starcoder_keys_and_values_stay_whole_under_heads_model():
    """Multi-query: k and v have no heads dim, so ``heads:model`` keeps them whole on each rank:
    nothing is gathered, every collective is an allreduce of a partial sum (the block outputs'
    and, in the backward, the inputs' and, in one bucket, the shared k and v weights' gradients:
    tests/test_comm_audit.py)."""
    model = md.load_model(STARCODER, tiny=True)
    counts = md.compile(heldout_outputs(model), "model:2", "heads:model; d_ff:model").totals()
    assert set(counts) == {"allreduce", "bucket_allreduce"}, counts


def test_mixtral_per_layer_losses_are_positive_and_read_by_the_loss():
    """The balance loss is >= 1 (it is 1 at a perfectly even routing) and the z-loss > 0 in every
    layer; turning their weights off lowers the loss by their weighted sums."""
    model = md.load_model(MIXTRAL, tiny=True)
    off = md.load_model(MIXTRAL, tiny=True, aux_weight=0.0, z_weight=0.0)
    got = _dense(model, {"l": model.loss, **model.outputs})
    bal, z = got["moe/balance"], got["moe/z"]
    assert bal.shape == (2,) and bool((bal >= 1 - 1e-6).all()) and bool((z > 0).all())
    want = float(_dense(off, {"l": off.loss})["l"]) + 0.02 * float(bal.sum()) + 0.001 * float(z.sum())
    # the same fp32 terms added in another order: ~1e-7 relative
    assert abs(float(got["l"]) - want) < 1e-5 * want


def test_mla_latent_norm_over_a_split_latent_moves_no_activation():
    """``kv_latent:model``: the latent's RMSNorm arrives split along the normalised dim. It was
    gathered (10 allgathers a step); as the composite its mean of squares is allreduced (a value
    per row), and the backward's row mean times the split rows reduces the mean, not the rows."""
    model = md.load_model(MLA, tiny=True)
    counts = md.compile(heldout_outputs(model), "model:2", "kv_latent:model").totals()
    # allreduces only (neighbouring ones may go in one buffer: lowering/coalesce.py)
    assert set(counts) <= {"allreduce", "bucket_allreduce"} and "allreduce" in counts, counts


def test_a_row_sum_times_the_rows_split_along_it_reduces_the_sum():
    """``x * reduce_sum(x * x, d)`` with ``d`` split (the sum read once): the product is linear in
    the partial row sum, but keeping it partial would gather ``x`` (and reduce-scatter the
    product); the sum (one value per row, 32 B) is allreduced instead."""
    b, d = md.Dim("batch", 8), md.Dim("d", 16)
    with md.Graph():
        x = md.param("x", [b, d])
        outs = {"y": x * md.reduce_sum(x * x, "d")}
    plan = md.compile(outs, "model:2", "d:model", strict_splits=True)
    assert plan.totals() == {"allreduce": {"count": 1, "bytes": 32}}, plan.totals()
    want, got = md.run_dense(outs), md.run_simulated(plan, {})
    for k in want:
        # the row sums added in two halves: fp32 rounding, ~1e-7 relative
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw", [{**INTERLEAVED, "schedule": "interleaved:3"}, {**INTERLEAVED, "stage_layers": (2, 1, 1, 2)}],
                         ids=["interleaved3", "unequal-chunks"])
def test_a_stacked_constant_and_arange_under_virtual_stages(kw):
    """A ``[layer]`` constant and ``md.arange(layer)`` stacked beside the weights: under virtual
    stages each rank holds its chunks' layers (r, r + p, ...), so the kernels making them run once
    per block. They read one contiguous slice (rank 0 got layers 0-2, not 0 and 3-4: the loss
    was 20.0 against the dense 27.5)."""
    b, d, layer = md.Dim("batch", 4), md.Dim("d_model", 3), md.Dim("layer", 6)
    with md.Graph():
        x = md.input("x", [b, d])
        w = md.param("w", [layer, d, md.Dim("d_out", 3)], fan_out=["layer", "d_out"])
        scale = md.constant(torch.arange(6.0) * 0.5 + 1, [layer])

        def block(h, p):
            y = md.rename(md.einsum("batch d_model, d_model d_out -> batch d_out", h, p["w"]), d_out="d_model")
            return h + md.tanh(y) * p["scale"] + 0.1 * p["index"]

        stacked = {"w": w, "scale": scale, "index": md.cast(md.arange(layer), torch.float32)}
        loss = md.reduce_mean(md.repeat(block, x, stacked, "layer") ** 2)
        outs = {"loss": loss, **md.grad(loss, {"w": w})}
    feeds = {"x": torch.randn(4, 3, generator=torch.Generator().manual_seed(0))}
    want = md.run_dense(outs, feeds)
    got = md.run_simulated(md.compile(outs, "stage:2", "layer:stage", **kw), feeds)
    for k in want:
        # the same fp32 ops; the micro-batches' gradients summed in another order (~1e-7 relative)
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


# Both searches (gemma2 4 s, mla 3 s) run with -m slow: the suite checks the search's top layouts
# against dense on round 7b's models (the same helper), and mla's layouts above
@pytest.mark.parametrize("path", [pytest.param(GEMMA2, marks=pytest.mark.slow), pytest.param(MLA, marks=pytest.mark.slow)],
                         ids=["gemma2", "mla"])
def test_the_searchs_top_layouts_match_dense(path, monkeypatch, tmp_path):
    """``md.search_layouts`` on 4 processes (the default calibration): its three best candidates
    compile and give the dense program's loss and gradients."""
    assert_search_top_layouts_match_dense(path, monkeypatch, tmp_path)
