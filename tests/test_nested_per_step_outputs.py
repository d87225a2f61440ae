"""A layer repeat's per-layer outputs made from an inner (time) repeat's per-step outputs.

Each layer of an outer ``md.repeat`` over ``layer`` runs an LSTM over ``time`` (an inner
``md.repeat`` whose per-step output is each step's ``h``, ``hs`` [time, batch, hidden]), and hands
out per layer, as the outer block's per-layer outputs:

- ``s``: a sum of ``tanh(hs)`` (a scalar per layer);
- ``hs``: the per-step outputs themselves;
- ``m``: made from both the inner repeat's last carry ``c`` and its per-step outputs;
- ``l``: a sum of ``hs`` weighted by a stacked param ``v`` of the outer block (linear in ``hs``:
  the outer backward's carry gradient needs no ``hs``, ``v``'s gradient does).

The forward block lowers its carry first and its per-layer outputs after; the backward block its
carry gradient, then the stacked params' gradients, then those of tensors read from outside.  The
inner repeat is lowered in the first phase, so what a later phase reads of it (its per-step
outputs) is marked read before any phase is lowered: otherwise it lowers without them (``compile:
... is used before it is defined``) or a second time.  Two forms: ``tuple`` (both repeats carry
``(h, c)``) and ``single`` (the outer one carries ``h``, the inner one ``[h, c]`` joined along
``hidden``; only this one can be pipelined over ``layer``).  The oracle is the dense program:
the loss and the gradients of every param and input.
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md
from conftest import adamw_dense_curve

T, B, DI, G = md.Dim("time", 3), md.Dim("batch", 4), md.Dim("d_in", 3), md.Dim("gate", 4)
H, HI, LAYER = md.Dim("hidden", 4), md.Dim("hidden_in", 4), md.Dim("layer", 2)
ALL = ("s", "hs", "m", "l")


def _cell(h, c, x, w, u):
    """One LSTM step: the new (h, c)."""
    pre = md.einsum("batch d_in, d_in gate hidden -> batch gate hidden", x, w) + \
        md.einsum("batch hidden_in, hidden_in gate hidden -> batch gate hidden", md.rename(h, hidden="hidden_in"), u)
    i, f, g, o = (md.squeeze(md.slice_(pre, "gate", k, k + 1), "gate") for k in range(4))
    c = md.sigmoid(f) * c + md.sigmoid(i) * md.tanh(g)
    return md.sigmoid(o) * md.tanh(c), c


def _over_time(h, c, xs, w, u, form: str):
    """(h, c) after the steps, and each step's h stacked over time."""
    if form == "tuple":
        def step(hc, p):
            h, c = _cell(*hc, p["x"], w, u)
            return (h, c), {"h": h}
        (h, c), per = md.repeat(step, (h, c), {"x": xs}, "time")
        return h, c, per["h"]

    def joined(hc, p):
        h, c = _cell(md.slice_(hc, "hidden", 0, 4), md.slice_(hc, "hidden", 4, 8), p["x"], w, u)
        return md.concat([h, c], "hidden"), {"h": h}
    hc, per = md.repeat(joined, md.concat([h, c], "hidden"), {"x": xs}, "time")
    return md.slice_(hc, "hidden", 0, 4), md.slice_(hc, "hidden", 4, 8), per["h"]


def _per_layer(hs, c, v, kinds) -> dict:
    made = {"s": lambda: md.reduce_sum(md.tanh(hs)), "hs": lambda: hs,
            "m": lambda: md.reduce_sum(md.tanh(hs), "time") * c, "l": lambda: md.reduce_sum(hs * v, "time")}
    return {k: made[k]() for k in kinds}


def _read(per: dict):
    """The loss's term of the stacked per-layer outputs (each read nonlinearly but ``s``)."""
    read = {"s": md.reduce_sum, "hs": lambda t: 0.5 * md.reduce_sum(md.tanh(t)), "m": lambda t: md.reduce_sum(t * t),
            "l": lambda t: md.reduce_sum(md.tanh(t))}
    terms = [read[k](t) for k, t in per.items()]
    return sum(terms[1:], terms[0])


def _graph(form: str, kinds=ALL, remat=None):
    """The loss (and graph, params) of the two nested repeats."""
    with md.Graph("nested") as g:
        xs, h0, c0 = md.input("xs", [T, B, DI]), md.input("h0", [B, H]), md.input("c0", [B, H])
        ps = {"w": md.param("w", [DI, G, H]), "u": md.param("u", [LAYER, HI, G, H]), "v": md.param("v", [LAYER, H])}
        w = ps["w"]
        if form == "tuple":
            def layer(hc, p):
                h, c, hs = _over_time(*hc, xs * 1.0, w, p["u"], "tuple")
                return (h, c), _per_layer(hs, c, p["v"], kinds)
            (h, c), per = md.repeat(layer, (h0, c0), {"u": ps["u"], "v": ps["v"]}, "layer", remat=remat)
            loss = md.reduce_sum(h * c) + md.reduce_sum(c * c) + _read(per)
        else:
            def layer(h, p):
                h, c, hs = _over_time(h, h * 0.5 + c0, xs * 1.0, w, p["u"], "single")
                return h + c, _per_layer(hs, c, p["v"], kinds)
            h, per = md.repeat(layer, h0, {"u": ps["u"], "v": ps["v"]}, "layer", remat=remat)
            loss = md.reduce_sum(h * h) + _read(per)
    return g, loss, ps, {"xs": xs, "h0": h0, "c0": c0}


