"""Unequal pipeline stages: ``stage_layers=(3, 5)`` / ``--stage-layers`` (lowering/stage_layers.py)
and the cost model's balanced split (search/stage_balance.py, ``--stage-layers auto``).

The plan gives the dense program's numbers on the simulated mesh for gpipe, 1f1b and zbh1
(dropout salted by each layer's global index) and on 2 gloo processes; a bad split is a
clear error (exit 2 from the CLI); the balanced split gives the last stage, which also runs
the head and the loss, fewer layers when the head costs about a layer or more; the stacked
params (and their gradients and optimizer state) are stored on the stage that runs them, so no
param or gradient moves between stages, and a checkpoint saved under unequal stages is in the
global layer order and loads on another mesh.  With virtual stages (``interleaved:v``) the split
gives one count per virtual stage (tests/test_interleave.py runs them), and the balanced split
is the cost model's fastest of the equal one, the smallest largest stage, and the one the
schedule's simulation at the stages' costs finds.
"""
from __future__ import annotations

import multiprocessing

import pytest
import torch

import meshdsl as md
from meshdsl.comm.distributed import TorchComm
from meshdsl.comm.microbatch import for_plan
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.processes import launcher as launch
from meshdsl.search.calibrate import Calibration
from meshdsl.search.predict import StageCost
from meshdsl.search.stage_balance import balance_stages, split_by_cost
from meshdsl.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from meshdsl.train.jobs import agree_plan
from meshdsl.train.step import training_outputs

from conftest import run_cli

REL = 1e-5  # as tests/test_pipeline_exec.py: micro-batch sums in another order, fp32 rounding only


def _outputs(layers, name="transformer", **kw):
    model = md.load_model(name, tiny=True, layers=layers, batch=8, **kw)
    return model, training_outputs(model.loss, model.params, 0.1, with_grads=True)


def _assert_matches(got, want, what=""):
    assert set(got) == set(want)
    for k, ref in want.items():
        scale = ref.abs().max().item()
        torch.testing.assert_close(got[k], ref, rtol=REL, atol=REL * scale, msg=lambda e, k=k: f"{what} '{k}': {e}")


@pytest.mark.parametrize("name,layers,mesh,layout,m,schedule,counts,kw", [
    ("transformer", 4, "stage:2", "layer:stage", 2, "gpipe", (1, 3), {}),
    ("transformer", 4, "stage:2", "layer:stage", 4, "1f1b", (3, 1), {"dropout": 0.25}),  # salted by global layer
    ("transformer", 6, "stage:3", "layer:stage", 2, "zbh1", (1, 3, 2), {}),
    ("transformer", 7, "stage:2", "layer:stage", 2, "zbh1", (5, 2), {}),   # stored 5 + 2, where they run
    ("llama", 4, "stage:2; data:2", "layer:stage; batch:data", 2, "1f1b", (1, 3), {}),  # rotary tables per stage
])
def test_unequal_stages_match_dense_on_the_simulated_mesh(name, layers, mesh, layout, m, schedule, counts, kw):
    model, outs = _outputs(layers, name, **kw)
    plan = md.compile(outs, mesh, layout, microbatches=m, schedule=schedule, stage_layers=counts)
    fwd = [s for s in plan.steps if s.kind == "pipeline"][0].subplans[1].steps
    assert [s.times for s in fwd if s.kind == "repeat"] == list(counts)   # each stage runs its own layers
    ex = md.Executor(plan, SimulatedComm(plan.mesh))
    _assert_matches(ex.full_outputs(ex.run(model.feeds(0))), md.run_dense(outs, model.feeds(0)))


@pytest.mark.parametrize("counts,words", [
    ((1, 2), "sum to 3, not the 4 layers"),
    ((1, 1, 2), "3 entries for 2 stages"),
    ((0, 4), "not positive integers"),
])
def test_a_bad_split_is_refused(counts, words):
    _, outs = _outputs(4)
    with pytest.raises(md.MeshDSLError, match=words):
        md.compile(outs, "stage:2", "layer:stage", microbatches=2, stage_layers=counts)


