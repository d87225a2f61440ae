"""The fused attention op (meshdsl/ops/attention.py) against the composite it replaces.

The composite is ``softmax(where(causal_mask, einsum(q, k) * scale, -1e9)) . v``, the
transformer's attention before the fused op.  Both run in fp32 on O(1) values; the
fused kernel sums the softmax in blocks (online, flash style) and the composite in one
pass, so they agree to a few ulps, not bit for bit: rtol = atol = 1e-5 (as
test_nn_fused.py) still catches a wrong mask, scale or layout of any element.
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md
from conftest import build_case, check_plan

TOL = dict(rtol=1e-5, atol=1e-5)
B, H, S, K, E = md.Dim("batch", 2), md.Dim("heads", 4), md.Dim("seq", 8), md.Dim("key_seq", 8), md.Dim("d_head", 4)


def _attn(q, k, v, batch: list[str], causal: bool, fused: bool):
    if fused:
        return md.attention(q, k, v, "seq", "key_seq", "d_head", causal=causal)
    qn, kn = " ".join(batch + ["seq", "d_head"]), " ".join(batch + ["key_seq", "d_head"])
    scores = md.einsum(f"{qn}, {kn} -> {' '.join(batch + ['seq', 'key_seq'])}", q, k) * (E.size ** -0.5)
    if causal:
        scores = md.where(md.causal_mask(S, K), scores, -1e9)
    att = md.softmax(scores, "key_seq")
    return md.transpose(md.einsum(f"{' '.join(batch + ['seq', 'key_seq'])}, {kn} -> {qn}", att, v), q.shape.names)


def _run(q_dims, k_dims, causal: bool, fused: bool):
    """y = attention(q, k, v), loss = sum(y * W); meshdsl's y and gradients, dense."""
    batch = [d.name for d in q_dims if d.name not in ("seq", "d_head")]
    with md.Graph():
        q, k, v = md.param("q", q_dims, scale=1.0), md.param("k", k_dims, scale=1.0), md.param("v", k_dims, scale=1.0)
        w = md.param("w", q_dims, scale=1.0)
        y = _attn(q, k, v, batch, causal, fused)
        loss = md.reduce_sum(y * w)
        grads = md.grad(loss, {"q": q, "k": k, "v": v})
        return md.run_dense({"y": y, **{f"grad/{n}": g for n, g in grads.items()}}, seed=7)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("q_dims,k_dims", [
    ([B, S, H, E], [B, K, H, E]),        # the transformer's layout: two batch dims, folded for free
    ([H, E, S, B], [K, B, E, H]),        # every operand in another dim order
    ([S, E], [K, E]),                    # no batch dim
    ([S, B, E], [B, E, K]),              # one batch dim
    ([B, H, md.Dim("x", 3), S, E], [md.Dim("x", 3), K, B, H, E]),   # three: folded by a copy
], ids=["bshe", "permuted", "nobatch", "onebatch", "threebatch"])
def test_fused_matches_composite(q_dims, k_dims, causal):
    got, want = _run(q_dims, k_dims, causal, True), _run(q_dims, k_dims, causal, False)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


# ----------------------------------------------------------------------------- grouped-query attention
# q [batch, seq, kv_heads, group, d_head] against k, v [batch, key_seq, kv_heads, d_head]: each
# key/value head serves the `group` query heads of its own; k and v lack `group`.
N, G = md.Dim("kv_heads", 2), md.Dim("group", 3)


def _gqa_composite(q, k, v, causal: bool):
    """The composite with k and v broadcast over the dims they lack (einsum broadcasts them)."""
    qn, kn = " ".join(q.shape.names), " ".join(k.shape.names)
    batch = [n for n in q.shape.names if n not in ("seq", "d_head")]
    sn = " ".join(batch + ["seq", "key_seq"])
    scores = md.einsum(f"{qn}, {kn} -> {sn}", q, k) * (E.size ** -0.5)
    if causal:
        scores = md.where(md.causal_mask(S, K), scores, -1e9)
    return md.transpose(md.einsum(f"{sn}, {' '.join(v.shape.names)} -> {qn}", md.softmax(scores, "key_seq"), v),
                        q.shape.names)


