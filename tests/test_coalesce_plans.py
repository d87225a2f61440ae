"""Coalescing (lowering/coalesce.py): small allreduces that start together are sent as one.

Attention's backward under a sequence split leaves the keys' and the values' gradients partial
over the split at once: one coalesced collective per layer, and the same numbers as the dense
program.
Two partial sums made by different kernels stay apart where the second kernel takes longer than
a latency (the first starts early, overlapping it), and so do members whose bytes would hold the
first back longer than a latency.
Every plan here is on the simulated mesh, tiny.
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md
from meshdsl.lowering.cost import CostModel

MESH = "model:2"
SEQ = "seq:model"


def _attention_layers():
    """Two attention layers under md.repeat whose keys and values have biases: the biases'
    gradients read the keys' and values' gradients whole, so the block's backward reduces
    both where the attention's backward made them (legend: b batch, s query positions, d
    model width, e head width)."""
    b, s = md.Dim("batch", 2), md.Dim("seq", 4)
    d, e, L = md.Dim("d_model", 4), md.Dim("d_head", 4), md.Dim("layer", 2)
    with md.Graph():
        x = md.input("x", [b, s, d])
        w = {n: md.param(n, [L, d, e]) for n in ("wq", "wk", "wv")}
        w.update({n: md.param(n, [L, e], scale=0.1) for n in ("bk", "bv")})

        def block(h, p):
            ht = md.rename(h, seq="key_seq")
            q = md.einsum("batch seq d_model, d_model d_head -> batch seq d_head", h, p["wq"])
            k = md.einsum("batch key_seq d_model, d_model d_head -> batch key_seq d_head", ht, p["wk"]) + p["bk"]
            v = md.einsum("batch key_seq d_model, d_model d_head -> batch key_seq d_head", ht, p["wv"]) + p["bv"]
            return h + md.rename(md.attention(q, k, v, "seq", "key_seq", "d_head", causal=True), d_head="d_model")

        y = md.repeat(block, x, w, L)
        loss = md.reduce_sum(y * y)
        grads = md.grad(loss, w)
    feeds = {"x": torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(0))}
    return {"loss": loss, **{f"d/{n}": g for n, g in grads.items()}}, feeds


def _coalesced(plan):
    return [s for s, _ in plan.collectives() if s.kind == "bucket_allreduce" and "independent allreduces" in s.note]


def test_attention_backward_sends_the_keys_and_values_gradients_as_one():
    outs, feeds = _attention_layers()
    plan = md.compile(outs, MESH, SEQ)
    [loop] = [st for st in plan.steps if st.kind == "repeat" and st.args["backward"]]
    [step] = _coalesced(loop.subplans[0])   # in the block: one per layer
    assert step.phase == "backward" and len(step.ins) == 2 and step.axes == ("model",)
    made = {v: s for s in loop.subplans[0].steps for v in s.outs}
    assert {made[v].op for v in step.ins} == {"attention_backward"}   # both made by one kernel
    # nothing else in the block sends what the attention's backward made
    sent = [v for t in loop.subplans[0].steps if t.is_collective for v in t.ins]
    assert all(made[v].op != "attention_backward" for v in sent if v not in step.ins)
    assert step.bytes == sum(loop.subplans[0].values[v].local_bytes(plan.mesh) for v in step.ins)
    # 1e-4: fp32 sums over the split positions added in another order (md.check's default)
    assert md.check(outs, MESH, SEQ, feeds, tol=1e-4).ok


def test_members_whose_bytes_outweigh_a_latency_stay_apart():
    """The first member would wait for the second's bytes longer than a latency saves."""
    outs, _ = _attention_layers()
    slow_link = CostModel(latency_s=1e-9, bandwidth_Bps=1e9)   # 64 B take 64 ns > 1 ns
    assert not _coalesced(md.compile(outs, MESH, SEQ, cost=slow_link))


