"""Sliding-window attention: ``md.attention(..., window=w)``.

Convention (Mistral's ``sliding_window``): a causal query ``i`` attends to the keys
``i - w < j <= i``, itself included; not causal, to ``|i - j| < w``.  The dense op is checked
against an explicit banded-mask softmax in torch (forward and gradients, by autograd); layouts
that split the sequence (``seq:model; key_seq:model``, 2-way, 3-way uneven, heads split too, in
a ``repeat`` stack) against the dense program; and the plan against the gather it replaces:
each rank receives the ``w - 1`` key/value rows before its block (a halo, ``permute``) and
sends their gradients back, no allgather of k and v.
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md
from conftest import build_case, check_plan
from meshdsl.errors import ShapeError
from meshdsl.lowering.cost import CostModel

SEQ_SPLIT = "seq:model"   # k and v renamed from seq: key_seq:model implied (lowering/implied.py), even or not
UNEVEN = "seq:model; key_seq:model"   # written out: the same plan as SEQ_SPLIT implies


def _banded(q, k, v, window: int, causal: bool, scale: float):
    """The reference: q [b, s, h, e], k and v [b, t, h, e]; softmax of the masked scores."""
    s = torch.einsum("bshe,bthe->bhst", q, k) * scale
    d = torch.arange(q.shape[1])[:, None] - torch.arange(k.shape[1])[None, :]
    keep = ((d >= 0) & (d < window)) if causal else (d.abs() < window)
    return torch.einsum("bhst,bthe->bshe", s.masked_fill(~keep, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [1, 3, 7, 20])
def test_dense_window_matches_a_banded_mask_softmax(window, causal):
    """Forward and gradients of q, k, v against torch's autograd of the banded softmax; windows of
    one key, a few, more than half the sequence, more than all of it (= plain causal / full)."""
    b, s, h, e, t = md.Dim("batch", 2), md.Dim("seq", 9), md.Dim("heads", 2), md.Dim("d_head", 4), \
        md.Dim("key_seq", 9)
    g = torch.Generator().manual_seed(window)
    vals = {n: torch.randn(2, 9, 2, 4, generator=g, dtype=torch.float64) for n in ("q", "k", "v", "c")}
    with md.Graph():
        q = md.param("q", [b, s, h, e])
        k, v = md.param("k", [b, t, h, e]), md.param("v", [b, t, h, e])
        y = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=causal, window=window)
        loss = md.reduce_sum(y * md.constant(vals["c"].float(), [b, s, h, e]))
        grads = md.grad(loss, {"q": q, "k": k, "v": v})
        got = md.run_dense({"y": y, **{f"d{n}": gr for n, gr in grads.items()}},
                           params={n: vals[n].float() for n in "qkv"})
    ref = {n: vals[n].clone().requires_grad_() for n in "qkv"}
    want = _banded(ref["q"], ref["k"], ref["v"], window, causal, 0.5)
    (want * vals["c"]).sum().backward()
    torch.testing.assert_close(got["y"].double(), want.detach(), rtol=1e-5, atol=1e-5)
    for n in "qkv":
        torch.testing.assert_close(got[f"d{n}"].double(), ref[n].grad, rtol=1e-5, atol=1e-5)


def _self_attention(window, causal=True, n=12, heads=2):
    """x [batch, seq, heads, d_head] attending to itself, k and v scaled copies renamed to key_seq."""
    def fn():
        b, s, h, e = md.Dim("batch", 2), md.Dim("seq", n), md.Dim("heads", heads), md.Dim("d_head", 4)
        x = md.param("x", [b, s, h, e], scale=1.0)
        wk, wv = md.param("wk", [h, e], scale=1.0), md.param("wv", [h, e], scale=1.0)
        k, v = md.rename(x * wk, seq="key_seq"), md.rename(x * wv, seq="key_seq")
        return md.attention(x, k, v, "seq", "key_seq", "d_head", causal=causal, window=window), {}
    return fn


def _kinds(plan) -> set[str]:
    return {s.kind for s in plan.steps if s.kind != "local"}


#: a halo's kinds: one permute, or several to one neighbour in one buffer (lowering/coalesce.py: k and v)
PERMUTES = {"permute", "bucket_permute"}


@pytest.mark.parametrize("n,mesh,layout,window,halo", [
    (12, "model:2", SEQ_SPLIT, 3, True),
    (12, "model:2", SEQ_SPLIT, 1, False),                          # one key: nothing moves
    (12, "model:2", SEQ_SPLIT, 20, True),                          # wider than the sequence
    (12, "model:3", SEQ_SPLIT, 5, True),                           # 4 of a block of 4: one neighbour
    (11, "model:3", UNEVEN, 3, True),                              # uneven blocks 4, 4, 3
    (11, "model:3", SEQ_SPLIT, 3, True),                           # the same, key_seq:model implied
    (11, "model:3", UNEVEN, 5, True),                              # 4 rows, past a block of 3: halo_routes
    (12, "data:2; model:2", SEQ_SPLIT + "; heads:data", 5, True),  # heads split too
])
def test_split_sequence_matches_dense_and_trades_a_halo(n, mesh, layout, window, halo):
    case = build_case(_self_attention(window, n=n))
    check_plan(case, mesh, layout)
    plan = md.compile(case.outputs, mesh, layout)
    if halo:
        assert PERMUTES & _kinds(plan) and not {"allgather", "reduce_scatter"} & _kinds(plan), plan.totals()
        notes = [s.note for s in plan.steps if s.kind in PERMUTES]   # (a packed one keeps its members')
        assert any("halo gradient" in t for t in notes) and any(t.startswith("halo:") or ": halo:" in t
                                                                for t in notes), notes
    elif window == 1:
        assert not {*PERMUTES, "allgather", "reduce_scatter"} & _kinds(plan), plan.totals()
    else:
        assert "allgather" in _kinds(plan) and not PERMUTES & _kinds(plan), plan.totals()


def test_grouped_query_window_with_a_split_group_matches_dense():
    """Grouped-query attention (k, v without the ``group`` dim) with the group split over ``data``:
    dk and dv are partial sums over it, their halo rows folded back before the reduction."""
    def fn():
        b, s, kvh, g, e = md.Dim("batch", 2), md.Dim("seq", 12), md.Dim("kv_heads", 2), md.Dim("group", 2), \
            md.Dim("d_head", 4)
        x = md.param("x", [b, s, kvh, e], scale=1.0)
        wq, wv = md.param("wq", [kvh, g, e], scale=1.0), md.param("wv", [kvh, e], scale=1.0)
        k, v = md.rename(x, seq="key_seq"), md.rename(x * wv, seq="key_seq")
        return md.attention(x * wq, k, v, "seq", "key_seq", "d_head", window=4), {}
    case = build_case(fn)
    check_plan(case, "data:2; model:2", "seq:model; group:data")
    assert PERMUTES & _kinds(md.compile(case.outputs, "data:2; model:2", "seq:model; group:data"))


def test_halo_moves_fewer_bytes_than_the_causal_gather():
    """The same model under seq:model, window 3 against plain causal attention (k and v allgathered
    forward, their gradients reduce-scattered): the halo is 2 rows a rank each way, not the other
    ranks' blocks."""
    plan = md.compile(build_case(_self_attention(3, n=16)).outputs, "model:2", SEQ_SPLIT)
    assert "implied by rename: key_seq:model (from seq)" in plan.notes   # seq:model alone: keys stay split
    win = plan.totals()
    full = md.compile(build_case(_self_attention(None, n=16)).outputs, "model:2", SEQ_SPLIT).totals()
    # k and v gathered as one (made back to back: lowering/coalesce.py), dk and dv scattered so
    assert full["bucket_allgather"]["count"] == 1 and "allgather" not in full and "permute" not in full
    # k, v, dk, dv: 2 rows [b, h, e]; k and v to the next rank in one buffer, dk and dv back in one
    assert win["bucket_permute"] == {"count": 2, "bytes": 4 * 2 * 2 * 2 * 4 * 4} and "permute" not in win
    assert win["bucket_permute"]["bytes"] < full["bucket_allgather"]["bytes"] + full["bucket_reduce_scatter"]["bytes"]


