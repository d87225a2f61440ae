"""The plan executor's in-place adds and value freeing (meshdsl/runtime/steps.py, executor.py).

An add step writes into an operand only when a local kernel made it as new storage
and nothing else (another step, a collective, a loop, the outputs) reads it: the same
rule as the dense interpreter (meshdsl/ops/inplace.py).  Values are dropped right
after their last reader.  Every case checks results against plain torch on the same
numbers (exact: the same adds in the same order) and which add steps went in place.
"""
from __future__ import annotations

import torch

import meshdsl as md
from meshdsl.runtime.executor import Executor
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.ops import inplace

B, D, E = md.Dim("batch", 4), md.Dim("d_model", 4), md.Dim("e", 4)
MM = "batch d_model, d_model e -> batch e"


def _executor(out, mesh="data:1", layout=""):
    plan = md.compile(out, mesh, layout)
    return Executor(plan, SimulatedComm(plan.mesh))


def _in_place(ex):
    """(kernel, producer op of the overwritten operand) per add step that went in place."""
    steps = ex.plan.steps
    producer = {v: s.op for s in steps for v in s.outs}
    pos = {inplace.add_into_first: 0, inplace.add_into_second: 1}
    return sorted(((fn.__name__, producer[steps[i].ins[pos[fn]]]) for i, fn in ex.add_into.items()))


def _graph():
    with md.Graph():
        x = md.input("x", [B, D])
        w = md.param("w", [D, E])
        a = md.einsum(MM, x, w)   # fresh, read once: added into
        b = md.einsum(MM, x, w)   # fresh, but read twice and returned: never written
        s1 = a + b
        s2 = md.rename(x, d_model="e") + b   # a feed and a shared b: out of place
        return {"s1": s1, "s2": s2, "b": b}


def test_in_place_only_into_unshared_fresh_values():
    xv, wv = torch.randn(4, 4), torch.randn(4, 4)
    keep = xv.clone()
    for mesh, layout in (("data:1", ""), ("data:2", "batch:data"), ("model:2", "e:model")):
        ex = _executor(_graph(), mesh, layout)
        assert _in_place(ex) == [("add_into_first", "einsum")], (mesh, layout)
        got = ex.full_outputs(ex.run({"x": xv}, {"w": ex.local_slices(ex.plan.values[_w_vid(ex)], wv)}))
        ref = xv @ wv
        torch.testing.assert_close(got["s1"], ref + ref, rtol=0, atol=0)
        torch.testing.assert_close(got["s2"], xv + ref, rtol=0, atol=0)
        torch.testing.assert_close(got["b"], ref, rtol=0, atol=0)   # the output was not written
        assert torch.equal(xv, keep)                                # nor the feed


def _w_vid(ex):
    return next(s.outs[0] for s in ex.plan.steps if s.kind == "param")


def test_outputs_collective_results_and_broadcasts_are_never_written():
    with md.Graph():
        x = md.input("x", [B, D])
        w = md.param("w", [D, E])
        y = x * 2.0
        z = y + 1.0                                  # y is an output
        h = md.einsum(MM, x, w)                      # under d_model:model, a partial sum: allreduced
        u = h + md.rename(x, d_model="e")            # the allreduce's result may be shared by ranks
        t = md.reduce_sum(x * x, "d_model") + md.reduce_sum(w, "e")   # [batch] + [d_model] broadcasts
        out = {"y": y, "z": z, "u": u, "t": t}
    xv, wv = torch.randn(4, 4), torch.randn(4, 4)
    ex = _executor(out, "model:2", "d_model:model")
    assert not any(s.is_collective and s.outs[0] in ex.plan.steps[i].ins
                   for s in ex.plan.steps for i in ex.add_into)
    assert ("add_into_first", "mul") not in _in_place(ex)   # z's operand y is returned
    got = ex.full_outputs(ex.run({"x": xv}, {"w": ex.local_slices(ex.plan.values[_w_vid(ex)], wv)}))
    # a 4-term dot product split over 2 ranks and summed: fp32 rounding of one extra add
    torch.testing.assert_close(got["u"], xv @ wv + xv, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got["y"], xv * 2.0, rtol=0, atol=0)
    torch.testing.assert_close(got["z"], xv * 2.0 + 1.0, rtol=0, atol=0)
    torch.testing.assert_close(got["t"], (xv * xv).sum(1)[:, None] + wv.sum(1), rtol=1e-6, atol=1e-6)


def test_residual_adds_into_the_block_output():
    with md.Graph():
        x = md.input("x", [B, E])
        w = md.param("w", [D, E])
        h = md.einsum(MM, md.rename(x, e="d_model"), w)
        y = x + h * 0.5          # x is a feed (and read twice); the scaled product is fresh
        out = {"y": y}
    xv, wv = torch.randn(4, 4), torch.randn(4, 4)
    keep = xv.clone()
    ex = _executor(out)
    assert _in_place(ex) == [("add_into_second", "mul")]
    got = ex.full_outputs(ex.run({"x": xv}, {"w": [wv]}))
    torch.testing.assert_close(got["y"], xv + (xv @ wv) * 0.5, rtol=0, atol=0)
    assert torch.equal(xv, keep)


def test_training_step_gradient_sums_go_in_place_and_match_dense():
    """A two-layer MLP's backward sums the gradient of the shared input in place; the
    training step's outputs still equal the dense program's bit for bit."""
    F = md.Dim("d_ff", 8)
    with md.Graph():
        x = md.input("x", [B, D])
        w1, w2 = md.param("w1", [D, F]), md.param("w2", [D, F])
        h = md.einsum("batch d_model, d_model d_ff -> batch d_ff", x, w1)
        g = md.einsum("batch d_model, d_model d_ff -> batch d_ff", x, w2)
        y = h * g + h
        loss = md.reduce_sum(y * y)
        grads = md.grad(loss, {"w1": w1, "w2": w2})
        out = {"loss": loss, **{f"g_{k}": v for k, v in grads.items()}}
    feeds = {"x": torch.randn(4, 4)}
    params = {"w1": torch.randn(4, 8), "w2": torch.randn(4, 8)}
    ex = _executor(out)
    assert ex.add_into, "the gradient of h (read twice) is a sum of fresh products"
    got = ex.full_outputs(ex.run(feeds, {k: [v] for k, v in params.items()}))
    want = md.run_dense(out, feeds, params)
    for k in out:   # one device, the same kernels in the same order: exact
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)


def test_each_value_is_dropped_after_its_last_reader():
    ex = _executor(_graph())
    plan = ex.plan
    outputs = set(plan.outputs.values())
    last = {}
    for pos, i in enumerate(ex.order):
        for v in plan.steps[i].ins:
            last[v] = pos
    live_seen = []

    def watch(pos, call):
        def wrapped(env, get, run):
            made = {v for i in ex.order[:pos] for v in plan.steps[i].outs}
            want = {v for v in made if v in outputs or last.get(v, -1) >= pos}
            live_seen.append(set(env) == want)
            return call(env, get, run)
        return wrapped
    ex.calls = list(ex.calls)
    for pos, i in enumerate(ex.order):
        ex.calls[i] = watch(pos, ex.calls[i])
    res = ex.run({"x": torch.randn(4, 4)}, {"w": [torch.randn(4, 4)]})
    assert live_seen and all(live_seen)
    assert set(res) == {"s1", "s2", "b"}
    # every value some step reads is dropped exactly once, never an output
    dropped = [v for vs in ex.free_after for v in vs]
    assert len(dropped) == len(set(dropped)) and set(dropped) == set(last) - outputs
