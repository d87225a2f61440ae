"""Two pipelined stacks on one stage axis: an encoder-decoder with both layer dims on ``stage``.

``layer:stage; enc_layer:stage`` pipelines both stacks of tests/t5_tiny.py (encoder: 2 layers
over ``enc_layer``; decoder: 4 over ``layer``) and of tests/heldout_bart.py. The stages cut
the two stacks' layers in order, encoder first (an even cut by default, or ``stage_layers``
over the joined list). A stage can hold the end of the encoder and the start of the decoder.
A stack on one stage keeps its layers whole there. The encoder's output goes up to the
decoder's stages, and its gradient comes back down to the stage that made it
(lowering/stage_layers.py ``split_stacks``, lowering/partition.py). Every output matches the
dense program (simulated mesh; one case on two gloo processes).
"""
from __future__ import annotations

import multiprocessing
import pathlib
import re

import pytest
import torch

import meshdsl as md
from meshdsl.search.calibrate import Calibration
from meshdsl.search.predict import StageCost
from meshdsl.search.stage_balance import split_by_cost
from meshdsl.errors import LayoutError
from meshdsl.processes import launcher as launch

import t5_tiny as t5
from conftest import assert_matches_scaled, run_cli, held_outputs_on_this_rank

BART = str(pathlib.Path(__file__).parent / "heldout_bart.py")
BOTH = "layer:stage; enc_layer:stage"
# fp32 with O(1) values: only rounding differs. The stages and the micro-batches add the layers'
# and the batch's parts in another order than the dense program (n * 2**-24 of the magnitudes
# for n terms), far below 1e-5. A wrong cut, a lost transfer or a gradient summed on the wrong
# stage is off by O(1).
REL = 1e-5
CFG = t5.Config()


@pytest.fixture(scope="module")
def t5_model():
    outs, _ = t5.build(CFG)
    feeds = t5.feeds(CFG)
    return outs, feeds, md.run_dense(outs, feeds)


def _close(got, want, what=""):
    assert_matches_scaled(got, want, what, REL)


def _stages(plan, vid):
    return {plan.mesh.coords(r)["stage"] for r in plan.holders[vid]}


@pytest.mark.parametrize("stage_layers, schedule, m", [
    (None, "gpipe", 2),      # 3|3: the encoder whole on stage 0, the decoder's layers 0 | 1..3
    (None, "1f1b", 4),
    ((2, 4), "zbh1", 2),     # each stack whole on one stage (the decoder's shared gate on stage 1 only)
    ((1, 5), "1f1b", 2),     # the encoder over both stages, the decoder whole on stage 1
])
def test_t5_with_both_stacks_pipelined_matches_dense(t5_model, stage_layers, schedule, m):
    outs, feeds, want = t5_model
    plan = md.compile(outs, "stage:2", BOTH, microbatches=m, schedule=schedule, stage_layers=stage_layers)
    _close(md.run_simulated(plan, feeds), want, f"{stage_layers} {schedule} m={m}")