def test_symmetric_window_is_priced_against_the_gather():
    """Not causal, a rank needs w - 1 rows from each side: two permutes per tensor.  At these tiny
    sizes the default cost model (50 us a collective) finds one allgather cheaper; priced for
    bandwidth alone the halo is chosen.  Both plans match dense."""
    case = build_case(_self_attention(3, causal=False, n=12))
    check_plan(case, "model:3", SEQ_SPLIT)
    assert "bucket_allgather" in _kinds(md.compile(case.outputs, "model:3", SEQ_SPLIT))   # k and v, as one
    plan = md.compile(case.outputs, "model:3", SEQ_SPLIT, cost=CostModel(latency_s=0.0))
    assert PERMUTES & _kinds(plan) and not {"allgather", "bucket_allgather"} & _kinds(plan), plan.totals()
    got = md.run_simulated(plan, case.feeds)
    for name, want in case.ref.items():
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-5)


def test_window_wider_than_a_block_reads_the_ranks_further_on():
    """Window 7 over blocks of 4 (12 split 3 ways): 6 rows before each block, the left neighbour's
    whole block and 2 rows of the rank 2 away; their gradients go back the same two hops.  Priced
    for bandwidth alone (the default finds the allgather's one collective cheaper here)."""
    case = build_case(_self_attention(7, n=12))
    plan = md.compile(case.outputs, "model:3", SEQ_SPLIT, cost=CostModel(latency_s=0.0))
    notes = [s.note for s in plan.steps if s.kind in PERMUTES]
    assert "allgather" not in _kinds(plan) and any("rank 2" in t for t in notes), plan.totals()
    got = md.run_simulated(plan, case.feeds)
    for name, want in case.ref.items():
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-5)


