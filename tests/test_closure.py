"""A repeat block reads tensors of the graph around it (closed over, as JAX's scan consts).

The block below reads four kinds of outside tensor: a table fed as an input without a
batch dim (``tab``), an input split by batch (``keep``), a param not stacked along
``layer`` (``u``) and an activation made before the stack (``enc``).  Every layer reads
them unchanged; a param or activation read by every layer gets the sum of its layers'
gradients.  The oracle is the same model with its layers unrolled by hand in a Python
loop (each layer its own params, the outside tensors read directly), on the dense
program and on every layout family (pipelines: tests/test_stage_sum.py adds the plan's
traffic and an encoder-decoder).
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md
from meshdsl.errors import GraphError

B, D, F, E, L = md.Dim("batch", 8), md.Dim("d_model", 4), md.Dim("d_ff", 8), md.Dim("enc", 6), md.Dim("layer", 4)
UP = "batch d_model, d_model d_ff -> batch d_ff"
DOWN = "batch d_ff, d_ff d_model -> batch d_model"
ENC = "batch enc, enc d_ff -> batch d_ff"

# fp32 with O(1) values: a split reduction (or a layer sum kept per stage) adds in another
# order than the dense program, a few ulps; 1e-5 is ~100 ulps at 1.0 and still catches a
# missing layer, a dropped shard or a sum counted twice.
TOL = 1e-5


def _layer(h, w1, w2, tab, keep, u, enc):
    a = md.einsum(UP, h, w1) + md.einsum(ENC, enc, u)
    return h + md.einsum(DOWN, md.tanh(a) * tab * keep, w2)


def _inputs():
    x, src = md.input("x", [B, D]), md.input("src", [B, E])
    return x, src, md.input("tab", [F]), md.input("keep", [B, F])


def _loss(y, x):
    return md.reduce_sum(md.tanh(y) * x)


def _model():
    """The repeat model: its outputs (loss and every param's gradient) and its graph."""
    with md.Graph("closure") as g:
        x, src, tab, keep = _inputs()
        u, ge = md.param("u", [E, F]), md.param("ge", [E])
        w1, w2 = md.param("w1", [L, D, F]), md.param("w2", [L, F, D])
        enc = md.tanh(src * ge)
        y = md.repeat(lambda h, p: _layer(h, p["w1"], p["w2"], tab, keep, u, enc), x, {"w1": w1, "w2": w2}, "layer")
        loss = _loss(y, x)
        grads = md.grad(loss, {"u": u, "ge": ge, "w1": w1, "w2": w2})
    return {"loss": loss, **{f"d/{k}": v for k, v in grads.items()}}, g


def _unrolled(params: dict, feeds: dict) -> dict:
    with md.Graph("unrolled"):
        x, src, tab, keep = _inputs()
        u, ge = md.param("u", [E, F]), md.param("ge", [E])
        enc = md.tanh(src * ge)
        per = [(md.param(f"w1_{l}", [D, F]), md.param(f"w2_{l}", [F, D])) for l in range(L.size)]
        h = x
        for w1, w2 in per:
            h = _layer(h, w1, w2, tab, keep, u, enc)
        loss = _loss(h, x)
        wrt = {"u": u, "ge": ge, **{f"w{i + 1}_{l}": w[i] for l, w in enumerate(per) for i in range(2)}}
        grads = md.grad(loss, wrt)
    vals = {"u": params["u"], "ge": params["ge"],
            **{f"w{i}_{l}": params[f"w{i}"][l] for l in range(L.size) for i in (1, 2)}}
    r = md.run_dense({"loss": loss, **{f"d/{k}": v for k, v in grads.items()}}, feeds, vals)
    return {"loss": r["loss"], "d/u": r["d/u"], "d/ge": r["d/ge"],
            **{f"d/w{i}": torch.stack([r[f"d/w{i}_{l}"] for l in range(L.size)]) for i in (1, 2)}}


def _data():
    gen = torch.Generator().manual_seed(0)
    params = {"u": torch.randn(6, 8, generator=gen), "ge": torch.randn(6, generator=gen),
              "w1": torch.randn(4, 4, 8, generator=gen) * 0.5, "w2": torch.randn(4, 8, 4, generator=gen) * 0.5}
    feeds = {"x": torch.randn(8, 4, generator=gen), "src": torch.randn(8, 6, generator=gen),
             "tab": torch.randn(8, generator=gen), "keep": (torch.rand(8, 8, generator=gen) > 0.3).float()}
    return params, feeds


def _close(got, want):
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=TOL, atol=TOL, msg=lambda m, k=k: f"{k}: {m}")


def test_dense_matches_the_unrolled_loop():
    """The shared param's gradient is the sum of its layers' (against layers written out by hand)."""
    outs, _ = _model()
    params, feeds = _data()
    _close(md.run_dense(outs, feeds, params), _unrolled(params, feeds))