def test_each_stage_holds_its_cut_of_the_joined_layers(t5_model):
    outs, _, _ = t5_model
    plan = md.compile(outs, "stage:2", BOTH, microbatches=2, schedule="1f1b", stage_layers=(1, 5))
    # the encoder's 2 layers on stages 0 and 1, the decoder's 4 all on stage 1
    assert _stages(plan, plan.params["enc_wq"]) == {0, 1}
    assert _stages(plan, plan.params["dec_xq"]) == _stages(plan, plan.params["gate"]) == {1}
    # split over the stages where a stack runs on both, whole where it runs on one
    assert plan.values[plan.params["enc_wq"]].sharding.axes_of("enc_layer") == ("stage",)
    assert plan.values[plan.params["dec_xq"]].sharding.axes_of("layer") == ()
    assert "stack 'enc_layer' on 'stage': stage 0 layer 0, stage 1 layer 1" in plan.notes
    assert "stack 'layer' on 'stage': stage 1 layers 0..3" in plan.notes
    pipe = plan.steps[-1]
    prog = pipe.args["program"]
    _, forward, backward, _ = pipe.subplans
    loops = {(s.label, s.times, prog.stages[1][j]) for j, s in enumerate(forward.steps) if s.kind == "repeat"}
    assert sorted(t for _, t, _ in loops) == [1, 1, 4] and {st for *_, st in loops} == {(0,), (1,)}
    # one carry per boundary (the encoder's); the encoder's output is made on stage 1 (its last
    # layer's), where the decoder reads it, so nothing else goes up, and its gradient is summed there
    sends = [s for s in forward.steps if s.kind == "send"]
    assert [s.bytes for s in sends] == [CFG.batch // 2 * CFG.src_seq * CFG.d_model * 4]


@pytest.mark.parametrize("stage_layers", [(2, 4), (1, 5), (3, 3)])
def test_a_global_gradient_norm_counts_each_stage_once(t5_model, stage_layers):
    """The sum of every gradient's squares (what a clip norm reads) adds each stage's part of a
    stack once: a stage holding none of a stack adds zero for it, not a copy of another's."""
    outs, feeds, _ = t5_model
    grads = [g for k, g in outs.items() if k.startswith("grad/")]
    norm2 = md.reduce_sum(grads[0] * grads[0])
    for g in grads[1:]:
        norm2 = norm2 + md.reduce_sum(g * g)
    plan = md.compile({"norm2": norm2}, "stage:2", BOTH, microbatches=2, schedule="1f1b", stage_layers=stage_layers)
    _close(md.run_simulated(plan, feeds), md.run_dense({"norm2": norm2}, feeds), f"{stage_layers}")


def test_dropout_in_both_stacks_salts_each_layer_by_its_index_in_its_stack():
    """Each layer of each stack salts its dropout by its index in its own stack, wherever the
    cut puts it: the dense program's streams."""
    b, d = md.Dim("batch", 4), md.Dim("d_model", 8)
    le, ld = md.Dim("enc_layer", 3), md.Dim("layer", 4)
    with md.Graph("salted2"):
        x, we, wd = md.input("x", [b, d]), md.param("we", [le, d]), md.param("wd", [ld, d])
        enc = md.repeat(lambda h, p: md.dropout(md.tanh(h * p["w"]), 0.5, 3), x, {"w": we}, "enc_layer")
        y = md.repeat(lambda h, p: md.dropout(md.tanh(h * p["w"] + enc), 0.5, 7), x, {"w": wd}, "layer")
        loss = md.reduce_sum(y * y)
        outs = {"loss": loss, **md.grad(loss, {"we": we, "wd": wd})}
    feeds = {"x": torch.randn(4, 8, generator=torch.Generator().manual_seed(0))}
    want = md.run_dense(outs, feeds)
    # 3 encoder layers do not split evenly: the stages' counts are given (4|3 is the even cut)
    for counts in ((4, 3), (2, 5), (5, 2)):
        plan = md.compile(outs, "stage:2", BOTH, microbatches=2, schedule="1f1b", stage_layers=counts)
        _close(md.run_simulated(plan, feeds), want, f"stage_layers={counts}")


def test_bart_with_both_stacks_pipelined_matches_dense():
    m = md.load_model(BART, tiny=True, enc_layer="enc_layer")
    outs = {"loss": m.loss, **{f"grad/{k}": g for k, g in md.grad(m.loss, m.params).items()}}
    feeds = m.feeds(0)
    want = md.run_dense(outs, feeds)
    for counts, schedule in ((None, "1f1b"), ((1, 3), "gpipe"), ((3, 1), "1f1b")):
        plan = md.compile(outs, "stage:2", BOTH, microbatches=2, schedule=schedule, stage_layers=counts)
        _close(md.run_simulated(plan, feeds), want, f"{counts} {schedule}")


def test_what_two_stacks_cannot_run_is_refused_with_the_fix(t5_model):
    outs, _, _ = t5_model   # (interleaved:V with two stacks runs: tests/test_interleave_two_stacks.py)
    b, d, le, ld = md.Dim("batch", 6), md.Dim("d_model", 4), md.Dim("enc_layer", 3), md.Dim("layer", 3)
    with md.Graph("three"):
        x, we, wd = md.input("x", [b, d]), md.param("we", [le, d]), md.param("wd", [ld, d])
        enc = md.repeat(lambda h, p: md.tanh(h * p["w"]), x, {"w": we}, "enc_layer")
        loss = md.reduce_sum(md.repeat(lambda h, p: md.tanh(h * p["w"] + enc), x, {"w": wd}, "layer"))
    # the encoder whole on stage 0, the decoder over all three stages; each stack on two of the
    # three (tests/test_stack_subset.py has more): run, the dense numbers
    feeds = {"x": torch.randn(6, 4, generator=torch.Generator().manual_seed(1))}
    outs3 = {"loss": loss, **md.grad(loss, {"we": we, "wd": wd})}
    for counts in ((4, 1, 1), (1, 3, 2)):
        plan = md.compile(outs3, "stage:3", BOTH, microbatches=3, stage_layers=counts)
        _close(md.run_simulated(plan, feeds), md.run_dense(outs3, feeds), f"stage:3 {counts}")
    with pytest.raises(LayoutError, match=r"(?s)does not split 6 layers over 2 stages"):
        md.compile(outs, "stage:2", BOTH, microbatches=2, stage_layers=(2, 2))
    with pytest.raises(LayoutError, match=r"(?s)more than one repeat is pipelined over 2 mesh axes"):
        md.compile(outs, "stage:2; pipe:2", "layer:stage; enc_layer:pipe", microbatches=2)


@pytest.mark.parametrize("mesh, layout, m", [("stage:2", BOTH, 2), ("stage:2", BOTH, 4),
                                             ("stage:2; data:2", BOTH + "; batch:data", 2)])
def test_per_layer_outputs_of_a_stack_on_one_stage_match_dense(mesh, layout, m):
    """Beside another pipelined stack, a stack with per-layer outputs (a loss term per layer) all of
    whose layers one stage holds: once refused (the loss's sums of them over the layers were built as
    sums over the stages, and a stack stored whole on one stage dropped that sum, with the other terms
    scaled for it), it is now stored at its counts with an empty part on the other stage, as a stack on
    some of the stages is, and runs on every cut; ``balance_stages`` may pick any of them."""
    b, d, le, ld = md.Dim("batch", 8), md.Dim("d_model", 4), md.Dim("enc_layer", 2), md.Dim("layer", 2)
    with md.Graph("per_layer"):
        x, we, wd = md.input("x", [b, d]), md.param("we", [le, d]), md.param("wd", [ld, d])
        enc = md.repeat(lambda h, p: md.tanh(h * p["w"]) + h, x, {"w": we}, "enc_layer")
        y, per = md.repeat(lambda h, p: (md.tanh(h * p["w"]) + h, {"s": md.reduce_sum(h * h)}), x, {"w": wd}, "layer")
        loss = md.reduce_sum(y * y) + 0.1 * md.reduce_sum(per["s"]) + md.reduce_sum(enc * enc)
    outs = {"loss": loss, **md.grad(loss, {"we": we, "wd": wd})}
    feeds = {"x": torch.randn(8, 4, generator=torch.Generator().manual_seed(2))}
    want = md.run_dense(outs, feeds)
    kw = dict(microbatches=m, schedule="1f1b")
    for counts in (None, (1, 3), (3, 1)):   # 'layer' whole on stage 1 (twice), then on both stages
        plan = md.compile(outs, mesh, layout, stage_layers=counts, **kw)
        _close(md.run_simulated(plan, feeds), want, f"{mesh} m={m} {counts}")
    if m == 2 and mesh == "stage:2":
        plan = md.compile(outs, mesh, layout, stage_layers=(2, 2), **kw)
        # its params stored at its counts: none on stage 0, both layers on stage 1
        assert plan.values[plan.params["wd"]].sharding.axes_of("layer") == ("stage",)
        assert _stages(plan, plan.params["wd"]) == {0, 1}
        auto = md.balance_stages(outs, mesh, layout, **kw)
        _close(md.run_simulated(md.compile(outs, mesh, layout, stage_layers=auto, **kw), feeds), want, f"{auto}")


def test_a_cross_attention_cache_made_before_the_decoder_pipelines_with_both_stacks(capsys):
    """tests/heldout_xcache.py: every decoder layer's keys and values made from the encoder's output
    before the decoder stack.  Once refused with both stacks pipelined (the encoder's backward read its
    output's gradient, a sum over the decoder's stages taken after the micro-batches); each stage of the
    decoder now makes its own layers' keys and values and its part of that gradient per micro-batch, summed
    down the stages (every cut, AdamW, gloo: tests/test_xcache_stacks.py).  ``meshdsl check`` agrees."""
    xcache = str(pathlib.Path(__file__).parent / "heldout_xcache.py")
    for extra in ([], ["--stage-layers", "3,1"]):
        rc, out, err = run_cli(capsys, ["check", xcache, "--tiny", "--mesh", "stage:2", "--layout", BOTH,
                                        "--microbatches", "2", *extra])
        assert rc == 0, err


def _cuts(total, p):
    """Every cut of ``total`` joined layers into ``p`` stages of at least one."""
    if p == 1:
        yield (total,)
        return
    for first in range(1, total - p + 2):
        for rest in _cuts(total - first, p - 1):
            yield (first, *rest)


def _bart_outputs():
    m = md.load_model(BART, tiny=True, enc_layer="enc_layer")
    return {"loss": m.loss, **{f"grad/{k}": g for k, g in md.grad(m.loss, m.params).items()}}, m.feeds(0)


@pytest.mark.parametrize("model, schedule", [("t5", "gpipe"), ("t5", "1f1b"), ("bart", "1f1b"), ("bart", "zbh1")])
def test_auto_stages_cut_both_stacks_where_the_cost_model_predicts_the_fastest_step(t5_model, model, schedule):
    """balance_stages (--stage-layers auto) on both stacks: of every cut of the joined layers, the
    one the cost model predicts fastest (a decoder layer, with its cross-attention, costs more
    than an encoder layer), and it runs the dense numbers."""
    if model == "t5":
        outs, feeds, want = t5_model
    else:
        outs, feeds = _bart_outputs()
        want = md.run_dense(outs, feeds)
    cal = Calibration.defaults()
    counts = md.balance_stages(outs, "stage:2", BOTH, microbatches=2, schedule=schedule, cal=cal)
    plans = {c: md.compile(outs, "stage:2", BOTH, microbatches=2, schedule=schedule, stage_layers=c)
             for c in _cuts(sum(counts), 2)}
    step = {c: md.predict(plan, cal).step_s for c, plan in plans.items()}
    assert step[counts] == min(step.values()), (counts, step)
    _close(md.run_simulated(plans[counts], feeds), want, f"{model} {schedule} auto {counts}")


def _stage_costs(cut, others, sizes, per_layer):
    """StageCosts of ``cut`` (of stacks of ``sizes`` layers costing ``per_layer`` each)."""
    out, start = [], 0
    for o, n in zip(others, cut):
        parts = []
        for k, size in enumerate(sizes):
            lo = sum(sizes[:k])
            mine = max(0, min(start + n, lo + size) - max(start, lo))
            parts.append((mine, mine * per_layer[k]))
        layers_s = sum(x for _, x in parts)
        out.append(StageCost(n, o + layers_s, layers_s, tuple(parts)))
        start += n
    return out


@pytest.mark.parametrize("others", [(0.0, 0.0), (2.0, 0.0), (0.5, 0.0, 3.0), (4.0, 0.0, 0.0), (0.0, 0.0, 0.0)])
def test_the_split_by_cost_prices_each_stacks_layers_and_proposes_only_cuts_that_compile(others):
    """Per-layer costs that differ by stack (3 encoder layers of cost 1, then 3 decoder layers of
    cost 3): split_by_cost's largest stage is the smallest of every cut (the compiler runs each:
    a stack on one stage, on some or on all), priced at each stack's own layer cost."""
    p, sizes, per_layer = len(others), (3, 3), (1.0, 3.0)
    costs = [1.0] * 3 + [3.0] * 3
    stages = _stage_costs(next(_cuts(6, p)), others, sizes, per_layer)   # measured at any cut

    def worst(c):
        ends = [sum(c[:i + 1]) for i in range(p)]
        return max(o + sum(costs[e - n:e]) for o, n, e in zip(others, c, ends))

    valid = list(_cuts(6, p))
    counts = split_by_cost(stages)
    assert counts in valid and worst(counts) == min(map(worst, valid)), (counts, valid)


def test_auto_stages_on_three_stages_pick_the_fastest_predicted_of_every_cut():
    """On 3 stages every cut runs (a stack on one, two or three stages), and what a stage holds
    besides its layers (the encoder output's transfers) moves with the cut: balance_stages'
    answer is the predicted fastest of all ten cuts, and runs the dense numbers."""
    b, d, le, ld = md.Dim("batch", 6), md.Dim("d_model", 4), md.Dim("enc_layer", 3), md.Dim("layer", 3)
    with md.Graph("three_auto"):
        x, we, wd = md.input("x", [b, d]), md.param("we", [le, d]), md.param("wd", [ld, d])
        enc = md.repeat(lambda h, p: md.tanh(h * p["w"]), x, {"w": we}, "enc_layer")
        loss = md.reduce_sum(md.repeat(lambda h, p: md.tanh(h * p["w"] + enc), x, {"w": wd}, "layer"))
        outs3 = {"loss": loss, **md.grad(loss, {"we": we, "wd": wd})}
    cal = Calibration.defaults()
    counts = md.balance_stages(outs3, "stage:3", BOTH, microbatches=3, cal=cal)
    plans = {c: md.compile(outs3, "stage:3", BOTH, microbatches=3, stage_layers=c) for c in _cuts(6, 3)}
    step = {c: md.predict(plan, cal).step_s for c, plan in plans.items()}
    assert step[counts] == min(step.values()), (counts, step)
    feeds = {"x": torch.randn(6, 4, generator=torch.Generator().manual_seed(2))}
    plan = plans[counts]
    _close(md.run_simulated(plan, feeds), md.run_dense(outs3, feeds), f"stage:3 auto {counts}")


def test_cli_plan_with_auto_stages_prints_the_cut_of_both_stacks(capsys):
    rc, out, err = run_cli(capsys, ["plan", BART, "--tiny", "--config", "enc_layer=enc_layer", "--mesh", "stage:2",
                                    "--layout", BOTH, "--microbatches", "2", "--schedule", "1f1b",
                                    "--stage-layers", "auto"])
    assert rc == 0, err
    assert "note: stack 'enc_layer' on 'stage':" in out and "note: stack 'layer' on 'stage':" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("stages, predicted per micro-batch"))
    layers = [int(w) for w in re.findall(r"stage \d: (\d+) layers", line)]
    assert len(layers) == 2 and sum(layers) == 4, line


