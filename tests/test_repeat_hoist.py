"""Loop-invariant ops leave a repeat's block (ir/closure.py ``Closure.hoist``).

An op the block builds from tensors of the graph around it only (inputs, and what is made
from them; no carry, no layer's param, no param at all) is the same in every layer: it is
built once before the stack and the block reads its result.  A whole-batch count of the
inputs made in a block then runs under micro-batches (it was refused: a sum over the
micro-batches in every layer); a mask made from the inputs costs once, not once per layer.
Random ops and ops of params stay in the block.  The oracle is the dense program.
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md

B, D, L = md.Dim("batch", 4), md.Dim("d_model", 3), md.Dim("layer", 2)
EIN = "batch d_model, d_model d_out -> batch d_out"
PIPE = {"microbatches": 2, "schedule": "1f1b"}


def _layer(h, w):
    return md.tanh(md.rename(md.einsum(EIN, h, w), d_out="d_model"))


def _count_model(per_layer_count: bool = False, remat=None):
    """Per-layer losses, each divided by a whole-batch count of an input, made in the block."""
    with md.Graph() as g:
        x, wts = md.input("x", [B, D]), md.input("wts", [B])
        w = md.param("w", [L, D, md.Dim("d_out", 3)], fan_out=["layer", "d_out"])

        def block(h, p):
            h = _layer(h, p["w"])
            count = md.reduce_sum(wts)
            ys = {"loss": md.reduce_sum(md.reduce_sum(h ** 2, "d_model") * wts) / count}
            return h, ({**ys, "count": count} if per_layer_count else ys)

        _, per = md.repeat(block, x, {"w": w}, "layer", remat=remat)
        loss = md.reduce_sum(per["loss"], "layer")
        outs = {"loss": loss, **md.grad(loss, {"w": w})}
        if per_layer_count:
            outs["count"] = per["count"]
    gen = torch.Generator().manual_seed(0)
    return outs, g, {"x": torch.randn(4, 3, generator=gen), "wts": torch.tensor([1.0, 0.0, 1.0, 1.0])}


def _repeat(g):
    return next(n for n in g.nodes if n.op.name == "repeat")


def test_a_count_of_an_input_is_made_once_before_the_stack():
    outs, g, _ = _count_model()
    rep = _repeat(g)
    count = next(t for t in rep.inputs if t.node.op.name == "reduce_sum")
    assert count.graph is g and [t.name for t in count.node.inputs] == ["wts"]
    assert count.node.id < rep.id
    assert "reduce_sum" not in [n.op.name for n in rep.attrs["block"].graph.nodes if n.inputs and
                                all(t.name == "closed/wts" for t in n.inputs)]


@pytest.mark.parametrize("mesh, layout, kw", [
    ("stage:2", "layer:stage", PIPE),                                   # the DETR case: refused before
    ("data:1", "", {"microbatches": 2}),                                # plain gradient accumulation
    ("stage:2; data:2", "layer:stage; batch:data", {"microbatches": 2, "schedule": "zbh1"}),
    ("data:2", "batch:data", {}),
])
def test_a_count_made_in_a_block_runs_under_micro_batches(mesh, layout, kw):
    outs, _, feeds = _count_model()
    res = md.check(outs, mesh, layout, feeds, **kw)
    assert res.ok, str(res)


@pytest.mark.parametrize("remat", ["full", "selective"])
def test_a_hoisted_count_under_remat_policies(remat):
    outs, _, feeds = _count_model(remat=remat)
    res = md.check(outs, "stage:2", "layer:stage", feeds, **PIPE)
    assert res.ok, str(res)


def test_a_hoisted_value_returned_as_a_per_layer_output_is_stacked():
    """The block returns the count itself as a per-layer output: it is read back into the block."""
    outs, _, feeds = _count_model(per_layer_count=True)
    got = md.run_dense(outs, feeds)
    torch.testing.assert_close(got["count"], torch.tensor([3.0, 3.0]), rtol=0, atol=0)   # a sum of 0/1 weights: exact
    res = md.check(outs, "data:2", "batch:data", feeds)
    assert res.ok, str(res)


def _mask_model(hoistable: bool):
    """A mask made from an input without a batch dim in every layer (hoisted), or the same mask made
    by hand before the stack: the plans are the same work."""
    with md.Graph() as g:
        x, ids = md.input("x", [B, D]), md.input("ids", [D])
        w = md.param("w", [L, D, md.Dim("d_out", 3)], fan_out=["layer", "d_out"])
        made = None if hoistable else md.exp(md.tanh(ids) * 0.5)

        def block(h, p):
            mask = md.exp(md.tanh(ids) * 0.5) if hoistable else made
            return _layer(h * mask, p["w"])

        y = md.repeat(block, x, {"w": w}, "layer")
        loss = md.reduce_sum(y * y)
        return {"loss": loss, **md.grad(loss, {"w": w})}, g


def test_a_mask_of_an_input_costs_once_not_once_per_layer():
    (inside, g), (outside, _) = _mask_model(True), _mask_model(False)
    assert [n.op.name for n in g.nodes if n.op.name in ("tanh", "exp")][:2] == ["tanh", "exp"]   # outside the block
    blk = _repeat(g).attrs["block"]
    assert not [n for n in blk.graph.nodes if n.op.name == "exp"]
    for mesh, layout, kw in (("x:1", "", {}), ("stage:2", "layer:stage", PIPE)):
        assert md.compile(inside, mesh, layout, **kw).flops() == md.compile(outside, mesh, layout, **kw).flops()
    feeds = {"x": torch.randn(4, 3), "ids": torch.randn(3)}
    res = md.check(inside, "stage:2", "layer:stage", feeds, **PIPE)
    assert res.ok, str(res)


def test_random_ops_ops_of_params_and_batch_values_stay_in_the_block():
    """Dropout differs per layer (its stream is salted by the layer); a param's gradient is summed
    over the layers in the block (in fp32 under mixed precision); a value with the batch dim would be
    sent to every later stage of a pipeline per micro-batch, where each stage recomputes it now."""
    with md.Graph() as g:
        x, enc, pad = md.input("x", [B, D]), md.input("enc", [B, D]), md.input("pad", [B])
        u = md.param("u", [D])
        w = md.param("w", [L, D, md.Dim("d_out", 3)], fan_out=["layer", "d_out"])
        y = md.repeat(lambda h, p: _layer(h + md.dropout(enc, 0.5) + u * 2.0, p["w"]) * (pad - 1.0), x, {"w": w},
                      "layer")
    blk = _repeat(g).attrs["block"]
    ops = [n.op.name for n in blk.graph.nodes]
    assert "dropout" in ops and ops.count("mul") == 2 and "sub" in ops, ops
    assert [t.name for t in y.node.inputs[2:]] == ["enc", "u", "pad"]


def test_a_nested_repeat_hoists_out_of_both_blocks():
    inner_l = md.Dim("inner", 2)
    with md.Graph() as g:
        x, wts = md.input("x", [B, D]), md.input("wts", [B])
        w = md.param("w", [L, inner_l, D, md.Dim("d_out", 3)], fan_out=["layer", "inner", "d_out"])

        def outer(h, p):
            return md.repeat(lambda c, q: _layer(c, q["w"]) * md.reduce_mean(wts), h, {"w": p["w"]}, "inner")

        y = md.repeat(outer, x, {"w": w}, "layer")
        loss = md.reduce_sum(y * y)
        outs = {"loss": loss, **md.grad(loss, {"w": w})}
    # reduce_mean is a sum times 1/n: both in the top graph, the inner block only reads the product
    assert [n.op.name for n in g.nodes][3:6] == ["reduce_sum", "constant", "mul"]
    inner = next(n for n in y.node.attrs["block"].graph.nodes if n.op.name == "repeat").attrs["block"]
    assert "reduce_sum" not in [n.op.name for n in inner.graph.nodes]
    feeds = {"x": torch.randn(4, 3), "wts": torch.tensor([1.0, 2.0, 0.0, 1.0])}
    for mesh, layout, kw in (("data:2", "batch:data", {}), ("stage:2", "layer:stage", PIPE)):
        res = md.check(outs, mesh, layout, feeds, **kw)
        assert res.ok, (mesh, str(res))


def test_a_sum_of_an_activation_made_from_a_param_stays_and_is_refused_with_the_fix():
    """Not hoisted (its gradient flows into a param): under micro-batches the block's sum over the
    batch is refused, and the message says to make it before the repeat."""
    with md.Graph():
        x = md.input("x", [B, D])
        enc = md.tanh(x * md.param("ge", [D]))
        w = md.param("w", [L, D, md.Dim("d_out", 3)], fan_out=["layer", "d_out"])
        y = md.repeat(lambda h, p: _layer(h, p["w"]) / md.reduce_sum(enc), x, {"w": w}, "layer")
        loss = md.reduce_sum(y)
        outs = {"loss": loss, **md.grad(loss, {"w": w})}
    with pytest.raises(md.LayoutError, match="sums over the micro-batches in every layer") as e:
        md.compile(outs, "stage:2", "layer:stage", **PIPE)
    text = str(e.value)
    assert "is a sum over the batch made in the block from 'tanh' only" in text, text
    assert "of 'tanh') before the repeat" in text and "_mb" not in text, text


def _table_model(inside: bool):
    """A table of constants only (rotary-like: cos of position x frequency), made in every layer or
    by hand before the stack."""
    s, f = md.Dim("seq", 4), md.Dim("freq", 3)
    with md.Graph() as g:
        x = md.input("x", [B, s, f])
        w = md.param("w", [L, f, md.Dim("f_out", 3)], fan_out=["layer", "f_out"])

        def table():
            pos = md.cast(md.arange(s), torch.float32)
            return md.cos(pos * md.constant(torch.tensor([1.0, 0.1, 0.01]), [f]))

        made = None if inside else table()

        def block(h, p):
            h = h * (table() if inside else made)
            return md.tanh(md.rename(md.einsum("batch seq freq, freq f_out -> batch seq f_out", h, p["w"]), f_out="freq"))

        loss = md.reduce_sum(md.repeat(block, x, {"w": w}, "layer") ** 2)
        return {"loss": loss, **md.grad(loss, {"w": w})}, g


def test_a_table_of_constants_made_in_a_block_is_made_once():
    (inside, g), (outside, _) = _table_model(True), _table_model(False)
    blk = _repeat(g).attrs["block"]
    assert "cos" in [n.op.name for n in g.nodes] and "cos" not in [n.op.name for n in blk.graph.nodes]
    for mesh, layout, kw in (("x:1", "", {}), ("stage:2", "layer:stage", PIPE)):
        a, b = md.compile(inside, mesh, layout, **kw), md.compile(outside, mesh, layout, **kw)
        assert a.flops() == b.flops() and a.totals() == b.totals(), mesh
    res = md.check(inside, "stage:2", "layer:stage", {"x": torch.randn(4, 4, 3)}, **PIPE)
    assert res.ok, str(res)


def _named_examples_model(name: str):
    """Per-layer: the carry scaled by a padding mask of an input with the examples' dim (stays in
    the block) and divided by a whole-batch count of an input (hoisted), the examples' dim called
    ``name``: ``batch``, or a user's name the graph reads as its examples' dim."""
    e = md.Dim(name, 4)
    with md.Graph() as g:
        x, pad, wts = md.input("x", [e, D]), md.input("pad", [e]), md.input("wts", [e])
        w = md.param("w", [L, D, md.Dim("d_out", 3)], fan_out=["layer", "d_out"])

        def block(h, p):
            u = md.tanh(md.rename(md.einsum(f"{name} d_model, d_model d_out -> {name} d_out", h, p["w"]),
                                  d_out="d_model"))
            return u * (pad - 1.0) / md.reduce_sum(wts)

        loss = md.reduce_sum(md.repeat(block, x, {"w": w}, "layer") ** 2)
        return {"loss": loss, **md.grad(loss, {"w": w})}, g


@pytest.mark.parametrize("name", ["B", "examples"])
def test_the_examples_dim_by_any_name_hoists_as_batch_does(name):
    """What leaves the block is decided by the examples' dim the graph has, not by the name
    ``batch``: the mask of an input with it stays in the block (it was hoisted under ``B``), the
    count leaves; the graphs and the pipelined plans are the same work as with ``batch``."""
    (named, g), (base, g0) = _named_examples_model(name), _named_examples_model("batch")
    for a, b in ((g, g0), (_repeat(g).attrs["block"].graph, _repeat(g0).attrs["block"].graph)):
        assert [n.op.name for n in a.nodes] == [n.op.name for n in b.nodes]
    assert "sub" in [n.op.name for n in _repeat(g).attrs["block"].graph.nodes]
    for mesh, layout, kw in (("x:1", "", {}), ("stage:2", "layer:stage", PIPE)):
        p, q = md.compile(named, mesh, layout, **kw), md.compile(base, mesh, layout, **kw)
        assert p.flops() == q.flops() and p.totals() == q.totals(), mesh
    gen = torch.Generator().manual_seed(4)
    feeds = {"x": torch.randn(4, 3, generator=gen), "pad": torch.tensor([1.0, 0.0, 1.0, 1.0]),
             "wts": torch.tensor([1.0, 2.0, 0.0, 1.0])}
    res = md.check(named, "stage:2", "layer:stage", feeds, **PIPE)
    assert res.ok, str(res)
