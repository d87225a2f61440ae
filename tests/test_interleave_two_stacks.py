"""Interleaved virtual stages with two pipelined stacks: an encoder-decoder on ``stage:p`` with
``--schedule interleaved:V`` (issue 35, items 2 and 5).

``layout "layer:stage; enc_layer:stage"`` cuts the stacks' joined layers (encoder first) into
``p * V`` virtual stages; rank r runs virtual stages r, r + p, ..  The partition cuts the plan
on those logical stages and lowering/stacks_on_ranks.py puts them on the ranks: transfers at the
ranks' offsets (none between two stages of one rank), a value per chunk where several chunks of
a rank make one per micro-batch, joined where the final segment reads it, each stack's layers
stored block-cyclically with empty blocks on virtual stages holding none of it; per-layer outputs
of a stack (once refused) made and summed by each chunk on its own layers.  Each case
matches the dense program (forward and gradients, an AdamW step, a checkpoint a dense step loads,
one case on two gloo processes); the program's transfers pair up rank to rank.
"""
from __future__ import annotations

import pathlib

import pytest
import torch

import meshdsl as md
from meshdsl.lowering.pipeline_program import PER_MICROBATCH, Segment
from meshdsl.lowering.schedule import validate
from meshdsl.processes import launcher as launch

from conftest import assert_matches_scaled, run_cli, held_outputs_on_this_rank, assert_ranks_match_dense

BART = str(pathlib.Path(__file__).parent / "heldout_bart.py")
BOTH = "layer:stage; enc_layer:stage"
# fp32 with O(1) values: only rounding differs. The stages, chunks and micro-batches add the
# layers' and the batch's parts in another order than the dense program (n * 2**-24 of the
# magnitudes for n terms), far below 1e-5. A lost chunk's part, a doubled one or a layer run on
# the wrong chunk is off by O(1).
REL = 1e-5


def _bart(layers=2, batch=4):
    """The held-out BART, ``layers`` encoder and as many decoder layers."""
    return md.load_model(BART, tiny=True, enc_layer="enc_layer", layers=layers, batch=batch)


def _with_grads(m):
    return {"loss": m.loss, **{f"grad/{k}": g for k, g in md.grad(m.loss, m.params).items()}}


def _model(batch):
    m = _bart(3, batch)
    outs = _with_grads(m)
    return m, outs, md.run_dense(outs, m.feeds(0))


@pytest.fixture(scope="module")
def bart():
    return _model(4)


@pytest.fixture(scope="module")
def bart6():
    return _model(6)


@pytest.fixture(scope="module")
def bart8():
    """A batch of 8: 2 micro-batches on data:2."""
    return _model(8)


def _program(plan):
    return next(s for s in plan.steps if s.kind == "pipeline").args["program"]


def _check_transfers(prog):
    """Every per-micro-batch send of a stage has its receive, with its tag, on the rank its offset
    names; none is between two stages of one rank (offset 0); each rank runs its stages only."""
    p = prog.num_ranks
    sends, recvs = {}, {}
    for seg in PER_MICROBATCH:
        for s, st in prog.steps(seg):
            if s.kind in ("send", "recv"):
                assert s.args["offset"] != 0, s.label
                side = sends if s.kind == "send" else recvs
                for t in st:
                    side.setdefault(s.args["tag"], []).append(((t % p + s.args["offset"]) % p if s.kind == "send"
                                                               else t % p, t))
    assert set(sends) == set(recvs)
    for tag, out in sends.items():
        # as many sends as receives of each tag, and each send's target rank receives that tag
        assert sorted(r for r, _ in out) == sorted(r for r, _ in recvs[tag]), tag
    for r, row in enumerate(prog.actions()):
        assert {a.action.stage for a in row} == set(range(r, prog.num_stages, p))