def _gqa_run(q_dims, k_dims, v_dims, causal: bool, fused: bool):
    with md.Graph():
        q, k, v = (md.param(n, dims, scale=1.0) for n, dims in (("q", q_dims), ("k", k_dims), ("v", v_dims)))
        y = md.attention(q, k, v, causal=causal) if fused else _gqa_composite(q, k, v, causal)
        loss = md.reduce_sum(y * md.param("w", q_dims, scale=1.0))
        grads = md.grad(loss, {"q": q, "k": k, "v": v})
        return md.run_dense({"y": y, **{f"grad/{n}": g for n, g in grads.items()}}, seed=3)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("q_dims,k_dims,v_dims", [
    ([B, S, N, G, E], [B, K, N, E], [B, K, N, E]),      # the llama's layout
    ([G, E, S, B, N], [N, K, E, B], [E, B, N, K]),      # every operand in its own order
    ([B, S, H, E], [B, K, E], [K, B, E]),               # multi-query: one key/value head for all
    ([S, G, E], [K, E], [E, K]),                        # no dim shared but the key and feature dims
], ids=["bsnge", "permuted", "multi-query", "nothing-shared"])
def test_grouped_query_attention_matches_the_broadcast_composite(q_dims, k_dims, v_dims, causal):
    got, want = _gqa_run(q_dims, k_dims, v_dims, causal, True), _gqa_run(q_dims, k_dims, v_dims, causal, False)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


def _gqa_case():
    q = md.param("q", [B, S, N, md.Dim("group", 2), E], scale=1.0)   # a group the axes divide
    k, v = md.param("k", [B, K, N, E], scale=1.0), md.param("v", [B, K, N, E], scale=1.0)
    return md.attention(q, k, v), {}


@pytest.mark.parametrize("layout", ["kv_heads:x", "group:x", "kv_heads:x; group:y", "batch:x; kv_heads:y",
                                    "seq:x; group:y"])
def test_grouped_query_layouts_match_dense(layout):
    check_plan(build_case(_gqa_case), "x:2; y:2", layout)


def test_split_group_leaves_dk_dv_partial_and_kv_heads_split_is_local():
    c = build_case(_gqa_case)
    plan = md.compile(c.outputs, "x:2", "group:x")
    bwd = next(s for s in plan.steps if s.kind == "local" and s.op == "attention_backward")
    dq, dk, dv = (plan.values[v].sharding for v in bwd.outs)
    assert dq.split == {"group": ("x",)} and dk.partial == ("x",) and dv.partial == ("x",)
    # kv_heads:x: Megatron's split of a grouped attention, every head's group on its rank;
    # only the test's scalar loss is reduced.
    assert md.compile(c.outputs, "x:2", "kv_heads:x").totals() == {"allreduce": {"count": 1, "bytes": 4}}


def test_expanded_kv_on_other_devices_is_the_cpu_kernels_grouping():
    """Off the CPU, k and v are repeated over each group for the kernel and their gradients summed
    back: the same numbers as the CPU kernel's own grouped-query form, query head n * G + g
    reading key/value head n."""
    from meshdsl.ops.attention import _BWD, _FWD, _backward_expanded, _expand_kv, _sum_groups, math_forward
    gen = torch.Generator().manual_seed(1)
    q, dout = (torch.randn(2, 6, 5, 8, generator=gen) for _ in range(2))
    k, v = (torch.randn(2, 2, 7, 8, generator=gen) for _ in range(2))
    out, lse = _FWD(q, k, v, 0.0, True)
    m_out, m_lse = math_forward(q, _expand_kv(k, q), _expand_kv(v, q), True, None, None)
    torch.testing.assert_close(m_out, out, **TOL)
    torch.testing.assert_close(m_lse, lse, **TOL)
    dq, dk, dv = _backward_expanded(dout, q, _expand_kv(k, q), _expand_kv(v, q), out, lse, True, None, None)
    for got, ref in zip((dq, _sum_groups(dk, k), _sum_groups(dv, v)), _BWD(dout, q, k, v, out, lse, 0.0, True)):
        torch.testing.assert_close(got, ref, **TOL)


def _case():
    q = md.param("q", [B, S, H, E], scale=1.0)
    k, v = md.param("k", [B, K, H, E], scale=1.0), md.param("v", [B, K, H, E], scale=1.0)
    return md.attention(q, k, v), {}


@pytest.mark.parametrize("layout", [
    "heads:x", "batch:x; heads:y", "seq:x", "seq:x; heads:y", "key_seq:x", "d_head:x", "batch:y; seq:x",
])
def test_sharded_layouts_match_dense(layout):
    # seq:x gives each rank a slice of the queries, whose causal mask starts at its offset;
    # key_seq / d_head are gathered (they are whole in the kernel).
    check_plan(build_case(_case), "x:2; y:2", layout)


def test_heads_split_is_local():
    c = build_case(_case)
    plan = md.compile(c.outputs, "x:2", "heads:x")
    # Megatron's attention: forward and backward run on each rank's heads; only the
    # test's scalar loss (a sum over the split heads) is reduced.
    assert plan.totals() == {"allreduce": {"count": 1, "bytes": 4}}, plan.totals()


