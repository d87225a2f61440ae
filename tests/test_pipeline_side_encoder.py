"""Work outside a pipelined stack that feeds it and that the head after it reads too.

An encoder (an ``md.repeat`` not on the stage axis) whose output every layer of a pipelined decoder
reads and a pointer over the source after the decoder reads again (a pointer-generator): its output's
gradient has two terms, the decoder's stage sum, which ends on stage 0 where the encoder ran, and the
head's, made on the last stage. They meet on stage 0 per micro-batch, so the encoder's backward runs
there once, on its own saved activations. It ran after the micro-batches on both stages, stage 0
sending the other its saved activations (:func:`meshdsl.lowering.partition._meet`). On virtual
stages (``interleaved:v``) the head's term is sent by the last logical stage's forward and received
by stage 0's backward of the same micro-batch (:func:`meshdsl.lowering.interleave._out_of_order`
accepts it: every B of a micro-batch follows all its Fs). Every case is
checked against the dense program (``md.check``: each output within 1e-4 of its magnitude, fp32
rounding only; a misplaced gradient is off by O(1)).
"""
from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import assert_heldout_case_matches_dense, assert_steps_track_dense, heldout_outputs, run_cli
from meshdsl.lowering.interleave import _out_of_order
from meshdsl.lowering.pipeline_program import Segment
from meshdsl.lowering.plan import Step, step_args
from meshdsl.lowering.schedule import validate
from meshdsl.runtime.pipeline_store import slot_holds
from test_pipe_slots import _walk

HERE = Path(__file__).parent
PTRGEN = str(HERE / "heldout_ptrgen.py")

B, S, D, F, DI = md.Dim("batch", 4), md.Dim("seq", 3), md.Dim("d_model", 4), md.Dim("d_ff", 6), md.Dim("d_in", 4)


def _pointer_model(dec_layers: int = 2, remat: str = "none"):
    """An encoder repeat over ``enc_layer``, a decoder over ``dec_layer`` whose blocks read the
    encoder's output, and a head reading both (``y * enc``): loss and every param's gradient."""
    E, L = md.Dim("enc_layer", 2), md.Dim("dec_layer", dec_layers)

    def enc_block(h, p):
        z = md.tanh(md.einsum("batch seq d_model, d_model d_ff -> batch seq d_ff", h, p["w1"]))
        return h + md.einsum("batch seq d_ff, d_ff d_model -> batch seq d_model", z, p["w2"])

    with md.Graph():
        x = md.input("x", [B, S, D])
        w1 = md.param("w1", [E, D, F], fan_out=["enc_layer", "d_ff"])
        w2 = md.param("w2", [E, F, D], fan_out=["enc_layer", "d_model"])
        wd = md.param("wd", [L, DI, D], fan_out=["dec_layer", "d_model"])
        enc = md.repeat(enc_block, x, {"w1": w1, "w2": w2}, E, remat=remat)
        y = md.repeat(lambda h, p: h + md.tanh(md.einsum("batch seq d_in, d_in d_model -> batch seq d_model",
                                                         md.rename(h + enc, d_model="d_in"), p["wd"])),
                      x, {"wd": wd}, L, remat=remat)
        loss = md.reduce_mean((y * enc) ** 2)
        return {"loss": loss, **{f"grad/{k}": g for k, g in md.grad(loss, {"w1": w1, "w2": w2, "wd": wd}).items()}}


def _feeds():
    return {"x": torch.randn(4, 3, 4, generator=torch.Generator().manual_seed(0))}


def _pipeline(plan):
    """Per segment, ``(step, stages)`` of the plan's pipeline step."""
    pipe = next(s for s in plan.steps if s.kind == "pipeline")
    prog = pipe.args["program"]
    return {k: [(s, prog.stages[k][j]) for j, s in enumerate(pipe.subplans[k].steps)] for k in Segment}


def _side_backward_is_per_micro_batch_on_stage_0(plan, grads: set[str], stack_grads: set[str]) -> None:
    """Every repeat making the ``grads`` params' gradients but not the pipelined stack's (``stack_grads``:
    the side encoder's backward) runs in the B actions on stage 0 only, and the final segment sends
    nothing (no saved activation of the encoder goes to another stage)."""
    segs = _pipeline(plan)
    final_sends = [s.label for s, _ in segs[Segment.FINAL] if s.kind == "send"]
    assert not final_sends, final_sends
    side = _behind(plan, grads) - _behind(plan, stack_grads)
    found = [(k, s.label, st) for k in Segment for s, st in segs[k] if s.kind == "repeat" and id(s) in side]
    assert found and all(k == Segment.BACKWARD and st == (0,) for k, _, st in found), found


