"""Held-out models of round 5 (written from the README and docs alone) against the dense program.

``tests/heldout_gemma.py`` (a Gemma-2-style decoder: grouped-query attention with 2 key/value
heads under a 4-way model axis, soft-capped attention and final logits, a sandwich of pre- and
post-norms, a scaled tied embedding, a per-layer scalar gate on the residual branches, and with
``exit_loss=True`` an early-exit loss per layer through the tied head summed into the loss),
``tests/heldout_mae.py`` (a masked autoencoder: kept patches picked per sample by a fed index
tensor, a decoder over the kept and mask tokens, the loss on the masked patches only) and
``tests/heldout_t5shared.py`` (a T5-style encoder-decoder: one embedding shared by both inputs and
the head, one relative bias table read by both stacks, both stacks pipelined and tensor parallel
at once), each ``Config.tiny()``, on a subset of the layouts they were checked on by hand.

Also what they led to: ``md.gather`` with ids and a table sharing a dim (a per-sample gather) is
refused with the rule and the one-hot einsum that does it, and that einsum is such a gather.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import assert_heldout_case_matches_dense, heldout_case_id, heldout_outputs

HERE = Path(__file__).parent
GEMMA, MAE, T5 = (str(HERE / f"heldout_{n}.py") for n in ("gemma", "mae", "t5shared"))
PIPE = {"microbatches": 2, "schedule": "1f1b"}

# (model, config overrides, mesh, layout, compile keywords)
CASES = [
    (GEMMA, {}, "model:4", "heads:model; d_ff:model"),                    # 2 kv heads whole, 4 query heads split
    (GEMMA, {}, "kv:2; grp:2", "heads:(kv, grp); d_ff:(kv, grp)"),         # the same split, q never gathered
    (GEMMA, {"exit_loss": True}, "data:2; model:2", "batch:data; vocab:model; d_ff:model"),
    (GEMMA, {}, "data:2", "batch:data; params.d_model:data"),
    (GEMMA, {"exit_loss": True}, "stage:2", "layer:stage", PIPE),        # per-layer losses through the tied head
    (MAE, {}, "data:2; model:2", "batch:data; heads:model; d_ff:model"),
    (MAE, {}, "model:2", "patches:model"),                               # the one-hot pick over split patches
    (MAE, {}, "stage:2", "dec_layer:stage", PIPE),                       # a masked count made from the inputs
    (T5, {}, "data:2", "batch:data"),
    (T5, {}, "stage:2; model:2", "layer:stage; enc_layer:stage; heads:model; d_ff:model", PIPE),
]


@pytest.mark.parametrize("case", CASES, ids=[heldout_case_id(c) for c in CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


def test_the_exit_losses_add_to_the_loss():
    """exit_loss=True: the loss is the final cross-entropy plus 0.1 x each layer's own, the
    per-layer terms positive (so the summed per-layer output is read, not dropped)."""
    plain = md.load_model(GEMMA, tiny=True)
    exits = md.load_model(GEMMA, tiny=True, exit_loss=True)
    feeds = plain.feeds(0)
    a, b = md.run_dense({"l": plain.loss}, feeds)["l"], md.run_dense({"l": exits.loss}, feeds)["l"]
    # each layer's exit cross-entropy over 32 classes is near log(32) = 3.5: 4 layers x 0.1 x ~3.5
    assert 0.5 < float(b - a) < 3.0, (a, b)


def test_fewer_kv_heads_than_ranks_split_over_two_axes_gather_nothing():
    """2 kv heads, 4 ranks (docs/guide/api.md): on one axis of 4 the rearrange of a split 'heads'
    into kv_heads x group gathers q; on kv:2 x grp:2 it splits kv_heads and group, no allgather."""
    model = md.load_model(GEMMA, tiny=True)
    one = md.compile(heldout_outputs(model), "model:4", "heads:model; d_ff:model").totals()
    two = md.compile(heldout_outputs(model), "kv:2; grp:2", "heads:(kv, grp); d_ff:(kv, grp)").totals()
    assert one.get("allgather", {}).get("count", 0) > 0 and "allgather" not in two, (one, two)


def test_a_kv_head_dim_smaller_than_the_axis_is_refused_with_the_reason():
    model = md.load_model(GEMMA, tiny=True)
    with pytest.raises(md.LayoutError) as e:
        md.compile(heldout_outputs(model), "model:4", "kv_heads:model")
    text = str(e.value)
    assert "'kv_heads' of size 2 is not divisible by mesh axes model:4" in text and "Fix:" in text, text


def test_a_per_sample_gather_is_refused_with_the_einsum_that_does_it():
    """ids [batch, kept] into a table [batch, patches, d_model]: gather has one table for all ids;
    the message's one-hot einsum, run as written, is torch's per-sample gather, on any layout."""
    b, k, p, d = md.Dim("batch", 4), md.Dim("kept", 3), md.Dim("patches", 6), md.Dim("d_model", 2)
    gen = torch.Generator().manual_seed(5)
    ids_t = torch.stack([torch.randperm(6, generator=gen)[:3] for _ in range(4)])
    with md.Graph():
        table = md.param("table", [b, p, d], scale=1.0)
        ids = md.input("ids", [b, k], dtype=torch.int64)
        with pytest.raises(md.ShapeError) as e:
            md.gather(table, ids, "patches")
        text = str(e.value)
        assert "share dim(s) ['batch'] (gather along 'patches')" in text and "per-sample" in text, text
        eq = text.split('md.einsum("')[1].split('"')[0]
        assert eq == "batch kept patches, batch patches d_model -> batch kept d_model", text
        y = md.einsum(eq, md.one_hot(ids, table.shape["patches"]), table)
        outs = {"y": y, **md.grad(md.reduce_sum(y ** 2), {"grad/table": table})}
    want = md.run_dense(outs, {"ids": ids_t})
    t = md.run_dense({"t": table})["t"]
    # a one-hot contraction adds exact zeros to the one picked row: bitwise torch's gather
    torch.testing.assert_close(want["y"], torch.gather(t, 1, ids_t[..., None].expand(4, 3, 2)), rtol=0, atol=0)
    plan = md.compile(outs, "data:2; model:2", "batch:data; patches:model")
    got = md.run_simulated(plan, {"ids": ids_t})
    # the split patches add the picked row to zeros from the other rank: exact; the gradient too
    for name in outs:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