@pytest.mark.parametrize("model, mesh, layout, counts, schedule, m", [
    ("bart", "stage:2", BOTH, (1, 2, 2, 1), "interleaved:2", 2),           # a stack on 3 of 4 virtual stages
    ("bart", "stage:2", BOTH, (2, 1, 1, 2), "interleaved:2", 2),           # each stack on 2 virtual stages
    ("bart", "stage:2", BOTH, (1, 1, 1, 3), "interleaved:2", 4),           # the encoder on both chunks of rank 0
    ("bart8", "stage:2; data:2", BOTH + "; batch:data", (3, 1, 1, 1), "interleaved-zb:2", 2),
    ("bart", "stage:2", BOTH, (1, 1, 1, 1, 1, 1), "interleaved:3", 2),     # the wrap p-1 -> 0 twice
    ("bart6", "stage:3", BOTH, None, "interleaved:2", 3),                  # the even cut, 1 layer each
])
def test_two_stacks_on_virtual_stages_match_dense(request, model, mesh, layout, counts, schedule, m):
    model, outs, want = request.getfixturevalue(model)
    feeds = model.feeds(0)
    plan = md.compile(outs, mesh, layout, microbatches=m, schedule=schedule, stage_layers=counts)
    prog = _program(plan)
    validate(prog.schedule)   # a valid order, no deadlock
    _check_transfers(prog)
    assert_matches_scaled(md.run_simulated(plan, feeds), want, f"{mesh} {counts} {schedule}", REL)


def test_each_stack_is_stored_block_cyclically_with_empty_blocks(bart):
    """Rank r stores its virtual stages' layers of each stack, one after another (none where a
    virtual stage holds none of it); a stack on one virtual stage whole, on its rank; no param or
    gradient moves between ranks."""
    _, outs, _ = bart
    plan = md.compile(outs, "stage:2", BOTH, microbatches=2, schedule="interleaved:2", stage_layers=(2, 2, 1, 1))
    enc = plan.values[plan.params["enc_wq"]]   # virtual stages 0 and 1
    dec = plan.values[plan.params["dec_w1"]]   # virtual stages 1, 2 and 3: two chunks of rank 1
    assert str(enc.sharding).startswith("{enc_layer:stage[cyclic 2][blocks 2,1,0,0]")
    assert str(dec.sharding).startswith("{layer:stage[cyclic 2][blocks 0,1,1,1]")
    ranks = plan.mesh.group(0, ("stage",))
    assert [enc.local_shape(plan.mesh, r)[0] for r in ranks] == [2, 1]
    assert [dec.local_shape(plan.mesh, r)[0] for r in ranks] == [1, 2]
    prog = _program(plan)
    sent = [plan.values[s.ins[0]] for seg in Segment for s, _ in prog.steps(seg) if s.kind == "send"]
    assert sent and not any({"layer", "enc_layer"} & set(v.shape.names) for v in sent)   # nothing stacked moves
    # each chunk's backward loop adds its stacked gradients into its own running sum; the final
    # segment joins the rank's chunks once, after the micro-batches (no join per micro-batch)
    assert prog.loop_grads and not [s for s, _ in prog.steps(Segment.BACKWARD) if s.op == "join"]
    joins = [s for s, _ in prog.steps(Segment.FINAL) if s.op == "join"]
    assert {plan.values[s.outs[0]].shape.names[0] for s in joins} == {"layer", "enc_layer"}
    # a value sent once to two virtual stages of one rank reaches it once
    received = [(s.outs[0], t % 2) for s, st in prog.steps(Segment.FINAL) if s.kind == "recv" for t in st]
    assert len(received) == len(set(received))
    plan = md.compile(outs, "stage:2", BOTH, microbatches=2, schedule="interleaved:2", stage_layers=(1, 1, 1, 3))
    assert str(plan.values[plan.params["enc_wq"]].sharding).startswith("{enc_layer:stage[cyclic 2][blocks 1,1,1,0]")
    assert plan.values[plan.params["dec_w1"]].sharding.axes_of("layer") == ()   # on virtual stage 3 alone
    assert {plan.mesh.coords(r)["stage"] for r in plan.holders[plan.params["dec_w1"]]} == {1}   # rank 1's


def test_dropout_salts_each_layer_by_its_index_in_its_stack_across_chunks():
    """A stack on both chunks of a rank salts chunk 1's layers after chunk 0's (the layer offset
    counts the stack's loops of every chunk): the dense program's streams."""
    b, d = md.Dim("batch", 4), md.Dim("d_model", 8)
    le, ld = md.Dim("enc_layer", 3), md.Dim("layer", 3)
    with md.Graph("salted_interleaved"):
        x, we, wd = md.input("x", [b, d]), md.param("we", [le, d]), md.param("wd", [ld, d])
        enc = md.repeat(lambda h, p: md.dropout(md.tanh(h * p["w"]), 0.5, 3), x, {"w": we}, "enc_layer")
        y = md.repeat(lambda h, p: md.dropout(md.tanh(h * p["w"] + enc), 0.5, 7), x, {"w": wd}, "layer")
        loss = md.reduce_sum(y * y)
        outs = {"loss": loss, **md.grad(loss, {"we": we, "wd": wd})}
    feeds = {"x": torch.randn(4, 8, generator=torch.Generator().manual_seed(0))}
    want = md.run_dense(outs, feeds)
    for counts in ((1, 1, 1, 3), (3, 1, 1, 1)):
        plan = md.compile(outs, "stage:2", BOTH, microbatches=2, schedule="interleaved:2", stage_layers=counts)
        assert_matches_scaled(md.run_simulated(plan, feeds), want, f"{counts}", REL)


