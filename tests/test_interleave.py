"""Interleaved virtual stages: ``schedule="interleaved:v"`` (lowering/interleave.py).

The schedule's own properties at chunk costs (F and B of a chunk take 1/v of a whole
stage's): a valid, deadlock-free order whose bubble is (p-1)/(v m+p-1).  The lowered
program: rank r runs chunks r, r+p, ..., stored in place (no param or gradient moves between
ranks), each chunk's layers salted by their global index.
The plan gives the dense program's numbers on the simulated mesh (one gloo case lives in
tests/test_pipeline_dist.py), its measured peaks are the theory's, ``plan`` prints its table,
and v not dividing a rank's layers exits 2 with the reason.  With ``stage_layers`` (one count
per virtual stage) the chunks are unequal: each virtual stage runs and stores its own layers
(``layer:stage[cyclic v][blocks ..]``), with the same numbers and still no param moving
(bad counts: tests/test_balanced_stages.py).  A stacked input made per micro-batch before the layers
(tests/heldout_xcache.py's cross-attention cache) is narrowed per chunk in the chunk's forward, and its
stacked gradient joined from the chunks after the micro-batches.
"""
from __future__ import annotations

import pathlib
from fractions import Fraction

import pytest
import torch

import meshdsl as md
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.core.shape import Dim, Shape
from meshdsl.layout.sharding import Sharding, cyclic_order
from meshdsl.lowering.pipeline_program import Segment
from meshdsl.lowering.schedule import validate
from meshdsl.lowering.schedule_gen import named_schedule, parse_schedule, peak_theory
from meshdsl.lowering.timeline import bubble_from_timeline, costs, simulate
from meshdsl.train.step import training_outputs

from conftest import assert_heldout_case_matches_dense, assert_matches_scaled, heldout_outputs, run_cli

REL = 1e-5  # as tests/test_pipeline_exec.py: micro-batch sums in another order, fp32 rounding only


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("k", [1, 2])
def test_the_schedule_at_chunk_costs_has_the_interleaved_bubble(p, v, k):
    m = k * p
    s = named_schedule(f"interleaved:{v}", p, m)
    validate(s)   # every action on its rank, in a valid order, and no deadlock
    assert (s.num_chunks, s.num_stages) == (v, p * v)
    assert all({a.stage for a in row} == set(range(r, p * v, p)) for r, row in enumerate(s.actions))
    # A whole stage's F = 1 and B = 2: a chunk's take 1/v of that.
    stats = simulate(s, costs(Fraction(1, v), Fraction(2, v)))
    assert stats.makespan == Fraction(3 * (v * m + p - 1), v)
    for r in stats.ranks:
        assert r.busy == 3 * m   # the same work as one stage per rank
        assert r.idle_fraction == Fraction(p - 1, v * m + p - 1)


def test_schedule_names():
    assert parse_schedule("interleaved:3") == ("interleaved", 3) and parse_schedule("zbh1") == ("zbh1", 1)
    for bad, words in (("interleaved", "name its virtual stages"), ("1f1b:2", "no virtual stages"),
                       ("interleaved:0", "name its virtual stages"), ("interleaved:x", "name its virtual stages")):
        with pytest.raises(md.MeshDSLError, match=words):
            parse_schedule(bad)


def _outputs(layers, name="transformer", **kw):
    model = md.load_model(name, tiny=True, layers=layers, batch=8, **kw)
    return model, training_outputs(model.loss, model.params, 0.1, with_grads=True)


