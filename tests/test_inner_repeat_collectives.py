"""An inner repeat (an RNN over ``time``) in a layer stack is not run again by the outer backward
under ``remat=None`` (meshdsl/ir/repeat_grad.py, ``_mirror_saved``).

The outer backward block re-traces the layer, and its gradient of the inner repeat reads that
repeat's saved activations.  They existed in the re-trace only, so the outer backward ran the
inner repeat again, its collectives included: under ``hidden:model`` the per-step allgather of
``h``, ``2 x time`` a layer where ``time`` do.  Now the outer forward's inner repeat outputs them
too, the outer forward saves them like any activation, and the outer backward runs only the inner
repeat's gradient.  ``full`` still saves each layer's input only, by definition: its recompute
sends the layer's collectives again.

Legend: T time, B batch, H hidden, HI hid_in (``h`` as a matmul reads it), G gate (an LSTM's
i, f, g, o), L layer.  Two forms: ``single`` (a tanh RNN carrying ``h``) and ``tuple`` (an LSTM
carrying ``(h, c)``); and ``deep``, whose RNN step refines ``h`` by a repeat of its own over
``iter`` (K), three repeats deep.  The oracle is the dense program: the loss and every param's
gradient.
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md
from meshdsl.lowering.memory import memory_report

T, B, H, HI = md.Dim("time", 5), md.Dim("batch", 4), md.Dim("hidden", 8), md.Dim("hid_in", 8)
G, L, K = md.Dim("gate", 4), md.Dim("layer", 2), md.Dim("iter", 2)


def _step(form: str, p):
    """One step of the inner recurrence over ``time``: ``x`` [B, H] a step, weights of the layer."""
    def rnn(h, s):
        return md.tanh(md.einsum("batch hid_in, hid_in hidden -> batch hidden", md.rename(h, hidden="hid_in"),
                                 p["w"]) + s["x"])

    def lstm(hc, s):
        h, c = hc
        pre = md.einsum("batch hid_in, hid_in gate hidden -> batch gate hidden", md.rename(h, hidden="hid_in"),
                        p["u"]) + s["x"]
        i, f, g, o = (md.squeeze(md.slice_(pre, "gate", k, k + 1), "gate") for k in range(4))
        c = md.sigmoid(f) * c + md.sigmoid(i) * md.tanh(g)
        return md.sigmoid(o) * md.tanh(c), c
    def deep(h, s):
        def refine(g, q):
            return md.tanh(md.einsum("batch hid_in, hid_in hidden -> batch hidden", md.rename(g, hidden="hid_in"),
                                     q["v"]) + h)
        return rnn(md.repeat(refine, h, {"v": p["v"]}, "iter"), s)
    return {"single": rnn, "tuple": lstm, "deep": deep}[form]


def _outputs(form: str, remat=None) -> dict:
    with md.Graph():
        xs = md.input("xs", [T, B, H])
        if form != "tuple":
            stacked = {"w": md.param("w", [L, HI, H], fan_out=["layer", "hidden"])}
            if form == "deep":
                stacked["v"] = md.param("v", [L, K, HI, H], fan_out=["layer", "iter", "hidden"])
            h0 = md.constant(0.1, [B, H])
        else:
            stacked = {"u": md.param("u", [L, HI, G, H], fan_out=["layer", "gate", "hidden"])}
            h0 = (md.constant(0.1, [B, H]), md.constant(0.0, [B, H]))

        def layer(carry, p):
            return md.repeat(_step(form, p), carry, {"x": xs}, "time")

        out = md.repeat(layer, h0, stacked, "layer", remat=remat)
        h = out[0] + 0.5 * out[1] if form == "tuple" else out
        loss = md.reduce_sum(h * h)
        return {"loss": loss, **{f"grad/{k}": g for k, g in md.grad(loss, stacked).items()}}


def _feeds() -> dict:
    return {"xs": torch.randn(T.size, B.size, H.size, generator=torch.Generator().manual_seed(0))}


def _inner_reruns(plan) -> int:
    """Inner forward repeats the outer backward blocks run (a pipeline's: in its stage programs)."""
    n = 0
    for s, _ in plan.walk():
        if s.kind == "repeat" and s.args["backward"]:
            n += sum(t.kind == "repeat" and not t.args["backward"] for t in s.subplans[0].steps)
    return n


def _gathers(plan) -> int:
    return sum(mult for s, mult in plan.walk() if s.is_collective and "allgather" in s.kind)


def _check_dense(plan, form: str) -> None:
    feeds = _feeds()
    want, got = md.run_dense(_outputs(form), feeds), md.run_simulated(plan, feeds)
    assert set(want) == set(got) and len(want) == (3 if form == "deep" else 2)
    for k in want:
        # fp32, values O(1): the same kernels, split sums added in another order: rounding only
        # (~1e-7); a wrong saved value or layout is O(1e-1)
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_an_rnn_in_a_layer_stack_gathers_h_once_a_step():
    plan = md.compile(_outputs("single"), "model:2", "hidden:model")
    # one allgather of h per step and layer, in the forward (was 2 x 5 x 2: the backward's rerun)
    assert _gathers(plan) == T.size * L.size and _inner_reruns(plan) == 0
    _check_dense(plan, "single")
    # what it costs, per layer: the inner repeat's saved activations stacked over time, each step
    # the gathered h [B, HI] (whole) and tanh's output ([B, H] half a rank; not the step's input h,
    # which its gradient does not read); and the layer's input h [B, H] half, fp32
    assert memory_report(plan)["saved_per_layer"] == 4 * (T.size * (B.size * HI.size + B.size * H.size // 2)
                                                           + B.size * H.size // 2)
    full = md.compile(_outputs("single", "full"), "model:2", "hidden:model")
    assert _gathers(full) == 2 * T.size * L.size and _inner_reruns(full) == 1   # full recomputes the layer


@pytest.mark.parametrize("form, mesh, layout, kw", [
    ("tuple", "model:2", "hidden:model", {}),
    ("tuple", "data:2", "batch:data", {}),
    ("single", "stage:2", "layer:stage", {"microbatches": 2}),
    ("tuple", "stage:2; model:2", "layer:stage; hidden:model", {"microbatches": 2, "schedule": "1f1b"}),
])
def test_the_inner_repeat_runs_once_and_matches_dense(form, mesh, layout, kw):
    plan = md.compile(_outputs(form), mesh, layout, **kw)
    assert _inner_reruns(plan) == 0
    _check_dense(plan, form)


def test_a_repeat_three_deep_runs_each_repeat_once():
    plan = md.compile(_outputs("deep"), "model:2", "hidden:model")
    # each step gathers h for its 2 refinements and its own matmul, in the forward only (was 48:
    # the outer backward ran the time repeat again, and the time repeat's backward the refinements)
    assert _gathers(plan) == L.size * T.size * (K.size + 1) and _inner_reruns(plan) == 0
    _check_dense(plan, "deep")
