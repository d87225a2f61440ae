"""md.attention(..., mask=): a boolean mask joined with the causal and window masks, in the fused
kernel (meshdsl/ops/attention.py) and its composite lowering (meshdsl/lowering/attention.py).

torch's ``F.scaled_dot_product_attention`` with a boolean ``attn_mask``, the composite
``softmax(where(mask, q . k * scale, -1e9)) . v`` and the dense program under split layouts are the
oracles.  A query that keeps no key gets zeros and passes no gradient, as torch's SDPA does (2.13).

Legend: batch 2, seq/key_seq 6, heads or kv x group 2 x 2, d_head 4.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import meshdsl as md
from meshdsl.errors import ShapeError

B, S, KV, G, E = 2, 6, 2, 2, 4
# fp32 sums in another order than the reference's: rounding of values O(1)
TOL = dict(rtol=1e-5, atol=1e-5)


def _padded_bert_layer():
    """Bidirectional attention over padded rows: the mask from per-example lengths [key_seq, batch]."""
    b, s, h, e, ks = md.Dim("batch", B), md.Dim("seq", S), md.Dim("heads", KV), md.Dim("d_head", E), md.Dim("key_seq", S)
    q, k, v = md.input("q", [b, s, h, e]), md.input("k", [b, ks, h, e]), md.input("v", [b, ks, h, e])
    keep = md.less(md.arange(ks), md.input("lengths", [b], dtype=torch.int64))
    y = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=False, mask=keep)
    grads = md.grad(md.reduce_sum(y * y), {"q": q, "k": k, "v": v})
    return {"y": y, **{f"d{n}": t for n, t in grads.items()}}


def _feeds(gqa: bool = False) -> dict:
    gen = torch.Generator().manual_seed(0)
    q_shape = (B, S, KV, G, E) if gqa else (B, S, KV, E)
    feeds = {"q": torch.randn(*q_shape, generator=gen), "k": torch.randn(B, S, KV, E, generator=gen),
             "v": torch.randn(B, S, KV, E, generator=gen), "lengths": torch.tensor([4, 6])}
    i = torch.arange(S)
    feeds["blk"] = (i[:, None] // 3 == i[None, :] // 3) | (i[None, :] == 0)   # blocks of 3, and key 0
    feeds["pad"] = torch.ones(B, KV, S, dtype=torch.bool)
    feeds["pad"][0, :, 5] = feeds["pad"][1, 1, 2] = False
    drop = ("lengths",) if gqa else ("blk", "pad")
    return {n: t for n, t in feeds.items() if n not in drop}


def test_a_padding_mask_is_torchs_sdpa_with_a_boolean_mask():
    with md.Graph():
        outs, feeds = _padded_bert_layer(), _feeds()
        got = md.run_dense(outs, feeds)
    q, k, v = (feeds[n].transpose(1, 2).clone().requires_grad_() for n in "qkv")
    keep = (torch.arange(S)[None, :] < feeds["lengths"][:, None])[:, None, None, :]
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    grads = torch.autograd.grad((y * y).sum(), [q, k, v])
    torch.testing.assert_close(got["y"], y.detach().transpose(1, 2), **TOL)
    for n, g in zip("qkv", grads):
        torch.testing.assert_close(got[f"d{n}"], g.transpose(1, 2), **TOL, msg=lambda m, n=n: f"d{n}: {m}")


def _gqa(fused: bool, causal: bool, window):
    """Grouped-query attention with a block-diagonal mask [seq, key_seq] and a per-example,
    per-head padding mask [batch, kv, key_seq], joined."""
    b, s, kv, g, e, ks = (md.Dim("batch", B), md.Dim("seq", S), md.Dim("kv", KV), md.Dim("group", G),
                          md.Dim("d_head", E), md.Dim("key_seq", S))
    q, k, v = md.input("q", [b, s, kv, g, e]), md.input("k", [b, ks, kv, e]), md.input("v", [b, ks, kv, e])
    keep = md.logical_and(md.input("blk", [s, ks], dtype=torch.bool), md.input("pad", [b, kv, ks], dtype=torch.bool))
    if fused:
        y = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=causal, window=window, mask=keep)
    else:
        if causal:
            keep = md.logical_and(keep, md.causal_mask(s, ks))
        if window:
            dist = md.arange(s) - md.arange(ks)
            keep = md.logical_and(keep, md.less(dist if causal else md.abs(dist), window))
        sc = md.einsum("batch seq kv group d_head, batch key_seq kv d_head -> batch kv group seq key_seq", q, k)
        att = md.softmax(md.where(keep, sc * E ** -0.5, -1e9), "key_seq")
        y = md.einsum("batch kv group seq key_seq, batch key_seq kv d_head -> batch seq kv group d_head", att, v)
    grads = md.grad(md.reduce_sum(y * y), {"q": q, "k": k, "v": v})
    return {"y": y, **{f"d{n}": t for n, t in grads.items()}}


@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, 3)])
def test_grouped_query_attention_with_joined_masks_is_the_composite(causal, window):
    feeds = _feeds(gqa=True)
    with md.Graph():
        got = md.run_dense(_gqa(True, causal, window), feeds)
    with md.Graph():
        want = md.run_dense(_gqa(False, causal, window), feeds)
    for n in want:
        torch.testing.assert_close(got[n], want[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("mesh, layout", [
    ("data:2", "batch:data"), ("model:2", "kv:model"),
    ("model:2", "group:model"),          # dk, dv partial over the group's axis
    ("model:2", "seq:model"),            # the query dim split: the mask's rows cut as q's
    ("model:3", "key_seq:model"),        # the key dim split: gathered (or the composite, q smaller)
])
def test_split_layouts_match_the_dense_program(mesh, layout):
    feeds = _feeds(gqa=True)
    with md.Graph():
        outs = _gqa(True, True, 3)
        got, want = md.run_simulated(md.compile(outs, mesh, layout), feeds), md.run_dense(outs, feeds)
    for n in want:
        torch.testing.assert_close(got[n], want[n], **TOL, msg=lambda m, n=n: f"{mesh} {layout} {n}: {m}")


def test_keys_split_under_whole_queries_run_the_composite_with_the_mask():
    """A few queries over many keys split by position (cross-attention over a memory): the keys
    stay split and the mask's columns with them."""
    b, lat, ks, e = md.Dim("batch", B), md.Dim("latents", 2), md.Dim("key_seq", 12), md.Dim("d_head", E)
    with md.Graph():
        q, k, v = md.input("q", [b, lat, e]), md.input("k", [b, ks, e]), md.input("v", [b, ks, e])
        keep = md.less(md.arange(ks), md.input("lengths", [b], dtype=torch.int64))
        y = md.attention(q, k, v, "latents", "key_seq", "d_head", causal=False, mask=keep)
        outs = {"y": y, **{f"d{n}": t for n, t in md.grad(md.reduce_sum(y * y), {"q": q, "k": k, "v": v}).items()}}
        gen = torch.Generator().manual_seed(2)
        feeds = {"q": torch.randn(B, 2, E, generator=gen), "k": torch.randn(B, 12, E, generator=gen),
                 "v": torch.randn(B, 12, E, generator=gen), "lengths": torch.tensor([5, 12])}
        plan = md.compile(outs, "model:2", "key_seq:model")
        got, want = md.run_simulated(plan, feeds), md.run_dense(outs, feeds)
    assert "allgather" not in {s.kind for s, _ in plan.collectives()}
    for n in want:
        torch.testing.assert_close(got[n], want[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("mode", ["fused", "math"])
def test_a_query_that_keeps_no_key_gets_zeros_as_in_torchs_sdpa(mode, monkeypatch):
    """Example 0's length is 0: its queries keep no key.  torch's SDPA gives them zeros and
    no gradient; so do the fused kernel, the math form and a key split by position (where one
    member holds no kept key of either example)."""
    monkeypatch.setenv("MESHDSL_ATTENTION", mode)
    b, s, ks, e = md.Dim("batch", B), md.Dim("seq", 3), md.Dim("key_seq", 8), md.Dim("d_head", E)
    gen = torch.Generator().manual_seed(3)
    feeds = {"q": torch.randn(B, 3, E, generator=gen), "k": torch.randn(B, 8, E, generator=gen),
             "v": torch.randn(B, 8, E, generator=gen), "lengths": torch.tensor([0, 3])}
    with md.Graph():
        q, k, v = md.input("q", [b, s, e]), md.input("k", [b, ks, e]), md.input("v", [b, ks, e])
        keep = md.less(md.arange(ks), md.input("lengths", [b], dtype=torch.int64))
        y = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=False, mask=keep)
        outs = {"y": y, **{f"d{n}": t for n, t in md.grad(md.reduce_sum(y * y), {"q": q, "k": k, "v": v}).items()}}
        got = md.run_dense(outs, feeds)
        split = md.run_simulated(md.compile(outs, "model:2", "key_seq:model"), feeds)
    tq, tk, tv = (feeds[n].clone().requires_grad_() for n in "qkv")
    ty = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=(torch.arange(8) < feeds["lengths"][:, None])[:, None])
    assert not ty[0].any() and not got["y"][0].any()
    want = {"y": ty.detach(), **dict(zip(["dq", "dk", "dv"], torch.autograd.grad((ty * ty).sum(), [tq, tk, tv])))}
    for n in want:
        torch.testing.assert_close(got[n], want[n], **TOL, msg=lambda m, n=n: f"dense {n}: {m}")
        torch.testing.assert_close(split[n], got[n], **TOL, msg=lambda m, n=n: f"key_seq:model {n}: {m}")