@pytest.mark.parametrize("name,layers,mesh,layout,m,v,kw", [
    ("transformer", 4, "stage:2", "layer:stage", 2, 2, {}),
    ("transformer", 6, "stage:2", "layer:stage", 4, 3, {}),
    ("transformer", 8, "stage:4", "layer:stage", 4, 2, {"dropout": 0.25}),   # each chunk salts by its layers
    ("transformer", 8, "stage:2; data:2", "layer:stage; batch:data", 2, 2, {}),
    ("llama", 4, "stage:2; data:2", "layer:stage; batch:data", 2, 2, {}),    # every chunk reads the rotary tables
])
def test_interleaved_matches_dense_on_the_simulated_mesh(name, layers, mesh, layout, m, v, kw):
    model, outs = _outputs(layers, name, **kw)
    plan = md.compile(outs, mesh, layout, microbatches=m, schedule=f"interleaved:{v}")
    ex = md.Executor(plan, SimulatedComm(plan.mesh))
    assert_matches_scaled(ex.full_outputs(ex.run(model.feeds(0))), md.run_dense(outs, model.feeds(0)), mesh, REL)
    # Measured like the other schedules: per rank, the activations held at once are the theory's.
    p = md.Mesh.parse(mesh).sizes["stage"]
    stats = bubble_from_timeline(ex.last_timeline)
    assert [r.peak_activations for r in stats.ranks] == [peak_theory("interleaved", p, m, r, v) for r in range(p)]


@pytest.mark.parametrize("layers,mesh,layout,m,schedule,counts,kw", [
    (6, "stage:2", "layer:stage", 2, "interleaved:2", (1, 2, 2, 1), {"dropout": 0.25}),  # salted by global layer
    (6, "stage:2; data:2", "layer:stage; batch:data", 2, "interleaved:2", (2, 1, 1, 2), {}),
    (5, "stage:2", "layer:stage", 4, "interleaved-zb:2", (1, 1, 2, 1), {}),   # 5 layers: no even split exists
])
def test_unequal_virtual_stages_match_dense_on_the_simulated_mesh(layers, mesh, layout, m, schedule, counts, kw):
    model, outs = _outputs(layers, **kw)
    plan = md.compile(outs, mesh, layout, microbatches=m, schedule=schedule, stage_layers=counts)
    prog = next(s for s in plan.steps if s.kind == "pipeline").args["program"]
    name, v = parse_schedule(schedule)
    p = md.Mesh.parse(mesh).sizes["stage"]
    # each virtual stage runs its own layers, one step per stage, salted from its first global layer
    fwd = [(j, s, st) for j, (s, st) in enumerate(prog.steps(Segment.FORWARD)) if s.kind == "repeat"]
    assert [(st, s.times) for _, s, st in fwd] == [((t,), n) for t, n in enumerate(counts)]
    assert [prog.layer_offset(Segment.FORWARD, j, st[0]) for j, _, st in fwd] == [sum(counts[:t]) for t in range(p * v)]
    ex = md.Executor(plan, SimulatedComm(plan.mesh))
    assert_matches_scaled(ex.full_outputs(ex.run(model.feeds(0))), md.run_dense(outs, model.feeds(0)), mesh, REL)
    stats = bubble_from_timeline(ex.last_timeline)
    assert [r.peak_activations for r in stats.ranks] == [peak_theory(name, p, m, r, v) for r in range(p)]