def _step(m, mesh, layout, **kw):
    from meshdsl.comm.simulated import SimulatedComm
    mesh = md.Mesh.parse(mesh) if mesh else md.Mesh(())
    return md.TrainStep(m.loss, m.params, mesh, layout, SimulatedComm(mesh), optimizer=md.AdamW(lr=0.01), **kw)


def _full(step, k):
    return step.executor.to_full_held(step.plan.params[k], step.params[k])


def test_adamw_steps_and_a_checkpoint_that_loads_dense(tmp_path, one_torch_thread):
    """Two AdamW steps on virtual stages give the dense params; the checkpoint (each rank its
    blocks of both stacks, empty ones included) loads into a dense step, which goes on alike."""
    from meshdsl.train.checkpoint import load_checkpoint, save_checkpoint

    m = _bart(3)
    pipe = _step(m, "stage:2", BOTH, microbatches=2, schedule="interleaved:2", stage_layers=(1, 1, 1, 3))
    dense = _step(m, "", None)
    for t in range(2):
        assert pipe(m.feeds(t))[0] == pytest.approx(dense(m.feeds(t))[0], rel=REL)
    for k in m.params:
        assert_matches_scaled({k: _full(pipe, k)}, {k: _full(dense, k)}, "after 2 AdamW steps", REL)
    path = save_checkpoint(tmp_path, 2, pipe.state(), pipe.executor.comm)
    loaded = _step(m, "", None)
    state = loaded.state()
    loaded.load_state(load_checkpoint(path, {k: spec for k, (spec, _) in state.items()}, loaded.plan.mesh,
                                      loaded.executor.comm.ranks))
    for k in pipe.carried:
        held = pipe.executor.to_full_held(pipe.plan.params[k], pipe.params[k])
        assert torch.equal(loaded.executor.to_full_held(loaded.plan.params[k], loaded.params[k]), held), k
    assert loaded(m.feeds(2))[0] == pytest.approx(pipe(m.feeds(2))[0], rel=REL)


def test_cli_check_and_plan(capsys):
    base = ["tests/heldout_bart.py", "--tiny", "--config", "enc_layer=enc_layer,batch=4", "--mesh", "stage:2",
            "--layout", BOTH, "--microbatches", "2", "--schedule", "interleaved:2"]
    rc, out, err = run_cli(capsys, ["check", *base, "--optimizer", "adamw"])
    assert rc == 0, err
    assert "OK: 86 outputs match the dense program" in out
    rc, out, err = run_cli(capsys, ["plan", *base, "--totals"])
    assert rc == 0, err
    flat = " ".join(out.split())
    assert "interleaved: 2 ranks, 2 micro-batches, 2 stages per rank" in flat
    assert "rank 0 | F0@0 F1@0 F0@2 F1@2" in out
    assert ("stack 'enc_layer' on 'stage': stage 0 layer 0 (rank 0), stage 1 layer 1 (rank 1)" in flat
            and "stack 'layer' on 'stage': stage 2 layer 0 (rank 0), stage 3 layer 1 (rank 1)" in flat)
    assert ("enc_layer:stage[cyclic 2][blocks 1,1,0,0]: rank 0 holds layers 0 (stage 0); rank 1 holds layers 1 "
            "(stage 1)") in flat


@pytest.mark.parametrize("argv, words", [
    (["--schedule", "interleaved:3"], "fewer than the 6 virtual stages"),
    (["--schedule", "interleaved:2", "--stage-layers", "2,2"], "2 entries for 4 virtual stages"),
])
def test_what_cannot_run_exits_2_with_the_reason(capsys, argv, words):
    rc, out, err = run_cli(capsys, ["check", "tests/heldout_bart.py", "--tiny", "--config",
                                    "enc_layer=enc_layer,batch=4", "--mesh", "stage:2", "--layout", BOTH,
                                    "--microbatches", "2", *argv])
    assert rc == 2 and words in " ".join(err.split()), err
    assert "Traceback" not in err


