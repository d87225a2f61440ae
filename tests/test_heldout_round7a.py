"""Held-out models of round 7a (written from the README and docs alone): language-model training variants.

``tests/heldout_lora.py`` (LoRA adapters on q and v of a frozen Llama-style decoder: the base
weights are md.params left out of the Model's params, or fed as inputs with ``frozen="input"``);
``tests/heldout_albert.py`` (one layer's weights shared by every layer: a repeat with no stacked
params whose block reads them from outside, or their ``md.broadcast_to`` copies stacked with
``shared="broadcast"``; a factorized embedding); ``tests/heldout_distill.py`` (a frozen teacher
stack and a student stack on the same tokens, the KL of their softened distributions times T**2
plus the CE); ``tests/heldout_packed.py`` (documents packed in rows: a fed segment id makes a
block-diagonal causal mask, positions restart per document, labels of -100 masked out of a mean
over the real tokens); ``tests/heldout_mod.py`` (Mixture-of-Depths: per layer the router's top-k
tokens of each sequence go through the block, the rest skip it); ``tests/heldout_longformer.py``
(a sliding window plus fed per-example global tokens with projections of their own), each under
data, Megatron, sequence, FSDP, uneven and pipeline layouts against the dense program.

What they led to: a repeat with no stacked params under a ``layer:<axis>`` rule crashed inside the
runtime (an AttributeError on the split per-layer stacks: the repeat was not seen as a pipeline,
since a pipeline is found by its stacked params); ``md.repeat`` now stacks a layer index its
block does not see, and ALBERT's shared layer pipelines under every schedule, unequal stages
too. A layout rule scoped to a param with a dotted name (``teacher.wte.t_model:data``, as torch's
state_dict keys) was a ParseError; the dim is now the part after the last dot.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import assert_heldout_case_matches_dense, heldout_case_id, run_cli

HERE = Path(__file__).parent
LORA, ALBERT, DISTILL, PACKED, MOD, LONGFORMER = (
    str(HERE / f"heldout_{n}.py") for n in ("lora", "albert", "distill", "packed", "mod", "longformer"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}
INTERLEAVED = {"microbatches": 4, "schedule": "interleaved:2"}
TP = "batch:data; heads:model; d_ff:model"

# (model, config overrides, mesh, layout, compile keywords)
CASES = [
    (LORA, {}, "data:2; model:2", TP),                                          # Megatron beside frozen weights
    (LORA, {}, "data:2", "batch:data; params.d_model:data"),                    # FSDP of the adapters only
    (LORA, {}, "data:3", "batch:data"),                                         # 4 rows on 3 ranks
    (LORA, {}, "stage:2", "layer:stage", PIPE),
    (LORA, {"frozen": "input"}, "model:2", "seq:model"),                        # fed weights, split sequence
    (LORA, {"frozen": "input"}, "data:2", "batch:data; d_model:data"),          # fed weights cut by d_model
    (LORA, {"frozen": "input"}, "stage:2", "layer:stage", INTERLEAVED),         # fed [layer, ...] block-cyclic
    (ALBERT, {}, "data:2; model:2", TP),                                        # the shared layer's partial sums
    (ALBERT, {}, "model:2", "seq:model"),
    (ALBERT, {}, "data:2", "batch:data; params.d_model:data"),
    (ALBERT, {}, "model:3", "vocab:model"),                                     # 20 ids on 3 ranks, emb tied
    (ALBERT, {}, "stage:2", "layer:stage"),                                     # no stacked params, pipelined
    (ALBERT, {}, "stage:2; model:2", "layer:stage; heads:model", {"microbatches": 2, "schedule": "zbh1"}),
    (ALBERT, {}, "stage:2", "layer:stage", INTERLEAVED),                        # every chunk reads the shared layer
    (ALBERT, {}, "stage:3", "layer:stage", {**PIPE, "stage_layers": (1, 2, 1)}),
    (ALBERT, {"shared": "broadcast"}, "stage:2", "layer:stage", PIPE),           # the copies' gradients summed
    (ALBERT, {"shared": "broadcast"}, "stage:2", "layer:stage", INTERLEAVED),    # ... after the chunks join them
    (DISTILL, {}, "data:2; model:2", f"{TP}; t_heads:model; t_ff:model"),       # both stacks Megatron
    (DISTILL, {}, "model:2", "vocab:model"),                                     # KL over a split vocab
    (DISTILL, {}, "data:3", "batch:data; params.d_model:data"),
    (DISTILL, {}, "stage:2", "layer:stage", PIPE),                               # the student pipelined
    (DISTILL, {}, "stage:2", "t_layer:stage", PIPE),                             # the frozen teacher pipelined
    (DISTILL, {}, "stage:2", "layer:stage; t_layer:stage", PIPE),                # both, one after the other
    (DISTILL, {}, "stage:2", "layer:stage", INTERLEAVED),
    (DISTILL, {}, "data:2; model:2", "batch:data; teacher.wte.t_model:data; teacher.wqkv.t_heads:model"),
    (PACKED, {}, "data:2; model:2", TP),
    (PACKED, {}, "model:2", "seq:model"),                                        # the segment mask split by query
    (PACKED, {}, "model:3", "key_seq:model"),                                    # and by key, 4 each
    (PACKED, {}, "data:3", "batch:data; params.d_model:data"),                   # the real-token count, uneven
    (PACKED, {}, "stage:2; data:2", "layer:stage; batch:data", {"microbatches": 2, "schedule": "zbh1"}),
    (PACKED, {}, "stage:2", "layer:stage", INTERLEAVED),
    (MOD, {}, "data:2; model:2", TP),
    (MOD, {}, "model:3", "seq:model"),                                           # top-k over a split seq
    (MOD, {}, "model:2", "kept:model"),                                          # the picked tokens split
    (MOD, {}, "data:2", "batch:data; params.d_model:data"),
    (MOD, {}, "stage:2", "layer:stage", PIPE),                                   # per-layer router losses
    (MOD, {}, "stage:2", "layer:stage", INTERLEAVED),
    (LONGFORMER, {}, "data:2; model:2", TP),
    (LONGFORMER, {}, "model:3", "seq:model"),                                    # window and global rows split
    (LONGFORMER, {}, "model:2", "key_seq:model"),
    (LONGFORMER, {}, "data:3", "batch:data; params.d_model:data"),
    (LONGFORMER, {}, "stage:2", "layer:stage", PIPE),
    (LONGFORMER, {}, "stage:2", "layer:stage", INTERLEAVED),
]


@pytest.mark.parametrize("case", CASES, ids=[heldout_case_id(c) for c in CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


def _dense(model, outputs, feeds=None, params=None):
    return md.run_dense(outputs, model.feeds(0) if feeds is None else feeds, params)


def test_lora_is_the_base_model_with_merged_weights():
    """The adapters add (x A B) alpha/rank to q and v: the loss equals that of the base model whose
    wq, wv are merged (wq + A B alpha/rank) and whose B are zero."""
    model = md.load_model(LORA, tiny=True, frozen="input")
    feeds, cfg = model.feeds(0), model.config
    init = md.run_dense(dict(model.params))
    merged = dict(feeds)
    for w, a, b in (("wq", "q_a", "q_b"), ("wv", "v_a", "v_b")):
        merged[w] = feeds[w] + torch.einsum("ldr,lrhe->ldhe", init[a], init[b]) * (cfg.alpha / cfg.rank)
    zero_b = {**init, "q_b": torch.zeros_like(init["q_b"]), "v_b": torch.zeros_like(init["v_b"])}
    assert init["q_b"].abs().max() > 0
    # the same product summed in another order (x (A B) against (x A) B): fp32 rounding, ~1e-7 relative
    torch.testing.assert_close(_dense(model, {"l": model.loss}, merged, zero_b)["l"],
                               _dense(model, {"l": model.loss}, feeds, init)["l"], rtol=1e-5, atol=0)


def test_lora_trains_only_the_adapters(tmp_path):
    """md.fit with AdamW (whose weight decay would move any param it holds) keeps and updates the
    four adapters only, with the same losses on one rank and on a 1f1b pipeline; the eval after
    the last step is the dense loss of the trained adapters beside the base's initial weights."""
    kw = dict(optimizer="adamw", lr=0.01, steps=2, eval_every=2, samples=0)
    m1, m2 = md.load_model(LORA, tiny=True), md.load_model(LORA, tiny=True)
    held_out = [m2.feeds(99)]
    one = md.fit(m1, mesh="data:1", data=lambda t: m1.feeds(t), eval_data=held_out, out=str(tmp_path / "a"), **kw)
    pipe = md.fit(m2, mesh="stage:2", layout="layer:stage", microbatches=2, schedule="1f1b",
                  data=lambda t: m2.feeds(t), eval_data=held_out, out=str(tmp_path / "b"), **kw)
    adapters = pipe.step.full_params()
    assert sorted(adapters) == ["q_a", "q_b", "v_a", "v_b"]
    want = float(md.run_dense({"l": m2.loss}, held_out[0], adapters)["l"])   # frozen ones: their init
    # the same fp32 terms in another order (micro-batches, stages): ~1e-7 relative
    assert abs(pipe.final_eval_loss - want) < 1e-5 * want, (pipe.final_eval_loss, want)
    # micro-batches and stages add the same fp32 terms in another order: ~1e-7 relative
    torch.testing.assert_close(torch.tensor([r["loss"] for r in pipe.rows]),
                               torch.tensor([r["loss"] for r in one.rows]), rtol=1e-5, atol=0)
    assert one.rows[1]["loss"] != one.rows[0]["loss"]