def test_a_block_cyclic_split_of_given_block_lengths_tiles_the_dim():
    """``layer:stage[cyclic 2][blocks 1,3,2,1]``: stage 0 holds blocks 0 and 2 (layers 0 and 4-5),
    stage 1 blocks 1 and 3 (layers 1-3 and 6); the parts joined stage by stage are the full
    tensor once :func:`cyclic_order` puts the blocks back."""
    mesh = md.Mesh.parse("stage:2")
    shape = Shape([Dim("layer", 7), Dim("d", 3)])
    sh = Sharding.of(shape, {"layer": ("stage",)}).with_cyclic("layer", 2, (1, 3, 2, 1))
    assert str(sh) == "{layer:stage[cyclic 2][blocks 1,3,2,1]}"
    assert [sh.local_shape(shape, mesh, r) for r in range(2)] == [(3, 3), (4, 3)]
    assert sh.local_shape(shape, mesh) == (4, 3)   # the largest
    full, parts = torch.arange(21.0).reshape(7, 3), []
    for r, want in ((0, [(0, 1), (4, 6)]), (1, [(1, 4), (6, 7)])):
        regions = sh.regions(shape, mesh, r)
        assert [(g[0].start, g[0].stop) for g, _ in regions] == want
        local = torch.full(sh.local_shape(shape, mesh, r), -1.0)
        for g, loc in regions:
            local[loc] = full[g]
        assert (local >= 0).all()
        parts.append(local)
    assert torch.equal(torch.cat(parts).index_select(0, torch.tensor(cyclic_order(7, 2, 2, (1, 3, 2, 1)))), full)
    # one chunk of it (each rank's one block) is the given parts' split
    one = sh.with_cyclic("layer", 1, (3, 1))
    assert str(one) == "{layer:stage[3,1]}" and one.local_shape(shape, mesh, 1) == (1, 3)



class _SendLog(SimulatedComm):
    """The simulated mesh, recording the tag of each send."""

    def __init__(self, mesh, ranks=None, sends=None, **kw):
        super().__init__(mesh, ranks, **kw)
        self.sends = [] if sends is None else sends

    def view(self, ranks):
        return _SendLog(self.mesh, ranks, self.sends, mailbox=self.mailbox, log=self.log, device=self.device)

    def collective(self, kind, xs, axes, args):
        if kind == "send":
            self.sends.append(args["tag"])
        return super().collective(kind, xs, axes, args)


def test_a_block_cyclic_split_tiles_the_dim_and_gathers_back_in_order():
    """``layer:stage[cyclic 3]``: 2 stages x 3 blocks of 2 layers; stage i holds blocks i, i + 2,
    i + 4 one after another, each a region of the full tensor; the parts joined stage by stage
    are the full tensor once :func:`cyclic_order` puts the blocks back."""
    mesh = md.Mesh.parse("stage:2; data:2")
    shape = Shape([Dim("layer", 12), Dim("d", 4)])
    sh = Sharding.of(shape, {"layer": ("stage",), "d": ("data",)}).with_cyclic("layer", 3)
    assert str(sh) == "{layer:stage[cyclic 3], d:data}"
    full, seen, parts = torch.arange(48.0).reshape(12, 4), torch.zeros(12, 4), {}
    for r in range(mesh.size):
        local = torch.full(sh.local_shape(shape, mesh, r), -1.0)
        regions = sh.regions(shape, mesh, r)
        assert [g[0] for g, _ in regions] == [slice(b * 2, b * 2 + 2) for b in range(mesh.coords(r)["stage"], 6, 2)]
        for g, loc in regions:
            local[loc] = full[g]
            seen[g] += 1
        assert (local >= 0).all()
        parts.setdefault(mesh.coords(r)["data"], []).append(local)
    assert (seen == 1).all()   # every element on one rank only
    joined = torch.cat([torch.cat(parts[j], 0) for j in sorted(parts)], 1)
    assert torch.equal(joined.index_select(0, torch.tensor(cyclic_order(12, 2, 3))), full)


@pytest.mark.parametrize("layers,mesh,layout,counts", [
    (4, "stage:2", "layer:stage", None), (8, "stage:2", "layer:stage", None),
    (8, "stage:2; data:2", "layer:stage; batch:data", None), (8, "stage:4", "layer:stage", None),
    (6, "stage:2", "layer:stage", (1, 2, 2, 1)), (6, "stage:2; data:2", "layer:stage; batch:data", (2, 1, 1, 2))])