def _behind(plan, outputs: set[str]) -> set[int]:
    """The ids of the pipeline's steps that the plan's ``outputs`` are made by, directly or not."""
    steps = [s for sub in next(s for s in plan.steps if s.kind == "pipeline").subplans for s in sub.steps]
    producer = {v: s for s in steps if s.kind not in ("send", "recv") for v in s.outs}
    todo, seen, out = [plan.outputs[k] for k in outputs], set(), set()
    while todo:
        v = todo.pop()
        if v not in seen and v in producer:
            seen.add(v)
            out.add(id(producer[v]))
            todo += producer[v].ins
    return out


def test_a_side_encoders_backward_runs_once_per_micro_batch_on_its_stage():
    outs = _pointer_model()
    plan = md.compile(outs, "stage:2", "dec_layer:stage", microbatches=2, schedule="1f1b")
    _side_backward_is_per_micro_batch_on_stage_0(plan, {"grad/w1", "grad/w2"}, {"grad/wd"})
    # per micro-batch: the carry, the encoder's output up, the carry's gradient, the decoder's stage
    # sum and the head's term down (5 x 2 x 96 B); it was 12 sends (1440 B), the encoder's saved activations up
    assert plan.totals()["send"] == {"count": 10, "bytes": 960}
    res = md.check(outs, "stage:2", "dec_layer:stage", _feeds(), microbatches=2, schedule="1f1b")
    assert res.ok, str(res)


def test_a_projection_feeding_the_stack_and_the_head_is_differentiated_on_stage_0():
    """Not a repeat: a projection of the input is the stack's first carry and the head reads it too
    (a skip around the stack); its backward runs per micro-batch on stage 0 as well."""
    L = md.Dim("layer", 2)
    with md.Graph():
        x = md.input("x", [B, S, DI])
        w_in = md.param("w_in", [DI, D])
        w = md.param("w", [L, D, DI], fan_out=["layer", "d_in"])
        e = md.tanh(md.einsum("batch seq d_in, d_in d_model -> batch seq d_model", x, w_in))
        y = md.repeat(lambda h, p: h + md.tanh(md.rename(md.einsum("batch seq d_model, d_model d_in -> batch seq d_in",
                                                                   h, p["w"]), d_in="d_model")), e, {"w": w}, L)
        loss = md.reduce_mean((y * e) ** 2)
        outs = {"loss": loss, **{f"grad/{k}": g for k, g in md.grad(loss, {"w_in": w_in, "w": w}).items()}}
    plan = md.compile(outs, "stage:2", "layer:stage", microbatches=2, schedule="1f1b")
    segs = _pipeline(plan)
    side = _behind(plan, {"grad/w_in"}) - _behind(plan, {"grad/w"})
    found = [(k, s.label, st) for k in Segment for s, st in segs[k] if s.op == "einsum" and id(s) in side]
    # (its gradient's einsum, and the add of the stack's and the head's terms, ran on both stages after)
    assert found and all(k == Segment.BACKWARD and st == (0,) for k, _, st in found), found
    res = md.check(outs, "stage:2", "layer:stage", _feeds(), microbatches=2, schedule="1f1b")
    assert res.ok, str(res)


@pytest.mark.parametrize("schedule,layers,remat,mesh,layout", [
    ("gpipe", 2, "none", "stage:2", "dec_layer:stage"),
    ("zbh1", 2, "none", "stage:2", "dec_layer:stage"),
    ("1f1b", 4, "none", "stage:4", "dec_layer:stage"),
    ("interleaved:2", 4, "none", "stage:2", "dec_layer:stage"),
    ("interleaved-zb:2", 4, "none", "stage:2", "dec_layer:stage"),
    ("1f1b", 2, "full", "stage:2", "dec_layer:stage"),
    ("1f1b", 2, "selective", "stage:2; data:2", "dec_layer:stage; batch:data"),
], ids=["gpipe", "zbh1", "4-stages", "interleaved", "interleaved-zb", "remat-full", "remat-selective-data"])
def test_the_side_encoder_matches_dense(schedule, layers, remat, mesh, layout):
    outs = _pointer_model(layers, remat)
    res = md.check(outs, mesh, layout, _feeds(), microbatches=2, schedule=schedule)
    assert res.ok, str(res)
    _side_backward_is_per_micro_batch_on_stage_0(
        md.compile(outs, mesh, layout, microbatches=2, schedule=schedule), {"grad/w1", "grad/w2"}, {"grad/wd"})