def test_mismatched_dims_are_reported():
    with md.Graph():
        q = md.param("q", [B, S, H, E])
        k = md.param("k", [B, K, md.Dim("x", 3), E])   # a dim q does not have
        with pytest.raises(md.ShapeError, match=r"(?s)attention.*k \[batch:2, key_seq:8, x:3, d_head:4\].*Rule:"):
            md.attention(q, k, k)
        v = md.param("v", [K, E])   # k and v must have the same dims
        with pytest.raises(md.ShapeError, match=r"(?s)v \[key_seq:8, d_head:4\] should have the dims"):
            md.attention(q, md.param("k2", [B, K, E]), v)


def test_transformer_uses_one_fused_node_per_block():
    from meshdsl.train.model import load_model
    from pathlib import Path
    model = load_model(str(Path(__file__).resolve().parents[1] / "models" / "transformer.py"))
    block = next(n for n in md.core.graph.topo_nodes([model.loss]) if n.op.name == "repeat").attrs["block"]
    ops = [n.op.name for n in block.graph.nodes]
    assert ops.count("attention") == 1 and "softmax" not in ops, ops


def test_split_queries_leave_dk_dv_partial_not_gathered():
    """seq:x: the backward runs on each rank's queries (no gather of its query-side inputs);
    dq comes out split, dk and dv partial sums over x (every query adds to them)."""
    c = build_case(_case)
    plan = md.compile(c.outputs, "x:2", "seq:x")
    bwd = next(s for s in plan.steps if s.kind == "local" and s.op == "attention_backward")
    dq, dk, dv = (plan.values[v].sharding for v in bwd.outs)
    assert dq.split == {"seq": ("x",)} and not dq.partial
    assert dk.partial == ("x",) and dv.partial == ("x",)
    assert not any(s.kind == "allgather" for s in plan.steps if s.phase == "backward")


def test_sequence_parallel_transformer_reduce_scatters_key_and_value_gradients():
    """The transformer under seq:model: per layer, k and v are allgathered forward and their
    gradients reduce-scattered backward; no attention backward runs on the whole sequence."""
    model = md.load_model("transformer", tiny=True)
    plan = md.compile(model.train_step(0.01), "model:2", "seq:model")
    totals, layers = plan.totals(), model.config.layers
    # k's and v's made back to back: sent as one (lowering/coalesce.py), two members each
    assert totals["bucket_allgather"]["count"] == layers and totals["bucket_reduce_scatter"]["count"] == layers
    assert "allgather" not in totals and "reduce_scatter" not in totals
    packed = [s for s, _ in plan.collectives() if s.kind in ("bucket_allgather", "bucket_reduce_scatter")]
    assert all(len(s.ins) == 2 for s in packed), [s.note for s in packed]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, dict(rtol=1e-5, atol=1e-5)),
                                       (torch.float64, dict(rtol=1e-10, atol=1e-10)),
                                       (torch.bfloat16, dict(rtol=2e-2, atol=2e-2))])
@pytest.mark.parametrize("causal,offset,scale", [(False, 0, None), (True, 0, None), (True, 3, 0.3), (False, 0, 0.7)])
def test_math_form_matches_the_fused_cpu_kernel(dtype, tol, causal, offset, scale):
    """The unfused form other devices run (a GPU) returns what the CPU kernel returns: out and
    logsumexp forward, dq, dk, dv backward, also for a query slice's offset causal mask."""
    from meshdsl.ops.attention import _BWD, _FWD, _mask, math_backward, math_forward
    from meshdsl.ops.registry import LocalCtx
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 3, n, 8, generator=g).to(dtype) for n in (5, 9, 9, 5))
    ctx = LocalCtx({"seq": offset}) if offset else LocalCtx()
    is_causal, mask = _mask(ctx, {"causal": causal, "query_dim": "seq"}, 5, 9, q)
    out, lse = _FWD(q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)
    m_out, m_lse = math_forward(q, k, v, is_causal, mask, scale)
    assert m_out.dtype == out.dtype and m_lse.dtype == lse.dtype
    torch.testing.assert_close(m_out, out, **tol)
    torch.testing.assert_close(m_lse, lse, **tol)
    want = _BWD(dout, q, k, v, out, lse, 0.0, is_causal, attn_mask=mask, scale=scale)
    for got, ref in zip(math_backward(dout, q, k, v, out, lse, is_causal, mask, scale), want):
        assert got.dtype == ref.dtype
        torch.testing.assert_close(got, ref, **tol)
