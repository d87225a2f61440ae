"""Held-out models of round 3 (written from the README and docs alone) against the dense program.

``tests/heldout_t5rel.py`` (a T5 encoder: a bucketed relative position bias made from integer
ops, ``md.log`` and a cast that floors, looked up in a ``[buckets, heads]`` table read by every
layer), ``tests/heldout_swin.py`` (window attention by rearranges, shifted windows by
``md.roll`` with a region mask, a per-layer relative position table gathered in the block),
``tests/heldout_palm.py`` (a parallel block, multi-query attention, GPT-J interleaved partial
rotary, SwiGLU, tied embeddings), ``tests/heldout_whisper.py`` (a conv1d stem, a stride-2 conv
written as even/odd streams, sinusoidal positions, an encoder-decoder with cross-attention) and
``tests/heldout_perceiver.py`` (a latent array cross-attending to a long input read from outside
the repeat), each ``Config.tiny()``, on a subset of the layouts they were checked on by hand.

Also the fixes they led to: ``md.neg`` and the new ``md.abs`` take integer tensors (a relative
position's distance); a gather's gradient (``scatter_add``) keeps a partial sum of its rows
partial, so a table gathered inside a pipelined block (Swin's relative position bias) runs
under micro-batches instead of being refused; a softmax whose dim arrives split (attention
written with einsums over a split key dim) reduces its max and sum by allreduces instead of
gathering the scores; and the fused ``md.attention`` over a split key dim with whole, fewer
queries (a Perceiver's latents over a long input) keeps the keys split the same way instead of
gathering k and v; ``md.conv`` takes ``stride=`` (built from stride-1 convs over the input's
phases, which keep a split spatial dim split).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import meshdsl as md
from conftest import assert_heldout_case_matches_dense, heldout_case_id

HERE = Path(__file__).parent
T5, SWIN, PALM, WHISPER, PERCEIVER = (str(HERE / f"heldout_{n}.py")
                                      for n in ("t5rel", "swin", "palm", "whisper", "perceiver"))

# (model, config overrides, mesh, layout, compile keywords)
CASES = [
    (T5, {}, "data:2; model:2", "batch:data; heads:model; d_ff:model", {}),
    (T5, {}, "model:2", "seq:model; key_seq:model", {}),                 # buckets and bias split too
    (T5, {}, "stage:2", "layer:stage", {"microbatches": 2, "schedule": "1f1b"}),
    (SWIN, {}, "data:2", "hp:data", {}),                                 # windows stay split, rolls trade halos
    (SWIN, {}, "stage:2", "layer:stage", {"microbatches": 2, "schedule": "1f1b"}),   # gather in the block
    (PALM, {}, "data:2; model:2", "batch:data; heads:model; d_ff:model", {}),       # one kv head
    (PALM, {"layers": 4}, "stage:2", "layer:stage", {"microbatches": 2, "schedule": "interleaved:2"}),
    (WHISPER, {"stride_conv": True}, "data:2", "frames:data; seq:data", {}),   # the stem's halos
    (WHISPER, {}, "stage:2", "layer:stage", {"microbatches": 2, "schedule": "zbh1"}),
    (PERCEIVER, {"fused": False}, "model:2", "seq:model", {}),           # split softmax over the input
    (PERCEIVER, {}, "stage:2; model:2", "layer:stage; seq:model", {"microbatches": 2, "schedule": "1f1b"}),
]


@pytest.mark.parametrize("case", CASES, ids=[heldout_case_id(c) for c in CASES])
def test_heldout_model_matches_dense(case):
    assert_heldout_case_matches_dense(case)


def _load(name: str):
    """A held-out model file as a module (its helpers are compared with torch below)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"heldout_{name}", HERE / f"heldout_{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_models_helpers_are_the_torch_math():
    """T5's buckets (Hugging Face's formula), GPT-J's interleaved partial rotary and the stride-2
    conv equal their torch forms exactly (integer buckets) or to fp32 rounding."""
    t5, palm, whisper = _load("t5rel"), _load("palm"), _load("whisper")
    s, k = md.Dim("seq", 40), md.Dim("key_seq", 40)
    with md.Graph():
        ids = t5.bucket_ids(s, k, 16, 32)
    assert torch.equal(md.run_dense({"b": ids})["b"], t5.bucket_ids_torch(40, 16, 32).T)

    cfg = palm.Config.tiny()
    xt = torch.randn(2, 8, 3, cfg.d_head, generator=torch.Generator().manual_seed(0))
    with md.Graph():
        x = md.input("x", [md.Dim("batch", 2), md.Dim("seq", 8), md.Dim("heads", 3), md.Dim("d_head", cfg.d_head)])
        y = palm.rotate_pairs(x, "seq", cfg)
    half = cfg.rotary // 2
    ang = torch.arange(8.0)[:, None] * cfg.rope_theta ** (-torch.arange(half, dtype=torch.float32) / half)
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    ev, od = xt[..., :cfg.rotary:2], xt[..., 1:cfg.rotary:2]
    want = torch.cat([torch.stack([ev * cos - od * sin, od * cos + ev * sin], -1).flatten(-2), xt[..., cfg.rotary:]], -1)
    # the same products and one sum each: equal up to fp32 rounding of the angles' cos/sin
    torch.testing.assert_close(md.run_dense({"y": y}, {"x": xt})["y"], want, rtol=0, atol=1e-6)

    xt, wt = torch.randn(2, 10, 3), torch.randn(3, 3, 4)
    with md.Graph():
        y = whisper.conv_stride2(md.input("x", [md.Dim("batch", 2), md.Dim("frames", 10), md.Dim("c_in", 3)]),
                                 md.input("w", [md.Dim("tap", 3), md.Dim("c_in", 3), md.Dim("c_out", 4)]))
    want = F.conv1d(xt.transpose(1, 2), wt.permute(2, 1, 0), stride=2, padding=1).transpose(1, 2)
    # three taps summed in another order than torch's kernel: a few ulps of O(1) values
    torch.testing.assert_close(md.run_dense({"y": y}, {"x": xt, "w": wt})["y"], want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("mesh, layout", [("x:2", "seq:x"), ("x:3", "key_seq:x")])
def test_neg_and_abs_take_integer_tensors_on_any_split(mesh, layout):
    s, k = md.Dim("seq", 7), md.Dim("key_seq", 7)
    with md.Graph():
        rel = md.arange(k) - md.arange(s)
        outs = {"neg": -rel, "abs": md.abs(rel)}
    rel_t = torch.arange(7)[:, None] - torch.arange(7)[None, :]
    got = md.run_simulated(md.compile(outs, mesh, layout), {})
    assert got["abs"].dtype == torch.int64 and torch.equal(got["abs"], rel_t.abs())
    assert torch.equal(got["neg"], -rel_t)
    with md.Graph(), pytest.raises(md.MeshDSLError, match="neg is defined on floating-point"):
        -md.less(md.arange(s), 3)                     # a bool tensor still has no negation


def test_abs_gradient_is_the_sign():
    xt = torch.tensor([[-2.0, -0.5, 0.0, 0.5, 3.0, -1.0]])
    with md.Graph():
        x = md.param("x", [md.Dim("batch", 1), md.Dim("feat", 6)])
        loss = md.reduce_sum(md.abs(x) * md.constant(torch.arange(1.0, 7.0), ["feat"]))
        outs = {"loss": loss, **md.grad(loss, {"grad/x": x})}
    want = torch.tensor([[-1.0, -2.0, 0.0, 4.0, 5.0, -6.0]])   # sign(x) * weight, 0 at 0 as torch
    for mesh, layout in (("x:1", ""), ("x:2", "feat:x")):
        got = md.run_simulated(md.compile(outs, mesh, layout), {}, params={"x": xt})
        torch.testing.assert_close(got["grad/x"], want, rtol=0, atol=0)   # one product each: exact


def _table_in_block():
    """A block that gathers rows of its own (stacked) table by constant ids: Swin's relative bias."""
    b, n, d, r, layer = md.Dim("batch", 4), md.Dim("pos", 3), md.Dim("d", 2), md.Dim("rows", 5), md.Dim("layer", 2)
    with md.Graph():
        x = md.input("x", [b, n, d])
        table = md.param("table", [layer, r, d], scale=1.0)
        ids = md.constant(torch.tensor([4, 0, 4]), [n])

        def block(h, p):
            return md.tanh(h + md.gather(p["table"], ids, "rows"))

        loss = md.reduce_mean(md.repeat(block, x, {"table": table}, "layer") ** 2)
        outs = {"loss": loss, **md.grad(loss, {"grad/table": table})}
    return outs, {"x": torch.randn(4, 3, 2, generator=torch.Generator().manual_seed(1))}


@pytest.mark.parametrize("mesh, layout, kw", [
    ("stage:2", "layer:stage", {"microbatches": 2, "schedule": "1f1b"}),   # refused before: a sum per micro-batch
    ("x:2", "batch:x", {"microbatches": 2}),
])
def test_a_table_gathered_inside_a_block_runs_under_micro_batches(mesh, layout, kw):
    outs, feeds = _table_in_block()
    want = md.run_dense(outs, feeds)
    got = md.run_simulated(md.compile(outs, mesh, layout, **kw), feeds)
    for key in want:
        # fp32 sums of 2-4 terms in another order: ulps of O(1) values
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-6)


