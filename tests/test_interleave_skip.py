"""Interleaved virtual stages with a value made before the pipelined layers and read after them
(issue 35, scope 2): a skip around the whole stack (a residual tensor) or a loss term made from
the stack's input (a scalar, as a VAE's KL term), under ``interleaved:V`` and ``interleaved-zb:V``.

As under 1f1b, the value travels once per micro-batch besides the carry: logical stage 0 (rank 0's
first chunk) sends it to rank p - 1, whose first chunk receives it and whose last chunk (the last
logical stage) reads it; its gradient comes back as under 1f1b (lowering/interleave.py,
``_out_of_order`` checks that every such value is on its rank before a chunk reads it and that it
moves with the schedule's order).  Each case matches the dense program (forward and gradients,
two AdamW steps, one case on two gloo processes); the program's schedule stays valid; unequal stages
(``--stage-layers``) with one stage per rank run it too; what still cannot run (such a value beside
two stacks) exits 2 with the reason.
"""
from __future__ import annotations

import types

import pytest
import torch

import meshdsl as md
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.lowering.interleave import _out_of_order
from meshdsl.lowering.partition import program_of
from meshdsl.lowering.pipeline_program import PER_MICROBATCH, Segment
from meshdsl.lowering.plan import Step, step_args
from meshdsl.lowering.schedule import validate
from meshdsl.lowering.schedule_gen import parse_schedule, peak_theory
from meshdsl.lowering.timeline import bubble_from_timeline
from meshdsl.processes import launcher as launch
from meshdsl.train.model import Model

from conftest import assert_matches_scaled, held_outputs_on_this_rank, assert_ranks_match_dense

# fp32 with O(1) values: only rounding differs (the chunks and micro-batches add the layers' and
# the batch's parts in another order than the dense program: n * 2**-24 of the magnitudes for n
# terms, far below 1e-5).  A lost skip, one read from another micro-batch, or a gradient summed
# twice is off by O(1).
REL = 1e-5


def _build(kind: str, layers: int = 4, batch: int = 8) -> Model:
    """``w0`` makes ``h0`` from ``x``; a residual stack of ``layers`` runs from it; then either
    ``kind="tensor"``: the loss reads ``tanh(h + h0)`` (a skip around the whole stack), or
    ``kind="scalar"``: the loss adds ``0.1 * mean(h0 ** 2)``, a scalar made from the stack's
    input per micro-batch (a KL-like term)."""
    b, d, e, layer = md.Dim("batch", batch), md.Dim("d", 4), md.Dim("e", 4), md.Dim("layer", layers)
    with md.Graph(f"skip_{kind}") as g:
        x = md.input("x", [b, d])
        params = {"w0": md.param("w0", [d, e]), "w": md.param("w", [layer, d, e], fan_out=["layer", "e"])}
        h0 = md.tanh(md.rename(md.einsum("batch d, d e -> batch e", x, params["w0"]), e="d"))

        def block(c, p):
            return c + md.tanh(md.rename(md.einsum("batch d, d e -> batch e", c, p["w"]), e="d"))

        h = md.repeat(block, h0, {"w": params["w"]}, "layer")
        if kind == "tensor":
            loss = md.reduce_mean(md.reduce_sum(md.tanh(h + h0) ** 2, "d"))
        else:
            loss = md.reduce_mean(md.reduce_sum(h * h, "d")) + 0.1 * md.reduce_mean(h0 * h0)

    def feeds(seed: int = 0) -> dict:
        return {"x": torch.randn(batch, 4, generator=torch.Generator().manual_seed(seed))}

    return Model(g, loss, params, feeds, None)


def _with_grads(m: Model) -> dict:
    return {"loss": m.loss, **md.grad(m.loss, m.params)}


CASES = [   # kind, layers, mesh, layout, micro-batches, schedule, stage layers
    ("tensor", 4, "stage:2", "layer:stage", 2, "interleaved:2", None),
    ("tensor", 4, "stage:2", "layer:stage", 4, "interleaved-zb:2", None),
    ("scalar", 4, "stage:2", "layer:stage", 2, "interleaved-zb:2", None),
    ("scalar", 4, "stage:2", "layer:stage", 4, "interleaved:2", None),
    ("tensor", 8, "stage:4", "layer:stage", 4, "interleaved:2", None),
    ("tensor", 8, "stage:4", "layer:stage", 8, "interleaved-zb:2", None),
    ("scalar", 8, "stage:4", "layer:stage", 4, "interleaved-zb:2", None),
    ("scalar", 8, "stage:4", "layer:stage", 8, "interleaved:2", None),
    ("tensor", 4, "stage:2; data:2", "layer:stage; batch:data", 2, "interleaved:2", None),
    ("scalar", 4, "stage:2; data:2", "layer:stage; batch:data", 2, "interleaved-zb:2", None),
    ("tensor", 6, "stage:2", "layer:stage", 2, "interleaved:2", (1, 2, 2, 1)),   # unequal chunks
]


