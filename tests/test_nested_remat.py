"""A repeat nested in a layer stack (an RNN over ``time``) under remat: the outer forward saves
nothing its backward's sub-plan does not read (meshdsl/ir/repeat_grad.py, ``_layer_inputs``).

Under ``none`` the outer forward saves the nested repeat's activations, and its gradient runs on
them.  Given them, an RNN's gradient reads the gathered ``h`` it saved, not its per-step carries:
those were still saved, stacked over ``time`` and the layers, for a step input nothing read.  Now a
carry the nested gradient does not read is given as zeros (a constant, never saved); one it reads
(an LSTM's ``c``, read by the forget gate's gradient) is saved as before.  Under ``selective`` the
outer backward recomputes the nested repeat, carries included, and gives them as made.

Legend: T time, B batch, H hidden, HI hid_in (``h`` as a matmul reads it), G gate (an LSTM's
i, f, g, o), L layer.  Forms: ``single`` (a tanh RNN carrying ``h``) and ``tuple`` (an LSTM
carrying ``(h, c)``).  The oracle is the dense program: the loss and every param's gradient.
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md
from meshdsl.lowering.memory import memory_report

T, B, H, HI = md.Dim("time", 5), md.Dim("batch", 4), md.Dim("hidden", 8), md.Dim("hid_in", 8)
G, L = md.Dim("gate", 4), md.Dim("layer", 2)
FP32 = 4


def _outputs(form: str, remat=None) -> dict:
    """The loss and the weight's gradient of ``L`` layers, each an RNN over ``time`` (``form``)."""
    with md.Graph():
        xs = md.input("xs", [T, B, H])
        if form == "single":
            w = md.param("w", [L, HI, H], fan_out=["layer", "hidden"])
            h0 = md.constant(0.1, [B, H])
        else:
            w = md.param("w", [L, HI, G, H], fan_out=["layer", "gate", "hidden"])
            h0 = (md.constant(0.1, [B, H]), md.constant(0.0, [B, H]))

        def rnn(h, s, p):
            return md.tanh(md.einsum("batch hid_in, hid_in hidden -> batch hidden", md.rename(h, hidden="hid_in"),
                                     p["w"]) + s["x"])

        def lstm(hc, s, p):
            h, c = hc
            pre = md.einsum("batch hid_in, hid_in gate hidden -> batch gate hidden", md.rename(h, hidden="hid_in"),
                            p["w"]) + s["x"]
            i, f, g, o = (md.squeeze(md.slice_(pre, "gate", k, k + 1), "gate") for k in range(4))
            c = md.sigmoid(f) * c + md.sigmoid(i) * md.tanh(g)
            return md.sigmoid(o) * md.tanh(c), c

        step = rnn if form == "single" else lstm

        def layer(carry, p):
            return md.repeat(lambda h, s: step(h, s, p), carry, {"x": xs}, "time")

        out = md.repeat(layer, h0, {"w": w}, "layer", remat=remat)
        h = out if form == "single" else out[0] + 0.5 * out[1]
        loss = md.reduce_sum(h * h)
        return {"loss": loss, "grad/w": md.grad(loss, {"w": w})["w"]}


def _check_dense(plan, form: str, remat=None) -> None:
    feeds = {"xs": torch.randn(T.size, B.size, H.size, generator=torch.Generator().manual_seed(0))}
    want, got = md.run_dense(_outputs(form, remat), feeds), md.run_simulated(plan, feeds)
    assert set(want) == set(got) == {"loss", "grad/w"}
    for k in want:
        # fp32, values O(1): the same kernels, split sums added in another order: rounding only
        # (~1e-7); a wrong saved value, or zeros read where a carry was wanted, is O(1e-1)
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def _unread_saved(plan) -> list[str]:
    """The outer backward's saved inputs (``saved/<i>``) that reach a nested backward step only
    as a layer input its sub-plan does not read: saved for nothing."""
    bwd = next(s for s in plan.steps if s.kind == "repeat" and s.args["backward"])
    sub = bwd.subplans[0]
    names = {v: n for n, v in sub.inputs.items() if n.startswith("saved/")}
    out = []
    for s in sub.steps:
        if s.kind == "repeat" and s.args["backward"]:
            inner = s.subplans[0]
            read = {v for t in inner.steps for v in t.ins}
            for i in range(s.args.get("carries", 1)):
                name = "carry" if i == 0 else f"carry.{i}"
                if s.ins[i] in names and inner.inputs[name] not in read:
                    out.append(names[s.ins[i]])
    return out


@pytest.mark.parametrize("form", ["single", "tuple"])
def test_the_outer_forward_saves_no_carry_the_nested_gradient_does_not_read(form):
    plan = md.compile(_outputs(form), "model:2", "hidden:model")
    assert _unread_saved(plan) == []
    # per layer, fp32: each step's gathered h [B, HI] (whole), and, half a rank each, the RNN's tanh
    # output, or the LSTM's 5 gate terms (3 sigmoids, 2 tanh) and its c (the forget gate's gradient
    # reads it), never its h (before: one more half a step, the stacked h carries); and the layer's
    # input (h, or h and c), half a rank
    half = B.size * H.size // 2
    want = T.size * (B.size * HI.size + half) + half if form == "single" else \
        T.size * (B.size * HI.size + 6 * half) + 2 * half
    assert memory_report(plan)["saved_per_layer"] == FP32 * want
    _check_dense(plan, form)


def test_selective_recomputes_the_nested_repeat_with_its_carries():
    """The outer policy recomputes the nested repeat (its own policy ``none``): the nested gradient
    takes the carries the recompute makes (no zeros made besides them), and nothing is saved but
    each layer's input."""
    plan = md.compile(_outputs("tuple", "selective"), "model:2", "hidden:model")
    bwd = next(s for s in plan.steps if s.kind == "repeat" and s.args["backward"])
    sub = bwd.subplans[0]
    made = {v: s for s in sub.steps for v in s.outs}
    inner = next(s for s in sub.steps if s.kind == "repeat" and s.args["backward"])
    assert all(made[v].kind == "repeat" and not made[v].args["backward"] for v in inner.ins[:2])
    assert memory_report(plan)["saved_per_layer"] == FP32 * 2 * B.size * H.size // 2
    _check_dense(plan, "tuple", "selective")
