"""md.repeat with a tuple carry: several carried tensors, each with its own shape and layout.

Two models: an LSTM over ``time`` carrying ``(h, c)`` [batch, hidden] each (its per-step ``h``
a per-layer output), and a two-track block in the way of Evoformer carrying an MSA track
``msa`` [rows, res, c_m] and a pair track ``pair`` [res, res_j, c_z] that read each other every
layer.  The oracle is the dense program, and for the LSTM also the same cell with ``(h, c)``
joined into one carry along ``hidden`` (the workaround a tuple carry replaces): values and
every gradient.  Covered: dense (remat none/full/selective), data, Megatron-style and each
carried tensor's own dims split, uneven 3-way splits, FSDP, micro-batches, a time repeat
nested in a layer repeat, a tuple-carry recurrence inside each stage of a 1f1b / gpipe /
zbh1 pipeline, mixed precision's replay, AdamW steps, the layout search (its pipelines too),
one gloo run, a pipeline over the recurrence's own steps (``time:stage``), and the refusals of
bad carries.
"""
from __future__ import annotations

import pytest
import torch

import meshdsl as md
from meshdsl.search.calibrate import Calibration
from meshdsl.search.search import search

T, B, DI, G = md.Dim("time", 3), md.Dim("batch", 4), md.Dim("d_in", 3), md.Dim("gate", 4)
H, HI, LAYER = md.Dim("hidden", 4), md.Dim("hidden_in", 4), md.Dim("layer", 2)


def _cell(h, c, x, w, u):
    """One LSTM step: the new (h, c)."""
    pre = md.einsum("batch d_in, d_in gate hidden -> batch gate hidden", x, w) + \
        md.einsum("batch hidden_in, hidden_in gate hidden -> batch gate hidden", md.rename(h, hidden="hidden_in"), u)
    i, f, g, o = (md.squeeze(md.slice_(pre, "gate", k, k + 1), "gate") for k in range(4))
    c = md.sigmoid(f) * c + md.sigmoid(i) * md.tanh(g)
    return md.sigmoid(o) * md.tanh(c), c


def _over_time(h, c, xs, w, u, form: str, remat=None):
    """(h, c) after the steps, and each step's h stacked over time; ``form``: ``tuple`` carries
    (h, c), ``concat`` joins them along ``hidden`` (8 wide), ``one`` carries a 1-tuple (h,) and
    keeps c constant."""
    if form == "tuple":
        def step(hc, p):
            h, c = _cell(*hc, p["x"], w, u)
            return (h, c), {"h": h}
        (h, c), per = md.repeat(step, (h, c), {"x": xs}, "time", remat=remat)
        return h, c, per["h"]
    if form == "one":
        def step(hs, p):
            (h,) = hs
            return (_cell(h, c, p["x"], w, u)[0],), {"h": h}
        (h,), per = md.repeat(step, (h,), {"x": xs}, "time", remat=remat)
        return h, c, per["h"]

    def joined(hc, p):
        h, c = _cell(md.slice_(hc, "hidden", 0, 4), md.slice_(hc, "hidden", 4, 8), p["x"], w, u)
        return md.concat([h, c], "hidden"), {"h": h}
    hc, per = md.repeat(joined, md.concat([h, c], "hidden"), {"x": xs}, "time", remat=remat)
    return md.slice_(hc, "hidden", 0, 4), md.slice_(hc, "hidden", 4, 8), per["h"]


def _lstm(form: str = "tuple", remat=None, nested: bool = False):
    """The LSTM's loss and the gradients of every param and input.  ``nested``: a time repeat in
    each of two layers of a layer repeat that carries (h, c) too (its u stacked per layer)."""
    with md.Graph("lstm"):
        xs = md.input("xs", [T, B, DI])
        h0, c0 = md.input("h0", [B, H]), md.input("c0", [B, H])
        w = md.param("w", [DI, G, H])
        u = md.param("u", [LAYER, HI, G, H])
        if nested:
            def layer(hc, p):
                h, c, hs = _over_time(*hc, xs * 1.0, w, p["u"], form)
                return (h + 0.1 * md.reduce_sum(md.tanh(hs), "time"), c)
            h, c = md.repeat(layer, (h0, c0), {"u": u}, "layer", remat=remat)
            extra = 0.0
        else:
            h, c, hs = _over_time(h0, c0, xs, w, md.squeeze(md.slice_(u, "layer", 0, 1), "layer"), form, remat)
            extra = md.reduce_sum(md.tanh(hs))
        loss = extra + md.reduce_sum(h * c) + md.reduce_sum(c * c)
        grads = md.grad(loss, {"w": w, "u": u, "h0": h0, "c0": c0, "xs": xs})
    return {"loss": loss, **{f"d/{k}": v for k, v in grads.items()}}