@pytest.mark.parametrize("kind,layers,mesh,layout,m,schedule,counts", CASES)
def test_a_value_made_before_the_layers_and_read_after_them_matches_dense(kind, layers, mesh, layout, m, schedule,
                                                                           counts):
    model = _build(kind, layers)
    outs = _with_grads(model)
    plan = md.compile(outs, mesh, layout, microbatches=m, schedule=schedule, stage_layers=counts)
    prog = program_of(next(s for s in plan.steps if s.kind == "pipeline"))
    validate(prog.schedule)   # every action on its rank, in a valid order, and no deadlock
    ex = md.Executor(plan, SimulatedComm(plan.mesh))
    assert_matches_scaled(ex.full_outputs(ex.run(model.feeds(0))), md.run_dense(outs, model.feeds(0)),
                          f"{kind} {mesh} {schedule} m={m}", REL)
    # run in the schedule's order: per rank, the activations held at once are the theory's
    name, v = parse_schedule(schedule)
    p = md.Mesh.parse(mesh).sizes["stage"]
    peaks = [r.peak_activations for r in bubble_from_timeline(ex.last_timeline).ranks]
    assert peaks == [peak_theory(name, p, m, r, v) for r in range(p)]


@pytest.mark.parametrize("kind,layers,mesh,counts,m,schedule", [
    ("tensor", 5, "stage:2", (2, 3), 2, "1f1b"),
    ("scalar", 6, "stage:3", (1, 3, 2), 3, "zbh1"),
])
def test_unequal_stages_with_one_stage_per_rank_run_it_too(kind, layers, mesh, counts, m, schedule):
    """--stage-layers without virtual stages (lowering/stage_layers.py) moves it as equal stages do."""
    model = _build(kind, layers, 12)
    outs = _with_grads(model)
    plan = md.compile(outs, mesh, "layer:stage", microbatches=m, schedule=schedule, stage_layers=counts)
    assert_matches_scaled(md.run_simulated(plan, model.feeds(0)), md.run_dense(outs, model.feeds(0)),
                          f"{kind} {mesh} {counts} {schedule}", REL)


def _transfers(prog, seg):
    return [(s, st) for s, st in zip(prog.segments[seg].steps, prog.stages[seg])
            if s.kind in ("send", "recv") and s.args["tag"] not in prog.carry_tags]


@pytest.mark.parametrize("kind", ["tensor", "scalar"])
@pytest.mark.parametrize("p", [2, 4])
def test_the_value_goes_from_the_first_logical_stage_to_the_last_rank_once_per_micro_batch(kind, p):
    """Rank 0's first chunk sends it to rank p - 1 (offset p - 1), whose first chunk (logical stage
    p - 1) receives it; besides the carry, only the skip's gradient term from the loss crosses back
    (made by the last logical stage's forward, received by stage 0's backward, where it meets the
    layers' input gradient, as under 1f1b; the loss term's is made on stage 0 from its value there).
    The skip is added to the stack's output on the last logical stage (rank p - 1's last chunk); the
    loss term, which does not wait for the layers, is made on receipt (rank p - 1's first chunk)."""
    v = 2
    model = _build(kind, 2 * p)
    plan = md.compile(_with_grads(model), f"stage:{p}", "layer:stage", microbatches=p, schedule=f"interleaved:{v}")
    prog = program_of(next(s for s in plan.steps if s.kind == "pipeline"))
    moved = _transfers(prog, Segment.FORWARD)
    back = [("send", -(p - 1), (p * v - 1,))] if kind == "tensor" else []
    assert [(s.kind, s.args["offset"], st) for s, st in moved] == [("send", p - 1, (0,)), ("recv", p - 1, (p - 1,))] + back
    assert [(s.kind, s.args["offset"], st) for s, st in _transfers(prog, Segment.BACKWARD)] == (
        [("recv", -(p - 1), (0,))] if kind == "tensor" else [])
    moved = moved[:2]
    value = moved[0][0].ins[0]
    readers = {st for seg in PER_MICROBATCH for s, st in zip(prog.segments[seg].steps, prog.stages[seg])
               if value in s.ins and s.kind != "send"}
    # stage 0 also starts the stack from it
    assert readers == {(0,), (p * v - 1,) if kind == "tensor" else (p - 1,)}


def test_adamw_steps_match_dense(one_torch_thread):
    m = _build("tensor")
    mesh = md.Mesh.parse("stage:2")
    pipe = md.TrainStep(m.loss, m.params, mesh, "layer:stage", SimulatedComm(mesh), optimizer=md.AdamW(lr=0.01),
                        microbatches=2, schedule="interleaved:2")
    dense = md.TrainStep(m.loss, m.params, md.Mesh(()), None, SimulatedComm(md.Mesh(())), optimizer=md.AdamW(lr=0.01))
    for t in range(2):
        assert pipe(m.feeds(t))[0] == pytest.approx(dense(m.feeds(t))[0], rel=REL)
    for k in m.params:
        got = pipe.executor.to_full_held(pipe.plan.params[k], pipe.params[k])
        want = dense.executor.to_full_held(dense.plan.params[k], dense.params[k])
        assert_matches_scaled({k: got}, {k: want}, "after 2 AdamW steps", REL)


