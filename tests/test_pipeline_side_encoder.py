"""Work outside a pipelined stack that feeds it and that the head after it reads too.

An encoder (an ``md.repeat`` not on the stage axis) whose output every layer of a pipelined decoder
reads and a pointer over the source after the decoder reads again (a pointer-generator): its output's
gradient has two terms, the decoder's stage sum, which ends on stage 0 where the encoder ran, and the
head's, made on the last stage. They meet on stage 0 per micro-batch, so the encoder's backward runs
there once, on its own saved activations. It ran after the micro-batches on both stages, stage 0
sending the other its saved activations (:func:`meshdsl.lowering.partition._meet`). Every case is
checked against the dense program (``md.check``: each output within 1e-4 of its magnitude, fp32
rounding only; a misplaced gradient is off by O(1)).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import meshdsl as md
from conftest import assert_heldout_case_matches_dense, assert_steps_track_dense, heldout_outputs, run_cli
from meshdsl.lowering.pipeline_program import Segment

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
    ("1f1b", 2, "full", "stage:2", "dec_layer:stage"),
    ("1f1b", 2, "selective", "stage:2; data:2", "dec_layer:stage; batch:data"),
], ids=["gpipe", "zbh1", "4-stages", "interleaved", "remat-full", "remat-selective-data"])
def test_the_side_encoder_matches_dense(schedule, layers, remat, mesh, layout):
    outs = _pointer_model(layers, remat)
    res = md.check(outs, mesh, layout, _feeds(), microbatches=2, schedule=schedule)
    assert res.ok, str(res)
    if not schedule.startswith("interleaved"):   # (virtual stages keep the head's term after the micro-batches)
        _side_backward_is_per_micro_batch_on_stage_0(
            md.compile(outs, mesh, layout, microbatches=2, schedule=schedule), {"grad/w1", "grad/w2"}, {"grad/wd"})


@pytest.mark.parametrize("over", [{}, {"enc": "gru"}], ids=["transformer", "gru"])
def test_the_pointer_generators_encoder_is_differentiated_on_stage_0(over):
    """tests/heldout_ptrgen.py, decoder pipelined: the encoder (a transformer stack, or a bi-GRU's two
    repeats over 'src') runs its backward per micro-batch on stage 0 (dense equality of these plans:
    the slow cases below and tests/test_heldout_round17b.py's)."""
    model = md.load_model(PTRGEN, tiny=True, **over)
    plan = md.compile(heldout_outputs(model), "stage:2", "dec_layer:stage", microbatches=2, schedule="1f1b")
    enc, dec = ({f"grad/{k}" for k in model.params if k.startswith(pre)} for pre in (("enc_", "gru_"), "dec_"))
    assert enc and dec, sorted(model.params)
    _side_backward_is_per_micro_batch_on_stage_0(plan, enc, dec)


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
def test_the_pointer_generator_on_two_real_processes(capsys):
    """``meshdsl check --nproc 2``: the pipelined plan on two gloo processes, the head's gradient term
    received by stage 0 within the micro-batch."""
    code, out, err = run_cli(capsys, ["check", PTRGEN, "--tiny", "--mesh", "stage:2", "--layout", "dec_layer:stage",
                                      "--microbatches", "2", "--schedule", "1f1b", "--nproc", "2"])
    assert code == 0 and "OK:" in out, out + err
