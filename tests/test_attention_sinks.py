"""Attention sinks: ``md.attention(..., window=w, sinks=S)`` (StreamingLLM).

Convention: a causal query ``i`` keeps key ``j`` when ``j <= i`` and (``i - j < w`` or ``j < S``);
not causal, when ``|i - j| < w`` or ``j < S``.  The fused op is checked against the composite a
user writes today (an iota mask ``(dist >= 0) & ((dist < w) | (key_pos < S))`` in front of a
softmax), forward and every gradient; layouts that split the sequence (2-way, 3-way uneven, sink
rows spanning several blocks, a window past the neighbour, heads or a query group split too, a
``repeat`` stack, a pipeline) against the dense program; and the plan: under ``seq:model`` one
allgather of each rank's window and sink rows of k and v (``lowering/attention_sinks.py``) and its
reduce-scatter back, never k and v gathered whole.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import assert_heldout_case_matches_dense, build_case, check_plan, heldout_outputs
from meshdsl.errors import ShapeError

SINKS_MODEL = str(Path(__file__).parent / "heldout_sinks.py")


def _self_attention(form: str, n=12, window=3, sinks=2, causal=True, heads=2, layers=0):
    """x [batch, seq, heads, d_head] attending to itself (k, v scaled copies renamed to key_seq),
    fused (``form="fused"``) or as the composite with the iota mask; ``layers``: a repeat stack."""
    def attend(x, k, v):
        if form == "fused":
            return md.attention(x, k, v, "seq", "key_seq", "d_head", causal=causal, window=window, sinks=sinks)
        s, ks = x.shape.get("seq"), k.shape.get("key_seq")
        dist = md.arange(s) - md.arange(ks)
        keep = md.logical_or(md.less(dist if causal else md.abs(dist), window), md.less(md.arange(ks), sinks))
        keep = md.logical_and(md.greater_equal(dist, 0), keep) if causal else keep
        scores = md.einsum("batch seq heads d_head, batch key_seq heads d_head -> batch heads seq key_seq", x, k)
        att = md.softmax(md.where(keep, scores * 0.5, -1e9), "key_seq")
        return md.einsum("batch heads seq key_seq, batch key_seq heads d_head -> batch seq heads d_head", att, v)

    def fn():
        b, s, h, e = md.Dim("batch", 2), md.Dim("seq", n), md.Dim("heads", heads), md.Dim("d_head", 4)
        x = md.param("x", [b, s, h, e], scale=1.0)
        if not layers:
            wk, wv = md.param("wk", [h, e], scale=1.0), md.param("wv", [h, e], scale=1.0)
            return attend(x, md.rename(x * wk, seq="key_seq"), md.rename(x * wv, seq="key_seq")), {}
        lay = md.Dim("layer", layers)
        w = {m: md.param(m, [lay, h, e], scale=1.0) for m in ("wk", "wv")}

        def block(c, p):
            return md.tanh(attend(c, md.rename(c * p["wk"], seq="key_seq"), md.rename(c * p["wv"], seq="key_seq"))) + c
        return md.repeat(block, x, w, "layer"), {}
    return fn


def _kinds(plan) -> set[str]:
    return {s.kind for s in plan.steps if s.kind != "local"}


@pytest.mark.parametrize("n,window,sinks,causal", [
    (12, 3, 2, True), (12, 3, 5, True), (12, 1, 3, True),   # sinks past the window; window of one key
    (11, 4, 11, True),                                        # every key a sink: plain causal attention
    (12, 3, 2, False),                                        # not causal: |i - j| < w or j < S
])
def test_dense_sinks_match_the_composite_mask(n, window, sinks, causal):
    """The fused op and the composite (same params: built in the same order from one seed), loss
    and every gradient; fp32 softmax sums in another order: 1e-5 is ~100 ulps of these O(1) values."""
    fused = build_case(_self_attention("fused", n, window, sinks, causal)).ref
    mask = build_case(_self_attention("mask", n, window, sinks, causal)).ref
    assert set(fused) == set(mask) and "grad/x" in fused and "grad/wv" in fused
    for k, want in mask.items():
        torch.testing.assert_close(fused[k], want, rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("n,mesh,layout,window,sinks", [
    (12, "model:2", "seq:model", 3, 2),
    (11, "model:3", "seq:model", 3, 2),                        # uneven blocks 4, 4, 3
    (11, "model:3", "seq:model", 3, 6),                        # sink rows over the first two blocks
    (12, "model:3", "seq:model", 7, 2),                        # the window reaches two blocks back
    (12, "data:2; model:2", "seq:model; heads:data", 3, 2),
])
def test_split_sequence_matches_dense_with_one_allgather_of_edges(n, mesh, layout, window, sinks):
    case = build_case(_self_attention("fused", n, window, sinks))
    check_plan(case, mesh, layout)
    plan = md.compile(case.outputs, mesh, layout)
    moves = [s for s in plan.steps if s.kind in ("allgather", "reduce_scatter", "permute")]
    assert [s.kind for s in moves] == ["allgather", "reduce_scatter"], plan.totals()
    assert all("attention edges" in s.note for s in moves), [s.note for s in moves]


def test_not_causal_and_other_layouts_match_dense():
    """Not causal (rows after the block too), heads split (keys whole: the mask alone), the keys
    split with the queries whole (the composite lowering), a repeat stack over an uneven split."""
    check_plan(build_case(_self_attention("fused", 12, 3, 2, causal=False)), "model:3", "seq:model")
    case = build_case(_self_attention("fused", 12, 3, 5))
    check_plan(case, "model:2", "heads:model")
    check_plan(case, "model:2", "key_seq:model")
    check_plan(build_case(_self_attention("fused", 10, 3, 2, layers=2)), "model:3", "seq:model")


def test_grouped_query_sinks_with_a_split_group_match_dense():
    """k and v lack ``group`` (split over data): their gradients, sink and window rows included,
    are partial sums over it until the end."""
    def fn():
        b, s, kvh, g, e = md.Dim("batch", 2), md.Dim("seq", 12), md.Dim("kv_heads", 2), md.Dim("group", 2), \
            md.Dim("d_head", 4)
        x = md.param("x", [b, s, kvh, e], scale=1.0)
        wq, wv = md.param("wq", [kvh, g, e], scale=1.0), md.param("wv", [kvh, e], scale=1.0)
        k, v = md.rename(x, seq="key_seq"), md.rename(x * wv, seq="key_seq")
        return md.attention(x * wq, k, v, "seq", "key_seq", "d_head", window=4, sinks=3), {}
    check_plan(build_case(fn), "data:2; model:2", "seq:model; group:data")


def test_heldout_sinks_fused_moves_edges_not_keys():
    """The StreamingLLM model (tiny: seq 12 over 2 ranks, window 3, 2 sinks, 2 layers): fused, each
    allgather carries 2 (w - 1 + S) = 8 rows of [batch 2, kv_heads 2, d_head 4] fp32 (512 B a rank:
    k's and v's window and sink rows), one per layer forward and one in its backward (a repeat's
    backward exchanges again), and one reduce-scatter a layer sends their gradients back; the
    composite mask allgathers k and v whole (6 rows, 384 B each, made back to back: one bucket,
    lowering/coalesce.py) and reduce-scatters both gradients."""
    def moves(form):
        plan = md.compile(heldout_outputs(md.load_model(SINKS_MODEL, tiny=True, form=form)), "model:2", "seq:model")
        return [(s.kind, s.bytes, s.note) for s, mult in plan.walk() for _ in range(mult)
                if s.kind in ("allgather", "reduce_scatter", "permute", "bucket_allgather", "bucket_reduce_scatter")]
    fused, mask = moves("fused"), moves("mask")
    assert sorted((k, b) for k, b, _ in fused) == [("allgather", 512)] * 4 + [("reduce_scatter", 1024)] * 2, fused
    assert all("attention edges" in note for _, _, note in fused), fused
    assert ("bucket_allgather", 2 * 384) in [(k, b) for k, b, _ in mask], mask   # k and v gathered whole
    assert sum(b for _, b, _ in fused) < sum(b for _, b, _ in mask)


@pytest.mark.parametrize("case", [
    (SINKS_MODEL, {"form": "fused"}, "model:3", "seq:model"),
    (SINKS_MODEL, {"form": "fused"}, "stage:2; model:2", "layer:stage; seq:model",
     {"microbatches": 2, "schedule": "1f1b"}),
], ids=["seq3", "pipe_seq"])
def test_heldout_sinks_fused_matches_dense(case):
    assert_heldout_case_matches_dense(case)


@pytest.mark.parametrize("kw,what", [
    ({"window": 3, "sinks": -1}, "sinks=-1 is negative"),
    ({"window": 3, "sinks": 2.0}, "sinks=2.0 (float) is not an int"),
    ({"window": 3, "sinks": True}, "sinks=True (bool) is not an int"),
    ({"sinks": 2}, "sinks=2 is given without a window"),
    ({"window": 3, "sinks": 5}, "sinks=5 exceeds the 4 keys of k's 'key_seq'"),
])
def test_a_bad_sinks_is_a_clear_error(kw, what):
    b, s, e, t = md.Dim("batch", 2), md.Dim("seq", 4), md.Dim("d_head", 4), md.Dim("key_seq", 4)
    with md.Graph():
        q, k = md.param("q", [b, s, e]), md.param("k", [b, t, e])
        with pytest.raises(ShapeError) as err:
            md.attention(q, k, k, "seq", "key_seq", "d_head", **kw)
    text = str(err.value)
    assert what in text and "j <= i with i - j < w or j < S" in text and "sinks=4" in text, text