def _step(kind, op, ins, outs, st, **args):
    args = step_args(kind, args) if kind in ("send", "recv") else {}
    return Step(kind, -1, op, op, "forward", tuple(ins), tuple(outs), ("stage",), args), frozenset(st)


def test_a_value_read_before_its_rank_holds_it_or_moved_against_the_schedule_is_refused():
    """``_out_of_order`` on hand-made chunked lists (p = 2, v = 2: logical stage s on rank s % 2,
    chunk s // 2), the check behind the lifted refusal."""
    ch = types.SimpleNamespace(p=2, v=2, nc=1)
    empty = {Segment.PROLOGUE: [], Segment.BACKWARD: [], Segment.FINAL: []}
    ok = [_step("local", "make", (), (5,), {0}), _step("send", "send", (5,), (), {0}, offset=1, tag=2),
          _step("recv", "recv", (), (5,), {1}, offset=1, tag=2), _step("local", "read", (5,), (6,), {3})]
    assert _out_of_order(ch, {**empty, Segment.FORWARD: ok}) is None
    # made on rank 1's second chunk (stage 3), read on its first (stage 1): not there yet
    late = [_step("local", "make", (), (5,), {3}), _step("local", "read", (5,), (6,), {1})]
    assert "reads a value that its rank makes in a later chunk" in _out_of_order(ch, {**empty, Segment.FORWARD: late})
    # the backward runs chunk 1 before chunk 0: made on stage 1 (chunk 0), read on stage 3 (chunk 1)
    late_b = [_step("local", "make", (), (5,), {1}), _step("local", "read", (5,), (6,), {3})]
    assert "later chunk" in _out_of_order(ch, {**empty, Segment.FORWARD: [], Segment.BACKWARD: late_b})
    down = [_step("send", "send", (5,), (), {1}, offset=-1, tag=2)]
    assert "moves a value down the stages in the forward" in _out_of_order(ch, {**empty, Segment.FORWARD: down})


ENC_DEC = '''
from dataclasses import dataclass
import torch
import meshdsl as md


@dataclass(frozen=True)
class Config:
    batch: int = 4

    @classmethod
    def tiny(cls):
        return cls()


def build(cfg=Config()):
    b, d, le, ld = md.Dim("batch", cfg.batch), md.Dim("d", 4), md.Dim("enc_layer", 2), md.Dim("layer", 2)
    with md.Graph("enc_dec_skip") as g:
        x = md.input("x", [b, d])
        params = {"we": md.param("we", [le, d]), "wd": md.param("wd", [ld, d]), "w0": md.param("w0", [d])}
        enc = md.repeat(lambda h, p: md.tanh(h * p["w"]), x, {"w": params["we"]}, "enc_layer")
        y0 = md.tanh(x * params["w0"])
        y = md.repeat(lambda h, p: md.tanh(h * p["w"] + enc), y0, {"w": params["wd"]}, "layer")
        loss = md.reduce_mean(y * y) + md.reduce_mean(y0 * y0)

    def feeds(seed=0):
        return {"x": torch.randn(cfg.batch, 4, generator=torch.Generator().manual_seed(seed))}

    return md.Model(g, loss, params, feeds, cfg)
'''


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved:2", "interleaved-zb:2"])
def test_such_a_value_beside_two_stacks_matches_dense(tmp_path, schedule):
    """Beside two stacks (an encoder-decoder whose loss reads the decoder's input, made before it)
    the value goes up the stages as with one stack, on one stage per rank and on virtual stages."""
    path = tmp_path / "enc_dec_skip.py"
    path.write_text(ENC_DEC)
    m = md.load_model(str(path), tiny=True)
    outs = _with_grads(m)
    plan = md.compile(outs, "stage:2", "layer:stage; enc_layer:stage", microbatches=2, schedule=schedule)
    assert_matches_scaled(md.run_simulated(plan, m.feeds(0)), md.run_dense(outs, m.feeds(0)), schedule, REL)


def _on_two_processes(comm):
    m = _build("tensor", 4, 4)
    plan = md.compile(_with_grads(m), "stage:2", "layer:stage", microbatches=2, schedule="interleaved:2")
    return held_outputs_on_this_rank(comm, plan, m.feeds(0))


@pytest.mark.timeout(200)
def test_a_skip_around_the_stack_on_two_gloo_processes():
    m = _build("tensor", 4, 4)
    want = md.run_dense(_with_grads(m), m.feeds(0))
    results = launch.spawn(_on_two_processes, 2, mesh="stage:2", timeout=180)
    assert_ranks_match_dense(results, want, REL)