def test_a_pipelined_encoder_reads_the_mask_from_outside_its_layers():
    L = md.Dim("layer", 2)
    with md.Graph():
        b, s, h, e, ks = md.Dim("batch", 4), md.Dim("seq", S), md.Dim("heads", 2), md.Dim("d_head", E), md.Dim("key_seq", S)
        x = md.input("x", [b, s, h, e])
        keep = md.less(md.arange(ks), md.input("lengths", [b], dtype=torch.int64))
        w = md.param("w", [L, md.Dim("d_head", E), md.Dim("e2", E)])

        def block(t, p):
            kv = md.rename(t, {"seq": "key_seq"})
            a = md.attention(t, kv, kv, "seq", "key_seq", "d_head", causal=False, mask=keep)
            return t + md.rename(md.tanh(md.einsum("batch seq heads d_head, d_head e2 -> batch seq heads e2",
                                                   a, p["w"])), {"e2": "d_head"})
        loss = md.reduce_mean(md.repeat(block, x, {"w": w}, L) ** 2)
        outs = {"loss": loss, **{f"d{k}": g for k, g in md.grad(loss, {"x": x, "w": w}).items()}}
        gen = torch.Generator().manual_seed(3)
        feeds = {"x": torch.randn(4, S, 2, E, generator=gen), "lengths": torch.tensor([3, 6, 5, 1])}
        params = {"w": torch.randn(2, E, E, generator=gen) * 0.5}
        want = md.run_dense(outs, feeds, params)
        plan = md.compile(outs, "stage:2; data:2", "layer:stage, batch:data", microbatches=2)
        got = md.run_simulated(plan, feeds, params)
    for n in want:
        torch.testing.assert_close(got[n], want[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")


def test_a_bad_mask_names_what_was_wrong():
    b, s, h, e, ks = md.Dim("batch", B), md.Dim("seq", S), md.Dim("heads", KV), md.Dim("d_head", E), md.Dim("key_seq", S)
    with md.Graph():
        q, k = md.input("q", [b, s, h, e]), md.input("k", [b, ks, h, e])
        with pytest.raises(ShapeError, match=r"mask is torch.float32, not torch.bool"):
            md.attention(q, k, k, causal=False, mask=md.input("m", [b, ks]))
        with pytest.raises(ShapeError, match=r"mask's dim 'd_head' is not one of q's batch dims, 'seq' or 'key_seq'"):
            md.attention(q, k, k, causal=False, mask=md.input("m2", [ks, e], dtype=torch.bool))
        with pytest.raises(ShapeError, match=r"mask's 'key_seq' has size 5, not 6"):
            md.attention(q, k, k, causal=False, mask=md.input("m3", [md.Dim("key_seq", 5)], dtype=torch.bool))
        with pytest.raises(ShapeError, match=r"argument 'mask' is \[True\] \(list\), not a meshdsl Tensor"):
            md.attention(q, k, k, causal=False, mask=[True])