def test_window_in_a_repeat_stack_matches_dense():
    """Two layers of windowed self-attention under md.repeat, the sequence split 3 ways unevenly."""
    def fn():
        b, s, h, e, layer = md.Dim("batch", 2), md.Dim("seq", 10), md.Dim("heads", 2), md.Dim("d_head", 4), \
            md.Dim("layer", 2)
        x = md.param("x", [b, s, h, e], scale=1.0)
        w = {"wk": md.param("wk", [layer, h, e], scale=1.0), "wv": md.param("wv", [layer, h, e], scale=1.0)}

        def block(c, p):
            k, v = md.rename(c * p["wk"], seq="key_seq"), md.rename(c * p["wv"], seq="key_seq")
            return md.tanh(md.attention(c, k, v, "seq", "key_seq", "d_head", window=3)) + c
        return md.repeat(block, x, w, "layer"), {}
    case = build_case(fn)
    check_plan(case, "model:3", UNEVEN)
    plan = md.compile(case.outputs, "model:3", UNEVEN)
    assert "allgather" not in {s.kind for s in plan.steps}, plan.totals()


def test_an_uneven_split_implies_the_keys_split_only_for_a_window():
    """seq 11 over ``model:3`` (blocks 4, 4, 3): ``seq:model`` alone implies ``key_seq:model`` for
    keys only a windowed attention mixes, and the plan is the written layout's (4 halo permutes,
    2 to each neighbour in one buffer, no gather); plain causal attention, or keys another op
    also sums over, keep the keys whole (an uneven split of keys every query reads would be
    gathered anyway)."""
    plan = md.compile(build_case(_self_attention(3, n=11)).outputs, "model:3", SEQ_SPLIT)
    assert "implied by rename: key_seq:model (from seq)" in plan.notes, plan.notes
    written = md.compile(build_case(_self_attention(3, n=11)).outputs, "model:3", UNEVEN).totals()
    assert plan.totals() == written and written["bucket_permute"] == {"count": 2, "bytes": 512}, written

    def summed_keys():
        b, s, e = md.Dim("batch", 2), md.Dim("seq", 11), md.Dim("d_head", 4)
        x = md.param("x", [b, s, e], scale=1.0)
        k = md.rename(x, seq="key_seq")
        y = md.attention(x, k, k, "seq", "key_seq", "d_head", window=3)
        return y + md.reduce_sum(k, "key_seq"), {}
    for fn in (_self_attention(None, n=11), summed_keys):
        notes = md.compile(build_case(fn).outputs, "model:3", SEQ_SPLIT).notes
        assert not any("key_seq:model" in t for t in notes), notes


