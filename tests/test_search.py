"""Layout search: predicted bytes are the executor's, limits hold, candidates are valid, the search is fast.

The cost model's communication figure is the plan's own ``totals()``; here it is
pinned to what the simulated mesh's communicator actually moves, for every
layout family.  Every candidate the search ranks is compiled and checked
against the dense program (hypothesis picks them), and the ranking respects
``--memory-limit``.  Calibrations are read from a per-test cache folder, so
these tests price with the uncalibrated defaults and never touch the user's cache.
"""
from __future__ import annotations

import re
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import meshdsl as md
from conftest import time_limit
from meshdsl.runtime.executor import Executor
from meshdsl.comm.simulated import SimulatedComm
from meshdsl.lowering.compiler import compile as compile_plan
from meshdsl.search.calibrate import Calibration
from meshdsl.search.predict import predict, process_axes, process_totals
from meshdsl.search.search import search
from meshdsl.search.space import candidates, factorizations
from meshdsl.tools.cli import main

# (model, AdamW?, mesh, layout, microbatches): one per layout family.
FAMILIES = {
    "DP": ("transformer", False, "data:2", "batch:data", 1),
    "TP": ("transformer", False, "model:2", "heads:model; d_ff:model", 1),
    "DP+TP": ("transformer", False, "data:2; model:2", "batch:data; heads:model; d_ff:model", 1),
    "FSDP": ("transformer", True, "data:2", "batch:data; params.d_model:data", 1),
    "ZeRO-1": ("transformer", True, "data:2", "batch:data; opt.d_model:data", 1),
    "ZeRO-2": ("transformer", True, "data:2", "batch:data; opt.d_model:data; grads.d_model:data", 1),
    "pipeline": ("transformer", False, "pipe:2", "layer:pipe", 2),
    "DP+pipeline": ("transformer", False, "pipe:2; data:2", "batch:data; layer:pipe", 2),
    "MoE EP": ("moe", False, "data:2", "batch:data; experts:data", 1),
    "MLP TP": ("mlp", False, "model:2", "d_ff:model", 1),
    "DP+accumulation": ("mlp", False, "data:2", "batch:data", 2),
}


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHDSL_CACHE_DIR", str(tmp_path))


def _outputs(model, adamw: bool):
    if not adamw:
        return model.train_step(0.01)
    from meshdsl.train.step import optimizer_outputs
    return optimizer_outputs(model.loss, model.params, md.AdamW(lr=1e-2), False)


@pytest.mark.parametrize("family", FAMILIES)
def test_predicted_collective_bytes_are_what_the_executor_moves(family):
    name, adamw, mesh, layout, m = FAMILIES[family]
    model = md.load_model(name, tiny=True)
    outs = _outputs(model, adamw)
    plan = compile_plan(outs, mesh, layout, microbatches=m)
    comm = SimulatedComm(plan.mesh)
    ex = Executor(plan, comm)
    feeds = model.feeds(0)
    if adamw:
        feeds.update(md.AdamW(lr=1e-2).feeds(0))
    ex.run(feeds, ex.init_params(0))
    moved: dict[str, int] = {}
    for kind, axes, nbytes in comm.log:
        if process_axes(axes):  # a micro-batch-only sum is a local add on real processes
            moved[kind] = moved.get(kind, 0) + nbytes
    pred = predict(plan, Calibration.defaults())
    predicted = {k: t["bytes"] for k, t in process_totals(plan).items()}
    assert moved, "the layout communicates"
    assert predicted == moved
    assert pred.comm_bytes == sum(moved.values())


def test_factorizations_cover_every_ordered_split():
    assert factorizations(8, 2) == [(2, 4), (4, 2)]
    assert factorizations(8, 3) == [(2, 2, 2)]
    assert factorizations(7, 2) == []