def test_partial_sums_of_different_kernels_stay_apart():
    """The first sum's allreduce starts as soon as its kernel ran, overlapping the second
    kernel: joined, it would wait for the second, here (at 100 kFLOP/s) longer than the
    latency it saves.  At the default rate they join: tests/test_coalesce_neighbours.py."""
    b, p, k = md.Dim("batch", 2), md.Dim("p", 4), md.Dim("k", 2)
    with md.Graph():
        a = md.input("a", [b, p, k])
        u, w = md.param("u", [p]), md.param("w", [p])
        y1 = md.einsum("batch p k, p -> batch k", a, u)
        y2 = md.einsum("batch p k, p -> batch k", a * a, w)
        loss = md.reduce_sum(md.exp(y1) * md.exp(y2))
    plan = md.compile({"loss": loss}, MESH, "p:model", cost=CostModel(flops_per_s=1e5))
    assert not _coalesced(plan)
    assert sum(1 for s, _ in plan.collectives() if s.kind == "allreduce") >= 2


@pytest.mark.parametrize("layout", ["dp", "fsdp"])
def test_gradients_are_left_to_the_bucket_pass(layout):
    """bucket_mb=0 keeps one collective per gradient: coalescing does not pack them either (under
    FSDP it packs the forward's gathers of the params, no gradient)."""
    outs, _ = _attention_layers()
    rules = {"dp": "batch:data", "fsdp": "batch:data; params.d_model:data"}[layout]
    plan = md.compile(outs, "data:2", rules, bucket_mb=0)
    assert not [s for s, _ in plan.collectives() if s.kind in ("bucket_allreduce", "bucket_reduce_scatter")]
    assert sum(1 for s, _ in plan.collectives() if s.kind in ("allreduce", "reduce_scatter")) >= 2


def _summed_twice(t: int, u: int):
    """A partial sum over the split ``p`` (RNN-T's joint gradient, in the shape of a contraction)
    read by two sums: over ``u`` and over ``t``."""
    b, tt, uu, j, p = (md.Dim(n, s) for n, s in (("batch", 1), ("t", t), ("u", u), ("j", 2), ("p", 16)))
    with md.Graph():
        a = md.input("a", [b, tt, uu, p])
        w = md.param("w", [p, j])
        z = md.einsum("batch t u p, p j -> batch t u j", a, w)
        e, q = md.reduce_sum(z, ["u"]), md.reduce_sum(z, ["t"])
        loss = md.reduce_sum(md.tanh(e)) + md.reduce_sum(md.tanh(q))
    feeds = {"a": torch.randn(1, t, u, 16, generator=torch.Generator().manual_seed(2))}
    return {"loss": loss}, feeds


def test_a_partial_sum_summed_twice_is_reduced_after_each_sum():
    outs, feeds = _summed_twice(128, 128)
    plan = md.compile(outs, MESH, "p:model")
    [step] = [s for s, _ in plan.collectives()]
    # |b,t,j| + |b,u,j| instead of |b,t,u,j| = 128 KiB: a second collective's 50 us latency
    # (the default cost model) costs less than the 126 KiB it saves; the two sums, made back to
    # back, then go in one buffer (a 1 KiB wait for the first, under the latency it saves)
    assert step.kind == "bucket_allreduce"
    assert [plan.values[v].local_bytes(plan.mesh) for v in step.ins] == [128 * 2 * 4, 128 * 2 * 4]
    # 1e-4: fp32 sums over the split p added in another order
    assert md.check(outs, MESH, "p:model", feeds, tol=1e-4).ok


def test_a_small_partial_sum_summed_twice_is_reduced_once():
    """At 96 bytes a second collective's latency costs more than the bytes it saves."""
    outs, _ = _summed_twice(3, 4)
    plan = md.compile(outs, MESH, "p:model")
    assert sorted(s.bytes for s, _ in plan.collectives()) == [3 * 4 * 2 * 4]