@pytest.mark.parametrize("schedule,p,m,sends", [
    ("interleaved:2", 2, 2, {"count": 18, "bytes": 1728}),
    ("interleaved-zb:2", 4, 4, {"count": 52, "bytes": 2496}),
], ids=["interleaved-2-ranks", "interleaved-zb-4-ranks"])
def test_on_virtual_stages_the_heads_term_goes_down_within_the_micro_batch(schedule, p, m, sends):
    """Virtual stages: the last logical stage's forward (rank p - 1's last chunk, where the head ran)
    sends the head's term of the encoder output's gradient to rank 0, whose first chunk's backward
    receives it per micro-batch; the final segment moves nothing between stages.  The program stays
    valid: its schedule validates, and every rank's list, run against shared-memory rings of one and
    eight slots with the receives :func:`slot_holds` lets hold their slot (sends never block, a
    receive waits for its message), runs to its end."""
    v = 2
    outs = _pointer_model(2 * p)
    plan = md.compile(outs, f"stage:{p}", "dec_layer:stage", microbatches=m, schedule=schedule)
    _side_backward_is_per_micro_batch_on_stage_0(plan, {"grad/w1", "grad/w2"}, {"grad/wd"})
    prog = next(s for s in plan.steps if s.kind == "pipeline").args["program"]
    down = [(s.args["tag"], s.args["offset"], st) for s, st in prog.steps(Segment.FORWARD)
            if s.kind == "send" and not prog.is_carry(s) and s.args["offset"] < 0]
    assert [d[1:] for d in down] == [(-(p - 1), (p * v - 1,))], down
    got = [(seg, st) for seg in Segment for s, st in prog.steps(seg) if s.kind == "recv" and s.args["tag"] == down[0][0]]
    assert got == [(Segment.BACKWARD, (0,))], got
    # it was 20 sends (2208 B) and 52 (2640 B): the head's term sent after the micro-batches, stage 0
    # sending its saved activations and the encoder output's gradient up for the encoder's backward there
    assert plan.totals()["send"] == sends
    validate(prog.schedule)
    for slots in (1, 8):
        holds = [slot_holds(prog, True, r, slots, margin=-10 ** 9) for r in range(p)]
        assert _walk(prog, slots, holds) == [len(row) for row in prog.actions(True)], slots
    feeds = {"x": torch.randn(4, 3, 4, generator=torch.Generator().manual_seed(1))}
    res = md.check(outs, f"stage:{p}", "dec_layer:stage", feeds, microbatches=m, schedule=schedule)
    assert res.ok, str(res)


def _step(kind, ins, outs, stages, phase="forward", **args):
    args = step_args(kind, args) if kind in ("send", "recv") else {}
    return Step(kind, -1, kind, kind, phase, tuple(ins), tuple(outs), ("stage",), args), frozenset(stages)


def test_a_forward_send_down_is_in_order_only_when_a_backward_receives_it():
    """``_out_of_order`` on hand-made chunked lists (p = 2, v = 2: logical stage s on rank s % 2):
    a value made by the last logical stage's forward and sent down may be received by stage 0's
    backward (it follows every forward of its micro-batch), not by a forward."""
    ch = types.SimpleNamespace(p=2, v=2, nc=1)
    make = _step("local", (), (5,), {3})
    send = _step("send", (5,), (), {3}, offset=-1, tag=7)
    recv_b = _step("recv", (), (6,), {0}, "backward", offset=-1, tag=7)
    read_b = _step("local", (6,), (8,), {0}, "backward")
    lists = {Segment.PROLOGUE: [], Segment.FORWARD: [make, send], Segment.BACKWARD: [recv_b, read_b],
             Segment.FINAL: []}
    assert _out_of_order(ch, lists) is None
    recv_f = _step("recv", (), (6,), {0}, offset=-1, tag=7)
    why = _out_of_order(ch, {**lists, Segment.FORWARD: [make, send, recv_f], Segment.BACKWARD: []})
    assert "moves a value down the stages in the forward" in why


@pytest.mark.parametrize("over,schedule", [({}, "1f1b"), ({"enc": "gru"}, "1f1b"), ({"dec_layers": 4}, "interleaved:2")],
                         ids=["transformer", "gru", "interleaved"])
def test_the_pointer_generators_encoder_is_differentiated_on_stage_0(over, schedule):
    """tests/heldout_ptrgen.py, decoder pipelined: the encoder (a transformer stack, or a bi-GRU's two
    repeats over 'src') runs its backward per micro-batch on stage 0 (dense equality of these plans:
    the slow cases below and tests/test_heldout_round17b.py's)."""
    model = md.load_model(PTRGEN, tiny=True, **over)
    plan = md.compile(heldout_outputs(model), "stage:2", "dec_layer:stage", microbatches=2, schedule=schedule)
    enc, dec = ({f"grad/{k}" for k in model.params if k.startswith(pre)} for pre in (("enc_", "gru_"), "dec_"))
    assert enc and dec, sorted(model.params)
    _side_backward_is_per_micro_batch_on_stage_0(plan, enc, dec)
    if schedule != "1f1b":   # it was 41 sends (18464 B): the encoder's backward on both stages after the micro-batches
        assert plan.totals()["send"] == {"count": 22, "bytes": 7424}