def _per_layer_graph(on: str, counts: tuple[int, int]):
    """Two stacks, one (``on``) with per-layer outputs: a sum of squares and a per-row term, which the
    loss reads through a sum over the layers and an elementwise exp; the decoder reads the encoder's
    output; the per-layer outputs are an output too."""
    b, d = md.Dim("batch", 8), md.Dim("d_model", 4)
    le, ld = md.Dim("enc_layer", counts[0]), md.Dim("layer", counts[1])

    def block(h, p, ys):
        out = md.tanh(h * p["w"]) + h
        return (out, {"s": md.reduce_sum(h * h), "row": md.reduce_sum(out, "d_model")}) if ys else out
    with md.Graph("per_layer"):
        x, we, wd = md.input("x", [b, d]), md.param("we", [le, d]), md.param("wd", [ld, d])
        enc = md.repeat(lambda h, p: block(h, p, on == "enc_layer"), x, {"w": we}, "enc_layer")
        enc, per = enc if on == "enc_layer" else (enc, None)
        y = md.repeat(lambda h, p: block(h + enc, p, on == "layer"), x, {"w": wd}, "layer")
        y, per = y if on == "layer" else (y, per)
        loss = md.reduce_sum(y * y) + 0.1 * md.reduce_sum(per["s"]) + 0.01 * md.reduce_sum(md.exp(0.1 * per["row"]))
    return loss, {"we": we, "wd": wd}, per["s"]


@pytest.mark.parametrize("on, counts, mesh, kw", [
    ("layer", (2, 2), "stage:2", {"microbatches": 2}),
    ("layer", (2, 6), "stage:2", {"microbatches": 4, "stage_layers": (1, 3, 3, 1)}),   # 'layer' in both chunks of rank 1
    ("enc_layer", (4, 2), "stage:2; data:2", {"microbatches": 2, "stage_layers": (2, 1, 1, 2)}),
    ("enc_layer", (2, 4), "stage:2", {"microbatches": 2, "schedule": "interleaved:3", "stage_layers": (1,) * 6}),
], ids=str)
def test_per_layer_outputs_of_two_stacks_on_virtual_stages_match_dense(on, counts, mesh, kw):
    """Once refused: each chunk makes its layers' per-layer outputs and what the loss makes of them on its
    own layers; a chunk where no rank runs that stack makes a zero part of their sums over the layers."""
    loss, params, s = _per_layer_graph(on, counts)
    outs = {"loss": loss, "s": s, **md.grad(loss, params)}
    feeds = {"x": torch.randn(8, 4, generator=torch.Generator().manual_seed(2))}
    layout = BOTH + ("; batch:data" if "data" in mesh else "")
    plan = md.compile(outs, mesh, layout, **{"schedule": "interleaved:2", **kw})
    assert_matches_scaled(md.run_simulated(plan, feeds), md.run_dense(outs, feeds), f"{on} {counts} {kw}", REL)


def test_adamw_steps_with_per_layer_outputs_on_virtual_stages_give_the_dense_params(one_torch_thread):
    import types
    loss, params, _ = _per_layer_graph("layer", (2, 6))
    m = types.SimpleNamespace(loss=loss, params=params)
    pipe = _step(m, "stage:2", BOTH, microbatches=2, schedule="interleaved:2", stage_layers=(1, 3, 3, 1))
    dense = _step(m, "", None)
    for t in range(2):
        feeds = {"x": torch.randn(8, 4, generator=torch.Generator().manual_seed(t))}
        assert pipe(feeds)[0] == pytest.approx(dense(feeds)[0], rel=REL)
    for k in params:
        assert_matches_scaled({k: _full(pipe, k)}, {k: _full(dense, k)}, "after 2 AdamW steps", REL)


def _on_two_processes(comm):
    m = _bart(2)
    plan = md.compile(_with_grads(m), "stage:2", BOTH, microbatches=2, schedule="interleaved:2")
    return held_outputs_on_this_rank(comm, plan, m.feeds(0))


@pytest.mark.timeout(200)
def test_two_stacks_on_virtual_stages_on_two_gloo_processes():
    m = _bart(2)
    want = md.run_dense(_with_grads(m), m.feeds(0))
    results = launch.spawn(_on_two_processes, 2, mesh="stage:2", timeout=180)
    assert_ranks_match_dense(results, want, REL)