R, N, NJ, CM, CMO, CZ = (md.Dim("rows", 2), md.Dim("res", 3), md.Dim("res_j", 3), md.Dim("c_m", 4), md.Dim("c_mo", 4),
                         md.Dim("c_z", 6))


def _two_tracks(mp, p):
    """A layer of the two tracks: the MSA biased by the pair, the pair updated by the MSA's outer product."""
    msa, pair = mp
    bias = md.einsum("res c_z, c_z c_m -> res c_m", md.reduce_mean(pair, "res_j"), p["w_zm"])
    msa = msa + md.rename(md.tanh(md.einsum("rows res c_m, c_m c_mo -> rows res c_mo", msa, p["w_m"])), c_mo="c_m") + bias
    opm = md.einsum("rows res c_m, rows res_j c_m -> res res_j c_m", msa, md.rename(msa, res="res_j"))
    pair = pair + md.tanh(md.einsum("res res_j c_m, c_m c_z -> res res_j c_z", opm, p["w_mz"]))
    return (msa, pair), {"norm": md.reduce_sum(pair * pair)}


def _evo(remat=None):
    with md.Graph("evo"):
        m0, z0 = md.input("m0", [R, N, CM]), md.input("z0", [N, NJ, CZ])
        ps = {"w_m": md.param("w_m", [LAYER, CM, CMO]), "w_zm": md.param("w_zm", [LAYER, CZ, CM]),
              "w_mz": md.param("w_mz", [LAYER, CM, CZ])}
        (m, z), per = md.repeat(_two_tracks, (m0, z0), ps, "layer", remat=remat)
        loss = md.reduce_sum(md.tanh(m)) + md.reduce_mean(z * z) + 0.01 * md.reduce_sum(per["norm"])
        grads = md.grad(loss, {**ps, "m0": m0, "z0": z0})
    return {"loss": loss, **{f"d/{k}": v for k, v in grads.items()}}


def _inputs(kind: str):
    gen = torch.Generator().manual_seed(0)
    if kind == "lstm":
        params = {"w": torch.randn(3, 4, 4, generator=gen) * 0.5, "u": torch.randn(2, 4, 4, 4, generator=gen) * 0.5}
        feeds = {"xs": torch.randn(3, 4, 3, generator=gen), "h0": torch.randn(4, 4, generator=gen),
                 "c0": torch.randn(4, 4, generator=gen)}
        return params, feeds
    params = {"w_m": torch.randn(2, 4, 4, generator=gen) * 0.5, "w_zm": torch.randn(2, 6, 4, generator=gen) * 0.5,
              "w_mz": torch.randn(2, 4, 6, generator=gen) * 0.5}
    return params, {"m0": torch.randn(2, 3, 4, generator=gen), "z0": torch.randn(3, 3, 6, generator=gen)}


def _close(got: dict, want: dict, what: str = "") -> None:
    for k in want:
        # fp32, values O(10): the same kernels, split sums added in another order: rounding only
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{what} {k}: {m}")


def _count(plan, kind: str) -> int:
    """Collectives of ``kind`` a step runs, a loop's body counted once per layer."""
    return sum((s.kind == kind) + sum((s.times if s.kind == "repeat" else 1) * _count(sub, kind)
                                      for sub in s.subplans) for s in plan.steps)


def _lstm_want():
    params, feeds = _inputs("lstm")
    return params, feeds, md.run_dense(_lstm("concat"), feeds, params)


@pytest.mark.parametrize("remat", [None, pytest.param("full", marks=pytest.mark.slow),
                                   pytest.param("selective", marks=pytest.mark.slow)])
def test_lstm_tuple_carry_matches_the_joined_carry_densely(remat):
    params, feeds, want = _lstm_want()
    _close(md.run_dense(_lstm("tuple", remat), feeds, params), want, f"remat={remat}")


def test_lstm_hidden_split_moves_nothing_between_h_and_c():
    """hidden:model splits h and c each: no permute, where the joined carry trades halves every step."""
    params, feeds, want = _lstm_want()
    tuple_plan = md.compile(_lstm("tuple"), "model:2", "hidden:model")
    joined_plan = md.compile(_lstm("concat"), "model:2", "hidden:model")
    _close(md.run_simulated(tuple_plan, feeds, params), want, "tuple")
    assert _count(tuple_plan, "permute") == 0
    assert _count(joined_plan, "permute") >= 3 * T.size   # (32 here: h and c traded every step, both ways)
    fwd = next(s for s in tuple_plan.steps if s.kind == "repeat" and not s.args["backward"])
    assert fwd.args["carries"] == 2 and set(fwd.subplans[0].inputs) >= {"carry", "carry.1"}