def _model(form: str, kinds=ALL, remat=None) -> dict:
    """The loss and the gradient of every param and input."""
    g, loss, ps, ins = _graph(form, kinds, remat)
    with g:
        grads = md.grad(loss, {**ps, **ins})
    return {"loss": loss, **{f"d/{k}": t for k, t in grads.items()}}


def _feeds(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"xs": torch.randn(3, 4, 3, generator=gen), "h0": torch.randn(4, 4, generator=gen),
            "c0": torch.randn(4, 4, generator=gen)}


def _params() -> dict:
    gen = torch.Generator().manual_seed(1)
    return {"w": torch.randn(3, 4, 4, generator=gen) * 0.5, "u": torch.randn(2, 4, 4, 4, generator=gen) * 0.5,
            "v": torch.randn(2, 4, generator=gen)}


def _inner_lowerings(plan) -> list[int]:
    """For each block holding the inner repeat (the outer forward's, the outer backward's
    recompute), how many times its sub-plan runs the inner forward repeat."""
    counts = []
    for s in plan.steps:
        for sub in s.subplans:
            inner = [t for t in sub.steps if t.kind == "repeat" and not t.args.get("backward")]
            if s.kind == "repeat" and inner:
                counts.append(len(inner))
            counts += _inner_lowerings(sub)
    return counts


def _check(form, kinds, mesh, layout, remat=None, microbatches=1):
    params, feeds = _params(), _feeds()
    want = md.run_dense(_model(form, kinds), feeds, params)
    plan = md.compile(_model(form, kinds, remat), mesh, layout, microbatches=microbatches)
    got = md.run_simulated(plan, feeds, params)
    assert set(got) >= set(want) and len(want) == 7
    for k in want:
        # fp32, values O(10): the same kernels, split sums added in another order: rounding only
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    # the outer forward block runs it once; so does the outer backward block's recompute under
    # "full", while under none the forward saves the inner repeat's activations and nothing reruns it
    assert _inner_lowerings(plan) == ([1, 1] if remat == "full" else [1]), _inner_lowerings(plan)


@pytest.mark.parametrize("form, kinds, mesh, layout, remat", [
    ("tuple", ("s",), "data:2", "batch:data", None),                      # the report's case
    ("single", ("s", "hs", "m"), "model:3", "hidden:model", "full"),      # uneven: 4 over 3
    ("tuple", ("l",), "data:2", "batch:data", "full"),                    # hs read by v's gradient only
    pytest.param("tuple", ALL, "model:2", "hidden:model", None, marks=pytest.mark.slow),
    pytest.param("single", ("m", "l"), "model:2", "time:model", "full", marks=pytest.mark.slow),
    pytest.param("tuple", ("hs", "m"), "data:2; model:2", "batch:data; hidden:model; params.d_in:data", "full",
                 marks=pytest.mark.slow),
    pytest.param("single", ALL, "model:2", "gate:model", None, marks=pytest.mark.slow),
])
def test_per_layer_outputs_of_inner_per_step_outputs_match_dense(form, kinds, mesh, layout, remat):
    _check(form, kinds, mesh, layout, remat)


@pytest.mark.parametrize("mesh, layout", [
    ("stage:2", "layer:stage"),
    pytest.param("stage:2; model:2", "layer:stage; hidden:model", marks=pytest.mark.slow),
])
def test_a_pipeline_of_the_outer_repeat(mesh, layout):
    _check("single", ("s", "m"), mesh, layout, microbatches=2)


def test_adamw_steps_under_a_batch_split_track_the_dense_program(one_torch_thread):
    g, loss, ps, _ = _graph("tuple", ("s", "m"), remat="full")
    model = md.Model(g, loss, ps, _feeds)
    opt = md.AdamW(lr=0.01, weight_decay=0.1)
    want, _ = adamw_dense_curve(model, opt, 1.0, 3)
    step = md.TrainStep(model.loss, model.params, "data:2", "batch:data", md.SimulatedComm(md.Mesh.parse("data:2")),
                        optimizer=opt, clip_norm=1.0)
    got = [step(model.feeds(i), lr=0.01)[0] for i in range(3)]
    # fp32 sums in another order over a few steps: ~1e-6 relative; a wrong update is O(1e-2)
    assert got == pytest.approx(want, rel=1e-5), (got, want)
    assert want[0] != pytest.approx(want[-1], rel=1e-4)     # the steps moved the model