def test_no_param_or_gradient_moves_between_stages(layers, mesh, layout, counts):
    """Each rank stores its chunks in place (``layer:stage[cyclic v]``, of the given layers per
    virtual stage): the program's only transfers are the carry and its gradient, in the plan
    and in a run."""
    model, outs = _outputs(layers)
    p = md.Mesh.parse(mesh).sizes["stage"]
    plan = md.compile(outs, mesh, layout, microbatches=p, schedule="interleaved:2", stage_layers=counts)
    prog = next(s for s in plan.steps if s.kind == "pipeline").args["program"]
    moves = [(seg, s) for seg in Segment for s, _ in prog.steps(seg) if s.kind in ("send", "recv")]
    assert moves and all(s.args["tag"] in prog.carry_tags for _, s in moves), [(seg, s.label) for seg, s in moves]
    assert {seg for seg, _ in moves} == {Segment.FORWARD, Segment.BACKWARD}
    stacked = [k for k, t in model.params.items() if "layer" in t.shape.names]
    assert stacked and all(str(plan.values[plan.params[k]].sharding).startswith("{layer:stage[cyclic 2]")
                           for k in stacked)
    if counts is not None:   # rank r stores the layers of its virtual stages r and r + p
        for k in stacked:
            v = plan.values[plan.params[k]]
            at = v.shape.names.index("layer")
            assert [v.local_shape(plan.mesh, r)[at] for r in plan.mesh.group(0, ("stage",))] == \
                   [counts[r] + counts[r + p] for r in range(p)], k
    comm = _SendLog(plan.mesh)
    assert md.Executor(plan, comm).run(model.feeds(0))
    assert comm.sends and set(comm.sends) <= set(prog.carry_tags)


def test_each_rank_runs_its_chunks_of_layers():
    """Rank r runs the layer chunks r, r+p, ...: chunk c's forward runs on stages c p .. c p + p - 1,
    k layers each, and stage s's kernels salt from layer s k on."""
    p, v, layers = 2, 2, 8
    _, outs = _outputs(layers)
    plan = md.compile(outs, f"stage:{p}", "layer:stage", microbatches=2, schedule=f"interleaved:{v}")
    prog = next(s for s in plan.steps if s.kind == "pipeline").args["program"]
    assert (prog.num_ranks, prog.num_stages) == (p, p * v)
    k = layers // (p * v)
    chunks = [(j, s, st) for j, (s, st) in enumerate(prog.steps(Segment.FORWARD)) if s.kind == "repeat"]
    assert [st for _, _, st in chunks] == [tuple(range(c * p, c * p + p)) for c in range(v)]
    for j, s, st in chunks:
        assert s.times == k
        assert [prog.layer_offset(Segment.FORWARD, j, stage) for stage in st] == [stage * k for stage in st]
    for r, row in enumerate(prog.actions()):
        assert {a.action.stage for a in row} == set(range(r, p * v, p))
    # rank r stores its chunks' layers, one chunk after another: its local layers are the
    # global layers of stages r, r + p, ...; init and gathers keep the global order
    wq = plan.values[plan.params["wq"]]
    assert wq.local_shape(plan.mesh)[0] == layers // p
    ex = md.Executor(plan, SimulatedComm(plan.mesh))
    full = torch.arange(float(wq.shape.numel)).reshape(wq.shape.sizes)
    local = ex.local_slices(wq, full)
    for r, x in zip(ex.comm.ranks, local):   # the plan's mesh adds a micro-batch axis
        i = plan.mesh.coords(r)["stage"]
        assert torch.equal(x, torch.cat([full[s * k:(s + 1) * k] for s in range(i, p * v, p)])), r
    assert torch.equal(ex.to_full(wq.id, local)[0], full)


def test_plan_prints_the_interleaved_table(capsys):
    rc, out, err = run_cli(capsys, ["plan", "transformer", "--tiny", "--config", "layers=4", "--mesh", "stage:2",
                                    "--layout", "layer:stage", "--microbatches", "4", "--schedule", "interleaved:2",
                                    "--totals"])
    assert rc == 0, err
    flat = " ".join(out.split())
    assert "pipeline over 'stage': 2 stages, 4 micro-batches, schedule interleaved:2; in theory: bubble 11.1%" in flat
    assert "interleaved: 2 ranks, 4 micro-batches, 2 stages per rank" in out
    assert "rank 0 | F0@0 F1@0 F0@2 F1@2 F2@0 B0@2" in out
    assert ("layers stored where they run, layer:stage[cyclic 2] (no param or gradient moves): rank 0 holds "
            "layers 0, 2 (stages 0, 2); rank 1 holds layers 1, 3 (stages 1, 3)") in flat