def test_albert_shares_one_layer_and_its_broadcast_copies_give_the_same_numbers():
    """The block reading the one layer's params from outside, and the same params stacked by
    md.broadcast_to: the same loss and gradients (the copies' gradients summed over the layers)."""
    closure, stacked = md.load_model(ALBERT, tiny=True), md.load_model(ALBERT, tiny=True, shared="broadcast")
    a, b = _dense(closure, closure.train_step(0.1)), _dense(stacked, stacked.train_step(0.1))
    assert set(a) == set(b) and "grad/wq" in a and a["grad/wq"].shape == (16, 4, 4)
    for k in a:
        # the same fp32 sums over the layers, accumulated in the loop or by broadcast_to's gradient
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-7)


def test_a_repeat_with_no_stacked_params_pipelines_and_its_block_sees_none():
    """ALBERT's repeat of one shared layer under layer:stage: the carry goes between the stages and
    the block gets an empty dict. It was an AttributeError inside the runtime ('LayerStack' object
    has no attribute 'narrow'): a pipeline was found by its stacked params, and there were none."""
    seen = []
    d, layer = md.Dim("d", 3), md.Dim("layer", 2)
    with md.Graph():
        w = md.param("w", [d, md.Dim("e", 3)])
        x = md.input("x", [md.Dim("batch", 4), d])

        def block(h, p):
            seen.append(dict(p))
            return h + md.rename(md.tanh(md.einsum("batch d, d e -> batch e", h, w)), e="d")

        loss = md.reduce_mean(md.repeat(block, x, {}, layer) ** 2)
    assert seen == [{}]
    model = md.load_model(ALBERT, tiny=True)
    plan = md.compile(model.train_step(0.1), "stage:2", "layer:stage", **PIPE)
    assert plan.totals()["send"]["count"] > 0
    feeds = {"x": torch.randn(4, 3, generator=torch.Generator().manual_seed(0))}
    outs = {"loss": loss, **md.grad(loss, {"w": w})}
    got = md.run_simulated(md.compile(outs, "stage:2", "layer:stage", **PIPE), feeds)
    want = md.run_dense(outs, feeds)
    for k in want:
        # each stage sums its own layer's fp32 gradient of w, then the stages' sums are added
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7)