def test_a_softmax_over_a_split_dim_reduces_instead_of_gathering():
    b, q, key = md.Dim("batch", 2), md.Dim("query", 3), md.Dim("key", 8)
    with md.Graph():
        s = md.input("s", [b, q, key])
        v = md.param("v", [key, md.Dim("feat", 4)], scale=1.0)
        y = md.einsum("batch query key, key feat -> batch query feat", md.softmax(s * 3.0, "key"), v)
        loss = md.reduce_mean(md.tanh(y))
        outs = {"loss": loss, **md.grad(loss, {"grad/v": v, "grad/s": s})}
    feeds = {"s": torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(2))}
    want = md.run_dense(outs, feeds)
    for mesh in ("x:2", "x:3"):   # even and uneven parts of the key dim
        plan = md.compile(outs, mesh, "key:x")
        assert "allgather" not in plan.totals(), plan.totals()
        got = md.run_simulated(plan, feeds)
        for k in want:
            # max and sums split over ranks: fp32 rounding of O(1) values
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6)


def _cross_attention(causal: bool):
    """Grouped-query attention of 3 queries over 12 keys: q smaller than k and v together."""
    b, s, kvh, grp, e = md.Dim("batch", 2), md.Dim("seq", 3), md.Dim("kv_heads", 2), md.Dim("group", 2), md.Dim("d_head", 4)
    ks = md.Dim("key_seq", 12)
    with md.Graph():
        q = md.param("q", [b, s, kvh, grp, e], scale=1.0)
        k = md.param("k", [ks, b, kvh, e], scale=1.0)                  # k and v in other dim orders
        v = md.param("v", [b, kvh, ks, e], scale=1.0)
        y = md.attention(q, k, v, "seq", "key_seq", "d_head", causal=causal)
        w = md.constant(torch.randn(2, 3, 2, 2, 4, generator=torch.Generator().manual_seed(3)), [b, s, kvh, grp, e])
        loss = md.reduce_sum(md.tanh(y) * w)
        return {"loss": loss, "y": y, **md.grad(loss, {"grad/q": q, "grad/k": k, "grad/v": v})}


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mesh, layout", [("x:2", "key_seq:x"), ("x:3", "key_seq:x"), ("x:2; y:2", "key_seq:x; kv_heads:y")])
def test_fused_attention_over_split_keys_keeps_them_split(causal, mesh, layout):
    """A split key dim with the queries whole: the softmax's max and sum and the output are
    allreduced (about q's size) instead of gathering k and v, forward and backward. With
    causal=True the keys of x:2's second rank are all after every query (masked)."""
    outs = _cross_attention(causal)
    want = md.run_dense(outs)
    plan = md.compile(outs, mesh, layout)
    assert "allgather" not in plan.totals(), plan.totals()
    got = md.run_simulated(plan)
    for k in want:
        # the composite's exp and sums against the fused kernel's: fp32 rounding of O(1) values
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("n, taps, stride, padding", [
    (16, 3, 2, (1, 1)), (15, 5, 3, (4, 0)), (9, 2, 2, (1, 0)), (8, 1, 2, (0, 0)), (12, 4, 4, (0, 0))])