def _two_stack_t5(comm):
    outs, _ = t5.build(CFG)
    # the encoder over both stages (its carry crosses), the decoder on stage 1 (its shared gate's
    # gradient summed there alone)
    plan = md.compile(outs, "stage:2", BOTH, microbatches=2, schedule="1f1b", stage_layers=(1, 5))
    return held_outputs_on_this_rank(comm, plan, t5.feeds(CFG))


@pytest.mark.timeout(200)
def test_two_stacks_on_gloo_processes(t5_model):
    _, _, want = t5_model
    results = launch.spawn(_two_stack_t5, 2, mesh="stage:2", timeout=180)
    assert multiprocessing.active_children() == []
    seen: dict = {}
    for rank, got in enumerate(results):
        _close(got, {k: want[k] for k in got}, f"rank {rank}")
        seen.update(got)
    assert set(seen) == set(want)  # every output is held by some rank


def test_a_two_stack_checkpoint_loads_dense_and_the_run_goes_on(tmp_path, one_torch_thread):
    """Each stage writes its layers of both stacks (AdamW state too); a dense step loads them in
    each stack's global layer order and takes the pipeline's next step."""
    from meshdsl.comm.simulated import SimulatedComm
    from meshdsl.train.checkpoint import load_checkpoint, save_checkpoint

    m = md.load_model(BART, tiny=True, enc_layer="enc_layer")

    def step(mesh, layout, **kw):
        mesh = md.Mesh.parse(mesh) if mesh else md.Mesh(())
        return md.TrainStep(m.loss, m.params, mesh, layout, SimulatedComm(mesh), optimizer=md.AdamW(lr=0.01), **kw)
    pipe = step("stage:2", BOTH, microbatches=2, schedule="1f1b", stage_layers=(1, 3))
    for t in range(2):
        pipe(m.feeds(t))
    path = save_checkpoint(tmp_path, 2, pipe.state(), pipe.executor.comm)
    dense = step("", None)
    state = dense.state()
    dense.load_state(load_checkpoint(path, {k: spec for k, (spec, _) in state.items()}, dense.plan.mesh,
                                     dense.executor.comm.ranks))
    assert dense.step_count == 2
    for k in pipe.carried:
        held = pipe.executor.to_full_held(pipe.plan.params[k], pipe.params[k])
        assert torch.equal(dense.executor.to_full_held(dense.plan.params[k], dense.params[k]), held), k
    want = pipe(m.feeds(2))[0]
    assert dense(m.feeds(2))[0] == pytest.approx(want, rel=REL)