def test_plan_prints_the_layers_each_rank_holds_for_unequal_virtual_stages(capsys):
    rc, out, err = run_cli(capsys, ["plan", "transformer", "--tiny", "--config", "layers=6", "--mesh", "stage:2",
                                    "--layout", "layer:stage", "--microbatches", "2", "--schedule", "interleaved:2",
                                    "--stage-layers", "1,2,2,1", "--totals"])
    assert rc == 0, err
    flat = " ".join(out.split())
    assert ("layers stored where they run, layer:stage[cyclic 2][blocks 1,2,2,1] (no param or gradient moves): "
            "rank 0 holds layers 0, 3-4 (stages 0, 2); rank 1 holds layers 1-2, 5 (stages 1, 3)") in flat
    assert "stage 0: 1 layers" in flat and "stage 2: 2 layers" in flat and "stage 3: 1 layers" in flat


@pytest.mark.parametrize("schedule", ["interleaved:2", "interleaved-zb:2"])
def test_a_block_reading_tensors_from_outside_matches_dense(schedule):
    """The decoder layers read the encoder's output, made per micro-batch on stage 0: it reaches
    each rank's first chunk with the carry and its later chunks read it there; each rank sums its
    chunks' gradients of it after its first chunk's backward, then the stages' sums travel down
    as without virtual stages (lowering/interleave.py)."""
    import t5_tiny as t5

    cfg = t5.Config()
    outs, _ = t5.build(cfg)
    plan = md.compile(outs, "stage:2", "layer:stage", microbatches=2, schedule=schedule)
    assert_matches_scaled(md.run_simulated(plan, t5.feeds(cfg)), md.run_dense(outs, t5.feeds(cfg)), schedule, REL)


@pytest.mark.parametrize("argv,words", [
    (["--config", "layers=4", "--schedule", "interleaved:4"],
     ["4 virtual stages per rank do not divide the 2 layers of each of the 2 ranks", "Fix:",
      "a number of virtual stages that divides 2"]),
    (["--schedule", "interleaved:2"],   # one layer a rank: no count of virtual stages divides it
     ["2 virtual stages per rank do not divide the 1 layers", "Fix: use one stage per rank (--schedule 1f1b or zbh1), "
      "or a multiple of 4 layers"]),
    (["--config", "layers=4", "--schedule", "interleaved"], ["--schedule: invalid choice: 'interleaved'",
                                                              "write interleaved:V"]),
    (["--schedule", "1f1b:2"], ["--schedule: invalid choice: '1f1b:2', 1f1b has no virtual stages"]),
])
def test_bad_virtual_stages_exit_2(capsys, argv, words):
    rc, out, err = run_cli(capsys, ["plan", "transformer", "--tiny", "--mesh", "stage:2", "--layout", "layer:stage",
                                    "--microbatches", "2", *argv])
    assert rc == 2 and "Traceback" not in err, err
    for w in words:
        assert w in " ".join(err.split()), err