def test_a_strided_conv_is_torchs(n, taps, stride, padding):
    """Output, input gradient and weight gradient of md.conv(..., stride=) against torch's conv1d,
    odd lengths, causal padding, a phase without taps and a tap reading past the padding included."""
    gen = torch.Generator().manual_seed(n + taps)
    xt, wt = torch.randn(2, n, 3, generator=gen), torch.randn(taps, 3, 4, generator=gen)
    ci = md.Dim("c_in", 3)
    with md.Graph():
        x = md.param("x", [md.Dim("batch", 2), md.Dim("seq", n), ci])
        w = md.param("w", [md.Dim("tap", taps), ci, md.Dim("c_out", 4)])
        y = md.conv(x, w, {"seq": "tap"}, padding=padding, stride=stride)
        outs = {"y": y, **md.grad(md.reduce_sum(md.tanh(y)), {"x": x, "w": w})}
    got = md.run_dense(outs, params={"x": xt, "w": wt})
    xr, wr = xt.clone().requires_grad_(), wt.clone().requires_grad_()
    want = F.conv1d(F.pad(xr.transpose(1, 2), padding), wr.permute(2, 1, 0), stride=stride).transpose(1, 2)
    want.tanh().sum().backward()
    # the taps summed over phases in another order than torch's kernel: a few ulps of O(1) values
    for k, ref in (("y", want), ("x", xr.grad), ("w", wr.grad)):
        torch.testing.assert_close(got[k], ref, rtol=0, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_a_strided_conv_over_a_split_spatial_dim_trades_halos():
    """Kernel 3, stride 2 (a Whisper stem) and a 2-D stride-2 conv: the phases stay split, the
    plan trades halo rows (permutes) and gathers nothing, with the dense program's numbers."""
    gen = torch.Generator().manual_seed(5)
    ci, co = md.Dim("c_in", 3), md.Dim("c_out", 4)
    with md.Graph():
        x = md.param("x", [md.Dim("batch", 2), md.Dim("height", 16), md.Dim("width", 6), ci])
        w1 = md.param("w1", [md.Dim("tap", 3), ci, co])
        w2 = md.param("w2", [md.Dim("kh", 3), md.Dim("kw", 3), ci, co])
        y1 = md.conv(x, w1, {"height": "tap"}, padding=(1, 1), stride=2)
        y2 = md.conv(x, w2, {"height": "kh", "width": "kw"}, padding="same", stride={"height": 2, "width": 2})
        loss = md.reduce_sum(md.tanh(y1)) + md.reduce_sum(md.tanh(y2))
        outs = {"loss": loss, **md.grad(loss, {"grad/x": x, "grad/w1": w1, "grad/w2": w2})}
    params = {"x": torch.randn(2, 16, 6, 3, generator=gen), "w1": torch.randn(3, 3, 4, generator=gen),
              "w2": torch.randn(3, 3, 3, 4, generator=gen)}
    want = md.run_dense(outs, params=params)
    plan = md.compile(outs, "x:4", "height:x")
    totals = plan.totals()
    assert "permute" in totals and "allgather" not in totals, totals
    got = md.run_simulated(plan, params=params)
    for k in want:
        # split sums over ranks in another order: fp32 rounding of O(1) values
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