def test_two_tracks_of_different_shapes_match_the_dense_program():
    params, feeds = _inputs("evo")
    want = md.run_dense(_evo(), feeds, params)
    _close(md.run_dense(_evo("full"), feeds, params), want, "remat full")
    for mesh, layout in [("model:2", "c_m:model"), ("model:2", "c_z:model"), ("data:1", "")]:   # (data:1: one rank held)
        _close(md.run_simulated(md.compile(_evo(), mesh, layout), feeds, params), want, layout)


def test_one_element_tuple_carries_one_tensor():
    params, feeds = _inputs("lstm")
    with md.Graph():
        h0 = md.input("h0", [B, H])
        out = md.repeat(lambda hs, p: (hs[0] * 0.5,), (h0,), {}, md.Dim("layer", 2))
    assert isinstance(out, tuple) and len(out) == 1
    torch.testing.assert_close(md.run_dense({"h": out[0]}, {"h0": feeds["h0"]}, {})["h"], feeds["h0"] * 0.25)
    want = md.run_dense(_lstm("one"), feeds, params)
    _close(md.run_simulated(md.compile(_lstm("one"), "model:2", "hidden:model"), feeds, params), want, "1-tuple")


def test_a_tuple_carry_pipelines_over_its_own_steps():
    """'time:stage' pipelines the (h, c) recurrence's own steps, each stage handing both carried
    tensors on (tests/test_pipeline_tuple_carry.py covers stacks of layers), as the joined carry does."""
    params, feeds, want = _lstm_want()
    plan = md.compile(_lstm("tuple"), "stage:3", "time:stage", microbatches=2, schedule="1f1b")
    _close(md.run_simulated(plan, feeds, params), want, "time:stage")


def _stack_of_lstms(form: str):
    """Two layers pipelined over ``layer`` (one carried tensor between the stages), each running an
    LSTM over time that carries (h, c): the tuple carry inside each stage's block."""
    with md.Graph("stack"):
        xs, h0 = md.input("xs", [T, B, DI]), md.input("h0", [B, H])
        w, u = md.param("w", [DI, G, H]), md.param("u", [LAYER, HI, G, H])

        def layer(h, p):
            h, c, hs = _over_time(h, h * 0.5, xs * 1.0, w, p["u"], form)
            return h + c + 0.1 * md.reduce_sum(md.tanh(hs), "time")
        h = md.repeat(layer, h0, {"u": u}, "layer")
        loss = md.reduce_sum(h * h)
        grads = md.grad(loss, {"w": w, "u": u, "h0": h0})
    return {"loss": loss, **{f"d/{k}": v for k, v in grads.items()}}


@pytest.mark.parametrize("schedule, mesh, layout", [
    ("1f1b", "stage:2; model:2", "layer:stage; hidden:model"),
    pytest.param("gpipe", "stage:2", "layer:stage", marks=pytest.mark.slow),
    pytest.param("zbh1", "stage:2; model:2", "layer:stage; hidden:model", marks=pytest.mark.slow),
])
def test_a_tuple_carry_inside_a_pipeline_stage(schedule, mesh, layout):
    params, feeds = _inputs("lstm")
    feeds.pop("c0")
    want = md.run_dense(_stack_of_lstms("concat"), feeds, params)
    plan = md.compile(_stack_of_lstms("tuple"), mesh, layout, microbatches=2, schedule=schedule)
    _close(md.run_simulated(plan, feeds, params), want, schedule)


def _bad_repeat(x, block=lambda c, p: c):
    with md.Graph():
        h = md.input("h", [B, H])
        return md.repeat(block, x(h) if callable(x) else x, {}, md.Dim("layer", 2))


