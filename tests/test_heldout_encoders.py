"""Held-out encoder and vision models (written from the docs only) against the dense program.

The models: ``tests/heldout_bert.py`` (padding mask from per-example lengths, token type and
position embeddings, post-LN blocks, an MLM loss over the masked positions plus a [CLS]
loss), ``tests/heldout_vit_cls.py`` (a class token concatenated to the patches, pre-LN
blocks, the head on the class token) and ``tests/heldout_mixer.py`` (token mixing contracts
the patches dim, channel mixing, mean pooling).  Each layout below gives the dense
program's loss and every gradient on the simulated mesh: data parallel with an uneven
batch, Megatron, FSDP, the sequence (or patch) dim split, pipelines under 1f1b and
interleaved:2, remat, 2x2 meshes.  Then the two bugs these models found, reduced:

* a dim of size 1 (a class token's ``seq:1``, ``slice_(h, "seq", 0, 1)``) under a rule that
  splits the sequence was refused ("too small to split unevenly"); it is now left whole;
* a loss divided by a count over the whole batch, pipelined over micro-batches, said its
  reader ran "before the pipelined repeat"; a count of the inputs now pipelines, made once
  before the micro-batches (tests/test_batch_stats.py), as the count fed as an input does.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md

HERE = Path(__file__).parent


def _outputs(model, remat=None):
    """The loss and every param's gradient, in the model's graph."""
    with model.graph:
        grads = md.grad(model.loss, model.params, remat=remat)
    return {"loss": model.loss, **{f"grad/{k}": v for k, v in grads.items()}}


def _assert_matches_dense(outs, feeds, mesh, layout, **compile_args):
    want = md.run_dense(outs, feeds)
    got = md.run_simulated(md.compile(outs, mesh, layout, **compile_args), feeds)
    for k in want:
        # fp32 sums re-ordered by the split (and by the micro-batches): ~1e-7 relative; a wrong
        # layout is off by O(1).  The atol is 1e-5 of the largest magnitude (as `meshdsl check`
        # allows 1e-4), since a gradient that is ~0 is rounding noise on both sides.
        scale = max(want[k].abs().max().item(), 1.0)
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5 * scale, msg=f"{k} on {mesh!r} {layout!r}")


CASES = [
    # model, config overrides, mesh, layout, compile args, remat
    ("bert", {}, "data:4", "batch:data", {}, None),                              # 6 rows: 2, 2, 1, 1
    ("bert", {}, "data:2; model:2", "batch:data; heads:model; d_ff:model", {}, None),
    ("bert", {}, "model:2", "seq:model", {}, None),                              # [CLS] slice of a split seq
    ("bert", {}, "data:2", "batch:data; params.d_model:data", {}, "selective"),
    # the padding mask, made per micro-batch outside the repeat, read by every virtual stage
    ("bert", {"mlm_norm": "input", "layers": 4}, "stage:2", "layer:stage", {"microbatches": 2, "schedule": "interleaved:2"}, None),
    ("vit_cls", {}, "model:3", "seq:model", {}, None),                           # class token concat on a split seq
    ("vit_cls", {}, "data:2; model:2", "batch:data; patches:model; seq:model", {}, None),
    ("vit_cls", {"layers": 4}, "stage:2", "layer:stage", {"microbatches": 2, "schedule": "interleaved:2"}, None),
    ("vit_cls", {}, "model:2", "heads:model; d_ff:model", {}, "full"),
    ("mixer", {}, "model:2", "patches:model", {}, None),                         # token mixing contracts a split dim
    ("mixer", {}, "data:2; model:2", "height:data; tok_hidden:model; d_ff:model", {}, None),
    ("mixer", {}, "stage:2; model:2", "layer:stage; patches:model", {"microbatches": 2, "schedule": "1f1b"}, "full"),
]


@pytest.mark.parametrize("name,config,mesh,layout,args,remat", CASES,
                         ids=[f"{c[0]}-{c[2]}-{c[3]}-{c[5]}".replace(" ", "") for c in CASES])
def test_heldout_model_matches_dense(name, config, mesh, layout, args, remat):
    model = md.load_model(str(HERE / f"heldout_{name}.py"), tiny=True, **config)
    _assert_matches_dense(_outputs(model, remat), model.feeds(0), mesh, layout, **args)


def _class_token_graph():
    b, s, one, d = md.Dim("batch", 2), md.Dim("seq", 4), md.Dim("seq", 1), md.Dim("d_model", 3)
    with md.Graph():
        x = md.input("x", [b, s, d])
        cls = md.param("cls", [one, d], scale=1.0)
        w = md.param("w", [d, md.Dim("d_out", 3)])
        h = md.concat([md.broadcast_to(cls, [b, one, d]), x], "seq")          # seq:5
        h = md.tanh(md.einsum("batch seq d_model, d_model d_out -> batch seq d_out", h, w))
        first = md.squeeze(md.slice_(h, "seq", 0, 1), "seq")                   # [batch, d_out]
        loss = md.reduce_sum(first ** 2) + md.reduce_mean(h)
        outs = {"loss": loss, **{f"grad/{k}": v for k, v in md.grad(loss, {"cls": cls, "w": w}).items()}}
    feeds = {"x": torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(0))}
    return outs, feeds


@pytest.mark.parametrize("mesh", ["model:2", "model:4", "data:2; model:2"])
def test_a_dim_of_size_one_stays_whole_under_a_rule_that_splits_its_name(mesh):
    """``seq:model`` splits the sequence; the class token's ``seq:1`` and the [CLS] slice stay whole."""
    outs, feeds = _class_token_graph()
    _assert_matches_dense(outs, feeds, mesh, "seq:model")
    plan = md.compile(outs, mesh, "seq:model")
    assert not any("seq" in plan.values[s.outs[0]].sharding.split for s in plan.steps
                   if s.kind == "param" and s.label == "cls"), "a size-1 dim was split"


def test_a_whole_batch_count_summed_in_the_graph_pipelines_as_the_fed_count_does():
    bert = HERE / "heldout_bert.py"
    model = md.load_model(str(bert), tiny=True, layers=4)
    # the masked count summed in the graph is made once, before the micro-batches
    # (lowering/batch_stats.py; every schedule and the refusal of a count made from params: tests/test_batch_stats.py)
    _assert_matches_dense(_outputs(model), model.feeds(0), "stage:2", "layer:stage", microbatches=2, schedule="1f1b")
    model = md.load_model(str(bert), tiny=True)
    # the same loss as the count fed as an input (the CASES above pipeline that one)
    fed = md.load_model(str(bert), tiny=True, mlm_norm="input")
    torch.testing.assert_close(md.run_dense({"l": fed.loss}, fed.feeds(3))["l"],
                               md.run_dense({"l": model.loss}, model.feeds(3))["l"])   # same loss, bit for bit