def test_distillation_reads_the_teacher_but_trains_only_the_student():
    """The KL is > 0 and shrinks at a higher temperature (both distributions flatten); the
    teacher's weights are not params (no gradient, no update)."""
    model = md.load_model(DISTILL, tiny=True)
    assert not any(k.startswith("teacher.") for k in model.params) and "wte" in model.params
    ids = {"ids": model.feeds(0)["ids"]}                 # the KL reads no labels
    kl = float(_dense(model, {"kl": model.outputs["kl"]}, ids)["kl"])
    hot = md.load_model(DISTILL, tiny=True, temperature=8.0)
    assert kl > 0 and float(_dense(hot, {"kl": hot.outputs["kl"]}, ids)["kl"]) < kl


def test_a_rule_scoped_to_a_dotted_param_name_applies_to_that_param_only():
    """'teacher.wte.t_model:data' (a dotted name, as torch's state_dict keys): it was a ParseError
    ("expected ':' after name 'wte'"); the string and the dict form now cut only that param."""
    from conftest import heldout_outputs
    model = md.load_model(DISTILL, tiny=True)
    outs = heldout_outputs(model)
    for layout in ("batch:data; teacher.wte.t_model:data", {"batch": "data", "teacher.wte.t_model": "data"}):
        plan = md.compile(outs, "data:2", layout)
        split = {k: plan.values[v].sharding.axes_of("t_model") for k, v in plan.params.items()
                 if "t_model" in plan.values[v].shape}
        assert split.pop("teacher.wte") == ("data",) and split and set(split.values()) == {()}, split
    with pytest.raises(md.LayoutError, match=r"scope 'teacher.wtee' is neither .* Did you mean 'teacher.wte'\?"):
        md.compile(outs, "data:2", "teacher.wtee.t_model:data")