def test_memory_limit_is_respected():
    model = md.load_model("mlp")
    free = search(model, model.train_step(0.01), 4, Calibration.defaults())
    mems = sorted(r.prediction.memory_bytes for r in free.ranked)
    limit = mems[len(mems) // 2]
    capped = search(model, model.train_step(0.01), 4, Calibration.defaults(), memory_limit=limit)
    assert capped.ranked and capped.infeasible
    assert all(r.prediction.memory_bytes <= limit for r in capped.ranked)
    assert all(r.prediction.memory_bytes > limit for r in capped.infeasible)
    assert len(capped.ranked) + len(capped.infeasible) == len(free.ranked)


def test_nothing_fits_is_a_clean_usage_error(capsys):
    assert main(["search", "mlp", "--tiny", "--nproc", "2", "--memory-limit", "1e-9"]) == 2
    err = capsys.readouterr().err
    assert "no layout is valid and fits" in err and "--memory-limit" in err and "Traceback" not in err


_SEARCHED: dict = {}


def _ranked(name: str, nproc: int):
    key = (name, nproc)
    if key not in _SEARCHED:
        model = md.load_model(name, tiny=True)
        _SEARCHED[key] = search(model, model.train_step(0.01), nproc, Calibration.defaults()).ranked
    return _SEARCHED[key]


# With -m slow: test_layout_auto_in_check_prints_the_choice checks the search's first choice against
# dense, the held-out rounds' test_the_searchs_top_layouts_match_dense its three best, and
# test_microbatch_lowering.py compiles the candidates of the shipped models' spaces.
@pytest.mark.slow
@settings(derandomize=True, deadline=None, max_examples=8, suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from(["mlp", "transformer", "moe"]), nproc=st.sampled_from([2, 4]), pick=st.integers(0, 10**6))
def test_every_ranked_candidate_compiles_and_checks(name, nproc, pick, capsys):
    ranked = _ranked(name, nproc)
    assert ranked
    c = ranked[pick % len(ranked)].candidate
    argv = ["check", name, "--tiny", "--mesh", c.mesh, "--layout", c.layout]
    if c.pipelined:
        argv += ["--microbatches", str(c.microbatches), "--schedule", c.schedule]
    assert main(argv) == 0, capsys.readouterr()


def test_every_enumerated_candidate_is_a_valid_string_pair():
    model = md.load_model("transformer", tiny=True)
    for c in candidates(model, 4, stateful=True):
        md.Mesh.parse(c.mesh)
        assert md.Mesh.parse(c.mesh).size == 4
        assert c.layout.count(":") == len([r for r in c.layout.split("; ") if r])


def test_a_space_of_over_a_thousand_candidates_is_searched_in_under_ten_seconds():
    model = md.load_model("transformer", tiny=True)
    # Timed in this process's CPU seconds, which other processes on the machine do not inflate
    # as they do the wall time (the search runs in this process, on one thread).
    t0 = time.process_time()
    r = search(model, _outputs(model, True), 64, Calibration.defaults())  # AdamW: ZeRO options too
    took = time.process_time() - t0
    assert r.num_candidates >= 1000 and r.ranked
    assert took < time_limit(10.0), f"{r.num_candidates} candidates took {took:.1f} s of CPU"


@pytest.mark.slow  # a timed scale check: the 64-process search above runs in the default suite
def test_64_processes_24_layers_plan_in_under_a_minute(capsys):
    t0 = time.perf_counter()
    assert main(["search", "transformer", "--nproc", "64", "--config", "layers=24", "--top", "3"]) == 0
    assert time.perf_counter() - t0 < time_limit(60.0)
    out = capsys.readouterr().out
    assert "best: --mesh" in out and "predicted ms" in out


def test_json_keys_are_the_issues(capsys):
    import json

    assert main(["search", "transformer", "--tiny", "--nproc", "2", "--json", "--top", "50"]) == 0
    rows = json.loads(capsys.readouterr().out)
    base = {"mesh", "layout", "predicted_ms", "predicted_memory_bytes", "comm_bytes"}
    assert rows and any("layer:" in r["layout"] for r in rows)
    for r in rows:  # the micro-batch flags come along exactly when run needs them
        extra = set(r) - base
        assert base <= set(r) and extra in (set(), {"microbatches", "schedule"})
        assert bool(extra) == ("layer:" in r["layout"] or r.get("microbatches", 1) > 1)
    assert [r["predicted_ms"] for r in rows] == sorted(r["predicted_ms"] for r in rows)
    model = md.load_model("transformer", tiny=True)
    for r in rows:  # strings run accepts as they are: they compile
        compile_plan(model.train_step(0.01), r["mesh"], r["layout"], microbatches=r.get("microbatches", 1))


def test_pipeline_prediction_has_the_schedules_bubble():
    model = md.load_model("transformer", tiny=True)
    plan = compile_plan(model.train_step(0.01), "pipe:2", "layer:pipe", microbatches=2)
    p = predict(plan, Calibration.defaults())
    assert p.bubble_s > 0
    dense = predict(compile_plan(model.train_step(0.01), "data:1", ""), Calibration.defaults())
    assert dense.bubble_s == 0 and dense.comm_bytes == 0 and dense.exposed_comm_s == 0


def test_overlap_hides_async_communication():
    # An async allreduce holds the link while later kernels run: exposed <= total communication.
    model = md.load_model("transformer", tiny=True)
    p = predict(compile_plan(model.train_step(0.01), "data:2", "batch:data"), Calibration.defaults())
    assert 0 <= p.exposed_comm_s <= p.comm_s
    assert p.step_s <= p.compute_s + p.comm_s + 1e-12


@pytest.mark.parametrize("argv, words", [
    (["check", "mlp", "--tiny", "--mesh", "auto", "--layout", "batch:data"], "--mesh auto needs --layout auto"),
    (["check", "mlp", "--tiny", "--mesh", "x:2; y:1", "--layout", "auto"], "no layout found for mesh 'x:2; y:1'"),
    (["search", "mlp", "--tiny", "--nproc", "2", "--config", "nope=1"], "nope"),
    (["search", "mlp", "--tiny", "--nproc", "2", "--measure", "--plot", "/no/such/folder/x.png"],
     "cannot write the scatter plot"),
])
def test_cli_errors_are_clean(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


@pytest.mark.parametrize("argv, words", [
    (["search", "mlp", "--tiny"], "--nproc"),
    (["search", "mlp", "--tiny", "--nproc", "0"], "out of range"),
    (["search", "mlp", "--tiny", "--nproc", "2", "--memory-limit", "-1"], "out of range"),
])
def test_cli_flag_errors_exit_2(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert words in capsys.readouterr().err


def test_layout_auto_in_check_prints_the_choice(capsys):
    assert main(["check", "mlp", "--tiny", "--mesh", "auto", "--layout", "auto"]) == 0
    out = capsys.readouterr().out
    assert "--layout auto: mesh '" in out and "OK" in out


def test_micro_batches_are_priced_as_one_process_runs_them():
    # A process runs its micro-batches one after another: accumulation costs at least the
    # whole-batch step, and a pipeline's cost does not grow with m as if every micro-batch
    # were another process sharing the cores.
    model = md.load_model("transformer", tiny=True)
    outs = model.train_step(0.01)
    cal = Calibration.defaults()

    def step_s(mesh, layout, m):
        return predict(compile_plan(outs, mesh, layout, microbatches=m, schedule="gpipe"), cal).step_s

    one, acc = step_s("model:2", "heads:model; d_ff:model", 1), step_s("model:2", "heads:model; d_ff:model", 4)
    assert acc >= one
    outs = md.load_model("transformer").train_step(0.01)  # batch 16: room for 8 micro-batches
    p2, p8 = step_s("pipe:2", "layer:pipe", 2), step_s("pipe:2", "layer:pipe", 8)
    assert p8 < 1.5 * p2


def _with_cores(cores: int) -> Calibration:
    cal = Calibration.defaults()
    cal.cores = cores
    return cal


def test_without_a_spare_core_communication_is_not_hidden():
    """gloo moves and reduces bytes on the CPU, in a thread of the process: with a spare core
    per process a collective in flight overlaps the kernels after it; with one core per
    process (or fewer) it cannot."""
    model = md.load_model("transformer", tiny=True)
    plan = compile_plan(model.train_step(0.01), "data:4", "batch:data")
    roomy, exact, crowded = (predict(plan, _with_cores(c)) for c in (8, 4, 2))
    assert roomy.exposed_comm_s < roomy.comm_s
    assert exact.exposed_comm_s == pytest.approx(exact.comm_s)
    assert crowded.exposed_comm_s == pytest.approx(crowded.comm_s)
    assert exact.compute_s == pytest.approx(roomy.compute_s)
    assert crowded.compute_s == pytest.approx(2 * exact.compute_s)   # two processes per core


def test_the_executors_cost_per_step_shares_the_cores_like_its_kernels():
    """The executor's own work per step (a measured calibration's ``dispatch_s``, timed in one
    process alone) runs on the process's core too: two processes per core slow it as they
    slow the kernels."""
    model = md.load_model("transformer", tiny=True)
    plan = compile_plan(model.train_step(0.01), "data:4", "batch:data")
    exact, crowded = _with_cores(4), _with_cores(2)
    for cal in (exact, crowded):
        cal.dispatch_s = 1e-3   # far over the kernels: a missed slowdown shows
    assert predict(plan, crowded).compute_s == pytest.approx(2 * predict(plan, exact).compute_s)


def test_the_first_collective_after_compute_pays_the_measured_drift():
    """Ranks come to a collective from compute apart: the calibration's after-compute cost is
    added once per run of collectives that follows local compute, never to one that follows
    another collective, and only where it was measured for the job and group size."""
    model = md.load_model("transformer", tiny=True)
    base = _with_cores(8)
    drift = _with_cores(8)
    drift.after_compute_s = {2: {2: 1e-3}}

    def grew(plan):
        extra = predict(plan, drift).comm_s - predict(plan, base).comm_s
        assert extra == pytest.approx(round(extra / 1e-3) * 1e-3)   # whole multiples of the drift
        return round(extra / 1e-3), sum(m for s, m in plan.collectives())

    # Megatron: every allreduce follows the kernels that made its partial sums
    paid, count = grew(compile_plan(model.train_step(0.01), "model:2", "heads:model; d_ff:model"))
    assert paid == count > 0
    # FSDP: the param gathers run back to back, and pay once per run
    plan = compile_plan(model.train_step(0.01), "data:2", "batch:data; params.d_model:data")
    paid, count = grew(plan)
    assert 1 <= paid < count
    plan = compile_plan(model.train_step(0.01), "model:2", "heads:model; d_ff:model")
    other = _with_cores(8)
    other.after_compute_s = {2: {4: 1e-3}}                     # measured for groups of 4 only
    assert predict(plan, other).comm_s == pytest.approx(predict(plan, base).comm_s)


def test_an_oversubscribed_pipeline_is_slowed_by_its_work_not_its_process_count():
    """A stage in its bubble leaves its core to the others: on 2 cores, 4 stages with a
    60% bubble (m=2) are slowed far less than 2x, and never below their busy time over the cores."""
    model = md.load_model("transformer", tiny=True, layers=4)
    plan = compile_plan(model.train_step(0.01), "pipe:4", "layer:pipe", microbatches=2)
    roomy, crowded = predict(plan, _with_cores(4)), predict(plan, _with_cores(2))
    assert roomy.step_s < crowded.step_s < 1.5 * roomy.step_s
    single = predict(plan, _with_cores(1))   # one core: every stage's busy time, one after another
    assert single.step_s > crowded.step_s


def test_a_pipelines_actions_are_priced_at_the_pipeline_runtimes_cost_per_step():
    model = md.load_model("transformer", tiny=True)
    piped = compile_plan(model.train_step(0.01), "pipe:2", "layer:pipe", microbatches=2)
    flat = compile_plan(model.train_step(0.01), "data:2", "batch:data")
    base = _with_cores(4)
    slow = _with_cores(4)
    slow.pipeline_dispatch_s = base.dispatch_s + 1e-3
    assert predict(flat, slow).step_s == predict(flat, base).step_s
    calls = predict(piped, base).kernel_calls
    assert calls > 0
    grew = predict(piped, slow).compute_s - predict(piped, base).compute_s
    # every forward and backward step of every stage and micro-batch pays 1 ms more
    assert 0 < grew <= calls * 1e-3 + 1e-9


def test_a_pipeline_prediction_splits_a_sending_backward_as_the_runtime_does(monkeypatch):
    """Stage 1 sends each input gradient before its loop's weight-gradient matmuls (a W):
    the prediction counts those matmuls (the same compute) but stage 0 waits less for
    each gradient, so the step is shorter than with whole B's."""
    import meshdsl.search.predict as pr

    model = md.load_model("transformer", tiny=True)
    plan = compile_plan(model.train_step(0.01), "pipe:2", "layer:pipe", microbatches=4, schedule="1f1b")
    cal = _with_cores(4)
    split = predict(plan, cal)
    pipe = next(s for s in plan.steps if s.kind == "pipeline")
    assert len(pr._put_off(pipe)) == 6    # per layer: wq wk wv wo w_fc w_proj's gradients
    monkeypatch.setattr(pr, "_put_off", lambda step: frozenset())
    whole = predict(plan, cal)
    assert split.compute_s == pytest.approx(whole.compute_s)
    assert split.step_s < whole.step_s


def test_the_search_offers_zbh1_and_prices_it_from_its_own_schedule():
    """A pipe axis gets ZB-H1 beside GPipe and 1F1B, at every micro-batch count the batch
    allows; priced with the same stage costs, its bubble is below 1F1B's (its Ws fill the
    cooldown) and it computes the same work."""
    model = md.load_model("transformer", tiny=True)
    piped = [c for c in candidates(model, 2) if c.pipelined and "layer:" in c.layout]
    by_sched = {}
    for c in piped:
        by_sched.setdefault(c.schedule, set()).add(c.microbatches)
    assert set(by_sched) == {"gpipe", "1f1b", "zbh1"}
    assert by_sched["zbh1"] == by_sched["1f1b"] and by_sched["zbh1"]
    cal = _with_cores(4)
    pred = {s: predict(compile_plan(model.train_step(0.01), "pipe:2", "layer:pipe", microbatches=4, schedule=s), cal)
            for s in ("1f1b", "zbh1")}
    assert pred["zbh1"].compute_s == pytest.approx(pred["1f1b"].compute_s)
    assert pred["zbh1"].bubble_s < pred["1f1b"].bubble_s
    assert pred["zbh1"].step_s < pred["1f1b"].step_s


def test_a_plan_with_its_schedule_swapped_is_the_plan_compiled_for_it():
    """with_schedule gives the plan a compilation for that schedule gives: the same schedule
    and the same prediction (time, bubble, memory, bytes)."""
    from meshdsl.lowering.partition import with_schedule

    model = md.load_model("transformer", tiny=True)
    cal = _with_cores(2)
    base = compile_plan(model.train_step(0.01), "pipe:2", "layer:pipe", microbatches=4, schedule="gpipe")
    for sched in ("1f1b", "zbh1", "gpipe"):
        swapped = with_schedule(base, sched)
        fresh = compile_plan(model.train_step(0.01), "pipe:2", "layer:pipe", microbatches=4, schedule=sched)
        (a,), (b,) = ([s.args["program"].schedule for s in p.steps if s.kind == "pipeline"] for p in (swapped, fresh))
        assert a.name == b.name == sched and a.actions == b.actions
        pa, pb = predict(swapped, cal), predict(fresh, cal)
        assert (pa.step_s, pa.bubble_s, pa.memory_bytes, pa.comm_bytes) == \
               (pb.step_s, pb.bubble_s, pb.memory_bytes, pb.comm_bytes)
    flat = compile_plan(model.train_step(0.01), "data:2", "batch:data")
    assert with_schedule(flat, "1f1b") == flat
    # virtual stages: a plan cut into 2 chunks per rank swaps between the schedules that run 2
    deep = md.load_model("transformer", tiny=True, layers=4, batch=8)
    chunked = compile_plan(deep.train_step(0.01), "pipe:2", "layer:pipe", microbatches=4, schedule="interleaved:2")
    swapped = with_schedule(chunked, "interleaved-zb:2")
    fresh = compile_plan(deep.train_step(0.01), "pipe:2", "layer:pipe", microbatches=4, schedule="interleaved-zb:2")
    pa, pb = predict(swapped, cal), predict(fresh, cal)
    assert (pa.step_s, pa.bubble_s, pa.memory_bytes, pa.comm_bytes) == (pb.step_s, pb.bubble_s, pb.memory_bytes,
                                                                         pb.comm_bytes)
    for other in ("1f1b", "interleaved:3"):
        with pytest.raises(ValueError, match="compile for it"):
            with_schedule(chunked, other)


def test_the_search_offers_interleaved_zb_and_prices_it_from_its_simulated_schedule(monkeypatch):
    """Where each rank's layers cut in two and the micro-batches come in groups of the pipe axis,
    the pipe axis also gets interleaved:2 and interleaved-zb:2.  The search prices
    interleaved-zb from its own schedule, the Ws placed by simulation (lowering/w_placement.py):
    its bubble is the makespan of that schedule at the stages' costs less the busiest rank's
    busy time, and its memory peak the plan's."""
    from meshdsl.lowering.pipeline_program import PipelineProgram
    from meshdsl.lowering.schedule_gen import interleaved_zero_bubble

    model = md.load_model("transformer", tiny=True, layers=4, batch=8)
    piped = [c for c in candidates(model, 2) if c.staged]
    by_sched = {}
    for c in piped:
        by_sched.setdefault(c.schedule, set()).add(c.microbatches)
    assert set(by_sched) == {"gpipe", "1f1b", "zbh1", "interleaved:2", "interleaved-zb:2"}
    assert by_sched["interleaved-zb:2"] == by_sched["interleaved:2"] == {2, 4, 8}
    assert by_sched["zbh1"] == {2, 4, 8}
    # 2 layers: one per rank, no chunks to interleave
    assert {c.schedule for c in candidates(md.load_model("transformer", tiny=True), 2) if c.staged} == \
           {"gpipe", "1f1b", "zbh1"}

    seen = []
    real = PipelineProgram.simulate

    def recording(self, cost=None, defer=False):
        stats = real(self, cost, defer)
        seen.append((self.run_schedule(defer), stats))
        return stats
    monkeypatch.setattr(PipelineProgram, "simulate", recording)
    result = search(model, _outputs(model, False), 2, _with_cores(4))
    ranked = {(r.candidate.schedule, r.candidate.microbatches): r for r in result.ranked if r.candidate.staged}
    assert {s for s, _ in ranked} == {"gpipe", "1f1b", "zbh1", "interleaved:2", "interleaved-zb:2"}
    zb, plain = ranked[("interleaved-zb:2", 4)], ranked[("interleaved:2", 4)]
    sims = [(sched, stats) for sched, stats in seen if sched.name == "interleaved-zb" and sched.num_microbatches == 4]
    assert sims, "the interleaved-zb candidate was priced from its schedule"
    sched, stats = sims[-1]
    def compute(s):
        return [[(a.kind, a.microbatch, a.stage) for a in row if a.kind in ("F", "B", "W")] for row in s.actions]
    assert compute(sched) == compute(interleaved_zero_bubble(2, 4, 2))   # w_placement.py's orders, Ws included
    busy = max(float(r.busy) for r in stats.ranks)
    assert zb.prediction.bubble_s == pytest.approx(float(stats.makespan) - busy, rel=1e-12)
    # the same work as plain interleaved, at the same memory (no rank holds more than its peak)
    assert zb.prediction.compute_s == pytest.approx(plain.prediction.compute_s)
    assert zb.prediction.memory["activations_peak"] <= plain.prediction.memory["activations_peak"]


def test_cli_search_explain_shows_each_schedule(capsys):
    assert main(["search", "transformer", "--tiny", "--config", "layers=4,batch=8", "--nproc", "2", "--explain",
                 "--top", "3"]) == 0
    out = capsys.readouterr().out
    rows = {m.group(1): m for m in re.finditer(r"^ {6}(\S+) +#(\d+) 'pipe:2' 'layer:pipe' m=(\d+): ([\d.]+) ms, "
                                              r"bubble ([\d.]+) ms, activations ([\d.]+) KiB$", out, re.M)}
    assert set(rows) == {"gpipe", "1f1b", "zbh1", "interleaved:2", "interleaved-zb:2"}, out


def test_the_search_ranks_as_if_every_candidate_were_compiled(monkeypatch):
    """Re-pricing a compiled pipeline under another schedule changes no prediction: the
    ranking equals the one with every candidate compiled afresh."""
    import meshdsl.search.search as search_mod
    from meshdsl.errors import MeshDSLError

    model = md.load_model("transformer", tiny=True)
    outs, cal = _outputs(model, False), _with_cores(2)
    cached = search(model, outs, 2, cal)

    def refuse(plan, schedule):
        raise MeshDSLError("compile it")
    monkeypatch.setattr(search_mod, "with_schedule", refuse)
    fresh = search(model, outs, 2, cal)
    assert any(r.candidate.schedule == "zbh1" for r in cached.ranked)
    assert [(r.candidate, r.prediction.step_s) for r in cached.ranked] == \
           [(r.candidate, r.prediction.step_s) for r in fresh.ranked]


@pytest.mark.parametrize("cores", [1, 2, 8])
def test_the_terms_of_a_prediction_add_up_to_its_step_time(cores):
    """compute on the critical path + exposed communication + bubble + waiting for a core =
    the step: a pipeline's kernels summed over its stages exceed its step time and are no term."""
    model = md.load_model("transformer", tiny=True)
    cal = _with_cores(cores)
    cases = [("pipe:2", "layer:pipe", 2, "gpipe"), ("pipe:2", "layer:pipe", 4, "1f1b"),
             ("pipe:2", "layer:pipe", 4, "zbh1"), ("pipe:2; data:2", "layer:pipe; batch:data", 2, "1f1b"),
             ("pipe:2; model:2", "layer:pipe; heads:model; d_ff:model", 2, "zbh1"),
             ("data:2; model:2", "batch:data; heads:model; d_ff:model", 1, "gpipe"), ("data:2", "batch:data", 2, "gpipe")]
    for mesh, layout, m, sched in cases:
        p = predict(compile_plan(model.train_step(0.01), mesh, layout, microbatches=m, schedule=sched), cal)
        terms = dict(p.terms())
        assert sum(terms.values()) == pytest.approx(p.step_s, rel=1e-12), (mesh, m, sched, terms)
        assert all(t >= 0 for t in terms.values()) and terms["exposed communication"] <= p.comm_s + 1e-12
        assert p.path_compute_s <= p.compute_s + 1e-12
        if "pipe" in mesh:
            assert p.compute_s > p.path_compute_s   # the other stage's kernels run beside the path
        waits = terms["stages waiting for a core"]
        if cores == 8 or "pipe" not in mesh:   # a core per process, or no stages to share them
            assert waits == 0
        elif cores == 1:                       # two stages' work on one core: longer than the makespan
            assert waits > 0


def test_explain_prints_pipeline_terms_that_add_up_to_the_prediction(capsys, monkeypatch):
    """The issue's line read '27.44 ms = 42.22 ms compute, 0.00 ms exposed communication, 14.70 ms
    pipeline bubble': the compute was every stage's.  Now a pipelined winner's printed terms add
    up to its printed time (each rounded to 0.01 ms: the sum may be off by half that per term)."""
    import meshdsl.tools.search_cli as search_cli

    real = search_cli.search

    def piped_first(*args, **kw):   # put a pipelined candidate first, as a search on a pipeline-friendly model would
        r = real(*args, **kw)
        r.ranked.sort(key=lambda x: (not x.candidate.staged, x.prediction.step_s))
        return r
    monkeypatch.setattr(search_cli, "search", piped_first)
    assert main(["search", "transformer", "--tiny", "--nproc", "2", "--explain", "--top", "3"]) == 0
    out = capsys.readouterr().out
    for who in ("winner", "runner-up"):
        line = next(l for l in out.splitlines() if l.startswith(who))
        total, rest = re.search(r": ([\d.]+) ms = ([^;]+);", line).groups()
        parts = re.findall(r"([\d.]+) ms ([a-z ]+?)(?: \+ |$)", rest)
        names = [n for _, n in parts]
        assert names[:3] == ["compute", "exposed communication", "pipeline bubble"], line
        assert float(total) == pytest.approx(sum(float(v) for v, _ in parts), abs=0.005 * len(parts) + 1e-9), line
    assert "the kernels of all stages sum to" in out


def test_a_search_defers_full_collections_and_puts_the_thresholds_back(monkeypatch):
    """Full collections walk every plan a search holds (a quarter of its time at Python's default
    of one per 10 young ones); the search defers them while it runs and restores the thresholds."""
    import gc

    from meshdsl.search import search as search_module
    during = []
    real = search_module.evaluate
    monkeypatch.setattr(search_module, "evaluate", lambda *a, **k: during.append(gc.get_threshold()) or real(*a, **k))
    model = md.load_model("mlp", tiny=True)
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)   # Python's default (the suite's conftest raises the last)
    try:
        search(model, model.train_step(0.01), 2, Calibration.defaults())
        after = gc.get_threshold()
    finally:
        gc.set_threshold(*saved)
    assert during and all(t == (700, 10, search_module.GC_FULL) for t in during)
    assert after == (700, 10, 10)


def test_the_search_command_defers_full_collections_and_puts_the_thresholds_back(monkeypatch):
    """``meshdsl search`` builds the model and prints its table under the search's deferred full
    collections too (they walked the model's graph as often); an error exit restores the thresholds."""
    import gc

    from meshdsl.search import search as search_module
    from meshdsl.tools import search_cli
    during = []
    real = search_cli.run_search
    monkeypatch.setattr(search_cli, "run_search", lambda *a, **k: during.append(gc.get_threshold()) or real(*a, **k))
    saved = gc.get_threshold()
    # a marker the command must put back (not Python's default 10: with the suite's heap, full
    # collections that often cost seconds)
    gc.set_threshold(700, 10, 997)
    try:
        code = main(["search", "mlp", "--tiny", "--nproc", "2", "--memory-limit", "1e-9"])   # nothing fits: exit 2
        after = gc.get_threshold()
    finally:
        gc.set_threshold(*saved)
    assert code == 2 and during == [(700, 10, search_module.GC_FULL)]
    assert after == (700, 10, 997)


def test_a_backward_block_lowered_twice_is_ordered_once(monkeypatch):
    """A search compiles many candidates; a repeat's backward block that is lowered both ways
    (a closed-over gate's gradient, partial over ``data``, passed on through the sigmoid) is
    ordered for memory (:mod:`meshdsl.lowering.block_order`) once, the lowering kept, not every
    try (a quarter of ``heldout_brt``'s block lowering time).  Its numbers stay the dense ones."""
    import torch

    from conftest import build_case, check_plan
    from meshdsl.lowering import repeat as repeat_module

    B, D, F, L = md.Dim("batch", 4), md.Dim("d_model", 4), md.Dim("d_ff", 6), md.Dim("layer", 3)

    def fn():
        x = md.input("x", [B, D])
        w1, w2, b = md.param("w1", [D, F]), md.param("w2", [F, D]), md.param("b", [D])

        def block(h, p):
            h = h * md.sigmoid(b)
            u = md.tanh(md.einsum("batch d_model, d_model d_ff -> batch d_ff", h, w1))
            return h + md.einsum("batch d_ff, d_ff d_model -> batch d_model", u, w2)
        return md.repeat(block, x, {}, L), {"x": torch.randn(4, 4)}

    case = build_case(fn)
    calls = {"ordered": 0, "backward lowerings": 0}
    order, once = repeat_module.order_block, repeat_module._lower_block_once

    def counted_order(*a, **k):
        calls["ordered"] += 1
        return order(*a, **k)

    def counted_once(lw, loop, *a, **k):
        calls["backward lowerings"] += loop.backward
        return once(lw, loop, *a, **k)
    monkeypatch.setattr(repeat_module, "order_block", counted_order)
    monkeypatch.setattr(repeat_module, "_lower_block_once", counted_once)
    check_plan(case, "data:2", "batch:data")
    assert calls == {"ordered": 1, "backward lowerings": 2}
