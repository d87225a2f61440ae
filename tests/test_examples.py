"""Which dim indexes the examples (meshdsl/core/examples.py), read off the graph.

Pinned: a nanoGPT-style model whose token input is batch-first ``[B, T]`` or time-major
``[T, B]`` (no param holds either dim: no learned positions) reads ``B`` as its examples' dim
either way, as does an RNN-style model whose repeat scans time-major inputs over ``T``: a dim
an op runs along (causal attention's positions, a repeat's layer dim) is a sequence, not the
examples. Time-major, micro-batches then cut ``B`` and the pipelined loss and gradients are the
dense program's. A dim named ``batch`` is the examples' dim whatever else the graph says: that
is how a user names it.
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md
from meshdsl.core.examples import examples_dim, runs_along
from meshdsl.core.graph import topo_nodes

B, T, C, V, L = md.Dim("B", 4), md.Dim("T", 6), md.Dim("C", 8), md.Dim("V", 11), md.Dim("L", 2)
NH, HS = md.Dim("nh", 2), md.Dim("hs", 4)


def _gpt(order: str, examples: md.Dim = B):
    """A tied-embedding causal-attention LM, tokens ``[B, T]`` (``order="BT"``) or ``[T, B]``."""
    dims = [T, examples] if order == "TB" else [examples, T]
    sig = " ".join(d.name for d in dims)
    with md.Graph() as g:
        idx = md.input("idx", dims, dtype=torch.int64)
        targets = md.input("targets", dims, dtype=torch.int64)
        wte = md.param("wte", [V, C], scale=0.1)
        blocks = {k: md.param(k, [L, C, NH, HS], fan_out=["L", "nh", "hs"]) for k in ("wq", "wk", "wv")}
        blocks["wo"] = md.param("wo", [L, NH, HS, C], fan_out=["L", "C"])

        def block(h, p):
            proj = f"{sig} C, C nh hs -> {sig} nh hs"
            q = md.einsum(proj, h, p["wq"])
            k, v = (md.rename(md.einsum(proj, h, p[w]), T="Tk") for w in ("wk", "wv"))
            att = md.attention(q, k, v, "T", "Tk", "hs", causal=True)
            return h + md.einsum(f"{sig} nh hs, nh hs C -> {sig} C", att, p["wo"])

        y = md.repeat(block, md.gather(wte, idx, "V"), blocks, "L")
        logits = md.einsum(f"{sig} C, V C -> {sig} V", y, wte)
        loss = md.reduce_mean(md.cross_entropy(logits, targets, "V"))
        params = {"wte": wte, **blocks}
        outs = {"loss": loss, **{f"grad/{k}": t for k, t in md.grad(loss, params).items()}}
    gen = torch.Generator().manual_seed(0)
    shape = [d.size for d in dims]
    feeds = {"idx": torch.randint(0, V.size, shape, generator=gen),
             "targets": torch.randint(0, V.size, shape, generator=gen)}
    return outs, feeds, g


def _rnn():
    """An RNN over time-major inputs ``x [T, B, C]``: a repeat scans ``T`` (the inputs stacked
    along it), the state ``[B, C]`` its carry."""
    with md.Graph():
        x = md.input("x", [T, B, C])
        w = md.param("w", [C, md.Dim("C2", 8)])

        def step(h, p):
            return md.tanh(md.rename(md.einsum("B C, C C2 -> B C2", h, w), C2="C") + p["x"])

        h = md.repeat(step, md.tanh(md.reduce_mean(x, "T")), {"x": x}, "T")
        return md.reduce_mean(h * h)


@pytest.mark.parametrize("order", ["BT", "TB"])
def test_tokens_batch_first_or_time_major_read_B_as_the_examples(order):
    outs, _, g = _gpt(order)
    assert {"T", "Tk", "L"} <= runs_along(topo_nodes([outs["loss"]]))
    assert examples_dim([outs["loss"]]) == "B"   # time-major, T (leftmost, as many inputs) was read


def test_a_repeat_over_time_major_inputs_reads_B_as_the_examples():
    assert examples_dim([_rnn()]) == "B"


def test_a_dim_named_batch_wins_over_what_the_ops_say():
    outs, _, _ = _gpt("TB", md.Dim("batch", 4))
    assert examples_dim([outs["loss"]]) == "batch"


@pytest.mark.parametrize("mesh, layout, kw", [
    ("stage:2", "L:stage", {"microbatches": 2, "schedule": "1f1b"}),
    ("data:2", "B:data", {"microbatches": 2}),
])
def test_a_time_major_model_cuts_B_into_micro_batches_with_the_dense_numbers(mesh, layout, kw):
    outs, feeds, _ = _gpt("TB")
    res = md.check(outs, mesh, layout, feeds, **kw)
    assert res.ok, str(res)