def test_packed_documents_do_not_see_each_other_and_the_loss_is_torchs_ignore_index_mean():
    """Changing the tokens of a row's later documents leaves the logits of its first document as
    they were (block-diagonal), and the loss is torch's cross_entropy(ignore_index=-100) mean."""
    model = md.load_model(PACKED, tiny=True)
    feeds = model.feeds(0)
    inputs = {k: feeds[k] for k in ("ids", "segments", "positions")}       # the logits read no labels
    first = feeds["segments"] == 0
    other = {**inputs, "ids": torch.where(first, feeds["ids"], (feeds["ids"] + 7) % 20)}
    a, b = _dense(model, {"y": model.logits}, inputs), _dense(model, {"y": model.logits}, other)
    torch.testing.assert_close(b["y"][first], a["y"][first], rtol=0, atol=0)   # the same ops on the same rows
    assert not torch.equal(b["y"][~first], a["y"][~first])
    got = _dense(model, {"l": model.loss, "y": model.logits}, feeds)
    want = torch.nn.functional.cross_entropy(got["y"].flatten(0, 1), feeds["labels"].flatten(), ignore_index=-100)
    assert (feeds["labels"] == -100).any()
    # the same per-token terms summed in another order: fp32 rounding
    torch.testing.assert_close(got["l"], want, rtol=1e-6, atol=0)


def test_mixture_of_depths_tokens_the_router_skips_keep_their_embedding():
    """One layer of capacity 0.5: the logits of the tokens outside the router's top half are those
    of the embedding alone (the layer skipped), the picked ones' are not; the router loss is read."""
    model = md.load_model(MOD, tiny=True, layers=1)
    ids = {"ids": model.feeds(0)["ids"]}
    p = md.run_dense(dict(model.params))
    x = p["wte"][ids["ids"]] + p["wpe"]                                       # [batch, seq, d_model]
    score = torch.einsum("bsd,d->bs", x, p["w_router"][0])
    picked = torch.zeros_like(score, dtype=torch.bool).scatter(1, score.topk(score.shape[1] // 2, 1).indices, True)
    skipped = torch.nn.functional.layer_norm(x, x.shape[-1:], p["lnf"]) @ p["wte"].T
    got = _dense(model, {"y": model.logits, "a": model.outputs["router_aux"]}, ids)
    # the same layer norm and matmul in torch: fp32 rounding only
    torch.testing.assert_close(got["y"][~picked], skipped[~picked], rtol=1e-5, atol=1e-6)
    assert (got["y"][picked] - skipped[picked]).abs().max() > 1e-3 and float(got["a"]) > 0


@pytest.mark.slow   # by default: the shared layer pipelined simulated (CASES' ALBERT stage:2 rows) and stage sums
# added across gloo processes (tests/test_stage_sum.py::test_encoder_decoder_pipelined_on_gloo_processes)
@pytest.mark.timeout(300)
def test_albert_shared_layer_on_a_real_pipeline(capsys):
    """The repeat with no stacked params on two gloo stages, 1f1b: each process sums its own
    layers' gradients of the shared weights, and the stage sums are added across processes."""
    rc, out, err = run_cli(capsys, ["check", ALBERT, "--tiny", "--mesh", "stage:2", "--layout", "layer:stage",
                                    "--microbatches", "2", "--schedule", "1f1b", "--nproc", "2"])
    assert rc == 0 and "OK: 19 outputs match the dense program" in out, (out, err)