@pytest.mark.parametrize("mesh, layout, kw", [
    ("data:2", "batch:data", {}),
    ("model:2", "d_ff:model", {}),
    ("data:2; model:2", "batch:data; d_ff:model", {}),
    ("data:2", "batch:data; params.d_model:data; u.enc:data", {}),   # FSDP, the shared param too
    ("data:2", "batch:data; params.d_model:data", {"microbatches": 2}),
    *[("stage:2", "layer:stage", {"microbatches": m, "schedule": s})
      for s in ("gpipe", "1f1b", "zbh1") for m in (2, 4)],
    ("stage:2; data:2", "layer:stage; batch:data", {"microbatches": 2, "schedule": "1f1b"}),
    ("stage:4", "layer:stage", {"microbatches": 2, "schedule": "1f1b"}),  # the gradient's chain: 3 hops
])
def test_layouts_match_the_unrolled_loop(mesh, layout, kw):
    outs, _ = _model()
    params, feeds = _data()
    _close(md.run_simulated(md.compile(outs, mesh, layout, **kw), feeds, params), _unrolled(params, feeds))


def test_outside_tensors_are_inputs_of_the_repeat_not_copies_per_layer():
    """The block reads each outside tensor once per layer from one value: nothing is stacked."""
    outs, g = _model()
    (rep,) = [n for n in g.nodes if n.op.name == "repeat"]
    assert [t.name for t in rep.inputs[3:]] == ["tanh", "u", "tab", "keep"]  # in the order the block reads them
    plan = md.compile(outs, "data:2", "batch:data")
    fwd = next(s for s in plan.steps if s.kind == "repeat" and not s.args["backward"])
    assert fwd.args["closed"] == ("closed/tanh", "closed/u", "closed/tab", "closed/keep")
    assert not [v for v in plan.values.values() if "layer" in v.shape.names and "enc" in v.shape.names]


def test_only_what_the_gradient_flows_into_gets_a_gradient():
    """The tables and the batch input are not differentiated: the backward loop makes the
    gradients of the shared param and of the encoder activation only."""
    _, g = _model()
    (back,) = [n for n in g.nodes if n.op.name == "repeat_grad"]
    assert list(back.attrs["block"].extra["dclosed"]) == ["closed/tanh", "closed/u"]


def test_a_shared_param_is_reduced_once_per_step_not_per_layer():
    """Its layers' gradients are summed in the loop as partial sums; one reduction follows."""
    outs, _ = _model()
    plan = md.compile(outs, "data:2", "batch:data")
    bwd = next(s for s in plan.steps if s.kind == "repeat" and s.args["backward"])
    (block,) = bwd.subplans
    assert block.values[block.outputs["d/closed/u"]].sharding.partial == ("data",)
    with_grad = [k for k in bwd.args["closed"] if f"d/{k}" in block.outputs]  # the step's last outputs
    du = bwd.outs[1 + len(bwd.args["names"]) + with_grad.index("closed/u")]
    assert plan.values[du].sharding.partial == ("data",)
    (red,) = [s for s in plan.steps if du in s.ins]  # one reduction of the layers' sum, after the loop
    assert red.kind in ("allreduce", "bucket_allreduce") and red.axes == ("data",)


# bf16 keeps 8 significant bits (2^-9 ~ 2e-3 relative per rounding); each gradient here lies
# behind a handful of roundings (two einsums and a tanh per layer, four layers), which add
# like a random walk: measured 0.5e-2 to 0.7e-2 in norm, dense and on data:2.  A dropped
# layer or partial sum is off by far more.
BF16_GRAD_REL = 2e-2


@pytest.mark.parametrize("mesh, layout", [("data:1", ""), ("data:2", "batch:data")])
def test_bf16_rebuild_reads_the_same_outside_tensors(mesh, layout):
    """Mixed precision replays the block: the new one reads the replayed activation and the same
    params and inputs (the table cast once, before the stack), and its gradients are the fp32 ones rounded."""
    from meshdsl.ir.precision import mixed_precision
    outs, g = _model()
    params, feeds = _data()
    low = mixed_precision(outs["loss"], "bf16")
    old, new = [n for n in g.nodes if n.op.name == "repeat"]  # the rebuilt one is built last
    assert new.inputs[3] is not old.inputs[3] and new.inputs[3].node.op.name == "tanh"  # the replayed activation
    # the same param and inputs; the table without a batch dim is cast to bf16 once, before the stack
    # (loop-invariant), the batch input in every layer as before
    (u, tab, keep), (u0, tab0, keep0) = new.inputs[4:], old.inputs[4:]
    assert u is u0 and keep is keep0 and tab.node.op.name == "cast" and tab.node.inputs[0] is tab0
    ps = {n.name: n.outputs[0] for n in g.nodes if n.op.name == "param"}
    with g:
        grads = md.grad(low, ps)
    got = md.run_simulated(md.compile(grads, mesh, layout), feeds, params)
    want = md.run_dense({k: outs[f"d/{k}"] for k in ps}, feeds, params)
    for k in ps:
        assert got[k].dtype == torch.float32
        assert 0 < (got[k] - want[k]).norm() <= BF16_GRAD_REL * want[k].norm(), k