@pytest.mark.parametrize("x, block, err, words", [
    (lambda h: (h, 3.0), None, md.ShapeError, r"item 1 of the carry x is 3\.0 \(float\), not a Tensor"),
    (lambda h: (), None, md.ShapeError, "the carry x is an empty tuple"),
    (lambda h: (h, md.broadcast_to(h, md.Shape([md.Dim("layer", 2), B, H]))), None, md.ShapeError,
     r"item 1 of the carry, .*, has the layer dim 'layer'"),
    (lambda h: (h, h * 2.0), lambda c, p: (c[0],), md.ShapeError,
     "the carry is a tuple of 2 tensors, but the block returned a tuple of 1 items"),
    (lambda h: (h, h * 2.0), lambda c, p: c[0], md.ShapeError, r"block returned Tensor.*\(Tensor\)"),
    (lambda h: (h, h * 2.0), lambda c, p: (c[0], 1.0), md.ShapeError, "item 1 of the block's returned carry is 1.0"),
    (lambda h: (h, h * 2.0), lambda c, p: (c[0], md.reduce_sum(c[1], "hidden")), md.ShapeError,
     r"maps carry\[1\] \[batch:4, hidden:4\] to \[batch:4\](.|\n)*at position 1 of its tuple"),
    (lambda h: (h, h * 2.0), lambda c, p: (c[0], md.cast(c[1], torch.bfloat16)), md.ShapeError,
     r"maps carry\[1\].*its dtype changes"),
    (lambda h: h, lambda c, p: (c, c * 2.0), md.ShapeError, r"to carry several tensors, pass the carry as a tuple"),
])
def test_bad_tuple_carries_are_refused_with_the_position(x, block, err, words):
    with pytest.raises(err, match=words):
        _bad_repeat(x, block or (lambda c, p: c))


# ----------------------------------------------------------------------------- slow: more layouts


@pytest.mark.slow
@pytest.mark.parametrize("mesh, layout, microbatches", [
    ("data:2", "batch:data", 1),
    ("model:3", "hidden:model", 1),                                      # uneven: 4 over 3
    ("data:2; model:2", "batch:data; hidden:model; params.d_in:data", 1),   # FSDP with the split
    ("model:2", "gate:model", 1),                                          # Megatron-style: the gates split
    ("data:2", "batch:data", 2),                                           # micro-batches (accumulation)
])
def test_lstm_layouts_match_the_dense_program(mesh, layout, microbatches):
    params, feeds, want = _lstm_want()
    for remat in (None, "full"):
        plan = md.compile(_lstm("tuple", remat), mesh, layout, microbatches=microbatches)
        _close(md.run_simulated(plan, feeds, params), want, f"{mesh} {layout} remat={remat}")


@pytest.mark.slow
@pytest.mark.parametrize("mesh, layout", [("model:2", "hidden:model"), ("data:2", "batch:data"),
                                          ("model:3", "hidden:model"), ("model:2", "time:model")])
def test_a_time_repeat_nested_in_a_layer_repeat(mesh, layout):
    params, feeds = _inputs("lstm")
    want = md.run_dense(_lstm("concat", nested=True), feeds, params)
    _close(md.run_dense(_lstm("tuple", nested=True), feeds, params), want, "dense")
    plan = md.compile(_lstm("tuple", nested=True, remat="full"), mesh, layout)
    _close(md.run_simulated(plan, feeds, params), want, layout)
    assert _count(plan, "permute") == 0


@pytest.mark.slow
@pytest.mark.parametrize("mesh, layout", [
    ("model:3", "c_m:model"), ("data:2", "rows:data"), ("data:2", "res:data"), ("model:2", "res_j:model"),
    ("data:2; model:2", "res:data; c_z:model; params.c_m:data"),
])
def test_two_tracks_layouts(mesh, layout):
    params, feeds = _inputs("evo")
    want = md.run_dense(_evo(), feeds, params)
    for remat in ("selective", "full"):
        _close(md.run_simulated(md.compile(_evo(remat), mesh, layout), feeds, params), want, f"{layout} {remat}")