@pytest.mark.slow
@pytest.mark.parametrize("case", [
    ("heldout_whisper.py", {}, "stage:2", "layer:stage", "zbh1"),
    ("heldout_bart.py", {"enc_layer": "enc_layer"}, "stage:2", "layer:stage", "1f1b"),
    ("heldout_t5shared.py", {}, "stage:2", "layer:stage", "gpipe"),
    ("heldout_t5rel.py", {}, "stage:2", "layer:stage", "1f1b"),
    ("heldout_ptrgen.py", {}, "stage:2; data:2", "dec_layer:stage; batch:data", "gpipe"),
    ("heldout_ptrgen.py", {"remat": "full", "enc": "gru"}, "stage:2", "dec_layer:stage", "zbh1"),
    ("heldout_ptrgen.py", {"dec_layers": 4, "enc": "gru"}, "stage:2", "dec_layer:stage", "interleaved-zb:2"),
    # other plans the change moved (a feature extractor, a downsampling or an embedding before the stack
    # whose output the head reads too): their backward per micro-batch on stage 0
    ("heldout_wav2vec.py", {}, "stage:2", "layer:stage", "zbh1"),
    ("heldout_segformer.py", {}, "stage:2", "layer2:stage", "1f1b"),
    ("heldout_sdunet.py", {}, "stage:2", "B:stage", "gpipe"),
    ("heldout_funnel.py", {}, "stage:2", "layer2:stage", "1f1b"),
    ("heldout_mtp.py", {}, "stage:2", "layer:stage", "1f1b"),
    # and on virtual stages (their plans moved so too)
    ("heldout_segformer.py", {"layers1": 4, "layers2": 4}, "stage:2", "layer2:stage", "interleaved:2"),
    ("heldout_wav2vec.py", {"layers": 4}, "stage:2", "layer:stage", "interleaved-zb:2"),
], ids=lambda c: "-".join(map(str, c)) if isinstance(c, tuple) else None)
def test_encoder_decoder_models_match_dense(case):
    path, over, mesh, layout, schedule = case
    assert_heldout_case_matches_dense((str(HERE / path), over, mesh, layout,
                                       {"microbatches": 2, "schedule": schedule}))


@pytest.mark.slow
@pytest.mark.parametrize("path,layout", [(PTRGEN, "dec_layer:stage"), (str(HERE / "heldout_wav2vec.py"), "layer:stage")],
                         ids=["ptrgen", "wav2vec"])
def test_adamw_steps_track_dense(path, layout, one_torch_thread):
    """Two AdamW steps, pipelined, give the dense program's losses, then its params: the side encoder's
    params are updated where they are held (wav2vec's feature extractor, which a whole-batch statistic
    makes run once on both stages, gets its gradient from stage 0 on stage 1)."""
    from meshdsl.comm.simulated import SimulatedComm
    model = md.load_model(path, tiny=True)

    def step(mesh, layout, **kw):
        m = md.Mesh.parse(mesh) if mesh else md.Mesh(())
        return md.TrainStep(model.loss, model.params, m, layout, SimulatedComm(m), optimizer=md.AdamW(lr=0.01), **kw)
    # fp32, O(1) values: micro-batches and stages add the same terms in another order
    assert_steps_track_dense(step("stage:2", layout, microbatches=2, schedule="1f1b"), step("", None), model, 1e-5,
                             f"{path} {layout}")


@pytest.mark.slow
@pytest.mark.parametrize("schedule,layers", [("1f1b", 2), ("interleaved:2", 4)])
def test_the_pointer_generator_on_two_real_processes(capsys, schedule, layers):
    """``meshdsl check --nproc 2``: the pipelined plan on two gloo processes, the head's gradient term
    received by stage 0 within the micro-batch (on virtual stages: sent by rank 1's last chunk's forward,
    received by rank 0's first chunk's backward)."""
    code, out, err = run_cli(capsys, ["check", PTRGEN, "--tiny", "--config", f"dec_layers={layers}", "--mesh", "stage:2",
                                      "--layout", "dec_layer:stage", "--microbatches", "2", "--schedule", schedule,
                                      "--nproc", "2"])
    assert code == 0 and "OK:" in out, out + err