def test_layers_the_stages_do_not_divide_need_a_split():
    _, outs = _outputs(5)
    with pytest.raises(md.MeshDSLError, match="--stage-layers"):
        md.compile(outs, "stage:2", "layer:stage", microbatches=2)


@pytest.mark.parametrize("counts,words", [
    ((1, 3), "2 entries for 4 virtual stages (2 ranks x 2 per rank)"),   # one per rank: per virtual stage instead
    ((2, 0, 2, 1), "not positive integers"),
    ((1, 1, 2, 2), "sum to 6, not the 5 layers"),
])
def test_a_bad_split_of_virtual_stages_is_refused(counts, words):
    _, outs = _outputs(5)
    with pytest.raises(md.LayoutError) as e:
        md.compile(outs, "stage:2", "layer:stage", microbatches=2, schedule="interleaved:2", stage_layers=counts)
    text = " ".join(str(e.value).split())
    assert words in text and "one per virtual stage, in layer order" in text and "Fix: give 4 counts summing to 5" in text


def test_a_split_without_a_pipeline_is_refused():
    _, outs = _outputs(4)
    with pytest.raises(md.MeshDSLError, match="no repeat is pipelined"):
        md.compile(outs, "data:2", "batch:data", stage_layers=(2, 2))
    with pytest.raises(md.MeshDSLError, match="md.balance_stages"):
        md.compile(outs, "stage:2", "layer:stage", microbatches=2, stage_layers="auto")
    with pytest.raises(md.MeshDSLError, match="pipelines no repeat"):
        balance_stages(outs, "data:2", "batch:data", cal=Calibration.defaults())


@pytest.mark.parametrize("counts", [(3, 1), (1, 3)])
def test_unequal_stages_move_no_param_or_gradient_between_stages(counts):
    model, outs = _outputs(4)
    plan = md.compile(outs, "stage:2", "layer:stage", microbatches=2, schedule="1f1b", stage_layers=counts)
    prog = next(s for s in plan.steps if s.kind == "pipeline").args["program"]
    assert [t for t in prog.transfers if not t.carry] == []   # the carry (and its gradient) alone
    stacked = [plan.values[plan.params[k]] for k in model.params if "layer" in model.params[k].shape.names]
    assert stacked
    for v in stacked:   # each stage stores the layers it runs
        at = v.shape.names.index("layer")
        assert [v.local_shape(plan.mesh, r)[at] for r in plan.mesh.group(0, ("stage",))] == list(counts)


def test_equal_counts_are_the_plain_pipeline():
    _, outs = _outputs(4)
    a = md.compile(outs, "stage:2", "layer:stage", microbatches=2, stage_layers=(2, 2))
    b = md.compile(outs, "stage:2", "layer:stage", microbatches=2)
    assert [s.label for s in a.steps] == [s.label for s in b.steps]


def _compositions(total, parts):
    if parts == 1:
        yield (total,)
        return
    for first in range(1, total - parts + 2):
        for rest in _compositions(total - first, parts - 1):
            yield (first, *rest)