def test_a_repeat_stack_saves_the_halo_for_its_backward():
    """In a ``repeat`` the forward saves the key/value rows its neighbours sent (halo strips,
    ``hl`` rows a layer each) and the backward glues them on again: the stack trades the unrolled
    layers' permutes (per layer 2 halos, 2 gradient folds, each pair to one neighbour in one
    buffer), not 2 more a layer."""
    def stack(rep: bool):
        def fn():
            b, s, h, e, layer = md.Dim("batch", 2), md.Dim("seq", 11), md.Dim("heads", 2), md.Dim("d_head", 4), \
                md.Dim("layer", 2)
            x = md.param("x", [b, s, h, e], scale=1.0)
            w = {n: md.param(n, [layer, h, e], scale=1.0) for n in ("wk", "wv")}

            def block(c, p):
                k, v = md.rename(c * p["wk"], seq="key_seq"), md.rename(c * p["wv"], seq="key_seq")
                return md.tanh(md.attention(c, k, v, "seq", "key_seq", "d_head", window=3)) + c
            if rep:
                return md.repeat(block, x, w, "layer"), {}
            for i in range(2):
                x = block(x, {n: md.squeeze(md.slice_(t, "layer", i, i + 1), "layer") for n, t in w.items()})
            return x, {}
        return fn
    case = build_case(stack(True))
    check_plan(case, "model:3", SEQ_SPLIT)
    plan = md.compile(case.outputs, "model:3", SEQ_SPLIT)
    unrolled = md.compile(build_case(stack(False)).outputs, "model:3", SEQ_SPLIT).totals()
    assert plan.totals()["bucket_permute"] == unrolled["bucket_permute"] == {"count": 4, "bytes": 1024}, \
        plan.totals()
    assert "permute" not in plan.totals() and "permute" not in unrolled, plan.totals()
    back = next(s for s in plan.steps if s.kind == "repeat" and s.args["backward"]).subplans[0]
    [fold] = [s for s in back.steps if s.kind in PERMUTES]   # (its members' notes kept)
    assert fold.kind == "bucket_permute" and fold.note.count(": halo gradient") == 2, fold.note


@pytest.mark.parametrize("window,what", [(0, "window=0 is not positive"), (-2, "window=-2 is not positive"),
                                         (2.5, "window=2.5 (float) is not an int"),
                                         (True, "window=True (bool) is not an int"),
                                         ("4", "window='4' (str) is not an int")])
def test_a_bad_window_is_a_clear_error(window, what):
    b, s, e, t = md.Dim("batch", 2), md.Dim("seq", 4), md.Dim("d_head", 4), md.Dim("key_seq", 4)
    with md.Graph():
        q, k = md.param("q", [b, s, e]), md.param("k", [b, t, e])
        with pytest.raises(ShapeError) as err:
            md.attention(q, k, k, "seq", "key_seq", "d_head", window=window)
    text = str(err.value)
    assert what in text and "i - w < j <= i" in text and "window=4096" in text, text