def _evo_model():
    with md.Graph("evo_train"):
        m0, z0 = md.input("m0", [R, N, CM]), md.input("z0", [N, NJ, CZ])
        ps = {"w_m": md.param("w_m", [LAYER, CM, CMO]), "w_zm": md.param("w_zm", [LAYER, CZ, CM]),
              "w_mz": md.param("w_mz", [LAYER, CM, CZ])}
        (m, z), per = md.repeat(_two_tracks, (m0, z0), ps, "layer")
        loss = md.reduce_mean(md.tanh(m) * m0) + md.reduce_mean(z * z0) + 0.01 * md.reduce_sum(per["norm"])

    def feeds(seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        return {"m0": torch.randn(2, 3, 4, generator=gen), "z0": torch.randn(3, 3, 6, generator=gen)}
    return md.Model(loss.graph, loss, ps, feeds)


def _lstm_model():
    """Two LSTM layers (a layer repeat carrying (h, c), a time repeat in each), batch 8: a model the
    search may pipeline over ``layer``."""
    b = md.Dim("batch", 8)
    with md.Graph("lstm_train"):
        xs, h0 = md.input("xs", [T, b, DI]), md.input("h0", [b, H])
        w, u = md.param("w", [DI, G, H]), md.param("u", [LAYER, HI, G, H])

        def layer(hc, p):
            h, c, hs = _over_time(*hc, xs * 1.0, w, p["u"], "tuple")
            return (h + 0.1 * md.reduce_sum(md.tanh(hs), "time"), c)
        h, c = md.repeat(layer, (h0, h0 * 0.5), {"u": u}, "layer")
        loss = md.reduce_mean(h * c)

    def feeds(seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        return {"xs": torch.randn(3, 8, 3, generator=gen), "h0": torch.randn(8, 4, generator=gen)}
    return md.Model(loss.graph, loss, {"w": w, "u": u}, feeds)


@pytest.mark.slow
def test_adamw_steps_on_a_tuple_carry():
    from conftest import adamw_dense_curve
    for model, mesh, layout in [(_evo_model(), "model:2", "c_z:model"), (_lstm_model(), "data:2", "batch:data")]:
        opt = md.AdamW(lr=0.01, weight_decay=0.1)
        want, _ = adamw_dense_curve(model, opt, 1.0, 3)
        step = md.TrainStep(model.loss, model.params, mesh, layout, md.SimulatedComm(md.Mesh.parse(mesh)),
                            optimizer=opt, clip_norm=1.0)
        got = [step(model.feeds(i), lr=0.01)[0] for i in range(3)]
        # fp32 sums in another order over a few steps: ~1e-6 relative; a wrong update is O(1e-2)
        assert got == pytest.approx(want, rel=1e-5) and want[0] != pytest.approx(want[-1], rel=1e-4), layout


@pytest.mark.slow
def test_the_search_ranks_a_tuple_carry_and_its_pipelines():
    """The search prices pipelines over the (h, c)-carrying layers too (each stage sends both)."""
    model = _lstm_model()
    found = search(model, model.train_step(0.01), 2, Calibration.defaults())
    assert any("layer:" in r.candidate.layout for r in found.ranked)
    assert not any("carries 2 tensors" in why for _, why in found.invalid)


@pytest.mark.slow
def test_mixed_precision_replays_a_tuple_carry():
    params, feeds = _inputs("evo")
    with md.Graph():
        m0, z0 = md.input("m0", [R, N, CM]), md.input("z0", [N, NJ, CZ])
        ps = {"w_m": md.param("w_m", [LAYER, CM, CMO]), "w_zm": md.param("w_zm", [LAYER, CZ, CM]),
              "w_mz": md.param("w_mz", [LAYER, CM, CZ])}
        (m, z), _ = md.repeat(_two_tracks, (m0, z0), ps, "layer")
        loss = md.reduce_sum(md.tanh(m)) + md.reduce_mean(z * z)
        low = md.mixed_precision(loss, "bf16")
        grads = md.grad(low, ps)
    got, want = md.run_dense({"loss": low, **grads}, feeds, params), md.run_dense({"loss": loss}, feeds, params)
    # bf16 matmuls: 8 bits of mantissa over sums of O(10): a loose bound, far from a lost term
    torch.testing.assert_close(got["loss"], want["loss"], rtol=5e-2, atol=0)


def _gloo_case(rank: int):
    from meshdsl.comm.distributed import TorchComm
    from meshdsl.comm.microbatch import for_plan
    from meshdsl.train.jobs import agree_plan
    torch.set_num_threads(1)
    comm = TorchComm("model:2")
    plan = md.compile(_lstm("tuple"), "model:2", "hidden:model")
    agree_plan(comm, plan)
    params, feeds = _inputs("lstm")
    ex = md.Executor(plan, for_plan(comm, plan))
    local = {s.args["name"]: ex.local_slices(plan.values[s.outs[0]], params[s.args["name"]])
             for s in plan.steps if s.kind == "param"}   # this process's slices of the whole params
    full = {k: ex.to_full_held(plan.outputs[k], xs) for k, xs in ex.run(feeds, local).items()}
    return {k: v for k, v in full.items() if v is not None}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_lstm_tuple_carry_on_two_gloo_processes_matches_dense():
    """One process per rank (a loop holding one rank): (h, c) each split over hidden, no permute."""
    from meshdsl.processes import launcher
    from conftest import assert_ranks_match_dense
    results = launcher.spawn(_gloo_case, 2, timeout=100)
    params, feeds, want = _lstm_want()
    # fp32, the dense program's kernels, split sums added in another order: rounding only
    assert_ranks_match_dense(results, want, 1e-5)