@pytest.mark.parametrize("schedule", ["interleaved:2", "interleaved-zb:2"])
def test_a_value_made_before_the_layers_and_read_after_them_matches_dense(schedule):
    """A skip around the stack (here a per-example term of the loss made from the stack's input)
    moves once per micro-batch besides the carry, from logical stage 0 to rank p - 1, as under
    1f1b; its reader there runs in a chunk after the receive (lowering/interleave.py
    ``_out_of_order``; more cases: tests/test_interleave_skip.py)."""
    b, d, e, layer = md.Dim("batch", 4), md.Dim("d", 4), md.Dim("e", 4), md.Dim("layer", 4)
    with md.Graph():
        x = md.input("x", [b, d])
        w0, w = md.param("w0", [d, e]), md.param("w", [layer, d, e])
        h0 = md.rename(md.einsum("batch d, d e -> batch e", x, w0), e="d")
        side = md.reduce_sum(h0 * h0, "d")
        h = md.repeat(lambda c, p: c + md.tanh(md.rename(md.einsum("batch d, d e -> batch e", c, p["w"]), e="d")),
                      h0, {"w": w}, "layer")
        loss = md.reduce_mean(md.reduce_sum(h * h, "d") + side)
    outs = {"loss": loss, **md.grad(loss, {"w": w, "w0": w0})}
    feeds = {"x": torch.randn(4, 4, generator=torch.Generator().manual_seed(0))}
    plan = md.compile(outs, "stage:2", "layer:stage", microbatches=2, schedule=schedule)
    assert_matches_scaled(md.run_simulated(plan, feeds), md.run_dense(outs, feeds), schedule, REL)


XCACHE = str(pathlib.Path(__file__).parent / "heldout_xcache.py")


@pytest.mark.parametrize("mesh, layout, kw", [
    ("stage:2", "layer:stage", {"microbatches": 2, "schedule": "interleaved:2"}),
    ("stage:2", "layer:stage", {"microbatches": 4, "schedule": "interleaved-zb:2"}),
    ("stage:2; data:2", "layer:stage; batch:data", {"microbatches": 2, "schedule": "interleaved:2"}),
    ("stage:2", "layer:stage", {"microbatches": 4, "schedule": "interleaved:2", "stage_layers": (1, 2, 1, 1)}),
], ids=str)
def test_a_stacked_input_made_per_micro_batch_is_cut_into_chunks(mesh, layout, kw):
    """tests/heldout_xcache.py: every decoder layer's cross-attention keys and values, made per
    micro-batch by one einsum before the stack and read as a stacked input.  Each chunk narrows its
    layers of them in its forward (they are made on the rank's first chunk), and their stacked
    gradient, which the einsum's backward reads after the micro-batches, is joined from the rank's
    chunks first.  Once refused ("a stacked gradient is read other than by its sum over the
    micro-batches")."""
    layers = sum(kw.get("stage_layers", (4,)))
    assert_heldout_case_matches_dense((XCACHE, {"layers": layers}, mesh, layout, kw))


def test_a_stacked_input_made_per_micro_batch_is_narrowed_in_the_chunks_forward():
    m = md.load_model(XCACHE, tiny=True, layers=4)
    plan = md.compile(heldout_outputs(m), "stage:2", "layer:stage", microbatches=2, schedule="interleaved:2")
    pipe = next(s for s in plan.steps if s.kind == "pipeline")
    stages = pipe.args["program"].stages
    prologue, forward, _, final = pipe.subplans
    narrows = [(s.label, stages[Segment.FORWARD][j]) for j, s in enumerate(forward.steps) if s.op == "narrow"]
    # the keys' and the values' caches: chunk 0 on logical stages 0, 1 (the ranks' first chunks), chunk 1 on 2, 3
    assert sorted(narrows) == sorted([("stacked input's layers of chunk 0", (0, 1))] * 2
                                     + [("stacked input's layers of chunk 1", (2, 3))] * 2), narrows
    assert not any(s.op == "narrow" and "stacked input" in s.label for s in prologue.steps)
    # their two stacked gradients joined from the chunks after the micro-batches, for the einsum's
    # backward there (a rename reads them: not a sum over the micro-batches)
    read = {v for s in final.steps if s.op != "join" and s.kind != "allreduce" for v in s.ins}
    assert sum(s.op == "join" and s.outs[0] in read for s in final.steps) == 2