@pytest.mark.parametrize("others,layers", [
    ((0.5, 0.0, 2.5), 12),    # the first stage also holds an embedding, the last a costly head and loss
    ((0.1, 3.7), 8),
    ((0.0, 0.0, 0.0, 9.0), 8),   # a head of 9 layers' cost: the last stage keeps one layer
])
def test_the_split_by_cost_has_the_smallest_largest_stage(others, layers):
    p = len(others)
    # a layer costs 1; each stage's cost at the even split is its other work plus its layers
    stages = [StageCost(layers // p, o + layers // p, float(layers // p)) for o in others]
    counts = split_by_cost(stages)
    assert sum(counts) == layers and min(counts) >= 1
    worst = max(o + n for o, n in zip(others, counts))
    assert worst == min(max(o + n for o, n in zip(others, c)) for c in _compositions(layers, p))


@pytest.mark.parametrize("layers,equal", [(4, (2, 2)), (5, (3, 2))])
def test_balance_stages_gives_the_head_stage_fewer_layers(layers, equal):
    # A vocabulary large enough that the head and the loss cost more than a layer.
    model = md.load_model("transformer", tiny=True, layers=layers, batch=8, vocab=4096)
    outs = training_outputs(model.loss, model.params, 0.1, with_grads=True)
    cal = Calibration.defaults()
    counts = balance_stages(outs, "stage:2", "layer:stage", microbatches=2, schedule="1f1b", cal=cal)
    assert sum(counts) == layers and counts[1] < counts[0] and counts != equal
    worst = []
    for c in (equal, counts):
        plan = md.compile(outs, "stage:2", "layer:stage", microbatches=2, schedule="1f1b", stage_layers=c)
        worst.append(max(s.seconds for s in md.predict(plan, cal).stages))
    assert worst[1] < worst[0]


def test_balance_stages_for_virtual_stages_beats_the_equal_split():
    # The head and the loss cost more than a layer: the last virtual stage (rank 1's second
    # chunk) takes fewer layers, and the cost model predicts a faster step than equal chunks.
    model = md.load_model("transformer", tiny=True, layers=8, batch=8, vocab=4096)
    outs = training_outputs(model.loss, model.params, 0.1, with_grads=True)
    cal = Calibration.defaults()
    counts = balance_stages(outs, "stage:2", "layer:stage", microbatches=2, schedule="interleaved:2", cal=cal)
    assert len(counts) == 4 and sum(counts) == 8 and min(counts) >= 1 and counts[3] < 2
    step = [md.predict(md.compile(outs, "stage:2", "layer:stage", microbatches=2, schedule="interleaved:2",
                                  stage_layers=c), cal).step_s for c in ((2, 2, 2, 2), counts)]
    assert step[1] < step[0]


def test_the_split_by_schedule_shortens_the_simulated_interleaved_schedule():
    """From the smallest-largest-stage split, a layer moves where the schedule runs faster:
    on 2 ranks of 2 virtual stages, with a head of 3 layers' cost on the last, the stage before
    it on rank 0 takes more (it runs while rank 1 runs the head)."""
    from meshdsl.lowering.schedule_gen import named_schedule
    from meshdsl.lowering.timeline import simulate
    from meshdsl.search.stage_balance import split_by_schedule

    others = (0.0, 0.0, 0.0, 3.0)
    stages = [StageCost(3, o + 3, 3.0) for o in others]   # 12 layers of cost 1
    sched = named_schedule("interleaved:2", 2, 4)

    def makespan(c):
        return simulate(sched, lambda a: (others[a.stage] + c[a.stage]) * {"F": 1, "B": 2}.get(a.kind, 0) / 3).makespan
    by_cost, counts = split_by_cost(stages), split_by_schedule(stages, sched)
    assert sum(counts) == 12 and min(counts) >= 1
    assert makespan(counts) < makespan(by_cost) and makespan(counts) < makespan((3, 3, 3, 3))
    # no single move of a layer shortens it further
    for i in range(4):
        for j in range(4):
            if i != j and counts[i] > 1:
                moved = tuple(n + (k == j) - (k == i) for k, n in enumerate(counts))
                assert makespan(moved) >= makespan(counts), moved


def test_cli_split_given_auto_and_refused(capsys):
    base = ["plan", "transformer", "--tiny", "--config", "layers=4", "--mesh", "stage:2", "--layout", "layer:stage",
            "--microbatches", "2", "--schedule", "1f1b"]
    rc, out, _ = run_cli(capsys, base + ["--stage-layers", "1,3"])
    assert rc == 0 and "stage 0: 1 layers" in out and "stage 1: 3 layers" in out
    rc, out, _ = run_cli(capsys, base + ["--stage-layers", "auto"])
    assert rc == 0 and "stages, predicted per micro-batch" in out
    rc, _, err = run_cli(capsys, base + ["--stage-layers", "2,3"])
    assert rc == 2 and "sum to 5, not the 4 layers" in err and "Traceback" not in err
    rc, _, err = run_cli(capsys, base + ["--stage-layers", "two"])
    assert rc == 2 and "neither 'auto' nor layer counts" in err
    for cmd in ("run", "train"):   # refused before any process starts
        rc, _, err = run_cli(capsys, [cmd] + base[1:] + ["--stage-layers", "1,1,2"])
        assert rc == 2 and "3 entries for 2 stages" in err, cmd
    rc, out, _ = run_cli(capsys, ["check", "transformer", "--tiny", "--config", "layers=4", "--mesh", "stage:2",
                                  "--layout", "layer:stage", "--microbatches", "2", "--schedule", "zbh1",
                                  "--stage-layers", "3,1"])
    assert rc == 0 and "OK" in out
    virtual = base[:-1] + ["interleaved:2", "--config", "layers=5"]
    for counts, words in (("1,3", "2 entries for 4 virtual stages"), ("1,0,2,2", "each stage runs at least one layer"),
                          ("1,1,1,1", "sum to 4, not the 5 layers")):
        rc, _, err = run_cli(capsys, virtual + ["--stage-layers", counts])
        flat = " ".join(err.split())
        assert rc == 2 and words in flat and "Traceback" not in err, (counts, err)
    rc, out, err = run_cli(capsys, virtual + ["--stage-layers", "auto"])
    assert rc == 0 and "[cyclic 2][blocks" in out, err
    rc, out, _ = run_cli(capsys, ["check"] + virtual[1:] + ["--stage-layers", "1,2,1,1"])
    assert rc == 0 and "OK" in out


def test_stacked_params_saved_under_unequal_stages_load_on_another_mesh(tmp_path):
    model = md.load_model("transformer", tiny=True, layers=4, batch=8)
    step = md.TrainStep(model.loss, model.params, "stage:2", "layer:stage", SimulatedComm(md.Mesh.parse("stage:2")),
                        optimizer=md.AdamW(lr=0.01), microbatches=2, schedule="1f1b", stage_layers=(3, 1))
    dense = md.TrainStep(model.loss, model.params, md.Mesh(()), None, SimulatedComm(md.Mesh(())),
                         optimizer=md.AdamW(lr=0.01))
    feeds = model.feeds(0)
    torch.testing.assert_close(step(feeds)[0], dense(feeds)[0], rtol=REL, atol=REL)
    # The stacked params and their AdamW state, stored where the stages run them (3 layers on rank
    # 0, 1 on rank 1), saved in the global layer order.  (A pipeline's other params are held by one
    # stage only.)
    stacked = {k: v for k, v in step.state().items() if "layer" in v[0].shape.names}
    assert len(stacked) > 10
    save_checkpoint(tmp_path, 1, stacked, step.executor.comm)
    want = dense.state()
    got = load_checkpoint(latest_checkpoint(tmp_path), {k: want[k][0] for k in stacked}, md.Mesh(()))
    for k in stacked:
        # the same step as the dense program's: fp32 sums of the micro-batches in another order only
        torch.testing.assert_close(got[k][0], want[k][1][0], rtol=REL, atol=REL * want[k][1][0].abs().max().item(),
                                   msg=k)


# (layers, schedule, counts): one stage per rank, and virtual stages of unequal chunks, in one spawn
GLOO_CASES = [(4, "1f1b", (3, 1)), (5, "interleaved:2", (1, 2, 1, 1))]


def _gloo_case(rank):
    out = []
    for layers, schedule, counts in GLOO_CASES:
        comm = TorchComm("stage:2")
        model, outs = _outputs(layers)
        plan = md.compile(outs, "stage:2", "layer:stage", microbatches=2, schedule=schedule, stage_layers=counts)
        agree_plan(comm, plan)
        ex = md.Executor(plan, for_plan(comm, plan))
        res = ex.run(model.feeds(0))
        full = {k: ex.to_full_held(plan.outputs[k], xs) for k, xs in res.items()}
        out.append({k: v for k, v in full.items() if v is not None})
    return out


@pytest.mark.timeout(120)
def test_unequal_stages_on_two_gloo_processes():
    results = launch.spawn(_gloo_case, 2, timeout=100)
    assert multiprocessing.active_children() == []
    for c, (layers, schedule, counts) in enumerate(GLOO_CASES):
        model, outs = _outputs(layers)
        want = md.run_dense(outs, model.feeds(0))
        got = {}
        for r in results:
            got.update(r[c])
        _assert_matches(got, want, f"gloo {schedule} {counts}")