def test_nested_repeat_reads_the_outermost_graph():
    """An inner block reads a param two graphs out: captured through the block in between."""
    s = md.Dim("sub", 3)
    with md.Graph("nested"):
        x, u, w = md.input("x", [B, D]), md.param("u", [D]), md.param("w", [L, s, D])
        y = md.repeat(lambda h, p: md.repeat(lambda c, q: md.tanh(c * q["w"] + u), h, {"w": p["w"]}, "sub") + h,
                      x, {"w": w}, "layer")
    params, feeds = {"u": torch.randn(4), "w": torch.randn(4, 3, 4)}, {"x": torch.randn(8, 4)}
    h = feeds["x"]
    for l in range(L.size):
        h0 = h
        for j in range(s.size):
            h = torch.tanh(h * params["w"][l, j] + params["u"])
        h = h + h0
    torch.testing.assert_close(md.run_dense(y, feeds, params)["out"], h, rtol=TOL, atol=TOL)
    torch.testing.assert_close(md.run_simulated(md.compile(y, "model:2", "d_model:model"), feeds, params)["out"],
                               h, rtol=TOL, atol=TOL)


def test_a_block_reading_a_tensor_of_another_graph_is_an_error():
    with md.Graph("other"):
        table = md.input("table", [D])
    with md.Graph("main"):
        x, w = md.input("x", [B, D]), md.param("w", [L, D])
        with pytest.raises(GraphError) as info:
            md.repeat(lambda h, p: h * p["w"] + table, x, {"w": w}, "layer")
    text = str(info.value)
    assert "reads Tensor(table" in text and "graph 'other'" in text and "does not enclose the block" in text, text
    assert "Fix: build 'table' in graph 'main' before calling repeat" in text, text


def test_a_table_lookup_inside_the_layers_pipelines_with_micro_batches():
    """A table lookup inside the block: its gradient is a scatter of the batch's sum, linear in
    it, so each micro-batch's part passes through the scatter and the parts are summed after the
    micro-batches (ops/embed.py ``ScatterAdd.linear_args``).  Inside the block or before the
    repeat, the model matches dense.  (A sum over the batch that is not linear is still refused:
    tests/test_heldout_encdec_moe.py.)"""
    s, v = md.Dim("seq", 3), md.Dim("vocab", 5)

    def build(inside: bool):
        with md.Graph("lookup"):
            ids, pos = md.input("ids", [B, s], torch.int64), md.input("pos", [s], torch.int64)
            emb, w = md.param("emb", [v, D]), md.param("w", [L, D])
            x = md.gather(emb, ids, "vocab")
            table = None if inside else md.gather(emb, pos, "vocab")
            y = md.repeat(lambda h, p: md.tanh(h * p["w"] + (md.gather(emb, pos, "vocab") if inside else table)),
                          x, {"w": w}, "layer")
            loss = md.reduce_sum(y * y)
            return {"loss": loss, **md.grad(loss, {"emb": emb, "w": w})}
    feeds = {"ids": torch.randint(0, 5, (8, 3), generator=torch.Generator().manual_seed(0)), "pos": torch.arange(3)}
    for inside in (True, False):
        outs = build(inside)
        _close(md.run_simulated(md.compile(outs, "stage:2", "layer:stage", microbatches=2), feeds),
               md.run_dense(outs, feeds))


ANOTHER_GRAPH_MODEL = '''
from dataclasses import dataclass

import meshdsl as md


@dataclass(frozen=True)
class Config:
    @classmethod
    def tiny(cls):
        return cls()


def build(cfg):
    d = md.Dim("d_model", 4)
    with md.Graph("tables"):
        table = md.input("table", [d])
    with md.Graph("model"):
        x, w = md.input("x", [md.Dim("batch", 2), d]), md.param("w", [md.Dim("layer", 2), d])
        md.repeat(lambda h, p: h * p["w"] + table, x, {"w": w}, "layer")
'''


def test_cli_names_the_tensor_of_another_graph_and_exits_2(capsys, tmp_path):
    from meshdsl.tools import cli
    path = tmp_path / "two_graphs.py"
    path.write_text(ANOTHER_GRAPH_MODEL)
    rc = cli.main(["check", str(path), "--tiny", "--mesh", "data:2", "--layout", "batch:data"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    assert "reads Tensor(table" in err and "build 'table' in graph 'model' before calling repeat" in err, err