@pytest.mark.parametrize("glue", ["rename", "tanh"])
def test_a_stack_that_starts_from_the_other_stacks_output_pipelines_both(glue):
    """A second stack whose first carry is made from the first stack's output (not read by its
    blocks): once refused, now both stacks pipeline (the ops between them on the first one's last
    stage, tests/test_chained_stacks.py), with the dense numbers."""
    b, d, le, ld = md.Dim("batch", 4), md.Dim("d_model", 4), md.Dim("layer", 2), md.Dim("dec_layer", 2)
    with md.Graph("chained"):
        x = md.input("x", [b, d])
        w, v = md.param("w", [le, d]), md.param("v", [ld, d])
        h = md.repeat(lambda c, p: md.tanh(c * p["w"]), x, {"w": w}, "layer")
        g = md.tanh(h) if glue == "tanh" else h * 2.0
        y = md.repeat(lambda c, p: md.tanh(c * p["v"]), g, {"v": v}, "dec_layer")
        loss = md.reduce_sum(y * y)
        outs = {"loss": loss, **md.grad(loss, {"w": w, "v": v})}
    feeds = {"x": torch.randn(4, 4, generator=torch.Generator().manual_seed(3))}
    plan = md.compile(outs, "stage:2", "layer:stage; dec_layer:stage", microbatches=2)
    _close(md.run_simulated(plan, feeds), md.run_dense(outs, feeds), "both stacks")
